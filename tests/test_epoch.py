"""The epoch state machine alone: no threads, no processes (autominato.pipeline.epoch)."""

from __future__ import annotations

import random

import pytest

from autominato.pipeline.epoch import (
    Completed,
    Discard,
    Emit,
    End,
    Epoch,
    Failed,
    Lost,
    Raise,
    Skip,
)


class Boom(Exception):
    pass


def run_all(ep: Epoch, fail: set[int] = frozenset()) -> list:
    """Dispatch and complete everything in order; positions in ``fail`` raise."""
    out = ep.start()
    while not ep.finished:
        tasks = ep.take(4)
        assert tasks or ep.in_flight == 0
        for t in tasks:
            ev = Failed(t.pos, t.attempt, Boom(t.index)) if t.pos in fail else Completed(t.pos, t.attempt, t.index)
            out += ep.on(ev)
    return out


def batches(decisions: list) -> list[list[int]]:
    return [[i for _, i, _ in d.items] for d in decisions if isinstance(d, Emit)]


def test_completion_order_batches_are_full_except_the_last():
    out = run_all(Epoch(list(range(10)), batch_size=4))
    assert batches(out) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert isinstance(out[-1], End)


def test_empty_epoch_ends_at_once():
    assert Epoch([], batch_size=3).start() == [End()]


def test_drop_last_with_skips_delivers_no_short_batch():
    out = run_all(Epoch(list(range(8)), batch_size=4, drop_last=True, skip_errors=True), fail={1})
    assert batches(out) == [[0, 2, 3, 4]]
    assert sum(isinstance(d, Discard) for d in out) == 3  # 5, 6, 7: dropped, and freed
    assert [d.index for d in out if isinstance(d, Skip)] == [1]


def test_in_order_skip_shortens_only_the_last_batch():
    out = run_all(Epoch(list(range(9)), batch_size=3, in_order=True, skip_errors=True), fail={4})
    assert batches(out) == [[0, 1, 2], [3, 5, 6], [7, 8]]


def test_in_order_waits_for_the_straggler():
    ep = Epoch(list(range(4)), batch_size=2, in_order=True)
    t = ep.take(4)
    assert ep.on(Completed(t[1].pos, 0, "b")) == []
    out = ep.on(Completed(t[0].pos, 0, "a"))
    assert batches(out) == [[0, 1]]


def test_straggler_is_counted_when_it_joins_a_later_batch():
    ep = Epoch(list(range(4)), batch_size=2)
    t = ep.take(4)
    out = ep.on(Completed(1, 0, 1)) + ep.on(Completed(2, 0, 2)) + ep.on(Completed(3, 0, 3))
    out += ep.on(Completed(0, 0, 0))
    assert batches(out) == [[1, 2], [3, 0]]
    assert ep.stragglers == 1 and len(t) == 4


def test_raise_policy_raises_and_the_epoch_goes_on_without_the_failing_sample():
    """As from the DataLoader's iterator, a loop that catches the error gets the rest."""
    ep = Epoch(list(range(6)), batch_size=4)
    ep.take(6)
    out = ep.on(Completed(0, 0, "r0")) + ep.on(Failed(1, 0, Boom()))
    assert [type(d) for d in out] == [Raise] and not out[0].final
    for pos in (2, 3, 4, 5):
        out += ep.on(Completed(pos, 0, f"r{pos}"))
    assert [[r for _, _, r in d.items] for d in out if isinstance(d, Emit)] == [
        ["r0", "r2", "r3", "r4"], ["r5"]]
    assert isinstance(out[-1], End) and ep.ended and not ep.failed and ep.raised == 1


