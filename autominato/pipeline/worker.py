"""What a worker runs for one sample, and the loop of a worker process.

The same :func:`run_sample` serves thread workers and process workers, so a sample's result
does not depend on where it ran: its random generator is seeded from ``(seed, epoch, index)``
alone (``numpy.random.SeedSequence`` entropy), and for an index that the sampler repeats in
the epoch, from its ``draw`` too (which occurrence it is: :func:`sample_rng`), so that each
repeat gets an augmentation of its own.

Global generators. A worker process (or Ray actor) seeds Python's ``random``, NumPy's legacy
global generator and torch's default generator before ``worker_init_fn`` exactly as the
DataLoader seeds each of its workers (:func:`seed_worker`: ``torch.initial_seed()`` there is
``get_worker_info().seed``), and again from
``(seed, epoch, index)`` (and ``draw``) before each sample (:func:`seed_globals`, 8 us), for
a dataset's ``__getitem__`` or a transform that draws from them: a sample's draws are then
reproducible whichever worker ran it, and an index a sampler draws twice in one epoch draws
anew. The DataLoader's per-worker seeds suffice there because it gives each
worker a fixed share of the batches; here any worker may take any sample (trial 44: draws in
``__getitem__`` differed between runs with the same seed when only a ``transform`` got
per-sample seeds). Thread workers (``worker_kind="thread"``, ``workers=0``) run in the
training process: they leave those generators alone, since reseeding them from a worker
thread would repeat the training loop's own draws and race with them.

Random state of library transforms. MONAI's ``Randomizable`` transforms (in the ``transform``
or inside the dataset, as ``monai.data.Dataset(data, transform=Compose([...]))``) draw from
a ``RandomState`` of their own; before a sample's read and its transform, each is reseeded
from ``(seed, epoch, index)`` and ``draw`` (:func:`reseed_parts`; found once per worker by
:mod:`autominato.pipeline.random_state`), in thread and process workers alike, so that a
crop depends on the sample, not on the worker, and the same seed gives it bit for bit with
any worker count.

Worker info. Every worker has an id in ``[0, workers)`` (a replacement, or a worker the
controller adds, takes the lowest free id, as the DataLoader's ids) and
``torch.utils.data.get_worker_info()`` returns its ``WorkerInfo(id, num_workers, seed,
dataset)`` there, ``seed`` being DataLoader's ``base_seed + id`` (the loader's seed as base in the
workers' first epoch; a new one where the DataLoader's workers would start afresh: ``WorkSpec.base_seed``).
A process worker sets torch's own process-wide record; thread workers cannot (the training
loop shares the process), so a thread-kind pipeline gives torch's getter, once, a body that
reads a thread-local record first (:func:`install_thread_getter`; references bound before see
it too): it still returns ``None`` in the training loop's thread. :func:`get_worker_info`
(``autominato.get_worker_info``) reads the same records. ``worker_init_fn(id)`` runs once in every worker before
its first sample, and again after the dataset is sent anew (``persistent_workers=False``).

Intra-op threads (BLAS, OpenMP, torch) of a worker process:

* A worker that descends from the training process by fork (a zygote forked from it, see
  :mod:`autominato.pipeline.spawn`) keeps **one** thread, as the DataLoader's workers do
  (``torch.set_num_threads(1)`` in its worker loop). GNU libgomp, the OpenMP runtime of
  torch's Linux wheels, does not survive fork: after the parent ran a parallel region, a
  child that enters one with more than one thread waits forever for pool threads that fork
  did not copy (GCC bug 60035). One thread never uses the pool.
* A worker forked by a zygote that is a new interpreter (or spawned) never inherited an
  OpenMP pool: it takes ``cores // workers`` threads (:func:`threads_per_worker`), updated
  when the worker count changes, so that workers x threads stays within the cores.

Memory between tasks. glibc keeps freed chunks below its mmap threshold (which rises up to
32 MiB as large arrays are freed) in the heap, so a persistent worker holds the high-water
mark of the transforms it ran, also while it waits. After a task, before it waits for the
next one (the loader sends a worker its next task only once it replied, so this usually
overlaps the round trip; not after a ``dataset`` message, which comes right before a task),
a process worker whose resident anonymous memory grew by :data:`HEAP_SLACK_BYTES` or more
since it last did so gives the free pages of its C heap back (:class:`HeapTrim`, glibc's
``malloc_trim``; once also at start, before it says it is ready): transforms of large
volumes, which free tens to hundreds of MB per sample, give them back; small samples keep
reusing warm pages. A zygote that forks its workers gives back its own free heap once when
it starts (:mod:`autominato.pipeline.spawn`).

Warm heap. Giving the heap back has a price: every page of the next sample's arrays is a new
page fault, zeroed by the kernel. On the KiTS19 bench (42 cases, MLPerf transforms) that was
half of a worker's CPU time (8-9 s of system time beside 9 s of user time per worker per
run); a process that kept its freed heap ran the same samples 25-40% faster. So the loader
lets a process worker keep up to ``keep`` bytes of free heap warm between samples
(``("heap", keep)``, sent by memory-aware dispatch, :meth:`SampleMemory.heap_keep
<autominato.pipeline.memory.SampleMemory.heap_keep>`: the upper quartile's figure, lowered to
what fits in the memory budget beside a larger sample while one runs, so that the peak stays
within the budget). Once ``keep`` is above 0 the
worker allocates every array from its heap (glibc ``mallopt``: no ``mmap`` per large array,
which would be unmapped and faulted anew every time, and no trim by ``free``), and its
give-backs keep ``keep`` bytes at the top of the heap (``malloc_trim(keep)``); a keep of 0
puts the allocator back (:func:`heap_only`). A sample's peak memory (:class:`PeakMeter`) counts
the warm heap it used (the free top of the heap when it began, ``mallinfo2``), so that the
figures stay the samples' working sets. The keep reaches a busy worker when its sample ends
(``ProcessWorkers.set_heap_keep``). A sample sent alone whose figure is below the keep
comes with it, and the worker trims its warm heap to that figure (plus
:data:`HEAP_SLACK_BYTES`) before it runs it (:meth:`HeapTrim.trim_for`); an outlier (a figure
above ``memory.COLD_ABOVE`` times the upper quartile's) comes with ``cold`` and runs without a
warm heap, its large arrays mapped on their own and unmapped when freed.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import inspect
import io
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autominato.pipeline import random_state
from autominato.pipeline.errors import ErrorReport, WorkerInitError, describe
from autominato.pipeline.memory import NO_RISE
from autominato.pipeline.rows import CLAIM
from autominato.pipeline.shm import (
    SCM_MAX_FD,
    FdDesc,
    SlotCache,
    fd_socket,
    pack,
    pack_memfd,
    pack_prepared,
    prepare,
    unpack,
    use_slot,
)


def _libc(name: str, argtypes: list, restype: Any) -> Callable | None:
    """The C library function ``name`` of this interpreter's C library, or ``None`` where it
    has none (another C library: musl, macOS; Windows has no ``CDLL(None)``)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


#: glibc's ``malloc_trim``, ``mallopt`` and ``mallinfo2`` (2.33 and later), or ``None``.
_malloc_trim = _libc("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def give_back_free_heap(keep: int = 0) -> bool:
    """Return the free pages of this process's C heap to the system: glibc's
    ``malloc_trim(keep)`` (``man 3 malloc_trim``: since glibc 2.8 it releases the whole free
    pages of free chunks in every arena, and shrinks the top of the main arena to ``keep``
    bytes above what is in use: those stay warm, see :func:`heap_only`). The memory
    stays the process's to allocate again, at the cost of its page faults then. Takes
    microseconds when little is free, ~14 ms after 320 MB of small arrays were freed
    (measured on this project's machines). Returns False where the C library has no
    ``malloc_trim`` (musl, macOS: nothing is done)."""
    if _malloc_trim is None:
        return False
    _malloc_trim(max(0, int(keep)))
    return True


_mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)

#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_mallinfo2 = _libc("mallinfo2", [], _Mallinfo2)


#: Environment settings by which a user tunes the C allocator (glibc's ``mallopt`` variables
#: and tunables, or another allocator preloaded): where one is set the workers keep no warm
#: heap and leave the allocator as the user set it (:func:`heap_only` refuses).
_USER_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                       "MALLOC_TOP_PAD_")


def user_tuned_allocator(env: dict | None = None) -> str | None:
    """The environment setting by which the user tuned this process's C allocator, or None:
    one of :data:`_USER_ALLOCATOR_ENV`, a ``GLIBC_TUNABLES`` with ``glibc.malloc.mmap_*``,
    ``trim_threshold``, ``top_pad`` or ``hugetlb`` (huge pages move glibc's mmap threshold
    limits, review 130), or an ``LD_PRELOAD`` of another allocator (jemalloc,
    tcmalloc, mimalloc: glibc's ``mallopt`` and ``mallinfo2`` are still found there and
    neither steer nor measure it)."""
    env = os.environ if env is None else env
    for name in _USER_ALLOCATOR_ENV:
        if env.get(name):
            return name
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(t in tunables for t in ("glibc.malloc.mmap_", "glibc.malloc.trim_threshold",
                                   "glibc.malloc.top_pad", "glibc.malloc.hugetlb")):
        return "GLIBC_TUNABLES"
    preload = env.get("LD_PRELOAD", "").lower()
    if any(a in preload for a in ("jemalloc", "tcmalloc", "mimalloc")):
        return "LD_PRELOAD"
    return None


def warm_heap_refused() -> str | None:
    """Why this process's allocator cannot keep a warm heap (:func:`heap_only`), or None:
    ``"glibc"`` (no ``mallopt``/``mallinfo2``: not glibc 2.33 or later), or the environment
    setting by which the user tuned the allocator (:func:`user_tuned_allocator`)."""
    if _mallopt is None or _mallinfo2 is None:
        return "glibc"
    return user_tuned_allocator()


