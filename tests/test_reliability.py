"""Reliability (issue 9): faults, bad input and long runs lose nothing and leave nothing behind.

Each scenario is small and deterministic: faults are triggered by the sample index (and, where
a fault must strike only once, by a marker file that the first worker to try claims), never
by racing a timer. Every scenario checks what was delivered against what was expected, value
by value, so a duplicate or a partial sample in a failed one's place cannot pass.

Worker processes re-import this module: keep it light at import time.

Run with ``-s`` to see the closing table (fault, what happened, delivered / expected, time to
recover, leftovers found).
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest

from autominato import Loader
from autominato.pipeline.errors import SampleTimeout, WorkerDied
from autominato.pipeline.shm import leftover_segments

ROWS: list[tuple[str, str, str, str, str]] = []


@pytest.fixture(scope="module", autouse=True)
def _closing_table():
    yield
    if ROWS:
        head = ("fault", "what happened", "delivered/expected", "recover s", "leftovers")
        widths = [max(len(str(r[k])) for r in [head, *ROWS]) for k in range(5)]
        print("\n")
        for r in [head, *ROWS]:
            print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def row(fault: str, happened: str, got: int, want: int, recover: float | None, left: str) -> None:
    ROWS.append((fault, happened, f"{got}/{want}", "-" if recover is None else f"{recover:.2f}", left))


# ---------------------------------------------------------------------------------------------
# Datasets and transforms (module level: worker processes unpickle them by reference)


class IndexDataset:
    """Sample ``i`` is ``(a (4, 8) float32 array filled with i, i)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def sample_path(self, i: int) -> str:
        return f"case_{i:05d}.npy"

    def __getitem__(self, i: int):
        return np.full((4, 8), i, np.float32), i


def identity(sample, rng):
    return sample


