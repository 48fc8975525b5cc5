"""Every Prometheus metric autominato exports, defined in one place.

Names follow the Prometheus naming conventions (https://prometheus.io/docs/practices/naming/):
an ``autominato_`` prefix, base units (seconds, bytes, ratios in 0..1), ``_total`` on counters.
Labels have bounded cardinality: ``rank`` (an int per loader), ``stage`` (one of
:data:`STAGES`), ``knob`` (one of :data:`autominato.pipeline.knobs.KNOB_NAMES`), ``reason``
(a controller reason, capped by :func:`bounded_reason`), and ``gpu`` / ``UUID`` for NVML
figures (as NVIDIA's DCGM exporter labels them). Never an index or a path.

Two kinds of metric live here:

* **Observed** metrics (plain ``prometheus_client`` histograms over :data:`LATENCY_BUCKETS`,
  and the decision counter) are recorded once per item by the hooks that
  :func:`autominato.telemetry.attach` puts on each ``StageStats``; the timings come from the
  workers with each result, so everything is recorded in the main process and no
  multiprocess directory is needed.
* **Collected** metrics (counters and gauges that mirror cumulative loader counters) are read
  from ``loader.snapshot()`` at scrape time by a collector, so they cost nothing per item.
  :data:`COLLECTED` lists their names, types and help text; the collector lives in
  :mod:`autominato.telemetry.collector`.

All of them sit in :data:`REGISTRY`, one registry per process that the exporter serves; each
attached loader adds its ``rank`` children, so two loaders in one process (two ranks in a
test) never clash. When it closes its gauges go; its counters and histograms stay exported as
it left them, and the label's next loader goes on from them (a validation loader built anew
each epoch): every series is monotonic for the process's life, as Prometheus's ``rate()`` and
``increase()`` need.
"""

from __future__ import annotations

import re
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector

#: Pipeline stages that carry a ``stage`` label (the consumer has its own metrics).
STAGES = ("read", "transform", "batch", "transfer")

#: The Renard R10 series of preferred numbers (ISO 3): ten a decade, each about 1.26 times
#: the last.
R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)

#: Histogram buckets in seconds: the R10 series from 0.1 ms to 100 s (61 bounds). Prometheus's
#: ``histogram_quantile`` interpolates linearly inside a bucket ``(a, r a]``, so a quantile
#: reads somewhere in the bucket its value lies in: off by at most the bucket's width, -22 %
#: to +28 % with bounds 1.25-1.28x apart (review 172; in the first bucket, 0 to 0.1 ms, it
#: interpolates from 0: steady 20 us waits read a median of 50 us, review 174). Of steady values (all in one bucket)
#: the median reads -11 % to +14 % off, the p99 up to +28 % (values just above a bound: a
#: 100 ms step's p99 reads 125 ms, trial 171); the mean, ``_sum / _count``, is exact. The 1-2.5-5-a-decade bounds before them
#: (0.5 ms to 10 s) read a 20 ms transform's median as 17.5 ms, a 100 ms step's p99 as
#: 175 ms, and any sample over 10 s (a large 3D volume's transforms) as 10 s (trial 168). Each
#: ``observe`` walks the bounds: 1.0-3.4 us here (larger values cost more), against 1.1-2.3 us
#: with the 14 before (docs/telemetry.md, "Overhead").
LATENCY_BUCKETS = tuple(
    float(f"{m}e{e}") for e in range(-4, 2) for m in R10
) + (100.0,)

#: The process-wide registry the exporter serves. Users with their own exporter may serve it
#: too (``prometheus_client.generate_latest(REGISTRY)``).
REGISTRY = CollectorRegistry(auto_describe=True)

# Standard process_* figures (CPU seconds, resident memory, open fds) of the main process.
ProcessCollector(registry=REGISTRY)

# --- observed: recorded per item by StageStats hooks ----------------------------------------
# Plain prometheus_client histograms: a hook calls ``.labels(...).observe(seconds)`` on a child
# it looked up once, and a closed loader's children go with ``.remove(...)``.

