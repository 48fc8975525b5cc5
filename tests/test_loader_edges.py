"""Edges where the loader once differed from DataLoader or leaked: one test per defect found."""

from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
import threading
import time
import warnings
import weakref
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from autominato import Loader
from autominato.pipeline.shm import leftover_segments


class Indexed:
    """Sample i is (a (4,) float32 array filled with i, i); listed indices sleep or fail."""

    def __init__(self, n: int, slow: dict[int, float] | None = None, bad: set[int] = frozenset(),
                 shape: tuple = (4,)) -> None:
        self.n, self.slow, self.bad, self.shape = n, slow or {}, set(bad), shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        if i in self.slow:
            time.sleep(self.slow[i])
        return np.full(self.shape, i, np.float32), i


def indices(batches) -> list[int]:
    return [int(i) for _, idx in batches for i in idx]


def test_ranks_without_a_seed_share_the_permutation_and_never_overlap():
    ds = Indexed(40)
    shards = []
    for rank in (0, 1):
        with Loader(ds, 4, shuffle=True, rank=rank, world_size=2, workers=0, autotune=False) as L:
            shards.append(indices(L))
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(40))
    # The same shards as DistributedSampler's default seed (0) gives.
    for rank in (0, 1):
        ds_sampler = DistributedSampler(range(40), num_replicas=2, rank=rank, shuffle=True)
        assert sorted(shards[rank]) == sorted(ds_sampler)


def test_seed_none_follows_torch_manual_seed_as_dataloader_does():
    orders = []
    for _ in range(2):
        torch.manual_seed(123)
        with Loader(Indexed(20), 20, shuffle=True, workers=0, autotune=False, in_order=True) as L:
            orders.append(indices(L))
    assert orders[0] == orders[1] and orders[0] != list(range(20))


def test_timeout_zero_means_no_timeout():
    with Loader(Indexed(8, slow={3: 0.3}), 2, workers=1, worker_kind="thread", sample_timeout=0,
                autotune=False) as L:
        assert sorted(indices(L)) == list(range(8))
        assert L.snapshot().skipped_total == 0


def _slots_all_free(loader) -> bool:
    pool = loader._pipeline.slots
    return len(pool._free) == len(pool._all)


