"""The pipeline: stages composed for a configuration, and the scheduler thread that feeds them.

The scheduler thread is a thin shell. It takes events from one queue (stage results, worker
deaths, epoch starts and stops, knob changes, batches consumed), feeds sample outcomes to the
pure :class:`~autominato.pipeline.epoch.Epoch` of their run and carries out its decisions:
pass a sample to the next stage, hand a full batch to the batch stage, free a sample's
shared-memory slots, skip, raise, end. Each stage is a
:class:`~autominato.pipeline.stage.Stage`; a configuration is a list of sample stages
(:func:`compose`) followed by the batch stage and, with CUDA, the transfer stage.

Every live iterator of the loader is a *run* (one epoch's order, its own output queue), so two
iterators of one loader are independent, as the DataLoader's are.

Epochs without a boundary: :meth:`Pipeline.start` may be told the order of the epoch expected
next. That run is *speculative*: it waits until its predecessor has handed out every sample,
then takes the workers its predecessor frees, inside the predecessor's ``pool_size`` window
(the two share one window, so no more samples are in flight than without speculation), and
holds up to ``depth`` batches for an iterator that does not exist yet. The next
:meth:`Pipeline.start` adopts it when it asks for the same epoch and order, else discards it
(its samples are counted in :attr:`Pipeline.speculative_discarded`). A batch never mixes
epochs: every run has its own :class:`~autominato.pipeline.epoch.Epoch`.

This module knows nothing of telemetry, the controller or configuration files: it receives a
frozen :class:`PipelineConfig`, the live :class:`~autominato.pipeline.knobs.Knobs`, and
statistics records it fills (:class:`~autominato.pipeline.stats.StageStats`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from autominato.pipeline import cleanup, random_state
from autominato.pipeline.collate import BatchPool, batch_nbytes, collate, pin, to_device
from autominato.pipeline.compose import Packed, compose
from autominato.pipeline.costs import SampleCosts
from autominato.pipeline.epoch import (
    Completed,
    Discard,
    Emit,
    End,
    Epoch,
    Failed,
    Lost,
    Raise,
    Skip,
)
from autominato.pipeline.errors import (
    SampleError,
    SampleTimeout,
    WorkerDied,
    describe,
    log_skip,
    note_batch,
)
from autominato.pipeline.executors import CHUNK_BUDGET_S, ProcessExecutor, ThreadExecutor
from autominato.pipeline.knobs import Knobs
from autominato.pipeline.memory import (
    COLD_ABOVE,
    COLD_STAYS,
    FILE_MEDIAN_MIN,
    FILE_PREREAD,
    FILE_WAIT_S,
    KEPT_HEAP_BYTES,
    SCAN_REFUSALS,
    SampleMemory,
    SizeReader,
    file_bytes,
)
from autominato.pipeline.rows import CLAIM, RowAllocator, RowRef, RowsView
from autominato.pipeline.shm import (
    FdDesc,
    SlotPool,
    packed_nbytes,
    unpack,
    use_slot,
)
from autominato.pipeline.stage import Result, Stage
from autominato.pipeline.stats import StageStats
from autominato.pipeline.stream import Pull, PullDone, ShardLost, Stream, Yielded, YieldFailed
from autominato.pipeline.worker import (
    HEAP_SLACK_BYTES,
    Streams,
    WorkSpec,
    pass_base_seed,
    sample_files,
    sample_path,
)

log = logging.getLogger("autominato.pipeline")


def _sample_task(item: Any) -> bool:
    """Whether an item of the process workers' stage is a sample's task, ``(index, epoch,
    draw, read, in_slot, in_desc, out_slot)`` (see ``worker.process_main``), not a pull of
    an iterable dataset's shard or a task of another kind."""
    return type(item) is tuple and len(item) == 7


#: The output slot of a queued process-worker task, taken as it leaves for a worker.
_SLOT_LATER = object()

#: Seconds between two passes that let idle slots and batch buffers give their memory back
#: (each looks at a few dozen objects at most).
DECAY_TICK_S = 0.25

#: Samples whose stages' seconds are summed at once (slow first, see ``costs.py``): those
#: between a read stage and the last one, which the window bounds (``pool_size``); an ended
#: run's go with it (``_end_run``), a failed sample's with its result. A net: past this many
#: no more are kept (their time is then the last stage's).
_SPENT_MAX = 4096

#: Positions slow first chooses among (``epoch.Epoch.take``): the window (``pool_size``), at
#: most this many, so that a take costs a few microseconds whatever the window (each choice
#: reads every candidate's figure on the scheduler thread: 167 us a sample with a window of
#: 520 measured in review 78).
SLOW_FIRST_LOOKAHEAD = 16

#: Batches the training loop must take without waiting, after it last waited for one, before
#: the batches ready for it count in the window again (``Pipeline._dispatch``; they do from
#: the start until it first waits): while it waits now and then (the loader is the
#: bottleneck, or the two are balanced) the window keeps its whole ``pool_size`` beside them,
#: to ride out stragglers; once it has not waited for this many, the loader is ahead and more
#: lead is only memory. About three per-rank epochs of MLPerf's 3D-UNet on 8 ranks (10 steps
#: each); this project's choice: at 16, on the KiTS19 bench with a step equal to the floor's,
#: the rule held the window at 41% of the batches.
LEAD_WAITS = 32

#: Seconds a worker busy on a sample when the pipeline parks (``Pipeline.park``) may take to
#: finish it before it is SIGKILLed: the DataLoader's ``_shutdown_workers`` waits 5 s too.
PARK_GRACE_S = 5.0

#: The largest pickle of the dataset that the first pass after a park sends to its new
#: workers, bytes: a list of files or cases pickles to kilobytes, and its changes since the
#: Loader was built (a grown list) are then seen; an in-memory dataset of arrays is left as
#: the fork server holds it (shared with the workers, copy-on-write), not pickled and copied
#: into each worker at every fit.
PARK_RESEND_MAX_BYTES = 64 * 2**20

#: Seconds every process worker must have idled before their warm heaps go back (keep 0;
#: ``_update_heap_keep``): a validation pass, a checkpoint, the end of training. Longer than a
#: training step (at 1 s, review 119 saw the keep go to 0 and back at every 1.3 s step, the
#: samples sent meanwhile running cold); jemalloc decays its idle pages over the same 10 s
#: (``dirty_decay_ms``).
WARM_IDLE_S = 10.0

#: ``memory_aware=False``: the share of the memory available at the first pass that the
#: workers' warm heaps may hold together (each worker ``1 / workers`` of it), beyond which a
#: worker gives its free heap back (``worker.HeapTrim.set_keep``'s ``whole``). Without a
#: cap a worker held the high-water mark of every sample it ran, an outlier's included, as
#: long as the loop ran (8 workers that each once ran a 5 GB volume: 40 GB); the DataLoader's
#: workers unmap each array over glibc's mmap threshold when it is freed. A project choice.
WHOLE_HEAP_SHARE = 0.5


def available_memory() -> int:
    """Bytes of memory available to this process now: the machine's (psutil's
    ``available``), at most what its cgroup v2 limit leaves (``memory.max`` less
    ``memory.current`` of ``/sys/fs/cgroup``: a container limited to 16 GiB on a larger
    host, review 203)."""
    avail = int(psutil.virtual_memory().available)
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return avail
    if limit == "max":
        return avail
    try:
        return max(0, min(avail, int(limit) - used))
    except ValueError:
        return avail


@dataclass(frozen=True)
class PipelineConfig:
    """Everything about a pipeline that is fixed when it is built.

    Attributes:
        batch_size: samples per batch.
        drop_last: never deliver a short batch.
        in_order: batches in sampler order (else completion order).
        on_error: ``"raise"`` or ``"skip"``.
        on_worker_death: ``"retry"`` or ``"raise"``.
        max_tries: a sample whose worker died this many times goes through ``on_error``.
        sample_timeout: seconds one sample may take in a worker, or ``None``.
        collate_fn: the user's collate function, or ``None`` for pooled collation.
        device: a ``torch.device`` to copy batches to (CUDA: pinned memory, side stream).
        worker_kind: ``"process"``, ``"thread"`` or ``"ray"``.
        fuse_read: process workers read as well as transform (else a read stage of threads).
        start_method: see :class:`~autominato.pipeline.executor.ProcessWorkers`.
        shm_budget_bytes: most bytes of shared-memory slots.
        pin_memory: collate into page-locked (pinned) host memory even without ``device``
            (the DataLoader's ``pin_memory=True``).
        persistent_workers: workers keep the dataset they started with (else it is sent to
            them again at the start of each epoch, as the DataLoader's fresh workers see it:
            see :meth:`Pipeline.start`).
        iterable: the dataset is iterated, not indexed (``IterableDataset``): runs are
            :meth:`Pipeline.start_stream`, each worker iterating its shard.
        ray_actor_options: options of the transform actors (``worker_kind="ray"``), see
            :func:`~autominato.pipeline.ray_executor.actor_options`.
        memory_aware: process workers measure each sample's peak memory and a sample whose
            working set would not fit beside those in flight waits (see
            :mod:`autominato.pipeline.memory`).
        dataset_len: the map-style dataset's length (for ``memory_aware``'s figures).
        warm_heap: with ``memory_aware``, process workers keep part of their free heap warm
            between samples (``SampleMemory.heap_keep``, ``worker.HeapTrim``).
    """

    batch_size: int
    drop_last: bool = False
    in_order: bool = False
    on_error: str = "raise"
    on_worker_death: str = "retry"
    max_tries: int = 3
    sample_timeout: float | None = None
    collate_fn: Callable | None = None
    device: Any = None
    worker_kind: str = "process"
    fuse_read: bool = True
    start_method: str = "auto"
    shm_budget_bytes: int = 1 << 30
    persistent_workers: bool = True
    pin_memory: bool = False
    iterable: bool = False
    ray_actor_options: dict | None = None
    memory_aware: bool = True
    dataset_len: int | None = None
    warm_heap: bool = True

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"


@dataclass(slots=True)
class Carried:
    """A finished sample on its way to a batch, and the shared-memory slots its arrays use."""

    sample: Any
    slots: tuple = ()


