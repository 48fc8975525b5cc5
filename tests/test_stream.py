"""The pure bookkeeping of an iterable dataset's epoch (``pipeline/stream.py``), without
threads or processes: random interleavings of pulls, samples, errors and shard ends."""

from __future__ import annotations

import random

import pytest

from autominato.pipeline.epoch import Discard, Emit, End, Raise, Skip
from autominato.pipeline.stream import PullDone, ShardLost, Stream, Yielded, YieldFailed


def dataloader_order(lengths: list[list], B: int, drop_last: bool) -> list[list]:
    """The batches a DataLoader with ``len(lengths)`` workers yields for an iterable dataset
    whose worker s yields ``lengths[s]``: each worker batches its own samples, and the
    batches come round-robin over the workers still running."""
    per = []
    for samples in lengths:
        bs = [samples[i:i + B] for i in range(0, len(samples), B)]
        if drop_last and bs and len(bs[-1]) < B:
            bs.pop()
        per.append(bs)
    out = []
    for r in range(max((len(b) for b in per), default=0)):
        out += [b[r] for b in per if r < len(b)]
    return out


def dataloader_shard_batches(samples: list, bad: set, B: int, drop_last: bool) -> list[list]:
    """The batches one DataLoader worker yields from ``samples`` when those in ``bad`` raise:
    a fetch that meets an error raises it and loses the samples it had gathered, and the next
    fetch starts after the failing sample."""
    out, cur = [], []
    for x in samples:
        if x in bad:
            cur = []
            continue
        cur.append(x)
        if len(cur) == B:
            out.append(cur)
            cur = []
    if cur and not drop_last:
        out.append(cur)
    return out


def simulate(rng: random.Random, shards: list[list], B: int, drop_last: bool, in_order: bool,
             skip: bool, bad: set, window: int):
    """Drive a Stream with a random interleaving; returns (batches, skipped, discarded, raised,
    most held). ``shards[s]`` is what shard s yields; a sample in ``bad`` fails."""
    ep = Stream(len(shards), B, drop_last=drop_last, in_order=in_order, skip_errors=skip,
                max_pull=rng.randint(1, 6))
    cursor = [0] * len(shards)
    open_pulls: dict[int, list] = {}  # shard -> outcomes left to deliver
    batches, skipped, discarded, raised, most = [], [], [], [], 0
    ended = False

    def apply(decisions):
        nonlocal ended
        for d in decisions:
            assert not ended, "a decision after End"
            if isinstance(d, Emit):
                batches.append([r for _, _, r in d.items])
            elif isinstance(d, Skip):
                skipped.append(d.error.args[0])
            elif isinstance(d, Discard):
                discarded.append(d.result)
            elif isinstance(d, Raise):
                raised.append(d.error)
            elif isinstance(d, End):
                ended = True

    for _ in range(100_000):
        if ended or ep.failed:
            break
        if rng.random() < 0.4 or not open_pulls:
            room = window - ep.held - rng.randint(0, 2)
            for p in ep.take(room):
                assert p.shard not in open_pulls, "two pulls of one shard open"
                outs = []
                for _ in range(p.n):
                    s = p.shard
                    if cursor[s] >= len(shards[s]):
                        break
                    sample = shards[s][cursor[s]]
                    cursor[s] += 1
                    outs.append(YieldFailed(s, ValueError(sample)) if sample in bad else Yielded(s, sample))
                exhausted = len(outs) < p.n
                outs.append(PullDone(p.shard, p.n - len(outs) if exhausted else 0, exhausted))
                open_pulls[p.shard] = outs
            most = max(most, ep.held)
            continue
        s = rng.choice(sorted(open_pulls))
        ev = open_pulls[s].pop(0)
        if not open_pulls[s]:
            del open_pulls[s]
        apply(ep.on(ev))
    assert ended or ep.failed, "the epoch neither ended nor failed"
    return batches, skipped, discarded, raised, most