class HangOnce:
    """Transform: sample ``index`` hangs past the timeout in every worker."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, sample, rng):
        if int(sample[1]) == self.index:
            time.sleep(30)
        return sample


def test_skip_after_a_timeout_frees_the_samples_shared_memory():
    # Samples big enough (256 KiB) to travel through shared-memory slots.
    ds = Indexed(12, shape=(64, 1024))
    # Without the next epoch started ahead, so that every slot is free between epochs.
    with Loader(ds, 4, transform=HangOnce(5), workers=2, sample_timeout=2.0, on_error="skip",
                autotune=False, prefetch_next_epoch=False) as L:
        counts = []
        for _ in range(3):
            got = indices(L)
            assert sorted(got) == [i for i in range(12) if i != 5]
            assert _slots_all_free(L)
            counts.append(len(leftover_segments(os.getpid())))
        # Slots are created lazily up to the pool's bound (plus its lock file), never beyond.
        assert max(counts) <= 2 * L.knobs.pool_size + 1, counts
        assert L.snapshot().skipped_total == 3


def test_drop_last_with_skipped_samples_never_delivers_a_short_batch():
    with Loader(Indexed(20, bad={3, 11}), 4, drop_last=True, on_error="skip", workers=2,
                autotune=False) as L:
        sizes = [len(idx) for _, idx in L]
    assert sizes == [4, 4, 4, 4]  # 18 good samples: 4 full batches, 2 dropped


def test_two_live_iterators_each_deliver_a_whole_epoch():
    with Loader(Indexed(22), 4, shuffle=True, seed=0, workers=2, autotune=False) as L:
        pairs = list(zip(L, L, strict=True))
        assert len(pairs) == len(L) == 6
        a = sorted(int(i) for (_, ia), _ in pairs for i in ia)
        b = sorted(int(i) for _, (_, ib) in pairs for i in ib)
        assert a == b == list(range(22))


def test_a_sampler_set_by_the_training_loop_is_not_overridden():
    sampler = DistributedSampler(range(16), num_replicas=1, rank=0, shuffle=True, seed=0)
    with Loader(Indexed(16), 16, sampler=sampler, workers=0, in_order=True, autotune=False) as L:
        sampler.set_epoch(5)
        got = indices(L)
    expected = DistributedSampler(range(16), num_replicas=1, rank=0, shuffle=True, seed=0)
    expected.set_epoch(5)
    assert got == list(expected)
    with Loader(Indexed(16), 16, sampler=sampler, workers=0, in_order=True, autotune=False) as L:
        L.set_epoch(7)  # the loader's set_epoch reaches the sampler too
        got = indices(L)
    expected.set_epoch(7)
    assert got == list(expected)


def test_len_of_a_loader_over_a_one_shot_sampler_raises_type_error_and_consumes_nothing():
    sampler = (i for i in range(10))
    with Loader(Indexed(10), 3, sampler=sampler, workers=0, autotune=False) as L:
        with pytest.raises(TypeError, match="no len"):
            len(L)
        assert sorted(indices(L)) == list(range(10))


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_in_flight_samples_are_counted_once_and_sample_bytes_are_measured(kind):
    ds = Indexed(24, slow={i: 0.05 for i in range(24)}, shape=(256,))
    with Loader(ds, 4, workers=2, worker_kind=kind, fuse_read=False, autotune=False) as L:
        it = iter(L)
        next(it)
        time.sleep(0.1)
        snap = L.snapshot()
        for name in ("read", "transform"):
            st = snap.stages[name]
            assert st.busy_workers <= st.workers
            assert st.queue_len + st.busy_workers <= L.knobs.pool_size
        list(it)
        assert L.snapshot().sample_bytes == pytest.approx(256 * 4, rel=0.2)


def test_a_configuration_beyond_this_machines_cores_is_clamped_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, "autominato.pipeline")
    cfg = {"knobs": {"workers": 99}}
    with Loader(Indexed(4), 2, config=cfg, autotune=False, worker_kind="thread") as L:
        assert L.knobs.workers < 99
        assert L.knobs.workers == L.knobs.bounds("workers")[1]
        # the pool sized for the workers used (trial 173: for 99, 109 samples in flight)
        assert L.knobs.pool_size == 2 * 2 + L.knobs.workers + 2
    assert "99 workers" in caplog.text


def test_a_configurations_knob_below_the_loaders_bounds_is_said(caplog):
    """Trial 197: a pool_size below the batch size was raised to it without a word."""
    caplog.set_level(logging.WARNING, "autominato.pipeline")
    with Loader(Indexed(8), 4, config={"knobs": {"pool_size": 2, "depth": 3}}, autotune=False,
                worker_kind="thread", num_workers=1) as L:
        assert (L.knobs.pool_size, L.knobs.depth) == (4, 3)
    said = [r.getMessage() for r in caplog.records if "outside the Loader's bounds" in r.getMessage()]
    assert said == ["the configuration's pool_size=2 is outside the Loader's bounds here "
                    "(pool_size [4, 256]): using pool_size=4"]


def test_knob_arguments_that_override_a_configuration_are_said(caplog):
    """Trial 173: a DataLoader call converted as it was (num_workers=, prefetch_factor=)
    beside config= ran with the call's values, the tuned ones lost without a word."""
    caplog.set_level(logging.WARNING, "autominato.pipeline")
    cfg = {"knobs": {"workers": 1, "depth": 3, "pool_size": 9}}
    with Loader(Indexed(4), 2, config=cfg, autotune=False, worker_kind="thread",
                num_workers=2, prefetch_factor=2) as L:
        assert (L.knobs.workers, L.knobs.depth, L.knobs.pool_size) == (2, 2, 9)
    said = [r.getMessage() for r in caplog.records if "override" in r.getMessage()]
    assert len(said) == 1
    assert ("num_workers=2, prefetch_factor=2 given to the Loader override the "
            "configuration's workers=1, depth=3") in said[0]
    caplog.clear()
    with Loader(Indexed(4), 2, config=cfg, autotune=False, worker_kind="thread",
                num_workers=1) as L:  # (the same value: nothing lost, nothing said)
        pass
    assert not [r for r in caplog.records if "override" in r.getMessage()]


