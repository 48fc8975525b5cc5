"""The Data Monitor: a periodic table of the pipeline's figures and a bottleneck diagnosis.

:func:`diagnose` is a pure function of a list of :class:`LoaderSnapshot` (oldest first), so it
is tested on synthetic histories; :func:`format_report` renders its result as a text table;
:class:`DataMonitor` is the thin thread that takes a snapshot every ``interval`` seconds and
logs the report through the ``autominato.monitor`` logger (MegEngine's ``MGE_DATA_MONITOR``
is the model: per-stage times and which stage is the bottleneck).

How the bottleneck is found. Let ``T`` be the measured step time (seconds the training loop
spends between two ``next()`` calls, per batch). A stage keeps the consumer fed when its work
per batch, spread over its workers, fits in one step::

    load_s = mean_service_s * items_per_batch / workers        # seconds per batch
    share_s = load_s / T                                       # < 1 keeps up

When the accelerator idle share (consumer wait / (wait + step)) is at or below
``idle_threshold`` the loader keeps up and the run is **consumer bound**; the waits for the
first batch of passes that started cold (workers starting, ``worker_init_fn``, an epoch not
prefetched: ``cold_start_wait_seconds_total``) are left out of the share that decides it, so
that a slow start is not read as the pipeline's pace. Otherwise the stage
with the largest share is the bottleneck if that share is at least :data:`SATURATED`: the read
stage means **I/O bound**, the transform stage **CPU bound**, the batch stage (``collate_fn``,
one thread of the training process) **collate bound**, the transfer stage **transfer bound**. When one set of workers reads and transforms (a fused read, the default,
or ``workers=0``) their shares add up, and the pair is **CPU bound** unless the loader's
processes used less than :data:`~autominato.telemetry.cores.CPU_BUSY` of the cores, or of the
workers where they are fewer (then the
workers mostly wait: **I/O bound**); decompressing a ``.nii.gz`` in the read is CPU work. When
no stage is saturated yet the consumer still waits, the stages keep up on average but their
jitter is not absorbed: **synchronisation bound**, deepen the prefetch.

Worker counts that a suggestion names stop where the controller stops them
(:class:`~autominato.telemetry.cores.CoreBudget`, the one core budget of both).
"""

from __future__ import annotations

import io
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from autominato.pipeline.knobs import usable_cores, workers_bound
from autominato.pipeline.stats import RECENT, LoaderSnapshot, StageSnapshot
from autominato.telemetry.cores import (
    CPU_OF_WORKERS_KEY,
    CPU_SECONDS_KEY,
    CPU_TIME_SECONDS_KEY,
    CoreBudget,
    cpu_cores_used,
    kernel_share,
    loader_cpu_extra,
    reads_fused,
    transforms_inline,
)
from autominato.telemetry.process import ProcessMeter
from autominato.telemetry.window import Rates, between

LOGGER_NAME = "autominato.monitor"
logger = logging.getLogger(LOGGER_NAME)

#: A stage whose work per batch per worker takes at least this share of the step time is
#: saturated (a 10 % margin below 1.0, because service times jitter and the mean hides bursts).
SATURATED = 0.9
#: Status "warn" starts at this fraction of a threshold.
WARN_FRACTION = 0.8
#: Default accelerator idle share above which the loader is the bottleneck. A fixed floor:
#: below 10 % the remaining idle is usually start-up and epoch boundaries, not the pipeline.
IDLE_THRESHOLD = 0.10
#: Share of batches for which ``next()`` blocked above which prefetch is too shallow.
QUEUE_WAIT_THRESHOLD = 0.25
#: A ``next()`` that returns within this many seconds, or 2 % of the step, did not block:
#: a get from a non-empty queue takes microseconds.
BLOCKED_FLOOR_S = 0.001

#: bottleneck kind -> the heading printed in the report.
KINDS = {
    "io": "I/O bound",
    "cpu": "CPU bound",
    "transfer": "transfer bound",
    "collate": "collate bound",
    "sync": "synchronisation bound",
    "consumer": "consumer bound (the loader keeps up)",
    "none": "not enough data yet",
}


@dataclass(frozen=True)
class Row:
    """One line of the report table.

    ``current`` covers the latest window (the last two snapshots), ``mean`` everything since
    the loader started; ``threshold`` is the suggested limit in the same unit; ``status``
    is ``ok``, ``warn``, ``bad``, ``ref`` (a reference figure) or ``n/a`` (not measured).
    """

    metric: str
    unit: str
    current: float | None
    mean: float | None
    threshold: float | None
    status: str
    higher_is_worse: bool = True


@dataclass(frozen=True)
class NodeRow:
    """Remote transform workers on one Ray node over the report's window.

    ``samples`` finished there in the window; ``mib``: MiB of them moved through Ray's object
    store; ``service_ms`` / ``round_trip_ms``: mean per sample, on the actor and from sending
    to the result arriving (the difference is Ray's scheduling and the transfer), NaN without
    samples.
    """

    node: str
    workers: int
    samples: int
    mib: float
    service_ms: float
    round_trip_ms: float


