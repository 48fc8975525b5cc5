"""Memory-aware dispatch replayed on a simulated clock, to weigh its rule without noise.

A wall-clock benchmark on a shared 2-core machine swings by 10-30% between runs, more than
the differences between dispatch rules. The replay runs the loader's own code that decides
which sample starts (``Stage.pump``, ``Pipeline._admit``, ``SampleMemory``) over fake workers
and a simulated clock, with each sample's measured duration and peak memory, so that two rules
compare on the same samples exactly: the makespan (seconds until the last sample ends), the
worker-seconds idle while a sample was held back for memory, and the largest sum of the peaks
of the samples running together.

What it leaves out: transport and collation, the read stage (read and transform run in the
worker, as with the default ``fuse_read=True``), contention between workers (each sample
takes its serial duration), epochs unless ``epoch_sizes`` is given (then a batch never mixes
two, and the next epoch's samples start in the shared window as the loader's prefetch
does), and the controller (fixed workers). With no rule (``"off"``) and a training loop it
is the wall time of a loader with no overhead at all: what the real one is measured against
in ``scripts/ideal_loader.py``. The training loop is a fixed step per batch, or none (samples taken as they
finish: a run the loader bounds).

It patches ``autominato.pipeline.stage.time`` while it runs: never replay beside a live
Loader in the same process. Used by ``scripts/replay_memory.py`` and the tests of the
admission rule. Its figures are those of one measurement of the samples: a noisy machine
moves the measured seconds (up to 5x between two runs of the script in review 56), so
compare rules on the same measurement, as the script does.
"""

from __future__ import annotations

import heapq
import itertools
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autominato.pipeline import stage as stage_module
from autominato.pipeline.costs import SampleCosts
from autominato.pipeline.epoch import Epoch
from autominato.pipeline.memory import MARGIN, SCAN_REFUSALS, SampleMemory
from autominato.pipeline.scheduler import _SLOT_LATER, SLOW_FIRST_LOOKAHEAD, Pipeline
from autominato.pipeline.stage import Stage

#: The rules :func:`replay` compares: ``off`` (``memory_aware=False``), ``fifo`` (a sample
#: held back holds back every later one), ``stop`` (later ones overtake it until a second
#: refusal stops the scan: the rule before the whole queue was scanned), ``scan`` (the rule:
#: :data:`~autominato.pipeline.memory.SCAN_REFUSALS`).
RULES = ("off", "fifo", "stop", "scan")


class FakeWorkers:
    """The process executor as ``Pipeline._admit`` and :class:`Stage` see it: ``size``
    workers, one sample each (``running``: key -> task)."""

    chunk = 1

    def __init__(self, workers: int) -> None:
        self.size = workers
        self.running: dict[Any, Any] = {}

    def held_keys(self) -> Any:
        return iter(list(self.running))

    def free(self) -> int:
        return self.size - len(self.running)

    def submit(self, key: Any, item: Any) -> None:
        self.running[key] = item

    def flush(self) -> None:
        pass