class ClaimOnce:
    """Transform: the first worker to get sample ``index`` writes its pid to ``marker`` and then
    ``hang_s`` seconds pass (it is killed or times out meanwhile); later tries run normally."""

    def __init__(self, index: int, marker: str, hang_s: float = 600.0) -> None:
        self.index, self.marker, self.hang_s = index, marker, hang_s

    def __call__(self, sample, rng):
        if sample[1] == self.index:
            try:
                os.close(os.open(self.marker + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return sample
            Path(self.marker + ".tmp").write_text(str(os.getpid()))
            os.rename(self.marker + ".tmp", self.marker)  # readers see the pid whole
            time.sleep(self.hang_s)
        return sample


class KillFor:
    """Transform that SIGKILLs its own worker on sample ``index`` (an OOM kill, every time)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, sample, rng):
        if sample[1] == self.index:
            os.kill(os.getpid(), signal.SIGKILL)
        return sample


class ByEpoch:
    """Sampler: epoch ``e`` visits ``orders[e]``."""

    def __init__(self, orders: list[list[int]]) -> None:
        self.orders, self.epoch = orders, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(self.orders[self.epoch])

    def __len__(self) -> int:
        return len(self.orders[self.epoch])


# ---------------------------------------------------------------------------------------------
# Helpers


def run_epoch(loader) -> tuple[list[int], dict[int, float]]:
    """Indices delivered in one epoch and when (``time.monotonic()``) each arrived.

    Raises AssertionError when a delivered sample does not hold its own index (a partial or
    mixed-up sample)."""
    got, when = [], {}
    for x, idx in loader:
        now = time.monotonic()
        for row_, i in zip(x.numpy(), idx.tolist(), strict=True):
            assert np.all(row_ == i), f"sample {i} corrupted"
            got.append(i)
            when[i] = now
    return got, when


def alive(pids) -> set[int]:
    out = set()
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.add(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, limit: float = 10.0) -> set[int]:
    """Poll until none of ``pids`` is alive or ``limit`` seconds pass; return the survivors."""
    deadline = time.monotonic() + limit
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def settled_pids(loader, n: int, limit: float = 10.0) -> list[int]:
    """``loader.worker_pids()`` once it lists ``n`` workers (or after ``limit`` seconds): a
    worker starts asynchronously, and its pid is known once its fork server has forked it."""
    deadline = time.monotonic() + limit
    while len(loader.worker_pids()) != n and time.monotonic() < deadline:
        time.sleep(0.02)
    return loader.worker_pids()


def descendants() -> set[int]:
    """Live child processes of this process except multiprocessing's forkserver and resource
    tracker (started once, shared by every loader of the process)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and not ("forkserver" in cmd or "resource_tracker" in cmd):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def leftovers(before: set[int]) -> str:
    """What a closed loader left: processes started since ``before`` and /dev/shm segments."""
    procs = wait_gone(descendants() - before)
    segs = leftover_segments(os.getpid())
    if not procs and not segs:
        return "none"
    names = [" ".join(psutil.Process(p).cmdline())[-60:] for p in alive(procs)]
    return f"{len(procs)} processes {names}, {len(segs)} segments"


# ---------------------------------------------------------------------------------------------
# 1. Error policy: corrupt files of four kinds


def voxels(k: int) -> np.ndarray:
    """The (8, 16, 16) float32 image of case ``k``: distinct values (so a gzip stream of it is
    longer than its header and a half-truncated file still has a readable header), and ``k``
    can be read back from the first voxel."""
    return (np.arange(8 * 16 * 16, dtype=np.float32) + 10_000 * k).reshape(8, 16, 16)


ALL_BAD = {"truncated .nii.gz": 1, "CRC error": 4, "truncated .nii": 6, "empty file": 9}


def write_cases(tmp_path: Path, n: int, bad: dict[str, int]) -> list[tuple[Path, Path]]:
    """``n`` (image, label) NIfTI pairs: image ``voxels(k)`` as ``.nii`` and ``.nii.gz`` in
    turn, label ``k mod 3`` everywhere; the image at ``bad[kind]`` is corrupt as ``kind`` says."""
    import nibabel as nib

    kinds = {k: kind for kind, k in bad.items()}
    suffix = {"truncated .nii.gz": ".nii.gz", "CRC error": ".nii.gz", "truncated .nii": ".nii"}
    pairs = []
    for k in range(n):
        kind = kinds.get(k)
        image = tmp_path / f"case_{k:03d}{suffix.get(kind, '.nii.gz' if k % 2 else '.nii')}"
        label = tmp_path / f"case_{k:03d}_seg.nii.gz"
        nib.save(nib.Nifti1Image(voxels(k), np.eye(4)), image)
        nib.save(nib.Nifti1Image(np.full((8, 16, 16), k % 3, np.uint8), np.eye(4)), label)
        if kind in ("truncated .nii.gz", "truncated .nii"):
            raw = image.read_bytes()
            image.write_bytes(raw[: len(raw) // 2])  # the header survives, the voxels do not
        elif kind == "CRC error":
            raw = bytearray(image.read_bytes())
            raw[-8] ^= 0xFF  # the member's CRC-32 (RFC 1952); the voxels are intact
            image.write_bytes(bytes(raw))
        elif kind == "empty file":
            image.write_bytes(b"")
        pairs.append((image, label))
    return pairs


def run_cases_epoch(loader) -> list[int]:
    """Case numbers delivered in one epoch of a ``NiftiDataset`` loader, each checked whole."""
    got = []
    for images, labels in loader:
        for image, label in zip(images.numpy(), labels.numpy(), strict=True):
            k = int(image.flat[0]) // 10_000
            assert np.array_equal(image, voxels(k)[None]), f"case {k}: image corrupted"
            assert np.all(label == k % 3), f"case {k}: label corrupted"
            got.append(k)
    return got


#: The original error of each kind (named in the DatasetError's message) and a phrase of it.
CORRUPT_ERRORS = {
    "truncated .nii.gz": ("EOFError", "end-of-stream"),
    "CRC error": ("BadGzipFile", "CRC check failed"),
    "truncated .nii": ("OSError", "could the file be damaged"),
    "empty file": ("ValueError", "not a NIfTI"),  # an empty gzip stream decompresses to b""
}


def test_corrupt_file_raises_with_index_path_worker_and_traceback(tmp_path):
    from autominato.data import DatasetError, NiftiDataset

    pairs = write_cases(tmp_path, 12, ALL_BAD)
    good = [j for j in range(12) if j not in ALL_BAD.values()]
    before = descendants()
    # Epoch e visits the good cases and the corrupt case of kind e; the loader stays usable
    # after each error.
    sampler = ByEpoch([good[:4] + [pos] + good[4:] for pos in ALL_BAD.values()])
    with Loader(NiftiDataset(pairs), 2, sampler=sampler, transform=identity, fuse_read=True,
                workers=2, in_order=True, autotune=False) as loader:
        for epoch, (kind, pos) in enumerate(ALL_BAD.items()):
            loader.set_epoch(epoch)
            with pytest.raises(DatasetError) as info:
                run_cases_epoch(loader)
            e, (original, phrase) = info.value, CORRUPT_ERRORS[kind]
            path = str(pairs[pos][0])
            assert f"{original}: " in str(e) and phrase in str(e), kind
            assert e.sample_index == pos and e.sample_path == path, kind
            assert e.worker.startswith("worker ") and "process" in e.worker, kind
            assert f"sample index {pos} (file {path})" in "".join(e.__notes__), kind
            remote = str(e.__cause__)
            assert "Traceback in worker" in remote and "__getitem__" in remote, kind
            assert original in remote  # the original exception's own traceback, chained
    left = leftovers(before)
    assert left == "none"
    row("corrupt: 4 kinds (raise)", f"DatasetError ({', '.join(v[0] for v in CORRUPT_ERRORS.values())}"
        ") naming index, file, worker, traceback; next epoch runs", 0, 0, None, left)


@pytest.mark.parametrize("fuse_read", [False, True], ids=["read-threads", "read-in-workers"])
def test_corrupt_files_are_skipped_once_and_every_other_sample_arrives_once(tmp_path, caplog, fuse_read):
    from autominato.data import NiftiDataset

    pairs = write_cases(tmp_path, 12, ALL_BAD)
    good = [j for j in range(12) if j not in ALL_BAD.values()]
    before = descendants()
    caplog.set_level(logging.WARNING, logger="autominato.pipeline")
    with Loader(NiftiDataset(pairs), 3, transform=identity, fuse_read=fuse_read, workers=2,
                on_error="skip", seed=0, autotune=False) as loader:
        epochs = [run_cases_epoch(loader) for _ in range(2)]
        snap = loader.snapshot()
    for got in epochs:
        assert Counter(got) == Counter(good)
    assert snap.skipped_total == 2 * len(ALL_BAD)
    skips = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping sample")]
    assert len(skips) == len(ALL_BAD), skips  # once per sample, not once per epoch
    for kind, pos in ALL_BAD.items():
        line = next(m for m in skips if f"index {pos} " in m)
        assert str(pairs[pos][0]) in line and CORRUPT_ERRORS[kind][1] in line
    left = leftovers(before)
    assert left == "none"
    row(f"corrupt: 4 kinds (skip, {'workers' if fuse_read else 'threads'})",
        "each skipped and logged once, counted", len(epochs[0]), len(good), None, left)


# ---------------------------------------------------------------------------------------------
# 2. Worker death


def claimed_pid(marker: Path, limit: float = 60.0) -> int:
    deadline = time.monotonic() + limit
    while not marker.exists():
        assert time.monotonic() < deadline, "no worker claimed the sample"
        time.sleep(0.02)
    return int(marker.read_text())


@pytest.mark.parametrize("fuse_read", [False, True], ids=["read-threads", "read-in-workers"])
def test_sigkill_of_a_worker_mid_epoch_still_delivers_every_sample_once(tmp_path, fuse_read):
    marker = tmp_path / "claimed"
    killed: dict[str, float] = {}

    def kill_the_claimant() -> None:
        pid = claimed_pid(marker)
        killed["pid"], killed["t"] = pid, time.monotonic()
        os.kill(pid, signal.SIGKILL)

    before = descendants()
    with Loader(IndexDataset(40), 4, transform=ClaimOnce(5, str(marker)), fuse_read=fuse_read,
                workers=2, seed=0, autotune=False) as loader:
        killer = threading.Thread(target=kill_the_claimant)
        killer.start()
        got, when = run_epoch(loader)
        killer.join()
        snap = loader.snapshot()
        pids = settled_pids(loader, 2)
        again, _ = run_epoch(loader)
    assert sorted(got) == list(range(40)) and sorted(again) == list(range(40))
    assert snap.worker_restarts_total == 1
    assert len(pids) == 2 and killed["pid"] not in pids
    left = leftovers(before)
    assert left == "none"
    row(f"SIGKILL of a worker mid-epoch ({'fused read' if fuse_read else 'split'})",
        "replaced; its sample re-dispatched", len(got), 40, when[5] - killed["t"], left)


def test_worker_death_raises_when_asked_naming_pid_signal_and_sample(tmp_path):
    marker = tmp_path / "claimed"
    before = descendants()
    with Loader(IndexDataset(20), 4, transform=ClaimOnce(5, str(marker)), workers=2, seed=0,
                on_worker_death="raise", autotune=False) as loader:
        killer = threading.Thread(target=lambda: os.kill(claimed_pid(marker), signal.SIGKILL))
        killer.start()
        with pytest.raises(WorkerDied) as info:
            run_epoch(loader)
        killer.join()
    pid = int(marker.read_text())
    e = info.value
    assert f"pid {pid}" in str(e) and "signal 9" in str(e) and "sample index 5" in str(e)
    assert e.sample_index == 5 and e.sample_path == "case_00005.npy"
    left = leftovers(before)
    assert left == "none"
    row("SIGKILL, on_worker_death='raise'", "WorkerDied naming pid, signal, sample", 0, 0, None, left)


CLOSE_WHILE_COLLATING = """
import threading, time
import numpy as np
from autominato import Loader
from autominato.pipeline import scheduler

class Fast:
    def __len__(self):
        return 32
    def __getitem__(self, i):
        return np.full((1024, 1024), i, np.float32)  # 4 MiB, fast: sent in slots

if __name__ == "__main__":
    L = Loader(Fast(), batch_size=4, num_workers=2, seed=1, autotune=False,
               prefetch_next_epoch=False, in_order=False)
    for _ in range(2):
        list(L)
    collate = scheduler.collate
    started = threading.Event()
    sums = []

    def slow_collate(samples, pool):
        started.set()
        time.sleep(1.5)  # a large batch being stacked while close() runs
        sums.append(sum(float(s.sum()) for s in samples))
        return collate(samples, pool)

    scheduler.collate = slow_collate
    it = iter(L)
    assert started.wait(30)
    time.sleep(0.2)
    L.close()
    time.sleep(2.0)
    import gc
    gc.collect()
    maps = sum("/dev/shm/" in line for line in open("/proc/self/maps"))
    print("alive", len(sums), maps, flush=True)
"""


def test_closing_while_the_batch_thread_collates_samples_in_slots_does_not_crash(tmp_path):
    """close() waits 0.5 s for a busy batch thread, then unlinks the slots; a sample it still
    collates must stay mapped until it is done with it (review 99: the mapping was closed
    under it, SIGSEGV)."""
    script = tmp_path / "close_while_collating.py"
    script.write_text(CLOSE_WHILE_COLLATING)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert out.stdout.split()[:2] == ["alive", "1"]
    # and once it is, the mappings kept for it go, the Loader and iterator still alive
    # (review 101: they stayed until the Loader went)
    assert out.stdout.split()[2] == "0", out.stdout


class KillsOnceWhenFlagged:
    """Fast samples (sent in chunks once measured); sample 37 kills its worker once when the
    flag file exists (a transient death: the OOM killer, an operator)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if i == 37 and os.path.exists(self.flag):
            os.unlink(self.flag)
            os.kill(os.getpid(), signal.SIGKILL)
        return np.float32(i)


def test_worker_death_raises_when_asked_also_for_a_worker_that_held_a_chunk(tmp_path):
    """A worker that dies holding a chunk of samples gives each back as never started; with
    ``on_worker_death="raise"`` the death still raises at once, as DataLoader's (review 99:
    the chunk was sent again and nothing raised)."""
    flag = tmp_path / "kill"
    before = descendants()
    with Loader(KillsOnceWhenFlagged(str(flag)), 4, workers=2, seed=1, autotune=False,
                on_worker_death="raise", prefetch_next_epoch=False) as loader:
        for _ in range(3):
            assert len(list(loader)) == 16  # measured as fast: they go in chunks now
        assert loader._pipeline.procs.chunk > 1  # else this tests the single sample's path
        flag.touch()
        with pytest.raises(WorkerDied) as info:
            list(loader)
        assert not flag.exists()  # sample 37 ran and killed its worker
        assert "signal 9" in str(info.value)
    assert leftovers(before) == "none"


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_sample_that_kills_every_worker_goes_through_the_error_policy(on_error):
    before = descendants()
    t0 = time.monotonic()
    # This epoch's deaths only: the next epoch, started ahead, would meet the sample again.
    with Loader(IndexDataset(24), 4, transform=KillFor(7), workers=2, seed=0, max_tries=2,
                on_error=on_error, autotune=False, prefetch_next_epoch=False) as loader:
        if on_error == "skip":
            got, _ = run_epoch(loader)
            assert sorted(got) == [i for i in range(24) if i != 7]
        else:
            got = []
            with pytest.raises(WorkerDied) as info:
                run_epoch(loader)
            assert info.value.sample_index == 7 and "killed 2 workers" in str(info.value)
        t1 = time.monotonic()
        snap = loader.snapshot()
        # max_tries=2 deaths blamed on the sample; one more when the first death came while
        # the worker held a chunk of fast samples (none blamed: each is then sent alone).
        assert snap.worker_restarts_total in (2, 3)
        assert snap.skipped_total == (1 if on_error == "skip" else 0)
        # Replacements keep the pool at its size; the next epoch still works around the sample.
        assert len(settled_pids(loader, 2)) == 2
    left = leftovers(before)
    assert left == "none"
    row(f"sample kills every worker ({on_error})", "2 tries, then " + (
        "skipped" if on_error == "skip" else "WorkerDied raised"), len(got), 23 if on_error == "skip" else 0,
        t1 - t0, left)


# ---------------------------------------------------------------------------------------------
# 3. Hang


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_hanging_transform_times_out_naming_the_index_and_its_worker_is_replaced(tmp_path, on_error):
    marker = tmp_path / "claimed"
    before = descendants()
    with Loader(IndexDataset(24), 4, transform=ClaimOnce(7, str(marker)), workers=2, seed=0,
                sample_timeout=2.0, on_error=on_error, autotune=False) as loader:
        t0 = time.monotonic()
        if on_error == "skip":
            got, _ = run_epoch(loader)
            assert sorted(got) == [i for i in range(24) if i != 7]
        else:
            got = []
            with pytest.raises(SampleTimeout) as info:
                run_epoch(loader)
            e = info.value
            assert e.sample_index == 7 and "sample index 7" in str(e) and "sample_timeout=2.0" in str(e)
            assert e.sample_path == "case_00007.npy"
        t1 = time.monotonic()
        hung = int(marker.read_text())
        snap = loader.snapshot()
        assert snap.worker_restarts_total == 1 and snap.skipped_total == (on_error == "skip")
        assert hung not in loader.worker_pids() and not alive([hung])
        again, _ = run_epoch(loader)  # the sample does not hang a second time
        assert sorted(again) == list(range(24))
        assert len(settled_pids(loader, 2)) == 2
    left = leftovers(before)
    assert left == "none"
    row(f"transform hangs, sample_timeout=2 ({on_error})", "worker SIGKILLed and replaced; " + (
        "sample skipped" if on_error == "skip" else "SampleTimeout raised"),
        len(got), 23 if on_error == "skip" else 0, t1 - t0, left)


RELEASE = threading.Event()  # lets the threads stuck in HangsInThreads go once a test ends


class HangsInThreads(IndexDataset):
    """Reading sample ``hang`` blocks (in the loader's read threads) until :data:`RELEASE`."""

    def __init__(self, n: int, hang: int) -> None:
        super().__init__(n)
        self.hang = hang

    def __getitem__(self, i: int):
        if i == self.hang:
            RELEASE.wait(60)
        return super().__getitem__(i)


# With num_workers=0 a sample loads in the training loop's thread, as the DataLoader's: a hang
# there hangs the loop (sample_timeout needs a worker to give up on).
@pytest.mark.parametrize("workers,kind", [(2, "process"), (2, "thread")],
                         ids=["split-read-thread", "thread-workers"])
def test_a_read_hanging_in_a_thread_times_out_and_a_new_thread_takes_over(workers, kind):
    RELEASE.clear()
    try:
        # The second epoch must start after RELEASE, not ahead of it while the read still hangs.
        with Loader(HangsInThreads(24, 7), 4, transform=identity, workers=workers, worker_kind=kind,
                    fuse_read=False, sample_timeout=1.0, on_error="skip", seed=0, autotune=False,
                    prefetch_next_epoch=False) as loader:
            t0 = time.monotonic()
            got, _ = run_epoch(loader)
            t1 = time.monotonic()
            assert sorted(got) == [i for i in range(24) if i != 7]
            assert loader.snapshot().skipped_total == 1
            before = loader.snapshot().stages["read"].workers
            RELEASE.set()  # the stuck thread returns; its late result must not be delivered
            got, _ = run_epoch(loader)
            assert sorted(got) == list(range(24))
            assert loader.snapshot().stages["read"].workers == before
    finally:
        RELEASE.set()
    row(f"read hangs in a thread ({kind}, workers={workers}), sample_timeout=1 (skip)",
        "sample skipped; thread abandoned, replaced", 23, 23, t1 - t0, "1 stuck thread until it returns")


# ---------------------------------------------------------------------------------------------
# 4-5. Interrupts: Ctrl-C in the training loop, SIGTERM of the main process

CHILD = textwrap.dedent("""
    import faulthandler, signal, sys, time
    import numpy as np
    from autominato import Loader

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # see finish()
    # A process started with SIGINT ignored (inherited from the one that started it: once, the
    # test process) keeps it ignored, and Ctrl-C does nothing: as a terminal's shell would,
    # give it Python's handler, and say so; the loader must leave that handler in place.
    INHERITED = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if INHERITED:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    class Slow:
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            time.sleep(0.02)
            return np.full((64, 64), i, np.float32)

    def slow(x, rng):
        time.sleep(0.05)
        return x

    if __name__ == "__main__":
        if "--thread" in sys.argv:  # built in another thread, iterated in the main one
            import threading

            made = []
            maker = threading.Thread(target=lambda: made.append(
                Loader(Slow(), 2, transform=slow, workers=2, autotune=False)))
            maker.start()
            maker.join()
            loader = made[0]
        else:
            loader = Loader(Slow(), 2, transform=slow, workers=2, autotune=False)
        for k, batch in enumerate(loader):
            if k == 2:
                kept = signal.getsignal(signal.SIGINT) is signal.default_int_handler
                print("READY", "inherited-ignore" if INHERITED else "-",
                      "kept" if kept else "CHANGED", *loader.worker_pids(), flush=True)
            time.sleep(0.01)  # the training step
""")


def finish(child: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The child's stderr once it exited; one that has not within ``timeout_s`` dumps its
    threads' stacks (SIGUSR1, faulthandler) into the failure before it is killed."""
    try:
        return child.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        os.killpg(child.pid, signal.SIGKILL)
        err = child.communicate(timeout=30)[1]
        raise AssertionError(
            f"the child did not exit within {timeout_s:g} s; its stacks:\n{err}") from None


#: The repository's root: the working directory of the training scripts run as children.
REPO = str(Path(__file__).resolve().parents[1])


def repo_env() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, for a child
    Python that imports autominato as the tests do."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}


def run_child_until_ready(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "train.py"
    script.write_text(CHILD)
    # A session of its own, so that a signal to its process group is what Ctrl-C in a
    # terminal sends (the main process, its workers and the forkserver all get it).
    env = repo_env()
    child = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, cwd=REPO, env=env,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = child.stdout.readline()
    assert line.startswith("READY"), child.communicate(timeout=60)
    _, inherited, kept, *pids = line.split()
    assert kept == "kept", "the loader changed the training process's SIGINT handler"
    pids = [int(p) for p in pids]
    assert len(pids) == 2 and alive(pids) == set(pids)
    assert leftover_segments(child.pid), "the scenario must have segments to clean up"
    return child, pids


@pytest.mark.slow  # a fresh Python that imports torch, twice (with its forkserver)
def test_ctrl_c_raises_one_keyboard_interrupt_and_leaves_no_worker_or_segment(tmp_path):
    child, pids = run_child_until_ready(tmp_path)
    t0 = time.monotonic()
    os.killpg(child.pid, signal.SIGINT)
    survivors = wait_gone(pids, 5.0)
    t1 = time.monotonic()
    err = finish(child)
    assert child.returncode in (1, -signal.SIGINT), err
    assert err.count("KeyboardInterrupt") == 1, err
    assert "Error" not in err.replace("KeyboardInterrupt", ""), err  # nothing else went wrong
    assert not survivors, f"workers still alive 5 s after Ctrl-C: {survivors}"
    segs = leftover_segments(child.pid)
    assert segs == []
    row("Ctrl-C (SIGINT to the process group)", "one KeyboardInterrupt; workers and segments gone",
        0, 0, t1 - t0, "none" if not segs and not survivors else f"{survivors} {segs}")


@pytest.mark.slow  # a fresh Python that imports torch, twice (with its forkserver)
@pytest.mark.parametrize("built_in_a_thread", [False, True])
def test_sigterm_of_the_main_process_unlinks_segments_and_ends_workers(tmp_path,
                                                                      built_in_a_thread):
    # (built in another thread: no handler could be set there; the first pass, begun in the
    # main thread, sets it: trial 176 found the segments left in /dev/shm)
    child, pids = run_child_until_ready(tmp_path, *(["--thread"] if built_in_a_thread else []))
    t0 = time.monotonic()
    os.kill(child.pid, signal.SIGTERM)
    survivors = wait_gone(pids, 5.0)
    t1 = time.monotonic()
    err = finish(child)
    assert child.returncode == -signal.SIGTERM, err  # it still dies by SIGTERM, as asked
    assert not survivors, f"workers still alive 5 s after SIGTERM: {survivors}"
    segs = leftover_segments(child.pid)
    assert segs == []
    row("SIGTERM of the main process", "segments unlinked, workers ended, exit by SIGTERM",
        0, 0, t1 - t0, "none" if not segs and not survivors else f"{survivors} {segs}")


KILLED = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    import numpy as np
    from autominato.pipeline import shm
    shm.PREFIX = sys.argv[1]  # (segments no other test's pool reaps)
    from autominato import Loader

    class Big:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            time.sleep(0.02)
            return np.full((256, 256), i, np.float32)

    if __name__ == "__main__":
        loader = Loader(Big(), 4, workers=2, autotune=False)
        it = iter(loader)
        for _ in range(3):
            next(it)
        # a child of the user's forked after the pool (a DataLoader's worker, a Pool)
        mp.get_context("fork").Process(target=time.sleep, args=(60,)).start()
        print("READY", flush=True)
        time.sleep(120)
""")


@pytest.mark.slow  # a fresh Python that imports torch
def test_sigkill_of_the_main_process_leaves_no_segment_once_its_fork_server_ends(tmp_path):
    """Trial 193: the kernel's out-of-memory killer SIGKILLs the training process; its pools'
    segments stayed in /dev/shm (holding memory) until a pool of a later run reaped them. The
    fork server outlives it: it ends its workers and removes them, also while a child of
    the user's forked from the training process still runs (review 194: it held the pool's
    lock, so none could be taken)."""
    import uuid

    prefix = f"amtest{uuid.uuid4().hex[:8]}_"
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    child = subprocess.Popen([sys.executable, str(script), prefix], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=repo_env(),
                             start_new_session=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("READY"), child.communicate(timeout=60)
        kids = psutil.Process(child.pid).children()
        sleeper = [p.pid for p in kids if not p.children()]  # (the fork server has workers)
        tree = [p.pid for p in psutil.Process(child.pid).children(recursive=True)
                if p.pid not in sleeper]
        assert len(sleeper) == 1 and len(tree) >= 3, [(p.pid, p.name()) for p in kids]
        mine = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        assert any(not n.endswith(".lock") for n in mine), mine  # (what there is to clean)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)  # (not its pipes: the user's child holds them)
        assert not wait_gone(tree, 10.0), "the fork server or a worker outlived the loader"
        left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        assert alive(sleeper), "the user's child must still run (it held the lock)"
    finally:
        try:  # (the child, and what is left of its session: the user's child)
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.communicate(timeout=30)
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(os.path.join("/dev/shm", n))
    assert left == []
    row("SIGKILL of the main process", "fork server ends workers, unlinks segments", 0, 0,
        None, "none" if not left else str(left))


CHAINED = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from autominato import Loader

    if __name__ == "__main__":
        loader = Loader([np.full(4, i) for i in range(8)], 2, workers=1, autotune=False)
        print("PIDS", *loader.worker_pids(), flush=True)
        # Installed after the Loader's, calling the handler it found: as Lightning's signal
        # connector does with a Loader built before Trainer.fit, or a handler of one's own.
        found, got = signal.getsignal(signal.SIGTERM), []

        def note(signum, frame):
            got.append(signum)

        if sys.argv[1] == "lightning":
            from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

            signal.signal(signal.SIGTERM, _HandlersCompose([note, found]))
        else:
            def chained(signum, frame):
                note(signum, frame)
                found(signum, frame)

            signal.signal(signal.SIGTERM, chained)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        rows = sorted(int(b[k, 0]) for b in loader for k in range(len(b)))
        loader.close()
        print("GOT", got, rows, flush=True)
""")


@pytest.mark.slow  # a fresh Python that imports torch (and Lightning)
@pytest.mark.parametrize("handler", ["lightning", "own"])
def test_a_sigterm_handler_installed_later_that_calls_the_loaders(tmp_path, handler):
    """Lightning's graceful SIGTERM (``SIGTERMException`` at the next step, ``on_exception``,
    its SLURM requeue) with a Loader built before ``Trainer.fit``: Lightning's handler calls
    the Loader's, which must not kill the workers and die (trial 145: exit status 143). Any
    other handler that calls it gets the clean-up and death by SIGTERM it had before (a
    handler that returns would have its SIGTERM swallowed: review 148)."""
    script = tmp_path / "chained.py"
    script.write_text(CHAINED)
    env = repo_env()
    child = subprocess.Popen([sys.executable, str(script), handler], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    out, err = child.communicate(timeout=120)
    pids = [int(p) for p in out.splitlines()[0].split()[1:]]
    if handler == "lightning":
        assert child.returncode == 0, err
        assert f"GOT [{int(signal.SIGTERM)}] {list(range(8))}" in out, out
    else:
        assert child.returncode == -signal.SIGTERM, err
        assert "GOT" not in out
    assert not wait_gone(pids, 5.0) and leftover_segments(child.pid) == []


# ---------------------------------------------------------------------------------------------
# Exceptions that cannot be pickled


def _local_error_class() -> type:
    class LocalError(Exception):  # pickle finds no importable name for it
        pass

    return LocalError


class HoldsALock(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.lock = threading.Lock()  # locks do not pickle


class ReduceFails(Exception):
    def __reduce__(self):
        raise TypeError("not today")


class StrFails(ValueError):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


UNPICKLABLE = {
    "local class": lambda: _local_error_class()("bad header"),
    "lock attribute": lambda: HoldsALock("bad header"),
    "__reduce__ raises": lambda: ReduceFails("bad header"),
    "__str__ raises": lambda: StrFails("bad header"),
}


class RaisesUnpicklable(IndexDataset):
    def __init__(self, n: int, bad: dict[int, str]) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int):
        if i in self.bad:
            raise UNPICKLABLE[self.bad[i]]()
        return super().__getitem__(i)


def test_an_exception_that_cannot_be_pickled_arrives_readable():
    from autominato.pipeline.errors import SampleError

    bad = dict(zip((1, 4, 6, 9), UNPICKLABLE, strict=True))
    good = [i for i in range(12) if i not in bad]
    sampler = ByEpoch([good + [pos] for pos in bad])  # epoch e: the good ones and one bad
    with Loader(RaisesUnpicklable(12, bad), 3, sampler=sampler, fuse_read=True, workers=1,
                autotune=False) as loader:
        for epoch, (pos, kind) in enumerate(bad.items()):
            loader.set_epoch(epoch)
            with pytest.raises(Exception) as info:  # noqa: B017 - which type is the point
                run_epoch(loader)
            e = info.value
            assert e.sample_index == pos and e.sample_path == f"case_{pos:05d}.npy", kind
            assert "process" in e.worker, kind
            if kind == "local class":
                # Not rebuildable here: the original type's name, message and traceback arrive
                # as text in a SampleError.
                assert isinstance(e, SampleError), kind
                assert f"sample index {pos}" in str(e) and f"case_{pos:05d}.npy" in str(e)
                assert e.original_type.split(".")[-1] == "LocalError"
                assert "bad header" in str(e) and "__getitem__" in e.remote_traceback
            elif kind == "lock attribute":
                # Its attribute does not pickle: its type with its message, as the DataLoader
                # rebuilds it (trial 84: a SampleError, which `except HoldsALock` missed).
                assert type(e).__name__ == "HoldsALock" and isinstance(e, HoldsALock), kind
                assert e.args == ("bad header",) and not hasattr(e, "lock")
                assert "__getitem__" in str(e.__cause__)
            else:
                # Rebuilt without calling __init__ (or __reduce__): the original type and args.
                assert type(e).__name__ in ("ReduceFails", "StrFails"), kind
                assert e.args == ("bad header",)
                assert "__getitem__" in str(e.__cause__)


class Exits(IndexDataset):
    def __getitem__(self, i: int):
        if i == 5:
            sys.exit(0)
        return super().__getitem__(i)


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_sys_exit_in_a_sample_raises_a_sample_error_not_a_quiet_exit(kind):
    """Trial 84: SystemExit(0) was re-raised in the training loop, which ended the training
    process with status 0 and no traceback, as if it had succeeded (the DataLoader raises a
    RuntimeError: its worker exited unexpectedly)."""
    from autominato.pipeline.errors import SampleError

    with Loader(Exits(8), 2, workers=2, worker_kind=kind, seed=0, autotune=False) as loader:
        with pytest.raises(SampleError, match=r"sample index 5 .*SystemExit\(0\)") as info:
            run_epoch(loader)
    assert info.value.sample_index == 5 and info.value.original_type == "builtins.SystemExit"
    assert "sys.exit" in info.value.remote_traceback


def test_unpicklable_exceptions_are_skipped_like_any_other():
    bad = dict(zip((1, 4, 6, 9), UNPICKLABLE, strict=True))
    before = descendants()
    with Loader(RaisesUnpicklable(16, bad), 3, fuse_read=True, workers=2, on_error="skip", seed=0,
                autotune=False) as loader:
        got, _ = run_epoch(loader)
        assert loader.snapshot().skipped_total == 4
    assert sorted(got) == [i for i in range(16) if i not in bad]
    left = leftovers(before)
    assert left == "none"
    row("exceptions that cannot be pickled (4 kinds, skip)", "skipped; under raise: readable",
        len(got), 12, None, left)


# ---------------------------------------------------------------------------------------------
# A transform that starts a process pool of its own


def _total(chunk: np.ndarray) -> float:
    return float(chunk.sum())


def pooled_total(sample, rng):
    """Sums the sample's array in a pool of two processes (workers are not daemons, so a
    worker may have children)."""
    import multiprocessing as mp

    x, i = sample
    with mp.get_context("fork").Pool(2) as pool:
        parts = pool.map(_total, np.array_split(x, 2))
    return x, i, sum(parts)


def test_a_transform_may_start_its_own_process_pool():
    before = descendants()
    with Loader(IndexDataset(6), 2, transform=pooled_total, workers=2, seed=0,
                autotune=False) as loader:
        out = [(idx.tolist(), totals.tolist()) for x, idx, totals in loader]
    got = [i for idx, _ in out for i in idx]
    assert sorted(got) == list(range(6))
    for idx, totals in out:
        assert totals == [32.0 * i for i in idx]  # a (4, 8) array of i sums to 32 i
    left = leftovers(before)
    assert left == "none"
    row("transform starts its own process pool", "pool ran in each worker, then ended",
        len(got), 6, None, left)


# ---------------------------------------------------------------------------------------------
# 6. Long runs


class Volumes(IndexDataset):
    """Sample ``i`` is an (8, 64, 64) float32 volume (128 KiB) filled with ``i``."""

    def __getitem__(self, i: int):
        return np.full((8, 64, 64), i, np.float32), i


def anon_rss(pids) -> int:
    """Bytes of anonymous resident memory (RSS less file-backed and shared pages) of this
    process and ``pids``: where leaked objects and arrays live. File-backed pages (torch's
    library code, paged in as new code paths first run) and the pool's shared-memory slots
    (created lazily up to their bound) make RSS step up by megabytes without any leak."""
    total = 0
    for p in [os.getpid(), *pids]:
        m = psutil.Process(p).memory_info()
        total += m.rss - m.shared
    return total


def fds_by_kind() -> tuple[int, int]:
    """(descriptors held by shared-memory slots, all others) of this process. A slot's mmap
    holds a duplicate of its descriptor, so slot descriptors follow the pool's size."""
    slots = other = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the descriptor of the listing itself, closed by now
        slots += "/autominato_" in target
        other += "/autominato_" not in target
    return slots, other


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_twenty_epochs_keep_memory_and_file_descriptors_flat():
    rss, slot_fds, other_fds, pids = [], [], [], None
    with Loader(Volumes(24), 4, transform=identity, shuffle=True, workers=2, seed=0,
                autotune=False) as loader:
        for epoch in range(20):
            loader.set_epoch(epoch)
            n = 0
            for x, idx in loader:
                assert torch_equal_rows(x, idx)
                n += len(idx)
            assert n == 24
            if pids is None:
                # (epoch 0's 24 small samples may all have come from the first worker ready:
                # the second one can still be starting then)
                deadline = time.monotonic() + 30
                while len(loader.worker_pids()) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                pids = loader.worker_pids()
            assert loader.worker_pids() == pids  # no worker was replaced: the sum is comparable
            rss.append(anon_rss(pids))
            slots, other = fds_by_kind()
            slot_fds.append(slots)
            other_fds.append(other)
        max_slots = 2 * loader.knobs.pool_size
    mib = [r / 2**20 for r in rss]
    growth = max(mib[15:]) - max(mib[3:8])
    print("\nanonymous RSS per epoch (MiB, main + 2 workers):", " ".join(f"{m:.1f}" for m in mib))
    print("slot / other file descriptors per epoch:", list(zip(slot_fds, other_fds, strict=True)))
    # A leak of one 512 KiB batch per epoch would add 6 MiB from epochs 3-7 to 15-19.
    assert growth < 4.0, f"anonymous RSS grew {growth:.1f} MiB from epochs 3-7 to 15-19"
    assert max(other_fds[3:]) <= max(other_fds[:3]) + 1
    assert max(slot_fds) <= max_slots
    row("20 epochs (anonymous RSS, fds)", f"{min(mib):.0f}-{max(mib):.0f} MiB, growth "
        f"{growth:+.1f} MiB; fds {min(other_fds)}-{max(other_fds)} + slots {max(slot_fds)} of "
        f"<= {max_slots}", 20 * 24, 20 * 24, None, "none")


def torch_equal_rows(x, idx) -> bool:
    return all(bool((x[k] == i).all()) for k, i in enumerate(idx.tolist()))


class VariableSizes(IndexDataset):
    """Sample ``i`` is ``((4 + 16 (i mod 7)) x 1024) float32`` filled with ``i`` (16 KiB to
    400 KiB, like volumes of different cases), cropped to 4 rows by :func:`crop`."""

    def __getitem__(self, i: int):
        return np.full((4 + (i % 7) * 16, 1024), i, np.float32), i


def crop(sample, rng):
    x, i = sample
    return x[:4].copy(), i


def unlinked_maps(pid: int) -> int:
    """Mappings of this library's segments in process ``pid`` whose file was unlinked."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "autominato_" in line and "(deleted)" in line)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc/<pid>/maps")
def test_slots_dropped_while_the_pool_changes_are_unmapped_and_never_reused():
    """Variable sample sizes and a pool that shrinks and grows (as the controller does) make
    the main process drop and replace slots; no dropped slot may be handed out again (it used
    to stay on the free list, unmapped) and workers must not keep dropped segments mapped
    (each keeps its memory allocated)."""
    stale = []
    # The pool size set before an epoch applies to all of it (no samples started ahead).
    with Loader(VariableSizes(40), 4, transform=crop, shuffle=True, workers=2, seed=0,
                autotune=False, prefetch_next_epoch=False) as loader:
        for epoch in range(10):
            loader.knobs.pool_size = 40 if epoch % 2 == 0 else 4
            got = []
            for x, idx in loader:
                assert torch_equal_rows(x, idx)
                got += idx.tolist()
            assert sorted(got) == list(range(40)), epoch
            stale.append(sum(unlinked_maps(p) for p in loader.worker_pids()))
    print("\nunlinked segments still mapped by the workers, per epoch:", stale)
    assert max(stale) <= 8, stale
    row("pool shrinks and grows 10 times, variable sizes", "no dropped slot reused; "
        f"at most {max(stale)} dropped segments still mapped", 400, 400, None, "none")


# ---------------------------------------------------------------------------------------------
# 7. Thread oversubscription


def thread_counts(sample, rng):
    """Reports the worker's torch intra-op threads and the most threads of any BLAS / OpenMP
    pool, after loading a BLAS that was not loaded when the worker started (scipy's)."""
    import scipy.linalg  # noqa: F401
    import threadpoolctl
    import torch

    blas = max(p["num_threads"] for p in threadpoolctl.threadpool_info())
    return sample[0], sample[1], torch.get_num_threads(), blas


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_times_threads_stays_within_the_cores_as_the_worker_count_changes(start_method):
    """Workers forked from the training process keep one thread (libgomp's pool does not
    survive fork, see worker.py); those of a fork server in a new interpreter share the cores."""
    from autominato.pipeline.knobs import usable_cores

    cores = usable_cores()
    seen = {}
    # Each epoch's samples must run after its worker count is set, not ahead of it.
    with Loader(IndexDataset(8), 2, transform=thread_counts, workers=1, seed=0,
                start_method=start_method, autotune=False, prefetch_next_epoch=False) as loader:
        for workers in (1, 2, 1):
            loader.knobs.workers = workers
            for _, _, torch_threads, blas_threads in loader:
                seen.setdefault(workers, set()).update(
                    zip(torch_threads.tolist(), blas_threads.tolist(), strict=True))
            assert len(settled_pids(loader, workers)) == workers
    if start_method == "fork":
        want = {w: {(1, 1)} for w in (1, 2)}
    else:
        want = {w: {(max(1, cores // w),) * 2} for w in (1, 2)}
    assert seen == want, (cores, seen)
    row(f"thread oversubscription ({start_method})", f"{cores} cores: 1 worker x "
        f"{want[1].pop()[0]} threads, 2 workers x {want[2].pop()[0]}", 24, 24, None, "none")


# ---------------------------------------------------------------------------------------------
# 4. Shared memory: too little of it


def test_a_budget_beyond_free_shared_memory_is_capped_with_both_numbers_logged(caplog):
    from autominato.pipeline.shm import SlotPool, shm_free_bytes

    caplog.set_level(logging.WARNING, logger="autominato.pipeline")
    asked = shm_free_bytes() + 2**40
    pool = SlotPool(max_slots=4, budget_bytes=asked)
    try:
        assert pool.budget_bytes <= shm_free_bytes() + 2**20
        line = next(r.getMessage() for r in caplog.records if "budget" in r.getMessage())
        free = int(line.split(" has ")[1].split()[0])
        assert str(asked) in line and abs(free - shm_free_bytes()) < 2**30
    finally:
        pool.close()


def test_a_full_shared_memory_file_system_falls_back_to_pipes_with_a_clear_warning(monkeypatch, caplog):
    """``posix_fallocate`` reports a full /dev/shm as ENOSPC (instead of a SIGBUS when a worker
    writes into a sparse segment); the loader then sends samples pickled through the pipes."""
    import errno

    real = os.posix_fallocate
    calls = []

    def full_after_one(fd, offset, length):
        calls.append(length)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_after_one)
    caplog.set_level(logging.WARNING, logger="autominato.pipeline")
    before = descendants()
    with Loader(Volumes(24), 4, transform=identity, workers=2, seed=0, autotune=False) as loader:
        got = []
        for x, idx in loader:
            assert torch_equal_rows(x, idx)
            got += idx.tolist()
    assert sorted(got) == list(range(24)) and len(calls) > 1
    warnings = [r.getMessage() for r in caplog.records if "cannot grow" in r.getMessage()]
    assert len(warnings) == 1 and "bytes free, a slot needs" in warnings[0]
    left = leftovers(before)
    assert left == "none"
    row("/dev/shm full (ENOSPC at the 2nd slot)", "warned with both sizes; pickled via pipes",
        len(got), 24, None, left)


class DiesOnArrival(IndexDataset):
    """A dataset that ends any process that unpickles it except the one that made it."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.home = os.getpid()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.home:
            os._exit(3)


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_workers_that_die_before_they_are_ready_raise_instead_of_respawning_forever(on_error):
    before = descendants()
    # A fork server in a new interpreter unpickles the dataset (forked workers inherit it).
    with Loader(DiesOnArrival(8), 2, transform=identity, workers=1, max_tries=2,
                on_error=on_error, start_method="forkserver", autotune=False) as loader:
        for _ in range(2):  # each epoch tries again, and fails the same way
            with pytest.raises(WorkerDied) as info:
                run_epoch(loader)
            assert "2 transform worker processes in a row died before" in str(info.value)
            assert "exit code 3" in str(info.value)
        assert loader.snapshot().worker_restarts_total == 4  # 2 per epoch, then no more
    left = leftovers(before)
    assert left == "none"
    row(f"workers die on start-up ({on_error})", "WorkerDied after 2 in a row (was: respawned "
        "forever, training loop hung)", 0, 0, None, left)



class _NoNotes(ValueError):
    """An exception without ``add_note``, as every one before Python 3.11."""

    @property
    def add_note(self):
        raise AttributeError("add_note")


def test_without_exception_notes_the_sample_index_and_file_head_the_remote_traceback():
    # Python 3.10 has no add_note: the index and file must still reach the printed traceback.
    import pickle

    from autominato.pipeline import errors

    report = errors.ErrorReport.capture(_NoNotes("bad voxel"), 7, "/data/case_7.nii.gz",
                                        "worker 1")
    report = pickle.loads(pickle.dumps(report))  # (as it crosses from the worker)
    exc = report.to_exception()
    assert isinstance(exc, _NoNotes) and str(exc) == "bad voxel"
    assert not getattr(exc, "__notes__", None)
    cause = str(exc.__cause__)
    assert "sample index 7 (file /data/case_7.nii.gz) failed in worker 1" in cause, cause


class _StrNeedsAttr(Exception):
    def __init__(self, f) -> None:
        super().__init__()
        self.f = f  # an open file: does not pickle

    def __str__(self) -> str:
        return f"cannot read {self.f.name}"


def test_an_exception_rebuilt_without_its_attributes_must_still_print():
    """Review 87: the fallback that keeps the type and message drops the attributes; an
    exception whose __str__ reads one could not be printed. It arrives as a SampleError with
    its message."""
    from autominato.pipeline.errors import ErrorReport, SampleError

    with open(os.devnull) as f:
        try:
            raise _StrNeedsAttr(f)
        except _StrNeedsAttr as e:
            report = ErrorReport.capture(e, 7, "case_7.npy", "worker 0 (pid 1)")
    report = pickle.loads(pickle.dumps(report))  # as it crosses from a worker
    e = report.to_exception()
    assert isinstance(e, SampleError) and f"cannot read {os.devnull}" in str(e)
    assert e.sample_index == 7


@pytest.mark.parametrize("exc, hint", [(SystemExit(3), True), (KeyboardInterrupt(), False),
                                       (GeneratorExit(), False)])
def test_exceptions_that_are_no_exception_arrive_as_sample_errors(exc, hint):
    from autominato.pipeline.errors import ErrorReport, SampleError

    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        report = pickle.loads(pickle.dumps(ErrorReport.capture(e, 2, None, "worker 1 (pid 1)")))
    e = report.to_exception()
    assert isinstance(e, SampleError) and type(exc).__name__ in str(e)
    assert ("sys.exit" in str(e)) == hint


class _Code(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"code {code}")  # the message is formatted from the argument
        self.code = code


def test_an_exception_that_formats_its_message_arrives_with_it_once():
    """Trial 88: unpickling calls __init__(*args) again, so super().__init__(f"code {code}")
    arrived as 'code code 5'. It is rebuilt without calling __init__ then."""
    from autominato.pipeline.errors import ErrorReport

    try:
        raise _Code(5)
    except _Code as e:
        report = pickle.loads(pickle.dumps(ErrorReport.capture(e, 1, None, "worker 0 (pid 1)")))
    e = report.to_exception()
    assert isinstance(e, _Code) and str(e) == "code 5" and e.args == ("code 5",)
    assert e.code == 5


def crossed(exc: BaseException, path: str | None = "/data/case_2.nii.gz") -> BaseException:
    """``exc`` raised in a worker for sample 2 (file ``path``), as the training loop gets it:
    captured, pickled, loaded and rebuilt."""
    from autominato.pipeline.errors import ErrorReport

    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        report = ErrorReport.capture(e, 2, path, "worker 0 (pid 1)")
    return pickle.loads(pickle.dumps(report)).to_exception()


class _NoArgsOSError(OSError):
    def __init__(self) -> None:  # loading calls it with (5, "cannot read"): fails
        super().__init__(5, "cannot read")


class _Owned(Exception):
    def __init__(self, msg: str, owner) -> None:
        super().__init__(msg)
        self.owner = owner

    def __reduce__(self):  # it says how it pickles: trusted, message and all
        return (_Owned, (self.args[0], repr(self.owner)))

    def __str__(self) -> str:
        return f"{self.args[0]} [{self.owner!r}]"


def test_rebuilt_exceptions_keep_what_their_builtin_base_derives_and_their_own_pickling():
    """Review 89: rebuilt without __init__, an OSError lost errno and strerror; and a class with
    its own __reduce__ whose message changed slightly through it arrived as a SampleError."""
    e = crossed(_NoArgsOSError())
    assert isinstance(e, _NoArgsOSError) and (e.errno, e.strerror) == (5, "cannot read")
    with open(os.devnull) as f:
        e = crossed(_Owned("bad header", f))
    assert isinstance(e, _Owned) and str(e).startswith("bad header [")


class _CaseMissing(OSError):
    def __init__(self, path: str) -> None:  # loading calls it with (2, msg, path): fails
        super().__init__(errno.ENOENT, f"cannot read {path}", path)


class _NoCase(OSError):
    def __init__(self, path: str) -> None:
        super().__init__(f"no such case: {path}")  # formatted from the argument
        self.path = path


def test_an_oserror_subclass_keeps_its_filename_and_its_message_once():
    """An OSError subclass rebuilt without __init__ lost ``filename`` (OSError keeps it out of
    ``args``), and one that formats its message arrived formatted twice (OSError's own
    ``__reduce__`` was trusted as the class's)."""
    original = _CaseMissing("/data/case_2.nii.gz")
    e = crossed(_CaseMissing("/data/case_2.nii.gz"))
    assert isinstance(e, _CaseMissing)
    assert (e.errno, e.strerror, e.filename) == (errno.ENOENT, "cannot read /data/case_2.nii.gz",
                                                 "/data/case_2.nii.gz")
    assert str(e) == str(original) and e.args == original.args
    e = crossed(_NoCase("/data/case_2.nii.gz"))
    assert isinstance(e, _NoCase) and str(e) == "no such case: /data/case_2.nii.gz"
    assert e.path == "/data/case_2.nii.gz"
    e = crossed(FileNotFoundError(errno.ENOENT, "No such file", "/data/x.nii"))  # plain: as is
    assert (type(e), e.filename, str(e)) == (FileNotFoundError, "/data/x.nii",
                                             "[Errno 2] No such file: '/data/x.nii'")


class _ErrnoAfter(OSError):
    def __init__(self, path: str) -> None:
        super().__init__(f"bad {path}")
        self.errno = errno.EIO  # a C field set by assignment


class _MissingPlugin(ImportError):
    def __init__(self, plugin: str) -> None:
        super().__init__(f"plugin {plugin} missing", name=plugin, path=f"/plugins/{plugin}")


def test_fields_builtin_exceptions_keep_in_c_cross_with_a_rebuilt_exception():
    """Review 95: rebuilt without __init__, an OSError's errno set by assignment and an
    ImportError's name and path (neither in args nor in vars) were lost; a filename that does
    not pickle costs the filename only."""
    e = crossed(_ErrnoAfter("/data/c.nii"))
    assert (type(e), str(e), e.errno) == (_ErrnoAfter, "bad /data/c.nii", errno.EIO)
    e = crossed(_MissingPlugin("dicom"))
    assert (str(e), e.name, e.path) == ("plugin dicom missing", "dicom", "/plugins/dicom")
    e = crossed(FileNotFoundError(errno.ENOENT, "No such file", threading.Lock()))
    assert (type(e), e.errno, e.strerror, e.filename) == (
        FileNotFoundError, errno.ENOENT, "No such file", None)


_KEPT: list = []


def _child_keeps_a_loader() -> None:
    """A process target that leaves its Loader open (held, as a Lightning module holds the
    one ``train_dataloader`` returned) when it returns."""
    loader = Loader(list(range(8)), batch_size=2, num_workers=1, autotune=False)
    _KEPT.append(loader)
    assert len(list(loader)) == 4


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_process_that_multiprocessing_started_exits_with_its_loader_left_open(method):
    """``multiprocessing`` joins a process's children when its target returns, before
    ``atexit``: the Loader's fork server waited for the Loader to close, and a ``ddp_spawn``
    rank never exited after its fit (trial 153). The live Loaders close first now."""
    import multiprocessing as mp

    p = mp.get_context(method).Process(target=_child_keeps_a_loader)
    p.start()
    p.join(60)
    alive = p.is_alive()
    if alive:
        p.kill()
        p.join()
    assert not alive and p.exitcode == 0


def _child_builds_its_own_loader() -> None:
    loader = Loader(list(range(8)), batch_size=2, num_workers=1, autotune=False)
    _KEPT.append(loader)
    assert len(list(loader)) == 4


def test_a_forked_childs_exit_leaves_the_parents_loader_alone():
    """The child's exit closes the Loaders it built, not its copies of the parent's (review
    154: the parent's workers died and its shared memory was unlinked)."""
    import multiprocessing as mp

    with Loader(list(range(16)), batch_size=2, num_workers=2, autotune=False) as loader:
        it = iter(loader)
        first = next(it)
        deadline = time.monotonic() + 30
        while len(loader.worker_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # (the second worker may still be starting)
        workers = sorted(loader.worker_pids())
        assert len(workers) == 2
        p = mp.get_context("fork").Process(target=_child_builds_its_own_loader)
        p.start()
        p.join(60)
        assert p.exitcode == 0
        rest = list(it)
        assert sorted(int(i) for b in [first, *rest] for i in b) == list(range(16))
        assert sorted(loader.worker_pids()) == workers
        assert loader.snapshot().worker_restarts_total == 0


def test_a_child_of_os_fork_that_drops_its_copy_of_a_loader_leaves_the_parents_alone():
    """``os.fork()`` without multiprocessing: the child's copy of the Loader, dropped or left
    to its exit, closes nothing of the parent's (review 156: its ``__del__`` ended the
    parent's workers and fork server)."""
    with Loader(list(range(16)), batch_size=2, num_workers=2, autotune=False) as loader:
        it = iter(loader)
        first = next(it)
        pid = os.fork()
        if pid == 0:  # the child: drop the copy, collect, leave
            code = 0
            try:
                del it
                loader.close()
                gc.collect()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        rest = list(it)
        assert sorted(int(i) for b in [first, *rest] for i in b) == list(range(16))
        assert loader.snapshot().worker_restarts_total == 0


def test_a_ctrl_c_while_the_loader_starts_its_workers_lets_the_process_exit(tmp_path):
    """Trial 165 (high): a SIGINT that landed in the Loader's constructor after its fork
    server started (here: raised where it landed, the first worker's request) left the fork
    server, not a daemon, waiting on its socket, and multiprocessing's exit joined it for
    ever (4 of 25 real Ctrl-C's). It exits by the interrupt, as the DataLoader's process does."""
    script = tmp_path / "ctrl_c_in_init.py"
    script.write_text(textwrap.dedent("""
        import torch
        import autominato.pipeline.spawn as spawn
        from autominato import Loader

        def interrupted(self, *a, **k):
            raise KeyboardInterrupt

        spawn.Zygote.request = interrupted

        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return torch.zeros(4)

        Loader(DS(), batch_size=2, num_workers=2)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the process did not exit")
    assert proc.returncode in (130, -signal.SIGINT), out.decode()[-2000:]
    assert b"KeyboardInterrupt" in out


CTRL_C_IN_CONSTRUCTOR = textwrap.dedent("""
    import faulthandler, gc, os, signal, threading, time
    # (the CI run of session 51 saw this script pass the test's 60 s once, with no output
    # to tell where: every thread's stack is written to stderr, and the script ends, at 45 s)
    faulthandler.dump_traceback_later(45, exit=True)
    # Ctrl-C as in a terminal, whatever this script inherited: a shell that runs a job in the
    # background without job control starts it with SIGINT ignored (POSIX), and Python then
    # installs no KeyboardInterrupt handler (session 51's CI runs, started so, failed here)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    import psutil
    from autominato import Loader
    from autominato.control import Controller
    from autominato.pipeline.scheduler import Pipeline

    class DS:
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return np.zeros(1 << 16, np.float32)

    def ctrl_c_in(cls, name):
        # Ctrl-C as the Loader starts (the pipeline's threads, its controller)
        original = getattr(cls, name)

        def interrupted(self, *a, **k):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # (where Python raises it, unless it is held)
            return original(self, *a, **k)

        setattr(cls, name, interrupted)
        return lambda: setattr(cls, name, original)

    caught = 0
    for cls, name in ((Pipeline, "_wire_stats"), (Controller, "start")):
        undo = ctrl_c_in(cls, name)
        try:
            Loader(DS(), batch_size=4, shuffle=True, num_workers=2)
        except KeyboardInterrupt:
            caught += 1
        undo()

    class SlowToPickle(DS):  # pickled for persistent_workers=False as the Loader starts
        def __getstate__(self):
            time.sleep(60)
            return self.__dict__

    # a second Ctrl-C is not held: it raises at once. The second is sent once the first was
    # noted: two sent 0.3 s apart from the start (before) were one to Python's handler when
    # the main thread got no core in between (two CI runs of session 51, on a loaded machine,
    # waited out the 60 s sleep)
    sent = []

    def interrupt_twice():
        deadline = time.monotonic() + 30
        held = None
        while held is None and time.monotonic() < deadline:
            h = signal.getsignal(signal.SIGINT)
            held = h if getattr(h, "__name__", "") == "_note" else None  # (the Loader's hold)
            time.sleep(0.005)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
        while held is not None and not held.__self__.hit and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_twice, daemon=True).start()
    try:
        Loader(SlowToPickle(), batch_size=4, num_workers=2, persistent_workers=False)
    except KeyboardInterrupt:
        print("SECOND", round(time.monotonic() - sent[0], 2), flush=True)
    gc.collect()
    time.sleep(0.5)
    me = psutil.Process()
    shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"autominato_{os.getpid()}_")]
    print("RESULT", caught, len(me.children(recursive=True)), threading.active_count(),
          len(shm), flush=True)
    with Loader(DS(), batch_size=4, num_workers=2) as loader:
        print("NEXT", sum(len(b) for b in loader), flush=True)
""")


@pytest.mark.slow  # a fresh Python that imports torch
def test_ctrl_c_while_a_loader_starts_leaves_nothing_running(tmp_path):
    """Trial 176: a KeyboardInterrupt inside ``Loader(...)`` (a thread's start, the fork
    server's fork) left child processes, threads, descriptors and /dev/shm locks that nothing
    could reach or close, piling up over interrupted constructions until the interpreter
    exited. Ctrl-C is held while the Loader starts and raised once it can be closed."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_IN_CONSTRUCTOR)
    env = repo_env()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=60)  # (before: it hung, the leaked fork server kept)
    lines = dict(ln.split(maxsplit=1) for ln in out.stdout.splitlines() if ln[:1].isupper())
    assert "RESULT" in lines, f"{out.stdout}\n{out.stderr[-12000:]}"  # (the stacks at 45 s)
    caught, children, threads, shm = map(int, lines["RESULT"].split())
    assert caught == 2, out.stderr[-3000:]  # each Ctrl-C raised, as the constructor's
    assert (children, threads, shm) == (0, 1, 0), (lines, out.stderr[-3000:])
    assert lines.get("NEXT") == "40", out.stderr[-3000:]  # and the next Loader works
    assert 0.5 < float(lines["SECOND"]) < 5.0, lines  # (review 177: held for the whole 60 s)
