"""The process-worker model: how workers start, what they share, what they never run, their
threads and their random generators."""

from __future__ import annotations

import threading

import numpy as np

from autominato import Loader


def noisy(sample, rng):
    x, i = sample
    return x + rng.standard_normal(x.shape).astype(np.float32), i


class Ones:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return np.ones(3, np.float32), i


# ---------------------------------------------------------------------------------------------
# Consecutive loaders


def test_a_closed_loader_leaves_no_thread_so_the_next_one_can_fork():
    for kw in (dict(workers=2, worker_kind="thread"), dict(workers=2, fuse_read=False), dict(workers=0)):
        with Loader(Ones(), 4, transform=noisy, seed=0, autotune=False, **kw) as loader:
            list(loader)
        left = [t.name for t in threading.enumerate() if t.name.startswith("autominato-")]
        assert left == [], kw
