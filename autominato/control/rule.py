"""The controller's decision rule: a pure function from a stats history to knob changes.

A rule sees a history of :class:`~autominato.pipeline.stats.LoaderSnapshot` (oldest first),
the knobs' bounds, a :class:`Budget` (cores, memory) and its own previous :class:`RuleState`,
and returns the changes to make and its next state. It has no threads, no clocks and no side
effects: time comes only from the snapshots, so a test can replay a synthetic history and get
the same answer every time. :class:`Rule` is the interface; :class:`StageBasedRule` is the
default.

The target is the consumer, as in tf.data's ``STAGE_BASED`` autotuning (Murray et al.,
"tf.data: A Machine Learning Data Processing Framework", VLDB 2021, section 3.3): deliver each
batch by the time the training step asks for it (accelerator-idle ratio near zero) with the
fewest workers and the least memory that does so, rather than maximise throughput.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autominato.pipeline.stats import LoaderSnapshot
from autominato.telemetry.cores import (
    CPU_BUSY,
    CPU_OF_WORKERS_KEY,
    CPU_SATURATED,
    CPU_SECONDS_KEY,  # noqa: F401 - re-exported: the extra key the controller fills
    CoreBudget,
    cpu_cores_used,
    reads_fused,
    transforms_inline,
)
from autominato.telemetry.window import between

#: Why a knob changed. A bounded set, so that it can label a Prometheus counter.
REASONS = (
    "transform_bound",  # the transform stage is saturated: add workers
    "read_bound",  # the read stage is saturated: add read threads
    "pool_bound",  # samples in flight sit at the pool size: add pool slots
    "starved",  # no stage saturated yet the consumer waits (bursts): deepen the prefetch
    "over_provisioned",  # the consumer never waits and a stage has slack: remove some
    "revert",  # the last trial did not help: undo it
    "memory_pressure",  # predicted host memory is over the budget: shrink
    "core_budget",  # more CPU-bound transform workers than usable cores: shrink
)

#: Keys that :class:`~autominato.control.Controller` adds to ``LoaderSnapshot.extra``
#: (``CPU_SECONDS_KEY`` is shared with the Data Monitor, :mod:`autominato.telemetry.cores`).
WORKER_RSS_KEY = "control.worker_rss_bytes"
WORKER_COUNT_KEY = "control.worker_processes"

#: (stage, knob) pairs whose concurrency a knob sets.
STAGE_KNOBS = (("transform", "workers"), ("read", "read_threads"))

Bounds = Mapping[str, tuple[int, int]]


@dataclass(frozen=True)
class Decision:
    """One knob change.

    Attributes:
        knob: a name from :data:`~autominato.pipeline.knobs.KNOB_NAMES`.
        old / new: the value before and after (``new`` as applied, after clamping).
        reason: one of :data:`REASONS`.
        detail: the figures the rule saw, human-readable, one line.
    """

    knob: str
    old: int
    new: int
    reason: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"decision reason {self.reason!r} is not one of {REASONS}")

    def line(self) -> str:
        """The one-line log form: ``workers 2 -> 3 (transform_bound): idle 0.310 ...``."""
        return f"{self.knob} {self.old} -> {self.new} ({self.reason}): {self.detail}"


@dataclass(frozen=True)
class Budget:
    """Resources the loader may use.

    Attributes:
        cores: usable CPU cores (affinity and cgroup quota,
            :func:`~autominato.pipeline.knobs.usable_cores`); CPU-bound transform workers never
            exceed it.
        memory_bytes: host memory the loader may hold (buffered samples plus worker
            processes), bytes; ``None`` for no limit.
    """

    cores: int
    memory_bytes: float | None = None


@dataclass(frozen=True)
class Window:
    """Figures measured between two snapshots ``a`` (older) and ``b`` (see
    :meth:`StageBasedRule._fresh` for which two).

    Attributes:
        start / end: snapshot times, seconds (``time.monotonic()``).
        batches: batches delivered in the window.
        idle: accelerator-idle ratio, ``wait / (wait + busy)`` in [0, 1].
        wait_per_batch_s: consumer wait per batch, seconds.
        wait_sd_s: standard deviation of the wait per batch between the window's
            intervals (consecutive snapshots), seconds; 0.0 with fewer than two intervals.
        intervals: intervals with at least one batch in the window.
        idle_sd: standard deviation of the idle ratio between the window's intervals; 0.0
            with fewer than two intervals.
        idle_min: the lowest idle ratio of the window's intervals (0.0 without any).
        step_s: consumer step time per batch (time between ``next()`` calls), seconds.
        batch_size: mean samples per batch.
        demand: samples/s that would keep the consumer from ever waiting,
            ``batch_size / step_s``.
        util: per stage, mean fraction of its workers busy,
            ``service seconds / (active seconds x workers)``, at most 1: active seconds are
            the window's less the training loop's time between epochs.
        service_s: per stage, mean service time per item in the window, seconds.
        workers: per stage, the concurrency the stage reported at ``b``.
        cpu_cores: mean cores used by the loader's processes, over the active seconds when
            the figure is the worker processes' alone (this process's CPU would count the
            validation loop's), or ``None`` when unknown.
        in_flight_max: most samples seen holding pool slots (queued in or served by the
            read, transform and batch stages) at any snapshot of the window; when the stages
            do not report busy workers, the transform stage's mean busy workers are added.
        knobs: knob values at ``b``.
        memory_bytes: predicted host memory at ``b`` (see :func:`predicted_memory`).
        memory_wait: the share of the process workers' active seconds that free workers
            spent waiting because the samples queued for them did not fit in the memory
            budget (``memory_wait_seconds_total``; 0 without memory-aware dispatch).
    """

    start: float
    end: float
    batches: int
    idle: float
    wait_per_batch_s: float
    wait_sd_s: float
    intervals: int
    idle_sd: float
    idle_min: float
    step_s: float
    batch_size: float
    demand: float
    util: dict[str, float]
    service_s: dict[str, float]
    workers: dict[str, int]
    cpu_cores: float | None
    in_flight_max: int
    knobs: dict[str, int]
    memory_bytes: float
    memory_wait: float = 0.0

    def describe(self, budget: Budget) -> str:
        """The figures as one log line."""
        util = " ".join(f"{s}={self.util[s]:.2f}" for s, _ in STAGE_KNOBS if s in self.util)
        cpu = "?" if self.cpu_cores is None else f"{self.cpu_cores:.2f}"
        mem = f"{self.memory_bytes / 2**20:.0f}"
        cap = "inf" if budget.memory_bytes is None else f"{budget.memory_bytes / 2**20:.0f}"
        return (
            f"idle {self.idle:.3f} wait/batch {self.wait_per_batch_s * 1e3:.1f} ms "
            f"step {self.step_s * 1e3:.1f} ms demand {self.demand:.1f} samples/s "
            f"util {util} cpu {cpu}/{budget.cores} cores mem {mem}/{cap} MiB "
            + (f"memory wait {self.memory_wait:.0%} " if self.memory_wait > 0 else "")
            + f"over {self.batches} batches"
        )


#: Stages whose queued samples hold pool slots (the pool bounds the samples dispatched and
#: not yet collated into a batch).
POOL_STAGES = ("read", "transform", "batch")


def _in_flight(s: LoaderSnapshot) -> int:
    return sum(
        st.queue_len + st.busy_workers for name, st in s.stages.items() if name in POOL_STAGES
    )


def predicted_memory(s: LoaderSnapshot, knobs: Mapping[str, int], batch_size: float) -> float:
    """Host memory in bytes the loader would hold at ``knobs``, from what ``s`` measured.

    ``buffered samples x bytes per sample + worker processes x bytes per worker``, where
    buffered samples are ``pool_size + depth x batch_size`` (the pool's slots plus the
    batches prefetched ahead of the consumer), bytes per sample is the larger of the mean
    transformed sample (``s.sample_bytes``) and the pool's measured bytes per buffered
    sample, and bytes per worker is the mean private memory (RSS less shared pages, read by
    :mod:`autominato.telemetry.process`) of the worker processes the controller measured
    (``0`` for thread workers).
    """
    buffered_now = s.knobs.get("pool_size", 0) + s.knobs.get("depth", 0) * batch_size
    per_sample = s.sample_bytes
    if buffered_now > 0 and s.pool_bytes > 0:
        per_sample = max(per_sample, s.pool_bytes / buffered_now)
    n_proc = s.extra.get(WORKER_COUNT_KEY, 0.0)
    per_worker = s.extra.get(WORKER_RSS_KEY, 0.0) / n_proc if n_proc > 0 else 0.0
    buffered = knobs.get("pool_size", 0) + knobs.get("depth", 0) * batch_size
    return buffered * per_sample + knobs.get("workers", 0) * per_worker


def measure(a: LoaderSnapshot, b: LoaderSnapshot, window: Sequence[LoaderSnapshot] = ()) -> Window:
    """The :class:`Window` figures between snapshots ``a`` and ``b`` (``b`` later).

    Rates and ratios come from :func:`autominato.telemetry.window.between`; this adds what
    the controller makes of them. ``window`` (the snapshots from ``a`` to ``b``, oldest
    first) feeds ``in_flight_max``, ``wait_sd_s`` and ``intervals``.

    Where one set of workers runs two stages, the stages are folded so that utilisation is
    that of the workers: with ``workers == 0`` (transforms inline in the read threads) the
    transform stage is folded into ``read``; when the read stage reports no workers (reads
    fused into the transform worker processes) it is folded into ``transform``.
    """
    r = between(a, b)
    stages = {name: st for name, st in r.stages.items() if name in a.stages}
    inline = transforms_inline(b)
    read, transform = stages.get("read"), stages.get("transform")
    fused = reads_fused(b)
    if (inline or fused) and read is not None and transform is not None:
        into, other = (read, transform) if inline else (transform, read)
        stages[into.name] = replace(into, service_s=into.service_s + other.service_s)
        del stages[other.name]
    # The training loop's time between epochs (validation, checkpoints) is no time it asked
    # for batches: once the samples prefetched for the next epoch are done, the workers idle
    # there, which would read as spare capacity. Utilisation and CPU use are over the rest
    # (the prefetch made in a pause then counts in a shorter time: a bias towards busy).
    span = max(b.time - a.time, 1e-9)
    away = max(0.0, b.between_epochs_seconds_total - a.between_epochs_seconds_total)
    active = max(span - away, 1e-3 * span)
    util = {n: min(1.0, st.utilisation * span / active) for n, st in stages.items()}
    service = {
        n: st.mean_service_s if st.items > 0 else b.stages[n].mean_service_s
        for n, st in stages.items()
    }
    workers = {n: st.workers for n, st in stages.items()}
    in_flight = max((_in_flight(s) for s in (*window, a, b)), default=0)
    if not any(st.busy_workers for st in b.stages.values()) and "transform" in util:
        in_flight += round(util["transform"] * workers["transform"])
    intervals = [
        between(x, y)
        for x, y in zip(window[:-1], window[1:], strict=True)
        if y.batches_total > x.batches_total
    ]
    per_interval = [w.wait_per_batch_s for w in intervals]
    idle_per_interval = [w.idle_ratio for w in intervals]
    cpu = cpu_cores_used(a, b)
    if cpu is not None and b.extra.get(CPU_OF_WORKERS_KEY) == 1.0:
        # (the worker processes' CPU alone: this process's would hold the validation loop's)
        cpu *= span / active
    return Window(
        start=r.start,
        end=r.end,
        batches=r.batches,
        idle=r.idle_ratio,
        wait_per_batch_s=r.wait_per_batch_s,
        wait_sd_s=float(np.std(per_interval, ddof=1)) if len(per_interval) > 1 else 0.0,
        intervals=len(per_interval),
        idle_sd=float(np.std(idle_per_interval, ddof=1)) if len(intervals) > 1 else 0.0,
        idle_min=min(idle_per_interval, default=0.0),
        step_s=r.step_s,
        batch_size=r.samples_per_batch,
        demand=r.samples_per_batch / r.step_s if r.step_s > 0 else math.inf,
        util=util,
        service_s=service,
        workers=workers,
        cpu_cores=cpu,
        in_flight_max=in_flight,
        knobs=dict(b.knobs),
        memory_bytes=predicted_memory(b, b.knobs, r.samples_per_batch),
        memory_wait=_memory_wait(a, b, active),
    )


def _memory_wait(a: LoaderSnapshot, b: LoaderSnapshot, active: float) -> float:
    """:attr:`Window.memory_wait` between ``a`` and ``b`` over ``active`` seconds."""
    waited = b.memory_wait_seconds_total - a.memory_wait_seconds_total
    workers = b.knobs.get("workers", 0)
    return min(1.0, waited / (workers * active)) if waited > 0 and workers > 0 else 0.0


@dataclass(frozen=True)
class Trial:
    """A change on probation: kept if the next window shows it helped, else reverted."""

    decision: Decision
    baseline: Window
    grow: bool
    with_it: tuple[Decision, ...] = ()  # applied with it, reverted with it (``_pool_for``)


@dataclass(frozen=True)
class RuleState:
    """What :class:`StageBasedRule` remembers between calls (immutable; each call returns a new one).

    Attributes:
        since: time of the snapshot on which the last change was decided; windows start
            after it, so that no window mixes two configurations.
        trial: the change being judged, or ``None``.
        failures: ``(knob, direction) -> consecutive reverted trials``.
        backoff_until: ``(knob, direction) -> batches_total`` before which the move is not
            tried again (doubling with each failure: the hysteresis against oscillation).
        last_kept: ``knob -> direction`` (+1 / -1) of its last kept trial.
        decisions: changes made so far.
    """

    since: float = -math.inf
    trial: Trial | None = None
    failures: Mapping[tuple[str, int], int] = field(default_factory=dict)
    backoff_until: Mapping[tuple[str, int], int] = field(default_factory=dict)
    last_kept: Mapping[str, int] = field(default_factory=dict)
    decisions: int = 0


class Rule(ABC):
    """Interface of a decision rule; swap in another with ``Controller(loader, rule=...)``."""

    @abstractmethod
    def initial_state(self) -> Any:
        """The state before the first call of :meth:`decide`."""

    @abstractmethod
    def decide(
        self, history: Sequence[LoaderSnapshot], bounds: Bounds, budget: Budget, state: Any
    ) -> tuple[list[Decision], Any]:
        """Decide what to change.

        Args:
            history: snapshots, oldest first, taken every controller interval; each carries
                the knob values in force when it was taken.
            bounds: ``knob -> (low, high)``, inclusive.
            budget: cores and memory the loader may use.
            state: what the previous call returned (or :meth:`initial_state`).

        Returns:
            ``(decisions, next_state)``; each decision's ``new`` lies within ``bounds``.
        """


@dataclass(frozen=True)
class StageBasedRule(Rule):
    """Find the bottleneck stage, change one knob, judge it over a window, keep or revert.

    A window is a run of snapshots all taken after the last change under the same knobs
    (once new workers are up), past the first ``warmup_batches`` after the latest cold start
    (``cold_starts_total``: an epoch whose samples were not prefetched, the first included);
    it ends at the latest snapshot and reaches back no further than needed to cover
    ``max_window_batches`` batches. It spans epochs whose samples were prefetched, and the
    training loop's time between them (validation, checkpoints), which utilisation leaves
    out (see :func:`measure`): with short epochs (MLPerf 3D-UNet's 21 samples per rank, 11
    batches of 2) a window kept to one epoch would never hold ``warmup_batches +
    min_batches``, and the rule would never act. With a cold start every epoch
    (``prefetch_next_epoch=False``) it still needs epochs of ``warmup_batches +
    min_batches`` batches. Each call:

    1. Memory: when the predicted memory exceeds the budget, shrink depth, then the pool
       (not below one slot per worker and read thread), then workers, then read threads, as
       far as needed. This needs no window and no trial: it is not undone.
    2. Judges the change on trial once its window holds ``judge_batches``. A grow is kept
       when the consumer's wait per batch fell by more than ``z`` standard errors of the
       difference (the spread of the per-interval waits before the change is the noise
       estimate: a window picked for its high idle tends to be followed by a lower one by
       chance alone) and either by at least ``min_gain`` or to an idle below ``idle_low``.
       When that test fails the window grows to ``max_window_batches``, and the grow is
       then kept only if idle stays below ``idle_low`` over it. A shrink is kept while idle stays below ``(idle_low + idle_high) / 2``.
       Otherwise it is reverted and the move is barred for
       ``backoff_batches x 2**(failures - 1)`` batches (at most ``max_backoff_batches``).
       A shrink is judged over a full ``max_window_batches`` window (sooner only if idle
       rises above ``idle_high``). A kept grow bars shrinking that knob for
       ``backoff_batches``; if it grew back what a kept shrink removed, that counts as a
       failure of the shrink and the bar doubles like a revert's. This hysteresis is what
       lets a noisy steady workload settle instead of oscillating.
    3. Cores: more transform workers than usable cores while the loader's processes use at
       least ``cpu_saturated`` of them: shrink to the core count.
    4. Idle above ``idle_high`` by more than ``z_trigger`` standard errors of the window's
       per-interval idle (window of at least ``min_batches``; the latest ``judge_batches``
       alone when their idle exceeds ``idle_urgent`` and each of their intervals' idle
       exceeds ``idle_high``, so that a shift in the workload is met at once, with figures
       not diluted by the time before it): grow the stage with the
       highest utilisation if it is saturated (``util >= util_saturated``) to
       ``ceil(service x demand x headroom)`` workers (Little's law: the concurrency that
       serves ``demand`` samples/s), at least one more and at most double. Transform workers
       stop at the core count unless the stage is I/O-like (the loader's processes use less
       than ``cpu_busy`` of the cores); then they stop where the CPU use, scaled with the
       worker count, would reach ``cpu_saturated`` of the cores. No stage saturated: grow
       the pool when samples in flight reach ``pool_fill`` of it, else deepen the prefetch.
       A grow that would break the memory budget is not made; nor any grow while free
       workers spent ``memory_wait_high`` of their time or more waiting for memory
       (:attr:`Window.memory_wait`): the samples then wait for memory-aware dispatch's
       budget, which no knob raises where an outlier sets it.
    5. Idle below ``idle_low`` over a window of at least ``shrink_batches``: shrink a stage
       whose utilisation would stay below ``util_shrink`` with fewer workers (workers first,
       then read threads), else a pool never more than half used, to twice its peak use
       (at most halving it).

    Defaults: ``idle_high`` 5 % and ``idle_low`` 2 % bracket "near zero" with a dead band;
    ``util_saturated`` 0.8 and ``util_shrink`` 0.7 leave a stage 20-30 % headroom against
    bursts; ``memory_wait_high`` 10 % is well above what samples alike wait (none, by the
    budget's headroom: :mod:`autominato.pipeline.memory`). They are this project's choices,
    checked on the synthetic workloads of ``tests/test_control_rule.py``
    (:mod:`autominato.control.sim`).
    """

    idle_high: float = 0.05
    idle_low: float = 0.02
    min_batches: int = 8
    judge_batches: int = 16
    shrink_batches: int = 48
    max_window_batches: int = 64
    min_gain: float = 0.10
    z: float = 2.0
    z_trigger: float = 1.0
    idle_urgent: float = 0.15
    util_saturated: float = 0.8
    util_shrink: float = 0.7
    headroom: float = 1.2
    cpu_busy: float = CPU_BUSY
    cpu_saturated: float = CPU_SATURATED
    pool_fill: float = 0.8
    backoff_batches: int = 64
    max_backoff_batches: int = 4096
    settle_snapshots: int = 4
    warmup_batches: int = 4
    memory_wait_high: float = 0.1

    def initial_state(self) -> RuleState:
        return RuleState()

    # -- window -------------------------------------------------------------------------

    def _fresh(self, history: Sequence[LoaderSnapshot], since: float) -> list[LoaderSnapshot]:
        """The latest snapshots after ``since`` with the latest knobs, oldest first, across
        the epochs since the latest cold start but leaving out its first ``warmup_batches``
        (the consumer waits while the pipeline fills, whatever the knobs)."""
        b = history[-1]
        out: list[LoaderSnapshot] = []
        cold_at: int | None = 0 if history[0].batches_total == 0 else None
        for s in reversed(history):
            if s.cold_starts_total != b.cold_starts_total:
                cold_at = s.batches_total
                break
        for s in reversed(history):
            if s.time <= since or s.cold_starts_total != b.cold_starts_total or s.knobs != b.knobs:
                break
            if cold_at is not None and s.batches_total < cold_at + self.warmup_batches:
                break
            out.append(s)
        return out[::-1]

    def _window(self, fresh: list[LoaderSnapshot]) -> list[LoaderSnapshot]:
        """The latest window (oldest first): settled, and reaching back no further than needed
        to cover ``max_window_batches``."""
        # A new worker takes a while to start (a spawned process imports torch): wait until
        # the stages report the concurrency the knobs ask for, or a few snapshots at most.
        start = 0
        for i, s in enumerate(fresh):
            start = i
            if i >= self.settle_snapshots or self._settled(s):
                break
        fresh = fresh[start:]
        b = fresh[-1]
        # The latest start that still covers max_window_batches, else the earliest.
        first = 0
        for i in range(len(fresh) - 2, -1, -1):
            if b.batches_total - fresh[i].batches_total >= self.max_window_batches:
                first = i
                break
        return fresh[first:]

    @staticmethod
    def _settled(s: LoaderSnapshot) -> bool:
        for stage, knob in STAGE_KNOBS:
            st = s.stages.get(stage)
            want = s.knobs.get(knob, 0)
            # A stage with no workers of its own (fused or inline) follows another knob.
            if st is not None and want > 0 and st.workers not in (0, want):
                return False
        return True

    # -- rule ---------------------------------------------------------------------------

    def decide(
        self, history: Sequence[LoaderSnapshot], bounds: Bounds, budget: Budget, state: RuleState
    ) -> tuple[list[Decision], RuleState]:
        if len(history) < 2:
            return [], state
        b = history[-1]
        fresh = self._fresh(history, state.since)
        if len(fresh) < 2:
            return [], state
        memory = self._memory(history, bounds, budget)
        if memory is not None:
            return [memory], replace(state, since=b.time, trial=None, decisions=state.decisions + 1)
        snaps = self._window(fresh)
        w = measure(snaps[0], b, snaps)
        if state.trial is not None:
            if w.batches < self.judge_batches:
                return [], state
            verdict, state = self._judge(state, w, b, budget)
            if verdict or state.trial is not None:  # reverted, or still being judged
                return verdict, state
        # A long window averages noise out but reacts late to a change of workload; a
        # starved consumer over the latest judge_batches is acted on at once, and that
        # shorter window is then the baseline the change is judged against.
        recent = snaps
        for i in range(len(snaps) - 2, -1, -1):
            if b.batches_total - snaps[i].batches_total >= self.judge_batches:
                recent = snaps[i:]
                break
        short = measure(recent[0], b, recent)
        if (
            short.idle > self.idle_urgent
            and short.batches >= self.min_batches
            and short.intervals >= 2
            and short.idle_min > self.idle_high  # every interval starved, not one burst
        ):
            w = short
        for choose in (self._cores, self._grow, self._shrink):
            picked = choose(w, bounds, budget, state, b)
            if picked is not None:
                break
        else:
            return [], state
        decision, on_trial = replace(picked[0], detail=w.describe(budget)), picked[1]
        with_it = list(picked[2]) if len(picked) > 2 else []  # (_pool_for)
        # A pool that grows comes before the workers it feeds; one that shrinks, after them.
        ordered = [*with_it, decision] if decision.new > decision.old else [decision, *with_it]
        return ordered, replace(
            state,
            since=b.time,
            trial=(Trial(decision, w, decision.new > decision.old, tuple(with_it)) if on_trial
                   else None),
            decisions=state.decisions + 1,
        )

    def _judge(
        self, state: RuleState, w: Window, b: LoaderSnapshot, budget: Budget
    ) -> tuple[list[Decision], RuleState]:
        trial = state.trial
        assert trial is not None
        d = trial.decision
        move = (d.knob, 1 if trial.grow else -1)
        if trial.grow:
            base = trial.baseline
            gain = base.wait_per_batch_s - w.wait_per_batch_s
            noise = base.wait_sd_s * math.sqrt(
                1.0 / max(1, base.intervals) + 1.0 / max(1, w.intervals)
            )
            ok = gain > self.z * noise and (
                w.idle < self.idle_low or gain >= self.min_gain * base.wait_per_batch_s
            )
            if not ok and w.batches < self.max_window_batches:
                return [], state  # not conclusive yet: let the window grow
            # A full window with the consumer fed is conclusive on its own.
            ok = ok or w.idle < self.idle_low
        else:
            # Shrinks are never urgent: one must hold over a full window, unless it clearly
            # starves the consumer sooner.
            if w.idle <= self.idle_high and w.batches < self.max_window_batches:
                return [], state
            ok = w.idle < (self.idle_low + self.idle_high) / 2
        if ok:
            # A kept grow clears its failures; a kept shrink does not clear its own, which
            # count how often shrinking this knob was regretted (see below).
            failures = dict(state.failures)
            if trial.grow:
                failures.pop(move, None)
            backoff = dict(state.backoff_until)
            if trial.grow:
                # Growing back what a kept shrink removed counts as that shrink's failure, so
                # a shrink / grow cycle on one knob backs off like a reverted trial.
                shrink = (d.knob, -1)
                n = failures.get(shrink, 0) + 1 if state.last_kept.get(d.knob) == -1 else 1
                if n > 1:
                    failures[shrink] = n
                backoff[shrink] = b.batches_total + self._backoff(n)
            last_kept = {**state.last_kept, d.knob: move[1]}
            return [], replace(
                state, trial=None, failures=failures, backoff_until=backoff, last_kept=last_kept
            )
        n = state.failures.get(move, 0) + 1
        wait = self._backoff(n)
        revert = Decision(
            d.knob,
            d.new,
            d.old,
            "revert",
            f"{d.knob} {d.old} -> {d.new} ({d.reason}) did not help: before idle "
            f"{trial.baseline.idle:.3f} wait/batch {trial.baseline.wait_per_batch_s * 1e3:.1f} ms, "
            f"after {w.describe(budget)}; not retried for {wait} batches",
        )
        undo = [Decision(c.knob, c.new, c.old, "revert", f"with {d.knob} {d.new} -> {d.old}")
                for c in reversed(trial.with_it)]
        ordered = [*undo, revert] if revert.new > revert.old else [revert, *undo]
        return ordered, replace(
            state,
            since=b.time,
            trial=None,
            failures={**state.failures, move: n},
            backoff_until={**state.backoff_until, move: b.batches_total + wait},
            decisions=state.decisions + 1,
        )

    def _backoff(self, failures: int) -> int:
        """Batches a move is barred after its ``failures``-th failure (doubling, capped)."""
        return min(self.max_backoff_batches, self.backoff_batches * 2 ** (failures - 1))

    def _allowed(
        self, knob: str, new: int, old: int, bounds: Bounds, state: RuleState, b: LoaderSnapshot
    ) -> bool:
        lo, hi = bounds[knob]
        if new == old or not lo <= new <= hi:
            return False
        until = state.backoff_until.get((knob, 1 if new > old else -1), -1)
        return b.batches_total >= until

    @staticmethod
    def _pool_floor(knobs: Mapping[str, int], bounds: Bounds) -> int:
        # Every read thread and worker needs a slot to work on.
        return max(
            bounds["pool_size"][0], 1, knobs.get("workers", 0) + knobs.get("read_threads", 0)
        )

    def _memory(
        self, history: Sequence[LoaderSnapshot], bounds: Bounds, budget: Budget
    ) -> Decision | None:
        if budget.memory_bytes is None:
            return None
        b = history[-1]
        batch_size = b.samples_total / b.batches_total if b.batches_total else 1.0
        knobs = dict(b.knobs)
        now = predicted_memory(b, knobs, batch_size)
        if now <= budget.memory_bytes:
            return None
        for knob in ("depth", "pool_size", "workers", "read_threads"):
            old = knobs.get(knob, 0)
            floor = bounds[knob][0]
            if knob == "pool_size":
                floor = self._pool_floor(knobs, bounds)
            elif knob in ("workers", "read_threads"):
                floor = max(floor, 1)
            if old <= floor:
                continue
            new = old
            while (
                new > floor
                and predicted_memory(b, {**knobs, knob: new}, batch_size) > budget.memory_bytes
            ):
                new -= 1
            mib = 2**20
            detail = (
                f"predicted memory {now / mib:.0f} MiB over the budget {budget.memory_bytes / mib:.0f} "
                f"MiB (sample {b.sample_bytes / mib:.1f} MiB, batch {batch_size:.1f}, "
                f"worker private {b.extra.get(WORKER_RSS_KEY, 0.0) / mib:.0f} MiB in total)"
            )
            return Decision(knob, old, new, "memory_pressure", detail)
        return None

    def core_budget(self, budget: Budget) -> CoreBudget:
        """The :class:`~autominato.telemetry.cores.CoreBudget` this rule applies (the Data
        Monitor's suggestions use the same)."""
        return CoreBudget(budget.cores, self.cpu_busy, self.cpu_saturated)

    def _cores(self, w, bounds, budget, state, b):
        old = w.knobs.get("workers", 0)
        if not self.core_budget(budget).over(old, w.cpu_cores):
            return None
        new = max(bounds["workers"][0], budget.cores)
        return (Decision("workers", old, new, "core_budget"), False) if new < old else None

    def _fits(self, knob: str, new: int, w: Window, budget: Budget, b: LoaderSnapshot) -> bool:
        if budget.memory_bytes is None:
            return True
        return predicted_memory(b, {**w.knobs, knob: new}, w.batch_size) <= budget.memory_bytes

    def _grow(self, w, bounds, budget, state, b):
        if w.batches < self.min_batches:
            return None
        # Above idle_high by more than the window's noise: windows are picked for their
        # high idle, so a noisy steady workload would otherwise trigger by chance.
        excess = w.idle - self.idle_high
        if excess <= 0 or excess <= self.z_trigger * w.idle_sd / math.sqrt(max(1, w.intervals)):
            return None
        if w.memory_wait >= self.memory_wait_high:
            # The samples wait for memory (memory-aware dispatch's budget), not for a knob:
            # more workers would wait too, each process holding its own memory (trial 131:
            # a third worker beside outliers), and a larger pool or deeper prefetch holds
            # more samples and batches in the memory they wait for.
            return None
        saturated = sorted(
            (
                (w.util[stage], stage, knob)
                for stage, knob in STAGE_KNOBS
                if stage in w.util and w.util[stage] >= self.util_saturated
            ),
            reverse=True,
        )
        for _, stage, knob in saturated:
            old = w.knobs[knob]
            if old == 0:
                continue  # inline transforms run in the read threads, which the read stage shows
            need = w.service_s[stage] * w.demand * self.headroom
            new = min(max(old + 1, math.ceil(need) if math.isfinite(need) else old + 1), 2 * old)
            if knob == "workers":
                new = min(new, self.core_budget(budget).worker_cap(old, w.cpu_cores))
            new = min(new, bounds[knob][1])
            while True:  # the largest step the memory budget allows, with the pool it needs
                with_it = self._pool_for(knob, old, new, w, bounds)
                grown = {**w.knobs, knob: new, **{c.knob: c.new for c in with_it}}
                fits = (budget.memory_bytes is None
                        or predicted_memory(b, grown, w.batch_size) <= budget.memory_bytes)
                if fits or new <= old + 1:
                    break
                new -= 1
            if self._allowed(knob, new, old, bounds, state, b) and fits:
                reason = "transform_bound" if stage == "transform" else "read_bound"
                return Decision(knob, old, new, reason), True, with_it
        if saturated:
            # The bottleneck is at its limit (cores, bounds, memory or backoff): a deeper
            # queue or a bigger pool would not raise a saturated stage's throughput.
            return None
        pool = w.knobs.get("pool_size", 0)
        if pool > 0 and w.in_flight_max >= self.pool_fill * pool:
            new = min(bounds["pool_size"][1], max(pool + 1, math.ceil(pool * 1.5)))
            if self._allowed("pool_size", new, pool, bounds, state, b) and self._fits(
                "pool_size", new, w, budget, b
            ):
                return Decision("pool_size", pool, new, "pool_bound"), True
        depth = w.knobs.get("depth", 0)
        new = min(bounds["depth"][1], depth + 1)
        if self._allowed("depth", new, depth, bounds, state, b) and self._fits(
            "depth", new, w, budget, b
        ):
            return Decision("depth", depth, new, "starved"), True
        return None

    @staticmethod
    def _pool_for(knob: str, old: int, new: int, w: Window, bounds: Bounds) -> list[Decision]:
        """The pool's growth that goes with ``knob``'s from ``old`` to ``new`` workers (or
        read threads): none, or the workers added where they would pass the pool. Each
        worker and read thread needs a sample in flight (``pool_size`` of them), so one added
        past the pool idles (trial 159: 8 workers beside a pool of 7); the pool keeps its
        slack beyond them. Applied before the workers' change and not judged apart from it
        (growing the pool alone does not raise a saturated stage's throughput), and reverted
        with them."""
        pool = w.knobs.get("pool_size", 0)
        others = sum(w.knobs.get(k, 0) for _, k in STAGE_KNOBS if k != knob)
        if pool <= 0 or new + others <= pool:
            return []
        grown = min(bounds["pool_size"][1], pool + new - old)
        if grown <= pool:
            return []
        return [Decision("pool_size", pool, grown, "pool_bound",
                         f"with {knob} {old} -> {new}: a sample in flight for each")]

    def _shrink(self, w, bounds, budget, state, b):
        if w.idle >= self.idle_low or w.batches < self.shrink_batches:
            return None
        for stage, knob in STAGE_KNOBS:
            old = w.knobs.get(knob, 0)
            if stage not in w.util or old <= max(1, bounds[knob][0]):
                continue
            busy = w.util[stage] * old  # mean busy workers
            if busy / (old - 1) >= self.util_shrink:
                continue
            new = max(bounds[knob][0], 1, math.ceil(busy / self.util_shrink), (old + 1) // 2)
            if self._allowed(knob, new, old, bounds, state, b):
                # The pool gives back a sample in flight for each worker removed (as it grew
                # with them, _pool_for), down to its floor, keeping its slack beyond them.
                pool = w.knobs.get("pool_size", 0)
                floor = self._pool_floor({**w.knobs, knob: new}, bounds)
                less = max(floor, pool - (old - new))
                with_it = ([Decision("pool_size", pool, less, "over_provisioned",
                                     f"with {knob} {old} -> {new}")]
                           if 0 < less < pool else [])
                return Decision(knob, old, new, "over_provisioned"), True, with_it
        pool = w.knobs.get("pool_size", 0)
        floor = self._pool_floor(w.knobs, bounds)
        if pool > floor and 0 < w.in_flight_max <= pool // 2:
            new = max(floor, 2 * w.in_flight_max, pool // 2)
            if new < pool and self._allowed("pool_size", new, pool, bounds, state, b):
                return Decision("pool_size", pool, new, "over_provisioned"), True
        return None