def _node_rows(prev: LoaderSnapshot | None, last: LoaderSnapshot) -> tuple[NodeRow, ...]:
    before = {nd.node: nd for nd in prev.nodes} if prev is not None else {}
    rows = []
    for nd in last.nodes:
        b = before.get(nd.node)
        n = nd.items_total - (b.items_total if b else 0)
        service = nd.service_seconds_total - (b.service_seconds_total if b else 0.0)
        trip = nd.round_trip_seconds_total - (b.round_trip_seconds_total if b else 0.0)
        rows.append(NodeRow(
            nd.node, nd.workers, n, (nd.bytes_total - (b.bytes_total if b else 0)) / 2**20,
            service / n * 1e3 if n else math.nan, trip / n * 1e3 if n else math.nan))
    return tuple(rows)


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found.

    Attributes:
        kind: one of :data:`KINDS` (``io``, ``cpu``, ``transfer``, ``collate``, ``sync``,
            ``consumer``, ``none``).
        stage: the bottleneck stage (``read``, ``transform``, ``batch``, ``transfer``) or None.
        summary: one sentence of evidence with the figures.
        suggestion: a concrete change (a knob and a value where one applies).
        rows: the report table.
        step_time_s: measured step time over the latest window, seconds per batch.
        idle_ratio: accelerator idle share over the latest window, 0..1.
        shares: stage -> work per batch per worker as a share of the step (see module doc).
        window_s: length of the latest window, seconds; NaN when the diagnosis covers
            everything since the loader started (one snapshot, or no batch in the latest
            window).
        batches: batches delivered in that window.
        epoch: epoch of the latest snapshot.
        nodes: with Ray workers, the transform actors by node over the window.
        skipped, errors, lost: since the loader started, samples skipped
            (``on_error="skip"``), errors raised in the training loop after which the epoch
            went on, and the samples those errors cost (see ``LoaderSnapshot``).
        memory_held: since the loader started, samples that waited for memory-aware
            dispatch (``samples_held_for_memory_total``).
        memory_wait_s: over the diagnosis's window (since the start when ``window_s`` is
            NaN), seconds free workers idled for it, summed over workers (the growth of
            ``memory_wait_seconds_total``).
        memory_wait_share: ``memory_wait_s`` over the workers' time in the window (workers
            x window seconds), 0..1; NaN when the window's length is unknown.
    """

    kind: str
    stage: str | None
    summary: str
    suggestion: str
    rows: tuple[Row, ...]
    step_time_s: float
    idle_ratio: float
    shares: dict[str, float] = field(default_factory=dict)
    window_s: float = 0.0
    batches: int = 0
    epoch: int = 0
    nodes: tuple[NodeRow, ...] = ()
    skipped: int = 0
    errors: int = 0
    lost: int = 0
    memory_held: int = 0
    memory_wait_s: float = 0.0
    memory_wait_share: float = math.nan


def _memory_wait(prev: LoaderSnapshot | None, last: LoaderSnapshot) -> dict[str, float]:
    """``memory_wait_s`` and ``memory_wait_share`` of :class:`Diagnosis` between two
    snapshots (``prev=None``: since the start, share unknown)."""
    waited = last.memory_wait_seconds_total - (prev.memory_wait_seconds_total if prev else 0.0)
    worker_s = last.knobs.get("workers", 0) * (last.time - prev.time) if prev else 0.0
    return {"memory_wait_s": waited,
            "memory_wait_share": waited / worker_s if worker_s > 0 else math.nan}


def _items_per_batch(snap: LoaderSnapshot, stage: StageSnapshot) -> float:
    # Per delivered batch, as the controller counts it (Rates.samples_per_batch): a sample
    # stage does a batch's samples, a batch stage one batch. The stages' own counts run
    # ahead of delivery (the pool, the prefetched batches, the next epoch's speculative
    # start), which in a short run would count that lead's work against each batch.
    if stage.name not in ("read", "transform"):
        return 1.0
    if snap.batches_total <= 0 or snap.samples_total <= 0:
        return 1.0
    return snap.samples_total / snap.batches_total


def _effective_workers(snap: LoaderSnapshot, name: str) -> int:
    stage = snap.stages[name]
    if stage.workers > 0:
        return stage.workers
    # A stage reporting no workers of its own runs on the other's: a fused read runs in the
    # transform workers, an inline transform (workers=0) in the read threads.
    other = {"read": "transform", "transform": "read"}.get(name)
    if other in snap.stages:
        return max(1, snap.stages[other].workers)
    return 1


def _fused(snap: LoaderSnapshot) -> bool:
    """Read and transform share one set of workers (fused read, or workers=0 inline)."""
    return reads_fused(snap) or transforms_inline(snap)


def _shares(w: Rates, snap: LoaderSnapshot, step_s: float) -> dict[str, float]:
    """Stage -> mean service x items per batch / workers / step, for stages with items."""
    step = max(step_s, 1e-6)
    out = {}
    for name, stage in snap.stages.items():
        if name == "consumer":
            continue
        mean = w.stages[name].mean_service_s
        if mean is None:
            continue
        load = mean * _items_per_batch(snap, stage) / _effective_workers(snap, name)
        out[name] = load / step
    if w.h2d_s > 0 and w.batches > 0:
        # With CUDA the copy time is the transfer stage's real cost (events on the copy stream).
        out["transfer"] = max(out.get("transfer", 0.0), w.h2d_s / w.batches / step)
    return out


def _blocked_share(snap: LoaderSnapshot, batches: int | None, step_s: float) -> float | None:
    # batches=None: every recent batch kept (the running mean, over up to RECENT batches).
    empty = snap.consumer_empty_recent
    if empty and len(empty) >= min(snap.batches_total, RECENT):
        # Whether each next() found no batch ready, as the loader saw it: a next() that found
        # one ready but took over a millisecond to hand it over (median 0.3-0.8 ms, 90th
        # percentile 1.8 ms beside the loader's threads on 2 cores; the DataLoader's median
        # 1.7-3.0 ms) did not wait on the queue, and deeper prefetch would not shorten it
        # (trial 180: 23-31 % "bad" at 1 % idle).
        if batches:
            empty = empty[-batches:]
        return sum(empty) / len(empty)
    # Rebuilt from the exported metrics (no flags): the waits above a floor.
    waits = snap.consumer_wait_recent_s
    if batches:
        waits = waits[-batches:]
    if not waits:
        return None
    floor = max(BLOCKED_FLOOR_S, 0.02 * step_s)
    return sum(1 for x in waits if x > floor) / len(waits)


def _status(value: float | None, threshold: float | None, higher_is_worse: bool = True) -> str:
    if value is None or threshold is None or not math.isfinite(threshold):
        return "n/a"
    if higher_is_worse:
        if value > threshold:
            return "bad"
        return "warn" if value >= WARN_FRACTION * threshold else "ok"
    if value < threshold:
        return "bad"
    return "warn" if value * WARN_FRACTION <= threshold else "ok"


def _row(
    metric: str,
    unit: str,
    current: float | None,
    mean: float | None,
    threshold: float | None,
    higher_is_worse: bool = True,
) -> Row:
    status = _status(current, threshold, higher_is_worse)
    return Row(metric, unit, current, mean, threshold, status, higher_is_worse)


def _ms_rows(cur: Rates, run: Rates, last: LoaderSnapshot) -> list[Row]:
    """Per-stage times as MegEngine's monitor shows them: transform (per sample), collate,
    host-to-device copy and queue wait (per batch), seconds. The load time per sample is the
    ``load latency`` row, with its threshold (:func:`diagnose`), not a second row here."""
    rows = []
    for name, label, unit in (
        ("transform", "transform time", "s/sample"),
        ("batch", "collate time", "s/batch"),
    ):
        if name in last.stages:
            c = cur.stages[name].mean_service_s if cur.batches else None
            rows.append(Row(label, unit, c, run.stages[name].mean_service_s, None, "ref"))
    if run.h2d_s > 0:
        c = cur.h2d_s / cur.batches if cur.batches and cur.h2d_s > 0 else None
        rows.append(Row("H2D copy time", "s/batch", c, run.h2d_s / max(run.batches, 1), None, "ref"))
    rows.append(Row("queue wait", "s/batch", cur.wait_per_batch_s if cur.batches else None,
                    run.wait_per_batch_s, None, "ref"))
    return rows


def diagnose(
    history: Sequence[LoaderSnapshot],
    *,
    idle_threshold: float = IDLE_THRESHOLD,
    queue_wait_threshold: float = QUEUE_WAIT_THRESHOLD,
    budget: CoreBudget | None = None,
) -> Diagnosis:
    """Find the pipeline's bottleneck from snapshots taken over time (oldest first).

    The latest window is ``history[-2] -> history[-1]`` (since the loader started when there
    is one snapshot); the running mean covers everything since the loader started (snapshot
    counters are cumulative). See the module docstring for the rule.

    Args:
        history: at least one :class:`LoaderSnapshot` of one loader, oldest first; only the
            last two are read (callers may pass a longer history).
        idle_threshold: accelerator idle share (0..1) at or below which the loader keeps up.
        queue_wait_threshold: share (0..1) of batches that found no batch ready, above which
            the report flags the queue wait.
        budget: the core budget of the suggestions; default ``CoreBudget(usable_cores())``,
            the controller's default. CPU use is read from the snapshots' ``extra``
            (:data:`~autominato.telemetry.cores.CPU_SECONDS_KEY`) when they carry it.

    Returns:
        A :class:`Diagnosis`; ``kind == "none"`` when no batch was delivered in the window.

    Raises:
        ValueError: ``history`` is empty.
    """
    if not history:
        raise ValueError("diagnose() needs at least one LoaderSnapshot")
    last = history[-1]
    cur = between(history[-2] if len(history) > 1 else None, last)
    run = between(None, last)
    # An empty latest window (a report right after another) is judged on the whole history.
    basis = cur if cur.batches else run
    # The step time is the reference every other threshold is derived from.
    step = basis.step_s
    shares = _shares(basis, last, step)
    run_shares = _shares(run, last, run.step_s)
    rows: list[Row] = [
        Row("step time", "s/batch", cur.step_s if cur.batches else None, run.step_s, None, "ref")
    ]
    rows += _ms_rows(cur, run, last)
    budget = budget or CoreBudget(usable_cores())
    first = history[0] if len(history) > 1 else None
    # CPU over the latest window, else over the history kept.
    cpu = cpu_cores_used(history[-2], last) if len(history) > 1 else None
    ran = cpu_cores_used(history[-2], last, CPU_TIME_SECONDS_KEY) if len(history) > 1 else None
    since = history[-2] if len(history) > 1 else None
    if cpu is None and first is not None:
        cpu = cpu_cores_used(first, last)
        ran = cpu_cores_used(first, last, CPU_TIME_SECONDS_KEY)
        since = first
    fused = _fused(last)
    # One set of workers does both read and transform when fused, so their shares add up on
    # those workers, and the sum competes with the other stages (the table's
    # "read+transform share" row): read 0.6 + transform 0.6 is a saturated pair even beside
    # a collate share of 0.7.
    candidates = dict(shares)
    pair = [n for n in ("read", "transform") if n in shares]
    if fused and pair:
        lead = max(pair, key=shares.__getitem__)
        for n in pair:
            del candidates[n]
        candidates[lead] = sum(shares[n] for n in pair)
    if since is not None and cpu is not None:
        # Over the time the training loop did not wait for a cold pass's start: the workers
        # spent that in worker_init_fn or starting, not on the samples (trial 199: a CPU-bound
        # transform after a 4 s worker_init_fn read 0.73 of 2 cores, "I/O bound (transform)",
        # the verdict's idle having left that wait out). Only the part of each cold wait
        # beyond what its first batch takes the stages to make: in a loop of short passes
        # that part is the samples' (review 200: a transform that sleeps read 1.6 cores).
        per_batch = step * max(candidates.values(), default=0.0)
        cpu, ran = (c / _uncold_share(since, last, per_batch) if c is not None else None
                    for c in (cpu, ran))

    read = last.stages.get("read")
    read_threshold = None
    if read is not None:
        read_threshold = step * _effective_workers(last, "read") / _items_per_batch(last, read)
        lat, lat_mean = cur.stages["read"].mean_service_s, run.stages["read"].mean_service_s
        rows.append(_row("load latency", "s/sample", lat, lat_mean, read_threshold))
        if read.cpu_seconds_total is not None:
            # (a read stage of its own, in threads of this process: its CPU share)
            rows.append(Row("read CPU demand", "of time",
                            cur.stages["read"].cpu_share if cur.batches else None,
                            run.stages["read"].cpu_share, None, "ref"))
        # Stragglers (a heavy tail of slow samples) hide in the means: the slowest of the
        # window's samples, read and transformed (the last stats.RECENT of them at most:
        # the ring of recent times; review 110: the whole ring showed samples of earlier
        # windows), where the work may be in dataset[i] or in the transform.
        for name in ("read", "transform"):
            st = last.stages.get(name)
            if st is None or not st.recent_service_s:
                continue
            n = cur.stages[name].items if name in cur.stages else 0
            rows.append(Row(f"slowest {name}", "s/sample",
                            max(st.recent_service_s[-n:]) if n > 0 else None,
                            None, None, "ref"))
    if fused and ("read" in shares or "read" in run_shares):
        # One set of workers reads and transforms: the share that counts is their sum.
        def both(d: dict[str, float]) -> float | None:
            got = [d[n] for n in ("read", "transform") if n in d]
            return sum(got) if got else None

        rows.append(_row("read+transform share", "of step", both(shares), both(run_shares), 1.0))
        rows.append(_row("collate share", "of step", shares.get("batch"),
                         run_shares.get("batch"), 1.0))
    else:
        for name, label in (("transform", "transform share"), ("batch", "collate share")):
            if name in last.stages:
                rows.append(_row(label, "of step", shares.get(name), run_shares.get(name), 1.0))

    bw, bw_mean = basis.h2d_bytes_per_s, run.h2d_bytes_per_s
    need_bw = (basis.h2d_bytes / basis.batches) / max(step, 1e-6) if basis.batches and bw else None
    rows.append(_row("H2D bandwidth", "bytes/s", bw, bw_mean, need_bw, higher_is_worse=False))

    blocked = _blocked_share(last, basis.batches, step)
    blocked_mean = _blocked_share(last, None, run.step_s)
    rows.append(_row("queue wait share", "of batches", blocked, blocked_mean, queue_wait_threshold))
    if cpu is not None:
        rows.append(Row("loader CPU demand", "cores", cpu, None, float(budget.cores), "ref"))
    kernel = kernel_share(since, last) if since is not None else None
    if kernel is not None:
        rows.append(Row("workers' kernel time", "of CPU", kernel, None, None, "ref"))
    idle = basis.idle_ratio
    rows.append(_row("accelerator idle", "of time", idle, run.idle_ratio, idle_threshold))
    # The waits for the first batch of passes that started cold (workers starting,
    # worker_init_fn, an epoch not prefetched) are no measure of the pipeline's pace: the
    # verdict reads the idle without them (trial 197: a 1.5 s worker_init_fn, then one batch
    # of 69 waited, was "synchronisation bound: deeper prefetch", which changed nothing).
    cold_s = basis.cold_wait_s
    if cold_s > 0 or run.cold_wait_s > 0:
        rows.append(Row("cold-start wait", "of time", basis.cold_wait_ratio,
                        run.cold_wait_ratio, None, "ref"))
    steady = basis.steady_idle_ratio

    base = dict(
        rows=tuple(rows),
        step_time_s=step,
        idle_ratio=idle,
        shares=shares,
        window_s=basis.seconds,
        batches=basis.batches,
        epoch=last.epoch,
        nodes=_node_rows(history[-2] if len(history) > 1 and cur.batches else None, last),
        skipped=last.skipped_total,
        errors=last.errors_raised_total,
        lost=last.samples_lost_total,
        memory_held=last.samples_held_for_memory_total,
        **_memory_wait(history[-2] if len(history) > 1 and cur.batches else None, last),
    )
    if basis.batches == 0:
        return Diagnosis(
            "none", None, "no batch delivered yet", "wait for the first batches", **base
        )
    knobs = last.knobs
    stage = max(candidates, key=candidates.__getitem__) if candidates else None
    top = candidates.get(stage, 0.0) if stage else 0.0
    # The idle over the threshold was the cold passes' first batches, and every stage keeps
    # up: the pipeline's pace is the step's. Not where a stage is saturated: passes all
    # short (a loop of next(iter(loader))) are all cold starts, and a pipeline 1496x too
    # slow read "keeps up" (review 198).
    cold_only = idle > idle_threshold and steady <= idle_threshold and top < SATURATED
    if idle <= idle_threshold or cold_only:
        # "Fewer workers" is about the stage the workers knob drives (read+transform when
        # fused, else the transform): one fewer must keep it below saturation.
        n = knobs.get("workers", 0)
        load = (sum(shares[m] for m in pair) if fused and pair and n > 0
                else shares.get("transform", 0.0) if n > 0 else 0.0)
        name = "read+transform" if fused and pair else "transform"
        if n > 1 and load * n / (n - 1) < SATURATED:
            advice = ("nothing to change on the loader; if CPU is short, fewer workers would "
                      f"do ({name} needs {load:.2f} of each step with {n} workers, "
                      f"{load * n / (n - 1):.2f} with {n - 1})")
        elif n > 1:
            advice = (f"nothing to change on the loader; {name} needs {load:.2f} of each step "
                      f"with {n} workers, so fewer would make it the bottleneck")
        elif n == 1:  # (trial 182: "fewer would make it the bottleneck" of 1 worker at 0.00)
            advice = (f"nothing to change on the loader ({name} needs {load:.2f} of each step "
                      "with its one worker)")
        else:
            advice = "nothing to change on the loader"
        summary = (f"the training loop waited {idle:.0%} of the time (<= {idle_threshold:.0%}); "
                   f"its step of {step * 1e3:.1f} ms is the pace")
        if cold_only:
            summary, advice = _cold_verdict(basis, idle, steady, idle_threshold, step, advice,
                                            last)
        return Diagnosis("consumer", None, summary, advice, **base)
    if stage in ("read", "transform") and fused:
        if top >= SATURATED:
            # Which work fills them is told by the CPU they use: a read that decompresses
            # is CPU work; only workers that mostly wait make the pair I/O bound.
            stage = "read" if budget.io_like(cpu, knobs.get("workers")) else "transform"
    if stage is not None and top >= SATURATED:
        kind, stage, summary, suggestion = _bottleneck(
            stage, top, last, basis, step, read_threshold, knobs, budget, cpu, fused, ran,
            kernel,
        )
        return Diagnosis(kind, stage, summary, suggestion, **base)
    depth = knobs.get("depth", 0)
    waited = f" on {blocked:.0%} of batches" if blocked is not None else ""
    cold = (f" ({steady:.0%} without the waits for cold starts' first batches, "
            f"{cold_s:.2f} s)" if cold_s > 0 else "")
    return Diagnosis(
        "sync",
        None,
        f"idle {idle:.0%}{cold} although every stage keeps up on average (largest share "
        f"{top:.2f} of the step, {stage or '-'}): next() blocked{waited}",
        f"deeper prefetch to absorb the jitter: depth {depth} -> {max(2, 2 * depth)}, "
        f"and pool_size {knobs.get('pool_size', 0)} -> {2 * knobs.get('pool_size', 0)} "
        "so that more samples are in flight",
        **base,
    )


def _uncold_share(a: LoaderSnapshot, b: LoaderSnapshot, per_batch_s: float = 0.0) -> float:
    """The share of the window from ``a`` to ``b`` that the training loop did not spend
    waiting for a cold pass to start: its waits for cold passes' first batches
    (``cold_start_wait_seconds_total``) less ``per_batch_s`` (what the stages take to make
    a batch, seconds) for each cold pass that began in it, at least a tenth; 1.0 for no such
    wait or a window of no length."""
    seconds = b.time - a.time
    cold = b.cold_start_wait_seconds_total - a.cold_start_wait_seconds_total
    starts = max(0, b.cold_starts_total - a.cold_starts_total)
    cold -= starts * max(0.0, per_batch_s)
    if seconds <= 0 or cold <= 0:
        return 1.0
    return max(0.1, 1.0 - cold / seconds)


def _cold_verdict(basis: Rates, idle: float, steady: float, threshold: float, step: float,
                  advice: str, last: LoaderSnapshot) -> tuple[str, str]:
    """The consumer-bound verdict's summary and advice where the idle over the threshold is
    the wait for cold passes' first batches (``Rates.cold_wait_s``): the pipeline keeps up
    between them."""
    n = basis.cold_starts
    starts = (f"{n} pass{'es' if n != 1 else ''} that started cold" if n > 0
              else "a pass that started cold")
    summary = (f"the training loop waited {idle:.0%} of the time, {basis.cold_wait_s:.2f} s of "
               f"it for the first batch of {starts} (workers starting, worker_init_fn, an "
               f"epoch not prefetched); without those waits {steady:.0%} (<= {threshold:.0%}): "
               f"its step of {step * 1e3:.1f} ms is the pace")
    # Most passes cold, not one left early or resumed among many (review 198): at least half
    # the epochs so far, or three in a window (a loop that set its epoch far ahead).
    every = last.cold_starts_total >= 2 and (
        2 * last.cold_starts_total >= last.epoch + 1
        or (math.isfinite(basis.seconds) and basis.cold_starts >= 3))
    if every and last.iterable:
        # (trial 199: the advice below named the defaults, which an iterable dataset had)
        advice = (f"{advice}; each epoch starts cold ({last.cold_starts_total} cold starts so "
                  "far): an IterableDataset's workers begin each pass anew (no epoch of it is "
                  "prefetched), so set-up done in __iter__ (opening files, loading an index) "
                  "is paid every epoch: do it once, in __init__ or worker_init_fn, with "
                  "persistent_workers=True (the default; without it both run again each "
                  "epoch)")
    elif every:
        # (every epoch cold: persistent_workers=False, prefetch_next_epoch=False, or one of
        # the passes the loader cannot prefetch, docs/controller.md)
        advice = (f"{advice}; each epoch starts cold ({last.cold_starts_total} cold starts so "
                  "far): persistent_workers=True with prefetch_next_epoch=True (the defaults) "
                  "start an epoch's samples while the one before ends, where the sampler "
                  "allows (docs/controller.md lists the passes that start cold)")
    return summary, advice


#: A read stage of its own (threads of the training process) whose threads ran on a CPU, or
#: waited for a core, for at least this share of its service time decodes more than it
#: waits: the read is CPU work (a read that waits on storage or sleeps runs on a CPU for a
#: few percent of it: 0.6 % for a 20 ms sleep, 94 % for a zlib decompression; the run-queue
#: wait counts, or a decoding read on a busy machine read 26 %: review 172) ...
READ_CPU_SHARE = 0.5
#: ... or whose threads together ran on, or waited for, at least this many cores: about what
#: one process's GIL lets Python code run on, so more read threads add nothing (two threads of a Python
#: loop ran on a CPU for 53 % of their reads' time, one core in all; sixteen threads that
#: wait on storage for 94 % of theirs would read alike: the read is at the ceiling of the
#: threads either way).
READ_CPU_CORES = 0.75

#: The most a suggestion multiplies a reader count by before it puts storage first.
MAX_SCALE = 4


def _cores_used(cpu: float | None, budget: CoreBudget, snap: LoaderSnapshot) -> str:
    """The diagnosis's clause on the workers' CPU demand, or nothing when unknown. Without
    worker processes (thread workers) the figure is the training process's: its worker
    threads', its read threads' and its training loop's (trial 168: it read "the workers"), as
    it is before a process loader's workers are seen."""
    if cpu is None:
        return ""
    who = "the training process" if snap.extra.get(CPU_OF_WORKERS_KEY) == 0.0 else "the workers"
    return f"; {who} ran on or waited for {cpu:.2f} of {budget.cores} cores"


