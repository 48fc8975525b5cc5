"""Wiring a loader to the telemetry: hooks, the scrape collector, exporter and Data Monitor.

``attach(loader)`` is what ``Loader(metrics_port=..., monitor_interval=...)`` calls; it is also
usable by hand on anything that offers the loader's telemetry surface (``snapshot()``,
``stage_stats``, and optionally ``rank`` and ``decision_hooks``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from autominato.pipeline.knobs import KNOB_NAMES
from autominato.pipeline.stats import LoaderSnapshot, StageStats
from autominato.telemetry.collector import COLLECTOR
from autominato.telemetry.cores import CoreBudget
from autominato.telemetry.exporter import Exporter, serve
from autominato.telemetry.metrics import (
    CONSUMER_STEP_SECONDS,
    CONSUMER_WAIT_SECONDS,
    CONTROLLER_DECISIONS,
    H2D_COPY_SECONDS,
    STAGE_SERVICE_SECONDS,
    STAGE_WAIT_SECONDS,
    STAGES,
    bounded_reason,
)
from autominato.telemetry.monitor import CpuSnapshots, DataMonitor, diagnose, format_report
from autominato.telemetry.nvml import nvml_collector
from autominato.telemetry.switch import (  # noqa: F401 (re-exported)
    DEFAULT_MONITOR_INTERVAL,
    ENV_MONITOR,
    ENV_MONITOR_INTERVAL,
    monitor_interval_from_env,
)

log = logging.getLogger(__name__)



class Observable(Protocol):
    """What :func:`attach` reads from a loader."""

    stage_stats: dict[str, StageStats]

    def snapshot(self) -> LoaderSnapshot: ...


def _ensure_report_visible() -> None:
    """Give the report a handler when the program configured no logging at all.

    A script that never calls ``logging.basicConfig`` would otherwise drop the INFO records of
    ``autominato.monitor`` (Python's last-resort handler shows WARNING and above only), and
    ``AUTOMINATO_DATA_MONITOR=1`` would print nothing. A program that configured logging keeps
    full control: nothing is added then.
    """
    from autominato.telemetry.monitor import LOGGER_NAME

    mon = logging.getLogger(LOGGER_NAME)
    if mon.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    mon.addHandler(handler)
    if mon.getEffectiveLevel() > logging.INFO:
        mon.setLevel(logging.INFO)


_live_lock = threading.Lock()
_live_ranks: dict[int, str] = {}
#: ``id(loader)`` -> its open handle: a loader is attached once (a second handle exported
#: every series again under another rank label, and its histograms began later than the
#: counters its running means are read against: trial 146).
_attached: dict[int, TelemetryHandle] = {}


def _unique_rank(key: int, rank: int, suffix: int = 0) -> str:
    # Two live loaders of one rank in a process (a training and a validation loader) would
    # emit identical series; the second gets "<rank>-<n>" so both stay visible and valid.
    # ``suffix``: the n a relabelled loader had, kept when free (so that the loader built
    # second keeps "-1" whichever of the two is relabelled first).
    with _live_lock:
        return _pick_label(key, rank, suffix)


def _pick_label(key: int, rank: int, suffix: int = 0) -> str:
    """:func:`_unique_rank` under ``_live_lock``."""
    taken = {v for k, v in _live_ranks.items() if k != key}
    label = f"{rank}-{suffix}" if suffix else str(rank)
    n = 1
    while label in taken:
        label, n = f"{rank}-{n}", n + 1
    _live_ranks[key] = label
    return label


class TelemetryHandle:
    """A loader's live telemetry; made by :func:`attach`, ended by :meth:`close`.

    Attributes:
        rank: the ``rank`` label of this loader's series (``"0"``, or ``"0-1"`` for a second
            live loader of rank 0 in the same process).
        exporter: the HTTP exporter, or None when no port was asked for.
        monitor: the Data Monitor thread, or None when it is off.
    """

    def __init__(
        self,
        loader: Observable,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        monitor_interval: float | None = None,
        free_if_busy: bool = False,
        budget: CoreBudget | None = None,
    ) -> None:
        self._close_lock = threading.RLock()  # (first: close() may follow a failure below)
        if not callable(getattr(loader, "snapshot", None)) or not isinstance(
                getattr(loader, "stage_stats", None), dict):
            raise TypeError(
                f"attach() takes an autominato.Loader (or an object with snapshot() and a "
                f"stage_stats dict), not {type(loader).__name__}: a torch DataLoader records "
                "no telemetry; swap it for autominato.Loader")
        with _live_lock:
            if id(loader) in _attached:
                raise ValueError(
                    "this loader's telemetry is attached already: use that handle (a Loader "
                    "built with metrics_port= or monitor_interval= holds it as "
                    "loader.telemetry: loader.telemetry.report() reports now), or close it "
                    "before attaching again")
        self.loader = loader
        self._key = id(self)
        # (a label's histograms and decision counts, exported for the process's life, go on
        # from what its last loader left: .labels() gives the same children)
        self.rank = _unique_rank(self._key, int(getattr(loader, "rank", 0) or 0))
        self._closed = False
        # stage -> (service child, wait child) observed with (service_s, wait_s) of each
        # recorded item; the consumer's "service" is its step time between two next() calls.
        self._pairs = {
            stage: (
                STAGE_SERVICE_SECONDS.labels(stage, self.rank),
                STAGE_WAIT_SECONDS.labels(stage, self.rank),
            )
            for stage in STAGES
        }
        self._pairs["consumer"] = (
            CONSUMER_STEP_SECONDS.labels(self.rank),
            CONSUMER_WAIT_SECONDS.labels(self.rank),
        )
        self._h2d_copy = H2D_COPY_SECONDS.labels(self.rank)
        self._lock = threading.Lock()  # rank label, decision counts and closing
        self._hooked: list[StageStats] = []
        for stats in loader.stage_stats.values():
            stats.hooks.append(self._on_item)
            self._hooked.append(stats)
        decision_hooks: list[Callable[[Any], None]] | None = getattr(loader, "decision_hooks", None)
        if decision_hooks is not None:
            decision_hooks.append(self._on_decision)
        # (with the loader's CPU demand: exported, and weighed by every report's diagnosis)
        self._snapshot = CpuSnapshots(loader.snapshot, getattr(loader, "worker_pids", None))
        COLLECTOR.add(self._key, self.rank, self._snapshot)
        nvml_collector()
        self.exporter: Exporter | None = None
        self.monitor: DataMonitor | None = None
        try:
            if port is not None:
                self.exporter = serve(port, host, free_if_busy=free_if_busy)
            if monitor_interval is None:
                monitor_interval = monitor_interval_from_env()
            if monitor_interval is not None:
                _ensure_report_visible()
                self.monitor = DataMonitor(
                    self._snapshot, monitor_interval, rank=self.rank, budget=budget,
                ).start()
        except BaseException:
            self.close()
            raise
        with _live_lock:  # (only once attached whole: a failure above leaves it free, review 149)
            _attached[id(loader)] = self

    def set_rank(self, rank: int) -> None:
        """Label this loader's series with ``rank`` from now on (``Loader`` calls it when
        ``torch.distributed`` came up after the Loader was built, as under Lightning's DDP,
        which starts the process group in ``Trainer.fit``). A ``"-n"`` suffix is kept when
        free. The old label keeps what was counted under it, as a closed loader's (its
        counters, histograms and the controller's decision counts); the new one counts from
        now on, from what its last loader left: the loader's counters and histograms agree
        under each label (trial 168: 80 items counted beside a histogram of 16, the remote
        report's mean service a fifth of the truth). The gauges and the sliding window are
        the loader's own.
        """
        if self._closed or self.rank.partition("-")[0] == str(rank):
            return  # (the usual case, at every len() and iter(): no snapshot)
        try:  # (the loader's counters now: the old label keeps them)
            own = COLLECTOR.own_counters(self._snapshot())
        except Exception:  # noqa: BLE001 - those of the last scrape then
            own = None
        with self._lock:
            base, _, suffix = self.rank.partition("-")
            if self._closed or base == str(rank):
                return
            with _live_lock:  # (before the old label is free)
                new = _pick_label(self._key, rank, int(suffix or 0))
                COLLECTOR.relabel(self._key, new, own)
            self._pairs = {
                **{stage: (STAGE_SERVICE_SECONDS.labels(stage, new),
                           STAGE_WAIT_SECONDS.labels(stage, new)) for stage in STAGES},
                "consumer": (CONSUMER_STEP_SECONDS.labels(new), CONSUMER_WAIT_SECONDS.labels(new)),
            }
            self._h2d_copy = H2D_COPY_SECONDS.labels(new)
            self.rank = new
            if self.monitor is not None:
                self.monitor.relabel(new)

    @property
    def port(self) -> int | None:
        """The exporter's port (the one bound, when 0 or a busy port was asked), or None."""
        return self.exporter.port if self.exporter is not None else None

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics`` of the exporter, or None."""
        return self.exporter.url if self.exporter is not None else None

    def _on_item(self, stage: str, service_s: float, wait_s: float | None, nbytes: int) -> None:
        # Runs on the recording thread for every item: one look-up, two observes (one where
        # the item waited in no queue of the stage's own: a read fused into the workers).
        pair = self._pairs.get(stage)
        if pair is None:
            return
        pair[0].observe(service_s)
        if wait_s is not None:
            pair[1].observe(wait_s)
        if stage == "transfer":
            # The loader records the transfer stage once per batch copied to the device, with
            # the copy time from CUDA events (the stage is silent without a device).
            self._h2d_copy.observe(service_s)

    def _on_decision(self, decision: Any) -> None:
        knob = str(getattr(decision, "knob", ""))
        knob = knob if knob in KNOB_NAMES else "other"
        reason = bounded_reason(getattr(decision, "reason", "other"))
        with self._lock:  # against set_rank and close: no series left under a removed label
            if self._closed:
                return
            CONTROLLER_DECISIONS.labels(knob, reason, self.rank).inc()

    def report(self, title: str | None = None) -> str | None:
        """The Data Monitor report now: logged (when the monitor is on) and returned.

        Without a running monitor the window is since the loader started.
        """
        if self.monitor is not None:
            return self.monitor.report(title)
        return format_report(
            diagnose([self._snapshot()]), title=title or f"Data Monitor (rank {self.rank})"
        )

    def close(self) -> None:
        """Log a last report (monitor on), stop the monitor, drop the hooks, the loader's
        series and this user of the exporter. Idempotent; a close that an exception cut short
        (a Ctrl-C) goes on at the next call, the Loader's at exit (review 162), without a
        second report; the exporter is released at most once.
        """
        with self._close_lock:  # (two closing at once: the second waits, review 164)
            self._close_body()

    def _close_body(self) -> None:
        with self._lock:
            if self._close_done:
                return
            first, self._closed = not self._closed, True
        if self.monitor is not None:
            self.monitor.stop()
            try:
                if first:
                    self.monitor.report(
                        f"Data Monitor (rank {self.rank}), end of run", only_if_new=True
                    )
            except Exception:
                log.exception("final Data Monitor report failed")
        for stats in self._hooked:
            if self._on_item in stats.hooks:
                stats.hooks.remove(self._on_item)
        decision_hooks = getattr(self.loader, "decision_hooks", None)
        if decision_hooks is not None and self._on_decision in decision_hooks:
            decision_hooks.remove(self._on_decision)
        try:  # (the counters the label keeps for its next loader: the last figures)
            final = self._snapshot()
        except Exception:  # noqa: BLE001 - those of the last scrape then
            final = None
        with self._lock:
            COLLECTOR.remove(self._key, final)
            with _live_lock:  # (before the label is free)
                _live_ranks.pop(self._key, None)
                if _attached.get(id(self.loader)) is self:
                    del _attached[id(self.loader)]
        exporter, self.exporter = self.exporter, None  # (released once, even if cut short)
        if exporter is not None:
            exporter.close()
        self._close_done = True

    _close_done = False  # close() ran to its end (``_closed``: it began)

    def __enter__(self) -> TelemetryHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(
    loader: Observable,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    monitor_interval: float | None = None,
    free_if_busy: bool = False,
    budget: CoreBudget | None = None,
) -> TelemetryHandle:
    """Record ``loader``'s telemetry; optionally serve it and run the Data Monitor.

    Args:
        loader: an :class:`autominato.Loader` (or anything with ``snapshot()`` and
            ``stage_stats``; ``rank`` and ``decision_hooks`` are used if present).
        port: serve ``/metrics`` on this port (0: a free one); None: record only (the
            registry :data:`autominato.telemetry.metrics.REGISTRY` can still be served by
            :func:`autominato.telemetry.serve` or the user's own exporter).
        host: address the exporter binds (127.0.0.1 by default; ``"0.0.0.0"`` for all).
        monitor_interval: seconds between Data Monitor reports; None defers to
            ``AUTOMINATO_DATA_MONITOR`` / ``AUTOMINATO_DATA_MONITOR_INTERVAL``.
        free_if_busy: bind a free port when ``port`` is taken instead of raising.
        budget: the core budget of the Data Monitor's suggestions: the controller's (the
            Loader passes it; with Ray workers the cluster's free CPUs, not this machine's).
            Default ``CoreBudget(usable_cores())``.

    Returns:
        The :class:`TelemetryHandle`; call ``close()`` at the end (the Loader does): the
        Data Monitor logs a report every ``monitor_interval`` seconds and one at the close
        when batches came after the last one, never one per epoch (short epochs would
        flood the log).

    Raises:
        PortInUseError: ``port`` is taken and ``free_if_busy`` is False.
        ValueError: ``monitor_interval`` (or the environment's) is not positive, or
            ``loader``'s telemetry is attached already (use that handle, or close it first).
        TypeError: ``loader`` has no ``snapshot()`` and ``stage_stats`` (a torch DataLoader).
    """
    return TelemetryHandle(
        loader,
        port=port,
        host=host,
        monitor_interval=monitor_interval,
        free_if_busy=free_if_busy,
        budget=budget,
    )