@dataclass(slots=True)
class Run:
    """One live iterator: an epoch's bookkeeping and the batches waiting for the consumer.

    ``out`` holds ``("batch", batch, indices, h2d, positions)`` items (``indices``: dataset
    indices, ``positions``: their positions in the epoch's order; ``h2d``: the copy's CUDA
    events or ``None``) and ``("raise", exception, positions)`` items (a sample's error, or a
    batch's that could not be made, with the positions lost with it; raised in the training
    loop, the epoch goes on), then ``("end",)`` or ``("error", exception)``."""

    gen: int
    epoch_no: int
    epoch: Epoch | Stream
    out: deque = field(default_factory=deque)
    cv: threading.Condition = field(default_factory=threading.Condition)
    uncollated: int = 0  # samples emitted to the batch stage, not yet collated
    batching: int = 0  # batches and errors (non-final items) in the batch / transfer stages
    # Samples of its batches collated and not yet taken by the training loop (in the transfer
    # stage or in ``out``); the scheduler thread's, told of takes by ``Pipeline.consumed``.
    unconsumed: int = 0
    warm: bool = False  # adopted with samples loaded ahead (its first batch should be ready)
    stopped: bool = False
    closed: bool = False  # nothing more will be put in ``out``
    dropped: bool = False  # batches that waited in ``out`` were dropped (drop_batches)
    speculative: bool = False  # started for an iterator that does not exist yet
    pred: Run | None = None  # while speculative: the run whose window it shares
    taken: int = 0  # positions dispatched (once each: re-dispatches not counted)
    # Items that reach ``out`` before its final one (a batch, or an error the epoch goes on
    # after: one each per decision), counted by the scheduler thread as decided; their count
    # once the run's end was decided (``None`` before); those the consumer took. A pass cut by
    # ``close()`` tells its end from the cut by them (``loader._EpochIterator``).
    emitted: int = 0
    ends_after: int | None = None
    received: int = 0
    # While speculative, skips and stragglers wait to be logged and counted until adoption;
    # once adopted, until the loop takes an item of the run (before it, the pass may be
    # started again as another epoch, Pipeline.unadopt, which drops them; a pass left before
    # its first item never counts them, as a look-ahead discarded).
    deferred: list = field(default_factory=list)
    counts_held: list = field(default_factory=list)
    # While speculative: (pos, attempt, error) of samples that raised, loaded again at
    # adoption (after the training loop's code between the epochs ran: a file repaired there)
    parked: list = field(default_factory=list)
    # Once adopted: (pos, attempt) of the samples it had in flight then (loaded ahead too)
    ahead: set = field(default_factory=set)
    adopted: bool = False  # the next epoch's run, adopted by a pass (``Pipeline._adopt``)
    taken_ahead: int = 0  # ``taken`` when the scheduler thread saw it adopted (loaded ahead)

    def waiting_for_loop(self) -> int:
        """Samples of collated batches waiting for the training loop: this run's
        (``unconsumed``) and its predecessor's, while speculative (also once that ended: its
        last batches wait for the loop)."""
        return self.unconsumed + (self.pred.unconsumed if self.pred is not None else 0)

    def failed(self) -> bool:
        """Closed with an error as its final item."""
        with self.cv:
            return self.closed and bool(self.out) and self.out[-1][0] == "error"

    def deliver(self, item: tuple) -> None:
        with self.cv:
            self.out.append(item)
            self.cv.notify_all()

    def drop_batches(self) -> None:
        """Drop what waits in ``out`` (the consumer left) but its final item, the run's end
        or error; ``dropped`` says that batches went (a state then does not count the pass
        as drained: ``loader._run_drained``)."""
        with self.cv:
            self.dropped = any(item[0] == "batch" for item in self.out)
            # one new deque: a reader without the lock never sees it empty in between
            self.out = deque(item for item in self.out if item[0] in ("end", "error"))

    def finish(self, last: tuple | None) -> None:
        """Close the run with ``last`` (``("end",)`` or ``("error", e)``) as its final item, or
        with ``None`` (the consumer left) dropping what waits; one step, under the lock, so
        that a waking consumer never sees it closed before its final item."""
        with self.cv:
            if last is None:
                self.out.clear()
            else:
                self.out.append(last)
            self.closed = True
            self.cv.notify_all()


class _Final:
    """An item of a run that is no batch: its last (``("end",)`` or ``("error", e)``), or an
    error that the epoch goes on after (a sample's or a batch's, ``("raise", e, positions)``,
    ``ends=False``). It travels behind the run's batches through the batch and transfer
    stages, so it never overtakes one."""

    __slots__ = ("item", "ends")

    def __init__(self, item: tuple, ends: bool = True) -> None:
        self.item = item
        self.ends = ends


