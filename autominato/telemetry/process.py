"""The process meter: CPU time and memory of a process and the processes that work for it.

One meter for every reader: the controller (CPU and private memory of the loader's worker
processes, every interval), the tuner (CPU seconds and peak memory of a trial) and the
benchmark (a whole process tree, sampled from outside it). Figures come from psutil.

Memory, per process, in bytes:

* RSS: resident pages, shared ones included (each process that maps a page counts it).
* private: RSS less the resident shared pages (file-backed and shared memory; Linux
  ``/proc/PID/statm``): what the process holds for itself. Cheap to read.
* PSS (proportional set size, Linux ``/proc/PID/smaps_rollup``): each shared page divided
  between the processes that map it, so that a sum over processes counts every page once.
  Costs a walk of the process's mappings; read only when the meter is built with
  ``pss=True``.
* footprint (:attr:`Reading.footprint_bytes`): PSS with shared memory counted even where no
  process maps it. PSS sees a shared page only where some process's page table maps it: a
  batch that a worker wrote into shared memory, unmapped and sent, and that the training
  process mapped but has not touched (the DataLoader's prefetched batches under a consumer
  that does not read them, a memory file a loader has not read yet) is in no process's PSS
  (measured: a DataLoader holding five 20 MB batches, 100 MB of ``Shmem``, 0 MB of
  ``Pss_Shmem``). The footprint's shared part is the processes' ``Pss_Shmem`` at the meter's
  first reading plus the shared memory the machine gained since (``Shmem`` of
  ``/proc/meminfo``), or their ``Pss_Shmem`` now where that is more: what other processes on
  the machine create or free in shared memory meanwhile moves it too.

CPU, per process, in seconds: user + system time (psutil), and on Linux the time its threads
were runnable but waited for a core (the run-queue wait, second field of
``/proc/PID/task/TID/schedstat``). On a machine whose cores other jobs keep busy, a CPU-bound
worker gets little CPU time yet waits on the run queue: the sum of both is its CPU demand,
which tells CPU work from waiting on I/O (a read blocked on storage is not runnable).
A process that began working for the loader long after it started (a Ray actor: Ray starts
its worker process, imports and connects before the actor's constructor runs) counts from
where it began (:func:`count_from`), so that its start-up is not read as the loader's work.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

#: ``(pid, start time)`` -> ``(CPU seconds, run-queue seconds)`` a process had spent when it
#: began working for a loader (:func:`count_from`); every meter counts it out. At most
#: :data:`_BEFORE_MAX` entries: when full, those of processes gone are dropped (a key, with
#: its start time, never matches another process), and only if none is, the oldest.
_BEFORE: dict[tuple[int, float], tuple[float, float, float]] = {}
_BEFORE_MAX = 4096
_BEFORE_LOCK = threading.Lock()


def own_usage() -> tuple[int, float, float, float, float]:
    """This process's ``(pid, start time, CPU seconds, run-queue seconds, system seconds)``
    now (psutil's ``create_time()``, user + system time, the threads' run-queue wait as the
    meter reads them, system time): what :func:`count_from` takes, measured where the
    process begins working for a loader (a Ray actor's constructor) and sent to the process
    that meters it."""
    p = psutil.Process()
    times = p.cpu_times()
    return p.pid, p.create_time(), times.user + times.system, _runqueue_s(p.pid), times.system


def count_from(pid: int, start_time: float, cpu_s: float, runqueue_s: float,
               system_s: float = 0.0) -> None:
    """Count process ``pid`` (started at ``start_time``, psutil's ``create_time()``) from
    ``cpu_s`` CPU seconds, ``runqueue_s`` run-queue seconds and ``system_s`` system seconds
    (the part of ``cpu_s`` in the kernel) on, in every meter of this process: what it spent
    before (a Ray worker's start, its imports) is not the loader's work. Thread-safe."""
    with _BEFORE_LOCK:
        if len(_BEFORE) >= _BEFORE_MAX:
            # (review 181: dropping the oldest alone could drop a live actor's, whose start-up
            # then landed in one window)
            for key in [k for k in _BEFORE if not _alive(*k)]:
                del _BEFORE[key]
            if len(_BEFORE) >= _BEFORE_MAX:
                del _BEFORE[next(iter(_BEFORE))]
        _BEFORE[(pid, start_time)] = (float(cpu_s), float(runqueue_s), float(system_s))


def _alive(pid: int, start_time: float) -> bool:
    try:
        return psutil.Process(pid).create_time() == start_time
    except psutil.Error:
        return False


@dataclass(frozen=True)
class ProcessUsage:
    """One process at one reading.

    Attributes:
        pid: the process id.
        root: the process the meter was built for (else a child or a listed worker).
        cpu_s: user + system CPU seconds since the process started (since it began working
            for a loader where :func:`count_from` says when).
        rss_bytes / private_bytes: resident and private memory, bytes (see the module doc;
            private equals RSS where the platform does not report shared pages).
        pss_bytes: proportional set size, bytes; ``None`` unless the meter reads PSS and the
            platform reports it (Linux).
        shmem_pss_bytes: the part of ``pss_bytes`` in shared memory (``Pss_Shmem``: POSIX
            shared memory, memory files, tmpfs), bytes; ``None`` where not reported.
    """

    pid: int
    root: bool
    cpu_s: float
    rss_bytes: int
    private_bytes: int
    pss_bytes: int | None
    shmem_pss_bytes: int | None = None


@dataclass(frozen=True)
class Reading:
    """What :meth:`ProcessMeter.read` measured.

    Attributes:
        time: ``time.monotonic()`` seconds when the reading was taken.
        cpu_seconds_total: user + system CPU seconds of every process the meter has seen,
            each up to its latest reading. Cumulative and never decreasing: the difference
            of two readings is the CPU used between them (a process that started in between
            counts from its start, one that exited up to its last reading).
        processes: the live processes read, the root first when it is alive.
        worker_cpu_seconds_total: the part of ``cpu_seconds_total`` of processes other than
            the root (cumulative in the same way).
        runqueue_seconds_total / worker_runqueue_seconds_total: seconds the same processes'
            threads waited on a run queue for a core, cumulative in the same way (0.0 where
            ``/proc/PID/task/TID/schedstat`` is not readable: not Linux, or no schedstats;
            and from a meter built with ``runqueue=False``).
        worker_system_seconds_total: the part of ``worker_cpu_seconds_total`` spent in the
            kernel (system time: page faults, the zeroing of fresh pages, system calls),
            cumulative in the same way.
        shmem_bytes: the processes' shared memory, bytes: their ``Pss_Shmem`` now, or their
            ``Pss_Shmem`` at the meter's first reading plus the shared memory the machine
            gained since (``Shmem`` of ``/proc/meminfo``), whichever is more (see the module
            doc); ``None`` unless the meter reads PSS on Linux.
    """

    time: float
    cpu_seconds_total: float
    processes: tuple[ProcessUsage, ...]
    worker_cpu_seconds_total: float = 0.0
    runqueue_seconds_total: float = 0.0
    worker_runqueue_seconds_total: float = 0.0
    shmem_bytes: int | None = None
    worker_system_seconds_total: float = 0.0

    @property
    def workers(self) -> tuple[ProcessUsage, ...]:
        """The processes other than the root."""
        return tuple(p for p in self.processes if not p.root)

    @property
    def pss_bytes(self) -> int:
        """PSS summed over the processes, bytes (RSS for a process whose PSS was not read)."""
        return sum(p.pss_bytes if p.pss_bytes is not None else p.rss_bytes for p in self.processes)

    @property
    def footprint_bytes(self) -> int:
        """Memory of the processes with the shared memory none of them maps counted, bytes:
        their PSS outside shared memory plus :attr:`shmem_bytes` (see the module doc).
        :attr:`pss_bytes` where the shared figures are not known."""
        if self.shmem_bytes is None:
            return self.pss_bytes
        return sum(p.pss_bytes - p.shmem_pss_bytes for p in self.processes) + self.shmem_bytes

    @property
    def worker_private_bytes(self) -> int:
        """Private memory summed over the processes other than the root, bytes."""
        return sum(p.private_bytes for p in self.workers)


class ProcessMeter:
    """Reads CPU time and memory of process ``pid`` and the processes that work for it.

    Which processes: the root ``pid`` (default: this process), all its descendants when
    ``children`` is true, and the ``pids`` given to each :meth:`read` (a loader's
    ``worker_pids()``). A process is known by its pid and start time, so a reused pid is a
    new process. Not thread-safe: one thread reads a meter.

    Args:
        pid: the root process; default this one.
        children: also read every descendant of the root.
        pss: also read each process's PSS (see the module doc for its cost).
        pss_every: with ``pss``, seconds between two reads of one process's
            ``smaps_rollup``, at most one such read per :meth:`read`; in between, its PSS is
            the last one read plus the growth of its private anonymous memory since
            (``statm``: resident less file-backed and shared pages, microseconds). Every
            rollup is read again at a reading where a process that shares more than
            :attr:`SHARED_BYTES` with others started, exited or became a zombie (the pages
            it shared are split anew).
            Its shared memory (``Pss_Shmem``) between two rollups is the last one read,
            scaled down as its resident shared memory falls below the rollup's (``RssShmem``
            of ``/proc/PID/status``, microseconds): pages given back (a hole punched in an
            idle buffer, a segment unmapped) leave the figure when they are a net fall (until
            December 2026 they stayed in it until the next rollup: a KiTS19 loader's peak
            read 55 MiB over a full reading at the same moment). The scaling assumes the
            pages given back were shared like the rest: a process's figure may read low (the
            pages it shared with more processes than the rest) or high; the footprint's
            shared part is at least the first reading's plus the machine's gain since
            (:attr:`Reading.shmem_bytes`), which also counts shared memory mapped since.
            Between two rollups it misses pages that copy-on-write made private (a fork's
            child and parent writing to what they shared) and file pages newly mapped (a
            spawned worker's imports). 0 (the default) reads every process's rollup at
            every :meth:`read`: 5-11 ms each for a KiTS19 loader's processes of
            170-370 MB on the 2-core machine (a walk of the page tables), which took 9.6-14.7% of
            a core from the loaders the bench measured when it read them every 0.2 s.
        tree_every: with ``children``, seconds between two listings of the root's
            descendants (a walk of every process on the machine, ~2 ms with 68); the processes
            already known are read at every :meth:`read`. A descendant is then first read up
            to ``tree_every`` after it started (its CPU-seconds since its start count all the
            same); one that lives less is missed. They are listed again at once where a
            rollup due (``pss_every``) reads more than :attr:`SHARED_BYTES` under its
            estimate (the process forked: its children share its pages; also a fall for
            another cause, such as file pages or shared memory another process maps too:
            then the listing finds nothing new, ~1.5-4.5 ms with 3-17 processes), and before
            every rollup is read again for a process that started or exited (the pages are
            split between those listed). 0 (the default): at every :meth:`read`.
        runqueue: read the threads' run-queue wait (one ``schedstat`` file per thread; the
            :attr:`Reading.runqueue_seconds_total` figures stay 0.0 without it).
        exclude: descendants never read (a sampler that is itself a child of the root).

    Raises:
        psutil.NoSuchProcess: no process ``pid``.
        ValueError: ``pss_every`` or ``tree_every`` below 0.
    """

    def __init__(self, pid: int | None = None, *, children: bool = False, pss: bool = False,
                 pss_every: float = 0.0, tree_every: float = 0.0, runqueue: bool = True,
                 exclude: Iterable[int] = ()):
        for name, value in (("pss_every", pss_every), ("tree_every", tree_every)):
            if not value >= 0:  # (NaN too)
                raise ValueError(f"{name} must be >= 0 seconds, got {value}")
        self.root = psutil.Process(pid)
        self.children = children
        self.pss = pss
        self.pss_every = float(pss_every)
        self.tree_every = float(tree_every)
        self._walked = -math.inf  # when the descendants were last listed (tree_every)
        self._kids: list[tuple[int, psutil.Process]] = []
        self.runqueue = runqueue
        # (pid, start time) -> (time, PSS, Pss_Shmem, private bytes, shares pages, RssShmem)
        # of its last rollup
        self._rollups: dict[tuple[int, float],
                            tuple[float, int, int | None, int, bool, int | None]] = {}
        self._mapping: frozenset[tuple[int, float]] = frozenset()  # the last reading's
        #: Whether the last :meth:`read` read every process's rollup (``pss`` and: no
        #: ``pss_every``, or a process sharing pages started or exited since the reading
        #: before; see :meth:`_plan_rollups`).
        self.full = False
        self.exclude = frozenset(exclude)
        self._procs: dict[int, psutil.Process] = {}
        self._cpu: dict[tuple[int, float], float] = {}
        self._waited: dict[tuple[int, float], float] = {}
        # system (kernel) CPU seconds, counted as _cpu (from count_from's figure on)
        self._system: dict[tuple[int, float], float] = {}
        # The machine's shared memory and the processes' Pss_Shmem at the first reading.
        self._shmem0: tuple[int, int] | None = None
        self._split = False  # a rollup of this reading showed new sharers (read())
        self._listed = False  # the last _tree listed the descendants
        #: The pids whose ``smaps_rollup`` the last :meth:`read` read (``pss``).
        self.rollups_read: frozenset[int] = frozenset()

    def _process(self, pid: int, found: psutil.Process | None = None) -> psutil.Process | None:
        p = self._procs.get(pid)
        if p is not None and p.is_running():
            return p  # the cached object keeps the start time that identifies the process
        if found is not None and not found.is_running():
            # listed before tree_every, gone since: its pid may be another process's now,
            # outside the tree (the next listing brings a new child of the tree)
            self._procs.pop(pid, None)
            return None
        try:
            p = self._procs[pid] = found or psutil.Process(pid)
        except psutil.Error:
            self._procs.pop(pid, None)
            return None
        return p

    def _tree(self, pids: Iterable[int]) -> list[psutil.Process]:
        self._listed = False
        out = [self.root]
        seen = {self.root.pid, *self.exclude}
        found: list[tuple[int, psutil.Process | None]] = []
        if self.children:
            now = time.monotonic()
            self._listed = now - self._walked >= self.tree_every
            if self._listed:
                try:
                    self._kids = [(k.pid, k) for k in self.root.children(recursive=True)]
                    self._walked = now
                except psutil.Error:
                    self._kids = []
            found = list(self._kids)
        found += [(pid, None) for pid in pids]
        for pid, proc in found:
            if pid in seen:
                continue
            seen.add(pid)
            p = self._process(pid, proc)
            if p is not None:
                out.append(p)
        for pid in [pid for pid in self._procs if pid not in seen]:
            del self._procs[pid]  # gone from the tree: its CPU stays in the total
        return out

    def read(self, pids: Iterable[int] = ()) -> Reading:
        """Read every process now; ``pids`` adds processes outside the root's tree."""
        self._split = False
        rolled: dict[tuple[int, float], tuple[int | None, int | None]] = {}  # read now
        reading = self._read(pids, rolled)
        if self._split:
            # A rollup read less than its estimate by more than SHARED_BYTES: the process
            # forked (its pages are split with new sharers) since the descendants were
            # listed, and a tree read without them would miss their share of the pages (a
            # bench run's footprint fell 158 -> 143 MB when its DataLoader forked its
            # workers, up to tree_every before they were listed). List them now and read
            # again (their first reading reads every rollup: _plan_rollups; those read
            # already are kept).
            self._walked = -math.inf
            reading = self._read(pids, rolled, again=True)
        self.rollups_read = frozenset(pid for pid, _ in rolled)
        return reading

    def _found(self, pids: Iterable[int]) -> list:
        """The processes to read (:meth:`_tree`), each as ``(process, key, CPU times, memory
        info, private bytes)``; those that exited or cannot be read are left out."""
        found = []
        for p in self._tree(pids):
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    times = p.cpu_times()
                    mem = p.memory_info()
            except psutil.Error:
                continue  # exited, a zombie, or not ours to read
            shared = getattr(mem, "shared", 0) if sys.platform.startswith("linux") else 0
            found.append((p, key, times, mem, int(max(0, mem.rss - shared))))
        return found

    def _read(self, pids: Iterable[int],
              rolled: dict[tuple[int, float], tuple[int | None, int | None]],
              again: bool = False) -> Reading:
        t = time.monotonic()
        usages = []
        found = self._found(pids)
        due = None
        if self.pss:
            due = self._plan_rollups(found, t, rolled)
            if (self.full and self.pss_every > 0 and self.children and not self._listed
                    and not again):
                # A process sharing pages started or exited since the descendants were
                # listed: others may have too (an epoch's workers replaced, a worker
                # retired and another started), and every rollup read now splits the
                # pages between those listed only (review 142: 52 MiB read for 149 until
                # the listing). List them first.
                self._walked = -math.inf
                found = self._found(pids)
                self._plan_rollups(found, t, rolled)
                self.full = True
            if self.full or again:
                due = None  # (every rollup, or the one due read already: one a reading)
        read: set[tuple[int, float]] = set()
        for p, key, times, mem, private in found:
            try:
                rollup = (self._pss_now(p, key, t, private, mem.rss, rolled, key == due)
                          if self.pss else None)
            except psutil.Error:
                continue
            read.add(key)
            cpu_before, waited_before, system_before = _BEFORE.get(key, (0.0, 0.0, 0.0))
            # (never down: a process read before count_from named it keeps its figure)
            cpu = max(self._cpu.get(key, 0.0), times.user + times.system - cpu_before)
            self._cpu[key] = cpu
            self._system[key] = min(cpu, max(self._system.get(key, 0.0),
                                             times.system - system_before))
            if self.runqueue:
                # A thread that exited takes its figure along: never let the total go down.
                self._waited[key] = max(self._waited.get(key, 0.0),
                                        _runqueue_s(p.pid) - waited_before)
            pss, shmem_pss = rollup if rollup is not None else (None, None)
            usages.append(
                ProcessUsage(
                    pid=p.pid,
                    root=p.pid == self.root.pid,
                    cpu_s=cpu,
                    rss_bytes=int(mem.rss),
                    private_bytes=private,
                    pss_bytes=pss,
                    shmem_pss_bytes=shmem_pss,
                )
            )
        shmem_bytes = None
        if self.pss and all(
            u.pss_bytes is not None and u.shmem_pss_bytes is not None for u in usages
        ) and (machine := machine_shmem_bytes()) is not None:
            mapped = sum(u.shmem_pss_bytes for u in usages)
            if self._shmem0 is None:
                self._shmem0 = (machine, mapped)
            shmem_bytes = max(mapped, self._shmem0[1] + max(0, machine - self._shmem0[0]))
        for key in [k for k in self._rollups if k not in read]:
            del self._rollups[key]  # gone (or unreadable): read afresh if seen again
        root = self.root.pid
        workers = sum(cpu for (pid, _), cpu in self._cpu.items() if pid != root)
        waited = sum(self._waited.values())
        workers_waited = sum(w for (pid, _), w in self._waited.items() if pid != root)
        return Reading(
            t, sum(self._cpu.values()), tuple(usages), workers, waited, workers_waited, shmem_bytes,
            worker_system_seconds_total=sum(s for (pid, _), s in self._system.items()
                                            if pid != root),
        )

    #: Bytes of a process's resident set beyond its PSS (pages it shares with others) from
    #: which its start or exit makes every rollup be read again (``pss_every``): a forked
    #: worker shares the parent's heap (100+ MiB for a training process), an exec'd helper a
    #: few MiB of libraries.
    SHARED_BYTES = 8 << 20

    def _plan_rollups(self, found: list, now: float,
                      rolled: dict[tuple[int, float], tuple[int | None, int | None]],
                      ) -> tuple[int, float] | None:
        """Decide this reading's rollups (``pss``): sets :attr:`full`, reads those of processes
        seen for the first time into ``rolled``, and returns the one process due besides them
        (:attr:`full` or ``pss_every`` 0: ``None``, every rollup is read).

        Every rollup is read again when a process that shares pages with others started,
        exited or became a zombie: those pages are split between more or fewer processes now,
        which moves every sharer's PSS, and no process's private memory says so (a fork of a
        300 MiB process into 4 counted its pages twice until the next rollup: 552 instead of
        309 MiB; review 90). One that shares little (an exec'd helper: a few MiB of
        libraries) does not: re-reading every rollup for each gave back the sampler's cost
        (review 92)."""
        mapping = frozenset(key for _, key, _, mem, _ in found if mem.rss > 0)
        self.full = self.pss_every <= 0
        if not self.full:
            gone = self._mapping - mapping
            self.full = any(self._rollups[k][4] for k in gone if k in self._rollups)
            for p, key, _, mem, private in found:
                if key in mapping and key not in self._rollups:  # first seen
                    try:
                        rolled[key] = self._read_rollup(p, key, now, private, mem.rss)
                    except psutil.Error:
                        continue  # gone: read (and skipped) again below
                    if key not in self._mapping and key in self._rollups:
                        self.full = self.full or self._rollups[key][4]
        self._mapping = mapping
        if self.full or not self._rollups:
            return None
        key, (when, *_rest) = min(self._rollups.items(), key=lambda kv: kv[1][0])
        return key if now - when >= self.pss_every else None

    def _read_rollup(self, p: psutil.Process, key: tuple[int, float], now: float, private: int,
                     rss: int) -> tuple[int | None, int | None]:
        """:func:`_pss` of ``p``, kept (with ``pss_every``) as the base of its estimates.

        Raises:
            psutil.Error: the process is gone or not ours to read.
        """
        keep = self.pss_every > 0
        before = _rss_shmem(p.pid) if keep else None
        pss, shmem_pss = _pss(p)
        if pss is not None and keep:
            # (the smaller of before and after the walk: pages faulted in during it would
            # make a later fall read too small, review 122)
            after = _rss_shmem(p.pid) if shmem_pss else None
            self._rollups[key] = (now, pss, shmem_pss, private, rss - pss > self.SHARED_BYTES,
                                  None if before is None or after is None else min(before, after))
        else:
            self._rollups.pop(key, None)
        return pss, shmem_pss

    def _pss_now(self, p: psutil.Process, key: tuple[int, float], now: float, private: int,
                 rss: int, rolled: dict[tuple[int, float], tuple[int | None, int | None]],
                 due: bool) -> tuple[int | None, int | None]:
        """``(PSS, Pss_Shmem)`` of ``p`` in bytes: the rollup read at this reading (``rolled``,
        :attr:`full`, ``due``, or a process without a kept one), else the last one read plus
        the growth of its private memory since (see the class doc); ``(0, 0)`` for a process
        that maps nothing (``rss`` 0: a zombie), which leaves the rotation.

        Raises:
            psutil.Error: the process is gone or not ours to read.
        """
        if key in rolled:
            return rolled[key]
        if rss <= 0:
            self._rollups.pop(key, None)
            return 0, 0
        last = self._rollups.get(key)
        if not (self.full or due or last is None):
            return self._estimate(p, last, private)
        pss, shmem_pss = rolled[key] = self._read_rollup(p, key, now, private, rss)
        if (due and last is not None and self.children and pss is not None
                and pss < self._estimate(p, last, private)[0] - self.SHARED_BYTES):
            self._split = True  # new sharers of its pages: see read()
        return pss, shmem_pss

    @staticmethod
    def _estimate(p: psutil.Process, last: tuple, private: int) -> tuple[int, int | None]:
        """``(PSS, Pss_Shmem)`` of ``p`` from its ``last`` rollup and its private memory now
        (see :meth:`_pss_now`)."""
        _, pss, shmem_pss, private0, _, rss_shmem0 = last
        shmem_now = shmem_pss
        if shmem_pss and rss_shmem0:
            rss_shmem = _rss_shmem(p.pid)
            if rss_shmem is not None and rss_shmem < rss_shmem0:
                shmem_now = shmem_pss * rss_shmem // rss_shmem0
        return max(0, pss - (shmem_pss or 0) + private - private0) + (shmem_now or 0), shmem_now


def _pss(p: psutil.Process) -> tuple[int | None, int | None]:
    """``(PSS, Pss_Shmem)`` of ``p`` in bytes: from ``/proc/PID/smaps_rollup`` (Linux 4.14+;
    ``Pss_Shmem`` since 5.9), else psutil's PSS and ``None``.

    Raises:
        psutil.Error: the process is gone or not ours to read.
    """
    try:
        with open(f"/proc/{p.pid}/smaps_rollup", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        if _zombie(p):  # exited, not yet reaped: it maps nothing (its CPU still counts)
            return 0, 0
        if not psutil.pid_exists(p.pid):
            raise psutil.NoSuchProcess(p.pid) from None
        text = b""
    except PermissionError:
        raise psutil.AccessDenied(p.pid) from None
    except OSError:
        text = b""
    fields = {}
    for line in text.splitlines():
        if line.startswith(b"Pss"):
            key, value = line.split(b":", 1)
            fields[key] = int(value.split()[0]) * 1024
    if b"Pss" not in fields:
        pss = getattr(p.memory_full_info(), "pss", None)
        return (int(pss) if pss is not None else None), None
    return fields[b"Pss"], fields.get(b"Pss_Shmem")


def _kib_field(path: str, field: bytes) -> int | None:
    """The ``field`` line (``b"Name:"``) of a ``/proc`` file of ``N kB`` lines, in bytes;
    ``None`` where not readable or absent."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rss_shmem(pid: int) -> int | None:
    """Resident shared memory of process ``pid`` (``RssShmem`` of ``/proc/PID/status``, Linux
    4.5+), bytes; ``None`` where not readable."""
    return _kib_field(f"/proc/{pid}/status", b"RssShmem:")


def _zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def machine_shmem_bytes() -> int | None:
    """The machine's shared memory in use (``Shmem`` of ``/proc/meminfo``: POSIX shared
    memory, memory files, tmpfs files, SysV segments), bytes; ``None`` where not readable."""
    return _kib_field("/proc/meminfo", b"Shmem:")


def _runqueue_s(pid: int) -> float:
    """Seconds the threads of ``pid`` now alive waited on a run queue (Linux), else 0.0."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9