@pytest.mark.parametrize("in_order", [True, False])
def test_settings_given_as_arguments_win_over_a_configurations(in_order):
    """The file's ``loader`` section fills what the call leaves out; ``in_order`` and
    ``worker_kind`` given win, as knob arguments do (review 45: the file's won)."""
    cfg = {"loader": {"worker_kind": "process", "in_order": not in_order}}
    with Loader(Indexed(4), 2, config=cfg, autotune=False, in_order=in_order,
                worker_kind="thread") as L:
        assert L.in_order is in_order and L.worker_kind == "thread"
        assert L._ensure_pipeline().cfg.in_order is in_order
    with Loader(Indexed(4), 2, config=cfg, autotune=False, workers=0, shuffle=True) as L:
        assert L.in_order is (not in_order) and L.worker_kind == "process"
    # An order fixed in advance (no shuffle: evaluation) stays in order before the file's
    # choice, made for training (review 101: a tuned file's in_order false undid it).
    with Loader(Indexed(4), 2, config=cfg, autotune=False, workers=0) as L:
        assert L.in_order is True
    with Loader(Indexed(4), 2, autotune=False, workers=0) as L:  # the dataset's own order
        assert L.in_order is True and L.worker_kind == "process"
    with Loader(Indexed(4), 2, autotune=False, workers=0, shuffle=True) as L:
        assert L.in_order is False


def test_a_configuration_may_turn_memory_aware_dispatch_off_and_an_argument_wins(tmp_path,
                                                                                   caplog):
    """``autominato tune`` measures ``memory_aware`` (its default space searches it) and
    writes it in the file's ``loader`` section: a Loader built from the file runs with it,
    a ``memory_aware`` given to the call wins, and a value that is not a boolean is refused
    with its key."""
    from autominato.config import ConfigError, load_config, save_config

    path = save_config(load_config({"loader": {"memory_aware": False}, "knobs": {"depth": 3}}),
                       tmp_path / "l.yaml")
    with Loader(Indexed(4), 2, config=path, autotune=False, workers=1) as L:
        assert L._ensure_pipeline().cfg.memory_aware is False
        # A copy (a spawned rank's, deep-copied) runs with what this one read, not with the
        # file as it is then (trial 205: a later tune rewrote it, or it is gone)
        save_config(load_config({"loader": {"memory_aware": True}}), path)
        with copy.deepcopy(L) as C:
            assert C._ensure_pipeline().cfg.memory_aware is False and C.knobs.depth == 3
        path.unlink()
        with pickle.loads(pickle.dumps(L)) as P:
            assert P._ensure_pipeline().cfg.memory_aware is False
            assert sorted(indices(P)) == [0, 1, 2, 3]
    path = save_config(load_config({"loader": {"memory_aware": False}}), tmp_path / "l.yaml")
    with caplog.at_level(logging.WARNING, "autominato"):
        with Loader(Indexed(4), 2, config=path, autotune=False, workers=1,
                    memory_aware=True) as L:
            assert L._ensure_pipeline().cfg.memory_aware is True
    assert any("memory_aware=True given to the Loader overrides the configuration's "
               "memory_aware=False" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "autominato"):
        with Loader(Indexed(4), 2, config=path, autotune=False, workers=1,
                    memory_aware=False):
            pass  # (the file's value: nothing lost, nothing said)
    assert not [r for r in caplog.records if "override" in r.getMessage()]
    with Loader(Indexed(4), 2, config={"loader": {}}, autotune=False, workers=1) as L:
        assert L._ensure_pipeline().cfg.memory_aware is True  # the default, not the file's
    with pytest.raises(ConfigError, match=r"loader\.memory_aware: expected true or false"):
        load_config({"loader": {"memory_aware": "no"}})
    with pytest.raises(TypeError, match="memory_aware must be True or False"):
        Loader(Indexed(4), 2, memory_aware="no")


