"""The loader core: exactly-once, completion order, determinism, live knobs, errors, teardown."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
import traceback

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from autominato import Loader
from autominato.pipeline.sampler import epoch_order
from autominato.pipeline.shm import leftover_segments

N = 45


class IndexDataset:
    """Sample i is (a (2, 3) float32 array filled with i, i)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full((2, 3), i, np.float32), i


def noisy(sample, rng):
    x, i = sample
    return x + rng.standard_normal(x.shape).astype(np.float32), i


def delivered(loader) -> list[int]:
    out: list[int] = []
    for _, idx in loader:
        out += idx.tolist()
    return out


def expected_multiset(order: list[int], batch_size: int, drop_last: bool) -> collections.Counter:
    """What torch's DataLoader delivers for the same sampler order (its BatchSampler)."""
    dl = DataLoader(list(range(N)), batch_size=batch_size, sampler=order, drop_last=drop_last)
    return collections.Counter(i for b in dl for i in b.tolist())


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_every_index_is_delivered_exactly_once_per_epoch(workers):
    for batch_size in (1, 7, 32):
        for drop_last in (False, True):
            for shuffle in (False, True):
                with Loader(IndexDataset(), batch_size, shuffle=shuffle, drop_last=drop_last,
                            workers=workers, seed=3, autotune=False) as loader:
                    for epoch in range(3):
                        loader.set_epoch(epoch)
                        got = collections.Counter(delivered(loader))
                        full = epoch_order(N, epoch=epoch, seed=3, shuffle=shuffle)
                        want = expected_multiset(full, batch_size, drop_last)
                        assert got == want, (workers, batch_size, drop_last, shuffle, epoch)
                        assert len(loader) == (N // batch_size if drop_last else -(-N // batch_size))


def test_shuffle_changes_with_epoch_and_matches_seed():
    a = Loader(IndexDataset(), 5, shuffle=True, seed=11, in_order=True, workers=0, autotune=False)
    b = Loader(IndexDataset(), 5, shuffle=True, seed=11, in_order=True, workers=0, autotune=False)
    with a, b:
        e0, e1 = delivered(a), delivered(a)  # two passes without set_epoch: epochs 0 and 1
        b.set_epoch(1)
        assert delivered(b) == e1
        assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(N))


def test_ranks_split_the_epoch_like_distributed_sampler():
    from torch.utils.data import DistributedSampler

    seen = []
    for rank in range(2):
        with Loader(IndexDataset(), 4, shuffle=True, seed=5, rank=rank, world_size=2, in_order=True,
                    workers=0, autotune=False) as loader:
            loader.set_epoch(2)
            got = delivered(loader)
            ds = DistributedSampler(range(N), num_replicas=2, rank=rank, shuffle=True, seed=5)
            ds.set_epoch(2)
            assert got == list(ds)
            seen.append(got)
    # DistributedSampler pads 45 to 46 by repeating one index; apart from that, disjoint.
    assert len(set(seen[0]) & set(seen[1])) <= 1 and set(seen[0]) | set(seen[1]) == set(range(N))