def heap_only(on: bool = True) -> bool:
    """``on``: make this process's C allocator serve every block from its heap and never
    give free memory back by itself (glibc: ``mallopt(M_MMAP_MAX, 0)``,
    ``mallopt(M_TRIM_THRESHOLD, INT_MAX)``), so that only :func:`give_back_free_heap` does,
    keeping what it is told to. By default glibc maps each block above its mmap threshold
    (at most 32 MiB) on its own and unmaps it when freed: every such array of the next sample
    is then faulted in anew. The price: within a sample, an array freed below one still in
    use stays resident until the sample ends (its pages go back at the worker's next
    give-back, ``malloc_trim`` releasing free blocks in the middle of the heap too) where it
    would have been unmapped at once: a chain of ever larger arrays (40, 60, 90, 135 MiB)
    peaked 44% higher (review 116); the KiTS19 transforms' figures, 2% higher in sum.
    ``on=False``: back to mapping each block of 32 MiB or more on its own and trimming the
    heap's top over 64 MiB at a ``free``: where glibc's sliding threshold stands once a block
    that large was freed (``DEFAULT_MMAP_THRESHOLD_MAX``; it cannot be turned on again).
    glibc's first settings (128 KiB) mapped the 2 MiB arrays of samples whose keep went to 0
    at a hold on their own, where its default would have served them from the heap (trial
    120: 29 of 56 samples against 2 of 56). Returns False (and changes nothing) where
    :func:`warm_heap_refused` says why (not glibc 2.33 or later, or the user tuned the
    allocator: their settings stay)."""
    if warm_heap_refused() is not None:
        return False
    if on:
        return bool(_mallopt(_M_MMAP_MAX, 0)) and bool(_mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return (bool(_mallopt(_M_MMAP_MAX, 65536)) and bool(_mallopt(_M_MMAP_THRESHOLD, 32 << 20))
            and bool(_mallopt(_M_TRIM_THRESHOLD, 64 << 20)))


#: Growth of a worker's resident anonymous memory (bytes) since it last gave its free heap
#: back, from which it gives it back after a task: 16 MiB, so that workers of small samples
#: (which free little) skip the system call and keep their warm pages. Measured on the KiTS19
#: bench (8 cases, 6 epochs, 4 interleaved repeats, peak PSS): 927 MB with 16 MiB, 938 MB
#: with a trim after every task, 981 MB without (a second run: 964 vs 988 MB); wall and CPU
#: time alike within the noise in both.
HEAP_SLACK_BYTES = 16 << 20

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HeapTrim:
    """Gives the heap's free pages back (:func:`give_back_free_heap`) when this process's
    resident anonymous memory grew by ``slack`` bytes since the last time; the first time at
    once (what start-up, unpickling the dataset and ``worker_init_fn`` freed). Make it in the
    process that uses it (it keeps that process's ``/proc/self/statm`` open until
    :meth:`close`). Without ``/proc`` every :meth:`after_task` gives back."""

    def __init__(self, slack: int = HEAP_SLACK_BYTES) -> None:
        self.slack = slack
        self.keep = 0  # bytes of free heap kept warm at each give-back (set_keep)
        self.whole = False  # keep is a cap on the growth since the last give-back (set_keep)
        self.floor: int | None = None  # resident bytes after the last give-back
        self.heap_mode = False  # heap_only() is on: every block comes from the heap
        self.cold = False  # a task runs with heap_only() off (trim_for(cold=True))
        self.given = 0  # times the heap was given back
        try:
            self._statm: int | None = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._statm = None
        self.base: int | None = None
        self._give_back()

    def resident_bytes(self) -> int | None:
        """Resident anonymous memory (bytes): ``statm``'s resident minus its shared pages
        (file-backed and shared memory: the slots a worker maps do not count)."""
        if self._statm is None:
            return None
        try:
            fields = os.pread(self._statm, 128, 0).split()
            return (int(fields[1]) - int(fields[2])) * _PAGE
        except (OSError, ValueError, IndexError):
            return None

    def after_task(self) -> None:
        """Called between two tasks: gives back if the memory grew by ``slack`` since the
        last give-back, or since its lowest reading after it; after a task run cold
        (:meth:`trim_for`) the allocator serves every block from its heap again first."""
        if self.cold:
            self.cold = False
            heap_only(True)
        rss = self.resident_bytes()
        if rss is not None and self.base is not None and rss - self.base < self.slack:
            self.base = min(self.base, rss)  # freed without a trim: count growth from here
            return
        self._give_back()

    def after_dataset(self) -> None:
        """Called after a new copy of the dataset replaced the old one (``persistent_workers=
        False``: once a pass): keeping its whole heap (:meth:`set_keep`'s ``whole``), gives
        back all of its free heap now, after a garbage collection (the old copy and the
        pickled bytes, freed below the new copy: review 202 saw a worker of a 120 MiB
        dataset hold 518 MiB after four passes, 133 without), which the samples then take
        again; otherwise :meth:`after_task` gives it back as after a task."""
        if self.whole and self.keep:
            # The old copy may sit in a reference cycle, freed only by a collection inside a
            # later sample, below the new copy: kept there, as the whole heap is, one copy
            # more a pass (137, 257, 377, 497 MiB over four passes of a 120 MiB dataset
            # that refers to itself; CI saw one more where it could not be reproduced).
            gc.collect()
            if give_back_free_heap(0):
                self.given += 1
            self.base = self.floor = self.resident_bytes()

    def set_keep(self, keep: int, whole: bool = False) -> None:
        """Keep up to ``keep`` bytes of free heap warm from now on (between tasks: the
        worker's ``("heap", keep, whole)``). A ``keep`` above 0 makes the allocator heap-only
        (:func:`heap_only`); a smaller one gives back the excess now; 0 gives it all back and
        puts the allocator back to mapping large blocks on their own. ``whole``
        (``memory_aware=False``): ``keep`` is a cap, and the worker gives nothing back while
        its resident memory grew by at most that since its last give-back, else all but
        ``keep`` bytes at the top of the heap and every free block inside it; without it
        each give-back keeps ``keep`` bytes at the top and releases the free blocks inside
        the heap (``malloc_trim``). Nothing changes where the C library is not glibc 2.33
        or later."""
        keep = max(0, int(keep))
        self.whole = bool(whole)
        if keep == self.keep:
            return
        if keep and not self.heap_mode:
            if not heap_only():
                return  # another C library: as before
            self.heap_mode = True
        elif not keep and self.heap_mode:
            heap_only(False)
            self.heap_mode = self.cold = False
        shrink = keep < self.keep
        self.keep = keep
        if shrink:
            self._give_back()

    def trim_for(self, need: int, cold: bool = False) -> None:
        """Before a task whose last figure was ``need`` bytes: give back the free top of the
        heap beyond ``need + slack`` (``malloc_trim``), so that a worker running a sample
        smaller than :attr:`keep` does not hold the rest warm beside it (the keep stays: the
        task's growth is given back to it as before, :meth:`after_task`). The task faults
        in what it needs beyond that. Nothing is done where ``need + slack`` is the keep or
        more, the free top is already within it, or no warm heap is kept.

        ``cold``: the task is an outlier (``Pipeline._task_heap``: its figure above twice the
        upper quartile's): it runs as without a warm heap, the free top given back to
        ``slack`` and each block of 32 MiB or more that no free block of the heap holds
        mapped on its own and unmapped when freed (:func:`heap_only` off) until
        :meth:`after_task` (glibc serves a block from a free one first: a hole left below
        a block still in use, its pages given back by ``malloc_trim``, takes a large array
        and keeps it resident after ``free``, as from the heap alone, review 130). From the
        heap alone, the arrays an outlier frees stay resident below those it still uses
        until it ends: trial 128's MONAI workload peaked at 7.35 GB that way against
        5.76-6.03 GB cold (docs/memory.md, "An outlier runs cold")."""
        if not self.heap_mode or not self.keep:
            return
        if cold:
            # (set before the calls: where one of heap_only's mallopt calls fails after
            # another took, after_task still puts the heap-only settings back, review 130)
            self.cold = True
            heap_only(False)
            pad = self.slack
        elif need + self.slack >= self.keep:
            return
        else:
            pad = max(0, int(need)) + self.slack
        trim = int(_mallinfo2().keepcost) > pad
        if trim and give_back_free_heap(pad):
            self.given += 1
        if trim or cold:
            self.base = self.resident_bytes()

    def warm_bytes(self) -> tuple[int, int]:
        """``(bytes of free heap held warm, bytes of heap held)``, from one ``mallinfo2``: the
        free top of the heap (``keepcost``, what ``malloc_trim(keep)`` leaves there) at most
        :attr:`keep`, 0 when it keeps none, and what the allocator holds from the system in
        all its heaps (``arena``: it grows when a block did not fit in the free heap, the
        warm heap included, and shrinks only at a give-back). Not the process's growth since
        some point: memory a dataset's cache or a thread's arena took is not free heap
        (review 116)."""
        if not self.keep or not self.heap_mode:
            return 0, 0
        info = _mallinfo2()
        return min(self.keep, int(info.keepcost)), int(info.arena)

    def close(self) -> None:
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None

    def _give_back(self) -> None:
        if self.whole and self.keep:
            # Nothing while the resident memory grew by at most the cap since the last
            # give-back (malloc_trim(pad) would give back the free blocks inside the heap
            # whatever the pad, and the next sample would fault them in again). Not glibc's
            # free bytes (mallinfo2().fordblks): they keep counting the blocks whose pages a
            # trim gave back, so after one hole over the cap every later task trimmed
            # (review 203).
            rss = self.resident_bytes()
            if rss is not None and self.floor is not None and rss - self.floor <= self.keep:
                self.base = rss
                return
        if give_back_free_heap(self.keep):
            self.given += 1
        self.base = self.floor = self.resident_bytes()


class PeakMeter:
    """A task's peak memory in this process: the resident set's high-water mark above the
    resident set when the task began, bytes.

    Linux resets ``VmHWM`` to the current resident set when ``5`` is written to
    ``/proc/self/clear_refs`` (since 4.0; ``Documentation/filesystems/proc.rst``); 25 us a task
    here for the write and the two reads, so only tasks sent alone (10 ms or more, see
    ``executors.CHUNK_BUDGET_S``) are measured. Make it in the process that uses it. Without
    that file (another OS, a restricted ``/proc``) :meth:`start` returns ``None``."""

    def __init__(self) -> None:
        fds: list[int] = []
        try:
            for name, mode in (("clear_refs", os.O_WRONLY), ("statm", os.O_RDONLY),
                               ("status", os.O_RDONLY)):
                fds.append(os.open(f"/proc/self/{name}", mode | os.O_CLOEXEC))
        except OSError:
            for fd in fds:
                os.close(fd)
            fds = []
        self._clear, self._statm, self._status = fds or (None, None, None)
        #: the worker's :class:`HeapTrim` (set by its loop): a task fills the warm heap it
        #: keeps before its resident set rises (see :meth:`peak`)
        self.heap: HeapTrim | None = None
        self._warm = 0
        self._heap_bytes = 0

    def close(self) -> None:
        for fd in (self._clear, self._statm, self._status):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._clear = self._statm = self._status = None

    def start(self) -> int | None:
        """Reset the high-water mark; returns the resident bytes now (the task's base)."""
        if self._clear is None:
            return None
        try:
            os.write(self._clear, b"5")
            resident = int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE
            self._warm, self._heap_bytes = (self.heap.warm_bytes() if self.heap is not None
                                            else (0, 0))
            return resident
        except (OSError, ValueError, IndexError):
            self._clear = None
            return None

    def peak(self, base: int | None) -> int:
        """Bytes the resident set rose above ``base`` at most since :meth:`start`; 0 unknown.

        At least :data:`~autominato.pipeline.memory.NO_RISE` (1) when measured: a task that
        needed no new page, its memory from the heap the worker kept (``SampleMemory.learn``
        says what it counts as), so that 0 means only "not measured". Where the worker kept a
        warm heap of ``w`` bytes when the task began (:meth:`HeapTrim.warm_bytes`): a task
        whose heap grew (a block did not fit in the free heap, which it filled first) needed ``w + r`` for a rise ``r``; one whose heap did not
        grow but rose by :data:`HEAP_SLACK_BYTES` or more took pages back inside it and
        returns ``w + r`` (at most that); one that rose by less needed ``w + r`` at most (the
        free blocks inside the heap it used besides are not counted), which it returns negated:
        a bound (``SampleMemory.learn`` keeps a figure the index has, else takes it, at most
        the median; as "no rise" the first figures of samples that fitted read 16 MiB,
        review 116; taken whole, small samples read the whole warm heap, review 118)."""
        if base is None or self._status is None:
            return 0
        try:
            text = os.pread(self._status, 4096, 0)
            at = text.index(b"VmHWM:")
            rise = int(text[at + 6:text.index(b"kB", at)]) * 1024 - base
        except (OSError, ValueError):
            return 0
        if self._warm:
            # A heap that grew (the warm heap filled first), or pages faulted back inside it
            # (``malloc_trim`` gives free blocks there back whole, review 118: a 280 MiB
            # sample read as a bound and its index kept a 40 MiB figure): the rise and the
            # warm top, taken as a figure. For the second an upper bound: the rise alone read
            # a sample that used both at 151 MiB for 211 (review 121); a sample that did not
            # use the top reads up to the warm heap more (review 119: 40 MiB read 104), the
            # safe side.
            if rise >= HEAP_SLACK_BYTES or int(_mallinfo2().arena) > self._heap_bytes:
                return max(0, rise) + self._warm
            return -(max(0, rise) + self._warm)
        return max(NO_RISE, rise)


_meter: tuple[int, PeakMeter] | None = None


def _peak_meter() -> PeakMeter:
    global _meter
    if _meter is None or _meter[0] != os.getpid():  # (a fork's /proc/self is another's)
        if _meter is not None:
            _meter[1].close()  # the parent's descriptors, inherited
        _meter = (os.getpid(), PeakMeter())
    return _meter[1]


def takes_rng(fn: Callable | None) -> bool:
    """Whether ``fn`` is called as ``fn(sample, rng)`` rather than ``fn(sample)``.

    True when ``fn`` has exactly two required positional parameters, or its second positional
    parameter is named ``rng`` (``def aug(sample, rng=None)``). A MONAI ``Compose`` (one
    required parameter, the rest defaulted) is therefore called as ``fn(sample)``.
    """
    if fn is None:
        return False
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    # ``def aug(sample, rng=None)`` asks for the generator by name.
    return len(required) == 2 or (len(positional) >= 2 and positional[1].name == "rng")


@dataclass
class WorkSpec:
    """Everything a worker needs. Forked workers inherit it; a zygote in a new interpreter
    receives it cloudpickled, once (see :mod:`autominato.pipeline.spawn`)."""

    dataset: Any
    transform: Callable | None
    transform_takes_rng: bool
    seed: int
    threads_per_worker: int = 1
    worker_init_fn: Callable[[int], None] | None = None
    #: The process that built the spec (the training process): its main thread runs the
    #: objects themselves, never copies (``random_state.plan``'s ``trace_map``).
    home_pid: int = field(default_factory=os.getpid)
    #: ``id()`` of the dataset's and transform's MONAI invertible transforms in the training
    #: process (``random_state.trace_ids``), for workers that hold copies.
    trace_ids: tuple = ()
    #: The workers' base seed (DataLoader's ``base_seed``: ``get_worker_info().seed`` is it
    #: plus the worker id, and the generators are seeded from it before ``worker_init_fn``);
    #: ``None``: ``seed``. A dataset sent again for epoch ``e`` (``persistent_workers=False``,
    #: where ``worker_init_fn`` runs again as in the DataLoader's fresh workers) comes with
    #: :func:`pass_base_seed` ``(seed, e)``, so that a generator the function seeds from it
    #: does not repeat its draws each time.
    base_seed: int | None = None
    #: An iterable dataset's shard sees ``get_worker_info().seed`` of the pass's epoch,
    #: :func:`pass_base_seed` ``(seed, epoch) + shard``, as the DataLoader's workers that start
    #: afresh each epoch (``persistent_workers=False``, its default; the Loader's default is
    #: persistent workers, which keep theirs); ``False`` where ``persistent_workers=True`` was
    #: asked for: one seed for the workers' life, as the DataLoader's persistent workers.
    seeds_each_epoch: bool = False
    #: Arrays travel in their own memory order (``shm.pack_prepared``'s ``keep_order``): where
    #: the samples are seen as they are (``batch_size=None``, a ``collate_fn`` of the user's),
    #: not stacked C-contiguous by the default collation.
    keep_layout: bool = True
    #: MONAI's ``set_track_meta`` as the Loader was built (``None``: MONAI not imported),
    #: set in each worker process before ``worker_init_fn``: a worker that does not descend
    #: from the training process as it is now (a new interpreter, started because a thread
    #: ran; or forked from the fork server of an earlier Loader) had MONAI's default, and
    #: ``set_track_meta(False)`` gave MetaTensors all the same (trial 165). Only where the
    #: worker has MONAI imported (by the dataset or transform it unpickled).
    monai_track_meta: bool | None = None

    def worker_base_seed(self) -> int:
        """The workers' base seed now: :attr:`base_seed`, else :attr:`seed`."""
        return self.seed if self.base_seed is None else self.base_seed


@functools.lru_cache(maxsize=64)
def pass_base_seed(seed: int, epoch: int) -> int:
    """The workers' base seed for epoch ``epoch`` of a Loader of ``seed``: ``seed`` itself at
    epoch 0 (the workers' first), else a 64-bit number drawn from ``SeedSequence([seed,
    epoch])`` in ``[0, 2**63)``, as the DataLoader's fresh workers get a new ``base_seed``
    every epoch (it draws one with ``torch.int64``'s ``random_()``, in that range, from the
    main process's generator at each ``iter()``; here it follows the seed and the epoch, as
    the augmentation does)."""
    if epoch == 0:
        return seed
    state = np.random.SeedSequence([seed & _U64, epoch & _U64]).generate_state(1, np.uint64)[0]
    return int(state) >> 1


class PickleTooLarge(ValueError):
    """:func:`dumps_for_worker`'s pickle grew past its ``limit``."""


class _Bounded(io.BytesIO):
    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit

    def write(self, b: Any) -> int:
        # (checked before the copy: pickle writes an array's buffer in one call, review 150)
        if self.limit is not None and self.tell() + memoryview(b).nbytes > self.limit:
            raise PickleTooLarge(f"the pickle passed {self.limit} bytes")
        return super().write(b)


def dumps_for_worker(obj: Any, limit: int | None = None) -> bytes:
    """``obj`` cloudpickled for a worker that does not fork from the training process as it
    is now (a new interpreter, another Loader's zygote, a dataset sent again), followed in the
    same stream by the training script's classes that this pickle carried by value.

    cloudpickle sends the script's (``__main__``'s) classes by value, so a worker rebuilds
    them, while a sample of one (a ``NamedTuple``, a dataclass) travels back by *reference*,
    ``__main__.Name``, which that worker's ``__main__`` lacks or holds as another object (the
    DataLoader's forked workers have the script's own). :func:`loads_for_worker` puts those
    classes into the worker's ``__main__``, so the reference resolves there, to the class the
    sample has, and in the training process to the script's class. Only classes the object
    itself reaches are sent (recorded as the pickler meets them: nothing is pickled twice,
    and a class the dataset never uses is neither pickled nor unpickled), and the same memo
    makes them the very objects the dataset's pickle rebuilds.

    Raises:
        PickleTooLarge: the pickle grew past ``limit`` bytes (given), which it stops at.
    """
    import cloudpickle

    found: dict[str, type] = {}

    arrays = 0  # bytes of the arrays and tensors met so far (with a limit)
    torch = sys.modules.get("torch")
    big = (np.ndarray,) if torch is None else (np.ndarray, torch.Tensor)

    class Recording(cloudpickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            nonlocal arrays
            if limit is not None and isinstance(o, big):
                # (a tensor is serialized whole into bytes before it is written: stop first)
                arrays += int(o.nbytes)
                if arrays > limit:
                    raise PickleTooLarge(f"the pickle passed {limit} bytes")
            home = getattr(o, "__module__", None) if isinstance(o, type) else None
            if home in _SCRIPT_MODULES:
                name = o.__qualname__
                if "." not in name and getattr(sys.modules.get(home), name, None) is o:
                    found[name] = o
            return super().reducer_override(o)

    # A rank that torch.multiprocessing.spawn (or multiprocessing's spawn) started runs the
    # script as __mp_main__, which cloudpickle pickles by reference, as an importable module:
    # a new interpreter has no such module (its __mp_main__ is its own __main__), and found
    # no class of the script (trial 147: "Can't get attribute 'DS' on <module '__main__'>",
    # where the DataLoader's workers, which get the script run again, work). By value, as
    # __main__'s (taken back after: cloudpickle's registry is the process's).
    mp_main = sys.modules.get("__mp_main__")
    by_value = mp_main is not None and getattr(mp_main, "__name__", None) == "__mp_main__"
    if by_value:
        _mp_main_by_value(cloudpickle, mp_main, +1)
    try:
        buf = _Bounded(limit)
        pickler = Recording(buf, protocol=cloudpickle.DEFAULT_PROTOCOL)
        pickler.dump(obj)
        pickler.dump(found)
    finally:
        if by_value:
            _mp_main_by_value(cloudpickle, mp_main, -1)
    return buf.getvalue()


_by_value_lock = threading.Lock()
_by_value_users = 0  # dumps_for_worker calls under way that need __mp_main__ by value
_by_value_ours = False  # registered by them (not by the user, whose registration stays)


def _mp_main_by_value(cloudpickle: Any, module: Any, step: int) -> None:
    """Register ``__mp_main__`` with cloudpickle by value for the first of the dumps under
    way (``step`` +1), unregister it after the last (-1): the registry is the process's, and
    two threads dumping at once must not unregister it under each other (review 149)."""
    global _by_value_users, _by_value_ours
    with _by_value_lock:
        if step > 0:
            if _by_value_users == 0:
                _by_value_ours = module.__name__ not in cloudpickle.list_registry_pickle_by_value()
                if _by_value_ours:
                    cloudpickle.register_pickle_by_value(module)
            _by_value_users += 1
        else:
            _by_value_users -= 1
            if _by_value_users == 0 and _by_value_ours:
                _by_value_ours = False
                if module.__name__ in cloudpickle.list_registry_pickle_by_value():
                    cloudpickle.unregister_pickle_by_value(module)


#: The modules a training script runs as: ``__main__``, or ``__mp_main__`` in a process that
#: multiprocessing's spawn started (a rank of ``torch.multiprocessing.spawn``).
_SCRIPT_MODULES = ("__main__", "__mp_main__")


def script_classes_note(*objs: Any) -> str:
    """Where one of ``objs`` (a dataset, a transform) is an instance of a class defined in the
    training script, a sentence for an error of its pickle: such classes travel by value,
    with the module globals their methods use, so ``pickle.dumps`` of the object can succeed
    where the worker's pickle fails (trial 179: a module-level ``sqlite3`` connection used
    in ``__getitem__``). Else ``""``."""
    names = sorted({type(o).__qualname__ for o in objs
                    if o is not None and type(o).__module__ in _SCRIPT_MODULES})
    if not names:
        return ""
    return (f" The script's own class{'es' if len(names) > 1 else ''} "
            f"{', '.join(names)} (defined in __main__) travel{'' if len(names) > 1 else 's'} "
            "by value, with the module globals their methods use (an open connection, file "
            "or lock among them): define the class in a module the workers can import, or "
            "open such a resource in the worker (worker_init_fn, or at first use in "
            "__getitem__).")


def loads_for_worker(data: bytes | Any) -> Any:
    """The object of :func:`dumps_for_worker` (``data``: its bytes, or a file positioned at
    them), after putting the script's classes it carried into this process's ``__main__``."""
    import io
    import pickle

    if isinstance(data, (bytes, bytearray, memoryview)):
        data = io.BytesIO(data)
    unpickler = pickle.Unpickler(data)
    obj = unpickler.load()
    classes = unpickler.load()
    for home in {id(m): m for m in map(sys.modules.get, _SCRIPT_MODULES) if m is not None}.values():
        for name, cls in classes.items():
            setattr(home, name, cls)
    return obj


#: A sample's index: its dataset index, or for an iterable dataset ``(worker id, k)``, the k-th
#: sample that worker's shard yielded.
Index = int | tuple[int, int]


#: 2**64 - 1: seeds and the mixer's arithmetic are unsigned 64-bit, as torch's.
_U64 = 0xFFFFFFFFFFFFFFFF


def _key(index: Index, draw: int) -> tuple[int, ...]:
    """``index`` (a stream's ``(worker id, k)`` unpacked), then ``draw`` when it is not 0."""
    rest = index if isinstance(index, tuple) else (index,)
    return (*rest, draw) if draw else rest


def sample_rng(seed: int, epoch: int, index: Index, draw: int = 0) -> np.random.Generator:
    """The generator of one sample's augmentation: ``default_rng(SeedSequence([seed, epoch, index]))``;
    for an iterable dataset ``index`` is ``(worker id, k)`` (the k-th sample that worker's
    shard yielded): ``SeedSequence([seed, epoch, worker id, k])``.

    ``draw``: which occurrence of ``index`` in the epoch's order this is, counted from 0
    (:func:`autominato.pipeline.epoch.occurrences`); a sampler that repeats an index in an
    epoch (``WeightedRandomSampler(replacement=True)``) gets a new augmentation for each
    repeat, ``SeedSequence([seed, epoch, index, draw])``, as the DataLoader's workers draw
    anew from their streams; the first occurrence's generator is the one above.

    Touches no global generator (see :func:`seed_globals` for worker processes)."""
    return np.random.default_rng(
        np.random.SeedSequence([seed & _U64, epoch, *_key(index, draw)]))


def _mix(*values: int) -> int:
    """A 32-bit seed from integers: SplitMix64's finaliser over each (Steele, Lea and Flood,
    "Fast splittable pseudorandom number generators", OOPSLA 2014); 1 us where
    ``SeedSequence.generate_state`` takes 10."""
    x = 0
    for v in values:
        x = (x ^ (v & _U64)) + 0x9E3779B97F4A7C15 & _U64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _U64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _U64
        x ^= x >> 31
    return x & 0xFFFFFFFF


def seed_globals(*key: int) -> None:
    """Seed Python's ``random``, NumPy's legacy global generator and torch's default generator
    from ``key``: ``(seed, epoch, index)`` for one sample (``draw`` appended for a repeat,
    see :func:`sample_rng`), or ``(seed, epoch, worker id, k)`` for the k-th sample of an
    iterable dataset's shard (see the module docstring; before ``worker_init_fn``:
    :func:`seed_worker`).

    Only for worker processes: in the training process it would reseed the user's own
    generators."""
    s32 = _mix(*key)
    random.seed(s32)
    np.random.seed(s32)
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    # Not torch.manual_seed: with CUDA not initialised (a worker's usual state) it queues a
    # lazy CUDA seeding and formats the whole call stack for it, about 1 ms per sample.
    torch.default_generator.manual_seed(s32)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s32)


def worker_seed(base_seed: int, wid: int) -> int:
    """Worker ``wid``'s seed, DataLoader's ``base_seed + worker_id`` modulo 2**64 (what
    ``torch.initial_seed()`` returns there: a negative or huge ``base_seed`` wraps)."""
    return (base_seed + wid) & _U64


def seed_worker(base_seed: int, wid: int) -> None:
    """Seed a worker process's global generators as the DataLoader's worker loop does
    (``torch/utils/data/_utils/worker.py``): Python's ``random`` and torch's default generator
    from ``base_seed + wid`` (so that ``torch.initial_seed()`` in ``worker_init_fn`` equals
    ``get_worker_info().seed``, the idiom of PyTorch's reproducibility notes), NumPy's legacy
    generator from torch's ``_generate_state(base_seed, wid)`` (4 x uint32).

    Before ``worker_init_fn`` only: each sample reseeds them (:func:`seed_globals`)."""
    import torch

    seed = worker_seed(base_seed, wid)
    random.seed(seed)
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: see seed_globals
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    try:
        from torch.utils.data._utils.worker import _generate_state  # (private to torch)
    except ImportError:  # pragma: no cover - a torch that moved it: a seed of the same key
        np.random.seed(_mix(base_seed, wid))
    else:
        np.random.seed(_generate_state(base_seed & _U64, wid))


#: Attributes of a dataset that list its samples' files, one item an index: MONAI's
#: ``Dataset``, ``CacheDataset``, ``PersistentDataset`` (``data``: a file name or a dict of
#: them per sample, MONAI's idiom), torchvision's ``DatasetFolder`` and ``ImageFolder``
#: (``samples``: ``(path, class)``), MONAI's ``ImageDataset`` (``image_files`` and
#: ``seg_files``: a sample's names are those of every list that has one item an index; trial
#: 165: its errors named no file).
FILE_LISTS = ("data", "samples", "image_files", "seg_files")


#: The most strings of one sample's item that :func:`sample_files` looks at (an item that
#: holds a long list of strings, tokens or names, is not a list of files).
MAX_ITEM_PATHS = 64


def _paths_in(item: Any) -> list[str]:
    """The strings (and ``os.PathLike``) of ``item``: itself, or its values (a dict), or its
    elements (a list or tuple), one level down into lists (a series of files per key); at
    most :data:`MAX_ITEM_PATHS`."""
    if isinstance(item, (str, os.PathLike)):
        return [os.fspath(item)]
    if isinstance(item, Mapping):
        values = list(item.values())
    elif isinstance(item, (list, tuple)):
        values = list(item)
    else:
        return []
    out: list[str] = []
    for v in values:
        if isinstance(v, (str, os.PathLike)):
            out.append(os.fspath(v))
        elif isinstance(v, (list, tuple)):
            out.extend(os.fspath(x) for x in v[:MAX_ITEM_PATHS]
                       if isinstance(x, (str, os.PathLike)))
        if len(out) >= MAX_ITEM_PATHS:
            break
    return [p for p in out[:MAX_ITEM_PATHS] if p and "\0" not in p]


def _listed(dataset: Any, index: int) -> tuple[Any, int, list[str] | None]:
    """``(dataset, index, names)``: a ``Subset`` followed to its dataset and index; ``names``
    the strings of the item that a list attribute of :data:`FILE_LISTS` with one item per
    index holds for ``index``, or ``None`` (the dataset defines ``sample_path``, or lists
    nothing)."""
    from torch.utils.data import Subset

    while isinstance(dataset, Subset):
        index, dataset = int(dataset.indices[index]), dataset.dataset
    if callable(getattr(dataset, "sample_path", None)):
        return dataset, index, None
    names: list[str] | None = None
    for name in FILE_LISTS:
        items = getattr(dataset, name, None)
        if isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
            if len(items) != len(dataset) or not 0 <= index < len(items):
                continue
            names = (names or []) + _paths_in(items[index])
    return dataset, index, names


def _own_path(dataset: Any, index: int) -> str | None:
    """The dataset's ``sample_path(index)`` as a string, ``None`` where it defines none, it
    returns ``None`` or it raises."""
    fn = getattr(dataset, "sample_path", None)
    if not callable(fn):
        return None
    try:
        p = fn(index)
    except Exception:
        return None
    return None if p is None else str(p)


def sample_files(dataset: Any, index: int) -> list[str]:
    """The files (or directories: a DICOM series) sample ``index`` is read from, that exist:
    the dataset's ``sample_path(index)`` where it defines one (``[]`` for ``None``, an error
    or a path that is not there); else, where a list attribute of :data:`FILE_LISTS` has one
    item per index, the names in ``index``'s item that exist (a string that is a class name or
    a key is not a file); else ``[]``. A ``torch.utils.data.Subset`` is followed to its
    dataset's index. For :attr:`~autominato.pipeline.memory.SampleMemory.size_of`; errors
    name :func:`sample_path`'s."""
    try:
        dataset, index, names = _listed(dataset, index)
        if names is None:
            own = _own_path(dataset, index)
            names = [own] if own is not None else []
        return [p for p in names if _names_file(p)]
    except Exception:  # (the dataset's own attributes: naming a file is not worth an error)
        return []


def _names_file(p: str) -> bool:
    """Whether ``p`` names a file that exists, or a directory that exists given with a
    directory part (``imgs/case_1``, a DICOM series: not ``train``, a split's name that
    happens to be a directory here, review 129)."""
    return os.path.isfile(p) or (os.sep in p and os.path.isdir(p))


def _looks_like_path(p: str) -> bool:
    """Whether ``p``, which names nothing that exists, reads as a file name: no whitespace,
    and an extension of 1-10 letters or digits (a sentence of a text dataset is not one,
    review 129)."""
    ext = os.path.splitext(p)[1][1:]
    return (not any(c.isspace() for c in p) and 0 < len(ext) <= 10 and ext.isalnum())


def _error_text(error: BaseException | None) -> str:
    """The messages and ``filename`` attributes of ``error`` and the exceptions it chains
    (``__cause__``, ``__context__``; MONAI wraps a loader's error in a ``RuntimeError``)."""
    parts: list[str] = []
    seen: set[int] = set()
    e = error
    while isinstance(e, BaseException) and id(e) not in seen and len(seen) < 16:
        seen.add(id(e))
        for v in (getattr(e, "filename", None), getattr(e, "filename2", None), str(e)):
            if isinstance(v, (str, os.PathLike)):
                parts.append(os.fspath(v))
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def _mentions(text: str, name: str) -> bool:
    """Whether ``text`` names the file ``name`` (as given, or as an absolute path), as a
    whole path: not inside another word or path (``image`` in "reading image file", ``a.nii``
    in ``a.nii.gz``, ``ok.png`` as the end of ``../d/ok.png``: review 156)."""
    for form in {name, os.path.abspath(name)}:
        if re.search(r"(?<![\w./\\-])" + re.escape(form) + r"(?![\w/\\-]|\.\w)", text):
            return True
    return False


def sample_path(dataset: Any, index: int, error: BaseException | None = None) -> str | None:
    """The file sample ``index`` is read from, for errors, or ``None``: the dataset's
    ``sample_path(index)`` where it defines one; else, where it lists its samples' files
    (:func:`sample_files`): the name that ``error`` (the sample's error) mentions, else the
    first that reads as a file name and names nothing that exists (a file missing or
    misspelled is the most common bad input, review 127; an item's label that exists was
    named for its missing image: trial 155), else the first name in the item that exists."""
    try:
        dataset, index, names = _listed(dataset, index)
        if names is None:
            return _own_path(dataset, index)
        exists = {p: _names_file(p) for p in names}
        if error is not None:
            text = _error_text(error)
            for p in names:
                if p and (exists[p] or _looks_like_path(p)) and _mentions(text, p):
                    return p
        for p in names:
            if not exists[p] and _looks_like_path(p):
                return p
        for p in names:
            if exists[p]:
                return p
    except Exception:  # (the dataset's own attributes: naming a file is not worth an error)
        pass
    return None


def run_sample(
    spec: WorkSpec, index: Index, epoch: int, read: bool, sample: Any = None, draw: int = 0
) -> tuple[Any, float, float]:
    """Read (when ``read``) and transform one sample (``index`` and ``draw``: see
    :func:`sample_rng`).

    Returns:
        ``(sample, read_seconds, transform_seconds)``; ``read_seconds`` is 0 when not
        ``read``.
    """
    own = random_state.plan(spec)  # this thread's dataset and transform, and their Randomizables
    # (its first call in a thread or process walks the dataset: the stage's start, not this
    # sample's time, which the Data Monitor's slowest read would show: review 110)
    t0 = time.perf_counter()
    if read:
        reseed_parts(own.dataset_parts, spec.seed, epoch, index, 0, draw)
        sample = _read(own.dataset, index)
    # (not read here: a read stage timed it, and read_seconds is 0, so that the read stage's
    # figures count each sample once: audit 85)
    t1 = time.perf_counter() if read else t0
    if spec.transform is not None:
        reseed_parts(own.transform_parts, spec.seed, epoch, index, 1, draw)
        if spec.transform_takes_rng:
            sample = own.transform(sample, sample_rng(spec.seed, epoch, index, draw))
        else:
            sample = own.transform(sample)
    if own.trace_map:  # (MONAI's records: the training process's transforms' ids)
        random_state.retrace(sample, own.trace_map)
    return sample, t1 - t0, time.perf_counter() - t1


#: Dataset types whose ``__getitems__`` gave something other than one sample for one index
#: (a batched read returning columns): read through ``__getitem__`` (warned once each).
_GETITEMS_OFF: set[type] = set()


def _read(dataset: Any, index: Index) -> Any:
    """``dataset[index]``, or, where the dataset defines ``__getitems__`` (torch's batched
    read, which the DataLoader's fetcher calls in place of ``__getitem__``: a ``Subset``, a
    Hugging Face dataset), ``dataset.__getitems__([index])[0]``, so that both loaders read the
    same data (trial 160: it was ignored). One index a call: samples go to the workers one by
    one (or in chunks of fast ones), each seeded for its own index. A ``__getitems__`` that
    returns no list or tuple of one sample (a batched read returning columns, which torch
    hands to ``collate_fn`` as it is, review 161) is not used: the sample is read through
    ``__getitem__``, as before, and a warning says so once per dataset type."""
    getitems = getattr(dataset, "__getitems__", None)
    if not getitems or type(dataset) in _GETITEMS_OFF:
        return dataset[index]
    out = getitems([index])
    if isinstance(out, (list, tuple)) and len(out) == 1:
        return out[0]
    _GETITEMS_OFF.add(type(dataset))
    warnings.warn(
        f"{type(dataset).__name__}.__getitems__([{index!r}]) returned "
        f"{type(out).__name__} {_describe_len(out)}, not a list of one sample: its samples are "
        "read through __getitem__ (a batched __getitems__ returning columns is not used; the "
        "DataLoader hands its result to collate_fn whole)", stacklevel=2)
    return dataset[index]


def _describe_len(out: Any) -> str:
    try:
        return f"of length {len(out)}"
    except TypeError:
        return "without a length"


def reseed_parts(parts: list, seed: int, epoch: int, index: Index, group: int,
                 draw: int = 0) -> None:
    """Seed the ``RandomState`` of each MONAI ``Randomizable`` in ``parts`` (found by
    :func:`autominato.pipeline.random_state.plan`) with ``_mix(seed, epoch, index, group) + i``
    (mod 2**32; ``_mix(seed, epoch, index, draw, group)`` for a repeat, ``draw`` as in
    :func:`sample_rng`), ``i`` its place in ``parts`` and ``group`` 0 for the dataset's, 1 for
    the transform's. Consecutive seeds for the parts, as MONAI's ``set_rnd`` gives them; MT19937's
    seeding (Matsumoto and Nishimura's ``init_genrand``) decorrelates neighbouring seeds.

    In place (``RandomState.seed``), not ``set_random_state(seed=...)``, which first builds a
    new ``RandomState`` from operating-system entropy: for a 7-part ``Compose`` this takes
    tens of microseconds per sample where ``Compose.set_random_state`` takes milliseconds
    (measured on a loaded 2-core machine)."""
    if parts:
        base = _mix(seed, epoch, *_key(index, draw), group)  # (worker id, k): a stream's
        for i, part in enumerate(parts):
            part.R.seed((base + i) & 0xFFFFFFFF)


# -- worker info and worker_init_fn ---------------------------------------------------------

_local = threading.local()


def make_info(spec: WorkSpec, wid: int, workers: int, thread: bool = False,
              epoch: int | None = None) -> Any:
    """torch's ``WorkerInfo`` of worker ``wid`` of ``workers``: ``seed`` is
    :func:`worker_seed` (DataLoader's ``base_seed + worker_id``), ``dataset`` the dataset object
    this worker holds. ``epoch``: an iterable dataset's pass, whose base seed is the epoch's
    where ``spec.seeds_each_epoch``."""
    from torch.utils.data._utils.worker import WorkerInfo

    base = (pass_base_seed(spec.seed, epoch) if epoch is not None and spec.seeds_each_epoch
            else spec.worker_base_seed())
    return WorkerInfo(id=wid, num_workers=workers, seed=worker_seed(base, wid),
                      dataset=spec.dataset, worker_method="thread" if thread else "multiprocessing")


def set_worker_info(info: Any, process: bool) -> None:
    """Make ``info`` what ``get_worker_info()`` returns in this thread and, in a worker process
    (``process``), in the whole process through torch's own record."""
    _local.info = info
    if process:
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = info


def get_worker_info() -> Any:
    """The ``torch.utils.data.WorkerInfo`` (``id``, ``num_workers``, ``seed``, ``dataset``) of
    the autominato worker, process or thread, that calls it (or of a DataLoader worker);
    ``None`` in the training loop, as ``torch.utils.data.get_worker_info()``.

    ``num_workers`` is the worker count when the worker started (the ``workers`` knob may
    change it later); while a worker iterates an iterable dataset's shard it is the epoch's
    shard count, fixed for the epoch."""
    info = getattr(_local, "info", None)
    if info is not None:
        return info
    from torch.utils.data._utils import worker as torch_worker

    return torch_worker._worker_info


#: The body torch's ``get_worker_info`` gets from :func:`install_thread_getter` (compiled in
#: torch's module, where ``_worker_info`` is torch's process-wide record).
_THREAD_AWARE_GETTER = """
def get_worker_info():
    info = getattr(_autominato_thread_info, "info", None)
    return info if info is not None else _worker_info
"""


def install_thread_getter() -> None:
    """Make ``torch.utils.data.get_worker_info()`` see thread workers too: torch's getter reads
    one process-wide record, which a thread worker cannot set without the training loop seeing
    it. Torch's function object itself is given a body that returns this thread's record when
    it has one, else torch's record (so it still returns ``None`` in the training loop), so code
    that bound it before (``from torch.utils.data import get_worker_info`` at import time, as
    sharding iterable datasets commonly do) sees thread workers too: without that, each thread
    worker read the whole stream and every sample came ``num_workers`` times. Installed once,
    by the first pipeline with thread workers. Where torch's getter is not a plain function
    without closure (another library wrapped it), a thread-aware wrapper replaces the module
    attributes instead, which early-bound references do not see."""
    import functools
    import types

    import torch.utils.data as tud
    from torch.utils.data._utils import worker as torch_worker

    original = torch_worker.get_worker_info
    if getattr(original, "_autominato", False) or getattr(tud.get_worker_info, "_autominato", False):
        return
    if isinstance(original, types.FunctionType) and not original.__code__.co_freevars:
        torch_worker.__dict__["_autominato_thread_info"] = _local
        compiled: dict[str, Any] = {}
        exec(_THREAD_AWARE_GETTER, torch_worker.__dict__, compiled)  # noqa: S102 (fixed source)
        original.__code__ = compiled["get_worker_info"].__code__
        original._autominato = True  # type: ignore[attr-defined]
        return

    @functools.wraps(original)
    def thread_aware_get_worker_info() -> Any:
        info = getattr(_local, "info", None)
        return info if info is not None else original()

    thread_aware_get_worker_info._autominato = True  # type: ignore[attr-defined]
    tud.get_worker_info = thread_aware_get_worker_info
    torch_worker.get_worker_info = thread_aware_get_worker_info


def start_worker(spec: WorkSpec, wid: int, workers: int, where: str, process: bool) -> None:
    """Seed a worker process's global generators (:func:`seed_worker`, from the workers'
    base seed), set the worker info of worker ``wid`` of ``workers`` and run
    ``worker_init_fn(wid)``.

    Raises:
        WorkerInitError: ``worker_init_fn`` raised (named, with ``where``; the original is
            the cause).
    """
    if process:  # the global generators as the DataLoader's worker loop seeds them
        seed_worker(spec.worker_base_seed(), wid)  # (per sample after it: seed_globals)
    set_worker_info(make_info(spec, wid, workers, thread=not process), process)
    # (where the dataset or transform brought MONAI in: importing it costs a worker of a new
    # interpreter 2 s and 170 MiB it may never use)
    meta_obj = sys.modules.get("monai.data.meta_obj") if process else None
    if meta_obj is not None and spec.monai_track_meta is not None:
        if meta_obj.get_track_meta() != spec.monai_track_meta:
            meta_obj.set_track_meta(spec.monai_track_meta)
    if spec.worker_init_fn is not None:
        try:
            spec.worker_init_fn(wid)
        except BaseException as e:  # noqa: BLE001 - reported to the training loop
            raise WorkerInitError(
                f"worker_init_fn({wid}) raised {describe(e)} in {where}",
                original_type=(type(e).__module__, type(e).__qualname__)) from e


# -- iterable datasets ---------------------------------------------------------------------------


class Streams:
    """The iterators of an iterable dataset that one worker holds, one per (run, shard).

    A *pull* asks for up to ``n`` more samples of one shard's stream. The shard's iterator is
    ``iter(dataset)`` called (lazily, at the first pull) with ``get_worker_info()`` returning
    ``WorkerInfo(id=shard, num_workers=shards)``, so the dataset shards itself as under the
    DataLoader. The k-th sample a shard yields is transformed with
    ``sample_rng(seed, epoch, (shard, k))``; in a worker process the global generators are
    seeded from ``(seed, epoch, shard, k)`` before it is drawn (see :func:`seed_globals`), and
    the dataset's MONAI random transforms from the same key (:func:`reseed_parts`; thread
    workers share the dataset's and leave them alone, as the global generators). One pull of
    a shard at a time: the scheduler sends the next when
    this one is answered.

    Args:
        spec: the worker's spec (its ``dataset`` may be replaced between pulls).
        process: a worker process (else a thread of the training process).
        info: set the worker info during a pull (``False``: ``num_workers=0``, where
            ``get_worker_info()`` stays ``None`` as under the DataLoader).
    """

    def __init__(self, spec: WorkSpec, process: bool, info: bool = True) -> None:
        self.spec = spec
        self.process = process
        self.info = info
        self._its: dict[tuple[int, int], list] = {}  # (gen, shard) -> [iterator or None, k]

    def pull(self, gen: int, shard: int, shards: int, epoch: int, seq: int, n: int,
             where: str) -> Iterator[tuple]:
        """Up to ``n`` outcomes ``("ok", k, sample, read_s, transform_s)`` or
        ``("err", k, ErrorReport)`` (``next()`` or the transform raised), then one of
        ``("done", unused, exhausted)`` (``unused`` of the ``n`` were not used: the shard ended)
        or ``("lost",)``: ``seq > 0`` but this worker holds no such stream (the worker that
        iterated it died). Never raises."""
        spec, key = self.spec, (gen, shard)
        st = self._its.get(key)
        if st is None:
            if seq > 0:
                yield ("lost",)
                return
            st = self._its[key] = [None, 0]
        prev = getattr(_local, "info", None)
        if self.info:
            set_worker_info(make_info(spec, shard, shards, thread=not self.process, epoch=epoch),
                            self.process)
        seeding = self.process
        about = (f"{where}, sample {{}} of shard {shard} of {shards} of the iterable dataset "
                 "(sample and shard counted from 0)")
        try:
            for i in range(n):
                k = st[1]
                st[1] += 1
                t0 = time.perf_counter()
                try:
                    if seeding:
                        seed_globals(spec.seed, epoch, shard, k)
                        # the dataset's own MONAI random transforms (GridPatchDataset's, say)
                        # draw as it yields: seeded per sample, as a map-style read is
                        # (trial 141: every worker drew the same sequence, and seed= did not
                        # repeat it)
                        reseed_parts(random_state.plan(spec).dataset_parts, spec.seed, epoch,
                                     (shard, k), 0)
                    if st[0] is None:
                        st[0] = iter(spec.dataset)
                    sample = next(st[0])
                except StopIteration:
                    self._its.pop(key, None)
                    yield ("done", n - i, True)
                    return
                except BaseException as e:  # noqa: BLE001 - the sample's error, reported
                    if st[0] is None:  # iter() itself failed: the shard has nothing more
                        self._its.pop(key, None)
                        yield ("err", k, ErrorReport.capture(e, -1, None, about.format(k)))
                        yield ("done", n - i - 1, True)
                        return
                    yield ("err", k, ErrorReport.capture(e, -1, None, about.format(k)))
                    continue
                read_s = time.perf_counter() - t0
                try:
                    sample, _, transform_s = run_sample(spec, (shard, k), epoch, read=False,
                                                        sample=sample)
                except BaseException as e:  # noqa: BLE001
                    yield ("err", k, ErrorReport.capture(e, -1, None, about.format(k)))
                    continue
                yield ("ok", k, sample, read_s, transform_s)
            yield ("done", 0, False)
        finally:
            if self.info:
                set_worker_info(prev, self.process)

    def drop(self, gen: int) -> None:
        """Forget run ``gen``'s streams (it ended or its consumer left), closing generators."""
        for key in [k for k in list(self._its) if k[0] == gen]:
            st = self._its.pop(key, None)
            close = getattr(st[0], "close", None) if st is not None else None
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - a generator's clean-up that fails: ignore
                    pass


def serve_sample(
    spec: WorkSpec, index: int, epoch: int, read: bool, sample: Any = None, draw: int = 0,
) -> tuple[Any, float, float]:
    """:func:`run_sample` as a worker process (or a Ray actor) runs it: the global generators
    are first seeded from ``(seed, epoch, index)``, with ``draw`` appended for a repeat
    (:func:`seed_globals`; ``draw`` as in :func:`sample_rng`), so that a sample's result does
    not depend on which process ran it, and an index that a sampler draws twice in an epoch
    (``WeightedRandomSampler(replacement=True)``) draws anew each time, as under the
    DataLoader's per-worker streams (review 46).

    Returns:
        ``(sample, read_seconds, transform_seconds)``.
    """
    seed_globals(spec.seed, epoch, *_key(index, draw))
    return run_sample(spec, index, epoch, read, sample, draw)


#: Variables that BLAS / OpenMP libraries read when they load (OpenBLAS, MKL, BLIS, Apple
#: Accelerate, numexpr): a library that a transform imports later starts with the cap too.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def threads_per_worker(cores: int, workers: int) -> int:
    """Intra-op threads each of ``workers`` processes may use so that workers x threads does
    not exceed ``cores`` (at least 1)."""
    return max(1, cores // max(1, workers))


def limit_threads(n: int) -> None:
    """Cap BLAS / OpenMP / torch intra-op threads of this process to ``n``.

    Libraries already loaded are capped through threadpoolctl and torch; libraries loaded
    afterwards through the environment variables in :data:`THREAD_ENV`. A library already at
    ``n`` is left alone (torch is always set): after a ``fork``, setting OpenBLAS's thread count restarts its thread
    pool, whose threads then spin for ~0.1 s of CPU each (measured on the 2-core machine: a
    forked child spent 135 ms of CPU in 0.3 s of idling; a KiTS19 worker's first read took
    130 ms of CPU instead of 50), taken from the samples every new worker starts with. The
    fork server caps its own threads before it forks a worker (:mod:`autominato.pipeline.
    spawn`), so a worker it forks finds them capped and starts no such thread.
    """
    for var in THREAD_ENV:
        os.environ[var] = str(n)
    try:
        from threadpoolctl import threadpool_info, threadpool_limits

        # keyed by file: two copies of a library may share a prefix (numpy's and scipy's
        # OpenBLAS), and one already at n must not be set again
        limits = {lib["filepath"]: n for lib in threadpool_info() if lib.get("num_threads") != n}
        if limits:
            threadpool_limits(limits)
    except Exception:  # pragma: no cover - threadpoolctl is a dependency
        pass
    try:
        import torch

        # Always: it also sets MKL's own (thread-local) count, which torch.get_num_threads()
        # does not show; a forked worker that skipped it ran MKL's OpenMP team and hung.
        torch.set_num_threads(n)
    except Exception:  # pragma: no cover
        pass


def process_main(wid: int, conn, spec: WorkSpec | bytes, threads: int | None = None) -> None:
    """Body of a transform worker process.

    ``spec`` is the :class:`WorkSpec` itself (inherited by fork) or its cloudpickle bytes.
    The first message from the loader is ``("init", id, workers, dataset)``: this worker's id
    in ``[0, workers)`` (:func:`start_worker` runs ``worker_init_fn(id)``) and the dataset
    cloudpickled, or ``None`` to keep the spec's. Then: ``None`` (exit), ``("threads", n)``
    (cap intra-op threads at ``n``: the worker count changed), ``("heap", keep)`` (keep up to
    ``keep`` bytes of free heap warm between tasks, :meth:`HeapTrim.set_keep`), ``("dataset", bytes)`` (a new
    copy of the dataset, ``persistent_workers=False``: ``worker_init_fn`` runs again, as in a
    DataLoader's fresh worker), ``("many", [task, ...])`` or ``("many", [task], need, cold)``
    (a task sent alone whose last figure was ``need`` bytes: the warm heap is trimmed to it
    first, or with ``cold`` the task runs without one, :meth:`HeapTrim.trim_for`), each task
    ``(key, index, epoch, draw, read, in_slot, in_desc, out_slot)`` (``draw``: see
    :func:`sample_rng`) where a slot is ``(name, size)``
    or ``None``, and ``out_slot`` may be ``rows.CLAIM``: the finished sample (16 KiB or more)
    asks for a batch row, ``("claim", key, signature)``, answered ``("row", name, size,
    offsets)``, ``("slot", name, size)`` or ``("norow",)`` before any other message is served
    (see :class:`_Claimer`), served in order, ``("stream", key, gen, shard, shards, epoch, seq, slots)``
    (a pull of an iterable dataset's shard, see :class:`Streams`; one slot or ``None`` per
    sample asked) and ``("drop", gen)`` (forget run ``gen``'s streams). Replies:
    ``("many", [reply, ...])`` (see :data:`FLUSH_S`), each ``("ok", key, desc, need, read_s,
    transform_s, pack_s, peak_bytes)`` (``peak_bytes``: :class:`PeakMeter`'s, for a task sent
    alone; else 0) or ``("err", key, ErrorReport)``; ``("stream", key, [outcome, ...],
    final)``, each outcome ``("ok", k, desc, need, read_s, transform_s, pack_s)``,
    ``("err", k, ErrorReport)``, ``("done", unused, exhausted)`` or ``("lost",)``, ``final``
    on the message that ends the pull; before them ``("ready", pid)`` once, or
    ``("fatal", ErrorReport)`` when ``spec`` or the dataset cannot be unpickled or
    ``worker_init_fn`` raised (the worker then exits). ``threads`` overrides the spec's
    ``threads_per_worker``. The worker ends at ``None`` or at the end of ``conn`` (the loader
    closed or died: only the loader holds the other end).
    """
    # Ctrl-C goes to the whole process group; the loader in the main process handles it and
    # ends the workers, so a worker must not die half-way through writing a reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the loader's SIGTERM clean-up handler, which must not run here.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    worker = f"worker {wid} (process {os.getpid()})"
    try:
        try:
            if isinstance(spec, (bytes, bytearray)):

                spec = loads_for_worker(spec)
            limit_threads(spec.threads_per_worker if threads is None else threads)
            _, wid, workers, payload = conn.recv()  # ("init", id, workers, dataset or None)
            worker = f"worker {wid} (process {os.getpid()})"
            _take_dataset(spec, payload)
            del payload  # the pickled dataset: not kept through worker_init_fn or after
            start_worker(spec, wid, workers, worker, process=True)
            cache = SlotCache()
            streams = Streams(spec, process=True)
            # Its first give-back (what start-up freed) comes before "ready": no task waits on it.
            heap = HeapTrim()
            _peak_meter().heap = heap
        except (EOFError, OSError):
            raise
        except BaseException as e:  # noqa: BLE001 - reported to the training loop
            conn.send(("fatal", ErrorReport.capture(e, -1, None, worker)))
            return
        conn.send(("ready", os.getpid()))
    except (EOFError, OSError):
        return  # retired (or the loader closed) before this worker was ready: nothing to say
    served = False  # a message was served since the worker last looked at its heap
    pending: deque = deque()  # messages that came while a task waited for its batch row
    while True:
        if served:
            # A worker gets its next task only once it replied (the loader sends work to
            # idle workers), so this runs in the round trip, before the wait (see above).
            heap.after_task()
            served = False
        try:
            msg = pending.popleft() if pending else conn.recv()
        except (EOFError, OSError):
            return  # the loader is gone
        if msg is None:
            return
        kind = msg[0]
        if kind == "threads":
            limit_threads(msg[1])
            continue
        if kind == "heap":
            heap.set_keep(msg[1], *msg[2:])
            continue
        if kind == "drop":
            streams.drop(msg[1])
            continue
        if kind == "dataset":
            payload = msg[1]
            del msg
            try:
                _take_dataset(spec, payload)
                del payload  # the pickled copy: not kept through worker_init_fn
                start_worker(spec, wid, workers, worker, process=True)
            except BaseException as e:  # noqa: BLE001
                try:
                    conn.send(("fatal", ErrorReport.capture(e, -1, None, worker)))
                except (EOFError, OSError):
                    pass
                return
            served = True  # the old copy of the dataset was freed
            heap.after_dataset()
            continue
        if kind == "stream":
            ok = _serve_stream(conn, spec, cache, streams, worker, msg)
        else:  # ("many", [task, ...]) or ("many", [task], need, cold): HeapTrim.trim_for
            if len(msg) > 2:
                heap.trim_for(msg[2], msg[3])
            ok = _serve_chunk(conn, spec, cache, worker, msg[1], pending)
        if not ok:
            return
        served = True


def _take_dataset(spec: WorkSpec, payload: bytes | None) -> None:
    """Unpickle the dataset in ``payload`` (cloudpickled) into ``spec``; ``None``: keep the
    spec's. The caller drops ``payload`` before it runs ``worker_init_fn`` (:func:`start_worker`),
    so that the pickled bytes (as large as an in-memory dataset) are not held beside the copy."""
    if payload is not None:
        import io
        import pickle

        data = io.BytesIO(payload)
        spec.trace_ids, spec.base_seed = pickle.load(data)  # (Pipeline._with_trace_ids)
        spec.dataset = loads_for_worker(data)


#: A worker given several samples in one message replies for all of them in one message, but
#: sends what it has at once when this many seconds have passed since the last send: the
#: loader then knows which sample a worker holds when it hangs or dies (the first one with no
#: reply), and a slow sample never holds back the results of fast ones for long.
FLUSH_S = 0.02


def _serve(spec: WorkSpec, cache: SlotCache, worker: str, msg: tuple,
           claim: Callable[[tuple, tuple], tuple] | None = None,
           meter: PeakMeter | None = None) -> tuple:
    """Read / transform one task and pack the result; returns the reply (never raises).
    ``claim(key, signature)``: asks the loader for a batch row (``out_slot`` is
    ``rows.CLAIM``; see :mod:`autominato.pipeline.rows`). With ``meter``, the reply's last
    field is the task's peak memory (bytes, :class:`PeakMeter`), else 0."""
    pos, index, epoch, draw, read, in_slot, in_desc, out_slot = msg
    base = meter.start() if meter is not None else None
    try:
        sample = None
        if in_slot is not None or in_desc is not None:
            buf = cache.get(*in_slot) if in_slot is not None else None
            sample = unpack(in_desc, buf)
        sample, read_s, transform_s = serve_sample(spec, index, epoch, read, sample, draw)
        t = time.perf_counter()
        prep = prepare(sample)  # taken apart once, whichever way it travels
        del sample
        # The working set, read before packing: the output's shared pages (a slot or batch row
        # this process had not written yet, a memory file) are the pool's, counted there.
        peak = meter.peak(base) if meter is not None else 0
        need = prep.need
        buf = offsets = None
        if out_slot == CLAIM:
            if claim is not None and use_slot(need):
                w = time.perf_counter()
                row = claim(pos, prep.signature())
                t += time.perf_counter() - w  # waiting for the loader is not packing
                if row[0] in ("row", "slot"):  # a batch row, or a slot of its own
                    buf = cache.get(row[1], row[2])
                    offsets = row[3] if row[0] == "row" else None
        elif out_slot is not None:
            buf = cache.get(*out_slot)
            if need > len(buf):
                buf = None  # it outgrew its slot
        desc: bytes | FdDesc | None = None
        if buf is not None:
            desc, need = pack_prepared(prep, buf, offsets, keep_order=spec.keep_layout)
        else:  # no slot or row: a memory file, else pickled
            desc = pack_memfd(prep, need, keep_order=spec.keep_layout)
        if desc is None:
            desc, need = pack_prepared(prep, None, keep_order=spec.keep_layout)
        del prep
        pack_s = time.perf_counter() - t
        return ("ok", pos, desc, need, read_s, transform_s, pack_s, peak)
    except BaseException as e:  # noqa: BLE001 - every failure is the sample's, reported
        return ("err", pos, ErrorReport.capture(e, index, sample_path(spec.dataset, index, e),
                                                worker))


class _Claimer:
    """``claim(key, signature)`` for :func:`_serve`: sends ``("claim", key, signature)`` and
    waits for the answer (``("row", name, size, offsets)``, ``("slot", name, size)`` or
    ``("norow",)``, see ``rows.RowAllocator.claim``); messages that
    come before it (control messages: ``threads``, ``drop``, ``dataset``, ``None``) go to
    ``pending``, served after the task. Raises EOFError / OSError when the loader is gone
    (:func:`_serve` reports it as the sample's error; the reply then fails and the worker
    ends).
    ``rows``: rows received since :meth:`flush_now` last looked: the reply of a sample written
    into a row goes at once (not with the rest of its chunk, see :data:`FLUSH_S`), so that
    batches form in the order rows were handed out (``rows.RowAllocator``)."""

    def __init__(self, conn, pending: deque) -> None:
        self.conn = conn
        self.pending = pending
        self.rows = 0

    def __call__(self, key: tuple, sig: tuple) -> tuple:
        self.conn.send(("claim", key, sig))
        while True:
            msg = self.conn.recv()
            if type(msg) is tuple and msg and msg[0] in ("row", "slot", "norow"):
                self.rows += msg[0] == "row"
                return msg
            self.pending.append(msg)

    def flush_now(self) -> bool:
        n, self.rows = self.rows, 0
        return n > 0


def _serve_chunk(conn, spec: WorkSpec, cache: SlotCache, worker: str, tasks: list,
                 pending: deque | None = None) -> bool:
    """Serve several tasks, replying ``("many", [reply, ...])`` (see :data:`FLUSH_S`).
    Returns False when the loader is gone."""
    claim = _Claimer(conn, pending if pending is not None else deque())
    meter = _peak_meter() if len(tasks) == 1 else None  # (a task sent alone: 10 ms or more)
    return _send_flushing(conn, (_serve(spec, cache, worker, task, claim, meter) for task in tasks),
                          lambda replies, final: ("many", replies) if replies else None,
                          claim.flush_now)


def _serve_stream(conn, spec: WorkSpec, cache: SlotCache, streams: Streams, worker: str,
                  msg: tuple) -> bool:
    """Serve one pull of a shard (see :func:`process_main`): each sample is packed into the next
    slot of the pull. Returns False when the loader is gone."""
    _, key, gen, shard, shards, epoch, seq, slots = msg
    free = iter(slots)

    def outcomes() -> Iterator[tuple]:
        for out in streams.pull(gen, shard, shards, epoch, seq, len(slots), worker):
            if out[0] == "ok":
                _, k, sample, read_s, transform_s = out
                slot = next(free)
                t = time.perf_counter()
                try:
                    desc, need = pack(sample, cache.get(*slot) if slot is not None else None,
                                      keep_order=spec.keep_layout)
                except BaseException as e:  # noqa: BLE001 - an unpicklable leaf, say
                    yield ("err", k, ErrorReport.capture(e, -1, None, f"{worker}, packing sample {k} of shard {shard}"))
                    continue
                del sample
                yield ("ok", k, desc, need, read_s, transform_s, time.perf_counter() - t)
            else:
                if out[0] == "err":
                    next(free)
                yield out

    return _send_flushing(conn, outcomes(), lambda outs, final: ("stream", key, outs, final))


def _send_flushing(conn, replies: Iterator[tuple], message: Callable[[list, bool], tuple | None],
                   flush_now: Callable[[], bool] | None = None) -> bool:
    """Send ``replies`` as ``message(part, final)`` (skipped when ``None``): what is there each
    :data:`FLUSH_S` seconds or when ``flush_now()`` says so after a reply, and the rest at the
    end. Returns False when the loader is gone."""
    part: list = []
    last = time.perf_counter()
    try:
        for reply in replies:
            part.append(reply)
            if time.perf_counter() - last > FLUSH_S or (flush_now is not None and flush_now()):
                _send_with_fds(conn, message(part, False), part)
                part, last = [], time.perf_counter()
        msg = message(part, True)
        if msg is not None:
            _send_with_fds(conn, msg, part)
    except (EOFError, OSError, BrokenPipeError):
        _close_fds(part)
        return False
    return True


#: ``(conn, socket)``: a socket on a duplicate of the connection's descriptor, for
#: :func:`socket.send_fds` (a :class:`~multiprocessing.connection.Connection` has no
#: ``sendmsg``), made once per connection.
_fd_sock: tuple[Any, socket.socket] | None = None


def _fd_socket(conn) -> socket.socket:
    global _fd_sock
    if _fd_sock is None or _fd_sock[0] is not conn:
        if _fd_sock is not None:
            _fd_sock[1].close()  # another connection's (a process forked from one that sent)
        _fd_sock = (conn, fd_socket(conn.fileno()))
    return _fd_sock[1]


def _send_with_fds(conn, msg: tuple, part: list) -> None:
    """Send ``msg``, then the memory files of its replies (:class:`FdDesc`, in order) in
    ``SCM_RIGHTS`` messages of at most :data:`SCM_MAX_FD` each that the loader reads right
    after it; close them here."""
    fds = [r[2].fd for r in part if r[0] == "ok" and type(r[2]) is FdDesc]
    try:
        conn.send(msg)
        if fds:
            sock = _fd_socket(conn)
            for i in range(0, len(fds), SCM_MAX_FD):
                socket.send_fds(sock, [b"F"], fds[i:i + SCM_MAX_FD])
    finally:
        _close_fds(part)


def _close_fds(part: list) -> None:
    for r in part:
        if r[0] == "ok" and type(r[2]) is FdDesc and r[2].fd >= 0:
            os.close(r[2].fd)
            r[2].fd = -1
