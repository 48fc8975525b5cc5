"""Memory-aware dispatch replayed deterministically: the real ``Stage.pump``,
``Pipeline._admit`` and ``SampleMemory`` over a fake executor and a simulated clock, so that
who overtakes the sample held back, and when that sample starts, are exact (review 52)."""

from __future__ import annotations

import types

import pytest

from autominato.bench.replay import Dispatch, any_loader_bound, replay
from autominato.pipeline.scheduler import _SLOT_LATER

MiB = 1 << 20
#: The budget's headroom these scenarios' arithmetic assumes (they test the rule, not the
#: constant: budgets below read "1.25 * ...")
M = 1.25


def _run(mib, seconds, order, workers, rule="scan"):
    """Replay ``order`` with every figure known from the start."""
    return replay([(i, seconds[i], mib[i] * MiB) for i in order], workers, rule=rule,
                  figures=[m * MiB for m in mib], learn=False, margin=M)


def _starts(mib, seconds, order, workers, fifo=False):
    """Start time of each index."""
    r = _run(mib, seconds, order, workers, "fifo" if fifo else "scan")
    return {i: t for i, t in zip(order, r.starts, strict=True)}


def test_overtakers_never_start_the_held_sample_later_than_first_in_first_out():
    """Review 52: L (480 MiB, 10 s) and M (40, 1 s) run, H (100) waits (budget 600). When M
    ends, H fits beside L alone: overtakers that took that room made H wait until 3-5 s (the
    last of the epoch with 25 MiB ones). The room left is what H needs beside all but the
    smallest of the samples it waited for."""
    order = list(range(10))
    seconds = [10.0, 1.0, 2.0, 3.0] + [1.0] * 6
    for small in (10, 25):
        mib = [480, 40, 100, 30] + [small] * 6
        fifo = _starts(mib, seconds, order, 3, fifo=True)
        now = _starts(mib, seconds, order, 3)
        assert fifo[2] == 1.0
        assert now[2] <= fifo[2], (small, now)
        assert sorted(now) == order  # everything started


def test_small_samples_overtake_and_count_while_they_run():
    """Two workers: 0 (240 MiB) runs, 1 (120) waits (budget 300); the small 4 and 5 (16)
    overtake it one after the other (then 6 and 7, past the medium 2); 1 starts as 0 ends.
    Under first in, first out the free worker idled until then."""
    mib = [240, 120, 120, 120, 16, 16, 16, 16]
    seconds = [0.45, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1, 0.1]
    order = [0, 1, 4, 5, 2, 6, 3, 7]
    fifo = _starts(mib, seconds, order, 2, fifo=True)
    now = _starts(mib, seconds, order, 2)
    assert fifo[4] >= fifo[1] == 0.45  # 4 waited behind 1
    assert now[4] == 0.0 and now[5] == 0.1 and now[1] == 0.45
    assert now[2] >= 0.45  # 2 (120) did not overtake: it fits beside 0 with neither


