"""The environment's telemetry switch, read by ``Loader`` without importing the telemetry.

Kept apart from :mod:`autominato.telemetry.handle` so that a loader with telemetry off never
imports ``prometheus_client`` (0.8 MB of the training process's resident memory: 6.6 -> 5.8 MB
added by ``from autominato import Loader`` after ``import torch``, read from ``/proc/self/statm``).
"""

from __future__ import annotations

import os

#: ``AUTOMINATO_DATA_MONITOR=1`` turns the Data Monitor on without code changes (as
#: MegEngine's ``MGE_DATA_MONITOR`` does); the interval comes from
#: ``AUTOMINATO_DATA_MONITOR_INTERVAL`` (seconds, default :data:`DEFAULT_MONITOR_INTERVAL`,
#: MegEngine's 5 s).
ENV_MONITOR = "AUTOMINATO_DATA_MONITOR"
ENV_MONITOR_INTERVAL = "AUTOMINATO_DATA_MONITOR_INTERVAL"
DEFAULT_MONITOR_INTERVAL = 5.0


def monitor_interval_from_env() -> float | None:
    """The interval the environment asks for, or None when ``AUTOMINATO_DATA_MONITOR`` is
    unset, empty, ``0``, ``false``, ``no`` or ``off``.

    Raises:
        ValueError: ``AUTOMINATO_DATA_MONITOR_INTERVAL`` is not a positive number.
    """
    if os.environ.get(ENV_MONITOR, "").strip().lower() in ("", "0", "false", "no", "off"):
        return None
    raw = os.environ.get(ENV_MONITOR_INTERVAL, "").strip()
    if not raw:
        return DEFAULT_MONITOR_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_MONITOR_INTERVAL}={raw!r}: expected a positive number of seconds")
    return value
