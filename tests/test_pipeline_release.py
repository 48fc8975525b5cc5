"""What an abandoned run leaves behind in the scheduler: nothing (batches that waited for room
in its output, slots, bookkeeping)."""

from __future__ import annotations

import time

import numpy as np

from autominato import Loader


class Arrays:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(4, i, np.float32)


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_abandoned_run_leaves_no_batch_bookkeeping_behind():
    # depth=1: once a batch waits in the run's output, the next ones wait in the batch stage's
    # queue; abandoning the run drops them, and their count of samples being collated with them
    with Loader(Arrays(64), 2, num_workers=1, worker_kind="thread", depth=1, pool_size=16, autotune=False,
                prefetch_next_epoch=False) as L:
        for _ in range(3):
            it = iter(L)
            next(it)
            p = L._pipeline
            wait_until(lambda p=p: len(p.batch_stage.queue) >= 2)
            run = it.run
            it.stop()
            wait_until(lambda run=run: run.closed)
            wait_until(lambda p=p: not p.batch_stage.queue)
        assert p._collating == {}


class Unpicklable(Arrays):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = __import__("threading").Lock()  # cloudpickle refuses a lock


def test_a_pipeline_that_fails_to_build_leaves_no_thread_behind():
    import threading

    import pytest

    before = {t.ident for t in threading.enumerate()}
    # persistent_workers=False pickles the dataset when the pipeline is built; the read
    # threads of fuse_read=False exist by then. When an earlier test left a thread running
    # in this process, workers start from a fresh interpreter and the pickle check refuses
    # the dataset first (another message, same failure at build time)
    with pytest.raises(ValueError, match="persistent_workers=False|must be picklable"):
        Loader(Unpicklable(8), 2, num_workers=1, persistent_workers=False, fuse_read=False,
               autotune=False)
    wait_until(lambda: not [t.name for t in threading.enumerate()
                            if t.ident not in before and t.name.startswith("autominato")], 5)


class Gated(Arrays):
    """Each sample touches ``<dir>/busy-<pid>`` and waits for ``<dir>/open``."""

    def __init__(self, n: int, where: str) -> None:
        super().__init__(n)
        self.where = where

    def __getitem__(self, i: int):
        import os
        from pathlib import Path

        Path(self.where, f"busy-{os.getpid()}").touch()
        while not Path(self.where, "open").exists():
            time.sleep(0.01)
        return super().__getitem__(i)


def test_workers_shrunk_then_grown_while_busy_keep_distinct_ids(tmp_path):
    # 4 -> 2 -> 4 while every worker is busy: ids 2 and 3 are still running (retiring) when
    # the workers come back, so they serve again rather than two new workers taking their ids
    with Loader(Gated(64, str(tmp_path)), 1, num_workers=4, autotune=False,
                prefetch_next_epoch=False) as L:
        it = iter(L)
        wait_until(lambda: len(list(tmp_path.glob("busy-*"))) == 4)
        pool = L._pipeline.procs.pool
        L.knobs.workers = 2
        wait_until(lambda: pool.size == 2)
        L.knobs.workers = 4
        wait_until(lambda: pool.size == 4)
        slots = [w.slot for w in list(pool.workers.values())]
        (tmp_path / "open").touch()
        assert sorted(slots) == [0, 1, 2, 3]
        assert sorted(int(b) for batch in it for b in batch[:, 0].tolist()) == list(range(64))