def test_overtakers_in_flight_take_the_held_samples_room():
    """Four workers, budget 1.25 * 400 = 500 MiB. A (400, 5 s) and B (50, 1 s) run; H (60)
    waits (510). H fits beside A alone, so an overtaker must leave 60 + 400 beside the others
    that overtook: the first 25 MiB one passes (485), the second does not (510), though it
    fits now (500); H starts as B ends, beside A and the first."""
    mib = [400, 50, 60, 25, 25, 25, 25, 25]
    seconds = [5.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    now = _starts(mib, seconds, list(range(8)), 4)
    assert now[0] == now[1] == now[3] == 0.0
    assert now[2] == 1.0
    assert now[4] >= 1.0  # refused at 0.0 by the room the first overtaker took


def test_the_scan_goes_past_a_second_sample_refused():
    """The medium 2 behind the held 1 does not fit beside 0: the small 6 and 7 behind it
    overtake both (a scan that stopped at 2 idled the free worker 0.2-0.45 s), and 1 and 2
    still start as 0 ends, as they did without them."""
    mib = [240, 120, 120, 120, 16, 16, 16, 16]
    seconds = [0.45, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1, 0.1]
    now = _starts(mib, seconds, [0, 1, 4, 5, 2, 6, 3, 7], 2)
    assert [now[4], now[5], now[6], now[7]] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert now[1] == now[2] == 0.45 and now[3] >= 0.45
    # the three that waited count, not only the first in line (trial 57: 4 of 6 counted)
    assert _run(mib, seconds, [0, 1, 4, 5, 2, 6, 3, 7], 2).held_back == 3


def test_no_overtaking_once_the_held_sample_left_the_queue():
    """A sample held back and then dropped from the queue (its epoch discarded): nothing
    overtakes a sample that is not there, and the next first in line is judged afresh."""
    d = Dispatch([m * MiB for m in (240, 120, 16, 16)], workers=2, margin=M)
    for pos, index in enumerate([0, 1, 2]):
        d.put((0, pos, 0), index)
    d.stage.pump()
    assert list(d.procs.running) == [(0, 0, 0), (0, 2, 0)]  # 0, and 2 overtook 1
    d.stage.drop(lambda key: key != (0, 1, 0))  # 1 leaves the queue
    d.stage.put((0, 3, 0), (3, 0, 0, True, None, None, _SLOT_LATER))
    assert not d._admit((0, 9, 0), (3, 0, 0, True, None, None, _SLOT_LATER), True)


def test_samples_that_overtook_count_as_such_not_as_samples_waited_for():
    """Five workers, budget 500 MiB: A (400) and B (50) run, H (60) waits; H needs 60 + 400
    beside the overtakers, so two 15 MiB ones pass (490) and a third does not (505). Counted
    among the samples H waited for, the first would have let none more pass (60 + 450 + 15:
    all but the smallest of A, B and it)."""
    mib = [400, 50, 60, 15, 15, 15, 15, 15]
    seconds = [5.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    now = _starts(mib, seconds, list(range(8)), 5)
    assert now[3] == now[4] == 0.0
    assert now[5] >= 1.0 and now[2] == 1.0


def test_the_idle_worker_seconds_are_those_of_the_replay():
    """Two workers: 0 runs 0-0.45 s, 4, 5, 6 and 7 overtake the held 1 and the medium 2
    and 3 (0-0.4 s): one worker idles 0.4-0.45 s for memory, 0.05 worker-s (first in, first
    out: 0.45). Three workers with two queued samples, 1 held beside 0: one idle worker counts,
    not two (the other has nothing queued). The figure stays put once the pumps stop."""
    mib = [240, 120, 120, 120, 16, 16, 16, 16]
    seconds = [0.45, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1, 0.1]
    order = [0, 1, 4, 5, 2, 6, 3, 7]
    for rule, idle in (("scan", 0.05), ("stop", 0.25), ("fifo", 0.45)):
        assert _run(mib, seconds, order, 2, rule).held_idle_s == pytest.approx(idle), rule
    d = Dispatch([m * MiB for m in [240, 120] + [16] * 6], 3, margin=M)  # budget 1.25 * 240: 1 waits
    d.put((0, 0, 0), 0)
    d.put((0, 1, 0), 1)
    import autominato.pipeline.stage as stage_module
    real, stage_module.time = stage_module.time, types.SimpleNamespace(monotonic=lambda: 0.0)
    try:
        d.stage.pump()  # 0 starts, 1 waits: one idle worker counts from 0.0 s, not two
        stage_module.time = types.SimpleNamespace(monotonic=lambda: 0.45)
        d.ended((0, 0, 0))
        d.stage.pump()
    finally:
        stage_module.time = real
    assert list(d.procs.running) == [(0, 1, 0)]
    assert d.stage.held_idle_s() == pytest.approx(0.45)
    assert d.stage.held_idle_s() == d.stage.held_idle_s()  # (real clock again: no drift)


def test_the_replays_training_loop_bounds_the_wall_time_and_the_window():
    """Four 0.1 s samples on two workers, batches of 2, a 1 s step: the loop takes the first
    batch at 0.1 s and the second at 1.1 s, ending at 2.1 s. On four workers a window of 2
    samples starts the second pair when the loop takes the first (0.1 s), a window of 3 the
    third sample at once and only the fourth then."""
    samples = [(i, 0.1, MiB) for i in range(4)]
    r = replay(samples, 2, rule="off", batch_size=2, step_s=1.0)
    assert r.makespan_s == pytest.approx(2.1)
    r = replay(samples, 4, rule="off", batch_size=2, step_s=1.0, in_flight=2)
    assert r.starts == pytest.approx([0.0, 0.0, 0.1, 0.1])
    r = replay(samples, 4, rule="off", batch_size=2, step_s=1.0, in_flight=3)
    assert r.starts == pytest.approx([0.0, 0.0, 0.0, 0.1])
    assert replay(samples, 2, rule="off").makespan_s == pytest.approx(0.2)  # no loop
    # a finished sample the loop has not taken counts in the window (review 56): batches of
    # 1 every second, a window of 2: the fourth starts when the loop takes the second
    r = replay(samples, 4, rule="off", batch_size=1, step_s=1.0, in_flight=2)
    assert r.starts == pytest.approx([0.0, 0.0, 0.1, 1.1])
    with pytest.raises(ValueError, match="in_flight"):
        replay(samples, 2, rule="off", batch_size=4, step_s=1.0, in_flight=2)
    with pytest.raises(ValueError, match="rule"):
        replay(samples, 2, rule="lifo")


def test_the_replays_epochs_never_share_a_batch():
    """Two epochs of three samples, batches of 2, a 0.5 s step: epoch 0's last batch is its
    1 s straggler alone (taken at 1.1 s), although epoch 1's samples finished by 0.4 s (the
    workers went on into it); then epoch 1's two batches: the loop ends at 2.6 s. As one
    stream the loop would take two of epoch 1's samples at 0.6 s and end at 1.6 s."""
    samples = [(0, 0.1, MiB), (1, 0.1, MiB), (2, 1.0, MiB)] + [(i, 0.1, MiB) for i in range(3)]
    r = replay(samples, 2, rule="off", batch_size=2, step_s=0.5, epoch_sizes=[3, 3])
    assert r.makespan_s == pytest.approx(2.6)
    assert r.starts == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.2, 0.3])
    assert replay(samples, 2, rule="off", batch_size=2, step_s=0.5).makespan_s == pytest.approx(1.6)
    with pytest.raises(ValueError, match="epoch_sizes"):
        replay(samples, 2, rule="off", epoch_sizes=[3, 2])
    # With no step every batch that is there is taken at once (review 76): a 10 s straggler
    # ends epoch 0, the next epoch's six finished samples leave the window together, and
    # the window's seventh sample starts then, at 10 s.
    samples = [(0, 10.0, MiB)] + [(i, 1.0, MiB) for i in range(7)]
    r = replay(samples, 6, rule="off", in_flight=6, epoch_sizes=[1, 7])
    assert r.starts[-1] == pytest.approx(10.0) and r.makespan_s == pytest.approx(11.0)


