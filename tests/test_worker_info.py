"""Workers as the DataLoader's: ids in [0, workers), ``get_worker_info()`` inside them,
``worker_init_fn`` in every worker (replacements and added ones too), and
``persistent_workers=False`` seeing the dataset as it is at each epoch (issue 13)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

import autominato
from autominato import Loader
from autominato.pipeline.errors import WorkerInitError


class Info:
    """Sample i: ``[i, id, num_workers, seed, pid]`` from ``get_worker_info()`` where it is read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        assert info is None or info.dataset is not None
        if info is None:
            return np.array([i, -1, -1, -1, os.getpid()], np.int64)
        return np.array([i, info.id, info.num_workers, info.seed, os.getpid()], np.int64)


def info_in_transform(sample, rng):
    """The transform's view (thread workers: reads run in the read threads)."""
    torch_info = torch.utils.data.get_worker_info()
    ours = autominato.get_worker_info()
    assert torch_info is ours
    return np.array([sample[0], ours.id, ours.num_workers, ours.seed, threading.get_ident()], np.int64)


def rows(loader) -> list[list[int]]:
    return [r for b in loader for r in b.tolist()]


def record_init(folder: str, worker_id: int) -> None:
    """worker_init_fn: one file per call, ``<id>-<pid>-<thread>-<n>`` (n: calls so far here)."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    tag = f"{worker_id}-{os.getpid()}-{threading.get_ident()}"
    n = len([p for p in os.listdir(folder) if p.startswith(tag + "-")])
    Path(folder, f"{tag}-{n}").touch()


def inits(folder: Path) -> list[tuple[int, int, int]]:
    """(id, pid, thread) of each worker_init_fn call so far."""
    return [tuple(int(x) for x in p.name.split("-")[:3]) for p in folder.iterdir()]


def wait_until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("start_method", ["auto", "forkserver"])
def test_get_worker_info_in_process_workers_is_torchs_with_dataloaders_seed(start_method):
    with Loader(Info(24), 4, num_workers=2, seed=100, start_method=start_method,
                autotune=False) as L:
        got = rows(L)
        assert sorted(r[0] for r in got) == list(range(24))
        assert {(r[1], r[2]) for r in got} <= {(0, 2), (1, 2)}
        assert all(r[3] == 100 + r[1] for r in got)  # DataLoader's base_seed + worker id
        assert {r[4] for r in got} <= set(L.worker_pids()) and os.getpid() not in {r[4] for r in got}
    assert torch.utils.data.get_worker_info() is None and autominato.get_worker_info() is None


@pytest.mark.parametrize("workers", [0, 3])
def test_get_worker_info_in_thread_workers_and_none_in_the_training_loop(workers):
    seen: list = []

    def spy(sample, rng):
        seen.append(torch.utils.data.get_worker_info())
        return info_in_transform(sample, rng) if seen[-1] is not None else sample

    with Loader(Info(30), 3, num_workers=workers, worker_kind="thread", transform=spy, seed=5,
                autotune=False) as L:
        got = rows(L)
        assert torch.utils.data.get_worker_info() is None  # the training loop's thread
        assert autominato.get_worker_info() is None
    assert sorted(r[0] for r in got) == list(range(30))
    if workers == 0:  # no worker: None, as under the DataLoader
        assert seen == [None] * 30
        return
    assert {r[2] for r in got} == {3} and {r[1] for r in got} <= {0, 1, 2}
    assert all(r[3] == 5 + r[1] for r in got)
    assert threading.get_ident() not in {r[4] for r in got}
    # one id per thread
    assert len({(r[1], r[4]) for r in got}) == len({r[4] for r in got})


EARLY_BOUND = """
import sys
import torch
from torch.utils.data import get_worker_info  # bound before any Loader exists
from autominato import Loader

class Shards(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(w, 12, n))

assert get_worker_info() is None
with Loader(Shards(), batch_size=2, num_workers=3, worker_kind="thread", autotune=False) as L:
    got = sorted(int(x) for b in L for x in b)
