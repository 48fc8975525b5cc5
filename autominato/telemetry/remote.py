"""``autominato monitor URL``: the Data Monitor report of a loader that runs elsewhere.

Fetches the exporter's ``/metrics`` twice, ``--interval`` seconds apart, rebuilds a
:class:`~autominato.pipeline.stats.LoaderSnapshot` per ``rank`` from the exposition (counters,
histogram sums and gauges carry every cumulative figure :func:`diagnose` reads), and prints the
same report the training job would log. The one approximation: the consumer's per-batch waits
are rebuilt from the ``autominato_consumer_wait_seconds`` histogram's buckets (each wait taken
as its bucket's midpoint), which only feeds the "queue wait share" line.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from autominato.pipeline.stats import RECENT, LoaderSnapshot, StageSnapshot
from autominato.telemetry.cores import (
    CPU_OF_WORKERS_KEY,
    CPU_SECONDS_KEY,
    CPU_TIME_SECONDS_KEY,
    KERNEL_SECONDS_KEY,
    RUNQUEUE_SECONDS_KEY,
)
from autominato.telemetry.exporter import DEFAULT_PORT
from autominato.telemetry.metrics import STAGES
from autominato.telemetry.monitor import diagnose, format_report

#: label values -> value, per sample name
_Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def metrics_url(url: str) -> str:
    """Complete ``url``: ``host:port`` gets ``http://`` and a bare root gets ``/metrics``."""
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        rest += "/metrics"
    return f"{scheme}://{rest}"


def url_problem(url: str) -> str | None:
    """Why ``metrics_url(url)`` cannot be fetched (``None`` when it can be tried): not ``http``
    or ``https``, no host, a port that is no number, a malformed address (``http://[bad``)."""
    try:
        parts = urllib.parse.urlsplit(metrics_url(url))
        _ = parts.port  # raises ValueError when the port is not a number in range
    except ValueError as e:
        return f"{url!r} is not a URL ({e})"
    if parts.scheme not in ("http", "https"):
        return f"{url!r}: the scheme must be http or https, got {parts.scheme!r}"
    if not parts.hostname:
        return f"{url!r} names no host (give host:port or http://host:port/metrics)"
    return None


def fetch(url: str, timeout: float = 5.0) -> str:
    """GET ``url`` and return the exposition text.

    Raises:
        OSError: the exporter cannot be reached or answers with an HTTP error (urllib's
            ``URLError`` / ``HTTPError`` are ``OSError`` subclasses).
    """
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", errors="replace")


def _samples(text: str, url: str = "") -> _Samples:
    """The samples of an exposition, by name and sorted labels.

    Raises:
        LookupError: ``text`` is not Prometheus's text format (an HTML page, say: trial 146
            got a traceback from the parser).
    """
    out: _Samples = defaultdict(dict)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name][tuple(sorted(s.labels.items()))] = float(s.value)
    except ValueError as e:
        raise LookupError(f"{url or 'the endpoint'} does not answer in Prometheus's text format "
                          f"({e}): is it the exporter's /metrics?") from e
    return out


def _get(samples: _Samples, name: str, **labels: str) -> float:
    """A series' value, 0.0 where it is not exported."""
    value = _find(samples, name, **labels)
    return 0.0 if value is None else value


def _find(samples: _Samples, name: str, **labels: str) -> float | None:
    """A series' value, ``None`` where it is not exported (not measured: a stage's CPU)."""
    want = set(labels.items())
    return next((v for key, v in samples.get(name, {}).items() if want <= set(key)), None)


def _ranks(samples: _Samples) -> list[str]:
    # Live loaders' labels: a gauge's (a closed loader's label keeps its counters exported)
    ranks = {dict(k)["rank"] for k in samples.get("autominato_epoch", {})}
    return sorted(ranks, key=lambda r: (len(r), r))


def _buckets(samples: _Samples, name: str, rank: str) -> list[tuple[float, float]]:
    """Cumulative ``(le, count)`` pairs of histogram ``name`` for ``rank``, by ``le``."""
    pairs = []
    for key, value in samples.get(name + "_bucket", {}).items():
        labels = dict(key)
        if labels.get("rank") == rank:
            pairs.append((float(labels["le"]), value))
    return sorted(pairs)