def test_a_configuration_tuned_with_another_batch_size_is_said(tmp_path):
    """A tuned file's batch size is the tune's (its depth counts batches and its pool
    samples of that size); a Loader built with another is warned, at the caller's line,
    once (trial 138: silently ignored, the Loader ran with batch 1; review 140: copies warned
    again from inside the Loader), one with the same, unbatched, or with a batch sampler,
    is not; a batch size that is not a positive integer is refused."""
    import copy

    from autominato.config import ConfigError, load_config

    cfg = {"knobs": {"depth": 3}, "loader": {"batch_size": 4}}
    with pytest.warns(UserWarning, match="tuned with batch size 4, this Loader's is 2") as w:
        L = Loader(Indexed(8), 2, config=cfg, autotune=False, workers=0)
    assert [Path(x.filename).name for x in w] == [Path(__file__).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.deepcopy(L).close()  # a copy is built again from the arguments: said once
        L.close()
        Loader(Indexed(8), 4, config=cfg, autotune=False, workers=0).close()
        Loader(Indexed(8), None, config=cfg, autotune=False, workers=0).close()
        Loader(Indexed(8), config=cfg, autotune=False, workers=0,
               batch_sampler=[[0, 1], [2, 3]]).close()
    bad = tmp_path / "loader.yaml"
    bad.write_text("knobs: {depth: 3}\nloader: {batch_size: '4'}\n")
    with pytest.raises(ConfigError, match="loader.batch_size: expected a positive integer"):
        load_config(bad)
    # A search space given as a configuration says what it is (trial 173: "unknown key")
    with pytest.raises(ConfigError, match="reads as a search space"):
        load_config({"params": {"workers": {"type": "int", "low": 1, "high": 4}}})


def test_a_kept_timeout_error_does_not_keep_a_dropped_iterators_epoch_loading():
    """``timeout=``'s error is raised from no frame that holds the iterator: a training loop
    that keeps it (a notebook's ``sys.last_value``) and drops the iterator stops its epoch
    (review 45: the run went on loading and holding its window)."""
    with Loader(Indexed(40, slow={i: 0.3 for i in range(40)}), 4, workers=2, autotune=False,
                timeout=0.1, in_order=True, prefetch_next_epoch=False,
                worker_kind="thread") as L:
        it = iter(L)
        with pytest.raises(RuntimeError, match="timed out") as info:
            next(it)
        kept = info.value  # noqa: F841 (kept, as a notebook keeps it)
        del it, info
        gc.collect()
        deadline = time.monotonic() + 5
        while L._pipeline.runs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not L._pipeline.runs


def test_a_scheduler_that_fails_before_it_starts_the_epoch_fails_next_instead_of_hanging(
        monkeypatch):
    """A bug in the scheduler thread between ``iter()`` and the run's start: ``next()``
    raises it (review 45: it waited for ever, the run unknown to the failed scheduler)."""
    from autominato.pipeline.scheduler import Pipeline

    def broken(self, run):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(Pipeline, "_begin", broken)
    with Loader(Indexed(4), 2, workers=1, worker_kind="thread", autotune=False) as L:
        out = []

        def consume():
            try:
                next(iter(L))
            except RuntimeError as e:
                out.append(e)

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        t.join(10)
        assert out and isinstance(out[0].__cause__, ZeroDivisionError), "next() hung"


def test_bad_argument_types_name_the_argument():
    with pytest.raises(TypeError, match="batch_size"):
        Loader(Indexed(4), batch_size="2", autotune=False)
    with pytest.raises(ValueError, match="batch_size"):
        Loader(Indexed(4), batch_size=0, autotune=False)
    # the DataLoader raises ValueError for batch_size=2.0, and code catches that (trial 141):
    # a wrong type is a TypeError that is also a ValueError
    for dl in (DataLoader, Loader):
        with pytest.raises(ValueError, match="batch_size"):
            dl(Indexed(4), batch_size=2.0)
        # an empty dataset to shuffle: the DataLoader's RandomSampler refuses it (review 143)
        with pytest.raises(ValueError, match="num_samples should be a positive integer value"):
            dl([], batch_size=2, shuffle=True)
    with pytest.raises(TypeError, match="workers"):
        Loader(Indexed(4), 2, workers="4", autotune=False)
    with pytest.raises(TypeError, match="num_workers"):
        Loader(Indexed(4), 2, num_workers=2.0, autotune=False)
    with pytest.raises(ValueError, match="timeout"):
        Loader(Indexed(4), 2, timeout=-1, autotune=False)
    with pytest.raises(ValueError, match="sample_timeout"):
        Loader(Indexed(4), 2, sample_timeout=-1, autotune=False)


def test_a_loader_dropped_without_close_frees_its_workers_and_shared_memory():
    before = {p.pid for p in psutil.Process().children()}
    L = Loader(Indexed(32, shape=(64, 1024)), 4, workers=2, monitor_interval=5.0)
    it = iter(L)
    next(it)
    pids = set(L.worker_pids())
    assert pids and leftover_segments(os.getpid())
    ref = weakref.ref(L)
    del it, L
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = {p.pid for p in psutil.Process().children()} - before
        if not alive & pids and not leftover_segments(os.getpid()):
            break
        time.sleep(0.1)
    assert not ({p.pid for p in psutil.Process().children()} & pids)
    assert leftover_segments(os.getpid()) == []


# -- found in review of the core (each once reproduced) ------------------------------------------


class Tensors:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


def _cpu_transfer_stage(monkeypatch, fail_at: int | None = None):
    """Build the transfer stage on the CPU: its copy is a 5 ms sleep (or fails at call k)."""
    from autominato.pipeline import scheduler as S
    from autominato.pipeline.stage import Result

    calls = [0]

    def transfer(self, key, job):
        _, payload = job
        if isinstance(payload, S._Final):
            return Result("transfer", key, payload)
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("CUDA out of memory (injected)")
        time.sleep(0.005)
        return Result("transfer", key, payload)

    monkeypatch.setattr(S.PipelineConfig, "cuda", property(lambda self: True))
    monkeypatch.setattr(S.Pipeline, "_transfer", transfer)


def test_the_end_of_an_epoch_never_overtakes_batches_in_the_transfer_stage(monkeypatch):
    _cpu_transfer_stage(monkeypatch)
    with Loader(Tensors(40), 4, workers=1, worker_kind="thread", autotune=False,
                collate_fn=torch.stack) as L:
        for _ in range(3):
            assert sorted(int(x) for b in L for x in b[:, 0]) == list(range(40))


def test_a_failing_transfer_raises_in_the_training_loop_instead_of_hanging(monkeypatch):
    _cpu_transfer_stage(monkeypatch, fail_at=2)
    with Loader(Tensors(40), 4, workers=1, worker_kind="thread", autotune=False,
                collate_fn=torch.stack) as L:
        with pytest.raises(RuntimeError, match="out of memory"):
            for _ in L:
                pass


class _Event:
    """A CUDA event as ``_EpochIterator`` reads it: its copy is done at the second query
    (a copy still running when the training loop first looks), or once synchronized."""

    def __init__(self) -> None:
        self.queries = 0
        self.synced = False

    def query(self) -> bool:
        self.queries += 1
        return self.synced or self.queries > 1

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: _Event) -> float:
        return 2.0  # ms


