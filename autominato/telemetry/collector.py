"""Scrape-time collector: counters and gauges read from each attached loader's snapshot.

One :class:`SnapshotCollector` per process sits in :data:`~autominato.telemetry.metrics.REGISTRY`
and yields one family per name in :data:`~autominato.telemetry.metrics.COLLECTED`, with one
series per attached loader (its ``rank`` label). Nothing is recorded per item: the loader's
cumulative counters are read when Prometheus scrapes, so a family cannot clash between two
loaders and an unattached loader simply disappears from the next scrape.

A label outlives its loader: the counters a closed loader last had under it are carried, and
the next loader that takes the label (a validation loader built anew each epoch, a Loader
built again after ``close()``) exports them plus its own, so that every counter series stays
monotonic for the process's life; meanwhile they are exported as the loader left them (a pass
that ended between two scrapes, or shorter than the scrape interval, is then counted whole:
trial 168), while its gauges go. A series that came back from 0 would be read as a counter
reset, and where the new loader's count had passed the old one by the next scrape (a short
validation pass, as long as the last), ``increase()`` and ``rate()`` saw only the
difference, or nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from autominato.pipeline.knobs import KNOB_NAMES
from autominato.pipeline.stats import LoaderSnapshot
from autominato.telemetry.cores import (
    CPU_OF_WORKERS_KEY,
    CPU_SECONDS_KEY,
    CPU_TIME_SECONDS_KEY,
    KERNEL_SECONDS_KEY,
    RUNQUEUE_SECONDS_KEY,
    reads_fused,
)
from autominato.telemetry.metrics import COLLECTED, REGISTRY, STAGES
from autominato.telemetry.window import Ring

log = logging.getLogger(__name__)

#: Length of the sliding window of the idle-ratio and bandwidth gauges, seconds.
WINDOW_S = 30.0


class SlidingWindow:
    """The idle-ratio and bandwidth gauges over a sliding window of scrapes.

    Rates come from a :class:`~autominato.telemetry.window.Ring` of the snapshots taken at
    scrape times (the window runs back ``window_s`` seconds, or further when scrapes are
    sparse, or to the loader's start on the first scrape). When no batch (or no copy)
    completed within the window, the last value is kept: a loop that has stopped calling
    ``next()`` has no new ratio to report.
    """

    def __init__(self, window_s: float = WINDOW_S, keep: int = 256) -> None:
        self._ring = Ring(window_s, keep)
        self._lock = threading.Lock()
        self._idle = 0.0
        self._bw: float | None = None

    def update(self, snap: LoaderSnapshot) -> tuple[float, float | None]:
        """Add ``snap``; return ``(idle_ratio, h2d_bytes_per_second or None)`` over the window."""
        r = self._ring.add(snap)
        with self._lock:
            if r.wait_s + r.busy_s > 0:
                self._idle = r.idle_ratio
            if r.h2d_bytes_per_s is not None:
                self._bw = r.h2d_bytes_per_s
            return self._idle, self._bw


#: A counter series of one label: (sample name, label values but ``rank``).
_Key = tuple[str, tuple[str, ...]]

#: The names in :data:`COLLECTED` of its counters (carried across a label's loaders).
COUNTERS = frozenset(name for name, (kind, _, _) in COLLECTED.items() if kind == "counter")


@dataclass
class _Source:
    rank: str
    snapshot: Callable[[], LoaderSnapshot]
    window: SlidingWindow
    #: what earlier loaders of the label left (added to this one's counters)
    carried: dict[_Key, float] = field(default_factory=dict)
    #: the counters as last exported (earlier loaders' included)
    last: dict[_Key, float] = field(default_factory=dict)
    #: what the label had when this loader took it (totals, where ``carried`` may be an
    #: offset after a relabel)
    base: dict[_Key, float] = field(default_factory=dict)


class SnapshotCollector(Collector):
    """Yields the :data:`COLLECTED` families for every registered loader at scrape time."""

    def __init__(self) -> None:
        self._sources: dict[int, _Source] = {}
        #: label -> the counters its last loader left, until another loader takes it
        self._retired: dict[str, dict[_Key, float]] = {}
        self._lock = threading.Lock()

    def add(self, key: int, rank: str, snapshot: Callable[[], LoaderSnapshot]) -> None:
        """Register a loader under ``key`` (unique per handle) with label ``rank``; its counters
        go on from those the label's last loader left."""
        with self._lock:
            taken = self._retired.pop(rank, {})
            self._sources[key] = _Source(rank, snapshot, SlidingWindow(), carried=dict(taken),
                                         base=taken)

    def own_counters(self, snap: LoaderSnapshot) -> dict[_Key, float]:
        """The counters of ``snap`` alone (nothing carried), as exported."""
        fams = self._by_name()
        own: dict[_Key, float] = {}
        _add_samples(fams, "", snap, 0.0, None, {}, own)
        return own

    def relabel(self, key: int, rank: str, own: dict[_Key, float] | None = None) -> None:
        """Give the loader registered under ``key`` the label ``rank`` (its window is kept).
        ``own``: its counters now (:meth:`own_counters`; else read from the last scrape). The
        old label keeps them, as a closed loader's; the new one counts from now on, what its
        last loader left plus what this loader counts after the move, as its histograms,
        which begin there (trial 168: the items counted before the move beside a histogram
        of those after, the remote report's means were a fifth of the truth)."""
        with self._lock:
            src = self._sources.get(key)
            if src is None or src.rank == rank:
                return
            if own is None:
                own = {k: v - src.carried.get(k, 0.0) for k, v in src.last.items()}
            self._retire(src, {k: src.carried.get(k, 0.0) + v for k, v in own.items()})
            taken = self._retired.pop(rank, {})
            src.carried = {k: taken.get(k, 0.0) - own.get(k, 0.0) for k in {*taken, *own}}
            src.rank, src.last, src.base = rank, {}, taken

    def remove(self, key: int, final: LoaderSnapshot | None = None) -> None:
        """Unregister the loader of ``key``; its label keeps the counters of ``final`` (its
        last snapshot; else those last exported): exported as they are until another loader
        takes the label and goes on from them."""
        with self._lock:
            src = self._sources.get(key)
        if src is None:
            return
        last = None
        if final is not None:  # (before it leaves: a scrape finishing meanwhile finds it)
            fams = self._by_name()
            last = {}
            _add_samples(fams, src.rank, final, 0.0, None, src.carried, last)
        with self._lock:
            if self._sources.pop(key, None) is src:
                self._retire(src, src.last if last is None else last)

    def _retire(self, src: _Source, last: dict[_Key, float]) -> None:
        # (under _lock) counters the loader never exported keep what was carried to it; a
        # scrape that raced the close may have exported more than the final snapshot read
        # (the workers still counting): the larger, so the next loader never goes below it
        # (``base``, not ``carried``: after a relabel that is an offset, maybe negative)
        kept = {**src.base, **src.last}
        for k, v in last.items():
            kept[k] = max(v, kept.get(k, v))
        self._retired[src.rank] = kept

    def _late(self, rank: str, exported: dict[_Key, float]) -> None:
        """(under ``_lock``) A scrape of a loader that left label ``rank`` while it ran
        exported ``exported``: the label's counters go on from no less (trial 168: a scrape
        that overlapped a close exported more than the close's figures, and the next loader
        of the label went back below them, a reset to Prometheus)."""
        kept = self._retired.get(rank)
        if kept is not None:
            for k, v in exported.items():
                if v > kept.get(k, float("-inf")):
                    kept[k] = v
            return
        # Taken by another loader already: it exports carried + its own, from no less than
        # max(what it took, what it exported last); raise its carry by what that falls short.
        src = next((s for s in self._sources.values() if s.rank == rank), None)
        if src is None:
            return
        for k, v in exported.items():
            short = v - max(src.base.get(k, 0.0), src.last.get(k, float("-inf")))
            if short > 0:
                src.carried[k] = src.carried.get(k, 0.0) + short

    def ranks(self) -> list[str]:
        with self._lock:
            return [s.rank for s in self._sources.values()]

    def describe(self) -> list[Metric]:
        # Describing (rather than collecting) keeps registration free of snapshot calls.
        return list(self._families())

    def _families(self) -> Iterator[Metric]:
        for name, (kind, doc, labels) in COLLECTED.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield cls(name, doc, labels=[*labels, "rank"])

    def _by_name(self) -> dict[str, Metric]:
        """Empty families by the names :data:`COLLECTED` gives them (``_total`` on counters)."""
        return {m.name + ("_total" if m.type == "counter" else ""): m for m in self._families()}

    def collect(self) -> Iterator[Metric]:
        fams = self._by_name()
        with self._lock:
            sources = [(key, src, src.rank, src.carried) for key, src in self._sources.items()]
        done: set[str] = set()
        for key, src, rank, carried in sources:
            try:
                snap = src.snapshot()
            except Exception:  # a closing loader must not break the scrape of the others
                log.debug("snapshot of rank %s failed during scrape", rank, exc_info=True)
                continue
            last: dict[_Key, float] = {}
            _add_samples(fams, rank, snap, *src.window.update(snap), carried, last)
            with self._lock:
                if src.rank == rank and self._sources.get(key) is src:
                    src.last = last
                else:  # closed or relabelled meanwhile
                    self._late(rank, last)
            done.add(rank)
        with self._lock:  # closed loaders' labels: their counters as they left them
            retired = [(rank, dict(kept)) for rank, kept in self._retired.items()
                       if rank not in done]  # (one that closed during this scrape: once)
        for rank, kept in retired:
            for (name, labels), v in kept.items():
                fams[name].add_metric([*labels, rank], v)
        yield from fams.values()


def _add_samples(
    fams: dict[str, Metric],
    rank: str,
    s: LoaderSnapshot,
    idle: float,
    bandwidth: float | None,
    carried: dict[_Key, float],
    last: dict[_Key, float],
) -> None:
    """Add ``s``'s series under ``rank`` to ``fams``: each counter plus what ``carried`` holds
    for it, as also written into ``last``."""
    def put(name: str, value: float, *labels: str) -> None:
        if name in COUNTERS:
            value += carried.get((name, labels), 0.0)
            last[(name, labels)] = value
        fams[name].add_metric([*labels, rank], value)

    fused = reads_fused(s)
    for stage in STAGES:
        st = s.stages.get(stage)
        if st is None:
            continue
        put("autominato_stage_items_total", st.items_total, stage)
        if not (fused and stage == "read"):
            # A read inside the transform workers does not measure the bytes it read: no
            # series rather than a bandwidth of 0.
            put("autominato_stage_bytes_total", st.bytes_total, stage)
        put("autominato_stage_queue_items", st.queue_len, stage)
        put("autominato_stage_queue_capacity_items", st.queue_capacity, stage)
        put("autominato_stage_workers", st.workers, stage)
        if st.cpu_seconds_total is not None:
            put("autominato_stage_cpu_seconds_total", st.cpu_seconds_total, stage)
            put("autominato_stage_runqueue_wait_seconds_total",
                st.runqueue_seconds_total or 0.0, stage)
    put("autominato_accelerator_idle_ratio", idle)
    put("autominato_samples_total", s.samples_total)
    put("autominato_batches_total", s.batches_total)
    put("autominato_h2d_bytes_total", s.h2d_bytes_total)
    if bandwidth is not None:
        put("autominato_h2d_bandwidth_bytes_per_second", bandwidth)
    put("autominato_stragglers_total", s.stragglers_total)
    put("autominato_samples_skipped_total", s.skipped_total)
    put("autominato_errors_raised_total", s.errors_raised_total)
    put("autominato_samples_lost_total", s.samples_lost_total)
    put("autominato_worker_restarts_total", s.worker_restarts_total)
    put("autominato_speculative_samples_discarded_total", s.speculative_discarded_total)
    put("autominato_epoch_cold_starts_total", s.cold_starts_total)
    put("autominato_epoch_cold_start_wait_seconds_total", s.cold_start_wait_seconds_total)
    put("autominato_between_epochs_seconds_total", s.between_epochs_seconds_total)
    put("autominato_samples_held_for_memory_total", s.samples_held_for_memory_total)
    put("autominato_sample_memory_budget_bytes", s.sample_memory_budget_bytes)
    put("autominato_worker_heap_keep_bytes", s.worker_heap_keep_bytes)
    put("autominato_memory_wait_seconds_total", s.memory_wait_seconds_total)
    if s.extra.get(CPU_OF_WORKERS_KEY) == 1.0 and CPU_SECONDS_KEY in s.extra:
        # (of worker processes only: the training process's CPU is not the loader's, and a
        # counter must not switch basis)
        put("autominato_loader_cpu_seconds_total",
            s.extra.get(CPU_TIME_SECONDS_KEY, s.extra[CPU_SECONDS_KEY]))
        put("autominato_loader_runqueue_wait_seconds_total", s.extra.get(RUNQUEUE_SECONDS_KEY, 0.0))
        if KERNEL_SECONDS_KEY in s.extra:
            put("autominato_loader_cpu_system_seconds_total", s.extra[KERNEL_SECONDS_KEY])
    for knob in KNOB_NAMES:
        if knob in s.knobs:
            put("autominato_knob_value", s.knobs[knob], knob)
    put("autominato_pool_bytes", s.pool_bytes)
    put("autominato_epoch", s.epoch)
    if s.worker_kind:
        put("autominato_loader_info", 1.0, s.worker_kind,
            *("true" if flag else "false" for flag in (s.iterable, s.memory_aware, s.warm_heap)))
    for nd in s.nodes:
        put("autominato_remote_workers", nd.workers, nd.node)
        put("autominato_remote_samples_total", nd.items_total, nd.node)
        put("autominato_remote_bytes_total", nd.bytes_total, nd.node)
        put("autominato_remote_service_seconds_total", nd.service_seconds_total, nd.node)
        put("autominato_remote_round_trip_seconds_total", nd.round_trip_seconds_total, nd.node)


#: The process's one collector; :func:`autominato.telemetry.attach` adds loaders to it.
COLLECTOR = SnapshotCollector()
REGISTRY.register(COLLECTOR)
