"""The loader's Grafana dashboard, authored in code with grafana-foundation-sdk.

``dashboards/autominato.json`` in the repository is the output of :func:`dashboard_json`
(``autominato dashboards generate`` writes it; a test checks that the committed file equals
it). The SDK release pinned in ``pyproject.toml`` (``1769699998!10.1.0``) generates types for
Grafana 10.1.x, so the compose stack runs :data:`GRAFANA_VERSION` of that line.

Every query reads the Prometheus metrics that :mod:`autominato.telemetry.metrics` defines
(``autominato_*``, base units, ``rank`` on every loader metric, ``stage`` on per-stage ones)
and, on the GPU row, the NVIDIA DCGM exporter's names for the same figures, so one dashboard
serves hosts with either source. Template variables: ``datasource`` (any Prometheus), ``job``,
``rank`` and ``gpu`` (multi-select, "All" is the regex ``.*``).

:func:`check_series` is the test the dashboard must pass against a live Prometheus: each
panel query, with Grafana's ``$__rate_interval`` / ``$__range`` / template variables
substituted the way Grafana substitutes them, must return at least one series.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import gauge, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders import prometheus as gprom
from grafana_foundation_sdk.builders.common import (
    ReduceDataOptions,
    VizLegendOptions,
    VizTooltipOptions,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as mdash

#: The Grafana release the compose stack runs: the newest patch of the 10.1 line, which the
#: pinned grafana-foundation-sdk (``1769699998!10.1.0``, "types and builders generated for
#: Grafana v10.1.x" in its README) targets.
GRAFANA_VERSION = "10.1.10"

#: Dashboard uid: stable, so ``dashboards push`` updates the same dashboard in place.
DASHBOARD_UID = "autominato-loader"
DASHBOARD_TITLE = "autominato data loader"
#: uid of the Prometheus data source that file provisioning and ``dashboards push`` create.
DATASOURCE_UID = "autominato-prometheus"
DATASOURCE_NAME = "Prometheus (autominato)"
#: Every panel and query reads its data source from this template variable.
DATASOURCE = mdash.DataSourceRef(type_val="prometheus", uid="${datasource}")

#: The value a multi-select variable takes for "All": a regex that also matches an absent label.
ALL_VALUE = ".*"

#: Label matchers of the loader's own metrics and of the NVML / DCGM GPU metrics.
LOADER = 'job=~"$job", rank=~"$rank"'
NVML = 'job=~"$job", gpu=~"$gpu"'
# DCGM exporter series come from the exporter's own scrape job, so ``job`` does not apply.
DCGM = 'gpu=~"$gpu"'

#: Title of the row whose panels read only NVML / DCGM metrics (no series without a GPU).
GPU_ROW = "GPU (NVML, DCGM exporter)"

_QUANTILES = (0.5, 0.99)


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel: ``expr``, Grafana's ``legendFormat``, and whether it is
    an instant query (one value at the range's end) rather than a range query."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class PanelSpec:
    """What one panel shows; :func:`build_dashboard` turns it into SDK builders.

    ``kind`` is a Grafana panel type (``timeseries``, ``stat``, ``gauge``, ``state-timeline``);
    ``unit`` a Grafana unit id (``s``, ``Bps``, ``bytes``, ``percentunit``, ``suffix:...``);
    ``w`` / ``h`` grid columns (of 24) and rows.
    """

    title: str
    kind: str
    unit: str
    queries: tuple[Query, ...]
    description: str
    w: int = 12
    h: int = 8
    min: float | None = None
    max: float | None = None
    bars: bool = False
    stepped: bool = False
    thresholds: tuple[tuple[float | None, str], ...] = ()


def _quantiles(metric: str, by: str, legend: str, selector: str = LOADER) -> tuple[Query, ...]:
    """p50 and p99 of Prometheus histogram ``metric`` (seconds) grouped ``by`` labels.

    ``histogram_quantile`` over ``sum by (le, ...) (rate(..._bucket[...]))`` is the
    aggregation Prometheus documents for histograms ("Histograms and summaries").
    """
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            f"{legend} p{round(q * 100)}",
        )
        for q in _QUANTILES
    )


def _rate(metric: str, by: str, selector: str = LOADER) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def _in_range(metric: str) -> Query:
    """Increase of counter ``metric`` over the dashboard's whole time range (one value)."""
    return Query(f"sum(increase({metric}{{{LOADER}}}[$__range]))", instant=True)


_IDLE_THRESHOLDS = ((None, "green"), (0.1, "yellow"), (0.3, "red"))

#: Busy share of each stage's workers: service seconds per second over the workers. Stages
#: without workers of their own (the transfer stage without a device) are left out by
#: ``> 0`` rather than divided by zero.
STAGE_UTILISATION = (
    f"{_rate('autominato_stage_service_seconds_sum', 'stage')} / "
    f"(sum by (stage) (autominato_stage_workers{{{LOADER}}}) > 0)"
)