def test_in_order_raise_delivers_every_batch_before_the_failing_one_first():
    """In order, the DataLoader's fixed batches: the failing sample's batch is lost whole
    (its finished samples freed), the batches after it do not move."""
    ep = Epoch(list(range(12)), batch_size=4, in_order=True)
    ep.take(12)
    out = ep.on(Failed(6, 0, Boom()))  # fails before the samples ahead of it finish
    assert out == []
    for pos in (5, 4, 8, 3, 2, 1):
        out += ep.on(Completed(pos, 0, f"r{pos}"))
    assert [d.result for d in out] == ["r5", "r4"]  # batch 1's: lost with sample 6
    out = ep.on(Completed(0, 0, "r0"))
    assert batches(out) == [[0, 1, 2, 3]] and [type(d) for d in out] == [Emit, Raise]
    assert out[1].pos == 6 and out[1].lost == (4, 5, 6, 7)
    out += ep.on(Completed(7, 0, "r7"))
    assert isinstance(out[-1], Discard)
    for pos in (9, 10, 11):
        out += ep.on(Completed(pos, 0, f"r{pos}"))
    assert batches(out) == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert ep.ended and ep.raised == 1


def test_in_order_a_batchs_samples_not_dispatched_when_it_fails_are_never_loaded():
    """As the DataLoader, which stops fetching a batch at its first error."""
    ep = Epoch(list(range(8)), batch_size=4, in_order=True)
    (t0, t1) = ep.take(2)
    out = ep.on(Failed(1, 0, Boom()))
    assert out == []  # sample 0 may fail too: the DataLoader would raise its error
    assert [t.pos for t in ep.take(8)] == [4, 5, 6, 7]  # 2 and 3 are lost with the batch
    out += ep.on(Completed(0, 0, "r0"))  # its result is freed
    assert [type(d) for d in out] == [Discard, Raise] and out[1].lost == (0, 1, 2, 3)
    for pos in (4, 5, 6, 7):
        out += ep.on(Completed(pos, 0, f"r{pos}"))
    assert batches(out) == [[4, 5, 6, 7]] and ep.ended


def test_in_order_skipping_fills_a_batch_from_the_next_samples():
    ep = Epoch(list(range(6)), batch_size=2, in_order=True, skip_errors=True)
    ep.take(6)
    out = ep.on(Failed(1, 0, Boom()))
    for pos in (0, 2, 3, 4, 5):
        out += ep.on(Completed(pos, 0, f"r{pos}"))
    assert batches(out) == [[0, 2], [3, 4], [5]] and ep.skipped == 1


def test_in_order_drop_last_drops_the_short_remainder():
    # (the Loader's orders are cut to whole batches already: sampler.epoch_order)
    out = run_all(Epoch(list(range(7)), batch_size=3, in_order=True, drop_last=True))
    assert batches(out) == [[0, 1, 2], [3, 4, 5]] and isinstance(out[-1], End)


def test_in_order_the_error_raised_is_the_batchs_first_in_sampler_order():
    """As the DataLoader's fetch, which stops at a batch's first error: a later sample that
    failed first waits for the ones before it (the error raised does not depend on timing)."""
    ep = Epoch(list(range(8)), batch_size=4, in_order=True)
    ep.take(8)
    out = ep.on(Failed(2, 0, Boom("late one")))
    out += ep.on(Completed(0, 0, "r0"))
    assert not any(isinstance(d, Raise) for d in out)  # sample 1 may fail too
    out += ep.on(Failed(1, 0, Boom("first one")))
    (r,) = [d for d in out if isinstance(d, Raise)]
    assert (r.pos, str(r.error), r.lost) == (1, "first one", (0, 1, 2, 3))
    out = ep.on(Failed(3, 0, Boom("after it")))  # after the first failure: not raised
    for pos in (4, 5, 6, 7):
        out += ep.on(Completed(pos, 0, f"r{pos}"))
    assert batches(out) == [[4, 5, 6, 7]] and not any(isinstance(d, Raise) for d in out)
    assert ep.ended and ep.raised == 1


def test_in_order_a_sample_due_again_before_the_failing_one_is_still_loaded():
    ep = Epoch(list(range(4)), batch_size=4, in_order=True)
    ep.take(4)
    assert ep.on(Lost(0, 0, Boom("died"))) == []  # due again
    out = ep.on(Failed(2, 0, Boom("bad")))
    (t,) = ep.take(4)
    assert t.pos == 0 and not any(isinstance(d, Raise) for d in out)
    out += ep.on(Completed(1, 0, "r1")) + ep.on(Completed(t.pos, t.attempt, "r0"))
    assert [d.pos for d in out if isinstance(d, Raise)] == [2]


