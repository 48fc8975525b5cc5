"""Per-stage statistics: the one record that telemetry and the controller read.

Every stage of the pipeline owns a :class:`StageStats`. Work items report their service
time (seconds spent inside the stage's function), their wait time (seconds the item sat in
the stage's input queue before service began) and their size in bytes. Readers take a
:class:`StageSnapshot` (a frozen copy) and never touch the live record, so a snapshot can be
fed to a pure decision rule without locks.

Hooks let a metrics backend observe each item as it is recorded (Prometheus histograms need
the individual observations); they run on the recording thread and must be cheap.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

#: Called as ``hook(stage, service_seconds, wait_seconds, nbytes)`` for every recorded item
#: (``wait_seconds`` ``None``: the item waited in no queue of the stage's own).
StageHook = Callable[[str, float, "float | None", int], None]


class _SchedStat:
    """This thread's ``/proc/thread-self/schedstat``, opened once (the file stays the
    thread's) and closed with the thread's locals."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)  # (None: its open failed)
        if fd is not None:
            os.close(fd)


_THREAD = threading.local()
_SCHEDSTAT = os.path.exists("/proc/thread-self/schedstat")  # (Linux)


def thread_cpu() -> tuple[float, float | None]:
    """This thread's CPU time (``time.thread_time()``) and its run-queue wait so far (the
    second field of Linux's ``/proc/thread-self/schedstat``: runnable, waiting for a core;
    ``None`` where it cannot be read: not Linux, or this thread's file would not open or
    read), seconds. Their differences over an item are what the item asked of the CPU: a
    thread that decodes on a busy machine runs for part of that and waits for a core for the
    rest, which ``thread_time`` alone reads as not CPU work (review 172). About 1.3 us a call
    here."""
    cpu = time.thread_time()
    if not _SCHEDSTAT or getattr(_THREAD, "off", False):
        return cpu, None
    try:
        f = getattr(_THREAD, "sched", None)
        if f is None:
            f = _THREAD.sched = _SchedStat()
        return cpu, int(os.pread(f.fd, 64, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        # (this thread's only: one that could not open its file, EMFILE say, turned it off
        # for every thread, whose items in flight then counted minus their wait: review 174)
        _THREAD.off = True
        _THREAD.sched = None
        return cpu, None


#: How many recent service / wait times a stage keeps for percentiles (a bounded ring, so a
#: long run does not grow memory).
RECENT = 512


@dataclass(frozen=True)
class StageSnapshot:
    """A frozen copy of one stage's counters at ``time`` (``time.monotonic()`` seconds).

    Counters are cumulative since the loader was built; rates come from differences of two
    snapshots. ``recent_service_s`` holds up to :data:`RECENT` latest service times (seconds).
    """

    name: str
    time: float
    items_total: int
    bytes_total: int
    service_seconds_total: float
    wait_seconds_total: float
    queue_len: int
    queue_capacity: int
    workers: int
    busy_workers: int
    recent_service_s: tuple[float, ...] = ()
    recent_wait_s: tuple[float, ...] = ()
    #: CPU seconds the stage's threads in this process spent on its items
    #: (``time.thread_time()``: a read stage of its own, in read threads), ``None`` where the
    #: stage's work is not timed on the CPU (it runs in worker processes). With the service
    #: time it tells a read that decodes from one that waits on storage.
    cpu_seconds_total: float | None = None
    #: Seconds those threads waited runnable for a core during the items (Linux's run-queue
    #: wait; 0.0 where it cannot be read), ``None`` where the CPU is not timed: with
    #: ``cpu_seconds_total`` what the items asked of the CPU.
    runqueue_seconds_total: float | None = None

    def service_quantile(self, q: float) -> float:
        """Quantile ``q`` in [0, 1] of the recent service times in seconds (0.0 if none)."""
        if not self.recent_service_s:
            return 0.0
        return float(np.quantile(np.asarray(self.recent_service_s), q))

    @property
    def mean_service_s(self) -> float:
        """Mean service time per item since the start, seconds (0.0 before the first item)."""
        return self.service_seconds_total / self.items_total if self.items_total else 0.0

    @property
    def fill(self) -> float:
        """Queue fill ratio in [0, 1] (0.0 for an unbounded or zero-capacity queue)."""
        return min(1.0, self.queue_len / self.queue_capacity) if self.queue_capacity > 0 else 0.0


class StageStats:
    """Thread-safe cumulative counters of one stage, plus a ring of recent timings."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.items_total = 0
        self.bytes_total = 0
        self.service_seconds_total = 0.0
        self.wait_seconds_total = 0.0
        self._recent_service: deque[float] = deque(maxlen=RECENT)
        self._recent_wait: deque[float] = deque(maxlen=RECENT)
        self.queue_len: Callable[[], int] = lambda: 0
        self.queue_capacity: Callable[[], int] = lambda: 0
        self.workers: Callable[[], int] = lambda: 0
        self.busy = 0  # workers holding an item now, set by the scheduler
        self.hooks: list[StageHook] = []
        self.cpu_seconds_total: float | None = None  # (see StageSnapshot)
        self.runqueue_seconds_total: float | None = None

    def record(self, service_s: float, wait_s: float | None = 0.0, nbytes: int = 0,
               items: int = 1) -> None:
        """Record ``items`` processed in ``service_s`` seconds after ``wait_s`` in the queue
        (``None``: the stage has no queue of its own, a read fused into the transform
        workers: no wait is recorded, trial 138 read a wait histogram of zeros there)."""
        with self._lock:
            self.items_total += items
            self.bytes_total += nbytes
            self.service_seconds_total += service_s
            self._recent_service.append(service_s)
            if wait_s is not None:
                self.wait_seconds_total += wait_s
                self._recent_wait.append(wait_s)
        for hook in self.hooks:
            hook(self.name, service_s, wait_s, nbytes)

    def add_cpu(self, seconds: float, waited: float = 0.0) -> None:
        """Add ``seconds`` of CPU time a thread of this process spent on one of the stage's
        items and ``waited`` seconds it waited for a core meanwhile (differences of
        :func:`thread_cpu`); called where the item ran, before it is recorded."""
        with self._lock:
            self.cpu_seconds_total = (self.cpu_seconds_total or 0.0) + seconds
            self.runqueue_seconds_total = (self.runqueue_seconds_total or 0.0) + waited

    def snapshot(self) -> StageSnapshot:
        with self._lock:
            return StageSnapshot(
                name=self.name,
                time=time.monotonic(),
                items_total=self.items_total,
                bytes_total=self.bytes_total,
                service_seconds_total=self.service_seconds_total,
                wait_seconds_total=self.wait_seconds_total,
                queue_len=int(self.queue_len()),
                queue_capacity=int(self.queue_capacity()),
                workers=int(self.workers()),
                busy_workers=self.busy,
                recent_service_s=tuple(self._recent_service),
                recent_wait_s=tuple(self._recent_wait),
                cpu_seconds_total=self.cpu_seconds_total,
                runqueue_seconds_total=self.runqueue_seconds_total,
            )


@dataclass(frozen=True)
class NodeSnapshot:
    """The transform workers of one node of a Ray cluster (``worker_kind="ray"``), cumulative.

    Attributes:
        node: a bounded label, ``"<ip>/<node id prefix>"`` (``"other"`` past the limit).
        workers: actors of this loader ready on the node now.
        items_total: samples the node's actors finished.
        bytes_total: bytes of those samples moved through Ray's object store to this process.
        service_seconds_total: seconds the actors spent on them (read, transform, pack).
        round_trip_seconds_total: seconds from sending each sample to its result arriving
            here (service plus scheduling and object-store transfer).
    """

    node: str
    workers: int
    items_total: int
    bytes_total: int
    service_seconds_total: float
    round_trip_seconds_total: float


@dataclass(frozen=True)
class LoaderSnapshot:
    """Everything the telemetry and the controller may read about a loader at one instant.

    Attributes:
        time: ``time.monotonic()`` seconds.
        stages: per-stage snapshots keyed by stage name (``read``, ``transform``, ``batch``,
            ``transfer``); a stage that the current configuration does not run is absent.
        consumer_wait_seconds_total: seconds the training loop spent blocked in ``next()``.
        consumer_wait_recent_s: up to :data:`RECENT` latest per-batch waits, seconds.
        consumer_busy_seconds_total: seconds the training loop spent between ``next()`` calls
            (its step time), so ``wait / (wait + busy)`` is the accelerator-idle ratio.
        consumer_steps_total / consumer_steps_seconds_total: the training loop's steps
            that ended (at its next ``next()`` call) and their seconds, the step under way
            left out: the step time is their ratio (0 where unknown: a snapshot built from
            elsewhere; the step time is then ``busy / batches``).
        batches_total / samples_total: delivered to the training loop.
        epoch: current epoch number.
        stragglers_total: samples that finished after a later-dispatched sample of the same
            epoch had already been delivered in a batch (they joined a later batch).
        skipped_total: samples dropped by the ``on_error="skip"`` policy.
        worker_restarts_total: worker processes replaced after dying or hanging.
        h2d_bytes_total / h2d_seconds_total: host-to-device copies (0 without CUDA).
        knobs: current knob values by name.
        sample_bytes: mean bytes of one transformed sample (0 before the first).
        pool_bytes: memory held by the buffer pool (shared-memory slots and batch buffers that
            have their pages; idle ones give them back after ``shm.DECAY_S`` s), bytes.
        nodes: with Ray workers, the transform actors by node (:class:`NodeSnapshot`), else ().
        speculative_discarded_total: samples started for a next epoch that the training loop
            did not ask for (another epoch, order or sampler, or none before ``close()``), so
            discarded.
        errors_raised_total: errors raised in the training loop after which the epoch went on
            (a sample's under ``on_error="raise"``, or a batch's that could not be made).
        samples_held_for_memory_total: samples that waited before they started because their
            working set would not fit beside those in flight (``memory_aware``).
        sample_memory_budget_bytes: working-set bytes that may be in flight together now
            (``memory_aware``; 0 before a sample was measured).
        worker_heap_keep_bytes: bytes of free heap each worker process may keep warm between
            samples now (``warm_heap``; 0 while a sample waits for memory, while every worker
            has idled ``scheduler.WARM_IDLE_S``, until half the indices (or 256, or an
            epoch's distinct indices where fewer) have figures, or without ``memory_aware``).
        memory_wait_seconds_total: seconds that free workers waited, summed over workers,
            because the samples queued for them did not fit in that budget: idle
            worker time, the most ``memory_aware`` can cost (a cost only where the loader is
            the bottleneck; see docs/memory.md).
        samples_lost_total: samples not delivered because of those errors: the failing sample,
            and in order or with a batch sampler the rest of its batch (as the DataLoader's);
            for a batch that could not be made, its samples.
        cold_starts_total: passes (epochs) whose samples started only when the pass began,
            so the consumer waits while the pipeline fills: the first, every pass the loader
            does not prefetch (``prefetch_next_epoch=False``, ``persistent_workers=False``,
            no worker, a batch sampler, a sampler other than ``DistributedSampler``, an
            iterable dataset, a resumed epoch), and a prefetched pass that was discarded or
            adopted before it took a sample (the pass before it was left early).
        cold_start_wait_seconds_total: seconds of ``consumer_wait_seconds_total`` that the
            training loop waited for the first batch of a pass that started cold (see
            ``cold_starts_total``: workers starting, ``worker_init_fn``, the pipeline filling),
            counted when that batch arrives; not with ``num_workers=0``, where the first
            batch costs what every batch does.
        between_epochs_seconds_total: seconds the training loop spent between passes: from
            the end of the last live pass (``StopIteration``, an error that ends it, or the
            iterator dropped, e.g. after a ``break`` or an error caught outside the loop) to
            its next request of a batch or ``close()`` (a validation loop, a checkpoint):
            neither step nor wait. A pass the loop still holds after it stopped (an iterator
            kept in a variable; with no worker, an error it keeps) keeps this clock stopped.
        worker_kind: the Loader's ``worker_kind`` (``"process"``, ``"thread"``, ``"ray"``),
            ``""`` where unknown (a snapshot rebuilt from the exported metrics).
        consumer_empty_recent: for up to :data:`RECENT` latest batches, whether the
            ``next()`` that returned it found no batch ready (it waited for one), oldest
            first; the wait of a ``next()`` that found its batch ready is the loader's own
            cost of handing it over. Empty where no batch is made ahead (``num_workers=0``)
            and where unknown (a snapshot rebuilt from the exported metrics).
        workers_bound: the most workers the online controller may set (the ``workers``
            knob's upper bound); 0 where no controller runs, or unknown.
        iterable: the dataset is an ``IterableDataset`` (its workers iterate it: no read
            stage of its own can be split off); False where unknown.
        memory_aware / warm_heap: the Loader's ``memory_aware`` setting, and whether its
            process workers may keep freed heap warm (``warm_heap``, off too where the
            environment tunes the C allocator); False where unknown.
    """

    time: float
    stages: dict[str, StageSnapshot]
    consumer_wait_seconds_total: float
    consumer_wait_recent_s: tuple[float, ...]
    consumer_busy_seconds_total: float
    batches_total: int
    samples_total: int
    epoch: int
    stragglers_total: int
    skipped_total: int
    worker_restarts_total: int
    h2d_bytes_total: int
    h2d_seconds_total: float
    knobs: dict[str, int]
    sample_bytes: float
    pool_bytes: int
    extra: dict[str, float] = field(default_factory=dict)
    nodes: tuple[NodeSnapshot, ...] = ()
    speculative_discarded_total: int = 0
    errors_raised_total: int = 0
    samples_lost_total: int = 0
    cold_starts_total: int = 0
    cold_start_wait_seconds_total: float = 0.0
    between_epochs_seconds_total: float = 0.0
    samples_held_for_memory_total: int = 0
    sample_memory_budget_bytes: float = 0.0
    worker_heap_keep_bytes: float = 0.0
    memory_wait_seconds_total: float = 0.0
    consumer_steps_total: int = 0
    consumer_steps_seconds_total: float = 0.0
    worker_kind: str = ""
    consumer_empty_recent: tuple[bool, ...] = ()
    workers_bound: int = 0
    iterable: bool = False
    memory_aware: bool = False
    warm_heap: bool = False

    @property
    def idle_ratio(self) -> float:
        """Cumulative accelerator-idle ratio ``wait / (wait + busy)`` in [0, 1]."""
        total = self.consumer_wait_seconds_total + self.consumer_busy_seconds_total
        return self.consumer_wait_seconds_total / total if total > 0 else 0.0
