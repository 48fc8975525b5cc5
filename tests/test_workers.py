"""The process-worker model: how workers start, what they share, what they never run, their
threads and their random generators."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from autominato import Loader

# ---------------------------------------------------------------------------------------------
# 5. Thread workers leave the training process's generators alone


def noisy(sample, rng):
    x, i = sample
    return x + rng.standard_normal(x.shape).astype(np.float32), i


class Ones:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return np.ones(3, np.float32), i


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()


@pytest.mark.parametrize("kw", [dict(workers=2, worker_kind="thread"), dict(workers=0)],
                         ids=["thread-workers", "inline"])
def test_thread_workers_leave_the_training_processs_random_generators_alone(kw):
    def seed_all() -> None:
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)

    seed_all()
    want = draws()
    seed_all()
    for seed in (1, 2):
        with Loader(Ones(), 4, transform=noisy, seed=seed, autotune=False, **kw) as loader:
            assert sum(len(i) for _, i in loader) == 12
    assert draws() == want  # before: reseeded from the worker threads, the same every run


# ---------------------------------------------------------------------------------------------
# Consecutive loaders


def test_a_closed_loader_leaves_no_thread_so_the_next_one_can_fork():
    for kw in (dict(workers=2, worker_kind="thread"), dict(workers=2, fuse_read=False), dict(workers=0)):
        with Loader(Ones(), 4, transform=noisy, seed=0, autotune=False, **kw) as loader:
            list(loader)
        left = [t.name for t in threading.enumerate() if t.name.startswith("autominato-")]
        assert left == [], kw
