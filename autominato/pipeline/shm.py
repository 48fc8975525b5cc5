"""Shared-memory transport: a pool of slots, and packing of samples into them.

A *slot* is one POSIX shared-memory segment (a file under ``/dev/shm`` on Linux) that holds
the arrays of one sample. The main process creates every slot, hands its name to a worker,
and unlinks it in one place (:meth:`SlotPool.close`). Workers map slots by name and never
create or unlink any, so Python's ``multiprocessing.resource_tracker`` (which, before 3.13,
registers every attach and unlinks or warns from the wrong process) is not involved at all.

Segments are reserved with ``posix_fallocate``, so a full ``/dev/shm`` is an ``ENOSPC`` error
at allocation time (reported with the sizes involved) instead of a ``SIGBUS`` in a worker
that writes into a sparse segment.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import pickle
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from autominato.pipeline.tree import map_leaves

log = logging.getLogger("autominato.pipeline")

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "autominato_"
LOCK_SUFFIX = ".lock"
ALIGN = 64


def shm_free_bytes() -> int:
    """Free bytes of the shared-memory file system (``/dev/shm``)."""
    return shutil.disk_usage(SHM_DIR).free


class Slot:
    """One shared-memory segment owned by the main process."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # pragma: no cover - non-Linux
                os.ftruncate(fd, size)
            self.mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        try:
            self.mmap.close()
        except BufferError:
            # A view still exports the buffer; the mapping is freed when that view dies.
            pass