def _allocates(mib, rng):
    import numpy as np

    a = np.ones(mib << 20, np.uint8)  # touched: resident
    return a[:1]


def test_measure_reads_each_samples_time_and_peak():
    from autominato.bench.replay import measure
    from autominato.bench.workload import Workload

    wl = Workload("alloc", [32, 8], _allocates, batch_size=2, step_s=0.0)
    runs = measure(wl, 2)
    assert [(e, i) for e, i, _, _ in runs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s > 0 for _, _, s, _ in runs)
    peaks = {i: p for _, i, _, p in runs}
    if peaks[0] == 0:
        pytest.skip("no /proc/self/clear_refs here")
    assert 30 * MiB <= peaks[0] < 40 * MiB and 6 * MiB <= peaks[1] < 16 * MiB


def test_a_scan_asks_at_most_scan_refusals_refused_samples():
    """Each ask costs O(workers): a pump passes at most SCAN_REFUSALS refused samples. The
    small last sample overtakes 1 + 14 medium ones (all refused beside 0, 0.45 s) at once,
    not 1 + 15: it then starts last, behind them (0.45 + 8 x 0.12 s)."""
    from autominato.pipeline.memory import SCAN_REFUSALS

    assert SCAN_REFUSALS == 16
    for medium, small_start in ((14, 0.0), (15, 0.45 + 8 * 0.12)):
        mib = [240] + [120] * (1 + medium) + [16]
        seconds = [0.45] + [0.12] * (1 + medium) + [0.1]
        now = _starts(mib, seconds, list(range(len(mib))), 2)
        assert now[len(mib) - 1] == pytest.approx(small_start), medium