def _gloo_rank(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with Loader(IndexDataset(), 4, shuffle=True, seed=9, workers=1, autotune=False) as loader:
        idx = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            idx.append(delivered(loader))
    gathered = [None, None]
    dist.all_gather_object(gathered, idx)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def test_two_gloo_ranks_share_no_index(tmp_path):
    import torch.multiprocessing as tmp

    out = tmp_path / "idx.pt"
    tmp.spawn(_gloo_rank, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    gathered = torch.load(out)
    for epoch in range(2):
        r0, r1 = gathered[0][epoch], gathered[1][epoch]
        assert len(r0) == len(r1) == 23
        both = collections.Counter(r0) + collections.Counter(r1)
        assert set(both) == set(range(N))
        assert sum(both.values()) == 46  # one padding repeat, as DistributedSampler does


class SlowFor:
    """Transform that sleeps ``seconds`` for the given indices (a straggler)."""

    def __init__(self, slow: set[int], seconds: float) -> None:
        self.slow, self.seconds = slow, seconds

    def __call__(self, sample, rng):
        if sample[1] in self.slow:
            time.sleep(self.seconds)
        return sample


def test_straggler_joins_a_later_batch_and_arrives_once():
    with Loader(IndexDataset(40), 4, transform=SlowFor({1}, 2.0), workers=3, seed=0,
                autotune=False, in_order=False) as loader:
        batches = [b[1].tolist() for b in loader]
        snap = loader.snapshot()
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(40))
    where = next(k for k, b in enumerate(batches) if 1 in b)
    # Batches that the other samples could fill came first; the straggler was not waited for.
    assert where >= 1
    assert all(1 not in b for b in batches[:where])
    assert snap.stragglers_total >= 1


def test_in_order_waits_for_the_straggler():
    with Loader(IndexDataset(12), 4, transform=SlowFor({1}, 0.5), workers=2, seed=0, in_order=True,
                autotune=False) as loader:
        batches = [b[1].tolist() for b in loader]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def _per_index(loader) -> dict[int, np.ndarray]:
    out = {}
    for x, idx in loader:
        for row, i in zip(x.numpy(), idx.tolist(), strict=True):
            out[i] = row.copy()
    return out


def test_augmentation_does_not_depend_on_workers_or_worker_kind():
    ref = None
    for kw in (dict(workers=0), dict(workers=1), dict(workers=3), dict(workers=2, worker_kind="thread"),
               dict(workers=2, fuse_read=False)):
        with Loader(IndexDataset(20), 3, transform=noisy, seed=7, autotune=False, **kw) as loader:
            loader.set_epoch(4)
            got = _per_index(loader)
        if ref is None:
            ref = got
        assert got.keys() == ref.keys()
        for i in ref:
            np.testing.assert_array_equal(got[i], ref[i], err_msg=f"index {i} with {kw}")
    # And the augmentation is not the identity: the noise is really there.
    assert not np.allclose(ref[0], 0.0)


def test_in_order_stream_is_reproducible_bit_for_bit():
    streams = []
    for workers in (1, 3):
        with Loader(IndexDataset(), 6, shuffle=True, transform=noisy, seed=123, in_order=True,
                    workers=workers, autotune=False) as loader:
            streams.append([(x.clone(), i.clone()) for x, i in loader])
    assert len(streams[0]) == len(streams[1]) == 8
    for (xa, ia), (xb, ib) in zip(*streams, strict=True):
        assert torch.equal(ia, ib) and torch.equal(xa, xb)


def test_knobs_change_mid_epoch_without_loss_or_repeat():
    with Loader(IndexDataset(120), 5, transform=SlowFor(set(range(0, 120, 3)), 0.01), workers=1,
                shuffle=True, seed=2, autotune=False) as loader:
        for epoch in range(2):
            got = []
            for k, (_, idx) in enumerate(loader):
                got += idx.tolist()
                if k == 2:
                    loader.knobs.workers = 3
                    loader.knobs.depth = 6
                    loader.knobs.pool_size = 30
                    loader.knobs.read_threads = 4
                if k == 8:
                    loader.knobs.workers = 1
                    loader.knobs.depth = 1
                    loader.knobs.pool_size = 5
                    loader.knobs.read_threads = 1
                if k == 14:
                    loader.knobs.workers = 2
            assert sorted(got) == list(range(120)), epoch
            assert loader.knobs.workers == 2
        assert loader.knobs.bounds("workers")[0] >= 1
        loader.knobs.workers = 10_000  # clamped to its upper bound
        assert loader.knobs.workers == loader.knobs.bounds("workers")[1]


class MultiArgError(Exception):
    def __init__(self, code: int, where: str) -> None:
        super().__init__(f"code {code} at {where}")
        self.code, self.where = code, where


class Unpicklable(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.handle = lambda: None  # lambdas do not pickle


class FailingDataset(IndexDataset):
    def __init__(self, bad: int, exc: type) -> None:
        super().__init__(20)
        self.bad, self.exc = bad, exc

    def sample_path(self, i: int) -> str:
        return f"/data/case_{i:05d}.nii.gz"

    def __getitem__(self, i: int):
        if i == self.bad:
            if self.exc is MultiArgError:
                raise MultiArgError(42, "decode")
            if self.exc is Unpicklable:
                raise Unpicklable("cannot parse header")
            raise self.exc("broken sample")
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_multi_argument_exception_arrives_with_type_index_and_path(workers):
    with Loader(FailingDataset(13, MultiArgError), 4, workers=workers, autotune=False) as loader:
        with pytest.raises(MultiArgError) as info:
            delivered(loader)
    e = info.value
    assert e.code == 42 and "code 42 at decode" in str(e)
    assert e.sample_index == 13 and e.sample_path == "/data/case_00013.nii.gz"
    assert "sample index 13" in "".join(getattr(e, "__notes__", []))
    # The worker's traceback: as the cause when it crossed a process, else the exception's own.
    tb = str(e.__cause__) if workers else "".join(traceback.format_tb(e.__traceback__))
    assert "__getitem__" in tb and "raise MultiArgError" in tb


def test_unpicklable_exception_arrives_readable():
    # Its attribute does not pickle: its type with its message, as the DataLoader rebuilds it
    # (trial 84: a SampleError, which `except Unpicklable` missed)
    with Loader(FailingDataset(5, Unpicklable), 4, workers=2, autotune=False) as loader:
        with pytest.raises(Unpicklable) as info:
            delivered(loader)
    e = info.value
    assert str(e) == "cannot parse header" and not hasattr(e, "handle")
    assert e.sample_index == 5 and e.sample_path.endswith("case_00005.nii.gz")
    note = " ".join(getattr(e, "__notes__", [])) or str(e.__cause__)
    assert "sample index 5" in note and "case_00005.nii.gz" in note
    assert "__getitem__" in str(e.__cause__)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_clean(before: set[int]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = {
            p for p in _children() - before
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            and "forkserver" not in " ".join(psutil.Process(p).cmdline())
        }
        if not extra:
            break
        time.sleep(0.1)
    assert not extra, f"worker processes left behind: {extra}"
    assert leftover_segments(os.getpid()) == []


def test_teardown_after_break_error_and_close_leaves_nothing():
    before = _children()
    loader = Loader(IndexDataset(200), 4, transform=noisy, workers=3, autotune=False)
    for k, _ in enumerate(loader):
        if k == 3:
            break
    assert loader.worker_pids() and leftover_segments(os.getpid())
    loader.close()
    _assert_clean(before)

    with Loader(FailingDataset(3, ValueError), 2, transform=noisy, workers=2, autotune=False) as loader:
        with pytest.raises(ValueError):
            delivered(loader)
    _assert_clean(before)


def test_break_then_new_epoch_is_complete():
    with Loader(IndexDataset(60), 4, transform=noisy, workers=2, autotune=False) as loader:
        for k, _ in enumerate(loader):
            if k == 2:
                break
        assert sorted(delivered(loader)) == list(range(60))


def test_custom_collate_and_dict_samples():
    class DictDS(IndexDataset):
        def __getitem__(self, i):
            return {"x": np.full((3,), i, np.int64), "name": f"s{i}"}

    with Loader(DictDS(10), 4, workers=2, in_order=True, autotune=False) as loader:
        first = next(iter(loader))
        assert first["x"].shape == (4, 3) and first["name"] == ["s0", "s1", "s2", "s3"]
    with Loader(DictDS(10), 4, workers=1, in_order=True, collate_fn=lambda s: [d["name"] for d in s],
                autotune=False) as loader:
        assert list(loader)[-1] == ["s8", "s9"]


class _StartOrder:
    """Records the order in which samples start (thread workers: one process); index ``slow``
    takes 0.3 s, the others 20 ms."""

    def __init__(self, n: int = 12, slow: int = 6) -> None:
        self.n, self.slow, self.starts = n, slow, []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with self._lock:
            self.starts.append(i)
        time.sleep(0.3 if i == self.slow else 0.02)
        return np.full(3, i, np.float32)


@pytest.mark.parametrize("in_order", [False, True])
def test_a_sample_known_to_be_slow_starts_right_after_the_first_batch(in_order):
    # Slow first (pipeline/costs.py): in completion order, once an index's time is known, the
    # slowest of the window starts first after the epoch's first batch; the first epoch, and
    # in order every epoch, go in sampler order. Each epoch still delivers every sample once.
    ds = _StartOrder()
    with Loader(ds, 2, num_workers=2, worker_kind="thread", autotune=False, in_order=in_order,
                prefetch_next_epoch=False) as L:
        for epoch in range(3):
            ds.starts.clear()
            got = sorted(int(x) for b in L for x in b[:, 0])
            assert got == list(range(12))
            # (two threads take the samples in turn: neighbours may record in either order)
            if epoch == 0 or in_order:
                assert ds.starts.index(6) >= 5, (epoch, ds.starts)
            else:
                # (a thread that finished its first sample before the first batch formed
                # takes the next in order: on a loaded machine 6 starts fourth, not third)
                assert ds.starts.index(6) <= 3, (epoch, ds.starts)


def test_a_resumed_run_starts_the_samples_known_to_be_slow_first_in_its_first_epoch():
    # state_dict carries slow first's figures (sample_seconds): the fresh Loader that loads
    # it starts the known-slow sample right after its first batch, as the Loader that measured
    # it would have; without them its first epoch goes in sampler order.
    ds = _StartOrder()
    with Loader(ds, 2, num_workers=2, worker_kind="thread", autotune=False, seed=0,
                prefetch_next_epoch=False, in_order=False) as L:
        assert sorted(int(x) for b in L for x in b[:, 0]) == list(range(12))
        state = L.state_dict()
    seconds = state["sample_seconds"]
    assert len(seconds) == 12 and seconds[6] >= 0.29 and seconds[6] == max(seconds)
    assert all(s >= 0.019 for s in seconds), seconds  # (each sample's sleep, at least)
    for given, early in ((state, True), (dict(state, sample_seconds=None), False)):
        ds.starts.clear()
        with Loader(ds, 2, num_workers=2, worker_kind="thread", autotune=False, seed=0,
                    prefetch_next_epoch=False, in_order=False) as M:
            M.load_state_dict(given)
            assert sorted(int(x) for b in M for x in b[:, 0]) == list(range(12))
            assert (ds.starts.index(6) <= 3) is early, ds.starts  # (3: see the test above)
            # (its own figures of the epoch now; the state's are passed on until then)
            assert M.state_dict()["sample_seconds"][6] > 0.25


def test_a_state_with_bad_sample_seconds_is_refused_with_the_key_named():
    with Loader(_StartOrder(n=4), 2, workers=0, autotune=False, seed=0) as L:
        state = L.state_dict()
        for bad in (["x"] * 4, [0.1] * 3, [float("nan")] * 4, [-1.0] * 4):
            with pytest.raises(ValueError, match="sample_seconds is not a list of 4"):
                L.load_state_dict(dict(state, sample_seconds=bad))


def _slow_transform(sample, rng):
    time.sleep(0.03)  # (reads finish first and wait for it: samples sit between the stages)
    return sample


def test_passes_left_early_leave_no_stage_times_behind():
    # Review 78: with a read stage (thread workers), the read times of samples whose run was
    # ended between stages were kept forever, and past a bound no read time was learnt.
    ds = _StartOrder(n=40, slow=-1)
    with Loader(ds, 2, num_workers=2, worker_kind="thread", autotune=False,
                prefetch_next_epoch=False, transform=_slow_transform) as L:
        for _ in range(20):
            for _batch in L:
                break
        assert sorted(int(x) for b in L for x in b[:, 0]) == list(range(40))
        assert L._pipeline._spent == {}  # (nothing is in flight after a whole epoch)


def test_a_close_that_an_interrupt_cut_short_is_finished_by_the_next(interrupt_once):
    """Trial 158: a second Ctrl-C inside ``with``'s close left the Loader marked closed with
    its workers, fork server and shared memory still there; the exit's close skipped it, and
    the exit waited for the fork server (not a daemon) for ever. The next close finishes."""
    from autominato.pipeline.executors import ProcessExecutor

    before = _children()
    loader = Loader(IndexDataset(40), 4, transform=noisy, workers=2, autotune=False)
    next(iter(loader))
    hits = interrupt_once(ProcessExecutor, "stop")
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert hits and loader.worker_pids()  # cut short: the workers still run
    loader.close()  # (what the exit hook calls)
    _assert_clean(before)


def test_a_child_forked_while_the_parent_closes_closes_its_copy_at_once():
    """Review 164: a child forked while a thread of the parent was inside close() inherited
    the close lock held (by a thread the child does not have) and hung when it closed its
    copy (its exit hook, or close()). A forked child's copy closes nothing, lock or not."""
    import threading

    loader = Loader(IndexDataset(8), 4, workers=0, autotune=False)
    held, release = threading.Event(), threading.Event()

    def hold():
        with loader._close_lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)  # a hang ends the child with SIGALRM
        loader.close()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    release.set()
    t.join()
    loader.close()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