def _fake_copies(monkeypatch, event: type, *, clone: bool = False, made: list | None = None):
    """The transfer stage on the CPU as the CUDA copy looks to the training loop: a batch's
    copy is the batch itself (with ``clone``, a clone, so that the host batch is only the
    copy's), its events ``event()``; ``made`` gets ``(end event, weakref to the host batch)``
    per batch. Set ``L.device = torch.device("cpu")`` (current_stream's argument only)."""
    from autominato.pipeline import scheduler as S
    from autominato.pipeline.collate import batch_nbytes
    from autominato.pipeline.stage import Result

    def transfer(self, key, job):
        _, payload = job
        if isinstance(payload, S._Final):
            return Result("transfer", key, payload)
        batch, indices, positions = payload
        e0, e1 = event(), event()
        if made is not None:
            made.append((e1, weakref.ref(batch)))
        out = batch.clone() if clone else batch
        return Result("transfer", key, (out, indices, positions,
                                        (e0, e1, batch_nbytes(batch), batch)))

    class Stream:
        def wait_event(self, event) -> None:
            pass

    monkeypatch.setattr(S.PipelineConfig, "cuda", property(lambda self: True))
    monkeypatch.setattr(S.Pipeline, "_transfer", transfer)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())


def test_every_copied_batch_is_counted_in_h2d_bytes_total_the_epochs_last_too(monkeypatch):
    """A copy still running when the training loop takes its batch is counted once it ends;
    at the epoch's end the loader waits for the last ones instead of dropping them."""
    _fake_copies(monkeypatch, _Event)
    with Loader(Tensors(22), 4, workers=1, worker_kind="thread", autotune=False,
                collate_fn=torch.stack) as L:
        L.device = torch.device("cpu")  # (current_stream's argument only)
        for epoch in range(2):
            nbytes = sum(b.numel() * b.element_size() for b in L)
            assert nbytes == 22 * 4 * 4
            snap = L.snapshot()
            assert snap.h2d_bytes_total == (epoch + 1) * nbytes
            assert snap.h2d_seconds_total == pytest.approx((epoch + 1) * 6 * 0.002)


