"""The training loop's step time as the loader measures it (consumer figures)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from autominato import Loader
from autominato.telemetry import attach
from autominato.telemetry.metrics import CONSUMER_STEP_SECONDS

STEP_S = 0.15


class Small:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return np.full((2, 2), i, np.float32)


def _hist(rank: str) -> tuple[float, float]:
    """(count, sum) of the consumer step histogram of ``rank``."""
    child = CONSUMER_STEP_SECONDS.labels(rank)
    count = total = 0.0
    for metric in child.collect():
        for s in metric.samples:
            if s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    return count, total


@pytest.fixture
def loader():
    with Loader(Small(), batch_size=2, worker_kind="thread", autotune=False, seed=0) as L:
        yield L


def test_step_histogram_mean_matches_a_known_step_with_two_batch_epochs(loader):
    handle = attach(loader)
    try:
        for epoch in range(3):
            loader.set_epoch(epoch)
            for _ in loader:  # 2 batches an epoch
                time.sleep(STEP_S)
            time.sleep(0.3)  # between epochs (a validation pass): no step
        count, total = _hist(handle.rank)
    finally:
        handle.close()
    assert count == 6
    # Every step counts whole, the last of each epoch too; sleeps overshoot, never undershoot.
    assert STEP_S * 0.95 <= total / count <= STEP_S * 1.10
    snap = loader.snapshot()
    assert snap.consumer_busy_seconds_total == pytest.approx(total)
    assert STEP_S * 0.95 <= snap.consumer_busy_seconds_total / snap.batches_total <= STEP_S * 1.10


def test_a_break_closes_the_step_of_the_last_batch_taken(loader):
    for _ in loader:
        time.sleep(STEP_S)
        break
    time.sleep(0.3)  # after the loop: not a step
    snap = loader.snapshot()
    assert snap.batches_total == 1
    assert STEP_S * 0.95 <= snap.consumer_busy_seconds_total <= STEP_S * 1.5


def test_close_ends_the_open_step():
    L = Loader(Small(), batch_size=2, worker_kind="thread", autotune=False, seed=0)
    it = iter(L)
    next(it)
    time.sleep(STEP_S)
    L.close()
    assert L.snapshot().consumer_busy_seconds_total >= STEP_S * 0.95
    assert L.stage_stats["consumer"].snapshot().items_total == 2  # one step of 2 samples


class SmallStream:
    """The samples of :class:`Small` as an iterable dataset (no ``__getitem__``)."""

    def __iter__(self):
        return (np.full((2, 2), i, np.float32) for i in range(4))


@pytest.mark.parametrize("dataset", [Small, SmallStream])
def test_a_break_without_workers_closes_the_step_when_the_iterator_is_dropped(dataset):
    with Loader(dataset(), batch_size=2, num_workers=0, autotune=False, seed=0) as L:
        for _ in L:
            break
        # The iterator is gone: its last step is recorded now, not at the next request.
        assert L.stage_stats["consumer"].snapshot().items_total == 2


def test_a_snapshot_taken_mid_step_counts_the_step_so_far_beside_its_batchs_wait(loader):
    # the controller's and the monitor's windows read these totals: a window ending mid-step
    # held the batch's wait without any of its step, so idle read high
    it = iter(loader)
    next(it)
    time.sleep(STEP_S)
    s = loader.snapshot()
    assert s.batches_total == 1
    assert STEP_S <= s.consumer_busy_seconds_total < STEP_S + 0.1
    time.sleep(STEP_S)
    later = loader.snapshot()
    assert later.consumer_busy_seconds_total >= 2 * STEP_S  # the same step, further on
    next(it)  # the step ends: its whole length, once (the next one has just begun)
    done = loader.snapshot()
    assert 2 * STEP_S <= done.consumer_busy_seconds_total < 2 * STEP_S + 0.1


def test_the_busy_total_never_goes_back_when_a_snapshot_falls_between_next_and_its_lock(loader):
    # __next__ reads the time, then takes the lock to close the step: a snapshot in between
    # already counted the step further than that time. The total must not shrink (a window
    # would read a negative busy time, idle above 1).
    it = iter(loader)
    next(it)
    t0 = time.monotonic()  # __next__'s clock reading
    time.sleep(0.05)
    s1 = loader.snapshot()  # the monitor's, from its own thread, meanwhile
    loader._end_step(t0)  # __next__ goes on: the step closes
    s2 = loader.snapshot()
    assert s2.consumer_busy_seconds_total >= s1.consumer_busy_seconds_total
    assert loader.stage_stats["consumer"].snapshot().items_total == 2  # closed once


def test_an_iterator_finalized_while_the_step_lock_is_held_does_not_deadlock():
    # An iterator in a reference cycle is freed by the cyclic collector, which runs its
    # __del__ (it closes its step) in whichever thread an allocation triggered it: in the
    # training loop's own _delivered, say, with the step lock held.
    import gc
    import threading

    class Collecting(float):
        """A wait whose addition runs a collection, as an allocation there may."""

        def __radd__(self, other: float) -> float:
            gc.collect()
            return other + float(self)

    L = Loader(Small(), batch_size=2, num_workers=0, autotune=False, seed=0)
    gc.disable()  # the cycle below must outlive the lines up to _delivered
    try:
        old = iter(L)
        next(old)
        old.cycle = old
        del old
        t = threading.Thread(target=L._delivered, args=(time.monotonic(), Collecting(0.01), 2, 1),
                             daemon=True)
        t.start()
        t.join(10)
    finally:
        gc.enable()
    if t.is_alive():
        L._closed = True  # close() would wait for the lock for ever too
        pytest.fail("the step lock deadlocked against a finalizer in the same thread")
    assert L.snapshot().batches_total == 2
    L.close()
    assert L.stage_stats["consumer"].snapshot().items_total == 4  # both steps of 2, once each