def test_in_order_an_epoch_whose_last_batch_failed_is_exhausted():
    """(else the next epoch's samples were never started while the failed batch's members in
    flight finished)"""
    ep = Epoch(list(range(8)), batch_size=4, in_order=True)
    ep.take(5)
    ep.on(Failed(4, 0, Boom()))  # positions 5-7 are never loaded
    assert ep.exhausted and ep.take(4) == []


def test_in_order_resumed_from_a_completion_order_state_fills_every_batch():
    """Delivered positions that are not whole batches (a completion-order checkpoint): the
    remaining samples fill full batches, as before fixed batches (not a short batch at each
    partly delivered one)."""
    done = [1, 5, 10, 11, 0, 2, 3, 4]
    out = run_all(Epoch(list(range(24)), batch_size=4, in_order=True, done=done))
    assert batches(out) == [[6, 7, 8, 9], [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
    out = run_all(Epoch(list(range(12)), batch_size=4, in_order=True, done=[1, 5]), fail={6})
    assert batches(out) == [[0, 2, 3, 4], [7, 8, 9, 10], [11]]
    assert [d.lost for d in out if isinstance(d, Raise)] == [(6,)]
    out = run_all(Epoch(list(range(12)), batch_size=4, in_order=True, done=[4, 5, 6, 7]),
                  fail={9})  # whole batches: fixed
    assert batches(out) == [[0, 1, 2, 3]]


def test_completion_order_raise_loses_the_failing_sample_alone():
    ep = Epoch(list(range(4)), batch_size=2)
    ep.take(4)
    out = ep.on(Failed(2, 0, Boom()))
    assert [type(d) for d in out] == [Raise] and out[0].lost == (2,)


def test_a_death_redispatches_until_max_tries_then_applies_the_policy():
    ep = Epoch([7], batch_size=1, skip_errors=True, max_tries=2)
    (t,) = ep.take(1)
    assert ep.on(Lost(t.pos, t.attempt, Boom())) == []
    (t2,) = ep.take(1)
    assert t2.attempt == t.attempt + 1
    assert ep.on(Lost(t.pos, t.attempt, Boom())) == []  # the old attempt's late death: ignored
    out = ep.on(Lost(t2.pos, t2.attempt, Boom()))
    assert [type(d) for d in out] == [Skip, End]


def test_a_sample_that_never_started_is_requeued_without_blame():
    ep = Epoch([0], batch_size=1, skip_errors=True, max_tries=1)
    (t,) = ep.take(1)
    assert ep.on(Lost(t.pos, t.attempt, Boom(), count=False)) == []
    (t2,) = ep.take(1)
    assert batches(ep.on(Completed(t2.pos, t2.attempt, "x"))) == [[0]]


def test_a_timeout_is_not_retried():
    ep = Epoch([0, 1], batch_size=2, skip_errors=True)
    ep.take(2)
    out = ep.on(Lost(0, 0, TimeoutError(), retry=False))
    assert isinstance(out[0], Skip)
    assert ep.take(1) == []
    # The abandoned thread's result arrives after all: never delivered, but freed.
    assert ep.on(Completed(0, 0, "late")) == [Discard("late")]
    assert batches(ep.on(Completed(1, 0, "x"))) == [[1]]


def test_batch_sampler_groups_are_the_batches_first_complete_first():
    ep = Epoch(list(range(7)), batch_size=1, groups=[3, 0, 2, 2])
    tasks = ep.take(7)
    out = ep.start()
    for t in reversed(tasks):  # the last group completes first
        out += ep.on(Completed(t.pos, t.attempt, t.index))
    # (the empty group, a batch sampler's [], is complete at once: an empty batch first)
    assert batches(out) == [[], [5, 6], [3, 4], [0, 1, 2]] and isinstance(out[-1], End)


@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("skip_errors", [False, True])
def test_an_empty_group_is_an_empty_batch_at_its_turn(in_order, skip_errors):
    # Trial: a batch sampler's [] was skipped (len(loader) batches did not come); the
    # DataLoader calls collate_fn([]) for it. In order at its turn, else at once; a group
    # whose samples were all skipped is no batch (no sample to deliver).
    ep = Epoch(list(range(5)), batch_size=1, groups=[0, 2, 0, 0, 1, 2, 0], in_order=in_order,
               skip_errors=skip_errors)
    out = run_all(ep, fail={2} if skip_errors else set())
    got = batches(out)
    if in_order:
        assert got == [[], [0, 1], [], []] + ([] if skip_errors else [[2]]) + [[3, 4], []]
    else:
        assert got[:4] == [[], [], [], []]
        assert sorted(map(tuple, got[4:])) == [(0, 1)] + ([] if skip_errors else [(2,)]) + [(3, 4)]
    assert isinstance(out[-1], End) and ep.batches == len(got)
    # an epoch of empty groups only: its empty batches, then its end
    assert batches(Epoch([], batch_size=1, groups=[0, 0], in_order=in_order).start()) == [[], []]


def test_batch_sampler_groups_in_order_and_a_skip_shortens_its_group():
    ep = Epoch(list(range(6)), batch_size=1, groups=[2, 2, 2], in_order=True, skip_errors=True)
    out = []
    for t in reversed(ep.take(6)):
        ev = Failed(t.pos, t.attempt, Boom()) if t.pos == 2 else Completed(t.pos, t.attempt, t.index)
        out += ep.on(ev)
    assert batches(out) == [[0, 1], [3], [4, 5]]


def test_batch_sampler_in_order_raise_comes_after_the_earlier_groups():
    ep = Epoch(list(range(6)), batch_size=1, groups=[2, 2, 2], in_order=True)
    tasks = ep.take(6)
    out = ep.on(Failed(tasks[3].pos, tasks[3].attempt, Boom()))
    assert not any(isinstance(d, Raise) for d in out)
    for t in (tasks[5], tasks[4], tasks[2], tasks[1], tasks[0]):
        out += ep.on(Completed(t.pos, t.attempt, t.index))
    kinds = [type(d).__name__ for d in out if isinstance(d, (Emit, Raise))]
    # the failing group's batch is lost (as the DataLoader's), the next one follows
    assert batches(out) == [[0, 1], [4, 5]] and kinds == ["Emit", "Raise", "Emit"]
    assert [d.result for d in out if isinstance(d, Discard)] == [2]
    assert ep.ended and ep.held == 0


def test_a_failed_groups_members_not_yet_loaded_are_not_loaded():
    """As the DataLoader, which stops fetching a batch at its first error."""
    ep = Epoch(list(range(8)), batch_size=1, groups=[4, 4])
    first = ep.take(2)
    assert [t.pos for t in first] == [0, 1]
    out = ep.on(Failed(0, 0, Boom()))
    assert [type(d) for d in out] == [Raise]
    assert [t.pos for t in ep.take(8)] == [4, 5, 6, 7]  # not 2 and 3
    out = ep.on(Completed(1, 0, "r1"))
    assert out == [Discard("r1")]
    for pos in (4, 5, 6, 7):
        out += ep.on(Completed(pos, 0, pos))
    assert batches(out) == [[4, 5, 6, 7]] and isinstance(out[-1], End) and ep.raised == 1


def test_a_failed_groups_member_whose_worker_dies_is_not_loaded_again():
    ep = Epoch(list(range(8)), batch_size=1, groups=[4, 4])
    ep.take(3)
    ep.on(Failed(0, 0, Boom()))
    assert ep.on(Lost(1, 0, Boom("died"))) == []
    assert [t.pos for t in ep.take(8)] == [4, 5, 6, 7]  # not 1 again
    out = ep.on(Completed(2, 0, "r2"))
    for pos in (4, 5, 6, 7):
        out += ep.on(Completed(pos, 0, pos))
    assert batches(out) == [[4, 5, 6, 7]] and isinstance(out[-1], End)


def test_batch_sampler_raise_loses_the_group_and_raises_its_first_error_once():
    ep = Epoch(list(range(6)), batch_size=1, groups=[3, 3])
    tasks = ep.take(6)
    out = ep.on(Completed(tasks[0].pos, 0, "a")) + ep.on(Failed(tasks[1].pos, 0, Boom("first")))
    out += ep.on(Failed(tasks[2].pos, 0, Boom("second")))
    for t in tasks[3:]:
        out += ep.on(Completed(t.pos, 0, t.index))
    assert [str(d.error) for d in out if isinstance(d, Raise)] == ["first"]
    assert [d.result for d in out if isinstance(d, Discard)] == ["a"]
    assert batches(out) == [[3, 4, 5]] and isinstance(out[-1], End)


def test_groups_must_cover_the_order():
    with pytest.raises(ValueError, match="groups"):
        Epoch(list(range(5)), batch_size=1, groups=[2, 2])


def test_a_sampler_may_repeat_an_index():
    out = run_all(Epoch([3, 3, 3], batch_size=2))
    assert batches(out) == [[3, 3], [3]]


def positions(decisions: list) -> list[list[int]]:
    return [[pos for pos, _, _ in d.items] for d in decisions if isinstance(d, Emit)]


@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(drop_last=True), dict(groups=[3, 0, 2, 3, 2])])
def test_a_resumed_epoch_delivers_the_batches_after_the_checkpoint(in_order, kw):
    order = [7, 3, 3, 9, 0, 1, 5, 2, 8, 4]
    whole = positions(run_all(Epoch(order, batch_size=3, in_order=in_order, **kw)))
    for k in range(len(whole) + 1):
        done = [p for b in whole[:k] for p in b]
        # (an empty batch, a batch sampler's [], is counted: Progress.empties)
        ep = Epoch(order, batch_size=3, in_order=in_order, done=done,
                   done_empty=sum(not b for b in whole[:k]), **kw)
        rest = run_all(ep)
        assert positions(rest) == whole[k:]
        assert isinstance(rest[-1], End)
        assert all(t.pos not in done for t in ep.take(99))  # nothing left to dispatch