def test_a_copy_wait_that_fails_still_frees_the_pass_and_a_dropped_pass_makes_no_cuda_call(
        monkeypatch):
    """A sticky CUDA error surfaces from the wait for the last copies, and the pass is freed
    all the same; an iterator dropped by the loop (``__del__``, any thread) waits for none."""
    waits = [0]

    class Broken(_Event):
        def query(self) -> bool:
            return False  # never seen done: only the wait at the end would count it

        def synchronize(self) -> None:
            waits[0] += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _fake_copies(monkeypatch, Broken)
    with Loader(Tensors(40), 4, workers=1, worker_kind="thread", autotune=False,
                collate_fn=torch.stack) as L:
        L.device = torch.device("cpu")
        it = iter(L)
        next(it), next(it)
        run = it.run
        with pytest.raises(RuntimeError, match="illegal memory access"):
            it.stop()
        assert run.stopped and it._pending_h2d == []
        it = iter(L)
        next(it)
        run = it.run
        before = waits[0]
        del it  # __del__: no wait, so no error, and the pass is freed
        gc.collect()
        assert run.stopped and waits[0] == before
        # its copy waits at the Loader, with its host batch, until it ends or close()
        assert len(L._orphan_h2d) >= 1


def test_a_dropped_iterators_copies_keep_their_host_batches_until_they_end(monkeypatch):
    """``__del__`` makes no CUDA call, so it cannot wait for its last copies: their host
    batches (pooled, pinned) go to the Loader, which lets them go and counts the copies once
    their events say they ended (review 63: dropping them let the pool refill a buffer that
    a copy still read)."""
    made: list = []

    class Running(_Event):
        done = False

        def query(self) -> bool:
            return self.done

    _fake_copies(monkeypatch, Running, clone=True, made=made)
    with Loader(Tensors(40), 4, workers=1, worker_kind="thread", autotune=False,
                collate_fn=torch.stack) as L:
        L.device = torch.device("cpu")
        it = iter(L)
        kept = next(it)  # the loop keeps its batch and drops the iterator (a break)
        del it
        gc.collect()
        e1, host = made[0]
        assert host() is not None  # its copy still runs: its host batch is held
        nbytes = kept.numel() * kept.element_size()
        assert L.snapshot().h2d_bytes_total == 0
        e1.done = True
        next(iter(L))  # the training loop's next next() counts it and lets it go
        gc.collect()
        assert host() is None
        assert L.snapshot().h2d_bytes_total >= nbytes


def test_a_collate_error_always_reaches_the_training_loop():
    def coll(samples):
        if any(int(s[0]) == 13 for s in samples):
            raise ValueError("bad batch")
        return torch.stack(samples)

    with Loader(Tensors(24), 4, workers=0, autotune=False, collate_fn=coll, in_order=True) as L:
        for _ in range(100):
            with pytest.raises(ValueError, match="bad batch"):
                for _ in L:
                    pass


def test_a_collate_error_behind_batches_in_the_transfer_stage_keeps_its_place(monkeypatch):
    """A batch that cannot be made is an error in its place; the epoch goes on after it. With
    a transfer stage (CUDA) the error waits behind the batches being copied."""
    _cpu_transfer_stage(monkeypatch)

    def coll(samples):
        if any(int(s[0]) == 13 for s in samples):
            raise ValueError("bad batch")
        return torch.stack(samples)

    with Loader(Tensors(24), 4, workers=1, worker_kind="thread", autotune=False, collate_fn=coll,
                in_order=True) as L:
        for _ in range(3):
            seq, it = [], iter(L)
            while True:
                try:
                    seq.append(int(next(it)[0, 0]))
                except StopIteration:
                    break
                except ValueError:
                    seq.append("error")
            assert seq == [0, 4, 8, "error", 16, 20]


def test_errors_in_the_transfer_stage_count_against_the_prefetch_depth(monkeypatch):
    """Items ready for the loop (batches and errors) never exceed ``depth``: an error on its
    way through the batch and transfer stages was counted in neither, so a slow consumer with
    a transfer stage (CUDA) had 2-3 items ready at depth 1."""
    from autominato.pipeline import scheduler as S

    _cpu_transfer_stage(monkeypatch)
    most = [0]
    deliver = S.Run.deliver

    def counted(self, item):
        deliver(self, item)
        most[0] = max(most[0], len(self.out))

    monkeypatch.setattr(S.Run, "deliver", counted)
    coll = lambda b: (torch.stack([torch.as_tensor(x) for x, _ in b]), [i for _, i in b])  # noqa: E731
    with Loader(Indexed(60, bad=set(range(3, 60, 3))), 2, workers=2, worker_kind="thread",
                autotune=False, depth=1, collate_fn=coll, prefetch_next_epoch=False,
                in_order=False) as L:
        it, errors, got = iter(L), 0, []
        while True:
            time.sleep(0.02)  # a consumer slower than the loader
            try:
                got += next(it)[1]
            except StopIteration:
                break
            except ValueError:
                errors += 1
        assert errors == 19 and sorted(got) == [i for i in range(60) if i % 3 or i == 0]
    assert most[0] == 1