assert get_worker_info() is None  # the training loop's thread
print(got)
"""


def test_thread_workers_shard_an_iterable_that_bound_torchs_getter_before_the_loader():
    """A dataset module's ``from torch.utils.data import get_worker_info`` runs before any
    Loader (a fresh interpreter, so that no earlier test installed the getter first)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EARLY_BOUND], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(list(range(12)))  # each sample once, not once per worker


def test_worker_init_fn_runs_in_every_process_worker_replacements_and_added_ones(tmp_path):
    init = functools.partial(record_init, str(tmp_path))
    with Loader(Info(40), 4, num_workers=2, worker_init_fn=init, autotune=False) as L:
        rows(L)
        wait_until(lambda: len(inits(tmp_path)) == 2)  # a worker may start after the epoch
        calls = inits(tmp_path)
        assert sorted(i for i, _, _ in calls) == [0, 1]
        assert {p for _, p, _ in calls} == set(L.worker_pids())
        # a worker killed: its replacement takes the free id and runs worker_init_fn
        pid_of = {p: i for i, p, _ in calls}
        victim = L.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        got = rows(L)
        assert sorted(r[0] for r in got) == list(range(40))
        wait_until(lambda: len(inits(tmp_path)) == 3)
        (new,) = [c for c in inits(tmp_path) if c not in calls]
        assert new[0] == pid_of[victim] and new[1] not in pid_of
        assert {r[1] for r in got} <= {0, 1}  # ids stay in [0, workers)
        # a worker the controller (here: the user) adds runs it too, with the next id
        L.knobs.workers = 3
        wait_until(lambda: len(inits(tmp_path)) == 4)
        added = [c for c in inits(tmp_path) if c not in calls and c != new]
        assert [c[0] for c in added] == [2]
        got = rows(L)
        assert sorted(r[0] for r in got) == list(range(40)) and {r[1] for r in got} <= {0, 1, 2}
    # once per worker: no worker ran it twice
    assert all(p.name.endswith("-0") for p in tmp_path.iterdir())


def test_worker_init_fn_runs_once_in_every_thread_worker_added_ones_too(tmp_path):
    init = functools.partial(record_init, str(tmp_path))
    # (prefetch_next_epoch=False: the last epoch must start after the knob change)
    with Loader(Info(20), 4, num_workers=2, worker_kind="thread", transform=info_in_transform,
                worker_init_fn=init, autotune=False, prefetch_next_epoch=False) as L:
        got = rows(L)
        wait_until(lambda: len(inits(tmp_path)) == 2)
        assert sorted(i for i, _, _ in inits(tmp_path)) == [0, 1]
        assert {p for _, p, _ in inits(tmp_path)} == {os.getpid()}
        # the threads that ran worker_init_fn(id) are those whose get_worker_info says id
        assert {(r[1], r[4]) for r in got} <= {(i, t) for i, _, t in inits(tmp_path)}
        L.knobs.workers = 3
        wait_until(lambda: len(inits(tmp_path)) == 3)
        assert sorted(i for i, _, _ in inits(tmp_path)) == [0, 1, 2]
        L.knobs.workers = 1  # the highest ids retire first
        got = rows(L)
        assert {r[1] for r in got} == {0}


def broken_init(worker_id: int) -> None:
    raise OSError(f"cannot open the shard file of worker {worker_id}")


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_an_error_in_worker_init_fn_is_raised_naming_it(kind):
    with Loader(Info(8), 2, num_workers=1, worker_kind=kind, worker_init_fn=broken_init,
                autotune=False) as L:
        with pytest.raises(WorkerInitError, match=r"worker_init_fn\(0\) raised OSError: cannot "
                                                  "open the shard file of worker 0") as info:
            rows(L)
    # of the type worker_init_fn raised too, as DataLoader re-raises it: `except OSError` works
    assert isinstance(info.value, OSError) and isinstance(info.value, RuntimeError)
    assert "cannot open the shard file" in "".join(traceback.format_exception(info.value.__cause__))