#: (panel, refId) of queries that have no data until a batch is copied to a CUDA device:
#: the exporter's bandwidth gauge (a bandwidth of no copies is undefined), the bandwidth over
#: the rate interval and the copy time's quantiles (NaN: 0 / 0, and quantiles of an empty
#: histogram; trial 168: they were counted as data on a host without a device).
DEVICE_TARGETS = frozenset({("Host-to-device bandwidth", "A"), ("Host-to-device bandwidth", "B"),
                            ("Host-to-device copy time", "A"), ("Host-to-device copy time", "B")})
#: (panel, refId) of the worker processes' figures: no series with thread workers or
#: ``workers=0``.
WORKER_PROCESS_TARGETS = frozenset({("Loader CPU demand", "A"), ("Loader CPU demand", "B"),
                                    ("Loader CPU demand", "C")})
#: (panel, refId) of the controller's decisions and the knob changes' annotation: no data
#: while no knob changed (``autotune=False``, or a controller that held every knob; trial
#: 171: the check failed such a healthy run).
DECISION_TARGETS = frozenset({("Controller decisions", "A"), ("annotation: Knob changes", "")})
#: (panel, refId) of a read stage of its own's figures (threads of the training process): no
#: series where the worker processes read (``fuse_read=True``, the default).
READ_THREAD_TARGETS = frozenset({("Loader CPU demand", "D"), ("Loader CPU demand", "E")})
_COUNT_THRESHOLDS = ((None, "green"), (1.0, "orange"))