@pytest.mark.parametrize("in_order", [False, True])
def test_every_sample_is_delivered_once_in_random_interleavings(in_order):
    rng = random.Random(1234 + in_order)
    for trial in range(1500):
        n = rng.randint(1, 4)
        lengths = [rng.randint(0, 12) for _ in range(n)]
        shards = [[(s, k) for k in range(L)] for s, L in enumerate(lengths)]
        B, drop_last, skip = rng.randint(1, 5), rng.random() < 0.5, rng.random() < 0.5
        every = [x for sh in shards for x in sh]
        bad = set(rng.sample(every, min(len(every), rng.randint(0, 2))))
        window = rng.randint(B, 3 * B + 4)
        batches, skipped, discarded, raised, most = simulate(rng, shards, B, drop_last, in_order,
                                                             skip, bad, window)
        raised = [e.args[0] for e in raised]  # on_error="raise": the epoch goes on after each
        delivered = [x for b in batches for x in b]
        assert len(delivered) == len(set(delivered))
        assert sorted(delivered + skipped + discarded + raised) == sorted(every), trial
        assert set(skipped if skip else raised) == bad and not (raised if skip else skipped)
        # the window bounds what is asked for and held (in order, the shard whose turn it is
        # may fill its batch one sample at a time beyond it)
        # (after an error in order, the samples before it that wait for the shard's next
        # batch may be as many again)
        assert most <= window + (B if in_order else 0) + (B if in_order and raised else 0)
        if in_order and skip:
            good = [[x for x in sh if x not in bad] for sh in shards]
            assert batches == dataloader_order(good, B, drop_last), trial
        elif in_order:
            # An error takes its shard's turn and loses the samples of its batch before it, as
            # a DataLoader worker's fetch: each shard's batches are the DataLoader worker's.
            for sh, samples in enumerate(shards):
                got = [b for b in batches if b[0][0] == sh]
                assert got == dataloader_shard_batches(samples, bad, B, drop_last), trial
        else:
            assert all(len(b) == B for b in batches[:-1])
            if drop_last:
                assert all(len(b) == B for b in batches) and len(discarded) < B
            else:
                assert not discarded and (not batches or 0 < len(batches[-1]) <= B)


def test_a_failed_sample_raises_at_once_and_the_epoch_goes_on():
    """As DataLoader's workers: the error reaches the training loop, the shard is pulled on."""
    ep = Stream(2, 2)
    pulls = ep.take(8)
    assert [(p.shard, p.n, p.seq) for p in pulls] == [(0, 4, 0), (1, 4, 0)]
    assert ep.on(Yielded(0, "a")) == [] and ep.held == 8
    out = ep.on(YieldFailed(1, ValueError("bad")))
    assert [type(d) for d in out] == [Raise] and not out[0].final and not ep.finished
    out = ep.on(Yielded(1, "b"))
    assert [[r for _, _, r in d.items] for d in out if isinstance(d, Emit)] == [["a", "b"]]
    assert ep.raised == 1 and ep.skipped == 0


def test_a_lost_shard_ends_the_epoch_with_its_error():
    ep = Stream(3, 2)
    ep.take(6)
    ep.on(Yielded(2, "x"))
    err = RuntimeError("worker 1 died")
    out = ep.on(ShardLost(1, err))
    assert out[0] == Raise(err, final=True) and out[1:] == [Discard("x")]


def test_a_shard_has_one_pull_open_and_asks_no_more_than_the_room():
    ep = Stream(3, 2, max_pull=4)
    assert [(p.shard, p.n) for p in ep.take(5)] == [(0, 1), (1, 1), (2, 1)]
    assert ep.take(10) == []  # each shard has its pull open
    ep.on(Yielded(0, "a"))
    ep.on(PullDone(0, 0, False))
    assert [(p.shard, p.n, p.seq) for p in ep.take(10)] == [(0, 4, 1)]
    assert ep.take(0) == []


def test_in_order_an_error_comes_in_its_shards_turn():
    """As DataLoader's round-robin: shard 0's batch, shard 1's batch, then shard 1's error in
    place of its next batch, though the error arrived first."""
    ep = Stream(2, 2, in_order=True)
    ep.take(8)
    out = ep.on(Yielded(1, "b0")) + ep.on(Yielded(1, "b1"))
    out += ep.on(YieldFailed(1, ValueError("bad")))
    assert out == []  # shard 0's batch comes first
    out += ep.on(Yielded(0, "a0")) + ep.on(Yielded(0, "a1"))
    assert [type(d) for d in out] == [Emit, Emit]
    assert [[r for _, _, r in d.items] for d in out] == [["a0", "a1"], ["b0", "b1"]]
    out = ep.on(Yielded(0, "a2")) + ep.on(Yielded(0, "a3"))
    assert [type(d) for d in out] == [Emit, Raise]  # shard 0's 2nd batch, shard 1's error
    assert not ep.finished


def test_in_order_the_shard_whose_turn_it_is_may_ask_beyond_the_window():
    ep = Stream(2, 2, in_order=True)
    ep.take(2)  # one sample each
    ep.on(Yielded(1, "b0"))
    ep.on(PullDone(1, 0, False))
    ep.on(Yielded(0, "a0"))
    ep.on(PullDone(0, 0, False))
    # shard 0's batch is next and needs one more sample: it may ask although the room is gone
    assert [(p.shard, p.n) for p in ep.take(0)] == [(0, 1)]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="shard"):
        Stream(0, 2)
    with pytest.raises(ValueError, match="batch_size"):
        Stream(1, 0)