STAGE_SERVICE_SECONDS = Histogram(
    "autominato_stage_service_seconds",
    "Time one item spent being served by a pipeline stage (measured where it ran), seconds.",
    ["stage", "rank"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
STAGE_WAIT_SECONDS = Histogram(
    "autominato_stage_wait_seconds",
    "Time one item waited in a stage's input queue before service began, seconds.",
    ["stage", "rank"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
CONSUMER_WAIT_SECONDS = Histogram(
    "autominato_consumer_wait_seconds",
    "Time the training loop was blocked in next() for one batch (accelerator idle), seconds.",
    ["rank"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
CONSUMER_STEP_SECONDS = Histogram(
    "autominato_consumer_step_seconds",
    "Time the training loop spent between two next() calls (its step), seconds.",
    ["rank"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
H2D_COPY_SECONDS = Histogram(
    "autominato_h2d_copy_seconds",
    "Host-to-device copy time of one batch (CUDA events on the copy stream), seconds.",
    ["rank"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
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
        ("Capacity of a stage's input queue, items; what it holds differs by stage (see "
         "docs/telemetry.md); 0 for a read fused into the workers, which has no queue."),
        ("stage",),
    ),
    "autominato_stage_workers": (
        "gauge",
        "Workers (threads or processes) a stage runs now.",
        ("stage",),
    ),
    "autominato_stage_cpu_seconds_total": (
        "counter",
        "CPU time the stage's threads in the training process spent on its items (a read "
        "stage of its own: fuse_read=False or thread workers), seconds; beside the service "
        "time it tells decoding from waiting on storage.",
        ("stage",),
    ),
    "autominato_stage_runqueue_wait_seconds_total": (
        "counter",
        "Seconds those threads waited runnable for a core during the stage's items (Linux "
        "run-queue wait, /proc/thread-self/schedstat; 0 where it cannot be read): with the "
        "CPU time, what the items asked of the CPU on a busy machine.",
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
        "Samples delivered in a later batch of the epoch than their place in its order (not "
        "ready when an earlier batch filled: any sample slower than those after it).",
        (),
    ),
    "autominato_samples_skipped_total": (
        "counter",
        "Samples dropped by the on_error='skip' policy.",
        (),
    ),
    "autominato_errors_raised_total": (
        "counter",
        "Errors raised in the training loop after which the epoch went on (a sample's under "
        "on_error='raise', or a batch's that could not be made).",
        (),
    ),
    "autominato_samples_lost_total": (
        "counter",
        "Samples not delivered because of an error raised in the training loop (the failing "
        "sample; in order or with a batch_sampler its whole batch, as DataLoader's, and for "
        "an iterable dataset in order the samples of its batch before it; not what a "
        "generator that raised never yielded).",
        (),
    ),
    "autominato_speculative_samples_discarded_total": (
        "counter",
        "Samples started for a next epoch that the training loop did not ask for, discarded.",
        (),
    ),
    "autominato_epoch_cold_starts_total": (
        "counter",
        "Epochs (passes) whose samples started only when the pass began, so that the training "
        "loop waited while the pipeline filled: the first, every one the loader does not "
        "prefetch (docs/controller.md lists them), and a prefetched one discarded or adopted "
        "before it took a sample (the pass before it was left early).",
        (),
    ),
    "autominato_epoch_cold_start_wait_seconds_total": (
        "counter",
        "Seconds the training loop waited for the first batch of an epoch (pass) that started "
        "cold (autominato_epoch_cold_starts_total: workers starting, worker_init_fn, the "
        "pipeline filling), counted when that batch arrives; part of "
        "autominato_consumer_wait_seconds_sum. Not with num_workers=0.",
        (),
    ),
    "autominato_between_epochs_seconds_total": (
        "counter",
        "Seconds the training loop spent between epochs: from the end of its last live pass "
        "(StopIteration, an error that ends it, the iterator dropped) to its next request of a "
        "batch or close() (validation, checkpoints); neither step nor wait.",
        (),
    ),
    "autominato_samples_held_for_memory_total": (
        "counter",
        "Samples that waited before they started because their working set (the peak memory "
        "measured at their last run) would not fit beside the samples in flight.",
        (),
    ),
    "autominato_sample_memory_budget_bytes": (
        "gauge",
        "Working-set bytes of samples that may be in flight together: 1.35 x max(the largest "
        "sample's peak, or the estimate from its file's size of a sample not measured yet in "
        "flight or waiting where that is more, workers x the upper quartile's), as the last "
        "sample to ask for a worker saw it; 0 before a sample was measured.",
        (),
    ),
    "autominato_worker_heap_keep_bytes": (
        "gauge",
        "Bytes of free heap each worker process may keep warm between samples (warm_heap): "
        "the upper quartile's figure, lowered to what the memory budget leaves beside a larger "
        "sample while one runs; 0 while a sample waits for "
        "memory, while every worker has idled 10 s, and until half the indices (or 256, or "
        "an epoch's distinct indices where fewer) have figures.",
        (),
    ),
    "autominato_memory_wait_seconds_total": (
        "counter",
        "Seconds that free workers waited, summed over workers, because the samples queued "
        "for them did not fit in the memory budget (memory-aware dispatch): idle worker "
        "time, a throughput cost only where the loader is the bottleneck.",
        (),
    ),
    "autominato_worker_restarts_total": (
        "counter",
        "Worker processes replaced after dying or hanging.",
        (),
    ),
    "autominato_loader_cpu_seconds_total": (
        "counter",
        "CPU time of the loader's worker processes (user + system seconds on a core), summed "
        "over workers, read at each scrape (a worker that exited takes its CPU since the last "
        "read along); absent without worker processes (thread workers share the training "
        "process).",
        (),
    ),
    "autominato_loader_cpu_system_seconds_total": (
        "counter",
        "The part of autominato_loader_cpu_seconds_total the worker processes spent in the "
        "kernel (system time: page faults and the zeroing of fresh pages, file reads, other "
        "system calls), summed over workers as it.",
        (),
    ),
    "autominato_loader_runqueue_wait_seconds_total": (
        "counter",
        "Seconds the loader's worker processes' threads waited runnable for a core (Linux "
        "run-queue wait, /proc/PID/task/TID/schedstat; 0 where it cannot be read), summed over "
        "workers as autominato_loader_cpu_seconds_total; with it, their CPU demand.",
        (),
    ),
    "autominato_knob_value": ("gauge", "Current value of a loader knob.", ("knob",)),
    "autominato_pool_bytes": ("gauge", "Memory held by the buffer pool (slots and batch buffers that have their pages), bytes.", ()),
    "autominato_epoch": ("gauge", "Current epoch of the loader.", ()),
    "autominato_loader_info": (
        "gauge",
        "1, labelled with what the loader runs: worker_kind (process, thread, ray), "
        "iterable (true for an IterableDataset), memory_aware (its setting) and warm_heap "
        "(process workers may keep freed heap warm), so that autominato monitor URL advises "
        "as the training process's own report does.",
        ("worker_kind", "iterable", "memory_aware", "warm_heap"),
    ),
    # Remote transform workers (worker_kind="ray"), by node: a bounded label (MAX_NODES).
    "autominato_remote_workers": (
        "gauge",
        "Transform actors of the loader ready on a Ray node.",
        ("node",),
    ),
    "autominato_remote_samples_total": (
        "counter",
        "Samples the loader's transform actors on a Ray node finished.",
        ("node",),
    ),
    "autominato_remote_bytes_total": (
        "counter",
        "Bytes of samples moved from a Ray node through Ray's object store, bytes.",
        ("node",),
    ),
    "autominato_remote_service_seconds_total": (
        "counter",
        "Seconds the transform actors on a Ray node spent on samples (read, transform, pack).",
        ("node",),
    ),
    "autominato_remote_round_trip_seconds_total": (
        "counter",
        "Seconds from sending samples to a Ray node to their results arriving, seconds.",
        ("node",),
    ),
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