def init_failing_first(folder: str, fails: int, wid: int) -> None:
    """worker_init_fn that raises in its first ``fails`` calls (counted across processes by
    the files it claims in ``folder``), then succeeds."""
    n = 0
    while True:
        try:
            os.close(os.open(os.path.join(folder, str(n)), os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            n += 1
    if n < fails:
        raise OSError(f"cannot open the shard file of worker {wid}")


def test_a_worker_whose_init_failed_is_no_death_and_the_next_pass_runs(tmp_path, caplog):
    """The worker said why it cannot work and exited: no "died (exit code 0); replacing it"
    warning; once the cause is gone, the next pass loads everything."""
    init = functools.partial(init_failing_first, str(tmp_path), 2)
    with Loader(Info(8), 2, num_workers=2, worker_init_fn=init, autotune=False) as L:
        with caplog.at_level(logging.WARNING, logger="autominato"):
            with pytest.raises(WorkerInitError):
                rows(L)
            time.sleep(0.5)  # every report of the failing ones reached the loader
            # no replacement ran worker_init_fn before the next pass
            assert len(os.listdir(tmp_path)) == 2
            assert sorted(int(r[0]) for r in rows(L)) == list(range(8))
        assert not [r for r in caplog.records if "died" in r.getMessage()]


def test_a_late_report_of_the_same_init_failure_is_not_raised_again():
    """Workers started together fail together: the first report is raised; a report from a
    worker started before it was raised must not end a pass begun since."""
    from types import SimpleNamespace

    from autominato.pipeline.errors import ErrorReport
    from autominato.pipeline.executors import ProcessExecutor

    raised = []
    ex = ProcessExecutor.__new__(ProcessExecutor)
    worker = lambda ready=False: SimpleNamespace(info={}, ready=ready)  # noqa: E731
    ex.pool = SimpleNamespace(workers={0: worker(), 1: worker(), 2: worker(ready=True)}, dead={})
    ex.on_fatal, ex._fatal_wave = raised.append, set()
    report = lambda wid: ErrorReport.capture(OSError(f"init {wid}"), -1, None, f"worker {wid}")  # noqa: E731
    assert ex._reply(0, ("fatal", report(0))) == [] and len(raised) == 1
    assert ex._reply(1, ("fatal", report(1))) == [] and len(raised) == 1  # same wave
    # a worker that was ready (its re-init with persistent_workers=False failed), or one
    # started after, is a new failure
    assert ex._reply(2, ("fatal", report(2))) == [] and len(raised) == 2
    ex.pool.workers[3] = worker()
    assert ex._reply(3, ("fatal", report(3))) == [] and len(raised) == 3
    assert all(w.info.get("fatal") for w in ex.pool.workers.values())


def test_a_worker_init_fn_that_always_fails_raises_its_own_error_at_every_pass(tmp_path):
    """Not, every few passes, an unexplained "died before they were ready" WorkerDied."""
    init = functools.partial(init_failing_first, str(tmp_path), 10**6)
    with Loader(Info(8), 2, num_workers=2, worker_init_fn=init, autotune=False) as L:
        for _ in range(6):
            with pytest.raises(WorkerInitError, match="cannot open the shard file"):
                rows(L)


class UntilFlag:
    """worker_init_fn that looks for ``flag`` at once and, after ``delay`` s, raises if it was
    missing: a worker started before the cause was fixed reports its failure later."""

    def __init__(self, flag: str, delay: float) -> None:
        self.flag, self.delay = flag, delay

    def __call__(self, wid: int) -> None:
        missing = not os.path.exists(self.flag)
        time.sleep(self.delay)
        if missing:
            raise KeyError(f"no credentials for worker {wid}")


@pytest.mark.parametrize("knob", [False, True])
def test_the_pass_after_the_fix_of_a_failing_worker_init_fn_runs(tmp_path, knob):
    """As the DataLoader's fresh workers: workers that ran worker_init_fn before the cause was
    fixed do not fail the pass begun after it. The failed workers were replaced at once, the
    replacements failed again before the fix, and their reports failed the next one or two
    passes; a knob change between the error and the fix (the controller's, say) started them
    too (review 42)."""
    flag = tmp_path / "ok"
    with Loader(Info(8), 2, num_workers=2, worker_init_fn=UntilFlag(str(flag), 0.5),
                autotune=False) as L:
        with pytest.raises(WorkerInitError, match="no credentials"):
            rows(L)
        time.sleep(0.2)
        if knob:
            L.knobs.set("depth", L.knobs.depth + 1)
        time.sleep(0.3)  # (replacements started at once would look for the flag by now)
        flag.touch()
        assert sorted(int(r[0]) for r in rows(L)) == list(range(8))


def test_each_pass_raises_its_own_worker_init_fn_error_until_the_cause_goes():
    """One worker whose worker_init_fn fails its first three calls: passes 1-3 raise calls
    0-2's errors and pass 4 runs. The third failure was the third start death in a row
    (max_tries) and raised call 2's error again in pass 4 (review 42)."""
    calls = []

    def init(wid: int) -> None:
        n = len(os.listdir(folder))
        open(os.path.join(folder, str(n)), "w").close()
        if n < 3:
            raise OSError(f"call {n} failed")

    folder = tempfile.mkdtemp()
    with Loader(Info(8), 2, num_workers=1, worker_init_fn=init, autotune=False) as L:
        for _ in range(5):
            try:
                calls.append(len(rows(L)))
            except WorkerInitError as e:
                calls.append(str(e).split("call ")[1][0])
    assert calls == ["0", "1", "2", 8, 8]


class Offset:
    """Sample i is ``i + offset``; ``offset`` is changed by the training loop between epochs."""

    def __init__(self, n: int) -> None:
        self.n, self.offset = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.int64(i + self.offset)


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_workers_false_sees_a_dataset_change_between_epochs(persistent, tmp_path):
    ds = Offset(12)
    init = functools.partial(record_init, str(tmp_path))
    with Loader(ds, 4, num_workers=2, persistent_workers=persistent, worker_init_fn=init,
                autotune=False) as L:
        assert sorted(x for b in L for x in b.tolist()) == list(range(12))
        wait_until(lambda: len(inits(tmp_path)) == 2)
        assert sorted(x for b in L for x in b.tolist()) == list(range(12))
        time.sleep(0.2)
        # persistent: one worker_init_fn a worker; else each pass but the first gets a fresh
        # copy, as the DataLoader's fresh workers: worker_init_fn again (trial 166)
        assert len(inits(tmp_path)) == (2 if persistent else 4)
        ds.offset = 100
        after = sorted(x for b in L for x in b.tolist())
        if persistent:
            # True (autominato's default, unlike DataLoader's): the workers keep the dataset
            # they started with, as DataLoader's persistent workers do
            assert after == list(range(12))
            return
        assert after == list(range(100, 112))
        wait_until(lambda: len(inits(tmp_path)) == 6)
        assert sorted(i for i, _, _ in inits(tmp_path)) == [0, 0, 0, 1, 1, 1]
        # a replacement worker gets the dataset as last sent, not the one it was forked with
        os.kill(L.worker_pids()[0], signal.SIGKILL)
        assert sorted(x for b in L for x in b.tolist()) == list(range(100, 112))


class Drawn:
    """Sample i is a draw of a generator that ``worker_init_fn`` seeds from the worker's
    seed (the idiom of PyTorch's reproducibility notes for generators of one's own)."""

    def __init__(self, n: int) -> None:
        self.n, self.version, self.rng = n, 0, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.array([self.rng.integers(1 << 62), torch.utils.data.get_worker_info().seed])


def seed_own_generator(_: int) -> None:
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)


def test_a_dataset_sent_again_comes_with_a_new_worker_seed_each_epoch(kind="process", epochs=3):
    # persistent_workers=False with a dataset that changes each epoch (a curriculum): the
    # workers take the new copy and run worker_init_fn again, as the DataLoader's fresh
    # workers; they got the same seed each time, so a generator seeded from it drew the same
    # numbers every epoch (the DataLoader's workers get a new base_seed each epoch). Ray's
    # actors: tests/test_ray.py.
    ds = Drawn(8)
    seen, draws = [], []
    with Loader(ds, 4, num_workers=2, persistent_workers=False, worker_init_fn=seed_own_generator,
                worker_kind=kind, seed=5, autotune=False) as L:
        for _ in range(epochs):
            rows = np.concatenate([b.numpy() for b in L])
            draws.append(set(rows[:, 0].tolist()))
            seen.append(set(rows[:, 1].tolist()))
            ds.version += 1  # changed: sent again at the next epoch
    assert seen[0] <= {5, 6}  # the first workers' seeds: the Loader's seed plus the worker id
    for e in range(1, epochs):
        assert not seen[e] & set().union(*seen[:e]) and not draws[e] & set().union(*draws[:e])


class LazyLines(torch.utils.data.IterableDataset):
    """Opens its file at the first ``__iter__``, in the worker, and shards its lines (trial
    166's repro); ``cache`` counts the lines a copy has read."""

    def __init__(self, path: str) -> None:
        self.path, self.f, self.cache = path, None, 0

    def __iter__(self):
        if self.f is None:
            self.f = open(self.path)  # noqa: SIM115 - the worker's copy holds it
        info = torch.utils.data.get_worker_info()
        for k, line in enumerate(self.f):
            self.cache += 1
            if info is None or k % info.num_workers == info.id:
                yield np.int64(int(line))


@pytest.mark.parametrize("persistent", [False, True])
def test_what_a_worker_changed_in_its_copy_is_gone_at_the_next_epoch_without_persistence(
        persistent, tmp_path):
    # persistent_workers=False: the DataLoader's workers start afresh each epoch with a fresh
    # copy; the Loader's kept theirs while the dataset here was unchanged, so a file opened in
    # the worker stayed at its end and epochs 2 and 3 were empty (trial 166: 12, 0, 0).
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"{i}\n" for i in range(12)))
    ds = LazyLines(str(path))
    ref = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2,
                                      persistent_workers=persistent)
    want = [len([x for b in ref for x in b]) for _ in range(3)]
    del ref
    with Loader(ds, batch_size=4, num_workers=2, persistent_workers=persistent,
                autotune=False) as L:
        got = [len([x for b in L for x in b]) for _ in range(3)]
    assert got == want == ([12, 12, 12] if not persistent else [12, 0, 0])


