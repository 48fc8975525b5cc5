"""Every Prometheus metric autominato exports, defined in one place.

Names follow the Prometheus naming conventions (https://prometheus.io/docs/practices/naming/):
an ``autominato_`` prefix, base units (seconds, bytes, ratios in 0..1), ``_total`` on counters.
Labels have bounded cardinality: ``rank`` (an int per loader), ``stage`` (one of
:data:`STAGES`), ``knob`` (one of :data:`autominato.pipeline.knobs.KNOB_NAMES`), ``reason``
(a controller reason, capped by :func:`bounded_reason`), and ``gpu`` / ``UUID`` for NVML
figures (as NVIDIA's DCGM exporter labels them). Never an index or a path.

Two kinds of metric live here:

* **Observed** metrics (histograms, and the decision counter) are recorded once per item by
  the hooks that :func:`autominato.telemetry.attach` puts on each ``StageStats``; the timings
  come from the workers with each result, so everything is recorded in the main process and no
  multiprocess directory is needed.
* **Collected** metrics (counters and gauges that mirror cumulative loader counters) are read
  from ``loader.snapshot()`` at scrape time by a collector, so they cost nothing per item.
  :data:`COLLECTED` lists their names, types and help text; the collector lives in
  :mod:`autominato.telemetry.collector`.

All of them sit in :data:`REGISTRY`, one registry per process that the exporter serves; each
attached loader adds its ``rank`` children and removes them again when it closes, so two
loaders in one process (two ranks in a test) never clash.
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: Pipeline stages that carry a ``stage`` label (the consumer has its own metrics).
STAGES = ("read", "transform", "batch", "transfer")

#: Histogram buckets in seconds, 0.5 ms to 10 s, roughly 1-2.5-5 per decade (the
#: prometheus_client default starts at 5 ms, too coarse for a queue hand-off or a small read).
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

#: The process-wide registry the exporter serves. Users with their own exporter may serve it
#: too (``prometheus_client.generate_latest(REGISTRY)``).
REGISTRY = CollectorRegistry(auto_describe=True)

# Standard process_* figures (CPU seconds, resident memory, open fds) of the main process.
ProcessCollector(registry=REGISTRY)


class HistogramChild:
    """Bucket counts and sum of one labelled series.

    ``counts[i]`` counts values ``<= LATENCY_BUCKETS[i]`` and above the previous bound (the
    last slot is +Inf).
    """

    __slots__ = ("counts", "sum", "_lock")

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self._lock = lock if lock is not None else threading.Lock()

    def observe(self, value: float) -> None:
        """Count ``value`` (seconds) in the first bucket whose bound is >= it (Prometheus ``le``)."""
        i = bisect_left(LATENCY_BUCKETS, value)
        with self._lock:
            self.counts[i] += 1
            self.sum += value

    def read(self) -> tuple[list[int], float]:
        """Per-bucket (not cumulative) counts and the sum, read consistently."""
        with self._lock:
            return list(self.counts), self.sum


class LatencyHistogram:
    """A histogram family over :data:`LATENCY_BUCKETS`, counted here and exposed at scrape time.

    Why not ``prometheus_client.Histogram``: its ``observe`` walks the buckets in Python and
    takes a lock per bucket and one for the sum, on the pipeline's own threads. Measured on
    this project's 2-core machine (``timeit`` with CPU time, best of 7): a service + wait pair
    costs 2.35 us with prometheus_client and 0.62 us with :class:`PairedChildren` (a C
    ``bisect`` per value, one lock). Buffering the pairs and counting them in bulk with numpy
    at scrape time was tried and measured slower (0.72 us: building the array costs more than
    the bisects). The exposition still comes from prometheus_client's ``HistogramMetricFamily``.
    The interface (``labels(...)``, ``.observe``, ``remove(...)``) is prometheus_client's.
    """

    def __init__(
        self, name: str, documentation: str, labelnames: list[str], *, registered: bool = True
    ) -> None:
        """``registered``: expose it through :data:`REGISTRY` (False keeps it private)."""
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        self._lock = threading.Lock()
        if registered:
            _HISTOGRAMS.append(self)

    def labels(self, *values: object) -> HistogramChild:
        """The child of these label values (created on first use).

        Raises:
            ValueError: the number of values differs from the label names.
        """
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = HistogramChild()
            return child

    def _install(self, values: tuple[object, ...], child: HistogramChild) -> None:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        with self._lock:
            self._children[tuple(str(v) for v in values)] = child

    def remove(self, *values: object) -> None:
        """Drop the child of these label values (no error when absent)."""
        with self._lock:
            self._children.pop(tuple(str(v) for v in values), None)

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            counts, total = child.read()
            cumulative, buckets = 0, []
            for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            fam.add_metric(list(key), buckets, total)
        return fam


_HISTOGRAMS: list[LatencyHistogram] = []


class PairedChildren:
    """Fresh children of two histograms for the same labels, sharing one lock.

    A stage hook records two timings per item (service and wait, or a consumer's step and
    wait) on the pipeline's own threads; one lock for both keeps that to one acquisition.
    Creating the pair replaces earlier children of those labels.
    """

    __slots__ = ("first", "second", "_lock")

    def __init__(self, first: LatencyHistogram, second: LatencyHistogram, *labels: object) -> None:
        self._lock = threading.Lock()
        self.first, self.second = HistogramChild(self._lock), HistogramChild(self._lock)
        first._install(labels, self.first)
        second._install(labels, self.second)

    def observe(self, a: float, b: float) -> None:
        """Count ``a`` seconds in the first histogram and ``b`` seconds in the second."""
        i, j = bisect_left(LATENCY_BUCKETS, a), bisect_left(LATENCY_BUCKETS, b)
        first, second = self.first, self.second
        with self._lock:
            first.counts[i] += 1
            first.sum += a
            second.counts[j] += 1
            second.sum += b


class _HistogramCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        for hist in _HISTOGRAMS:
            yield hist.family()


REGISTRY.register(_HistogramCollector())

# --- observed: recorded per item by StageStats hooks ----------------------------------------

STAGE_SERVICE_SECONDS = LatencyHistogram(
    "autominato_stage_service_seconds",
    "Time one item spent being served by a pipeline stage (measured where it ran), seconds.",
    ["stage", "rank"],
)
STAGE_WAIT_SECONDS = LatencyHistogram(
    "autominato_stage_wait_seconds",
    "Time one item waited in a stage's input queue before service began, seconds.",
    ["stage", "rank"],
)
CONSUMER_WAIT_SECONDS = LatencyHistogram(
    "autominato_consumer_wait_seconds",
    "Time the training loop was blocked in next() for one batch (accelerator idle), seconds.",
    ["rank"],
)
CONSUMER_STEP_SECONDS = LatencyHistogram(
    "autominato_consumer_step_seconds",
    "Time the training loop spent between two next() calls (its step), seconds.",
    ["rank"],
)
H2D_COPY_SECONDS = LatencyHistogram(
    "autominato_h2d_copy_seconds",
    "Host-to-device copy time of one batch (CUDA events on the copy stream), seconds.",
    ["rank"],
)
CONTROLLER_DECISIONS = Counter(
    "autominato_controller_decisions",
    "Knob changes made by the online controller, by knob and reason.",
    ["knob", "reason", "rank"],
    registry=REGISTRY,
)

# --- collected: read from loader.snapshot() at scrape time ----------------------------------

#: name -> (type, help, extra labels besides ``rank``). Counter names carry ``_total`` here
#: because that is the exposed sample name; prometheus_client's families strip it.
COLLECTED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "autominato_stage_items_total": (
        "counter",
        "Items a stage finished (samples for read/transform, batches for batch/transfer).",
        ("stage",),
    ),
    "autominato_stage_bytes_total": (
        "counter",
        "Bytes a stage produced, bytes.",
        ("stage",),
    ),
    "autominato_stage_queue_items": (
        "gauge",
        "Items waiting in a stage's input queue.",
        ("stage",),
    ),
    "autominato_stage_queue_capacity_items": (
        "gauge",
        "Capacity of a stage's input queue, items (0: unbounded).",
        ("stage",),
    ),
    "autominato_stage_workers": (
        "gauge",
        "Workers (threads or processes) a stage runs now.",
        ("stage",),
    ),
    "autominato_accelerator_idle_ratio": (
        "gauge",
        "Share of the training loop's time spent blocked in next() over a sliding window, 0..1.",
        (),
    ),
    "autominato_samples_total": ("counter", "Samples delivered to the training loop.", ()),
    "autominato_batches_total": ("counter", "Batches delivered to the training loop.", ()),
    "autominato_h2d_bytes_total": ("counter", "Bytes copied host to device, bytes.", ()),
    "autominato_h2d_bandwidth_bytes_per_second": (
        "gauge",
        "Achieved host-to-device copy bandwidth over a sliding window, bytes/s.",
        (),
    ),
    "autominato_stragglers_total": (
        "counter",
        "Slow samples deferred to a later batch of the same epoch.",
        (),
    ),
    "autominato_samples_skipped_total": (
        "counter",
        "Samples dropped by the on_error='skip' policy.",
        (),
    ),
    "autominato_worker_restarts_total": (
        "counter",
        "Worker processes replaced after dying or hanging.",
        (),
    ),
    "autominato_knob_value": ("gauge", "Current value of a loader knob.", ("knob",)),
    "autominato_pool_bytes": ("gauge", "Bytes held by the buffer pool, bytes.", ()),
    "autominato_epoch": ("gauge", "Current epoch of the loader.", ()),
}

#: NVML figures, labelled ``gpu`` (NVML index) and ``UUID`` like DCGM exporter; the DCGM name
#: of the same figure is given so a dashboard can show either.
NVML_METRICS: dict[str, tuple[str, str]] = {
    "autominato_gpu_utilization_ratio": (
        "Share of the last sample period a kernel ran on the GPU, 0..1 (DCGM_FI_DEV_GPU_UTIL/100).",
        "DCGM_FI_DEV_GPU_UTIL",
    ),
    "autominato_gpu_memory_used_bytes": (
        "GPU framebuffer memory used, bytes (DCGM_FI_DEV_FB_USED is MiB).",
        "DCGM_FI_DEV_FB_USED",
    ),
    "autominato_gpu_pcie_tx_bytes_per_second": (
        "PCIe transmit throughput over NVML's 20 ms window, bytes/s.",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
    ),
    "autominato_gpu_pcie_rx_bytes_per_second": (
        "PCIe receive throughput over NVML's 20 ms window, bytes/s.",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
    ),
}

#: Every histogram family with a ``rank`` label, for removing a closed loader's children.
RANKED_HISTOGRAMS = (CONSUMER_WAIT_SECONDS, CONSUMER_STEP_SECONDS, H2D_COPY_SECONDS)
STAGE_HISTOGRAMS = (STAGE_SERVICE_SECONDS, STAGE_WAIT_SECONDS)

#: Most distinct ``reason`` values kept per process; later new ones count as ``other``.
MAX_REASONS = 32
_REASON_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_reasons: set[str] = set()
_reasons_lock = threading.Lock()


def bounded_reason(reason: str) -> str:
    """Map a controller reason to a label value of bounded cardinality.

    A reason is kept when it is a short snake_case word (``[a-z][a-z0-9_]{0,39}``) and fewer
    than :data:`MAX_REASONS` distinct reasons were seen in this process; anything else
    becomes ``"other"``, so free text (a path, a number) can never explode the series count.
    """
    reason = str(reason)
    if not _REASON_RE.match(reason):
        return "other"
    with _reasons_lock:
        if reason in _reasons:
            return reason
        if len(_reasons) >= MAX_REASONS:
            return "other"
        _reasons.add(reason)
        return reason
