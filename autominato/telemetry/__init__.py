"""Telemetry: Prometheus metrics, NVML GPU figures, and the Data Monitor report.

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
``handle`` (wiring to a loader), ``remote`` (``autominato monitor URL``).
"""

from __future__ import annotations

from autominato.telemetry.exporter import DEFAULT_PORT, Exporter, PortInUseError, serve
from autominato.telemetry.handle import TelemetryHandle, attach
from autominato.telemetry.metrics import REGISTRY
from autominato.telemetry.monitor import DataMonitor, Diagnosis, Row, diagnose, format_report

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
