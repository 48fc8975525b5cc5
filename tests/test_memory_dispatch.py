"""Memory-aware dispatch replayed deterministically: the real ``Stage.pump``,
``Pipeline._admit`` and ``SampleMemory`` over a fake executor and a simulated clock, so that
who overtakes the sample held back, and when that sample starts, are exact (review 52)."""

from __future__ import annotations

import heapq
import types

from autominato.pipeline.memory import SampleMemory
from autominato.pipeline.scheduler import _SLOT_LATER, Pipeline
from autominato.pipeline.stage import Stage

MiB = 1 << 20


class FakeWorkers:
    """The process executor as ``_admit`` and ``Stage`` see it: ``size`` workers, one
    sample each."""

    chunk = 1

    def __init__(self, workers: int) -> None:
        self.size = workers
        self.running: dict = {}

    def held_keys(self):
        return iter(list(self.running))

    def free(self) -> int:
        return self.size - len(self.running)

    def submit(self, key, item) -> None:
        self.running[key] = item

    def flush(self) -> None:
        pass


class Dispatch:
    """The scheduler's state that ``_admit`` reads, with its methods."""

    _admit = Pipeline._admit
    _in_queue_index = Pipeline._in_queue_index

    def __init__(self, mib: list[int], workers: int, fifo: bool = False) -> None:
        self.memory = SampleMemory(len(mib))
        for i, f in enumerate(mib):
            self.memory.learn(i, f * MiB)
        self.procs = FakeWorkers(workers)
        self._in_flight, self._held_key, self._overtook = {}, None, set()
        # fifo: the rule before overtaking (every later sample refused while the first waits)
        admit = (lambda k, it, over=False: not over and self._admit(k, it)) if fifo else self._admit
        self.stage = Stage("transform", self.procs, lambda *a: None, lambda: 100, admit=admit)
        self._admit_stage = self.stage

    def put(self, order: list[int]) -> None:
        for pos, index in enumerate(order):
            self.stage.put((0, pos, 0), (index, 0, 0, True, None, None, _SLOT_LATER))

    def replay(self, seconds: list[float]) -> dict[int, float]:
        """Start times (simulated seconds) of every queued index, run to the end; the
        stage reads the simulated clock meanwhile."""
        import autominato.pipeline.stage as stage_module

        clock = types.SimpleNamespace(now=0.0)
        real, stage_module.time = stage_module.time, types.SimpleNamespace(
            monotonic=lambda: clock.now)
        try:
            return self._replay(seconds, clock)
        finally:
            stage_module.time = real

    def _replay(self, seconds: list[float], clock: types.SimpleNamespace) -> dict[int, float]:
        events: list = []
        start: dict[int, float] = {}
        while True:
            now = clock.now
            before = set(self.procs.running)
            self.stage.pump()
            for key in set(self.procs.running) - before:
                index = self.procs.running[key][0]
                start[index] = now
                heapq.heappush(events, (now + seconds[index], key))
            if not events:
                return start
            clock.now, key = heapq.heappop(events)
            del self.procs.running[key]
            self._in_flight.pop(key, None)  # as Pipeline._result does
            self._overtook.discard(key)


def _starts(mib, seconds, order, workers, fifo=False):
    d = Dispatch(mib, workers, fifo)
    d.put(order)
    return d.replay(seconds)


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
    overtake it one after the other, the medium 2 behind them stops the scan; 1 starts as 0
    ends. Under first in, first out the free worker idled until then."""
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


def test_the_scan_stops_at_the_second_sample_refused():
    """The medium 2 behind the held 1 does not fit beside 0: the small 6 behind it does not
    overtake both (at most one sample is overtaken at a time)."""
    mib = [240, 120, 120, 120, 16, 16, 16, 16]
    seconds = [0.45, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1, 0.1]
    now = _starts(mib, seconds, [0, 1, 4, 5, 2, 6, 3, 7], 2)
    assert now[6] >= now[1] == 0.45


def test_no_overtaking_once_the_held_sample_left_the_queue():
    """A sample held back and then dropped from the queue (its epoch discarded): nothing
    overtakes a sample that is not there, and the next first in line is judged afresh."""
    d = Dispatch([240, 120, 16, 16], workers=2)
    d.put([0, 1, 2])
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
    """Two workers: 0 runs 0-0.45 s, 4 and 5 overtake the held 1 (0-0.2 s), then 2 stops
    the scan: one worker idles 0.2-0.45 s for memory, 0.25 worker-s (first in, first out:
    0.45). Three workers with two queued samples, 1 held beside 0: one idle worker counts,
    not two (the other has nothing queued). The figure stays put once the pumps stop."""
    mib = [240, 120, 120, 120, 16, 16, 16, 16]
    seconds = [0.45, 0.12, 0.12, 0.12, 0.1, 0.1, 0.1, 0.1]
    order = [0, 1, 4, 5, 2, 6, 3, 7]
    for fifo, idle in ((False, 0.25), (True, 0.45)):
        d = Dispatch(mib, 2, fifo)
        d.put(order)
        d.replay(seconds)
        assert abs(d.stage.held_idle_s() - idle) < 1e-9, fifo
    d = Dispatch([240, 120] + [16] * 6, 3)  # budget 1.25 * 240: 1 waits beside 0
    d.put([0, 1])
    d.replay(seconds)
    assert abs(d.stage.held_idle_s() - 0.45) < 1e-9
    assert d.stage.held_idle_s() == d.stage.held_idle_s()  # (real clock again: no drift)