def _no_more_workers(budget: CoreBudget) -> str:
    where = "the Ray cluster's free CPUs" if budget.placed else "usable cores"
    return f"no more workers fit: {budget.cores} {where}, one a worker"


def _beyond_controller(knob: str, current: int, target: int, snap: LoaderSnapshot) -> str:
    """Where more workers are advised than the online controller may set, how to get them
    (trial 180: "workers 8 -> 32" advised to a loader whose controller stopped at 8)."""
    bound = snap.workers_bound  # (0: no controller runs)
    if knob != "workers" or not bound or not current <= bound < target:
        return ""
    default = ("4 a usable core, at least 8" if bound == workers_bound(usable_cores())
               else "a configuration's bounds, or workers= given above the default")
    return (f" (num_workers={target} given to the Loader: its online controller goes no "
            f"higher than {bound} by itself: {default})")


def _needed(current: int, share: float) -> int:
    # Scale the worker count so the stage's share would land at 80 % of the step.
    return max(current + 1, math.ceil(current * share / WARN_FRACTION))


#: The memory-aware dispatch line is printed when free workers idled this long for it in the
#: report's window (summed over workers), seconds.
MEMORY_WAIT_REPORTED_S = 0.1
#: Its hint (``memory_aware=False``) needs that wait to be this share of the workers' time
#: (and the accelerator idle past :data:`IDLE_THRESHOLD`, the loader the bottleneck): below,
#: turning it off gains nothing felt ...
MEMORY_WAIT_HINT_SHARE = 0.02
#: ... or, when the window's length is unknown (since the start), this many seconds.
MEMORY_WAIT_HINT_S = 1.0