def test_in_order_errors_come_after_every_batch_before_the_failing_sample():
    with Loader(Indexed(64, bad={40}), 4, workers=0, autotune=False, in_order=True, depth=8,
                pool_size=64) as L:
        for _ in range(10):
            n = 0
            with pytest.raises(ValueError, match="bad sample 40"):
                for _ in L:
                    n += 1
            assert n == 10  # as DataLoader: batches 0-9, then the error at batch 10


def test_an_iterator_left_waiting_does_not_starve_a_newer_one():
    with Loader(Indexed(200), 4, workers=0, autotune=False) as L:
        peek = iter(L)
        next(peek)
        time.sleep(0.3)  # the first iterator fills its window and waits
        t0 = time.monotonic()
        assert sorted(indices(L)) == list(range(200))
        assert time.monotonic() - t0 < 30
        del peek


def test_after_the_scheduler_fails_a_new_epoch_raises_instead_of_hanging(monkeypatch):
    from autominato.pipeline import scheduler as S

    with Loader(Indexed(20), 4, workers=1, worker_kind="thread", autotune=False) as L:
        assert len(indices(L)) == 20

        def boom(self):
            raise RuntimeError("injected scheduler bug")

        monkeypatch.setattr(S.Pipeline, "_apply_knobs", boom)
        L._pipeline.knobs_changed()
        deadline = time.monotonic() + 5
        while L._pipeline.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="scheduler failed"):
            list(L)