#: The dashboard, row by row. Titles are unique (tests and ``dashboards check`` name panels).
ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Overview",
        (
            PanelSpec(
                "Throughput", "stat", "suffix: samples/s",
                (Query(f"sum(rate(autominato_samples_total{{{LOADER}}}[$__rate_interval]))"),),
                "Samples delivered to the training loop per second, all selected ranks.",
                w=4, h=4,
            ),
            PanelSpec(
                "Batches", "stat", "suffix: batches/s",
                (Query(f"sum(rate(autominato_batches_total{{{LOADER}}}[$__rate_interval]))"),),
                "Batches delivered to the training loop per second, all selected ranks.",
                w=4, h=4,
            ),
            PanelSpec(
                "Accelerator idle", "gauge", "percentunit",
                (Query(f"max(autominato_accelerator_idle_ratio{{{LOADER}}})"),),
                "Worst rank's share of time the training loop waits in next() (sliding "
                "window): the accelerator's idle time caused by the loader.",
                w=4, h=4, min=0.0, max=1.0, thresholds=_IDLE_THRESHOLDS,
            ),
            PanelSpec(
                "Stragglers in range", "stat", "short",
                (_in_range("autominato_stragglers_total"),),
                "Samples that joined a later batch than their place in the epoch's order (not ready "
                "when an earlier batch filled: any sample slower than those after it).",
                w=4, h=4, thresholds=_COUNT_THRESHOLDS,
            ),
            PanelSpec(
                "Skipped samples in range", "stat", "short",
                (_in_range("autominato_samples_skipped_total"),),
                "Samples dropped by on_error='skip' (unreadable or failing transform).",
                w=4, h=4, thresholds=_COUNT_THRESHOLDS,
            ),
            PanelSpec(
                "Worker restarts in range", "stat", "short",
                (_in_range("autominato_worker_restarts_total"),),
                "Transform worker processes replaced after dying or hanging.",
                w=4, h=4, thresholds=_COUNT_THRESHOLDS,
            ),
        ),
    ),
    (
        "Pipeline stages",
        (
            PanelSpec(
                "Stage service time", "timeseries", "s",
                _quantiles("autominato_stage_service_seconds", "stage", "{{stage}}"),
                "p50 / p99 seconds an item spends inside each stage's function.",
            ),
            PanelSpec(
                "Stage queue wait", "timeseries", "s",
                _quantiles("autominato_stage_wait_seconds", "stage", "{{stage}}"),
                "p50 / p99 seconds an item waits in a stage's input queue before service.",
            ),
            PanelSpec(
                "Queue fill", "timeseries", "percentunit",
                (
                    Query(
                        f"sum by (stage) (autominato_stage_queue_items{{{LOADER}}}) / "
                        f"(sum by (stage) (autominato_stage_queue_capacity_items{{{LOADER}}})"
                        " > 0)",
                        "{{stage}}",
                    ),
                ),
                "Items queued / queue capacity per stage: a full queue sits before the "
                "bottleneck, an empty one after it. The transfer stage's queue holds the "
                "batches ready ahead of the training loop (capacity: depth), with or without "
                "a device: full means the loader is ahead of the loop. A stage without a "
                "queue of its own has no line: a read fused into the transform workers, and the "
                "transform stage when its workers read (the default: samples go to free "
                "workers only, and its queue holds only those waiting for memory).",
                w=8, min=0.0, max=1.0,
            ),
            PanelSpec(
                "Stage throughput", "timeseries", "suffix: items/s",
                (Query(_rate("autominato_stage_items_total", "stage"), "{{stage}}"),),
                "Items finished per second by each stage.",
                w=8,
            ),
            PanelSpec(
                "Stage bandwidth", "timeseries", "Bps",
                (Query(_rate("autominato_stage_bytes_total", "stage"), "{{stage}}"),),
                "Bytes produced per second by each stage. No read series while reads are "
                "fused into the transform workers (the default): the bytes read are not "
                "measured there, and the transform's are the samples as they leave.",
                w=8,
            ),
            PanelSpec(
                "Stage utilisation", "timeseries", "percentunit",
                (Query(STAGE_UTILISATION, "{{stage}}"),),
                "Share of each stage's workers' time spent in its function (service seconds "
                "per second / workers). The stage near 100 % while the loop waits is the "
                "bottleneck. With reads fused into the transform workers both stages count "
                "the same workers, and their two lines add up to those workers' use.",
                w=24, min=0.0, max=1.0, thresholds=((None, "green"), (0.8, "orange"), (0.95, "red")),
            ),
            PanelSpec(
                "Active workers", "timeseries", "short",
                (Query("sum by (stage) (autominato_stage_workers{" + LOADER + "})", "{{stage}}"),),
                "Workers / threads running in each stage (the controller changes them).",
                w=24, h=6, stepped=True,
            ),
        ),
    ),
    (
        "Accelerator feed",
        (
            PanelSpec(
                "Accelerator idle ratio", "timeseries", "percentunit",
                (Query(f"autominato_accelerator_idle_ratio{{{LOADER}}}", "rank {{rank}}"),),
                "Share of time the training loop waits in next(), per rank (sliding window).",
                min=0.0, max=1.0,
            ),
            PanelSpec(
                "Consumer wait in next()", "timeseries", "s",
                _quantiles("autominato_consumer_wait_seconds", "rank", "rank {{rank}}"),
                "p50 / p99 seconds the training loop is blocked in next() per batch.",
            ),
            PanelSpec(
                "Consumer step time", "timeseries", "s",
                (
                    *_quantiles("autominato_consumer_step_seconds", "rank", "rank {{rank}}"),
                    Query(
                        _rate("autominato_consumer_step_seconds_sum", "rank") + " / "
                        + _rate("autominato_consumer_step_seconds_count", "rank"),
                        "rank {{rank}} mean",
                    ),
                ),
                "p50 / p99 / mean seconds of the training loop's step: from the return of "
                "a batch to the loop's next request of the loader (the last batch of an "
                "epoch included, time between epochs excluded). Compare with the stages' "
                "time per batch.",
            ),
            PanelSpec(
                "Samples per second", "timeseries", "suffix: samples/s",
                (Query(_rate("autominato_samples_total", "rank"), "rank {{rank}}"),),
                "Samples delivered to the training loop per second, per rank.",
                w=12,
            ),
            PanelSpec(
                "Host-to-device bandwidth", "timeseries", "Bps",
                (
                    Query(
                        f"autominato_h2d_bandwidth_bytes_per_second{{{LOADER}}}",
                        "rank {{rank}} exporter window",
                    ),
                    # Bytes over copy time, both counters: the same figure over the rate
                    # interval, so it can be compared across ranks and zoomed.
                    Query(
                        _rate("autominato_h2d_bytes_total", "rank")
                        + " / "
                        + _rate("autominato_h2d_copy_seconds_sum", "rank"),
                        "rank {{rank}} rate interval",
                    ),
                ),
                "Achieved bandwidth of host-to-device copies (bytes / copy time), bytes/s. "
                "Empty until a batch is copied to a CUDA device.",
                w=12,
            ),
            PanelSpec(
                "Host-to-device copy time", "timeseries", "s",
                _quantiles("autominato_h2d_copy_seconds", "rank", "rank {{rank}}"),
                "p50 / p99 seconds of one batch's host-to-device copy.",
                w=12,
            ),
        ),
    ),
    (
        GPU_ROW,
        (
            PanelSpec(
                "GPU utilisation", "timeseries", "percentunit",
                (
                    Query(f"autominato_gpu_utilization_ratio{{{NVML}}}", "GPU {{gpu}} NVML"),
                    # DCGM reports percent (0..100); the panel's unit is a 0..1 ratio.
                    Query(f"DCGM_FI_DEV_GPU_UTIL{{{DCGM}}} / 100", "GPU {{gpu}} DCGM"),
                ),
                "Share of time a kernel ran on the GPU: autominato's NVML reader and, when "
                "scraped, the DCGM exporter.",
                w=8, min=0.0, max=1.0,
            ),
            PanelSpec(
                "GPU memory used", "timeseries", "bytes",
                (
                    Query(f"autominato_gpu_memory_used_bytes{{{NVML}}}", "GPU {{gpu}} NVML"),
                    # DCGM_FI_DEV_FB_USED is in MiB.
                    Query(f"DCGM_FI_DEV_FB_USED{{{DCGM}}} * 1048576", "GPU {{gpu}} DCGM"),
                ),
                "Device memory in use (NVML, and DCGM's framebuffer-used figure).",
                w=8,
            ),
            PanelSpec(
                "PCIe bandwidth", "timeseries", "Bps",
                (
                    Query(
                        f"autominato_gpu_pcie_tx_bytes_per_second{{{NVML}}}", "GPU {{gpu}} tx NVML"
                    ),
                    Query(
                        f"autominato_gpu_pcie_rx_bytes_per_second{{{NVML}}}", "GPU {{gpu}} rx NVML"
                    ),
                    Query(f"DCGM_FI_PROF_PCIE_TX_BYTES{{{DCGM}}}", "GPU {{gpu}} tx DCGM"),
                    Query(f"DCGM_FI_PROF_PCIE_RX_BYTES{{{DCGM}}}", "GPU {{gpu}} rx DCGM"),
                ),
                "PCIe bytes per second the GPU transmits (tx) and receives (rx; host-to-device "
                "copies land here).",
                w=8,
            ),
        ),
    ),
    (
        "Controller",
        (
            PanelSpec(
                "Knob values", "state-timeline", "short",
                (Query(f"autominato_knob_value{{{LOADER}}}", "{{knob}} rank {{rank}}"),),
                "Each knob's value over time; a new block is a change by the online "
                "controller (or by the user).",
                w=24, h=7,
            ),
            PanelSpec(
                "Controller decisions", "timeseries", "short",
                (
                    Query(
                        "sum by (knob, reason) (increase(autominato_controller_decisions_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "{{knob}}: {{reason}}",
                    ),
                ),
                "Decisions of the online controller per rate interval, by knob and reason.",
                bars=True,
            ),
            PanelSpec(
                "Buffer pool", "timeseries", "bytes",
                (Query(f"autominato_pool_bytes{{{LOADER}}}", "rank {{rank}}"),),
                "Bytes held by the buffer pool (shared-memory slots and batch buffers).",
            ),
            PanelSpec(
                "Workers idle for memory", "timeseries", "short",
                (
                    Query(
                        "sum by (rank) (rate(autominato_memory_wait_seconds_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "rank {{rank}}",
                    ),
                ),
                "Mean number of free workers that waited because the samples queued for "
                "them did not fit in the memory budget (memory-aware dispatch, "
                "docs/memory.md). Idle worker time, not lost throughput: a cost only where "
                "the loader is the bottleneck (training loop idle), where memory_aware=False "
                "may give part of it back at the cost of the peak memory.",
            ),
            PanelSpec(
                "Loader CPU demand", "timeseries", "short",
                (
                    Query(
                        "sum by (rank) (rate(autominato_loader_cpu_seconds_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "ran on rank {{rank}}",
                    ),
                    Query(
                        "sum by (rank) (rate(autominato_loader_cpu_seconds_total{"
                        + LOADER
                        + "}[$__rate_interval]) + rate(autominato_loader_runqueue_wait_seconds_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "ran on or waited for rank {{rank}}",
                    ),
                    Query(
                        "sum by (rank) (rate(autominato_loader_cpu_system_seconds_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "in the kernel, rank {{rank}}",
                    ),
                    Query(
                        "sum by (rank) (rate(autominato_stage_cpu_seconds_total{"
                        + LOADER
                        + ', stage="read"}[$__rate_interval]))',
                        "read threads ran on, rank {{rank}}",
                    ),
                    Query(
                        "sum by (rank) (rate(autominato_stage_cpu_seconds_total{"
                        + LOADER
                        + ', stage="read"}[$__rate_interval]) + '
                        "rate(autominato_stage_runqueue_wait_seconds_total{"
                        + LOADER
                        + ', stage="read"}[$__rate_interval]))',
                        "read threads ran on or waited for, rank {{rank}}",
                    ),
                ),
                "Cores the loader's worker processes ran on (CPU time), and ran on or waited "
                "for (plus the run-queue wait): demand near the usable cores with the training "
                "loop idle, the loader is CPU bound; well below them, its workers wait "
                "(storage, a remote read); demand above what they ran on, other processes "
                "(the training loop's threads, another job) hold the cores. In the kernel: "
                "the part of their CPU time in system time (page faults and the zeroing of "
                "fresh pages, file reads); a large part of it in a CPU-bound loader is often "
                "memory given back between samples and faulted in again, which "
                "memory_aware=False trades for peak memory (docs/memory.md). No series with "
                "thread workers. Read threads: the cores a read stage of its own ran on "
                "(fuse_read=False or thread workers: threads of the training process, which "
                "share its GIL), and ran on or waited for (plus their run-queue wait); near one "
                "core, or near their reads' time, the reads decode rather than wait for storage.",
            ),
        ),
    ),
    (
        "Stragglers and errors",
        (
            PanelSpec(
                "Stragglers, skips, losses, restarts", "timeseries", "short",
                (
                    Query(
                        "sum by (rank) (increase(autominato_stragglers_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "stragglers rank {{rank}}",
                    ),
                    Query(
                        "sum by (rank) (increase(autominato_samples_skipped_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "skipped rank {{rank}}",
                    ),
                    Query(
                        "sum by (rank) (increase(autominato_samples_lost_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "lost to errors rank {{rank}}",
                    ),
                    Query(
                        "sum by (rank) (increase(autominato_worker_restarts_total{"
                        + LOADER
                        + "}[$__rate_interval]))",
                        "worker restarts rank {{rank}}",
                    ),
                ),
                "Per rate interval: samples that joined a later batch, samples skipped on "
                "error, samples lost with an error the training loop caught (the failing "
                "sample; in order or with a batch_sampler its whole batch), and worker "
                "processes restarted.",
                w=24, bars=True,
            ),
        ),
    ),
)