#: Appended to a suggestion of more workers while memory-aware dispatch holds samples.
_MORE_WORKERS_MEMORY = (" (memory-aware dispatch holds samples back: more workers raise its "
                        "budget, workers x the upper quartile's figure, and the peak memory)")


def _bottleneck(
    stage: str,
    share: float,
    last: LoaderSnapshot,
    cur: Rates,
    step: float,
    read_threshold: float | None,
    knobs: dict[str, int],
    budget: CoreBudget,
    cpu: float | None,
    fused: bool,
    ran: float | None = None,
    kernel: float | None = None,
) -> tuple[str, str, str, str]:
    """``cpu``: cores the workers ran on or waited for; ``ran``: those they ran on;
    ``kernel``: the share of that the worker processes spent in the kernel."""
    workers = _effective_workers(last, stage)
    used = _cores_used(cpu, budget, last)
    if transforms_inline(last) and stage in ("read", "transform"):
        # num_workers=0: the training loop's thread loads each sample, one after another; no
        # read thread or knob can change that (trial 146: "read_threads 2 -> 8" was advised,
        # which changes nothing there).
        parts = {s: cur.stages[s].mean_service_s or 0.0 for s in ("read", "transform")
                 if s in cur.stages}
        lat = sum(parts.values())
        stage = max(parts, key=parts.get) if parts else stage  # (the larger part)
        need = min(budget.cores, _needed(1, share))
        return (
            "cpu" if stage == "transform" else "io", stage,
            f"loading takes {share:.2f}x the {step * 1e3:.1f} ms step: {lat * 1e3:.1f} ms a "
            "sample, read and transformed in the training loop's thread (num_workers=0)",
            f"worker processes to load samples in parallel while the loop steps: build the "
            f"Loader with num_workers={need} (or more, where the samples wait on storage)",
        )
    fused = fused and not transforms_inline(last)  # the transform workers read
    if stage == "read" and fused and "transform" in cur.stages:
        lat = cur.stages["read"].mean_service_s or 0.0
        tf = cur.stages["transform"].mean_service_s or 0.0
        if tf > lat:
            # Workers that wait, and mostly in the transform (trial 111: a transform that
            # slept was blamed on a 0.0 ms read, with faster storage as the fix).
            n = knobs.get("workers", _effective_workers(last, "transform"))
            need = min(_needed(max(n, 1), share), max(n, budget.worker_cap(n, cpu)))
            more = (f"more workers to overlap the waits (workers {n} -> {need}"
                    f"{_beyond_controller('workers', n, need, last)})" if need > n
                    else f"more CPUs ({_no_more_workers(budget)})")
            return (
                "io", "transform",
                f"reads and transforms (in the same workers) take {share:.2f}x the "
                f"{step * 1e3:.1f} ms step, per worker, mostly waiting in the transform: "
                f"{tf * 1e3:.1f} ms a sample against the read's {lat * 1e3:.1f} ms{used}",
                f"{more}, or take the wait out of the transform (file or network access, sleeps, "
                + ("locks)" if last.iterable else
                   "locks: read in dataset[i], where read_threads or fuse_read=False can "
                   "overlap it)"),
            )
    cpu_share = cur.stages["read"].cpu_share if stage == "read" and not fused else None
    rd = cur.stages.get("read")
    # (cores asked for: ran on or waited for; on a busy machine GIL-bound threads wait in
    # the run queue too, and their CPU time alone read as waiting on storage: review 174)
    cores = ((rd.cpu_s + (rd.runqueue_s or 0.0)) / rd.seconds
             if cpu_share is not None and rd is not None and rd.cpu_s is not None
             and rd.seconds > 0 else None)
    if cpu_share is not None and (cpu_share >= READ_CPU_SHARE
                                  or (cores is not None and cores >= READ_CPU_CORES)):
        # A read stage of its own runs in threads of the training process: a read that
        # decodes there is CPU work, which faster storage does not shorten and more read
        # threads shorten only where the decoding lets go of the GIL (trial 168: such reads
        # were "I/O bound ... faster storage", the CPU figure counting worker processes only).
        lat = rd.mean_service_s or 0.0
        n = knobs.get("read_threads", workers)
        ran = f", {cores:.2f} cores in all" if cores is not None else ""
        if cpu_share >= READ_CPU_SHARE:
            why = "decoding, not waiting on storage"
        else:  # (the threads' ceiling: see READ_CPU_CORES)
            why = ("about what the training process's GIL lets its threads run Python on: "
                   "more read threads add nothing")
        kind = last.worker_kind or ("ray" if last.nodes else "")
        if kind == "thread":
            move = ("worker_kind='process' (the default, with fuse_read=True, its default): "
                    "each worker process reads on a core of its own")
        elif kind in ("process", "ray"):
            who = "Ray worker" if kind == "ray" else "worker process"
            move = f"fuse_read=True (the default): each {who} reads on a core of its own"
        else:  # (a snapshot rebuilt from the exported metrics: the kind is not exported)
            move = ("fuse_read=True (the default) with process or Ray workers, "
                    "worker_kind='process' in place of thread workers")
        return (
            "cpu", "read",
            f"reading takes {share:.2f}x the {step * 1e3:.1f} ms step per read thread, "
            f"the read {lat * 1e3:.1f} ms a sample, {cpu_share:.0%} of it on or waiting for "
            f"a CPU in the training process's {n} read thread(s){ran}: {why}{used}",
            f"read in the workers: {move}; or a cheaper read (samples stored uncompressed, "
            ".npy in place of .nii.gz, or preprocessed once); more read_threads help only "
            "where the decoding releases the GIL (zlib, NumPy, PIL do; Python loops do not)",
        )
    if stage == "read":
        lat = cur.stages["read"].mean_service_s or 0.0
        storage = "faster storage (local NVMe, page cache, samples preprocessed to .npy)"
        knob = "workers" if fused else "read_threads"
        n = knobs.get(knob, workers)
        need = wanted = _needed(n, share)
        if knob == "workers":
            need = min(need, max(n, budget.worker_cap(n, cpu)))
        if need > MAX_SCALE * n:
            # More readers than a few times the current count rarely scale on one disk or
            # network share: the storage is the fix, more readers only a stopgap. (The
            # count the step needs, not the core budget's cap of it: trial 182 read "74
            # readers" where the share called for 129.)
            advice = (
                f"{storage}: at this latency the step needs about {wanted} readers; meanwhile "
                f"{knob} {n} -> {MAX_SCALE * n}{_beyond_controller(knob, n, MAX_SCALE * n, last)}"
            )
        elif need <= n:  # (workers placed one a CPU, all placed: Ray's)
            advice = f"{storage}, or more CPUs: {_no_more_workers(budget)}"
        else:
            advice = (f"more readers ({knob} {n} -> {need}"
                      f"{_beyond_controller(knob, n, need, last)}), or {storage}")
        if fused and not last.iterable:  # (an iterable dataset's workers read as they go)
            advice += "; or a separate read stage in threads (fuse_read=False"
            advice += (", which turns memory-aware dispatch off: its reads are not measured)"
                       if last.samples_held_for_memory_total else ")")
        if knob == "workers":
            advice += _MORE_WORKERS_MEMORY if last.samples_held_for_memory_total else ""
        what = "reading and transforming" if fused else "reading"
        per = "worker" if fused else "read thread"
        return (
            "io", stage,
            f"{what} takes {share:.2f}x the {step * 1e3:.1f} ms step per {per}, the read "
            f"{lat * 1e3:.1f} ms per sample (limit {(read_threshold or 0) * 1e3:.1f} ms){used}",
            advice,
        )
    if stage == "batch":
        # One thread of the training process collates every batch (collate_fn): neither more
        # workers nor cheaper transforms shorten it (trial 145: that advice, and "no spare
        # cores" with no CPU figure, for a collate_fn that slept).
        lat = cur.stages["batch"].mean_service_s or 0.0
        return (
            "collate", stage,
            f"batch assembly (the collate, in one thread of the training process) takes "
            f"{share:.2f}x the {step * 1e3:.1f} ms step: {lat * 1e3:.1f} ms a batch{used}",
            "a collate_fn of your own: move its work per sample into the dataset or the "
            "transform (they run in the workers, in parallel), or make it cheaper (no "
            "per-sample Python work or waits: stack arrays); the default collate with "
            "pin_memory or a device copies each batch into pinned memory: fewer bytes per "
            "sample (float16, crops)",
        )
    if stage == "transform":
        n = knobs.get("workers", workers)
        cap = budget.worker_cap(n, cpu)
        where = "reads and transforms (in the same workers)" if fused else "transforms"
        more = (
            f"more workers (workers {n} -> {min(_needed(max(n, 1), share), cap)}, "
            f"{budget.cores} usable cores)"
            if n < cap
            else f"no spare cores ({budget.cores} usable)"
        )
        if n < cap and last.samples_held_for_memory_total:
            more += _MORE_WORKERS_MEMORY
        if (last.worker_kind == "thread" and cpu is not None
                and cpu < budget.cpu_saturated * budget.cores):
            # (trial 201: a Python transform in thread workers, 1.21 of 2 cores used, was
            # told "no spare cores"; the GIL, not the cores, held it)
            more = (f"worker_kind='process' (thread workers share the training process's "
                    f"GIL: Python work in them runs on about one core in all, here "
                    f"{cpu:.2f} of {budget.cores}), {more}")
        cheaper = ("cheaper transforms (crop before resampling, fewer random augmentations "
                   "per sample, float16 arrays)")
        read_s = cur.stages["read"].mean_service_s if fused and "read" in cur.stages else None
        transform_s = cur.stages[stage].mean_service_s or 0.0
        if read_s is not None and read_s > transform_s:
            # The workers' CPU goes to the read (decoding, decompressing: MONAI's LoadImage
            # of a .nii.gz, a __getitem__ that computes): the read is named, and its fix
            # (trial 159: 45.6 ms reads beside 0.2 ms transforms were "CPU bound (transform)").
            stage = "read"
            where = (f"reads and transforms (in the same workers: the read "
                     f"{read_s * 1e3:.1f} ms a sample, the transform {transform_s * 1e3:.1f} ms)")
            cheaper = ("a cheaper read (less decoding: samples stored uncompressed, .npy in "
                       "place of .nii.gz, or preprocessed once; less work in __getitem__, "
                       "where a dataset's own transforms run, MONAI's Dataset(transform=...) "
                       "among them: passed as Loader(transform=...) they are timed apart from "
                       "the read)")
        if (cpu is not None and ran is not None and ran < budget.cpu_busy * budget.cores
                and cpu - ran > ran):
            # The workers waited for a core more than they ran, on few of the cores: other
            # work holds them (trial 180: 32 workers sleeping in their reads beside a step
            # that spun on a core, "ran on or waited for 1.98 of 2 cores", 0.5 of it run,
            # were sent to "a cheaper read" of 0.09 ms of CPU).
            used += f" (ran on {ran:.2f}, waited runnable for {cpu - ran:.2f})"
            over = (f"; fewer workers: {n} take turns on {budget.cores} cores"
                    if n > budget.cores else "")
            return (
                "cpu", stage,
                f"{where} take {share:.2f}x the {step * 1e3:.1f} ms step, per worker{used}",
                "free cores for the workers: they waited for one more than they ran, so other "
                "work holds the cores (the training process: a step that spins on the CPU, "
                "such as a busy wait on the GPU, or its threads; other jobs on the machine)"
                f"{over}; a cheaper {stage} helps only as far as it needs the CPU it waits "
                "for",
            )
        return (
            "cpu", stage,
            f"{where} take {share:.2f}x the {step * 1e3:.1f} ms step, per worker{used}",
            f"{more}, or {cheaper}{_kernel_hint(kernel, last) if stage == 'transform' else ''}",
        )
    bw = cur.h2d_bytes_per_s
    got = f" at {bw / 1e9:.2f} GB/s" if bw else ""
    return (
        "transfer", stage,
        f"the host-to-device copy takes {share:.2f} of the {step * 1e3:.1f} ms step{got}",
        "pinned host memory (page-locked buffers copy 2-3x faster and asynchronously), "
        "larger batches to amortise each copy, or fewer bytes per sample (float16, crops)",
    )


