"""How far the loader runs ahead of a training loop that is slower than it.

While the training loop waits for batches now and then, the window keeps its whole
``pool_size`` of samples in flight beside the batches ready for it (to ride out stragglers);
once it has taken ``LEAD_WAITS`` batches without waiting, the loader is ahead and the batches
ready count in the window: at most ``pool_size`` samples are then started and not yet taken,
instead of ``pool_size + depth x batch_size`` (DataLoader holds ``prefetch_factor x
num_workers`` batches). Counted, not timed: the samples the dataset was asked for against
those the loop took.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from autominato import Loader

POOL, DEPTH, BATCH, WORKERS = 8, 2, 2, 2


class Counted:
    """Sample ``i`` is ``i``; counts the samples started; indices in ``slow`` sleep
    ``slow_s``."""

    def __init__(self, n: int, slow: range = range(0), slow_s: float = 0.0) -> None:
        self.n, self.slow, self.slow_s = n, slow, slow_s
        self.started = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.int64:
        with self._lock:
            self.started += 1
        if i in self.slow:
            time.sleep(self.slow_s)
        return np.int64(i)


def loader(ds: Counted, **kw) -> Loader:
    args = {"batch_size": BATCH, "workers": WORKERS, "worker_kind": "thread", "pool_size": POOL,
            "depth": DEPTH, "autotune": False, **kw}
    return Loader(ds, **args)


#: Batches taken after the loop last waited before a count is judged: those started while the
#: whole window was open (up to pool_size + depth batches) are taken by then.
SETTLE = POOL // BATCH + DEPTH + 1


def lead_counts(L: Loader, ds: Counted, epochs: int, step_s: float) -> tuple[list[int], int]:
    """Samples started and not yet taken, after each batch taken while the rule held (the
    loop had not waited for SETTLE batches), and the batches at which it had."""
    ahead, taken, waited, calm = [], 0, 0, 0
    for e in range(epochs):
        L.set_epoch(e)
        it = iter(L)
        for b in it:
            taken += len(b)
            time.sleep(step_s)  # the loop's step; the samples take microseconds
            if L._pipeline.full_lead_left:
                waited, calm = waited + 1, 0  # (a stall of the machine: not judged)
            else:
                calm += 1
                if calm > SETTLE:
                    ahead.append(ds.started - taken)
        time.sleep(0.05)
        assert it.run.unconsumed == 0, "every batch collated was taken"
    return ahead, waited


def test_a_loop_slower_than_the_loader_has_at_most_pool_size_samples_started_ahead():
    ds = Counted(40)
    with loader(ds) as L:  # the next epoch's samples start in this one's tail: counted too
        ahead, waited = lead_counts(L, ds, 3, 0.05)
    assert len(ahead) >= 20, f"the loop waited at {waited} of 60 batches"
    # Without the rule: 8 in flight or waiting for a batch, plus 2 batches ready (12), and
    # the next epoch's 8 + 2 batches beside this epoch's last batches at its end (16).
    assert max(ahead) <= POOL, ahead
    assert max(ahead) >= POOL - BATCH, ahead  # the loader did keep ahead


def test_a_batch_sampler_s_batches_count_as_their_samples():
    ds = Counted(72)
    groups = [list(range(k, k + 3)) for k in range(0, 72, 3)]
    with loader(ds, batch_size=1, batch_sampler=groups, pool_size=12) as L:
        ahead, waited = lead_counts(L, ds, 2, 0.05)
    assert len(ahead) >= 12, f"the loop waited at {waited} of 48 batches"
    # Without the rule 12 + 2 batches of 3 (18); with a ready batch counted as one sample, 16.
    assert max(ahead) <= 12, ahead
    assert max(ahead) >= 12 - 3, ahead


def test_after_the_loop_waited_the_window_keeps_its_pool_size_beside_the_ready_batches():
    ds = Counted(120, slow=range(20, 30), slow_s=0.1)  # the loader falls behind: the loop waits
    ahead, taken = [], 0
    # (one epoch: without the next epoch's samples, which would start in its tail)
    with loader(ds, prefetch_next_epoch=False) as L:
        for b in L:
            taken += len(b)
            time.sleep(0.05)
            if L._pipeline.full_lead_left and int(b[-1]) >= 30:  # within LEAD_WAITS of a wait
                ahead.append(ds.started - taken)
    assert ahead, "the loop never waited"
    # The window's pool_size in flight or waiting for a batch, and depth batches ready beside.
    assert max(ahead) > POOL, ahead
    assert max(ahead) <= POOL + DEPTH * BATCH, ahead


class Arrays:
    """Sample ``i``: a 1 MiB float32 array of ``i + 1`` that takes 15 ms, so that batches
    travel in shared batch buffers (and a buffer given back under a batch would read zeros)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        time.sleep(0.015)  # one sample a message (CHUNK_BUDGET_S): rows, not chunks
        return np.full((256, 1024), i + 1, np.float32)