class _EveryAskAfresh:
    """The stage as ``_admit`` sees it, outside any pump: it recomputes the in-flight
    estimates at every ask instead of once a pump."""

    scans = 0

    def __init__(self, stage):
        self.__dict__["_stage"] = stage

    def __getattr__(self, name):
        return getattr(self._stage, name)


def test_estimates_kept_for_a_pump_decide_as_recomputed_ones(monkeypatch):
    """The estimates in flight are computed once a pump, samples admitted during it added:
    200 random replays start every sample at the same time as with estimates recomputed at
    every ask (review 56's pump cost)."""
    import random

    import autominato.bench.replay as replay_module

    init = replay_module.Dispatch.__init__

    def afresh(self, *a, **k):
        init(self, *a, **k)
        self._admit_stage = _EveryAskAfresh(self.stage)

    for seed in range(200):
        rnd = random.Random(seed)
        n, workers = rnd.randint(4, 40), rnd.randint(2, 8)
        mib = [rnd.choice([rnd.randint(5, 60), rnd.randint(60, 200), rnd.randint(200, 600)])
               for _ in range(n)]
        order = list(range(n))
        rnd.shuffle(order)
        samples = [(i, rnd.choice([0.1, 0.5, 1.0, 3.0]), mib[i] * MiB) for i in order]
        kw = dict(n_indices=n, in_flight=rnd.choice([None, workers + 4]))
        if seed % 2:  # figures known from the start: a pump admits several at once
            kw.update(figures=[m * MiB for m in mib], learn=False)
        monkeypatch.setattr(replay_module.Dispatch, "__init__", init)
        kept = replay(samples, workers, **kw)
        monkeypatch.setattr(replay_module.Dispatch, "__init__", afresh)
        fresh = replay(samples, workers, **kw)
        assert (kept.starts, kept.held_back) == (fresh.starts, fresh.held_back), seed


def test_figures_restored_during_a_pump_count_at_the_next_ask():
    """Review 58: a restore (the training thread's load_state_dict) between two asks of one
    pump gives the running sample A its figure (600 MiB, it ran at the 100 MiB median): the
    next ask must see it (budget 750: A and one 100 MiB sample fit, not two), not the
    estimates kept since the pump began."""
    figs = [0, 0, 100 * MiB, 100 * MiB, 100 * MiB]
    d = Dispatch(figs, 4, margin=M)
    d.put((0, 0, 0), 0)
    d.stage.pump()  # A (index 0) runs at the median
    asks, admit = [0], d.stage.admit

    def restoring(key, item, overtaking=False):
        asks[0] += 1
        if asks[0] == 2:
            d.memory.restore([600 * MiB, 0, 100 * MiB, 100 * MiB, 100 * MiB])
        return admit(key, item, overtaking)

    d.stage.admit = restoring
    d.put((0, 1, 0), 2)
    d.put((0, 2, 0), 3)
    d.stage.pump()
    assert sorted(k[1] for k in d.procs.running) == [0, 1]