#: Annotation: a marker on every time-series panel where a knob changed value (the online
#: controller's decisions, or the user's). ``changes`` of the knob gauge rather than
#: ``increase`` of the decision counter, because a counter series that is born at 1 shows no
#: increase in Prometheus, which would hide the first decision of each knob and reason.
KNOB_CHANGES_ANNOTATION = Query(
    f"changes(autominato_knob_value{{{LOADER}}}[$__rate_interval]) > 0",
    "Knob changes",
)

#: Template variables other than ``datasource``: name -> (label, Prometheus query).
#: ``rank`` depends on ``job``, so variables are listed in dependency order.
VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("job", "Job", "label_values(autominato_samples_total, job)"),
    ("rank", "Rank", 'label_values(autominato_samples_total{job=~"$job"}, rank)'),
    (
        "gpu",
        "GPU",
        'label_values({__name__=~"autominato_gpu_utilization_ratio|DCGM_FI_DEV_GPU_UTIL"}, gpu)',
    ),
)


def _panel_builder(spec: PanelSpec) -> Any:
    if spec.kind == "timeseries":
        b = (
            timeseries.Panel()
            .line_width(1)
            .fill_opacity(10)
            .legend(
                VizLegendOptions()
                .show_legend(True)
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
            )
            .tooltip(VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
        )
        if spec.bars:
            b = b.draw_style(common.GraphDrawStyle.BARS).fill_opacity(60)
        if spec.stepped:
            b = b.line_interpolation(common.LineInterpolation.STEP_AFTER)
    elif spec.kind == "stat":
        b = (
            stat.Panel()
            .graph_mode(common.BigValueGraphMode.AREA)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
        )
    elif spec.kind == "gauge":
        b = gauge.Panel().reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
    elif spec.kind == "state-timeline":
        b = (
            statetimeline.Panel()
            .show_value(common.VisibilityMode.ALWAYS)
            .merge_values(True)
            .line_width(0)
            .fill_opacity(70)
            .legend(VizLegendOptions().show_legend(False))
        )
    else:
        raise ValueError(f"panel {spec.title!r}: unknown panel kind {spec.kind!r}")
    b = (
        b.title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .span(spec.w)
        .height(spec.h)
    )
    if spec.min is not None:
        b = b.min(spec.min)
    if spec.max is not None:
        b = b.max(spec.max)
    if spec.thresholds:
        b = b.thresholds(
            gdash.ThresholdsConfig()
            .mode(mdash.ThresholdsMode.ABSOLUTE)
            .steps([mdash.Threshold(value=v, color=c) for v, c in spec.thresholds])
        )
    for i, q in enumerate(spec.queries):
        target = (
            gprom.Dataquery()
            .expr(q.expr)
            .legend_format(q.legend or "__auto")
            .ref_id(chr(ord("A") + i))
            .datasource(DATASOURCE)
        )
        b = b.with_target(target.instant() if q.instant else target.range())
    return b


def _variable(name: str, label: str, query: str) -> gdash.QueryVariable:
    return (
        gdash.QueryVariable(name)
        .id(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED)
        # Ranks and GPU indices are numbers: 2 before 10.
        .sort(
            mdash.VariableSort.ALPHABETICAL_ASC
            if name == "job"
            else mdash.VariableSort.NUMERICAL_ASC
        )
        .multi(True)
        .include_all(True)
        .all_value(ALL_VALUE)
        .current(mdash.VariableOption(selected=True, text="All", value="$__all"))
    )


def build_dashboard() -> dict[str, Any]:
    """The dashboard as a JSON-ready ``dict`` (Grafana dashboard model, SDK schema version).

    Panel ids are 1, 2, ... in layout order (rows included), so the output is deterministic.

    Raises:
        ValueError: a :data:`ROWS` entry names an unknown panel kind.
    """
    b = (
        gdash.Dashboard(DASHBOARD_TITLE)
        .uid(DASHBOARD_UID)
        .description(
            "autominato's staged data loader: stage latency and queues, accelerator idle "
            "time, host-to-device copies, GPU (NVML / DCGM), knobs and controller decisions."
        )
        .tags(["autominato", "data-loader", "prometheus"])
        .editable()
        .tooltip(mdash.DashboardCursorSync.CROSSHAIR)
        .time("now-15m", "now")
        .refresh("5s")
        .timezone("browser")
        .with_variable(
            gdash.DatasourceVariable("datasource")
            .id("datasource")
            .label("Data source")
            .type("prometheus")
            .current(mdash.VariableOption(selected=True, text=DATASOURCE_NAME, value=DATASOURCE_UID))
        )
        .annotation(
            gdash.AnnotationQuery()
            .name(KNOB_CHANGES_ANNOTATION.legend)
            .datasource(DATASOURCE)
            .enable(True)
            .icon_color("orange")
            .expr(KNOB_CHANGES_ANNOTATION.expr)
        )
    )
    for name, label, query in VARIABLES:
        b = b.with_variable(_variable(name, label, query))
    panel_id = 0
    for row_title, specs in ROWS:
        panel_id += 1
        b = b.with_row(gdash.Row(row_title).id(panel_id))
        for spec in specs:
            panel_id += 1
            b = b.with_panel(_panel_builder(spec).id(panel_id))
    return json.loads(json.dumps(b.build(), cls=JSONEncoder))


def dashboard_json() -> str:
    """:func:`build_dashboard` as the text of ``dashboards/autominato.json`` (sorted keys,
    2-space indent, trailing newline), so regeneration is byte-for-byte stable."""
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------------------------
# Validating the dashboard model against the pinned SDK's schema.


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in b:
                out.append(f"{path}/{k}: not in the schema (dropped by the SDK model)")
            elif k not in a:
                out.append(f"{path}/{k}: missing (the SDK model adds {b[k]!r})")
            else:
                _diff(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {a!r} is read back as {b!r}")


def _all_panels(panels: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    for p in panels:
        yield p
        yield from _all_panels(p.get("panels") or [])


def schema_problems(dash: Mapping[str, Any]) -> list[str]:
    """What keeps ``dash`` from being a valid dashboard of the pinned schema; ``[]`` if none.

    Checks: ``schemaVersion`` is the SDK's (36 for grafana-foundation-sdk 10.1); the model
    reads back unchanged through the SDK's typed models (so no key is unknown to the schema
    and none has the wrong shape); every panel type is one the SDK knows; panel ids are unique
    integers; grid positions fit the 24-column grid without overlapping; every query target
    has a unique ``refId`` and a ``datasource``; every ``$variable`` in a query is defined.
    """
    from grafana_foundation_sdk.cog import runtime
    from grafana_foundation_sdk.cog.plugins import register_default_plugins

    register_default_plugins()
    problems: list[str] = []
    expected_version = mdash.Dashboard().schema_version
    if dash.get("schemaVersion") != expected_version:
        problems.append(f"schemaVersion {dash.get('schemaVersion')!r} != {expected_version}")
    if not dash.get("uid"):
        problems.append("no uid")
    try:
        back = json.loads(json.dumps(mdash.Dashboard.from_json(dict(dash)), cls=JSONEncoder))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        problems.append(f"the SDK model cannot read the dashboard: {e!r}")
    else:
        _diff(dict(dash), back, "", problems)

    ids: dict[Any, str] = {}
    cells: dict[tuple[int, int], str] = {}
    for p in _all_panels(dash.get("panels") or []):
        title = p.get("title", "?")
        pid = p.get("id")
        if not isinstance(pid, int) or isinstance(pid, bool):
            problems.append(f"panel {title!r}: id {pid!r} is not an integer")
        elif pid in ids:
            problems.append(f"panel {title!r}: id {pid} already used by {ids[pid]!r}")
        else:
            ids[pid] = title
        ptype = p.get("type")
        if ptype != "row" and runtime.panelcfg_config(str(ptype)) is None:
            problems.append(f"panel {title!r}: unknown panel type {ptype!r}")
        pos = p.get("gridPos") or {}
        x, y, w, h = (pos.get(k, -1) for k in ("x", "y", "w", "h"))
        if min(x, y) < 0 or w < 1 or h < 1 or x + w > 24:
            problems.append(f"panel {title!r}: gridPos {pos} is outside the 24-column grid")
        else:
            for cell in ((cx, cy) for cx in range(x, x + w) for cy in range(y, y + h)):
                if cell in cells:
                    problems.append(f"panel {title!r} overlaps panel {cells[cell]!r} at {cell}")
                    break
                cells[cell] = title
        refs: set[str] = set()
        for t in p.get("targets") or []:
            ref = t.get("refId")
            if not ref:
                problems.append(f"panel {title!r}: a target has no refId")
            elif ref in refs:
                problems.append(f"panel {title!r}: refId {ref!r} used twice")
            refs.add(ref or "")
            ds = t.get("datasource")
            if not isinstance(ds, dict) or not ds.get("type") or not ds.get("uid"):
                problems.append(f"panel {title!r} target {ref!r}: no datasource type and uid")

    names = [v.get("name") for v in (dash.get("templating") or {}).get("list") or []]
    if len(set(names)) != len(names):
        problems.append(f"template variable names repeat: {names}")
    placeholder = {str(n): "x" for n in names}
    for t in dashboard_targets(dash):
        try:
            interpolate(t.expr, placeholder, interval_s=1, range_s=1, scrape_interval_s=1)
        except KeyError as e:
            problems.append(f"panel {t.panel!r} [{t.ref_id}]: {e.args[0]}")
    return problems


# --------------------------------------------------------------------------------------------
# Checking the dashboard's queries against a live Prometheus.


@dataclass(frozen=True)
class Target:
    """One query of the dashboard: the panel (or annotation) it belongs to and its PromQL."""

    panel: str
    ref_id: str
    expr: str
    instant: bool = False


def dashboard_targets(dash: Mapping[str, Any]) -> list[Target]:
    """Every PromQL query of dashboard ``dash`` (panels, panels inside rows, annotations)."""
    out: list[Target] = []

    def walk(panels: Iterable[Mapping[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets") or []:
                out.append(
                    Target(
                        p.get("title", ""),
                        t.get("refId", ""),
                        t.get("expr", ""),
                        bool(t.get("instant")) and not t.get("range"),
                    )
                )
            walk(p.get("panels") or [])

    walk(dash.get("panels") or [])
    for a in (dash.get("annotations") or {}).get("list") or []:
        if a.get("expr"):
            out.append(Target(f"annotation: {a.get('name', '')}", "", a["expr"]))
    return out


def _duration(seconds: float) -> str:
    """Prometheus duration of whole seconds (at least 1 s), e.g. ``"4s"``."""
    return f"{max(1, math.ceil(seconds))}s"


_VAR = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def interpolate(
    expr: str,
    variables: Mapping[str, str],
    *,
    interval_s: float,
    range_s: float,
    scrape_interval_s: float,
) -> str:
    """Substitute Grafana's built-in and template variables in PromQL ``expr``.

    * ``$__interval``: ``interval_s`` (the query step).
    * ``$__rate_interval``: ``max($__interval + scrape interval, 4 * scrape interval)``, the
      definition in Grafana's Prometheus data source docs ("Use $__rate_interval").
    * ``$__range``: ``range_s``, the dashboard's time range.
    * ``$name`` / ``${name}``: ``variables[name]``, already formatted (a regex for ``=~``).

    Durations are rounded up to whole seconds.

    Raises:
        KeyError: ``expr`` uses a variable that is neither built in nor in ``variables``.
    """
    builtins = {
        "__interval": _duration(interval_s),
        "__rate_interval": _duration(max(interval_s + scrape_interval_s, 4 * scrape_interval_s)),
        "__range": _duration(range_s),
    }

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in builtins:
            return builtins[name]
        if name in variables:
            return variables[name]
        raise KeyError(f"query uses ${name}, which is not a dashboard variable: {expr}")

    return _VAR.sub(sub, expr)


def regex_escape(value: str) -> str:
    """``value`` as Grafana puts one selected value into a PromQL ``=~"..."`` matcher.

    Regex metacharacters get a backslash, itself doubled because the regex sits inside a
    PromQL string literal (``a.b`` -> ``a\\\\.b`` in the query text); the character set is
    the one of Grafana's ``prometheusSpecialRegexEscape`` (Prometheus data source).
    """
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


#: ``label_values(selector, label)``, the Grafana Prometheus variable query form used here.
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$")


def _get(url: str, timeout: float) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        raise RuntimeError(f"Prometheus answered HTTP {e.code} to {url}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ConnectionError(f"cannot reach Prometheus at {url}: {e}") from e
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus query failed: {url}: {body}")
    return body["data"]


@dataclass
class PrometheusAPI:
    """The two read endpoints of Prometheus' HTTP API v1 that the check needs.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:9090``.
        timeout: seconds per request.
    """

    url: str
    timeout: float = 10.0
    get: Callable[[str, float], Any] = field(default=_get, repr=False)

    def _call(self, path: str, params: list[tuple[str, str]]) -> Any:
        qs = urllib.parse.urlencode(params)
        return self.get(f"{self.url.rstrip('/')}/api/v1/{path}?{qs}", self.timeout)

    def label_values(self, label: str, selector: str, start: float, end: float) -> list[str]:
        """Values of ``label`` on series matching ``selector`` between ``start`` and ``end``
        (Unix seconds); what Grafana's ``label_values(selector, label)`` variable lists."""
        params = [("match[]", selector), ("start", str(start)), ("end", str(end))]
        return sorted(self._call(f"label/{label}/values", params))

    def query(self, expr: str, time: float) -> list[dict]:
        """Result series (``vector``) of instant query ``expr`` at ``time`` (Unix seconds)."""
        return self._call("query", [("query", expr), ("time", str(time))])["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        """Result series (``matrix``) of ``expr`` over ``[start, end]`` every ``step_s`` s."""
        params = [
            ("query", expr),
            ("start", str(start)),
            ("end", str(end)),
            ("step", _duration(step_s)),
        ]
        return self._call("query_range", params)["result"]


def resolve_variables(
    dash: Mapping[str, Any], prom: PrometheusAPI, start: float, end: float
) -> dict[str, str]:
    """Pick a value for each query variable of ``dash`` the way a user opening it would.

    Each variable's ``label_values`` query runs against ``prom`` (earlier variables
    substituted first); the first value (escaped by :func:`regex_escape`) is taken, or :data:`ALL_VALUE` when the query finds none (the GPU variable on a
    host without a GPU).

    Raises:
        ValueError: a query variable is not of the ``label_values(selector, label)`` form.
    """
    chosen: dict[str, str] = {}
    for var in (dash.get("templating") or {}).get("list") or []:
        if var.get("type") != "query":
            continue
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else str(query)
        m = _LABEL_VALUES.match(query)
        if m is None:
            raise ValueError(f"variable {var.get('name')!r}: unsupported query {query!r}")
        selector = interpolate(
            m.group(1), chosen, interval_s=1.0, range_s=end - start, scrape_interval_s=1.0
        )
        values = prom.label_values(m.group(2), selector, start, end)
        chosen[var["name"]] = regex_escape(values[0]) if values else ALL_VALUE
    return chosen


@dataclass(frozen=True)
class TargetResult:
    """Outcome of one query in :func:`check_series`: the query as sent, its series count."""

    target: Target
    query: str
    series: int


def check_series(
    dash: Mapping[str, Any],
    prom: PrometheusAPI,
    *,
    start: float,
    end: float,
    step_s: float = 1.0,
    scrape_interval_s: float = 15.0,
) -> list[TargetResult]:
    """Run every query of ``dash`` over ``[start, end]`` (Unix seconds) against ``prom``.

    Variables come from :func:`resolve_variables`; built-ins from :func:`interpolate` with
    ``$__interval = step_s`` and ``$__range = end - start``. ``scrape_interval_s`` is the
    data source's scrape interval setting (Grafana's default is 15 s).

    Returns:
        one :class:`TargetResult` per query, in dashboard order: its series with at least
        one number (NaN and infinities draw nothing: a series of them is no data);
        ``series == 0`` means the panel would show nothing for that query.
    """
    variables = resolve_variables(dash, prom, start, end)
    results = []
    for t in dashboard_targets(dash):
        q = interpolate(
            t.expr,
            variables,
            interval_s=step_s,
            range_s=end - start,
            scrape_interval_s=scrape_interval_s,
        )
        found = prom.query(q, end) if t.instant else prom.query_range(q, start, end, step_s)
        results.append(TargetResult(t, q, sum(1 for f in found if _has_number(f))))
    return results


def _has_number(series: Mapping[str, Any]) -> bool:
    """A query result's series (``value`` of an instant query, ``values`` of a range) has a
    finite value: Prometheus sends NaN and infinities as the strings "NaN", "+Inf", "-Inf"."""
    points = series.get("values") or ([series["value"]] if "value" in series else [])
    return any(math.isfinite(float(v)) for _, v in points)


def gpu_panel_titles() -> list[str]:
    """Titles of the panels that read only NVML / DCGM metrics (the :data:`GPU_ROW` row)."""
    return [s.title for row, specs in ROWS if row == GPU_ROW for s in specs]
