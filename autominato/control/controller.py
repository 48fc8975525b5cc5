"""The controller thread: every interval, snapshot the loader, ask the rule, turn the knobs.

All judgement lives in the rule (:mod:`autominato.control.rule`); this module only measures
what a snapshot cannot know (CPU time and memory of the worker processes, with the process
meter of :mod:`autominato.telemetry.process`), applies the decisions to ``loader.knobs``,
logs them and reports them to the loader.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from autominato.config import load_config
from autominato.control.rule import (
    WORKER_COUNT_KEY,
    WORKER_RSS_KEY,
    Budget,
    Decision,
    Rule,
    StageBasedRule,
)
from autominato.pipeline.knobs import usable_cores
from autominato.pipeline.stats import LoaderSnapshot
from autominato.telemetry.cores import loader_cpu_extra
from autominato.telemetry.process import ProcessMeter, Reading
from autominato.telemetry.window import slim

log = logging.getLogger("autominato.control")

#: Default memory budget: this fraction of the host's available RAM (psutil
#: ``virtual_memory().available``) when the controller starts. Half leaves the training job
#: and the page cache the rest; a project choice, settable with ``memory_budget_bytes``.
MEMORY_FRACTION = 0.5

#: Snapshots kept for the rule (10 minutes at the default 1 s interval).
HISTORY = 600


def process_figures(reading: Reading) -> dict[str, float]:
    """The ``LoaderSnapshot.extra`` figures the rule reads, from a process-meter reading of
    this process (the root) and the loader's worker processes. CPU is the loader's
    (:func:`~autominato.telemetry.cores.loader_cpu_seconds`: the workers', without the
    training loop's when there are worker processes).

    Worker memory is private memory (RSS less shared pages): the pool's shared-memory slots
    and the libraries are counted once, in the pool's bytes, not once per worker.
    """
    return {
        **loader_cpu_extra(reading),
        WORKER_RSS_KEY: float(reading.worker_private_bytes),
        WORKER_COUNT_KEY: float(len(reading.workers)),
    }


class Controller:
    """Retunes a loader's knobs while it runs.

    Args:
        loader: an :class:`autominato.Loader` (anything with ``snapshot()`` and ``knobs``;
            ``worker_pids()`` and ``report_decision(decision)`` are used when present).
        interval: seconds between two looks at the loader.
        rule: the decision rule; default :class:`StageBasedRule`.
        config: a configuration (path or mapping, :func:`autominato.config.load_config`)
            written by ``autominato tune``: its ``bounds`` become the knobs' bounds and its
            ``knobs`` the starting values (warm start). Skipped when it equals
            ``loader.config``, which the loader has applied already.
        memory_budget_bytes: host memory the loader may hold, bytes; default
            :data:`MEMORY_FRACTION` of the available RAM at construction.
        cores: the CPU-core budget; default :func:`~autominato.pipeline.knobs.usable_cores`.

    Raises:
        autominato.config.ConfigError: ``config`` is invalid.
        ValueError: ``interval`` is not positive.

    Example::

        ctl = Controller(loader, interval=1.0).start()
        ...
        ctl.stop()
        for d in ctl.decisions:
            print(d.line())
    """

    def __init__(
        self,
        loader: Any,
        *,
        interval: float = 1.0,
        rule: Rule | None = None,
        config: str | Path | dict[str, Any] | None = None,
        memory_budget_bytes: float | None = None,
        cores: int | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"controller interval must be > 0 seconds, got {interval!r}")
        self.loader = loader
        self.interval = float(interval)
        self.rule: Rule = rule if rule is not None else StageBasedRule()
        if memory_budget_bytes is None:
            memory_budget_bytes = MEMORY_FRACTION * psutil.virtual_memory().available
        self.budget = Budget(cores=cores or usable_cores(), memory_bytes=float(memory_budget_bytes))
        if config is not None:
            cfg = load_config(config)
            # autominato.Loader(config=...) applies its configuration itself (explicit knob
            # arguments winning); applying it again here would undo those arguments.
            if getattr(loader, "config", None) != cfg:
                self._warm_start(cfg)
        self.history: deque[LoaderSnapshot] = deque(maxlen=HISTORY)
        self.decisions: list[Decision] = []
        self._state = self.rule.initial_state()
        self._meter = ProcessMeter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _warm_start(self, cfg: dict[str, Any]) -> None:
        knobs = self.loader.knobs
        # A loader built without workers (transforms inline) cannot grow them while it runs.
        skip = {"workers"} if knobs.workers == 0 else set()
        for name, (lo, hi) in cfg["bounds"].items():
            if name not in skip:
                knobs.set_bounds(name, lo, hi)
        for name, value in cfg["knobs"].items():
            if name not in skip:
                knobs.set(name, value)
        log.info("warm start from configuration: %r", knobs)

    def step(self) -> list[Decision]:
        """Take one snapshot, run the rule once and apply what it decides.

        The thread calls this every ``interval``; tests and benchmarks may call it directly.

        Returns:
            The decisions applied, with ``new`` as the knobs clamped it.
        """
        with self._lock:
            pids = list(self.loader.worker_pids()) if hasattr(self.loader, "worker_pids") else []
            snap = self.loader.snapshot()
            # The rule reads totals only; the loader's own extras win over the meter's.
            extra = {**process_figures(self._meter.read(pids)), **snap.extra}
            snap = replace(slim(snap), extra=extra)
            self.history.append(snap)
            knobs = self.loader.knobs
            decisions, self._state = self.rule.decide(
                list(self.history), knobs.bounds_dict(), self.budget, self._state
            )
            applied = []
            for d in decisions:
                new = knobs.set(d.knob, d.new)
                if new == d.old:
                    continue
                d = replace(d, new=new)
                applied.append(d)
                self.decisions.append(d)
                log.info("%s", d.line())
                report = getattr(self.loader, "report_decision", None)
                if report is not None:
                    report(d)
            return applied

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.step()
            except ReferenceError:
                # The Loader was collected without close() (its figures are read through a
                # weak reference): nothing is left to tune (trial 115: this logged a
                # traceback every interval until the process ended).
                log.debug("controller stopped: its Loader was garbage-collected")
                return
            except Exception:
                # A controller fault must never take the training job down with it; the
                # knobs simply stay where they are.
                log.exception("controller step failed; knobs left unchanged")

    def start(self) -> Controller:
        """Start the thread (a daemon, named ``autominato-controller``); returns ``self``."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="autominato-controller", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it; idempotent."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Controller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