def test_a_resumed_epoch_never_dispatches_a_done_position():
    ep = Epoch(list(range(6)), batch_size=2, done=[0, 2, 3, 3])
    assert [t.pos for t in ep.take(10)] == [1, 4, 5]


def test_done_positions_must_lie_in_the_epoch():
    with pytest.raises(ValueError, match="done position 4"):
        Epoch([0, 1, 2, 3], batch_size=2, done=[4])


def test_an_epoch_resumed_after_its_last_batch_ends_at_once():
    assert Epoch([0, 1, 2], batch_size=2, done=[0, 1, 2]).start() == [End()]


def test_slow_first_starts_the_slowest_of_the_window_after_the_first_batch():
    cost = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.9, 4: 0.1, 5: 0.5, 6: 2.0, 7: 0.1, 8: 0.1, 9: 0.1}
    ep = Epoch(list(range(10)), batch_size=2, cost=cost.__getitem__, lookahead=4)
    # The first batch in sampler order (a cold start's first batch is not held up); then the
    # slowest of the next 4 positions each time, the earliest of equals.
    assert [t.pos for t in ep.take(2)] == [0, 1]
    assert [t.pos for t in ep.take(1)] == [3]  # of 2, 3, 4, 5
    assert [t.pos for t in ep.take(1)] == [6]  # of 2, 4, 5, 6
    assert [t.pos for t in ep.take(3)] == [5, 2, 4]
    assert not ep.exhausted
    assert [t.pos for t in ep.take(9)] == [7, 8, 9]
    assert ep.exhausted
    out = []
    for pos in [0, 1, 3, 6, 5, 2, 4, 7, 8, 9]:
        out += ep.on(Completed(pos, 0, pos))
    assert sorted(i for b in batches(out) for i in b) == list(range(10))  # each once
    assert isinstance(out[-1], End)


