"""Telemetry: Prometheus metrics, NVML GPU figures, the Data Monitor report, and the
measurements they and the controller share.

Public surface:

* :func:`attach` (``loader`` -> :class:`TelemetryHandle`): what ``Loader(metrics_port=...,
  monitor_interval=...)`` calls; records per-stage metrics, optionally serves them and runs
  the Data Monitor.
* :func:`serve`: the ``/metrics`` endpoint on 127.0.0.1 (``PortInUseError`` when taken).
* :func:`diagnose` / :func:`format_report`: the pure bottleneck diagnosis of a snapshot
  history and its text table.
* :data:`REGISTRY`: the registry all autominato metrics live in (names in
  :mod:`autominato.telemetry.metrics`).

Modules: ``metrics`` (definitions), ``collector`` (scrape-time figures from snapshots),
``nvml`` (GPU figures), ``exporter`` (HTTP), ``monitor`` (diagnosis, report, thread),
``handle`` (wiring to a loader), ``remote`` (``autominato monitor URL``), ``window`` (rates
and ratios between two snapshots), ``process`` (CPU and memory of the loader's processes).

The names above are imported on first use: ``window`` and ``process`` serve the controller,
the tuner and the benchmark, which should not import prometheus_client and register the
collectors merely to measure (a benchmark run's memory would grow by it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autominato.telemetry.exporter import DEFAULT_PORT, Exporter, PortInUseError, serve
    from autominato.telemetry.handle import TelemetryHandle, attach
    from autominato.telemetry.metrics import REGISTRY
    from autominato.telemetry.monitor import (
        DataMonitor,
        Diagnosis,
        Row,
        diagnose,
        format_report,
    )

#: public name -> the module that defines it
_PUBLIC = {
    "DEFAULT_PORT": "exporter",
    "Exporter": "exporter",
    "PortInUseError": "exporter",
    "serve": "exporter",
    "TelemetryHandle": "handle",
    "attach": "handle",
    "REGISTRY": "metrics",
    "DataMonitor": "monitor",
    "Diagnosis": "monitor",
    "Row": "monitor",
    "diagnose": "monitor",
    "format_report": "monitor",
}

__all__ = [
    "DEFAULT_PORT",
    "REGISTRY",
    "DataMonitor",
    "Diagnosis",
    "Exporter",
    "PortInUseError",
    "Row",
    "TelemetryHandle",
    "attach",
    "diagnose",
    "format_report",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # The handle module registers the scrape-time collectors in REGISTRY: whoever uses the
    # public surface gets them, as an eager import of this package gave them.
    importlib.import_module("autominato.telemetry.handle")
    return getattr(importlib.import_module(f"autominato.telemetry.{_PUBLIC[name]}"), name)