class Dispatch:
    """The scheduler's state that ``Pipeline._admit`` reads, with its methods, in front of
    :class:`FakeWorkers`.

    Args:
        figures: peak bytes per dataset index known before the first sample (0: unknown).
        workers: the workers.
        rule: one of :data:`RULES`.
        margin: the budget's headroom (:data:`~autominato.pipeline.memory.MARGIN`).
    """

    _admit = Pipeline._admit
    _refuse = Pipeline._refuse
    _in_queue_index = Pipeline._in_queue_index

    @staticmethod
    def _budgeted_pool_bytes() -> int:
        """The replay models no batch buffer: its rule is that of the working sets alone."""
        return 0

    @staticmethod
    def _busy_warm() -> float:
        """No warm heap in the replay (see :meth:`_update_heap_keep`)."""
        return 0.0

    @staticmethod
    def _idle_warm(running: int, beside: float = 0.0) -> list[float]:
        """No warm heap in the replay (see :meth:`_update_heap_keep`)."""
        return []

    @staticmethod
    def _make_room(estimate: float) -> None:
        """No warm heap in the replay (see :meth:`_update_heap_keep`)."""

    @staticmethod
    def _update_heap_keep(starting: float = 0.0) -> None:
        """The replay models no warm heap (``Loader(warm_heap=...)``): its peaks are the
        working sets' alone."""

    def __init__(self, figures: Sequence[float], workers: int, rule: str = "scan",
                 margin: float = MARGIN) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.memory = SampleMemory(len(figures), margin)
        for i, f in enumerate(figures):
            self.memory.learn(i, int(f))
        self.procs = FakeWorkers(workers)
        self._in_flight: dict = {}
        self._held_key = None
        self._overtook: set = set()
        self._scan_ests: tuple[tuple[int, int], dict, int] = ((0, 0), {}, 0)
        admit: Callable[..., bool] | None = self._admit
        if rule == "off":
            admit = None
        elif rule == "fifo":
            admit = lambda k, it, over=False: not over and self._admit(k, it)  # noqa: E731
        self.stage = Stage("transform", self.procs, lambda *a: None, lambda: 1 << 30,
                           admit=admit, max_refusals=2 if rule == "stop" else SCAN_REFUSALS)
        self._admit_stage = self.stage

    def put(self, key: tuple, index: int) -> None:
        """Queue dataset index ``index`` as a process worker's task under ``key``."""
        self.stage.put(key, (index, 0, 0, True, None, None, _SLOT_LATER))

    def ended(self, key: tuple) -> None:
        """The sample under ``key`` ended (what ``Pipeline._result`` does for admission)."""
        del self.procs.running[key]
        self._in_flight.pop(key, None)
        self._overtook.discard(key)


@dataclass(frozen=True)
class Replay:
    """What :func:`replay` saw.

    Attributes:
        makespan_s: simulated seconds until the last sample ended, or with a training loop
            until its last step ended.
        held_idle_s: worker-seconds idle while queued samples were held back for memory
            (``Stage.held_idle_s``, the figure ``autominato_memory_wait_seconds_total`` exports).
        peak_bytes: the largest sum of the peaks of samples running together.
        starts: simulated start time of each sample, in the order given.
        held_back: samples that waited for memory (``samples_held_for_memory_total``).
    """

    makespan_s: float
    held_idle_s: float
    peak_bytes: float
    starts: list[float]
    held_back: int = 0