@pytest.mark.parametrize("kwargs", [dict(in_order=True), dict(groups=[2, 2, 2, 2, 2]),
                                    dict(lookahead=1), dict(cost=None)])
def test_sampler_order_in_order_with_groups_or_without_costs(kwargs):
    cost = {i: float(i) for i in range(10)}  # later = slower: slow first would reverse them
    ep = Epoch(list(range(10)), batch_size=2, **{"cost": cost.__getitem__, "lookahead": 8,
                                                 **kwargs})
    assert [t.pos for t in ep.take(10)] == list(range(10))


def test_slow_first_steps_over_done_positions_and_hands_back_its_lookahead_in_order():
    cost = {i: float(i % 3) for i in range(8)}
    ep = Epoch(list(range(8)), batch_size=1, cost=cost.__getitem__, lookahead=4, done=[2, 5])
    assert [t.pos for t in ep.take(3)] == [0, 1, 4]  # 0 in order; the earliest of 1, 4 (slowest)
    ep.lookahead = 0  # (the window shrank to one sample: sampler order again)
    assert [t.pos for t in ep.take(9)] == [3, 6, 7]
    assert ep.exhausted


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_deliver_every_position_exactly_once(seed):
    """Thousands of random event orders: completions (also duplicates and late ones),
    failures, worker deaths, timeouts and window changes, against the invariants."""
    rng = random.Random(seed)
    for _trial in range(60):
        n = rng.randint(0, 40)
        B = rng.randint(1, 6)
        groups = None
        if rng.random() < 0.3:  # a batch sampler's batches (empty ones too)
            groups, left = [], n
            while left:
                groups.append(rng.randint(0, min(left, 2 * B)))
                left -= groups[-1]
        # A resumed epoch: some positions were delivered before a checkpoint (and some of the
        # empty groups' batches).
        done = rng.sample(range(n), rng.randint(0, n)) if rng.random() < 0.3 else ()
        done_empty = rng.randint(0, 3) if done and groups else 0
        ep = Epoch(
            [rng.randrange(max(n, 1)) for _ in range(n)], batch_size=B,
            drop_last=groups is None and rng.random() < 0.4, in_order=rng.random() < 0.4,
            skip_errors=rng.random() < 0.8, max_tries=rng.randint(1, 3), groups=groups,
            done=done, done_empty=done_empty,
        )
        if rng.random() < 0.5:  # slow first, with costs that may move while the epoch runs
            costs = {i: rng.choice([0.0, 0.01, 0.5, 2.0]) for i in range(max(n, 1))}
            ep.cost = lambda i, costs=costs, rng=rng: (costs[i] if rng.random() < 0.9
                                                       else rng.random())
            ep.lookahead = rng.randint(0, 10)
        _check_one_run(ep, rng)