class Pipeline:
    """The stages of one loader and the scheduler thread that drives them.

    Args:
        cfg: the frozen configuration.
        spec: what a worker needs to read and transform one sample.
        knobs: the live knobs (read on every scheduling round).
        stats: ``StageStats`` by stage name (``read``, ``transform``, ``batch``, ``transfer``),
            filled by the stages' hooks.
        on_skip: ``on_skip(index, path, exception)`` for every sample skipped.
    """

    def __init__(self, cfg: PipelineConfig, spec: WorkSpec, knobs: Knobs,
                 stats: dict[str, StageStats],
                 on_skip: Callable[[int, str | None, BaseException], None] | None = None) -> None:
        self.cfg = cfg
        self.spec = spec
        self.knobs = knobs
        self.stats = stats
        self.on_skip = on_skip
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.slots = SlotPool(max_slots=2 * knobs.pool_size, budget_bytes=cfg.shm_budget_bytes)
        self.batch_pool = BatchPool(max_per_key=knobs.depth + 3, pin=cfg.cuda or cfg.pin_memory)
        self.rows = RowAllocator(self.slots)
        self.runs: dict[int, Run] = {}
        self.pending: Run | None = None  # the speculative run the next start() may adopt
        # (its swaps: drop_ahead may run in an iterator's __del__, in any thread)
        self._pending_lock = threading.Lock()
        self._waiting: list[Run] = []  # speculative runs whose predecessor still dispatches
        self.speculative_adopted = 0  # runs
        self.speculative_discarded = 0  # samples dispatched for a run that was discarded
        # runs whose samples started only when their pass began (none adopted, or one adopted
        # before it took a sample: it waited behind a pass left early): the controller leaves
        # their first batches out of its window (the pipeline fills). The caller's thread.
        self.cold_starts = 0
        self.held: dict[tuple, tuple] = {}  # key -> slots an attempt holds in a worker
        self.out_estimate = 0  # bytes of one transformed sample's arrays, learned
        self.sample_bytes = 0.0
        self.stragglers = 0
        self.skipped = 0
        self._skip_logged: set[int] = set()
        self._gen = 0
        self._stop = threading.Event()
        self.closed = False  # close() ended every run it knew of (see orphaned)
        self.close_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._next_expire = 0.0
        self._next_decay = 0.0
        self._batch_ids = itertools.count()
        self._collating: dict[tuple, int] = {}  # batch key -> samples, until collated
        self.procs: ProcessExecutor | None = None
        self.streams: Streams | None = None  # thread workers' iterators of an iterable dataset
        self._knob_note: int | None = None  # the workers value last said to wait for an epoch
        self._parked = False  # park(): no workers until the next run starts
        # park(): the next start() sends the dataset as it is now, as persistent_workers=False
        # does at every epoch (the new workers would else fork the fork server's copy, made
        # when the Loader was built: review 149, a dataset grown between two fits)
        self._park_resend = False
        try:
            self.sample_stages: list[Stage] = compose(self)
            self._est_top = 0.0  # the largest estimate in flight or asking at the last ask
            self.memory = SampleMemory(
                cfg.dataset_len if not cfg.iterable else None,
                size_of=self._file_bytes, least_figure=KEPT_HEAP_BYTES)
            # (the files' sizes of each epoch's indices, read off the scheduler's thread)
            self._size_reader = SizeReader(self.memory)
            self._sizes_wanted = None  # the order of the epoch begun last, until an ask
            # Slow first (costs.py): in completion order, a map-style dataset's epochs start
            # the samples known to be slowest first within the window.
            self.costs = SampleCosts(cfg.dataset_len if not cfg.iterable else None)
            self._slow_first = not cfg.in_order and not cfg.iterable and self.costs.kept
            self._spent: dict[tuple, float] = {}  # key -> seconds of its stages done so far
            self._in_flight: dict[tuple, int] = {}  # admitted key -> its dataset index
            # the first queued sample held back for memory, and the keys that overtook it
            self._held_key: tuple | None = None
            self._ran_cold: set[int] = set()  # indices last sent cold (_task_heap)
            self._workers_busy_at = time.monotonic()  # last seen with a task (the warm heap)
            # Batches the training loop may still take without waiting before the window
            # counts the batches ready for it again (see _dispatch): LEAD_WAITS after it
            # waited for one, then down by one a batch taken at once; 0 from the start.
            self.full_lead_left = 0
            self._overtook: set[tuple] = set()
            self._admit_stage: Stage | None = None
            # ((Stage.scans, SampleMemory.version), key -> estimate, the pool's bytes): _admit
            self._scan_ests: tuple[tuple[int, int], dict, int] = ((0, 0), {}, 0)
            self._memory_aware = False
            # memory_aware=False: no budget bounds the warm heap, the workers keep all of it
            # up to a cap (WHOLE_HEAP_SHARE) until they idle WARM_IDLE_S (_update_heap_keep)
            self._keep_all = self.procs is not None and cfg.warm_heap and not cfg.memory_aware
            self._whole_cap = 0
            if self._keep_all:
                self.procs.pool.heap_whole = True
                self._whole_cap = int(WHOLE_HEAP_SHARE * available_memory())
            for st in self.sample_stages:
                if st.executor is self.procs and self.procs is not None:
                    st.prepare = self._give_slot
                    # (fuse_read=False: __getitem__ runs in the read threads, unmeasured)
                    if cfg.memory_aware and not cfg.iterable and cfg.fuse_read:
                        st.admit = self._admit
                        st.max_refusals = SCAN_REFUSALS
                        self._admit_stage = st
                        self._memory_aware = True
                        if cfg.warm_heap:
                            self.procs.task_heap = self._task_heap
            # Process workers write finished samples into batch rows (see rows.py) where the
            # default collate stacks them and no pinned copy follows.
            self._rows_ok = (self.procs is not None and self.sample_stages[-1].executor is self.procs
                             and cfg.collate_fn is None and not cfg.iterable
                             and not (cfg.cuda or cfg.pin_memory))
            if self._rows_ok:
                self.procs.pool.on_claim = self.rows.claim
            # persistent_workers=False: the dataset as the workers hold it (see _start)
            self._dataset_sent = self._pickled_dataset() if self._resends else None
            self._copies_used = False  # a pass ran on the workers' copies of the dataset
            self._start_warned: str | None = None  # the last start failure logged (_fail_runs)
        except BaseException:
            for st in getattr(self, "sample_stages", ()):
                if st.executor is not self.procs:
                    st.executor.stop()  # read threads: else they poll for ever (and no fork)
            if self.procs is not None:
                self.procs.stop()
            self.slots.close()  # an unpicklable dataset, say: leave no /dev/shm lock behind
            raise
        post = self.post
        self.batch_stage = Stage("batch", ThreadExecutor("batch", self._collate, post, 1),
                                 self._hook("batch"), lambda: 0)
        # The copy's time is read from its CUDA events by the consumer, not from this thread.
        self.transfer_stage = (
            Stage("transfer", ThreadExecutor("transfer", self._transfer, post, 1),
                  lambda *_: None, lambda: 0) if cfg.cuda else None)
        self._stage = {s.name: s for s in self.sample_stages}
        self._wire_stats()
        self.thread = threading.Thread(target=self._loop, name="autominato-scheduler", daemon=True)
        self.thread.start()
        cleanup.live.add(self)
        cleanup.install()

    # -- any thread -------------------------------------------------------------------------
    def start(self, order: Sequence[int], epoch: int, groups: Sequence[int] | None = None,
              done: Sequence[int] = (), nxt: tuple[Sequence[int], int] | None = None,
              unique: bool = False, done_empty: int = 0) -> Run:
        """Start a run over ``order`` (dataset indices) for augmentation epoch ``epoch``;
        ``groups``: the sizes of a ``batch_sampler``'s batches (see ``Epoch.groups``);
        ``done``: positions delivered before a checkpoint (see ``Epoch.done``; ``done_empty``:
        the empty groups, ``Epoch.done_empty``); ``unique``:
        no index repeats in ``order`` nor in ``nxt``'s (``Epoch.unique``: their repeats
        are not looked for).

        The speculative run of the previous call is adopted when it has this ``epoch`` and
        this ``order`` (and did not fail), else discarded. ``nxt``: ``(order, epoch)`` of the
        epoch expected after this one, started speculatively once this run has handed out
        every sample. Call from one thread (the training loop's).

        With ``persistent_workers=False`` and worker processes (or Ray actors), the dataset is
        pickled here (in the caller's thread) and sent to each of them before the run's first
        sample, which run ``worker_init_fn`` again: each pass but the workers' first sees a
        fresh copy, as the DataLoader's fresh workers do (changes made to it since the last
        epoch, and none its workers made to theirs), at the cost of one pickle per epoch and
        one copy per worker (Ray: new actors)."""
        self._check_open()
        run = self._adopt(order, epoch, groups is None and not len(done))
        spec = None
        try:
            if run is None:
                cfg = self.cfg
                ep = Epoch(order, cfg.batch_size, drop_last=cfg.drop_last,
                           in_order=cfg.in_order, skip_errors=cfg.on_error == "skip",
                           max_tries=cfg.max_tries, groups=groups, done=done,
                           done_empty=done_empty, unique=unique,
                           cost=self.costs.estimate if self._slow_first else None)
                run = self._start(epoch, ep)
                self.cold_starts += 1
                self.memory.epoch_indices = ep.distinct
            if nxt is not None:
                spec = self._new_run(*nxt, unique=unique)
                spec.speculative = True
                spec.pred = run
                with self._pending_lock:
                    self.pending = spec
                self.events.put(("speculate", spec))
        except BaseException:
            # (a KeyboardInterrupt while the next epoch's order is built, say) no iterator
            # will hold the run adopted or started: free what it holds now, not at close()
            if run is not None:
                self.stop(run)
            if spec is not None:  # (the scheduler may not have it yet: a discard is safe)
                with self._pending_lock:
                    if self.pending is spec:
                        self.pending = None
                spec.stopped = True
                self.events.put(("discard", spec))
            raise
        return run

    def start_stream(self, epoch: int) -> Run:
        """Start a run over an iterable dataset (``cfg.iterable``) for epoch ``epoch``: as many
        shards as the ``workers`` knob says now, each iterated by the worker of that id (see
        :class:`~autominato.pipeline.stream.Stream`; the dataset as in :meth:`start`)."""
        self._check_open()
        cfg = self.cfg
        # A process answers a pull sample by sample (every worker.FLUSH_S); a thread answers
        # at its end: one sample per pull keeps its samples flowing, and sample_timeout per
        # sample.
        ep = Stream(max(1, self.knobs.workers), cfg.batch_size, drop_last=cfg.drop_last,
                    in_order=cfg.in_order, skip_errors=cfg.on_error == "skip",
                    max_pull=cfg.batch_size if self.procs is not None else 1)
        run = self._start(epoch, ep)
        self.cold_starts += 1
        return run

    def _check_open(self) -> None:
        if self._stop.is_set():
            raise RuntimeError("this Loader is closed")
        if self._fatal is not None or not self.thread.is_alive():
            raise RuntimeError("autominato's scheduler failed; build a new Loader") from self._fatal

    def _start(self, epoch: int, ep: Epoch | Stream) -> Run:
        payload = None
        after_park, self._park_resend = self._park_resend, False
        if self._resends or after_park:
            try:
                # (Ray actors share no fork server's copy: theirs come from the object store
                # whatever its size, review 150)
                limit = None if self._resends or self.procs is None else PARK_RESEND_MAX_BYTES
                payload = self._pickled_dataset(limit)
            except ValueError as e:
                if self._resends:
                    raise
                # (persistent workers after a park: the new ones fork from the fork server,
                # which holds the dataset as the Loader was built; one that pickles large, an
                # in-memory array, is not copied into every worker at each fit)
                log.info("the workers that start again after they were stopped (Lightning "
                         "ends each fit so) hold the dataset as it was when the Loader was "
                         "built: changes made to it since are not seen (%s; "
                         "persistent_workers=False sends it at every epoch)", e.__cause__ or e)
            else:
                # (the transforms' ids too: a transform built anew alike pickles the same,
                # and the workers' records must then name the new one, review 144)
                ids = (random_state.trace_ids(self.spec.dataset, self.spec.transform)
                       if self.cfg.worker_kind != "thread" else ())
                # persistent_workers=False: a fresh copy at every pass but the workers' first,
                # as the DataLoader's fresh workers (what a worker changed in its copy, a file
                # it opened, a stream it consumed, a cache it filled, went on into the next
                # epochs: trial 166 saw epochs 2 and 3 empty, and worker_init_fn ran once);
                # after a park, only a changed one (the new workers fork the first). Nor the
                # first where the process workers' seed is not the epoch's (a first pass at
                # epoch 2: a resumed run, a Loader built anew each epoch; review 167): the
                # base seed follows the epoch, not the Loader's history, at the cost of a
                # second worker_init_fn a worker (not Ray's: new actors, seconds, review 169).
                fresh = self._resends and (
                    self._copies_used
                    or (self.procs is not None and pass_base_seed(self.spec.seed, epoch)
                        != self.spec.worker_base_seed()))
                if payload == self._dataset_sent and ids == self.spec.trace_ids and not fresh:
                    payload = None
                else:
                    changed = payload != self._dataset_sent or ids != self.spec.trace_ids
                    self._dataset_sent = payload
                    payload = (self._with_trace_ids(payload, ids, epoch), changed)
        self._copies_used = True
        self._gen += 1
        run = Run(self._gen, epoch, ep)
        self.events.put(("start", run, payload))
        return run

    def _new_run(self, order: Sequence[int], epoch: int, unique: bool = False) -> Run:
        self._gen += 1
        cfg = self.cfg
        ep = Epoch(order, cfg.batch_size, drop_last=cfg.drop_last, in_order=cfg.in_order,
                   skip_errors=cfg.on_error == "skip", max_tries=cfg.max_tries, unique=unique,
                   cost=self.costs.estimate if self._slow_first else None)
        self.memory.epoch_indices = ep.distinct
        return Run(self._gen, epoch, ep)

    def unadopt(self, run: Run) -> None:
        """The pass that adopted ``run`` with samples loaded ahead of it was started again as
        another epoch before its first batch (``Loader._restart_pass``, which stops it): what
        was loaded ahead is discarded after all, and counted so in
        :attr:`speculative_discarded` (by the scheduler thread, as every discard; review 185:
        it counted as adopted and nothing as discarded)."""
        if run.adopted:
            run.adopted = False
            self.speculative_adopted -= 1
            self.events.put(("unadopt", run))

    def _adopt(self, order: Sequence[int], epoch: int, adoptable: bool = True) -> Run | None:
        """The pending speculative run if it is this epoch's (else it is discarded; so is it
        when the new run is not ``adoptable``: a batch sampler's or a resumed epoch)."""
        with self._pending_lock:
            spec, self.pending = self.pending, None
        if spec is None:
            return None
        if (adoptable and spec.epoch_no == epoch and not spec.stopped and not spec.failed()
                and list(spec.epoch.order) == list(order)):
            self.speculative_adopted += 1
            spec.adopted = True
            if spec.taken == 0:  # (its predecessor was left before it handed out every sample)
                self.cold_starts += 1
            spec.warm = spec.taken > 0
            self.events.put(("adopt", spec))
            return spec
        spec.stopped = True
        self.events.put(("discard", spec))
        return None

    @property
    def _resends(self) -> bool:
        """The workers hold a copy of the dataset that ``persistent_workers=False`` renews
        at every pass but their first."""
        return not self.cfg.persistent_workers and self._workers_copy

    @property
    def _workers_copy(self) -> bool:
        """The workers hold a copy of the dataset, which can be renewed: processes (sent to
        them) and Ray actors (replaced); threads share the training process's."""
        return self.procs is not None or any(hasattr(st.executor, "reload")
                                             for st in self.sample_stages)

    def _with_trace_ids(self, payload: bytes, ids: tuple, epoch: int) -> bytes:
        """``payload`` (the dataset pickled, sent again) preceded by ``ids``, those of its and
        the transform's MONAI invertible transforms here (``random_state.trace_ids``), and the
        workers' base seed for ``epoch`` (``worker.pass_base_seed``), read by
        ``worker._take_dataset``; both also set on the spec (Ray's actors take it whole)."""
        import pickle

        self.spec.trace_ids = ids
        self.spec.base_seed = pass_base_seed(self.spec.seed, epoch)
        return pickle.dumps((ids, self.spec.base_seed)) + payload

    def _pickled_dataset(self, limit: int | None = None) -> bytes:
        """The dataset cloudpickled for the workers.

        Raises:
            PickleTooLarge: its pickle grew past ``limit`` bytes (given).
            ValueError: it does not pickle.
        """
        from autominato.pipeline.worker import PickleTooLarge, dumps_for_worker

        try:
            return dumps_for_worker(self.spec.dataset, limit)
        except PickleTooLarge:
            raise
        except Exception as e:
            raise ValueError(
                f"persistent_workers=False sends the dataset to the workers at every epoch, so it "
                f"must be picklable ({type(e).__name__}: {e}); use persistent_workers=True or "
                "worker_kind='thread'") from e

    def park(self, message: str) -> None:
        """Stop the workers and unlink the shared memory that no batch holds, keeping the
        pipeline: its fork server (a forked one can serve again: the training process now
        runs threads it could not fork beside, review 148), its scheduler and what it learnt
        (sample figures and times, knobs, counters). The next :meth:`start` starts new
        workers (none of the old ones serves again) and sends them the dataset as it is
        then, where it pickles to :data:`PARK_RESEND_MAX_BYTES` or less (Ray actors get it
        whatever its size). Live runs end: a run's batches already made are delivered, then
        its iterator raises ``RuntimeError(message)``; the next epoch loaded ahead is
        discarded (and counted). A worker busy on a sample finishes it, or is killed after
        :data:`PARK_GRACE_S`. Waits up to 10 s for the scheduler thread to have done it, then
        up to :data:`PARK_GRACE_S` + 1 s for the worker processes to have exited, as the
        DataLoader's shutdown joins its workers (trial 151: they exited 10-300 ms after a
        Lightning call returned); less when the pipeline closes meanwhile. Call from the
        training loop's thread."""
        if self._stop.is_set():
            return
        with self._pending_lock:
            spec, self.pending = self.pending, None
        if spec is not None and not spec.stopped:
            spec.stopped = True
            self.events.put(("discard", spec))
        self._park_resend = self._workers_copy
        done = threading.Event()
        self.events.put(("park", message, done))
        if threading.current_thread() is not self.thread:
            deadline = time.monotonic() + 10.0
            while not done.wait(0.05):  # (a close meanwhile ends the scheduler: review 149)
                if self._stop.is_set() or not self.thread.is_alive() or (
                        time.monotonic() > deadline):
                    break
        procs = self.procs
        if done.is_set() and procs is not None:
            procs.wait_ended(PARK_GRACE_S + 1.0, self._stop.is_set)

    def drop_ahead(self, run: Run) -> None:
        """``run``'s consumer left it before asking for any batch (Lightning's check of a
        loader: an iterator it never uses, then the same epoch's pass after its sanity
        validation): the next epoch loaded ahead of ``run`` is discarded, not loaded in the
        free workers meanwhile to be thrown away when that pass begins (review 152: 12
        samples at each fit's start, beside the validation), and counted. Any thread."""
        with self._pending_lock:
            spec = self.pending
            if spec is None or spec.pred is not run or spec.stopped:
                return
            self.pending = None
            spec.stopped = True
        self.events.put(("discard", spec))

    def stop(self, run: Run) -> None:
        """The consumer abandoned ``run``: free what it holds (its late results too)."""
        run.stopped = True
        self.events.put(("stop", run))

    def consumed(self, run: Run, waited: bool | None = False, samples: int = 0) -> None:
        """The training loop took an item of ``run``'s output: a batch of ``samples`` samples
        (0: an error); ``waited``: it had to wait for it (the output was empty when asked),
        or a wait of its timed out since; ``None`` while a cold run fills (before the loop
        first found a batch ready or took the window's batches): neither a wait nor a batch
        taken at once (``full_lead_left`` unchanged)."""
        self.events.put(("consumed", run, waited, samples))

    def knobs_changed(self, *_: Any) -> None:
        self.events.put(("knobs",))

    def fatal(self) -> BaseException | None:
        return self._fatal

    def worker_pids(self) -> list[int]:
        """PIDs of the transform workers that run on this machine (processes, local actors)."""
        pids = getattr(self._stage["transform"].executor, "pids", None)
        return pids() if pids is not None else []

    @property
    def memory_held(self) -> int:
        """Samples that waited for memory before they started (see :mod:`.memory`)."""
        return self.memory.held_back

    def restore_memory(self, figures: list[int] | None) -> None:
        """Take memory-aware dispatch's figures of a saved state (``SampleMemory.saved``) for
        the indices not measured here (thread-safe: samples may run)."""
        if figures is not None and self._memory_aware:
            self.memory.restore(figures)

    def restore_costs(self, seconds: list[float] | None) -> None:
        """Take slow-first dispatch's figures of a saved state (``SampleCosts.saved``) for the
        indices not measured here (thread-safe: samples may run)."""
        if seconds is not None and self._slow_first:
            self.costs.restore(seconds)

    @property
    def memory_wait_s(self) -> float:
        """Worker-seconds (summed over workers) that free workers waited because the queued
        samples did not fit in the memory budget, up to the scheduler's last pass (see
        :meth:`Stage.held_idle_s`), seconds."""
        st = self._admit_stage
        return st.held_idle_s() if st is not None else 0.0

    @property
    def sample_memory_budget_bytes(self) -> float:
        """Bytes of samples' working sets that may be in flight together now; 0 while no
        sample was measured or the dispatch is not memory-aware."""
        if not self._memory_aware or not self.memory.known:
            return 0.0
        return self.memory.budget(self.procs.size, self._est_top)

    @property
    def worker_heap_keep_bytes(self) -> float:
        """Bytes of free heap each worker process may keep warm between samples now, as
        last sent to them (``_update_heap_keep``); 0 without process workers. With
        ``memory_aware=False`` the cap of each worker's whole free heap
        (:data:`WHOLE_HEAP_SHARE`)."""
        return float(self.procs.pool.heap_keep) if self.procs is not None else 0.0

    def workers_ready_at(self) -> float | None:
        """``time.monotonic()`` since when a worker process (or Ray actor) has been ready to
        run samples (the earliest of those ready now); ``None`` while none is (they are
        starting, or all are being replaced); ``0.0`` where samples run in threads of this
        process (``worker_kind="thread"``, ``num_workers=0``)."""
        procs = self.procs
        if procs is not None:
            return min((w.ready_at for w in list(procs.pool.workers.values()) if w.ready),
                       default=None)
        since = getattr(self._stage["transform"].executor, "ready_since", None)
        return since() if since is not None else 0.0

    @property
    def worker_restarts(self) -> int:
        return getattr(self._stage["transform"].executor, "restarts", 0)

    def nodes(self) -> tuple:
        """Remote transform workers by node (:class:`~autominato.pipeline.stats.NodeSnapshot`)."""
        nodes = getattr(self._stage["transform"].executor, "nodes", None)
        return nodes() if nodes is not None else ()

    @property
    def pool_bytes(self) -> int:
        """Memory the pools hold now, bytes: slots and batch buffers that have their pages
        (one that gave them back after ``shm.DECAY_S`` idle seconds is not counted)."""
        return self.slots.resident_bytes() + self.batch_pool.resident_bytes()

    def close(self, error: BaseException | None = None) -> None:
        """Stop every thread and worker and unlink the shared memory. Idempotent. A live
        iterator then ends (``StopIteration``), or with ``error`` raises it. A close that an
        exception cut short (a second Ctrl-C inside it) goes on where it was at the next call
        (the Loader's at exit): it returned at once, the workers and the fork server (not a
        daemon) were left running, and the exit waited for them for ever (trial 158)."""
        if self.closed:
            return
        first = not self._stop.is_set()
        self._stop.set()
        if first:
            reader = getattr(self, "_size_reader", None)  # (a close of a failed __init__)
            if reader is not None:
                reader.close()
            self.events.put(("close",))
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)
        spec = self.pending
        if spec is not None and not spec.stopped:  # a next epoch the loop never asked for
            self.pending = None
            self.speculative_discarded += spec.taken
        stages = [st for st in (*self.sample_stages, self.batch_stage, self.transfer_stage)
                  if st is not None]
        busy = False  # a thread still at work may read or write a slot (see SlotPool.close)
        for st in stages:
            st.executor.stop()
            busy = busy or bool(getattr(st.executor, "running", bool)())
        # Runs that the scheduler never saw start (an iter() whose "start" was still queued
        # when it stopped: review 99, a load_state_dict that replaced the seeds) end too,
        # else their iterator would wait for ever.
        for ev in self._take_events():
            if type(ev) is not tuple:
                continue
            if ev[0] in ("start", "adopt") and not ev[1].closed:
                self.runs.setdefault(ev[1].gen, ev[1])
            # what the scheduler thread would have counted (review 186: a pass restarted
            # right before close() had its look-ahead counted nowhere)
            if ev[0] == "adopt":
                self._adopted_counts(ev[1])
            elif ev[0] == "unadopt":
                self._unadopted_counts(ev[1])
            elif ev[0] == "discard":
                self.speculative_discarded += ev[1].taken
            elif ev[0] == "consumed":
                self._count_held(ev[1])
        for run in list(self.runs.values()):
            run.finish(None if error is None else ("error", error))
        self.runs.clear()
        self.batch_pool.clear()
        self.slots.close(keep_referenced=busy)
        self.close_error = error
        self.closed = True  # after every run it knew ended: see ``orphaned``
        # What still refers to samples and slots goes (a thread that outlived the wait
        # posts nothing from now on, see ``post``): else a mapping kept for it above would
        # stay until the Loader itself goes (review 101).
        self._take_events()
        if not self.thread.is_alive():  # (else it may still use them)
            for st in stages:
                st.drop(lambda _key: False)
            self.held.clear()
            self._collating.clear()

    def _take_events(self) -> list:
        """Every event waiting in the queue, taken out of it (close() only)."""
        taken = []
        while True:
            try:
                taken.append(self.events.get_nowait())
            except queue.Empty:
                return taken

    def post(self, event: Any) -> None:
        """An executor's result or event for the scheduler thread; dropped once the
        pipeline closed (nobody reads them: a late thread's batch would keep its slots)."""
        if not self.closed:
            self.events.put(event)

    def orphaned(self, run: Run) -> None:
        """End ``run`` as :meth:`close` ended the others, if the pipeline closed without it
        (its start came after the close took the queued events: an iterator then checks
        this while it waits)."""
        if self.closed and not run.closed:
            run.finish(None if self.close_error is None else ("error", self.close_error))

    def kill_workers(self) -> None:
        if self.procs is not None:
            self.procs.kill_all()

    # -- scheduler thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    ev = self.events.get(timeout=0.05)
                except queue.Empty:
                    ev = None
                while ev is not None:
                    if ev == ("close",):
                        return
                    self._handle(ev)
                    try:
                        ev = self.events.get_nowait()
                    except queue.Empty:
                        ev = None
                self._expire()
                self._dispatch()
                now = time.monotonic()
                if now >= self._next_decay:  # idle memory goes back (see shm.DECAY_S)
                    self._next_decay = now + DECAY_TICK_S
                    # While the lead rule holds and batches wait for the loop (it is the
                    # bottleneck) no idle shared batch buffer stays warm: its page faults
                    # cost time the loader has to spare. Nor while memory-aware dispatch
                    # measures the samples (it has figures, and samples go one a message:
                    # CHUNK_BUDGET_S or more each): the pools' memory counts in its budget,
                    # idle buffers are the part of it that can go at once, and they sat
                    # beside the largest samples' working sets at the KiTS19 bench's peaks
                    # (3 of 20 MiB, DataLoader's peak exceeded by about as much). Samples
                    # faster than that (sent in chunks) keep them for DECAY_S, even where a
                    # slow first call of each worker gave figures (review 122).
                    ahead = self.full_lead_left == 0 and any(
                        r.waiting_for_loop() for r in self.runs.values())
                    held = self._held_key is not None
                    measured = (self._memory_aware and self.memory.known
                                and self.procs.chunk == 1)
                    self.slots.decay(now, keep=0 if ahead or held or measured else None)
                    self.batch_pool.decay(now, at_once=held or measured)
                    if self._memory_aware or self._keep_all:
                        self._update_heap_keep()
        except BaseException as e:  # a bug here must surface in the training loop, not hang it
            log.exception("autominato scheduler failed")
            self._fail_all(e)

    def _handle(self, ev: Any) -> None:
        if isinstance(ev, Result):
            self._result(ev)
            return
        kind = ev[0]
        if kind in ("proc", "died"):
            for r in self.procs.handle(ev):
                self._result(r)
        elif kind == "start":
            run, payload = ev[1], ev[2]
            if payload is not None:
                payload, changed = payload
                if changed:
                    self.memory.forget_sizes()  # (a new dataset: its files may differ)
                if self.procs is not None:
                    self.procs.pool.send_dataset(payload)
                else:  # Ray actors: new ones, that hold the dataset as it is now
                    for st in self.sample_stages:
                        if hasattr(st.executor, "reload"):
                            st.executor.reload(self.spec)
            if self._parked:  # (park(): the workers start again, with that dataset)
                self._parked = False
                self._apply_knobs()
            self._begin(run)
        elif kind == "fatal":  # worker_init_fn raised in a thread worker
            self._fail_runs(ev[1])
        elif kind == "stop":
            run = ev[1]
            if run.gen in self.runs:
                self._end_run(run, None)
            else:
                # It ended before the loop dropped it (its last batches were collated): the
                # batches waiting in its output go now, not when the run object does (a
                # pending next epoch, or an iterable dataset's progress, refers to it; review
                # 99). Its final item stays: it tells that the run ended (review 101: an
                # iterable epoch whose loop took len() batches was saved as unfinished).
                run.unconsumed = 0
                run.drop_batches()
        elif kind == "speculate":
            self._waiting.append(ev[1])
        elif kind == "adopt":
            spec = ev[1]
            self._adopted_counts(spec)
            spec.speculative = False
            spec.pred = None  # a window of its own from now on
            for pos, attempt, err in spec.parked:  # (not counted against max_tries)
                self._decide(spec, spec.epoch.on(Lost(pos, attempt, err, count=False)))
            spec.parked.clear()
            spec.ahead = set(spec.epoch.attempts())
            if spec in self._waiting:
                self._activate(spec)
        elif kind == "unadopt":
            self._unadopted_counts(ev[1])
        elif kind == "discard":
            spec = ev[1]
            if spec in self._waiting:
                self._waiting.remove(spec)
            self.speculative_discarded += spec.taken
            self._end_run(spec, None)
            spec.finish(None)  # a run that had already ended holds its batches until now
        elif kind == "consumed":  # room in a run's output: the batch stage is pumped below
            self._count_held(ev[1])
            ev[1].unconsumed -= ev[3]
            if ev[2]:
                self.full_lead_left = LEAD_WAITS
            elif self.full_lead_left and ev[2] is not None:  # (None: a cold run filling)
                self.full_lead_left -= 1
        elif kind == "knobs":
            self._apply_knobs()
        elif kind == "park":
            self._parked = True
            for run in list(self.runs.values()):  # (a new error each: tracebacks of its own)
                self._end_run(run, ("error", RuntimeError(ev[1])))
            if self.procs is not None:  # (none serves again; a busy one ends in 5 s)
                self.procs.stop_all(PARK_GRACE_S)
            self._apply_knobs()  # no workers, no free slot kept
            self.batch_pool.decay(at_once=True)
            ev[2].set()

    def _fail_runs(self, exc: BaseException) -> None:
        """The pipeline cannot serve the live runs (workers die before they are ready): each
        gets ``exc``; the next run tries again with fresh workers. With no run live but a
        speculative one (a worker that failed to start after a short epoch ended) it is logged,
        not lost silently."""
        if all(run.speculative for run in self.runs.values()):
            text = str(exc).strip().splitlines()
            said = f"{type(exc).__name__}: {text[0] if text else ''}"
            if said != self._start_warned:  # (replacements fail alike)
                self._start_warned = said
                log.warning("a worker could not start (%s); no epoch is running: workers start "
                            "again with the next one", said)
        for run in list(self.runs.values()):
            self._end_run(run, ("error", exc))

    def _fail_all(self, exc: BaseException) -> None:
        self._fatal = exc
        for run in list(self.runs.values()):
            run.finish(("error", exc))

    def _want(self, st: Stage) -> int:
        if self._parked:
            return 0
        return self.knobs.workers if st.name == "transform" else self.knobs.read_threads

    def _apply_knobs(self) -> None:
        k = self.knobs
        for st in self.sample_stages:
            if self.cfg.iterable and st.name == "transform" and self.runs:
                if k.workers != st.executor.size and k.workers != self._knob_note:
                    self._knob_note = k.workers
                    log.info("workers=%d takes effect at the next epoch: an iterable dataset's "
                             "epoch keeps the shards it started with (%d)", k.workers,
                             st.executor.size)
                continue
            self._resize(st, self._want(st))
        if self._memory_aware or self._keep_all:  # the keep depends on the worker count:
            self._update_heap_keep()  # started workers take the new one now, not at the tick
        self.slots.set_max_slots(0 if self._parked else 2 * k.pool_size)
        self.batch_pool.max_per_key = k.depth + 3
        for run in self.runs.values():
            with run.cv:
                run.cv.notify_all()

    def _expire(self) -> None:
        t = self.cfg.sample_timeout
        if t is None:
            return
        now = time.monotonic()
        if now < self._next_expire:
            return
        self._next_expire = now + min(0.05, t / 4)
        for st in self.sample_stages:
            st.executor.expire(t)

    # -- dispatch ---------------------------------------------------------------------------
    def _dispatch(self) -> None:
        if self._stop.is_set():
            return
        stages = self.sample_stages
        first = stages[0]
        pool = max(1, self.knobs.pool_size)
        for spec in list(self._waiting):
            # Not after a predecessor that failed or was abandoned (its workers may be broken,
            # its consumer gone): then the speculative run waits to be adopted.
            if spec.pred.epoch.exhausted and not spec.pred.epoch.failed:
                self._activate(spec)
        # Oldest run first; each live run has a window of its own (``pool_size`` samples), as
        # each DataLoader iterator has its own prefetch, so a run whose consumer pauses never
        # starves another. A speculative run shares its predecessor's window.
        for run in list(self.runs.values()):
            if run.epoch.finished:
                continue
            if isinstance(run.epoch, Stream):
                for pull in run.epoch.take(pool - run.epoch.held - run.uncollated):
                    self._pull(run, pull)
                continue
            used = run.epoch.held + run.uncollated
            ahead = run.waiting_for_loop()
            pred = run.pred
            if pred is not None and self.runs.get(pred.gen) is pred:
                used += pred.epoch.held + pred.uncollated
            # A batch sampler's batch larger than pool_size would never complete, nor would
            # an epoch whose window filled behind a sample to re-dispatch (a knob shrank it).
            window = max(pool, run.epoch.min_window) - used
            if ahead > 0 and self.full_lead_left == 0:
                # The training loop is the bottleneck (it has not waited for a batch lately):
                # the batches ready for it (this epoch's and the next's) count in the window,
                # so that the samples held ahead of it are pool_size, not pool_size + depth x
                # batch_size (DataLoader: prefetch_factor x num_workers batches); depth + 1
                # batches where that is more (a depth set beyond the pool is kept; a batch
                # sampler's batches at its largest: min_window).
                lead = max(pool, (self.knobs.depth + 1) * run.epoch.min_window)
                window = min(window, lead - ahead - used)
            room = min(max(window, run.epoch.redo_due), *(s.room() for s in stages))
            if room <= 0:
                continue
            # Slow first chooses among the window's next positions; not among samples sent
            # in chunks (under CHUNK_BUDGET_S each: nothing to gain, only the choosing's cost),
            # nor while memory-aware dispatch holds a sample back: the slow samples are mostly
            # the large ones, and pulled forward they would take the queue places of the small
            # ones that may overtake it (CI: a small sample started only after the held one).
            run.epoch.lookahead = (min(pool, SLOW_FIRST_LOOKAHEAD)
                                   if (self.procs is None or self.procs.chunk == 1)
                                   and self._held_key is None else 0)
            tasks = run.epoch.take(room)
            run.taken += sum(1 for t in tasks if t.attempt == 0)  # a re-dispatch is no new sample
            for t in tasks:
                key = (run.gen, t.pos, t.attempt)
                first.put(key, self._first_item(run, t.index, key, t.draw))
        for st in stages:
            st.pump()
            self.stats[st.name].busy = st.executor.busy
        self._pump_batches()

    def _pull(self, run: Run, pull: Pull) -> None:
        """Send ``pull`` to the worker of id ``pull.shard`` (processes: with one output slot
        per sample asked, ``self.held[key]``) or to the transform threads."""
        ep = run.epoch
        key = (run.gen, "pull", pull.shard)
        if self.procs is None:
            self.sample_stages[0].put(key, (run.gen, pull.shard, ep.shards, run.epoch_no, pull.seq, pull.n))
            return
        slots = deque(self.slots.acquire(self.out_estimate) if use_slot(self.out_estimate) else None
                      for _ in range(pull.n))
        self.held[key] = slots
        self.procs.pull(pull.shard, key, (
            "stream", key, run.gen, pull.shard, ep.shards, run.epoch_no, pull.seq,
            [(s.name, s.size) if s is not None else None for s in slots]))

    def _size_stream_workers(self, beginning: Run | None = None) -> None:
        """An iterable dataset: as many workers as the live runs have shards, else as the knob
        (``beginning``: the run that begins now, which has no shard iterated yet)."""
        st = self.sample_stages[0]
        want = max((r.epoch.shards for r in self.runs.values()), default=self._want(st))
        # (renewed only while no other run iterates shards: theirs would be lost)
        self._resize(st, want, renew=all(r is beginning for r in self.runs.values()))

    def _resize(self, st: Stage, n: int, renew: bool = True) -> None:
        """``n`` workers for ``st``. An iterable dataset's, with a ``worker_init_fn``, are all
        new ones (``renew``) when any was started for another count: the function may shard
        the dataset by ``num_workers``, as torch's example does (trial 84)."""
        if (renew and self.cfg.iterable and st.name == "transform"
                and self.spec.worker_init_fn is not None and st.executor.size
                and hasattr(st.executor, "renew") and st.executor.counts() != {n}):
            st.executor.renew(n)
        else:
            st.executor.resize(n)

    def _activate(self, spec: Run) -> None:
        """A speculative run starts taking samples (its predecessor has handed out all its own)."""
        self._waiting.remove(spec)
        if not spec.stopped:
            self._begin(spec)

    def _begin(self, run: Run) -> None:
        self.runs[run.gen] = run
        ep = run.epoch
        if self._rows_ok and isinstance(ep, Epoch):
            # In completion order a row is the next of the batch being filled; with a batch
            # sampler or in order, the sample's place in the batch it joins (rows.py).
            self.rows.open(run.gen, ep.batch_size, in_order=ep.in_order, groups=ep.groups,
                           done=ep.done)
        for st in self.sample_stages:
            st.executor.new_pass()
        if self.cfg.iterable:
            self._size_stream_workers(run)
        else:
            for st in self.sample_stages:
                if st.executor.size < self._want(st):
                    st.executor.resize(self._want(st))  # workers that could not start: again
        if self._memory_aware and self.procs is not None and isinstance(ep, Epoch):
            # (handed to the reader at the first ask for memory: samples sent in chunks are
            # never held, and their files are not read, review 129; the first few now while
            # samples may be sent alone, for the median file size before the workers ask,
            # memory.FILE_OUTLIER)
            if self.procs.chunk == 1:
                self._size_reader.want(ep.order[:FILE_PREREAD])
                # (workers up before the epoch began ask at once: the first indices' sizes
                # and enough for their median first, FILE_WAIT_S at most, review 132)
                first = max(FILE_MEDIAN_MIN, 2 * self.procs.size)
                self._size_reader.wait(ep.order[:first], FILE_WAIT_S)
            self._sizes_wanted = ep.order
        self._decide(run, run.epoch.start())

    def _note_stale_copy(self, err: BaseException) -> None:
        """An ``IndexError`` of a process worker whose copy of the dataset is older than the
        dataset's length now (``persistent_workers=True`` keeps the copy it got at start):
        say so, and how to give the workers the dataset as it is."""
        try:
            now = len(self.spec.dataset)
        except Exception:  # noqa: BLE001 - only a hint
            return
        if now != self.cfg.dataset_len:
            err.add_note(f"[autominato] the dataset has {now} samples now, the workers' copy "
                         f"{self.cfg.dataset_len}: persistent_workers=True keeps the copy the "
                         "workers got when they started; pass persistent_workers=False "
                         "for a dataset that changes between epochs (they then get it again "
                         "at every epoch)")

    def _first_item(self, run: Run, index: int, key: tuple, draw: int) -> Any:
        """The first stage's item: ``(index, epoch, draw)`` for threads and Ray actors
        (``draw``: see :func:`~autominato.pipeline.worker.sample_rng`), a process worker's
        task (:meth:`_proc_item`)."""
        if self.procs is not None and self.sample_stages[0].executor is self.procs:
            return self._proc_item(index, run.epoch_no, draw, key, read=True)
        return (index, run.epoch_no, draw)

    def _proc_item(self, index: int, epoch: int, draw: int, key: tuple, read: bool,
                   in_slot: Any = None, in_desc: Any = None) -> tuple:
        """A process worker's task (``(index, epoch, draw, read, in_slot, in_desc,
        out_slot)``, see :func:`~autominato.pipeline.worker.process_main`); its output slot is
        taken when it leaves the queue (:meth:`_give_slot`), so a queued task holds no memory
        and learns the output size of the samples finished meanwhile (the first of an epoch
        would else all go without)."""
        self.held[key] = (in_slot, None)
        return (index, epoch, draw, read,
                (in_slot.name, in_slot.size) if in_slot is not None else None, in_desc,
                _SLOT_LATER)

    def _file_bytes(self, index: int) -> int | None:
        """``SampleMemory.size_of``: bytes of the files ``index`` is read from
        (``worker.sample_files``: the dataset's ``sample_path``, or MONAI's file names; the
        dataset now: a reload replaces it), ``None`` where it names none."""
        sizes = [file_bytes(p) for p in sample_files(self.spec.dataset, index)]
        return sum(v for v in sizes if v) or None

    def _admit(self, key: tuple, item: Any, overtaking: bool = False) -> bool:
        """``admit`` of the process workers' stage (see :mod:`autominato.pipeline.memory`).

        Samples sent in chunks (under ``CHUNK_BUDGET_S`` each) are not held back: they are not
        measured, and up to ``workers * chunk`` of them are in flight by design. The samples
        in flight are the workers' (those of a run that ended too), each at its index's
        current estimate (a figure that arrives while it runs counts at once). A sample that
        would overtake the one held back (``overtaking``) must leave it room: its figure, plus
        what may still run of the samples it waited for when it could first start without
        the overtakers (all of them if it fits beside them now, else all but the smallest:
        any part of them that it fits beside is a proper part), plus the samples that
        overtook it and still run, plus the newcomer, within the budget."""
        if not _sample_task(item):
            return True
        index = self._in_flight
        beside = 0.0  # what the others' warm heaps make room for once it starts (_make_room)
        if self.procs.chunk == 1 and self.memory.file_outlier(item[0]):
            # (before sizes give estimates, before the first figure too: two outliers by file
            # never run together; their sizes from the first of the epoch's order, read as it
            # began: memory.FILE_PREREAD)
            if any(k in index and self.memory.file_outlier(index[k])
                   for k in self.procs.held_keys()):
                self.memory.refused(key)
                return self._refuse(key, overtaking)
        if self.memory.known and self.procs.chunk == 1:
            wanted = getattr(self, "_sizes_wanted", None)  # (replay's state has none)
            if wanted is not None:
                self._size_reader.want(wanted)
                self._sizes_wanted = None
            est = self.memory.estimate
            scans = self._admit_stage.scans  # (_admit is that stage's admit)
            stamp = (scans, self.memory.version)
            if scans % 2 and self._scan_ests[0] == stamp:
                # asked again in the same pump with the same figures (a restore from the
                # training thread moves them): the workers' items are those of the last ask
                # plus the ones admitted since (added below), so their estimates are kept
                ests, pool = self._scan_ests[1], self._scan_ests[2]
            else:
                held = list(self.procs.held_keys())
                if len(index) > 4 * len(held) + 16:  # (answered: dropped in _result; a net)
                    keep = set(held)
                    for k in [k for k in index if k not in keep]:
                        del index[k]
                    self._overtook &= keep
                median = self.memory.median
                ests = {k: est(index[k]) if k in index else median for k in held}
                pool = self._budgeted_pool_bytes()  # (it moves little within a pump)
                self._scan_ests = (stamp, ests, pool)
            warm = self._busy_warm()
            # the largest estimate in flight (a size estimate above the largest figure counts
            # in the budget's base, SampleMemory.admit), and the budget as this ask sees it,
            # for the gauge
            top = max(ests.values(), default=0.0)
            own = est(item[0])
            # (idle workers' warm heaps at what they keep once this one starts, _make_room:
            # beside it, or beside a running sample whose figure rose since the last tick)
            beside = max(top, self.memory.keep_estimate(item[0]))
            in_flight = [max(e, warm) for e in ests.values()] + self._idle_warm(
                len(ests), beside)
            self._est_top = max(top, own) if in_flight else 0.0
            ahead = None
            if overtaking:
                waiting = self._in_queue_index(self._held_key)
                if waiting is None:
                    return False  # (the sample held back is gone: no overtaking without it)
                held_est = est(waiting)
                over = self._overtook
                # the samples it waited for
                mine = sorted((max(e, warm), e) for k, e in ests.items() if k not in over)
                need = sum(m for m, _ in mine)
                if mine and held_est + need > self.memory.room(
                        self.procs.size, pool, max([held_est] + [e for _, e in mine])):
                    need -= mine[0][0]
                    mine = mine[1:]
                # (the largest estimate the held sample will start beside, for the budget's
                # base it will see: not the samples it no longer waits for, review 129)
                ahead = (held_est + need, sum(max(e, warm) for k, e in ests.items() if k in over),
                         max([held_est] + [e for _, e in mine]
                             + [e for k, e in ests.items() if k in over]))
            if not self.memory.admit(item[0], in_flight, self.procs.size, key, ahead, pool,
                                     largest=top):
                return self._refuse(key, overtaking)
            if overtaking:
                self._overtook.add(key)
            ests[key] = own  # (it is the workers' now: in held_keys at the next ask)
        if not overtaking and self._held_key is not None:
            # The first in line leaves: the sample held back (this one, or one no longer
            # queued, whatever the branch above) waits no more (review 105: a stale key kept
            # idle batch buffers punched at every tick).
            self._held_key = None
            self._overtook.clear()
            self._update_heap_keep(starting=beside)
        self.memory.started(key)
        index[key] = item[0]
        if beside:
            self._make_room(beside)
        return True

    def _make_room(self, estimate: float) -> None:
        """A sample starts beside samples in flight, the largest of them all ``estimate``
        bytes (``SampleMemory.keep_estimate`` for the newcomer: an index not measured counts
        at the largest figure at least): where the other workers' warm heaps do not fit
        beside it (a sample above the upper quartile, ``SampleMemory.heap_keep``), lower
        the keep to what does (:meth:`_update_heap_keep`): idle workers give theirs back at
        once, busy ones after their sample (admission counted them at their warm heap). A
        sample that starts with nothing else in flight is not held for them: it would wait
        only for the idle workers' give-back, which this starts."""
        if self._keep_all or not self.cfg.warm_heap:
            return
        keep = self.procs.pool.heap_keep
        if keep and keep > self.memory.keep_beside(self.procs.size, estimate):
            self._update_heap_keep(starting=estimate)

    def _refuse(self, key: tuple, overtaking: bool) -> bool:
        """``_admit``'s refusal (False): the first sample in line refused is the one held back
        (``_held_key``), which later ones may overtake only if they leave it room."""
        if not overtaking and key != self._held_key:
            held_before = self._held_key is not None
            self._held_key = key
            self._overtook.clear()
            if not held_before:
                self._update_heap_keep()  # idle workers' warm heaps go first
        return False

    def _busy_warm(self) -> float:
        """The warm heap a running sample counts at least at (``_admit``): a worker holds it
        while it runs a smaller sample (review 118: with 3 workers a 10 MiB sample on a
        195 MiB warm heap was counted at 10, and the samples beside it passed the budget by
        9%); the largest keep a busy worker was sent, as busy workers hear of a smaller keep
        only when their sample ends (review 119). A sample sent with a smaller figure runs on
        a heap trimmed to it (:meth:`_task_heap`) but still counts at the keep here: its
        figure can be its index's smaller mode (KiTS19's crop searches the foreground in 40%
        of its calls, and the working set is then up to 1.5x), and counting it lower would
        let more samples run together."""
        if not self.cfg.warm_heap:
            return 0.0
        pool = self.procs.pool
        return float(max([pool.heap_keep] + [w.heap_sent for w in list(pool.workers.values())
                                             if w.task is not None]))

    def _idle_warm(self, running: int, beside: float = 0.0) -> list[float]:
        """The warm heaps of the workers left idle when one more sample starts beside
        ``running`` samples (``SampleMemory.heap_keep`` fits them beside one sample at the
        upper quartile, not beside several, review 116), as estimates in flight; none when
        nothing runs (a sample then starts however large; one above the upper quartile
        lowers the keep as it starts, :meth:`_make_room`). ``beside``: the largest estimate
        in flight once it starts (``SampleMemory.keep_estimate`` for the newcomer): the idle
        warm heaps count at what :meth:`_make_room` lowers them to at its start, not at the
        keep before (each refusal would drop every warm heap, review 211)."""
        keep = self.procs.pool.heap_keep
        idle = self.procs.size - running - 1
        if not (keep and running and idle > 0):
            return []
        if beside:
            keep = min(keep, int(self.memory.keep_beside(self.procs.size, beside)))
        return [float(keep)] * idle if keep else []

    def _task_heap(self, item: Any) -> tuple[int, bool] | None:
        """``ProcessExecutor.task_heap``: ``(figure, cold)`` for a sample sent alone (its
        index's last figure, else its estimate, bytes) where it is below the warm heap its
        worker keeps by more than :data:`~autominato.pipeline.worker.HEAP_SLACK_BYTES`
        (``cold`` False): the worker gives back the rest before it runs it
        (``worker.HeapTrim.trim_for``), so that a small sample does not hold a warm heap
        sized for the largest one beside the other workers' samples (two workers at MLPerf's
        per-rank epoch size of the KiTS19 bench: a keep of 230-250 MiB, a median figure of
        160-185). The sample faults in what it needs beyond its figure, as does a larger
        sample after it on that worker. ``cold`` True where the figure is above
        :data:`~autominato.pipeline.memory.COLD_ABOVE` (2) times the upper quartile's, or
        :data:`~autominato.pipeline.memory.COLD_STAYS` (1.5) times it for an index that ran
        cold last time (and above it by more than the slack; with several workers the keep
        is at most that, ``SampleMemory.heap_keep``, with one the largest figure): an
        outlier, which sets the loader's peak, runs as without a warm heap (its arrays
        mapped on their own and unmapped when freed), so that the arrays it freed do not
        stay resident beside those it still uses (trial 128's MONAI workload: 7.35 GB from
        the heap against 5.76-6.03; docs/memory.md, "An outlier runs cold"). ``None``
        otherwise (samples in chunks, no figures, no keep, or a figure near it)."""
        keep = self.procs.pool.heap_keep
        if (not keep or not self.memory.known or self.procs.chunk != 1
                or not _sample_task(item)):
            return None
        index = item[0]
        need = int(self.memory.estimate(index))
        top = self.memory.upper_quartile
        cold = self._ran_cold
        # (an index that ran cold stays so while above 1.5x: its cold figure is lower than a
        # warm run would read, and it would flip to warm below 2x, where it needs more than
        # its figure, review 130)
        if need > max((COLD_STAYS if index in cold else COLD_ABOVE) * top,
                      top + HEAP_SLACK_BYTES):
            if len(cold) < 4096:  # (a bound: outliers are few)
                cold.add(index)
            return need, True
        cold.discard(index)
        if need + HEAP_SLACK_BYTES < keep:
            return need, False
        return None

    def _update_heap_keep(self, starting: float = 0.0) -> None:
        """Tell the workers how much free heap to keep warm between samples
        (``SampleMemory.heap_keep`` of the figures and the worker count now; see
        ``worker.HeapTrim``): a smaller keep at once, a larger one once it grew by
        :data:`~autominato.pipeline.worker.HEAP_SLACK_BYTES` or from 0. At most what fits
        beside the largest estimate in flight, ``starting`` (bytes, a sample being sent)
        included (``SampleMemory.keep_beside``): a sample above the upper quartile takes the
        others' warm heaps while it runs. None while a sample is held back for
        memory: a worker left idle by the hold gives its warm heap back at once (it would
        otherwise sit beside the samples in flight, on top of what they need: +100 MiB at
        the KiTS19 bench's peaks, 21 samples an epoch), and those running give theirs back
        after their sample. None either once every worker has idled :data:`WARM_IDLE_S`.
        Without ``memory_aware`` (``_keep_all``): all of it, up to :data:`WHOLE_HEAP_SHARE`
        of the memory available at the first pass (:func:`available_memory`) split between
        the workers, until they idled that long."""
        if not self.cfg.warm_heap:
            return
        now = time.monotonic()
        workers = list(self.procs.pool.workers.values())
        if any(w.task is not None for w in workers):
            self._workers_busy_at = now
        else:  # (tasks that began and ended between two ticks count from their start)
            self._workers_busy_at = max([self._workers_busy_at]
                                        + [w.task_started for w in workers])
        # Workers all idle for WARM_IDLE_S (a validation pass, a checkpoint, the end of
        # training, a loop that stopped): their warm heaps go back (review 118: 72 MiB against
        # 8 a worker, 3 s after the last epoch); the next sample takes it again.
        idle = now - self._workers_busy_at >= WARM_IDLE_S
        if self._keep_all:
            keep = 0 if idle else self._whole_cap // max(1, self.procs.size)
        else:
            keep = (int(self.memory.heap_keep(self.procs.size))
                    if self.memory.known and self._held_key is None and not idle else 0)
            if keep and self.procs.size > 1:
                est, index = self.memory.keep_estimate, self._in_flight
                top = max([starting] + [est(index[k]) for k in self.procs.held_keys()
                                        if k in index])
                keep = min(keep, int(self.memory.keep_beside(self.procs.size, top)))
        last = self.procs.pool.heap_keep
        # (a smaller keep goes at once: the budget leaves that much less beside the samples)
        if keep < last or (keep > last and (not last or keep - last >= HEAP_SLACK_BYTES)):
            self.procs.pool.set_heap_keep(keep)

    def _budgeted_pool_bytes(self) -> int:
        """What takes the pool's share of the memory budget (``memory.POOL_SHARE``): the
        shared slots and batch buffers with their pages, and the private batch buffers
        (``collate.BatchPool``: batches whose rows were copied) with theirs, what dispatch
        moves. Not the batch buffers that never give their pages back (pinned, or under
        ``collate.DECAY_MIN_BYTES``): counted they would only shrink the samples' room for
        good (reviews 105, 107)."""
        return self.slots.resident_bytes() + self.batch_pool.resident_bytes(releasable=True)

    def _in_queue_index(self, key: tuple | None) -> int | None:
        """The dataset index of the first queued item of the process workers' stage if its
        key is ``key`` (the sample held back), else ``None``."""
        st = self._admit_stage
        if key is None or st is None or not st.queue or st.queue[0][0] != key:
            return None
        return st.queue[0][1][0]

    def _give_slot(self, key: tuple, item: Any) -> Any:
        """``prepare`` of the process workers' stage: a task leaving for a worker takes its
        output slot (one that fits the largest output seen, or none: a memory file then)."""
        if not _sample_task(item) or item[6] is not _SLOT_LATER:
            return item  # a pull, or a task of another kind
        if (self.rows.active(key[0]) and self.sample_stages[-1].executor is self.procs
                and self.procs.chunk == 1):
            # It claims a batch row when its sample is done: one round trip, worth it for
            # samples that go one per message (10 ms or more, see executors.CHUNK_BUDGET_S);
            # faster ones keep their chunks' one message each way.
            return (*item[:6], CLAIM)
        out = self.slots.acquire(self.out_estimate) if use_slot(self.out_estimate) else None
        in_slot, _ = self.held.get(key, (None, None))
        self.held[key] = (in_slot, out)
        return (*item[:6], (out.name, out.size) if out is not None else None)

    def _pump_batches(self) -> None:
        """Start the next batch whose run has room for it in its output (``depth``); the
        batches of a run whose consumer is behind wait without holding up other runs'."""
        bs = self.batch_stage
        depth = max(1, self.knobs.depth)
        blocked: set[int] = set()
        i = 0
        while i < len(bs.queue) and bs.executor.free() > 0:
            _, (run, items), _ = bs.queue[i]
            final = isinstance(items, _Final)
            ends = final and items.ends  # a sample's error waits for room as a batch does
            if run.gen in blocked or (not ends and len(run.out) + run.batching >= depth
                                      and not run.stopped):
                blocked.add(run.gen)  # keep this run's order: none of its later items pass
                i += 1
                continue
            if not ends:  # a batch, or an error in a batch's place: counted until delivered
                run.batching += 1
            bs.queue.rotate(-i)
            bs.pump(1)
            bs.queue.rotate(i)
        if self.transfer_stage is not None:
            self.transfer_stage.pump()

    # -- results ----------------------------------------------------------------------------
    def _result(self, r: Result) -> None:
        stage = self._stage.get(r.stage)
        if stage is None:
            self._batch_result(r)
            return
        if r.key[1] == "pull":
            self._stream_result(stage, r)
            return
        stage.finished(r)
        gen, pos, attempt = r.key
        run = self.runs.get(gen)
        if self._memory_aware:
            self._in_flight.pop(r.key, None)
            self._overtook.discard(r.key)
        slots = self.held.pop(r.key, ())
        row = self.rows.take(r.key)  # the batch row (or slot) its sample claimed (rows.py)
        if row is not None:  # a claiming task was given no output slot
            slots = (slots[0] if slots else None, row)
        if r.ok:
            if (r.peak_bytes and run is not None and self._memory_aware
                    and r.service_s + r.read_s >= CHUNK_BUDGET_S):
                # (a sample faster than that is one of those sent in chunks once the executor
                # has measured them: neither held back nor a figure of the rule)
                self.memory.learn(run.epoch.order[pos], r.peak_bytes)
            if r.read_s:
                self.stats["read"].record(r.read_s, None, 0)  # (fused: no queue)
            last = stage is self.sample_stages[-1]
            if self._slow_first:
                # A sample's time is its stages' together (a read stage of threads, then the
                # transform's workers): summed under its key until its last stage is done.
                # (a late result, or an ended run's, is neither learnt nor kept)
                spent = self._spent.pop(r.key, 0.0) + r.service_s + r.read_s
                if run is not None and run.epoch.is_current(pos, attempt):
                    if last:
                        self.costs.learn(int(run.epoch.order[pos]), spent)
                    elif len(self._spent) < _SPENT_MAX:
                        self._spent[r.key] = spent
            value, slots = self._output(stage, r, slots, last)
            if run is None or not run.epoch.is_current(pos, attempt) and not last:
                self._free(slots)  # late (an abandoned thread's) or of an aborted run
                return
            if not last:
                index = run.epoch.order[pos]
                nxt = self.sample_stages[self.sample_stages.index(stage) + 1]
                nxt.put(r.key, self._next_item(index, run.epoch_no, run.epoch.draw(pos), r.key,
                                               value))
                return
            if run.ahead:
                run.ahead.discard((pos, attempt))
            carried = Carried(value, slots)
            decisions = run.epoch.on(Completed(pos, attempt, carried))
            if self.rows.active(gen):
                # A row that joins no batch, or a sample that joins one without a row, moves
                # the batches' boundaries against the buffers' (RowAllocator.shift).
                dropped = bool(decisions) and isinstance(decisions[0], Discard) and decisions[0].result is carried
                if type(row) is RowRef:
                    if dropped:
                        self.rows.shift(gen, +1)
                elif not dropped:
                    self.rows.shift(gen, -1)
            self._decide(run, decisions)
            return
        self._free(slots)
        self._spent.pop(r.key, None)
        if type(row) is RowRef:
            self.rows.shift(gen, +1)  # a row that joins no batch (a no-op for an ended run)
        if run is None or run.epoch.finished:
            return
        index = run.epoch.order[pos]
        # Loaded ahead, before the training loop's code between the epochs ran: a sample
        # that raised, passed sample_timeout or killed its worker is loaded again once the
        # epoch is adopted, as the DataLoader would load it then, not counted against
        # max_tries nor raised by on_worker_death="raise" (trial 79: a file repaired
        # between epochs still failed, read before the repair; review 81: so did a read
        # that timed out, a stalled mount fixed between the epochs; review 185: a death
        # raised or counted at once, so that an epoch adopted with the error behind its
        # batches raised after a few of them, as the README says it does not).
        ahead = (not r.requeue and run.epoch.is_current(pos, attempt)
                 and (run.speculative or (pos, attempt) in run.ahead))
        note = None
        if (not ahead and r.lost and not r.timed_out and not r.requeue
                and run.epoch.deaths(pos) + 1 >= self.cfg.max_tries):
            note = f"it killed {run.epoch.deaths(pos) + 1} workers, so it is not retried"
        if (isinstance(r.error, IndexError) and not r.lost and self.cfg.persistent_workers
                and self.procs is not None and hasattr(r.error, "add_note")):
            self._note_stale_copy(r.error)
        err = _about_sample(r.error, index, sample_path(self.spec.dataset, index, r.error), note)
        if ahead:
            if run.speculative:
                run.parked.append((pos, attempt, err))
            else:  # (it failed after the adoption: at once)
                run.ahead.discard((pos, attempt))
                self._decide(run, run.epoch.on(Lost(pos, attempt, err, count=False)))
            return
        was_ahead = r.requeue and (pos, attempt) in run.ahead and run.epoch.is_current(pos, attempt)
        if (r.lost and not r.timed_out and self.cfg.on_worker_death == "raise"
                and (not r.requeue or isinstance(r.error, WorkerDied))
                and not run.speculative and not was_ahead):
            # As DataLoader's, at the first death: also of a worker that held a chunk, whose
            # samples were each requeued (which one killed it is unknown: the error names
            # none of them; review 99). Not while loaded ahead, nor for a chunk loaded
            # ahead that died after the adoption (review 186): the chunk's samples are
            # requeued alone (below), and one that kills its worker again is loaded again
            # once its epoch is adopted (above), or raises then.
            if r.requeue:
                err = r.error
            self._decide(run, [Raise(err, final=True), *run.epoch.abort()])
        else:
            current = run.epoch.is_current(pos, attempt)  # else the event is stale: ignored
            if r.requeue:
                if was_ahead:
                    run.ahead.discard((pos, attempt))
                decisions = run.epoch.on(Lost(pos, attempt, err, count=False))
            elif r.lost:
                decisions = run.epoch.on(Lost(pos, attempt, err, retry=not r.timed_out))
            else:
                decisions = run.epoch.on(Failed(pos, attempt, err))
            if current and self.rows.active(gen) and run.epoch.settled(pos):
                self.rows.hole(gen, pos)  # in order skipping, the samples after it move up
            self._decide(run, decisions)

    def _stream_result(self, stage: Stage, r: Result) -> None:
        """Outcomes of a pull (see ``worker.Streams.pull``): each sample to the run's
        :class:`Stream`, each slot used or not freed; a lost pull ends the run."""
        stage.finished(r, count=False)
        gen, _, shard = r.key
        run = self.runs.get(gen)
        ep = run.epoch if run is not None and not run.epoch.finished else None
        proc = stage.executor is self.procs
        slots = self.held.get(r.key) or deque()
        if not r.ok:  # the worker died or timed out holding the pull
            self._free(tuple(self.held.pop(r.key, ())))
            if ep is not None:
                self._decide(run, ep.on(ShardLost(shard, self._stream_lost(r.error, shard, ep))))
            return
        for out in r.value:
            kind = out[0]
            if kind == "ok":
                if proc:
                    _, _, desc, need, read_s, transform_s, pack_s = out
                    sub = Result(stage.name, r.key, (desc, need), nbytes=need)
                    value, used = self._output(stage, sub, (None, slots.popleft()), True)
                else:
                    _, _, sample, read_s, transform_s = out
                    pack_s, need = 0.0, packed_nbytes(sample)
                    value, used = self._output(stage, Result(stage.name, r.key, sample, nbytes=need), (), True)
                self.stats["read"].record(read_s, None, 0)
                stage.hook(transform_s + pack_s, 0.0, need)
                if ep is None:
                    self._free(used)
                else:
                    self._decide(run, ep.on(Yielded(shard, Carried(value, used))))
            elif kind == "err":
                if proc:
                    self._free((slots.popleft(),))
                if ep is not None:
                    self._decide(run, ep.on(YieldFailed(shard, out[2].to_exception())))
            else:  # "done" or "lost": the pull is answered
                self._free(tuple(self.held.pop(r.key, ())))
                if ep is None:
                    continue
                if kind == "done":
                    self._decide(run, ep.on(PullDone(shard, out[1], out[2])))
                else:
                    err = WorkerDied(f"worker {shard} no longer holds shard {shard}'s iterator: the "
                                     "worker that iterated it died between two pulls", worker=f"worker {shard}")
                    self._decide(run, ep.on(ShardLost(shard, self._stream_lost(err, shard, ep))))

    def _stream_lost(self, err: BaseException | None, shard: int, ep: Stream) -> BaseException:
        """The error of a shard whose iterator is gone with its worker."""
        what = "timed out" if isinstance(err, SampleTimeout) else "was lost"
        return WorkerDied(
            f"shard {shard} of {ep.shards} of the iterable dataset {what}: {describe(err)}. An "
            "iterable dataset's stream lives in the worker that iterates it and cannot go on "
            "in another, so the epoch ends here (on_worker_death does not apply)",
            worker=getattr(err, "worker", None))

    def _output(self, stage: Stage, r: Result, slots: tuple, last: bool) -> tuple[Any, tuple]:
        """The sample a stage produced, and the slots its arrays now lie in."""
        if last:
            self._learn(r.nbytes)
        if stage.executor is not self.procs:
            if isinstance(r.value, Packed):  # the split read stage packed it into a slot
                return r.value, (r.value.slot,)
            return r.value, ()
        desc, need = r.value
        in_slot, out = slots if slots else (None, None)
        self.slots.release(in_slot)
        if type(out) is RowRef:
            if type(desc) is FdDesc:  # pragma: no cover - a worker with a row writes there
                self.rows.release(out)
                return unpack(desc.desc, desc.buf), ()
            return unpack(desc, out.buf.slot.mmap), (out,)
        if type(desc) is FdDesc:  # no slot (fitting) was given: it came in a memory file
            self.slots.release(out)
            # the mapping is this sample's alone and lives as long as views of it (a user's
            # collate may keep them): no copy
            return unpack(desc.desc, desc.buf), ()
        if out is not None and need > out.size:  # it did not fit: it came pickled
            self.slots.release(out)
            out = None
        if out is not None and self.cfg.collate_fn is not None:
            # The user's collate may keep references to the arrays: copy them out of the slot.
            sample = unpack(desc, out.mmap, copy=True)
            self.slots.release(out)
            return sample, ()
        return unpack(desc, out.mmap if out is not None else None), (out,)

    def _learn(self, nbytes: int) -> None:
        if nbytes > self.out_estimate:
            self.out_estimate = int(nbytes * 1.05)
        self.sample_bytes += (nbytes - self.sample_bytes) * 0.1 if self.sample_bytes else nbytes

    def _next_item(self, index: int, epoch: int, draw: int, key: tuple, value: Any) -> Any:
        if isinstance(value, Packed):  # read threads -> transform processes, through a slot
            return self._proc_item(index, epoch, draw, key, read=False, in_slot=value.slot,
                                   in_desc=value.desc)
        return (index, epoch, draw, value)

    def _free(self, slots: tuple) -> None:
        for s in slots:
            if type(s) is RowRef:
                self.rows.release(s)
            else:
                self.slots.release(s)

    def _decide(self, run: Run, decisions: list) -> None:
        for d in decisions:
            if isinstance(d, Emit):
                run.emitted += 1
                if run.speculative:
                    run.deferred.append(d.stragglers)
                else:
                    self.stragglers += d.stragglers
                run.uncollated += len(d.items)
                key = (run.gen, next(self._batch_ids))
                self._collating[key] = len(d.items)
                self.batch_stage.put(key, (run, d.items))
            elif isinstance(d, Discard):
                self._free(d.result.slots)
            elif isinstance(d, Skip):
                if run.speculative:
                    run.deferred.append(d)
                else:
                    self._skip(d)
            elif isinstance(d, Raise) and not d.final:  # the epoch goes on after it
                run.emitted += 1
                run.uncollated += 1  # in the window until delivered, as a batch's samples
                self.batch_stage.put((run.gen, next(self._batch_ids)),
                                     (run, _Final(("raise", d.error, d.lost), ends=False)))
            elif isinstance(d, (Raise, End)):
                last = ("error", d.error) if isinstance(d, Raise) else ("end",)
                if isinstance(d, End):
                    run.ends_after = run.emitted
                self.batch_stage.put((run.gen, next(self._batch_ids)), (run, _Final(last)))

    def _adopted_counts(self, run: Run) -> None:
        """At ``run``'s adoption (the scheduler thread's "adopt", or ``close()`` finding it
        queued): the samples it dispatched as the next epoch's until now are its look-ahead
        (:attr:`Run.taken_ahead`), and what it deferred is held until the loop takes an item
        of it (:meth:`_count_held`)."""
        run.taken_ahead = run.taken
        run.counts_held, run.deferred = run.deferred, []

    def _unadopted_counts(self, run: Run) -> None:
        """``Pipeline.unadopt``'s counts: the look-ahead is discarded after all, and the
        skips and stragglers held with it go with its batches."""
        self.speculative_discarded += run.taken_ahead
        run.counts_held = []

    def _count_held(self, run: Run) -> None:
        """Count the skips and stragglers ``run`` deferred while it was loaded ahead, now that
        the loop took an item of it (its pass can no longer be started again as another
        epoch): review 186 found them counted at adoption, and kept when ``Pipeline.unadopt``
        then discarded the batches they belonged to. A pass left before its first item never
        counts them (whether its run had ended or not, review 188), as a discarded
        look-ahead."""
        if not run.counts_held:  # (every batch's "consumed" asks: nothing to do mostly)
            return
        held, run.counts_held = run.counts_held, []
        for d in held:
            self._count(d)

    def _count(self, d: Skip | int) -> None:
        """Count a deferred skip, or stragglers (an int), of a speculative run now adopted."""
        if isinstance(d, Skip):
            self._skip(d)
        else:
            self.stragglers += d

    def _skip(self, d: Skip) -> None:
        self.skipped += 1
        path = sample_path(self.spec.dataset, d.index,
                           d.error if isinstance(d.error, BaseException) else None)
        log_skip(d.index, path, d.error, self._skip_logged)
        if self.on_skip is not None:
            self.on_skip(d.index, path, d.error)

    def _end_run(self, run: Run, last: tuple | None) -> None:
        """End ``run`` now: free everything it holds in the stages (results still in workers
        are freed when they arrive), then close it with ``last`` (``None``: the consumer left)."""
        if self.runs.pop(run.gen, None) is None:
            return
        self.rows.close_run(run.gen)
        self._decide(run, run.epoch.abort())
        gone = lambda k, g=run.gen: k[0] != g  # noqa: E731
        for st in self.sample_stages:
            for key, _ in st.drop(gone):
                self._free(self.held.pop(key, ()))
        for key, (_, items) in self.batch_stage.drop(gone):
            if not isinstance(items, _Final):
                self._collating.pop(key, None)
                self._release_items(items)
        if self.transfer_stage is not None:
            self.transfer_stage.drop(gone)
        if self.procs is not None:
            for key, _ in self.procs.forget(run.gen):
                self._free(tuple(self.held.pop(key, ())))
        self._drop_streams(run)
        if self._spent:  # (its samples between stages never end: their sums go)
            self._spent = {k: v for k, v in self._spent.items() if k[0] != run.gen}
        if self._held_key is not None and self._held_key[0] == run.gen:
            self._held_key = None  # (its queued item went above; review 105)
            self._overtook.clear()
        run.finish(last)

    def _drop_streams(self, run: Run) -> None:
        """An iterable dataset's run ended: its workers forget its iterators, and the worker
        count follows the knob again once no run needs more."""
        if not isinstance(run.epoch, Stream):
            return
        if self.procs is not None:
            self.procs.pool.broadcast(("drop", run.gen))
        elif self.streams is not None:
            self.streams.drop(run.gen)
        self._size_stream_workers()

    # -- batch and transfer stages -------------------------------------------------------------
    def _batch_result(self, r: Result) -> None:
        stage = self.batch_stage if r.stage == "batch" else self.transfer_stage
        run = self.runs.get(r.key[0])
        payload = r.value
        final = isinstance(payload, _Final)
        stage.finished(r, count=not final)
        n = 0  # the batch's samples
        if r.stage == "batch" and not final:
            n = self._collating.pop(r.key, 0)
            if run is not None:
                run.uncollated -= n
        if run is None:
            return  # the run ended (its consumer left): the batch is dropped
        if not r.ok:
            if r.stage == "batch" and not final and isinstance(r.error, Exception):
                # A batch that cannot be made (its samples do not stack, the collate_fn
                # raised): the error reaches the loop in the batch's place and the epoch goes
                # on, as DataLoader's iterator; its samples are lost with it (r.value: their
                # positions, delivered as far as a checkpoint is concerned, as DataLoader's).
                item = ("raise", r.error, r.value)
                if self.transfer_stage is not None:  # behind the batches being copied
                    run.uncollated += 1  # as a sample's error (see _decide)
                    self.transfer_stage.put(r.key, (run, _Final(item, ends=False)))
                    return
                if not run.stopped:
                    run.deliver(item)
                run.batching -= 1
                return
            self._end_run(run, ("error", r.error))
            return
        run.unconsumed += n  # (a batch collated) until the training loop takes it
        if r.stage == "batch" and self.transfer_stage is not None:
            self.transfer_stage.put(r.key, (run, payload))
            return
        if final and not payload.ends:
            run.uncollated -= 1  # delivered: out of the window (see _decide)
            if not run.stopped:
                run.deliver(payload.item)
            run.batching -= 1
            return
        if final:
            self.runs.pop(run.gen, None)
            self.rows.close_run(run.gen)
            self._drop_streams(run)
            run.finish(None if run.stopped else payload.item)
            return
        if not run.stopped:
            batch, indices, positions = payload[0], payload[1], payload[2]
            run.deliver(("batch", batch, indices, payload[3] if len(payload) > 3 else None,
                         positions))
        run.batching -= 1  # after it is in ``out``: a reader never sees it in neither

    def _collate(self, key: Any, job: tuple) -> Result:
        """Batch stage function (its own thread): collate a group into pooled buffers."""
        run, items = job
        if isinstance(items, _Final):
            return Result("batch", key, items)
        t0 = time.perf_counter()
        released = False
        try:
            pool = self.batch_pool
            # (no items: a batch sampler's [] batch, collated as the DataLoader does:
            # collate_fn([]), the default's IndexError taking the batch's place)
            first = items[0][2].slots if items else ()
            if first and type(first[-1]) is RowRef:
                buf = first[-1].buf
                if all(c.slots and type(c.slots[-1]) is RowRef and c.slots[-1].buf is buf
                       for _, _, c in items):
                    # Rows of one buffer: a run of rows in the batch's order is the batch (no
                    # copy). In completion order any order will do: the rows'.
                    if buf.home is None:
                        items = tuple(sorted(items, key=lambda it: it[2].slots[-1].row))
                    pool = RowsView(self.batch_pool, buf, self.rows)
            samples = [c.sample for _, _, c in items]
            if self.cfg.collate_fn is not None:
                batch = self.cfg.collate_fn(samples)  # samples own their arrays (see _output)
                self._release_items(items)
                released = True
                if self.cfg.pin_memory or self.cfg.cuda:
                    batch = pin(batch)
            else:
                batch = collate(samples, pool)
                del samples
                self._release_items(items)
                released = True
        except BaseException as e:  # noqa: BLE001 - the training loop gets it
            if not released:  # (pin failed after the release: a slot goes back once)
                self._release_items(items)
            note_batch(e, [index for _, index, _ in items],
                       functools.partial(sample_path, self.spec.dataset))
            return Result("batch", key, [pos for pos, _, _ in items], ok=False, error=e)
        indices = [index for _, index, _ in items]
        positions = [pos for pos, _, _ in items]
        return Result("batch", key, (batch, indices, positions),
                      service_s=time.perf_counter() - t0, nbytes=batch_nbytes(batch))

    def _release_items(self, items: tuple) -> None:
        for _, _, c in items:
            self._free(c.slots)

    def _transfer(self, key: Any, job: tuple) -> Result:
        """Transfer stage function (its own thread): start the host-to-device copy on a side
        CUDA stream; the consumer's stream waits on its end event."""
        import torch

        run, payload = job
        if isinstance(payload, _Final):
            return Result("transfer", key, payload)
        batch, indices, positions = payload
        device = self.cfg.device
        t0 = time.perf_counter()
        try:
            stream = getattr(self, "_stream", None)
            if stream is None:
                stream = self._stream = torch.cuda.Stream(device=device)
            with torch.cuda.stream(stream):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                on_device = to_device(batch, device)
                e1.record(stream)
        except BaseException as e:  # noqa: BLE001 - CUDA out of memory, say: the loop gets it
            return Result("transfer", key, None, ok=False, error=e)
        # The copy's time is read from its events by the consumer, once it has run.
        return Result("transfer", key, (on_device, indices, positions,
                                        (e0, e1, batch_nbytes(batch), batch)),
                      service_s=time.perf_counter() - t0)

    # -- statistics -------------------------------------------------------------------------------
    def _hook(self, name: str) -> Callable[[float, float, int], None]:
        return self.stats[name].record  # (service_s, wait_s, nbytes): called per item

    def _wire_stats(self) -> None:
        s = self.stats
        k = self.knobs
        st = self._stage
        tr = st["transform"]
        # The transform stage's capacity is its queue's places beyond one per free worker
        # (Stage.room): 0 where reads are fused into the process workers (the queue then
        # holds only samples waiting for memory-aware dispatch's budget), the read-ahead
        # behind a read stage of its own (trial 138: pool_size was exported for a queue that
        # never held an item).
        s["transform"].queue_capacity = tr.capacity
        s["transform"].queue_len = lambda: len(tr.queue)
        s["transform"].workers = lambda: tr.executor.size
        rd = st.get("read")
        if rd is not None:
            # (pool_size, not its queue's places, 0: reads_fused tells a read stage of its own
            # from one fused into the workers by it, also from the exported series)
            s["read"].queue_capacity = lambda: k.pool_size
            s["read"].queue_len = lambda: len(rd.queue)
            s["read"].workers = lambda: rd.executor.size
        else:  # reads run inside the transform workers
            s["read"].workers = lambda: tr.executor.size
        s["batch"].queue_capacity = lambda: k.pool_size
        s["batch"].queue_len = lambda: sum(len(items) for _, (_, items), _ in list(self.batch_stage.queue)
                                           if not isinstance(items, _Final))
        s["batch"].workers = lambda: 1
        s["transfer"].queue_capacity = lambda: k.depth
        s["transfer"].queue_len = lambda: sum(len(r.out) for r in list(self.runs.values()))
        s["transfer"].workers = lambda: 1 if self.transfer_stage is not None else 0


def _about_sample(err: BaseException, index: int, path: str | None,
                  note: str | None = None) -> BaseException:
    """Name the sample in an error raised about it (worker deaths and timeouts carry only the
    worker), with ``note`` appended; other errors (from the sample's own code) pass as they are."""
    if not isinstance(err, SampleError) or err.sample_index is not None:
        return err
    msg = f"sample index {index}" + (f" (file {path})" if path else "") + f": {err.args[0]}"
    if note:
        msg += f"; {note}"
    return type(err)(msg, sample_index=index, sample_path=path, worker=err.worker)


__all__ = ["Pipeline", "PipelineConfig", "Run"]