def any_loader_bound(epochs_s: Sequence[Sequence[float]], workers: int, batch_size: int,
                     step_s: float) -> float:
    """Seconds that no loader can beat: a lower bound on the wall time of a training loop
    that steps ``step_s`` seconds per batch of ``batch_size`` (``drop_last=False``) over
    epochs whose samples take ``epochs_s[e]`` seconds each on one of ``workers`` workers,
    whatever the order, window or look-ahead (cross-epoch prefetch unbounded, no overhead),
    as long as every batch but an epoch's last is full (as the DataLoader's and the Loader's
    are: a loader that stepped a short batch first could end sooner), and every step takes
    ``step_s`` (the bench's real steps can be shorter than their calibration).

    The last batch of epoch ``e`` cannot be taken before every sample of epochs ``0..e`` is
    done: not before ``max(their seconds / workers, the longest of them)`` (the two
    classic makespan bounds, Graham 1969); the loop then still steps that batch and every
    later one. The first batch cannot be taken before its ``batch_size`` samples are done:
    not before the ``batch_size``-th shortest of epoch 0 (with ``batch_size > workers``, more).
    The bound is the largest of these; the replay (:func:`replay`), a schedule, is never
    below it.

    Raises:
        ValueError: ``workers < 1``, ``batch_size < 1`` or ``step_s < 0``.
    """
    if workers < 1 or batch_size < 1 or step_s < 0:
        raise ValueError(f"workers and batch_size must be >= 1 and step_s >= 0, got "
                         f"{workers}, {batch_size}, {step_s}")
    per = [-(-len(e) // batch_size) for e in epochs_s]
    total = sum(per)
    best, work, longest, through = 0.0, 0.0, 0.0, 0
    for secs, nb in zip(epochs_s, per, strict=True):
        if not nb:
            continue
        work += float(sum(secs))
        longest = max(longest, float(max(secs)))
        through += nb
        best = max(best, max(work / workers, longest) + (total - through + 1) * step_s)
    if total:
        first = sorted(next(e for e in epochs_s if len(e)))[:batch_size]
        ready = max(first[-1], sum(first) / min(workers, len(first)))
        best = max(best, ready + total * step_s)
    return best


def replay(samples: Sequence[tuple[int, float, float]], workers: int, *, rule: str = "scan",
           in_flight: int | None = None, figures: Sequence[float] | None = None,
           n_indices: int | None = None,
           learn: bool = True, batch_size: int = 1, step_s: float = 0.0,
           margin: float = MARGIN, epoch_sizes: Sequence[int] | None = None,
           slow_first: bool = False) -> Replay:
    """Dispatch ``samples`` (``(dataset index, seconds, peak bytes)``, in the sampler's
    order) to ``workers`` on a simulated clock under ``rule``.

    Args:
        in_flight: samples taken and not yet consumed at most (the Loader's ``pool_size``
            window: queued, running, or done and waiting for the training loop; ``None``: all
            queued from the start).
        figures: peak bytes per index known before the first sample (a resumed run);
            ``None``: none (a fresh run's first epoch is unprotected).
        n_indices: the dataset's length (default: the largest index + 1).
        learn: each sample's peak becomes its index's figure when it ends, as the workers
            report it.
        batch_size, step_s: the training loop takes ``batch_size`` finished samples (in
            completion order, epochs not told apart) as soon as they are there and it has
            finished its last step, and steps ``step_s`` seconds; the samples leave the
            window when it takes them. ``step_s=0``: each batch is taken as it fills.
        margin: the budget's headroom (:data:`~autominato.pipeline.memory.MARGIN`).
        epoch_sizes: samples per epoch, in order (they sum to ``len(samples)``): the training
            loop then takes each epoch's batches from that epoch's finished samples only, the
            last one partial (``drop_last=False``), and starts the next epoch after it; the
            workers go on into the next epoch within the window. ``None``: one stream.
        slow_first: the window takes each epoch's samples as the Loader's completion order
            does (``epoch.Epoch.take`` with ``costs.SampleCosts``: after the epoch's first
            batch, the one whose index took longest last time among the next ``in_flight``,
            at most ``scheduler.SLOW_FIRST_LOOKAHEAD``),
            each sample's seconds becoming its index's when it ends; False: in the order
            given.

    Raises:
        ValueError: an unknown rule, ``workers < 1``, ``in_flight < batch_size`` (no batch
            could fill: the Loader keeps ``pool_size >= batch_size``), or ``epoch_sizes``
            that do not sum to ``len(samples)``.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if in_flight is not None and in_flight < batch_size:
        raise ValueError(f"in_flight ({in_flight}) must be >= batch_size ({batch_size})")
    sizes = list(epoch_sizes) if epoch_sizes is not None else [len(samples)]
    if sum(sizes) != len(samples) or any(n < 0 for n in sizes):
        raise ValueError(f"epoch_sizes sum to {sum(sizes)}, not to the {len(samples)} samples")
    epoch_of = [e for e, n in enumerate(sizes) for _ in range(n)]
    n = n_indices if n_indices is not None else 1 + max((s[0] for s in samples), default=0)
    d = Dispatch(figures if figures is not None else [0.0] * n, workers, rule, margin)
    clock = types.SimpleNamespace(now=0.0)
    starts = [0.0] * len(samples)
    events: list[tuple[float, int, tuple | None]] = []  # (time, pos, key); key None: a step ends
    cap = len(samples) if in_flight is None else in_flight
    fed = peak = done = consumed = 0
    # The order samples enter the window: as given, or each epoch's Epoch.take (slow first).
    starts_of = [0, *itertools.accumulate(sizes)]
    costs = SampleCosts(n)
    epochs = [Epoch([samples[p][0] for p in range(starts_of[e], starts_of[e + 1])],
                    batch_size, cost=costs.estimate if slow_first else None,
                    lookahead=min(cap, SLOW_FIRST_LOOKAHEAD))
              for e in range(len(sizes))]
    done_in = [0] * len(sizes)  # finished samples per epoch
    taken_in = [0] * len(sizes)  # of them, taken by the training loop
    ep = 0  # the epoch the training loop is in
    loop_free = True
    end = 0.0
    real, stage_module.time = stage_module.time, types.SimpleNamespace(  # type: ignore[assignment]
        monotonic=lambda: clock.now)
    try:
        while True:
            while loop_free:  # (with no step, every batch that is there is taken now)
                while ep < len(sizes) and taken_in[ep] == sizes[ep]:
                    ep += 1
                want = min(batch_size, sizes[ep] - taken_in[ep]) if ep < len(sizes) else 0
                if not want or done_in[ep] - taken_in[ep] < want:
                    break
                taken_in[ep] += want
                consumed += want
                if step_s > 0:
                    loop_free = False
                    heapq.heappush(events, (clock.now + step_s, -1, None))
                end = clock.now + step_s
            while fed < len(samples) and fed - consumed < cap:
                e = epoch_of[fed]
                pos = starts_of[e] + epochs[e].take(1)[0].pos
                d.put((0, pos, 0), samples[pos][0])
                fed += 1
            before = set(d.procs.running)
            d.stage.pump()
            for key in set(d.procs.running) - before:
                pos = key[1]
                starts[pos] = clock.now
                heapq.heappush(events, (clock.now + samples[pos][1], pos, key))
            peak = max(peak, sum(samples[k[1]][2] for k in d.procs.running))
            if not events:
                break
            clock.now, pos, key = heapq.heappop(events)
            if key is None:
                loop_free = True
                continue
            d.ended(key)
            done += 1
            done_in[epoch_of[pos]] += 1
            if learn:
                d.memory.learn(samples[pos][0], int(samples[pos][2]))
            costs.learn(samples[pos][0], samples[pos][1])
    finally:
        stage_module.time = real  # type: ignore[assignment]
    if done != len(samples):  # (a rule that never admits a sample: a defect of the rule)
        raise RuntimeError(f"replay stalled after {done} of {len(samples)} samples")
    return Replay(max(clock.now, end), d.stage.held_idle_s(), peak, starts, d.memory.held_back)


def measure(workload: Any, epochs: int,
            arms_order: bool = False) -> list[tuple[int, int, float, float]]:
    """Run every sample of ``epochs`` epochs serially in this process, read and transform
    (``workload``: a :class:`~autominato.bench.workload.Workload`), and time each and measure
    its peak memory as a worker does (:class:`~autominato.pipeline.worker.PeakMeter`):
    ``(epoch, index, seconds, peak bytes)``, in ``0 .. n - 1`` order per epoch, or with
    ``arms_order`` in the order the bench's arms take each epoch
    (:meth:`~autominato.bench.workload.Workload.epoch_indices`: a rank's share with
    ``--ranks``). One sample is
    run first and not counted (imports, first-call costs). The free heap is given back before
    each sample (glibc's ``malloc_trim``), so that a small sample after a large one is
    measured by its own working set, not by the pages the large one left (a worker gives
    them back only after its heap grew by ``worker.HEAP_SLACK_BYTES``)."""
    from autominato.bench.workload import SampleFn
    from autominato.pipeline.worker import PeakMeter, give_back_free_heap

    fn = SampleFn(workload)
    fn(0)
    meter = PeakMeter()
    out = []
    try:
        for e in range(epochs):
            for i in (workload.epoch_indices(e) if arms_order else range(len(fn))):
                give_back_free_heap()
                base = meter.start()
                t0 = time.perf_counter()
                fn((e, i))
                out.append((e, int(i), time.perf_counter() - t0, float(meter.peak(base))))
    finally:
        meter.close()
    return out


__all__ = ["RULES", "Dispatch", "FakeWorkers", "Replay", "measure", "replay"]