def group_of_pos(ep: Epoch, pos: int) -> int:
    return next(g for g in range(len(ep.groups)) if pos < sum(ep.groups[:g + 1]))


def _check_one_run(ep: Epoch, rng: random.Random) -> None:
    n, B = ep.size, ep.batch_size
    made: list[str] = []  # every result produced by a "worker"
    freed: list[str] = []
    delivered: list[int] = []  # positions, in batch order
    skipped: list[int] = []
    sizes: list[int] = []
    raised: list = []  # errors raised (the epoch goes on after each)
    ended = False
    in_flight: list = []  # tasks a worker holds (may include superseded attempts)
    failures: set = set()  # positions whose current attempt failed for good
    window = rng.randint(1, 8)

    def apply(decisions: list) -> None:
        nonlocal ended
        for d in decisions:
            assert not (ended and isinstance(d, (Emit, Raise, Skip, End))), "a decision after End"
            if isinstance(d, Emit):
                sizes.append(len(d.items))
                for pos, index, result in d.items:
                    assert ep.order[pos] == index
                    delivered.append(pos)
                    freed.append(result)
            elif isinstance(d, Skip):
                skipped.append(d.pos)
            elif isinstance(d, Discard):
                freed.append(d.result)
            elif isinstance(d, Raise):
                raised.append(d.pos)
                assert not d.final and d.pos is not None
                if ep.in_order and ep.groups is None:  # after the batches before it
                    assert all(p < d.pos for p in delivered)
                if ep.groups is not None:  # its group's first failure in sampler order
                    g = group_of_pos(ep, d.pos)
                    assert not any(q < d.pos and group_of_pos(ep, q) == g for q in failures)
                    assert d.lost == tuple(range(sum(ep.groups[:g]), sum(ep.groups[:g + 1])))
                else:
                    assert d.lost == (d.pos,)
            elif isinstance(d, End):
                ended = True

    apply(ep.start())
    steps = 0
    while not ep.finished or in_flight:
        steps += 1
        assert steps < 10_000, "no progress"
        r = rng.random()
        if r < 0.1:
            window = rng.randint(1, 8)  # a knob change
        room = max(max(window, ep.min_window) - ep.held, ep.redo_due)  # the scheduler's window
        if not ep.finished and rng.random() < 0.5:
            in_flight += ep.take(max(0, room))
        if not in_flight:
            if ep.finished:
                break
            # Nothing in flight and no room: the epoch could never end (the scheduler's window
            # is max(pool_size, min_window), as here).
            assert not (room <= 0 and ep.in_flight == 0), f"stalled: window {window}, held {ep.held}"
            continue
        t = in_flight.pop(rng.randrange(len(in_flight)))
        r = rng.random()
        if r < 0.75:
            res = f"r{t.pos}.{t.attempt}.{len(made)}"
            made.append(res)
            apply(ep.on(Completed(t.pos, t.attempt, res)))
            if rng.random() < 0.05:  # a duplicate reply of the same attempt
                res = f"dup{len(made)}"
                made.append(res)
                apply(ep.on(Completed(t.pos, t.attempt, res)))
        elif r < 0.82:
            if ep.is_current(t.pos, t.attempt) and ep.deaths(t.pos) + 1 >= ep.max_tries:
                failures.add(t.pos)
            apply(ep.on(Lost(t.pos, t.attempt, Boom("died"))))
            if rng.random() < 0.3:  # the dead worker's death reported twice
                apply(ep.on(Lost(t.pos, t.attempt, Boom("died"))))
        elif r < 0.86:  # queued behind a dead worker's sample: back to the queue, blameless
            apply(ep.on(Lost(t.pos, t.attempt, Boom("died"), count=False)))
        elif r < 0.93:
            if ep.is_current(t.pos, t.attempt):
                failures.add(t.pos)
            apply(ep.on(Failed(t.pos, t.attempt, Boom("bad sample"))))
        else:
            if ep.is_current(t.pos, t.attempt):
                failures.add(t.pos)
            apply(ep.on(Lost(t.pos, t.attempt, TimeoutError(), retry=False)))
            if rng.random() < 0.5:  # the abandoned thread returns after all
                res = f"late{len(made)}"
                made.append(res)
                apply(ep.on(Completed(t.pos, t.attempt, res)))

    # Every result produced is freed exactly once (delivered in a batch or discarded).
    assert sorted(freed) == sorted(made)
    assert len(set(delivered)) == len(delivered), "a position delivered twice"
    assert not set(delivered) & set(skipped)
    prior = set(ep.done)
    assert not (set(delivered) | set(skipped)) & prior, "a position done before the run came again"
    assert ep.ended and ended and not ep.failed
    assert not (ep.skip_errors and raised)
    dropped = set(range(n)) - set(delivered) - set(skipped) - prior
    if ep.groups is not None:
        # Each batch is one whole group less its skipped positions, in sampler order within;
        # a group with an error is lost whole, and raises once.
        starts = [sum(ep.groups[:g]) for g in range(len(ep.groups))]
        lost = {g for g in range(len(ep.groups))
                if set(range(starts[g], starts[g] + ep.groups[g])) & dropped}
        assert len(raised) == len(lost) and {group_of_pos(ep, p) for p in raised} == lost
        for g in lost:
            assert set(range(starts[g], starts[g] + ep.groups[g])) - prior <= dropped
        dropped -= {p for g in lost for p in range(starts[g], starts[g] + ep.groups[g])}
        assert not dropped
        starts = [sum(ep.groups[:g]) for g in range(len(ep.groups))]
        group_of = {p: g for g in range(len(ep.groups)) for p in range(starts[g], starts[g] + ep.groups[g])}
        emitted, i = [], 0
        # The empty groups' batches: each once but the first done_empty, at once in
        # completion order, at their turn in order.
        empties = [g for g, k in enumerate(ep.groups) if k == 0]
        due = iter(empties[ep.done_empty:])
        for size in sizes:
            batch = delivered[i:i + size]
            i += size
            if not size:
                emitted.append(next(due))
                continue
            g = group_of[batch[0]]
            want = [p for p in range(starts[g], starts[g] + ep.groups[g])
                    if p not in skipped and p not in prior]
            assert batch == want
            emitted.append(g)
        assert len(set(emitted)) == len(emitted)
        assert next(due, None) is None, "an empty group's batch did not come"
        if ep.in_order:
            assert emitted == sorted(emitted)
        else:
            due_n = max(0, len(empties) - ep.done_empty)
            assert sizes[:due_n] == [0] * due_n  # (complete at once: first)
        return
    # Every position is final exactly once: delivered, skipped, raised, or (drop_last) dropped.
    assert len(raised) == len(set(raised)) == ep.raised and set(raised) <= dropped
    dropped -= set(raised)
    if ep.drop_last:
        assert len(dropped) < B
        assert all(s == B for s in sizes)
    else:
        assert not dropped
        assert all(s == B for s in sizes[:-1]) and (not sizes or 1 <= sizes[-1] <= B)
    if ep.in_order:
        assert delivered == sorted(delivered)
        if ep.drop_last:
            assert all(p > max(delivered, default=-1) for p in dropped)