def test_while_the_loop_is_the_bottleneck_no_idle_batch_buffer_keeps_its_memory(monkeypatch):
    """Warm idle batch buffers only add to the peak while the loader is ahead
    (shm.SlotPool.decay's ``keep``): each pass of the scheduler's tick gives them back, never
    one under a batch the loop still holds. Without it, here (the loop drops three batches
    at once), 2 and 1 idle warm buffers at two steps of three; 1-3 at nearly every step on
    the KiTS19 bench."""
    from autominato.pipeline import scheduler

    monkeypatch.setattr(scheduler, "DECAY_TICK_S", 0.02)
    monkeypatch.setattr(scheduler, "LEAD_WAITS", 4)  # (a stall of a loaded machine: short)
    idle, held, seen = [], 0, []
    # (memory_aware=False: measured samples give idle buffers back too, the next test)
    with Loader(Arrays(), batch_size=BATCH, workers=WORKERS, pool_size=POOL, depth=DEPTH,
                autotune=False, prefetch_next_epoch=False, memory_aware=False) as L:
        calm, kept = 0, []
        for b in L:
            kept.append(b)
            if len(kept) == 3:  # the loop drops three batches at once (accumulated steps)
                for k in kept:  # each held through steps of ticks: intact
                    values = k[:, 0, 0].tolist()
                    assert min(values) > 0, "a batch lost its data"
                    assert all(bool((k[j] == v).all()) for j, v in enumerate(values))
                    seen += [int(v) - 1 for v in values]
                kept.clear()
            del b
            time.sleep(0.12)  # the loop's step: several ticks
            pipe = L._pipeline
            calm = 0 if pipe.full_lead_left else calm + 1
            if calm > SETTLE:
                pool = pipe.slots
                with pool._lock:
                    idle.append(sum(1 for s in pool._free
                                    if s.warm and s.batch and not (s.lent and s.viewed())))
                    held = max(held, sum(s.batch for s in pool._all.values()))
        seen += [int(v) - 1 for k in kept for v in k[:, 0, 0].tolist()]
    assert sorted(seen) == list(range(64))
    assert len(idle) >= 12, idle
    assert held > 0, "the batches did not travel in batch buffers"
    # A tick between the loop's release of a batch and this count can be late on a loaded
    # machine: most counts, not all.
    assert sum(n == 0 for n in idle) >= 0.75 * len(idle), idle


def _idle_warm_after_the_epoch(memory_aware: bool) -> tuple[int, int, bool]:
    """Warm batch buffers once an epoch's batches, all held by the loop until its end, were
    dropped, and after 0.3 s more (ticks, not shm.DECAY_S); whether the samples were
    measured."""
    with Loader(Arrays(), batch_size=BATCH, workers=WORKERS, pool_size=POOL, depth=DEPTH,
                autotune=False, prefetch_next_epoch=False, memory_aware=memory_aware) as L:
        kept = list(L)
        time.sleep(0.3)  # ticks pass: no buffer under a batch the loop holds is given back
        seen = []
        for k in kept:
            values = k[:, 0, 0].tolist()
            assert min(values) > 0, "a batch lost its data"
            assert all(bool((k[j] == v).all()) for j, v in enumerate(values))
            seen += [int(v) - 1 for v in values]
        assert sorted(seen) == list(range(64))
        pool = L._pipeline.slots
        with pool._lock:
            buffers = sum(s.batch for s in pool._all.values())
        del kept, k
        time.sleep(0.3)
        with pool._lock:
            warm = sum(1 for s in pool._free
                       if s.warm and s.batch and not (s.lent and s.viewed()))
        return buffers, warm, L._pipeline.memory.known


def test_measured_samples_keep_no_idle_batch_buffer_warm(monkeypatch):
    """Where memory-aware dispatch measures the samples (each of 10 ms or more), idle batch
    buffers give their pages back at the scheduler's next tick, the loop the bottleneck or
    not (the lead rule never holds here): at the KiTS19 bench's peaks three idle 20 MiB
    buffers sat beside the two largest samples' working sets. Not measured
    (``memory_aware=False``, as for samples under 10 ms), they keep them for shm.DECAY_S."""
    from autominato.pipeline import scheduler, shm

    if not shm.CAN_PUNCH:
        pytest.skip("this file system cannot give a buffer's pages back (no hole punching)")
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs: samples are not measured")
    monkeypatch.setattr(scheduler, "DECAY_TICK_S", 0.02)
    monkeypatch.setattr(scheduler, "LEAD_WAITS", 10**9)
    monkeypatch.setattr(shm, "DECAY_S", 60.0)
    buffers, warm, measured = _idle_warm_after_the_epoch(memory_aware=True)
    assert measured and buffers >= 3, buffers
    assert warm == 0
    buffers, warm, measured = _idle_warm_after_the_epoch(memory_aware=False)
    assert not measured and buffers >= 3
    assert warm >= 3, (warm, buffers)


def test_a_cold_start_s_waits_do_not_give_the_window_back():
    """Each epoch starts cold (prefetch_next_epoch=False) with slow samples: the loop waits
    while the pipeline fills, which says nothing of who is the bottleneck once it has; the
    lead rule holds once the loader is ahead (trial 97: the whole window came back at every
    epoch's start, +64 MiB of shared memory against the default)."""
    ds = Counted(40, slow=range(0, 6), slow_s=0.12)  # each epoch's first 3 batches
    opened, ahead, taken = [], [], 0
    with loader(ds, prefetch_next_epoch=False) as L:
        for e in range(3):
            L.set_epoch(e)
            for k, b in enumerate(L):
                taken += len(b)
                time.sleep(0.05)
                if k == 5:  # just past the fill: did its waits give the window back?
                    opened.append(L._pipeline.full_lead_left)
                elif k > SETTLE + 3 and not L._pipeline.full_lead_left:
                    ahead.append(ds.started - taken)
    # (a stall of a loaded machine may still count a wait at one epoch's start: not two)
    assert sum(n > 0 for n in opened) <= 1, opened
    assert ahead and max(ahead) <= POOL + BATCH, ahead