#: Share of the worker processes' CPU time in the kernel from which a CPU-bound verdict adds
#: that ``memory_aware=False`` keeps their freed heaps warm (:func:`_kernel_hint`). A project
#: choice: on the KiTS19 bench the workers spent 45-51% of their CPU time in the kernel with
#: the defaults, most of it zeroing fresh pages, and the loader ran 1.16-1.31x faster with
#: their heaps kept (docs/memory.md, "Measured"); a transform that computes in Python or
#: numpy spends a few percent there.
KERNEL_HINT_SHARE = 0.3


def _kernel_hint(kernel: float | None, last: LoaderSnapshot) -> str:
    """The CPU-bound advice's note on the workers' kernel time (``kernel``: its share of
    their CPU time), where it is :data:`KERNEL_HINT_SHARE` or more and process workers give
    freed memory back between samples that ``memory_aware=False`` would keep
    (``LoaderSnapshot.memory_aware`` and ``warm_heap``: review 202, the note went to loaders
    with ``warm_heap=False`` or an allocator the environment tunes, where it changes
    nothing), once memory-aware dispatch has its figures (its budgeted warm heap decided);
    "" otherwise. Only for a verdict that names the transform: where the read takes the
    workers' time the kernel's part is likely the file reads (trial 201: 94% beside a
    warm heap of a whole sample, and memory_aware=False changed nothing)."""
    if (kernel is None or kernel < KERNEL_HINT_SHARE or last.worker_kind != "process"
            or not (last.memory_aware and last.warm_heap)):
        return ""
    if not last.iterable and reads_fused(last) and last.sample_memory_budget_bytes <= 0:
        # Memory-aware dispatch before its figures: the defaults' warm heap is not decided
        # yet (trial 201: 63% in the first report, 0-1% one window later)
        return ""
    return (f"; the workers spent {kernel:.0%} of their CPU time in the kernel: where that is "
            "the zeroing of fresh pages for each sample's arrays (memory given back between "
            "samples) rather than file reads, memory_aware=False keeps each worker's freed "
            "heap warm, faster at the cost of peak memory (docs/memory.md)")


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "bytes/s":
        for scale, name in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} B/s"
    if unit.startswith("s/"):
        return f"{value * 1e3:.2f} ms"
    return f"{value:.0%}" if unit in ("of time", "of batches", "of CPU") else f"{value:.2f}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def format_report(diagnosis: Diagnosis, *, title: str = "Data Monitor", width: int = 100) -> str:
    """Render ``diagnosis`` as a text table (metric, current, running mean, threshold, status)
    followed by the diagnosis and its suggestion; plain text without colour codes.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", expand=False)
    for col, justify in (
        ("metric", "left"),
        ("current", "right"),
        ("running mean", "right"),
        ("threshold", "right"),
        ("status", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in diagnosis.rows:
        limit = (
            "-"
            if r.threshold is None
            else ("<= " if r.higher_is_worse else ">= ") + _fmt(r.threshold, r.unit)
        )
        table.add_row(
            f"{r.metric} ({r.unit.replace('s/', 'per ', 1) if r.unit.startswith('s/') else r.unit})",
            _fmt(r.current, r.unit),
            _fmt(r.mean, r.unit),
            limit,
            r.status,
        )
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    console.print(table)
    span = (
        f"window {diagnosis.window_s:.1f} s"
        if math.isfinite(diagnosis.window_s)
        else "since the loader started"
    )
    console.print(f"{span}, {diagnosis.batches} batches, epoch {diagnosis.epoch}")
    parts = []
    if diagnosis.skipped:
        parts.append(f"{_count(diagnosis.skipped, 'sample')} skipped (on_error='skip')")
    if diagnosis.errors:
        parts.append(f"{_count(diagnosis.lost, 'sample')} lost with "
                     f"{_count(diagnosis.errors, 'error')} the training loop caught")
    if parts:
        console.print("not delivered since the start: " + ", ".join(parts), soft_wrap=True)
    share = diagnosis.memory_wait_share
    # (a wait of a few milliseconds, one tiny sample held once, is no news in every report)
    felt = diagnosis.memory_wait_s >= MEMORY_WAIT_REPORTED_S
    if diagnosis.memory_held and felt:
        # Idle worker time costs throughput only where the loader is the bottleneck and the
        # accelerator idles, and only as far as it is a share of the workers' time that counts
        # (trial 88: the hint came beside "idle 0%", for one 16-byte sample held once).
        costly = (share >= MEMORY_WAIT_HINT_SHARE if math.isfinite(share)
                  else diagnosis.memory_wait_s >= MEMORY_WAIT_HINT_S)
        hint = ("; with the loader the bottleneck, memory_aware=False may give part of it "
                "back, at the cost of the peak memory"
                if diagnosis.kind in ("cpu", "io", "sync") and costly
                and diagnosis.idle_ratio >= IDLE_THRESHOLD else "")
        when = (f"in the window ({share:.0%} of the workers' time)" if math.isfinite(share)
                else "since the start")
        console.print(
            f"memory-aware dispatch: {_count(diagnosis.memory_held, 'sample')} waited for "
            f"room in the memory budget since the start; free workers idled "
            f"{diagnosis.memory_wait_s:.1f} s for it {when} (summed over workers){hint}",
            soft_wrap=True)
    if diagnosis.nodes:
        remote = Table(title="remote transform workers (Ray)", title_justify="left", expand=False)
        for col in ("node", "actors", "samples", "MiB moved", "service ms", "round trip ms"):
            remote.add_column(col, justify="left" if col == "node" else "right")
        for nd in diagnosis.nodes:
            remote.add_row(nd.node, str(nd.workers), str(nd.samples), f"{nd.mib:.1f}",
                           f"{nd.service_ms:.1f}", f"{nd.round_trip_ms:.1f}")
        console.print(remote)
    head = KINDS[diagnosis.kind]
    where = f" ({diagnosis.stage})" if diagnosis.stage else ""
    console.print(f"diagnosis: {head}{where}: {diagnosis.summary}")
    console.print(f"suggestion: {diagnosis.suggestion}")
    # (rich pads a centred title to the table's width: no line ends in spaces, trial 138)
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip().splitlines())


class CpuSnapshots:
    """``snapshot()`` with the loader's CPU demand in ``extra`` (:data:`CPU_SECONDS_KEY` and
    its basis, :func:`~autominato.telemetry.cores.loader_cpu_extra`), read from the processes
    ``worker_pids()`` names and this one (a :class:`ProcessMeter`). Thread-safe: the scrape
    thread, the Data Monitor and a ``report()`` call may read at once. Without
    ``worker_pids``, or when the snapshot carries the figure already (the controller's),
    the snapshot as it is."""

    def __init__(self, snapshot: Callable[[], LoaderSnapshot],
                 worker_pids: Callable[[], list[int]] | None) -> None:
        self._snapshot = snapshot
        self._pids = worker_pids
        self._meter = ProcessMeter() if worker_pids is not None else None
        self._lock = threading.Lock()

    def __call__(self) -> LoaderSnapshot:
        snap = self._snapshot()
        if self._meter is None or self._pids is None or CPU_SECONDS_KEY in snap.extra:
            return snap
        with self._lock:
            cpu = loader_cpu_extra(self._meter.read(self._pids()))
        return replace(snap, extra={**snap.extra, **cpu})


class DataMonitor:
    """A daemon thread that logs the Data Monitor report every ``interval`` seconds.

    Args:
        snapshot: returns the loader's current :class:`LoaderSnapshot`.
        interval: seconds between reports (> 0).
        rank: put in the report title so that the logs of several ranks stay apart.
        keep: snapshots kept (the first is taken at construction, the window's baseline).
        worker_pids: returns the loader's worker processes; with it, each snapshot carries
            the loader's CPU seconds (:func:`~autominato.telemetry.cores.loader_cpu_seconds`,
            read as the controller reads them), which the diagnosis weighs.
        budget: the core budget (default: the controller's, ``CoreBudget(usable_cores())``).

    Raises:
        ValueError: ``interval`` is not positive.
    """

    def __init__(
        self,
        snapshot: Callable[[], LoaderSnapshot],
        interval: float,
        *,
        rank: int | str = 0,
        keep: int = 8,
        worker_pids: Callable[[], list[int]] | None = None,
        budget: CoreBudget | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"monitor interval must be > 0 seconds, got {interval!r}")
        self._snapshot = CpuSnapshots(snapshot, worker_pids)
        self.budget = budget
        self.interval = float(interval)
        self.rank = rank
        self._recent: deque[LoaderSnapshot] = deque([self._snapshot()], maxlen=max(2, keep))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"autominato-monitor-{rank}", daemon=True
        )
        self.reports = 0

    def start(self) -> DataMonitor:
        self._thread.start()
        return self

    def relabel(self, rank: int | str) -> None:
        """Title later reports (and name the thread) with ``rank``."""
        self.rank = rank
        self._thread.name = f"autominato-monitor-{rank}"

    def history(self) -> list[LoaderSnapshot]:
        """The snapshots kept, oldest first."""
        with self._lock:
            return list(self._recent)

    def report(self, title: str | None = None, *, only_if_new: bool = False) -> str | None:
        """Take a snapshot, diagnose the window since the previous one, log and return it.

        With ``only_if_new`` (the end-of-run report), return None without logging when no
        batch was delivered since the previous report, and cover the previous report's window
        too when less than half an ``interval`` has passed since it.
        """
        # One report at a time takes and keeps its snapshot: the process meter is not
        # thread-safe, and the window needs the snapshots in the order they were taken.
        with self._lock:
            snap = self._snapshot()
            if only_if_new and snap.batches_total == self._recent[-1].batches_total:
                return None
            if (only_if_new and len(self._recent) > 1
                    and snap.time - self._recent[-1].time < self.interval / 2):
                # An end-of-run report right after a periodic one: a window of a few ms says
                # nothing (it read "window 0.0 s"); it covers the previous window too.
                self._recent.pop()
            self._recent.append(snap)
            history = list(self._recent)
        text = format_report(diagnose(history, budget=self.budget),
                             title=title or f"Data Monitor (rank {self.rank})")
        logger.info("%s", text)
        self.reports += 1
        return text

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.report()
            except Exception:  # a report must never kill training; say why and go on
                logger.exception("Data Monitor report failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