def _waits_from_buckets(
    before: list[tuple[float, float]], after: list[tuple[float, float]]
) -> tuple[float, ...]:
    """Per-batch waits rebuilt from the bucket counts that grew between two fetches."""
    prev = dict(before)
    waits: list[float] = []
    lower, below = 0.0, 0.0
    for le, cum in after:
        grown = cum - prev.get(le, 0.0)
        n = int(round(grown - below))
        below = grown
        value = le if le != float("inf") else lower * 2
        waits.extend([(lower + value) / 2] * max(0, n))
        lower = le if le != float("inf") else lower
    if len(waits) > RECENT:  # thin evenly, keeping the distribution's shape
        step = len(waits) / RECENT
        waits = [waits[int(i * step)] for i in range(RECENT)]
    return tuple(waits)


def snapshot_from_samples(
    samples: _Samples, rank: str, at: float, previous: _Samples | None = None
) -> LoaderSnapshot:
    """Rebuild rank ``rank``'s :class:`LoaderSnapshot` at monotonic time ``at``.

    ``previous`` (the earlier fetch) lets the consumer's recent waits cover only the batches
    delivered between the two fetches.
    """
    g = _get
    stages = {}
    for stage in STAGES:
        if not samples.get("autominato_stage_items_total", {}) or not any(
            dict(k).get("stage") == stage and dict(k).get("rank") == rank
            for k in samples["autominato_stage_items_total"]
        ):
            continue
        stages[stage] = StageSnapshot(
            name=stage,
            time=at,
            items_total=int(g(samples, "autominato_stage_items_total", stage=stage, rank=rank)),
            bytes_total=int(g(samples, "autominato_stage_bytes_total", stage=stage, rank=rank)),
            service_seconds_total=g(
                samples, "autominato_stage_service_seconds_sum", stage=stage, rank=rank
            ),
            wait_seconds_total=g(
                samples, "autominato_stage_wait_seconds_sum", stage=stage, rank=rank
            ),
            queue_len=int(g(samples, "autominato_stage_queue_items", stage=stage, rank=rank)),
            queue_capacity=int(
                g(samples, "autominato_stage_queue_capacity_items", stage=stage, rank=rank)
            ),
            workers=int(g(samples, "autominato_stage_workers", stage=stage, rank=rank)),
            busy_workers=0,
            cpu_seconds_total=_find(samples, "autominato_stage_cpu_seconds_total",
                                    stage=stage, rank=rank),
            runqueue_seconds_total=_find(samples, "autominato_stage_runqueue_wait_seconds_total",
                                         stage=stage, rank=rank),
        )
    knobs = {
        dict(k)["knob"]: int(v)
        for k, v in samples.get("autominato_knob_value", {}).items()
        if dict(k).get("rank") == rank
    }
    name = "autominato_consumer_wait_seconds"
    waits = _waits_from_buckets(
        _buckets(previous, name, rank) if previous is not None else [],
        _buckets(samples, name, rank),
    )
    info = [dict(k) for k in samples.get("autominato_loader_info", {})
            if dict(k).get("rank") == rank]
    return LoaderSnapshot(
        time=at,
        stages=stages,
        worker_kind=info[0].get("worker_kind", "") if info else "",
        iterable=bool(info) and info[0].get("iterable") == "true",
        memory_aware=bool(info) and info[0].get("memory_aware") == "true",
        warm_heap=bool(info) and info[0].get("warm_heap") == "true",
        consumer_wait_seconds_total=g(samples, name + "_sum", rank=rank),
        consumer_wait_recent_s=waits,
        consumer_busy_seconds_total=g(samples, "autominato_consumer_step_seconds_sum", rank=rank),
        consumer_steps_total=int(g(samples, "autominato_consumer_step_seconds_count", rank=rank)),
        consumer_steps_seconds_total=g(samples, "autominato_consumer_step_seconds_sum", rank=rank),
        batches_total=int(g(samples, "autominato_batches_total", rank=rank)),
        samples_total=int(g(samples, "autominato_samples_total", rank=rank)),
        epoch=int(g(samples, "autominato_epoch", rank=rank)),
        stragglers_total=int(g(samples, "autominato_stragglers_total", rank=rank)),
        skipped_total=int(g(samples, "autominato_samples_skipped_total", rank=rank)),
        errors_raised_total=int(g(samples, "autominato_errors_raised_total", rank=rank)),
        samples_lost_total=int(g(samples, "autominato_samples_lost_total", rank=rank)),
        worker_restarts_total=int(g(samples, "autominato_worker_restarts_total", rank=rank)),
        h2d_bytes_total=int(g(samples, "autominato_h2d_bytes_total", rank=rank)),
        h2d_seconds_total=g(samples, "autominato_h2d_copy_seconds_sum", rank=rank),
        knobs=knobs,
        sample_bytes=0.0,
        pool_bytes=int(g(samples, "autominato_pool_bytes", rank=rank)),
        speculative_discarded_total=int(
            g(samples, "autominato_speculative_samples_discarded_total", rank=rank)),
        cold_starts_total=int(g(samples, "autominato_epoch_cold_starts_total", rank=rank)),
        cold_start_wait_seconds_total=g(
            samples, "autominato_epoch_cold_start_wait_seconds_total", rank=rank),
        between_epochs_seconds_total=g(samples, "autominato_between_epochs_seconds_total",
                                       rank=rank),
        samples_held_for_memory_total=int(
            g(samples, "autominato_samples_held_for_memory_total", rank=rank)),
        sample_memory_budget_bytes=g(samples, "autominato_sample_memory_budget_bytes", rank=rank),
        worker_heap_keep_bytes=g(samples, "autominato_worker_heap_keep_bytes", rank=rank),
        memory_wait_seconds_total=g(samples, "autominato_memory_wait_seconds_total", rank=rank),
        extra=_cpu_extra(samples, rank),
    )