class SlotPool:
    """Bounded pool of shared-memory slots, created lazily and reused.

    Args:
        max_slots: most slots alive at once (a live knob: :meth:`set_max_slots`).
        budget_bytes: most bytes held by all slots together.

    ``acquire(nbytes)`` returns a free slot of at least ``nbytes`` (creating or growing one
    when the count and byte budgets allow), or ``None`` when the caller must send the sample
    another way (pickled through the pipe) or wait.
    """

    def __init__(self, max_slots: int, budget_bytes: int) -> None:
        free = shm_free_bytes()
        if budget_bytes > free:
            # Checked up front so that the numbers are in the log before anything runs; each
            # slot is also reserved with posix_fallocate, for space taken by others later.
            log.warning("%s has %d bytes free, less than the shared-memory budget of %d bytes; "
                        "the pool is capped at the free space (raise --shm-size in Docker)",
                        SHM_DIR, free, budget_bytes)
            budget_bytes = free
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._all: dict[str, Slot] = {}
        self.max_slots = max_slots
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._tag = f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._n = 0
        self._warned = False
        self.closed = False
        reap_stale_segments()
        # Held for the pool's life: a lock that anyone can take marks an owner that died
        # without cleaning up (SIGKILL, a crash), whose segments reap_stale_segments removes.
        self._lockfile = os.path.join(SHM_DIR, f"{self._tag}{LOCK_SUFFIX}")
        self._lockfd = os.open(self._lockfile, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lockfd, fcntl.LOCK_EX)

    def set_max_slots(self, n: int) -> None:
        with self._lock:
            self.max_slots = n
            while len(self._all) > n and self._free:
                self._drop(self._free.pop(0))

    def _drop(self, slot: Slot) -> None:
        del self._all[slot.name]
        self.bytes -= slot.size
        slot.unlink()

    def acquire(self, nbytes: int) -> Slot | None:
        if nbytes <= 0:
            return None
        with self._lock:
            if self.closed:
                return None
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                slot = min(fits, key=lambda s: s.size)
                self._free.remove(slot)
                return slot
            # Grow: replace the largest too-small free slot, or add one within the budgets.
            if self._free and len(self._all) >= self.max_slots:
                victim = max(self._free, key=lambda s: s.size)
                self._free.remove(victim)  # else it would be handed out again, unmapped
                self._drop(victim)
            if len(self._all) >= self.max_slots:
                return None
            size = -(-nbytes // 4096) * 4096
            if self.bytes + size > self.budget_bytes:
                self._warn(f"the pool's budget of {self.budget_bytes} bytes is reached "
                           f"({self.bytes} bytes in {len(self._all)} slots, {size} more asked)")
                return None
            self._n += 1
            try:
                slot = Slot(f"{self._tag}_{self._n}", size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    self._warn(
                        f"{SHM_DIR} has {shm_free_bytes()} bytes free, a slot needs {size} "
                        f"(pool holds {self.bytes} bytes in {len(self._all)} slots)"
                    )
                    self.max_slots = max(1, len(self._all))
                    return None
                raise
            self._all[slot.name] = slot
            self.bytes += size
            return slot

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("shared-memory pool cannot grow: %s; samples beyond it travel "
                        "pickled through pipes (slower). Raise the budget or free /dev/shm.", why)

    def release(self, slot: Slot | None) -> None:
        if slot is None:
            return
        with self._lock:
            if self.closed or slot.name not in self._all:
                slot.unlink()
                return
            if len(self._all) > self.max_slots:
                self._drop(slot)
            else:
                self._free.append(slot)

    def get(self, name: str) -> Slot:
        return self._all[name]

    def close(self) -> None:
        """Unlink every slot. Safe to call more than once."""
        with self._lock:
            self.closed = True
            for slot in list(self._all.values()):
                slot.unlink()
            self._all.clear()
            self._free.clear()
            self.bytes = 0
            if self._lockfd is not None:
                try:
                    os.unlink(self._lockfile)
                except FileNotFoundError:
                    pass
                os.close(self._lockfd)
                self._lockfd = None


def reap_stale_segments() -> int:
    """Unlink the segments of pools whose owner process died without closing them.

    Each pool holds an exclusive ``flock`` on ``<tag>.lock`` while it lives; the kernel drops
    it when the owner dies, even by SIGKILL. Taking that lock therefore proves the owner is
    gone, also for an owner in another PID namespace sharing ``/dev/shm``. Returns the
    number of segments removed.
    """
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for lock in (n for n in names if n.startswith(PREFIX) and n.endswith(LOCK_SUFFIX)):
        path = os.path.join(SHM_DIR, lock)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner is alive
        tag = lock[: -len(LOCK_SUFFIX)]
        for n in names:
            if n.startswith(tag + "_"):
                try:
                    os.unlink(os.path.join(SHM_DIR, n))
                    removed += 1
                except OSError:
                    pass
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
    if removed:
        log.info("removed %d shared-memory segments left by loaders that died", removed)
    return removed


def leftover_segments(pid: int | None = None) -> list[str]:
    """Names of this library's segments under ``/dev/shm`` (of process ``pid`` if given)."""
    tag = PREFIX if pid is None else f"{PREFIX}{pid}_"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(tag))
    except OSError:
        return []


# ---------------------------------------------------------------------------------------
# Packing: a sample is a tree of tuples / lists / dicts whose leaves are arrays or objects.


@dataclass(frozen=True)
class ArrayRef:
    """Where one array of a packed sample lies in its slot."""

    offset: int
    shape: tuple[int, ...]
    dtype: str
    torch: bool


def is_array(obj: Any) -> bool:
    """A leaf that travels through a slot: a NumPy array (not of objects) or a torch tensor."""
    return (isinstance(obj, np.ndarray) and obj.dtype != object) or _is_tensor(obj)


def _is_tensor(obj: Any) -> bool:
    t = type(obj)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def packed_nbytes(sample: Any) -> int:
    """Bytes of slot space the arrays of ``sample`` need (with alignment)."""
    leaves: list = []
    map_leaves(sample, leaves.append, is_array)
    total = 0
    for a in leaves:
        n = a.nbytes if isinstance(a, np.ndarray) else a.element_size() * a.numel()
        total += -(-n // ALIGN) * ALIGN
    return total


def pack(sample: Any, buf: memoryview | mmap.mmap | None) -> tuple[bytes, int]:
    """Write the arrays of ``sample`` into ``buf`` and return ``(descriptor, nbytes)``.

    The descriptor (pickle bytes) is the sample with every array replaced by an
    :class:`ArrayRef`. With ``buf=None`` (or too small a ``buf``) the whole sample is pickled
    into the descriptor instead, and ``nbytes`` still reports what a slot would need.
    """
    need = packed_nbytes(sample)
    if buf is None or need > len(buf) or need == 0:
        return pickle.dumps(("inline", sample), protocol=pickle.HIGHEST_PROTOCOL), need
    offset = 0

    def write(obj: Any) -> ArrayRef:
        nonlocal offset
        is_t = _is_tensor(obj)
        arr = obj.detach().cpu().numpy() if is_t else obj
        dst = np.ndarray(arr.shape, arr.dtype, buffer=buf, offset=offset)
        np.copyto(dst, arr, casting="no")
        ref = ArrayRef(offset, tuple(arr.shape), arr.dtype.str, is_t)
        offset += -(-arr.nbytes // ALIGN) * ALIGN
        return ref

    tree = map_leaves(sample, write, is_array)
    return pickle.dumps(("slot", tree), protocol=pickle.HIGHEST_PROTOCOL), need


def unpack(desc: bytes, buf: memoryview | mmap.mmap | None, copy: bool = False) -> Any:
    """Inverse of :func:`pack`. Arrays are views into ``buf`` unless ``copy`` is true.

    Views are valid only while the slot is held: copy (or collate) before releasing it.
    """
    kind, tree = pickle.loads(desc)
    if kind == "inline":
        return tree

    def read(ref: ArrayRef) -> Any:
        arr = np.ndarray(ref.shape, np.dtype(ref.dtype), buffer=buf, offset=ref.offset)
        if copy:
            arr = arr.copy()
        if ref.torch:
            import torch

            return torch.from_numpy(arr)
        return arr

    return map_leaves(tree, read, lambda x: isinstance(x, ArrayRef))


class SlotCache:
    """Worker-side maps of slots by name (LRU), so a worker maps each slot once.

    A slot that the main process drops (the pool shrank, or a bigger slot replaced it) is
    unlinked there, but its memory stays allocated while any process still maps it. So the
    cache unmaps slots whose file is gone: on every miss (when the pool is changing) and every
    ``check_every`` lookups (a few ``stat`` calls per sample), else a worker would keep up to
    ``capacity`` dead segments' memory.
    """

    def __init__(self, capacity: int = 256, check_every: int = 16) -> None:
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self.capacity = capacity
        self.check_every = check_every
        self._lookups = 0

    def purge(self) -> None:
        """Unmap every cached slot whose segment was unlinked."""
        for name in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            _close(self._maps.pop(name))

    def get(self, name: str, size: int) -> mmap.mmap:
        self._lookups += 1
        if self._lookups % self.check_every == 0:
            self.purge()
        m = self._maps.get(name)
        if m is not None and len(m) >= size:
            self._maps.move_to_end(name)
            return m
        self.purge()
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        old = self._maps.pop(name, None)  # mapped before with a smaller size
        if old is not None:
            _close(old)
        self._maps[name] = m
        while len(self._maps) > self.capacity:
            _close(self._maps.popitem(last=False)[1])
        return m


def _close(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # a view still uses it; it is unmapped when the last view is freed