def test_persistent_workers_false_with_an_iterable_dataset():
    from test_iterable import Numbers

    ds = Numbers(10)
    with Loader(ds, 3, num_workers=2, persistent_workers=False, autotune=False) as L:
        assert sorted(r[0] for b in L for r in b.tolist()) == list(range(10))
        ds.n = 14
        assert sorted(r[0] for b in L for r in b.tolist()) == list(range(14))


class Heavy:
    """An in-memory dataset of 8 MiB: its pickle is as large."""

    def __init__(self) -> None:
        self.blob = np.ones(1 << 23, np.uint8)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return np.int64(i)


def pickled_copies_in_callers(folder: str, wid: int) -> None:
    """worker_init_fn: write how many byte strings of >= 4 MiB its callers' frames hold."""
    import sys

    held, frame = 0, sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()) + [
                v for t in frame.f_locals.values() if isinstance(t, tuple) for v in t]:
            if isinstance(value, (bytes, bytearray, memoryview)) and len(value) >= 1 << 22:
                held += 1
        frame = frame.f_back
    Path(folder, f"{os.getpid()}-{time.monotonic_ns()}").write_text(str(held))


@pytest.mark.parametrize("persistent", [True, False])
def test_a_worker_drops_the_pickled_dataset_before_worker_init_fn(persistent, tmp_path):
    """The pickled bytes of the dataset (as large as an in-memory one) are not held beside
    the unpickled copy while worker_init_fn runs, nor after (persistent_workers=False sends
    the dataset anew every epoch)."""
    init = functools.partial(pickled_copies_in_callers, str(tmp_path))
    ds = Heavy()
    with Loader(ds, 2, num_workers=2, persistent_workers=persistent, worker_init_fn=init,
                autotune=False) as loader:
        for epoch in range(2):
            ds.blob[0] = epoch + 7  # a changed dataset is sent anew (persistent_workers=False)
            assert sorted(int(x) for b in loader for x in b) == [0, 1, 2, 3]
    counts = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert len(counts) >= (2 if persistent else 4) and counts == [0] * len(counts)