def _cpu_extra(samples: _Samples, rank: str) -> dict[str, float]:
    """The loader's CPU demand as the in-process snapshots carry it (worker processes'), when
    the exporter has it: the diagnosis then tells I/O-bound workers from CPU-bound ones."""
    name, waited = "autominato_loader_cpu_seconds_total", "autominato_loader_runqueue_wait_seconds_total"
    if not any(dict(k).get("rank") == rank for k in samples.get(name, {})):
        return {}
    def has(metric: str) -> bool:
        return any(dict(k).get("rank") == rank for k in samples.get(metric, {}))

    wait = _get(samples, waited, rank=rank) if has(waited) else 0.0
    ran = _get(samples, name, rank=rank)
    kernel = "autominato_loader_cpu_system_seconds_total"
    return {CPU_SECONDS_KEY: ran + wait, CPU_TIME_SECONDS_KEY: ran,
            RUNQUEUE_SECONDS_KEY: wait, CPU_OF_WORKERS_KEY: 1.0,
            **({KERNEL_SECONDS_KEY: _get(samples, kernel, rank=rank)} if has(kernel) else {})}


def remote_reports(url: str, interval: float = 5.0, *, timeout: float = 5.0) -> dict[str, str]:
    """Fetch ``url`` twice ``interval`` seconds apart; return rank -> report text.

    Raises:
        OSError: the exporter cannot be reached.
        LookupError: the endpoint exposes no autominato loader metrics, or answers with
            something other than Prometheus's text format.
    """
    url = metrics_url(url)
    t0, first = time.monotonic(), _samples(fetch(url, timeout), url)
    time.sleep(interval)
    t1, second = time.monotonic(), _samples(fetch(url, timeout), url)
    ranks = _ranks(second)
    if not ranks:
        raise LookupError(f"{url} exposes no live autominato loader (no autominato_epoch series)")
    reports = {}
    for rank in ranks:
        history = [snapshot_from_samples(second, rank, t1, first)]
        if rank in _ranks(first):
            history.insert(0, snapshot_from_samples(first, rank, t0))
        reports[rank] = format_report(diagnose(history), title=f"Data Monitor (rank {rank}) {url}")
    return reports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        nargs="?",
        default=f"http://127.0.0.1:{DEFAULT_PORT}/metrics",
        help="the exporter's metrics URL, or host:port (default: %(default)s)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help="seconds between the two fetches the report compares (default: %(default)s)",
    )
    parser.add_argument("--rank", default=None, help="report only this rank (default: all)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="HTTP timeout, seconds (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    """Print the report of each rank; 2 when unreachable, 1 when there is nothing to report."""
    for flag, v in (("--interval", args.interval), ("--timeout", args.timeout)):
        if not (v > 0 and math.isfinite(v)):
            print(f"autominato monitor: {flag} must be a finite number of seconds > 0, got {v}",
                  file=sys.stderr)
            return 2
    problem = url_problem(args.url)
    if problem is not None:
        print(f"autominato monitor: url {problem}", file=sys.stderr)
        return 2
    try:
        reports = remote_reports(args.url, args.interval, timeout=args.timeout)
    except OSError as e:
        print(f"autominato monitor: cannot read {metrics_url(args.url)}: {e}", file=sys.stderr)
        return 2
    except LookupError as e:
        print(f"autominato monitor: {e}", file=sys.stderr)
        return 1
    if args.rank is not None:
        if args.rank not in reports:
            print(
                f"autominato monitor: no rank {args.rank} at {metrics_url(args.url)} "
                f"(ranks: {', '.join(reports)})",
                file=sys.stderr,
            )
            return 1
        reports = {args.rank: reports[args.rank]}
    print("\n\n".join(reports.values()))
    return 0