def test_occurrences_count_each_index_in_position_order():
    from autominato.pipeline.epoch import occurrences

    assert occurrences([4, 1, 2]) is None and occurrences([]) is None and occurrences([7]) is None
    assert occurrences([5, 3, 5, 5, 3]).tolist() == [0, 0, 1, 2, 1]
    assert occurrences([-1, 2, -1]).tolist() == [0, 0, 1]  # a sampler's negative indices
    assert occurrences([10**12, 3, 10**12]).tolist() == [0, 0, 1]  # far apart: sorted, no bincount
    assert occurrences([10**12, 3]) is None
    assert Epoch([2, 2], batch_size=2, unique=True).draw(1) == 0  # the caller said so
    ep = Epoch([2, 2, 0, 2], batch_size=2)
    assert [(t.index, t.draw) for t in ep.take(4)] == [(2, 0), (2, 1), (0, 0), (2, 2)]


def test_slow_first_hands_out_no_position_more_than_about_two_windows_late():
    # Review 78: each choice took the costliest of a sliding window, so the cheap positions
    # piled up and came only at the epoch's end (a loop that stops early got few of them).
    n, L = 200, 4
    ep = Epoch(list(range(n)), batch_size=1, cost=float, lookahead=L)  # later = costlier
    taken = [t.pos for t in ep.take(n)]
    assert sorted(taken) == list(range(n))
    late = max(rank - pos for rank, pos in enumerate(taken))
    assert late <= 2 * L + 1, late
    assert taken[:2] != [0, 1] or taken[1:3] != [1, 2]  # (slow first did reorder them)


def test_slow_first_counts_stragglers_by_the_order_taken_not_by_position():
    # Review 78: "finished after a later-dispatched sample"; positions taken out of order and
    # completed in that order are no stragglers.
    ep = Epoch(list(range(12)), batch_size=2, cost=float, lookahead=6)
    out = []
    for t in ep.take(12):
        out += ep.on(Completed(t.pos, t.attempt, t.pos))
    assert len(batches(out)) == 6 and ep.stragglers == 0


def test_a_resumed_slow_first_epoch_counts_no_straggler_for_samples_taken_and_done_in_order():
    # Review 80: the ranks left out the positions delivered before the checkpoint, so every
    # sample of a resumed epoch counted as a straggler (500 of 500).
    ep = Epoch(list(range(1000)), batch_size=10, cost=lambda i: 1.0, lookahead=16,
               done=range(500))
    out = []
    while not ep.finished:
        for t in ep.take(8):
            out += ep.on(Completed(t.pos, t.attempt, t.pos))
    assert sum(len(b) for b in batches(out)) == 500 and ep.stragglers == 0
    assert ep._rank == {}  # (each rank goes with its batch)