class Straggler:
    """Sample 1 of the first version sleeps ``hang`` s (touching ``mark`` first); ``blob`` makes
    the dataset's pickle larger than a socket's buffer, so sending it blocks until read."""

    def __init__(self, n: int, mark: str, hang: float) -> None:
        self.n, self.mark, self.hang, self.version = n, mark, hang, 0
        self.blob = np.zeros(16 << 20, np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == 1 and self.version == 0:
            Path(self.mark).touch()
            time.sleep(self.hang)
        return np.int64(i + 100 * self.version)


def test_persistent_workers_false_a_busy_worker_does_not_hold_up_the_next_epoch(tmp_path):
    # The changed dataset goes to each worker when it is idle: a worker still on an abandoned
    # epoch's straggler must not block the scheduler thread (which sent the big pickle to it
    # and waited for it to be read: the whole pipeline stalled for the straggler's duration).
    mark = tmp_path / "straggling"
    ds = Straggler(8, str(mark), hang=60.0)
    with Loader(ds, 1, num_workers=2, persistent_workers=False, autotune=False) as L:
        it = iter(L)
        next(it)
        wait_until(mark.exists)
        it.stop()
        ds.version = 1
        t0 = time.monotonic()
        first = next(iter(L))
        assert time.monotonic() - t0 < 20
        assert first.item() >= 100


def test_a_worker_init_errors_original_type_pickles_and_spares_stop_iteration():
    """The class deriving from both pickles (a training function under multiprocessing sends
    its error back); a StopIteration, or what is no Exception, stays a plain WorkerInitError
    (a StopIteration would end the training loop's for silently)."""
    import pickle

    from autominato.pipeline.errors import with_original_type

    def made(t):
        return with_original_type(WorkerInitError(
            "worker_init_fn(0) raised ...", original_type=(t.__module__, t.__qualname__)))

    for t in (ValueError, KeyError, FileNotFoundError):
        err = made(t)
        back = pickle.loads(pickle.dumps(err))
        assert isinstance(err, t) and isinstance(back, t) and isinstance(back, WorkerInitError)
        assert str(back) == str(err) == "worker_init_fn(0) raised ..."  # no KeyError quotes
    for t in (StopIteration, SystemExit, KeyboardInterrupt):
        assert type(made(t)) is WorkerInitError


class _Range(torch.utils.data.IterableDataset):
    """torch's documentation example: ``range(start, end)``, sharded by ``_shard_by_info``."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__()
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def _shard_by_info(worker_id: int) -> None:
    # torch.utils.data.IterableDataset's docstring: each worker keeps its share of the range.
    info = torch.utils.data.get_worker_info()
    ds = info.dataset
    per = -(-(ds.end - ds.start) // info.num_workers)
    ds.start = ds.start + info.id * per
    ds.end = min(ds.start + per, ds.end)


@pytest.mark.parametrize("persistent", [True, False])
def test_a_worker_init_fn_that_shards_an_iterable_stays_exact_when_the_worker_count_changes(
        persistent):
    # Trial 84: the workers running kept the shares worker_init_fn gave them for the old count
    # (16 items of 12 at 3 workers, 6 at 1); the controller may change the count too.
    with Loader(_Range(0, 12), batch_size=4, num_workers=2, worker_init_fn=_shard_by_info,
                persistent_workers=persistent, autotune=False) as loader:
        for workers in (2, 3, 1, 2, 4):
            loader.num_workers = workers
            got = sorted(int(x) for b in loader for x in b)
            assert got == list(range(12)), (workers, got)


def _no_third_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    if info.num_workers == 3 and info.id == 2:
        raise RuntimeError("no third worker")
    _shard_by_info(worker_id)


def test_workers_that_survived_a_failed_worker_init_fn_are_renewed_for_the_new_count():
    # Review 86: after worker 2 of 3 failed its worker_init_fn, the two survivors held their
    # shares of 3; setting num_workers=2 (their number) kept them: 8 of 12 items each epoch.
    with Loader(_Range(0, 12), batch_size=2, num_workers=3, worker_init_fn=_no_third_worker,
                autotune=False) as loader:
        with pytest.raises(WorkerInitError):
            list(loader)
        loader.num_workers = 2
        for _ in range(2):
            assert sorted(int(x) for b in loader for x in b) == list(range(12))


_AT_INIT: list[float] = []


def _globals_at_init(worker_id: int) -> None:
    """worker_init_fn: what the global generators hold when it runs (trial 84: the idiom of
    PyTorch's reproducibility notes, ``np.random.seed(torch.initial_seed() % 2**32)``, needs
    ``torch.initial_seed()`` to be ``get_worker_info().seed`` there)."""
    import random

    info = torch.utils.data.get_worker_info()
    _AT_INIT[:] = [worker_id, info.seed % 2**32, torch.initial_seed() % 2**32, random.random(),
                   float(np.random.random()), float(torch.rand(()))]


class AtInit:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        time.sleep(0.05)  # (so that both workers serve samples)
        return torch.tensor(_AT_INIT, dtype=torch.float64)


def test_worker_init_fn_sees_the_global_generators_seeded_as_the_dataloader_seeds_them():
    def run(cls, **kw):
        with contextlib.ExitStack() as stack:
            loader = cls(AtInit(), batch_size=1, num_workers=2, worker_init_fn=_globals_at_init,
                         generator=torch.Generator().manual_seed(1234), **kw)
            if cls is Loader:
                stack.enter_context(loader)
            return sorted({tuple(r) for b in loader for r in b.tolist()})

    ours = run(Loader, autotune=False)
    theirs = run(torch.utils.data.DataLoader)
    assert len(theirs) == 2 and [r[0] for r in theirs] == [0, 1]
    assert all(r[1] == r[2] for r in theirs)  # (what the idiom relies on)
    assert ours == theirs


def _record_seeds(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    info.dataset.rec = (info.seed, torch.initial_seed())


class Recorded:
    rec = None

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        return torch.tensor(self.rec)


def test_worker_init_fn_run_again_for_a_new_dataset_is_seeded_from_its_epochs_seed():
    """Review 87: with persistent_workers=False the dataset sent anew runs worker_init_fn again,
    but the generators held the last sample's seeds, so torch.initial_seed() there depended on
    which samples that worker had served. It is seeded as a fresh worker: from the epoch's
    base seed, which get_worker_info().seed gives too (a new one each epoch, as the
    DataLoader's fresh workers get)."""
    from autominato.pipeline.worker import pass_base_seed

    with Loader(Recorded(), batch_size=None, num_workers=1, autotune=False, seed=7,
                worker_init_fn=_record_seeds, persistent_workers=False) as loader:
        for epoch in range(3):
            loader.dataset.epoch = epoch  # (a new dataset for the workers each epoch)
            seed = pass_base_seed(7, epoch)
            assert [tuple(b.tolist()) for b in loader] == [(seed, seed)] * 2, epoch
            assert (seed == 7) == (epoch == 0)


def test_a_first_pass_at_a_later_epoch_gives_worker_init_fn_that_epochs_seed():
    # Review 167: a Loader whose first pass is epoch 2 (a resumed run, a Loader built anew
    # each epoch) ran worker_init_fn from the Loader's seed, where a run from epoch 0 had
    # epoch 2's base seed then: the seed followed the Loader's history, not the epoch.
    from autominato.pipeline.worker import pass_base_seed

    with Loader(Recorded(), batch_size=None, num_workers=1, autotune=False, seed=7,
                worker_init_fn=_record_seeds, persistent_workers=False) as loader:
        loader.set_epoch(2)
        seed = pass_base_seed(7, 2)
        assert [tuple(b.tolist()) for b in loader] == [(seed, seed)] * 2
