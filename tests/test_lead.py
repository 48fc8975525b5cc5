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

import threading
import time

import numpy as np

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


def loader(ds: Counted) -> Loader:
    return Loader(ds, batch_size=BATCH, workers=WORKERS, worker_kind="thread",
                  pool_size=POOL, depth=DEPTH, autotune=False)


def test_a_loop_slower_than_the_loader_has_at_most_pool_size_samples_started_ahead():
    ds = Counted(40)
    ahead, taken, waited = [], 0, 0
    with loader(ds) as L:
        for e in range(3):  # the next epoch's samples start in this one's tail: counted too
            L.set_epoch(e)
            for b in L:
                taken += len(b)
                time.sleep(0.05)  # the loop's step; the samples take microseconds
                if L._pipeline.consumer_waits:
                    waited += 1  # (a loaded machine: the loop waited; not judged then)
                else:
                    ahead.append(ds.started - taken)
    assert len(ahead) >= 40, f"the loop waited at {waited} of {waited + len(ahead)} batches"
    # Without the rule: 8 in flight or waiting for a batch, plus 2 batches ready (12).
    assert max(ahead) <= POOL, ahead
    assert max(ahead) >= POOL - BATCH, ahead  # the loader did keep ahead


def test_after_the_loop_waited_the_window_keeps_its_pool_size_beside_the_ready_batches():
    ds = Counted(120, slow=range(20, 30), slow_s=0.1)  # the loader falls behind: the loop waits
    ahead, taken = [], 0
    with loader(ds) as L:
        for b in L:
            taken += len(b)
            time.sleep(0.05)
            if L._pipeline.consumer_waits and int(b[-1]) >= 30:  # within LEAD_WAITS of a wait
                ahead.append(ds.started - taken)
    assert ahead, "the loop never waited"
    # The window's pool_size in flight or waiting for a batch, and depth batches ready beside.
    assert max(ahead) > POOL, ahead
    assert max(ahead) <= POOL + DEPTH * BATCH, ahead
