"""The core budget and which stages share workers: one answer for the monitor and controller.

The Data Monitor (:mod:`autominato.telemetry.monitor`) and the online controller's rule
(:mod:`autominato.control.rule`) both ask "may the transform stage have more workers than
cores?" and "do read and transform run on the same workers?"; both ask it here, on the same
snapshots, so the report never advises what the controller just refused (or the reverse).

CPU use comes from ``LoaderSnapshot.extra[CPU_SECONDS_KEY]``, cumulative CPU seconds of the
loader's processes (see :func:`loader_cpu_seconds`), added by whoever takes the snapshots with
a :class:`~autominato.telemetry.process.ProcessMeter` (the controller and the Data Monitor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autominato.pipeline.stats import LoaderSnapshot
from autominato.telemetry.process import Reading

#: ``LoaderSnapshot.extra`` key: cumulative CPU demand (seconds on a core or waiting for
#: one) of the loader's processes, :func:`loader_cpu_seconds`.
CPU_SECONDS_KEY = "control.cpu_seconds_total"
#: ``LoaderSnapshot.extra`` key: the part of :data:`CPU_SECONDS_KEY` that the processes
#: waited runnable for a core (the run-queue wait), seconds; the rest ran on one.
RUNQUEUE_SECONDS_KEY = "control.runqueue_seconds_total"
#: ``LoaderSnapshot.extra`` key: the part that ran on a core (CPU time), seconds; exported as
#: read (not the demand less the wait: in floating point that moved back by an ulp now and
#: then, which Prometheus reads as a counter reset, review 167).
CPU_TIME_SECONDS_KEY = "control.cpu_time_seconds_total"
#: ``LoaderSnapshot.extra`` key: the part of :data:`CPU_TIME_SECONDS_KEY` that worker
#: processes spent in the kernel (system time: page faults and the zeroing of fresh pages,
#: file reads, other system calls), seconds; only where the figures count worker processes.
KERNEL_SECONDS_KEY = "control.worker_system_seconds_total"
#: ``LoaderSnapshot.extra`` key: 1.0 when :data:`CPU_SECONDS_KEY` counts worker processes
#: only, 0.0 when it counts this process (no worker process seen yet). Two figures of
#: different bases are never subtracted: the first snapshot of a loader comes before its
#: workers start, and its count (imports, the training loop) would cancel theirs.
CPU_OF_WORKERS_KEY = "control.cpu_of_workers"

#: Below this share of the cores used, the loader's workers mostly wait (on I/O): more
#: workers than cores may help. A project choice, checked on ``tests/test_control_rule.py``.
CPU_BUSY = 0.6
#: At or above this share of the cores used, the cores are spent: no more CPU-bound workers.
CPU_SATURATED = 0.9


def loader_cpu_seconds(reading: Reading) -> float:
    """Cumulative CPU demand of the loader's work, seconds, from a meter reading: seconds on a
    core plus seconds runnable but waiting for one (the run-queue wait, Linux; see
    :mod:`autominato.telemetry.process`). On a machine that other jobs keep busy, CPU-bound
    workers get little CPU time but wait on the run queue; I/O-bound ones do neither.

    With worker processes, theirs only: the main process also runs the training loop, whose
    CPU is not the loader's (the batch assembly in the main process is left out with it).
    With thread workers (no worker process) the main process's, training loop included, is
    all there is to read.
    """
    if _of_workers(reading):
        return reading.worker_cpu_seconds_total + reading.worker_runqueue_seconds_total
    return reading.cpu_seconds_total + reading.runqueue_seconds_total


def _of_workers(reading: Reading) -> bool:
    return bool(reading.workers) or reading.worker_cpu_seconds_total > 0


def loader_cpu_extra(reading: Reading) -> dict[str, float]:
    """The ``LoaderSnapshot.extra`` CPU figures of a meter reading: :data:`CPU_SECONDS_KEY`
    (:func:`loader_cpu_seconds`), the run-queue wait in it (:data:`RUNQUEUE_SECONDS_KEY`),
    the CPU time (:data:`CPU_TIME_SECONDS_KEY`) and, with worker processes, its kernel part
    (:data:`KERNEL_SECONDS_KEY`), and their basis, :data:`CPU_OF_WORKERS_KEY`."""
    workers = _of_workers(reading)
    kernel = {KERNEL_SECONDS_KEY: reading.worker_system_seconds_total} if workers else {}
    return {
        **kernel,
        CPU_SECONDS_KEY: loader_cpu_seconds(reading),
        RUNQUEUE_SECONDS_KEY: (reading.worker_runqueue_seconds_total if workers
                               else reading.runqueue_seconds_total),
        CPU_TIME_SECONDS_KEY: (reading.worker_cpu_seconds_total if workers
                               else reading.cpu_seconds_total),
        CPU_OF_WORKERS_KEY: 1.0 if workers else 0.0,
    }


#: Shortest window whose CPU demand is told, seconds: the kernel counts CPU time in clock
#: ticks (10 ms), so a few ticks over a window of milliseconds read as several cores (trial
#: 146: "5.92 of 2 cores" over a window of 0.0 s); 0.5 s holds the error of a tick per
#: process to 2% of a core.
MIN_CPU_WINDOW_S = 0.5


def cpu_cores_used(a: LoaderSnapshot, b: LoaderSnapshot,
                   key: str = CPU_SECONDS_KEY) -> float | None:
    """Mean cores the loader used between snapshots ``a`` and ``b`` (``b`` later): ran on or
    waited for (``key`` :data:`CPU_SECONDS_KEY`, the default), or ran on
    (:data:`CPU_TIME_SECONDS_KEY`); or None
    when either lacks :data:`CPU_SECONDS_KEY` or they count different processes
    (:data:`CPU_OF_WORKERS_KEY`). When ``a`` came before the worker processes existed (its
    figure is this process's) and ``b`` counts theirs, ``b``'s figure is all their CPU since
    they started, which lies inside the window: the end-of-run report of a run shorter than
    the report interval compares the first snapshot with the last, and had no CPU row. None
    too for a window under :data:`MIN_CPU_WINDOW_S`."""
    if key not in a.extra or key not in b.extra:
        return None
    seconds = b.time - a.time
    if seconds < MIN_CPU_WINDOW_S:
        return None
    of_a, of_b = a.extra.get(CPU_OF_WORKERS_KEY), b.extra.get(CPU_OF_WORKERS_KEY)
    if of_a != of_b:
        if of_a == 0.0 and of_b == 1.0:
            return max(0.0, b.extra[key]) / seconds
        return None
    return max(0.0, b.extra[key] - a.extra[key]) / seconds


#: Least CPU time of the workers in a window whose kernel share :func:`kernel_share` tells,
#: seconds per worker process (at least 1 s): the kernel splits a process's CPU time into
#: user and system time by clock ticks (10 ms), so each process's share may be off by a
#: tick or two: 2-4% of half a second.
MIN_KERNEL_CPU_S = 0.5


def kernel_share(a: LoaderSnapshot, b: LoaderSnapshot) -> float | None:
    """The share (0..1) of the worker processes' CPU time between snapshots ``a`` and ``b``
    that they spent in the kernel (:data:`KERNEL_SECONDS_KEY` over
    :data:`CPU_TIME_SECONDS_KEY`), or None: ``b`` lacks the figures (no worker process,
    no meter), ``a`` lacks them but counted worker processes too, or the workers ran under
    :data:`MIN_KERNEL_CPU_S` each (1 s at least) in between. Where ``a`` came before the
    worker processes existed (:data:`CPU_OF_WORKERS_KEY` 0.0), ``b``'s figures are all
    theirs, as in :func:`cpu_cores_used`."""
    keys = (KERNEL_SECONDS_KEY, CPU_TIME_SECONDS_KEY)
    if any(k not in b.extra for k in keys):
        return None
    if all(k in a.extra for k in keys):
        start = (a.extra[KERNEL_SECONDS_KEY], a.extra[CPU_TIME_SECONDS_KEY])
    elif a.extra.get(CPU_OF_WORKERS_KEY) == 0.0 and b.extra.get(CPU_OF_WORKERS_KEY) == 1.0:
        start = (0.0, 0.0)  # (review 202: a short run's end-of-run report had no figure)
    else:
        return None
    ran = b.extra[CPU_TIME_SECONDS_KEY] - start[1]
    if ran < max(1.0, MIN_KERNEL_CPU_S * b.knobs.get("workers", 1)):
        return None
    return min(1.0, max(0.0, b.extra[KERNEL_SECONDS_KEY] - start[0]) / ran)


def transforms_inline(snap: LoaderSnapshot) -> bool:
    """``workers=0``: transforms run inline in the read threads."""
    return snap.knobs.get("workers", 1) == 0


def reads_fused(snap: LoaderSnapshot) -> bool:
    """Reads run inside the transform workers (``fuse_read``, the default).

    A fused read stage has no queue of its own (capacity 0; a separate read stage's queue
    holds up to ``pool_size`` samples) and reports either no workers or the transform's.
    """
    read, transform = snap.stages.get("read"), snap.stages.get("transform")
    if read is None or transform is None or transforms_inline(snap):
        return False
    return read.queue_capacity == 0 and read.workers in (0, transform.workers)


@dataclass(frozen=True)
class CoreBudget:
    """How many transform workers the cores allow.

    Attributes:
        cores: usable CPU cores (:func:`~autominato.pipeline.knobs.usable_cores`).
        cpu_busy: share of ``cores`` below which the workers count as I/O-like.
        cpu_saturated: share of ``cores`` at which the cores count as spent.
        placed: each worker takes one of ``cores`` whatever it does (Ray actors, one CPU
            each, on the cluster's free CPUs): never more workers than ``cores``, also
            I/O-like ones (trial 146: "workers 2 -> 4" advised on a cluster of 2 CPUs,
            where the Loader keeps 2).
    """

    cores: int
    cpu_busy: float = CPU_BUSY
    cpu_saturated: float = CPU_SATURATED
    placed: bool = False

    def io_like(self, cpu_cores: float | None, workers: int | None = None) -> bool:
        """The loader used less than ``cpu_busy`` of the cores (False when unknown); with
        ``workers`` fewer than the cores, of ``workers`` cores (each worker runs one sample
        at a time: one worker busy on a core of two is CPU bound, trial 175 read it as
        I/O bound and sent it to faster storage)."""
        cores = min(self.cores, workers) if workers is not None and workers > 0 else self.cores
        return cpu_cores is not None and cpu_cores < self.cpu_busy * cores

    def worker_cap(self, workers: int, cpu_cores: float | None) -> int:
        """The most transform workers worth running, from ``workers`` using ``cpu_cores``.

        ``cores``, unless the workers are I/O-like: then the count at which their CPU use,
        scaled with the count, would reach ``cpu_saturated`` of the cores (never below
        ``cores``).
        """
        if self.placed or not self.io_like(cpu_cores):
            return self.cores
        cpu = max(cpu_cores or 0.0, 1e-3)
        return max(self.cores, math.floor(max(workers, 1) * self.cpu_saturated * self.cores / cpu))

    def over(self, workers: int, cpu_cores: float | None) -> bool:
        """More workers than cores while the cores are spent: shrink to ``cores``."""
        return (
            workers > self.cores
            and cpu_cores is not None
            and cpu_cores >= self.cpu_saturated * self.cores
        )