def test_the_replay_takes_the_slowest_known_sample_of_the_window_first_as_the_loader():
    # Three epochs of indices 0-5; index 5 takes 1 s, the others 0.1 s. The samples of an
    # epoch enter the window before index 5's first time is known (it ends at 1.2 s), so
    # epochs 0 and 1 go in sampler order; in epoch 2, after its first batch, index 5 starts
    # before the samples ahead of it, and the run ends sooner.
    samples = [(i, 1.0 if i == 5 else 0.1, 1) for i in range(6)] * 3
    kw = dict(in_flight=6, batch_size=1, epoch_sizes=[6, 6, 6], rule="off")
    plain = replay(samples, 2, **kw)
    slow = replay(samples, 2, slow_first=True, **kw)
    assert slow.starts[:12] == plain.starts[:12]
    assert slow.starts[12 + 5] < min(slow.starts[12 + 1:12 + 5])  # right after the first batch
    assert plain.starts[12 + 5] > max(plain.starts[12:12 + 5])
    assert slow.makespan_s < plain.makespan_s  # 2.5 s against 3.2 s


def test_no_loader_beats_the_bound_and_the_bound_is_reached_where_a_schedule_reaches_it():
    """Epoch 0's 1 s straggler started at once (no loader can do better) is done at 1.0 s:
    its batch, the second of four, and the two after it step 0.5 s each, 2.5 s. The replay
    starts it after the two fast ones (sampler order): 2.6 s, above the bound."""
    epochs = [[0.1, 0.1, 1.0], [0.1, 0.1, 0.1]]
    assert any_loader_bound(epochs, 2, 2, 0.5) == pytest.approx(2.5)
    samples = [(0, 0.1, MiB), (1, 0.1, MiB), (2, 1.0, MiB)] + [(i, 0.1, MiB) for i in range(3)]
    assert replay(samples, 2, rule="off", batch_size=2, step_s=0.5,
                  epoch_sizes=[3, 3]).makespan_s == pytest.approx(2.6)
    # the straggler first in the order: the replay reaches the bound
    first = [(2, 1.0, MiB), (0, 0.1, MiB), (1, 0.1, MiB)] + samples[3:]
    assert replay(first, 2, rule="off", batch_size=2, step_s=0.5,
                  epoch_sizes=[3, 3]).makespan_s == pytest.approx(2.5)
    # the work bound: four 1 s samples on one worker, batches of 1, no step: 4 s
    assert any_loader_bound([[1.0] * 4], 1, 1, 0.0) == pytest.approx(4.0)
    # the first batch: 3 samples of 1 s on 2 workers, batches of 3, a 10 s step: 1.5 + 10
    assert any_loader_bound([[1.0] * 3], 2, 3, 10.0) == pytest.approx(11.5)
    with pytest.raises(ValueError, match="workers"):
        any_loader_bound(epochs, 0, 2, 0.5)


@pytest.mark.parametrize("seed", range(20))
def test_the_replay_is_never_below_the_bound(seed):
    import random

    rng = random.Random(seed)
    sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
    secs = [[rng.choice([0.05, 0.1, 0.2, 1.5]) for _ in range(n)] for n in sizes]
    samples = [(i, s, MiB) for e in secs for i, s in enumerate(e)]
    workers, batch = rng.randint(1, 3), rng.randint(1, 3)
    step = rng.choice([0.0, 0.1, 0.4])
    bound = any_loader_bound(secs, workers, batch, step)
    for window in (None, max(batch, 4)):
        for rule, slow in (("off", False), ("scan", True)):
            r = replay(samples, workers, rule=rule, slow_first=slow, batch_size=batch,
                       step_s=step, in_flight=window, epoch_sizes=sizes)
            assert r.makespan_s >= bound - 1e-9