class HalfUnpicklable:
    """Odd samples hold a lock (they cannot be packed); every sample is 128 KiB."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        big = np.zeros(32 * 1024, np.float32)
        return (big, threading.Lock()) if i % 2 else (big, 0)


def test_a_read_that_cannot_be_packed_frees_its_slot():
    with Loader(HalfUnpicklable(), 2, workers=1, fuse_read=False, on_error="skip",
                autotune=False, prefetch_next_epoch=False) as L:  # every slot free between epochs
        for _ in range(3):
            assert sum(len(b[0]) for b in L) == 8
            assert _slots_all_free(L)


# -- from a new user's trial -----------------------------------------------------------------------


def test_unknown_arguments_name_themselves_and_what_to_use():
    with pytest.raises(TypeError, match=r"buffer_size: use pool_size=N") as info:
        Loader(Indexed(4), 2, buffer_size=2, colate_fn=None, autotune=False)
    assert "colate_fn: not an argument of Loader" in str(info.value)


def test_set_epoch_holds_for_every_pass_until_set_again():
    with Loader(Indexed(12), 12, shuffle=True, seed=3, workers=0, in_order=True,
                autotune=False) as L:
        L.set_epoch(4)
        peek = indices([next(iter(L))])
        assert indices(L) == peek  # the peek did not advance the epoch
        L.set_epoch(5)
        assert indices(L) != peek


def test_a_transform_with_an_optional_rng_gets_the_samples_generator():
    def aug(sample, rng=None):
        x, i = sample
        return x + rng.standard_normal(x.shape).astype(np.float32), i

    with Loader(Indexed(4), 4, transform=aug, seed=0, workers=0, autotune=False) as L:
        (x, _), = list(L)
    assert not torch.equal(x, torch.round(x))  # noise was added


def test_knobs_refuse_values_that_are_not_integers():
    with Loader(Indexed(4), 2, workers=0, autotune=False) as L:
        with pytest.raises(TypeError, match="knob depth takes an integer"):
            L.knobs.depth = "3"


WORKER_KINDS = [dict(num_workers=2), dict(num_workers=1, worker_kind="thread"), dict(num_workers=0)]


@pytest.mark.parametrize("kw", WORKER_KINDS, ids=["process", "thread", "none"])
def test_a_pass_that_close_cuts_raises_and_one_it_does_not_cut_ends(kw):
    """``close()`` while a map-style pass is live: a pass with batches of its epoch not taken
    raises at its next ``next()`` (it ended with StopIteration before: a training loop took
    the cut epoch for a whole one), then ends; a loop that closes the Loader after taking its
    epoch's last batch ends as usual (its end may still travel behind that batch)."""
    L = Loader(Indexed(20), 4, shuffle=True, seed=0, autotune=False, **kw)
    it = iter(L)
    got = indices([next(it), next(it)])
    L.close()
    with pytest.raises(RuntimeError, match=r"close\(\) was called while this pass was live: "
                                           r"it ended after 2 batches"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert len(got) == 8

    for _ in range(3):  # (the last batch and the run's end race: a few tries)
        L = Loader(Indexed(20), 4, shuffle=True, seed=0, autotune=False, **kw)
        seen = []
        for k, batch in enumerate(L):
            seen += indices([batch])
            if k == len(L) - 1:
                L.close()  # inside the loop's body, after its last batch
        assert sorted(seen) == list(range(20))


def test_a_pass_that_close_cuts_from_another_thread_raises_in_the_waiting_loop():
    """The loop waits in ``next()`` for a slow sample while another thread closes the Loader
    (a signal handler's shutdown, a watchdog): it raises, not ends the epoch."""
    L = Loader(Indexed(12, slow={i: 0.5 for i in range(4, 12)}), 2, num_workers=1,
               in_order=True, seed=0, autotune=False, prefetch_next_epoch=False)
    it = iter(L)
    next(it)
    threading.Timer(0.3, L.close).start()
    with pytest.raises(RuntimeError, match="close"):
        for _ in it:
            pass


def test_an_iterable_pass_that_close_cuts_ends():
    """An iterable dataset's pass cannot tell a cut from its end (the shards' exhaustion comes
    after the last batch): it ends with StopIteration, as documented."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (np.full(4, i, np.float32) for i in range(40))

    L = Loader(Stream(), 4, num_workers=1, seed=0, autotune=False)
    it = iter(L)
    next(it)
    L.close()
    with pytest.raises(StopIteration):
        next(it)


class Batched(Indexed):
    """A dataset with torch's batched read: ``__getitems__`` returns other data than
    ``__getitem__`` so that which one ran shows."""

    def __getitems__(self, keys):
        return [(np.full(self.shape, 100 + i, np.float32), 100 + i) for i in keys]


@pytest.mark.parametrize("kw", WORKER_KINDS, ids=["process", "thread", "none"])
def test_a_dataset_s_getitems_is_read_as_the_dataloader_reads_it(kw):
    """The DataLoader's fetcher calls ``__getitems__`` where a dataset defines it (trial 160:
    the Loader called ``__getitem__``, other data, silently)."""
    ds = Batched(10)
    with Loader(ds, 2, in_order=True, seed=0, autotune=False, **kw) as L:
        got = indices(L)
    want = indices(DataLoader(ds, 2))
    assert got == want == [100 + i for i in range(10)]
    # torch's Subset defines __getitems__ too, and hands it on
    sub = torch.utils.data.Subset(ds, [3, 1])
    with Loader(sub, 2, in_order=True, seed=0, autotune=False, **kw) as L:
        assert indices(L) == indices(DataLoader(sub, 2)) == [103, 101]


def test_a_getitems_that_returns_no_sample_a_key_is_not_used_and_says_so():
    """A batched ``__getitems__`` that returns columns (a dict of stacked arrays, which torch
    hands to ``collate_fn`` whole) cannot give one sample per index: the samples are read
    through ``__getitem__``, with a warning (review 161: a one-key dict gave its key string)."""

    class Columns(Indexed):
        def __getitems__(self, keys):
            return {"x": np.stack([np.full(self.shape, i, np.float32) for i in keys])}

    with Loader(Columns(4), 2, num_workers=0, in_order=True, seed=0, autotune=False) as L:
        with pytest.warns(UserWarning, match=r"Columns.__getitems__\(\[0\]\) returned dict of "
                                             r"length 1, not a list of one sample"):
            got = indices(L)
    assert got == [0, 1, 2, 3]


def test_a_drop_last_that_is_no_bool_is_refused_as_dataloader():
    # The DataLoader's BatchSampler refuses it in these words; "yes" was read as True (trial 166).
    for L in (torch.utils.data.DataLoader, Loader):
        with pytest.raises(ValueError, match="drop_last should be a boolean value, but got "
                                             "drop_last=yes"):
            L(list(range(4)), batch_size=2, drop_last="yes")
