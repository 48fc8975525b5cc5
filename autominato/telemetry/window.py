"""Rates and ratios over a window between two loader snapshots: the one definition.

A :class:`~autominato.pipeline.stats.LoaderSnapshot` holds cumulative counters (``*_total``);
every figure "over the last N seconds" is a difference of two of them. :func:`between` takes
those differences once and :class:`Rates` derives from them what the controller
(:mod:`autominato.control.rule`), the Data Monitor (:mod:`autominato.telemetry.monitor`) and
the Prometheus collector (:mod:`autominato.telemetry.collector`) read: samples/s, batches/s,
the accelerator-idle ratio, per-stage service time per item, utilisation and queue fill, and
the host-to-device bandwidth. :class:`Ring` keeps the snapshots of a sliding time window.

Units throughout: seconds (``time.monotonic()`` for instants), bytes, items; ratios in [0, 1].
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field, replace

from autominato.pipeline.stats import LoaderSnapshot, StageSnapshot


def idle_ratio(wait_s: float, busy_s: float) -> float:
    """Accelerator-idle ratio ``wait_s / (wait_s + busy_s)`` in [0, 1] (0.0 when both are 0).

    ``wait_s`` is the time the training loop spent blocked in ``next()``, ``busy_s`` the time
    it spent in its step; the accelerator idles while the loop waits.
    """
    total = wait_s + busy_s
    return wait_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class StageRates:
    """One stage over a window of ``seconds``.

    Attributes:
        name: the stage (``read``, ``transform``, ``batch``, ``transfer``).
        seconds: length of the window, seconds (NaN when measured from the loader's start).
        items: items the stage finished in the window.
        bytes: bytes of those items.
        service_s: service time summed over those items, seconds (worker-seconds of work).
        wait_s: input-queue wait summed over those items, seconds.
        workers: the stage's concurrency at the end of the window.
        queue_len / queue_capacity: the input queue at the end of the window, items.
        cpu_s: CPU seconds the stage's threads in this process spent on its items in the
            window (``StageSnapshot.cpu_seconds_total``), ``None`` where not measured.
        runqueue_s: seconds those threads waited for a core meanwhile
            (``StageSnapshot.runqueue_seconds_total``), ``None`` where not measured.
    """

    name: str
    seconds: float
    items: int
    bytes: int
    service_s: float
    wait_s: float
    workers: int
    queue_len: int
    queue_capacity: int
    cpu_s: float | None = None
    runqueue_s: float | None = None

    @property
    def cpu_share(self) -> float | None:
        """The share of the stage's service time its threads ran on a CPU or waited for a
        core (its CPU demand, 0..1: near 1 a read that decodes, near 0 one that waits on
        storage; a thread that waits for the GIL counts in neither); ``None`` where not
        measured or no item finished in the window."""
        if self.cpu_s is None or self.service_s <= 0 or self.items <= 0:
            return None
        return min(1.0, (self.cpu_s + (self.runqueue_s or 0.0)) / self.service_s)

    @property
    def mean_service_s(self) -> float | None:
        """Service time per item, seconds; ``None`` when no item finished in the window."""
        return self.service_s / self.items if self.items > 0 else None

    @property
    def items_per_s(self) -> float:
        """Items finished per second (NaN for a window of unknown or zero length)."""
        return self.items / self.seconds if self.seconds > 0 else math.nan

    @property
    def bytes_per_s(self) -> float:
        """Bytes finished per second (NaN for a window of unknown or zero length)."""
        return self.bytes / self.seconds if self.seconds > 0 else math.nan

    @property
    def utilisation(self) -> float:
        """Mean fraction of the stage's workers busy, ``service_s / (seconds x workers)``.

        Capped at 1.0: service time is counted when an item finishes, so an item that began
        before the window adds its whole time to it. 0.0 for a stage without workers of its
        own (a fused or inline stage runs on another's), NaN for a window of unknown length.
        """
        if self.workers <= 0:
            return 0.0
        if math.isnan(self.seconds):
            return math.nan
        return min(1.0, self.service_s / (max(self.seconds, 1e-9) * self.workers))

    @property
    def fill(self) -> float:
        """Input-queue fill at the end of the window in [0, 1] (0.0 without a bounded queue)."""
        if self.queue_capacity <= 0:
            return 0.0
        return min(1.0, self.queue_len / self.queue_capacity)


@dataclass(frozen=True)
class Rates:
    """What a loader did between two snapshots (see :func:`between`).

    Attributes:
        start / end: the snapshots' times, ``time.monotonic()`` seconds; ``start`` is NaN when
            the window runs from the loader's start (snapshots do not record that instant).
        batches / samples: delivered to the training loop in the window.
        wait_s: seconds the training loop spent blocked in ``next()``.
        busy_s: seconds the training loop spent in its step (between ``next()`` calls).
        h2d_bytes / h2d_s: host-to-device bytes copied and seconds the copies took.
        stages: per stage present at the end of the window, its :class:`StageRates`.
        steps / steps_s: the training loop's steps that ended in the window and their
            seconds (0 where the snapshots do not count them).
        cold_wait_s: the part of ``wait_s`` spent waiting for the first batch of passes that
            started cold (``LoaderSnapshot.cold_start_wait_seconds_total``), at most
            ``wait_s`` (that wait is counted when its batch arrives, and a window may hold
            only its end).
        cold_starts: passes that started cold in the window.
    """

    start: float
    end: float
    batches: int
    samples: int
    wait_s: float
    busy_s: float
    h2d_bytes: int
    h2d_s: float
    stages: dict[str, StageRates] = field(default_factory=dict)
    steps: int = 0
    steps_s: float = 0.0
    cold_wait_s: float = 0.0
    cold_starts: int = 0

    @property
    def seconds(self) -> float:
        """Length of the window, seconds (NaN when it runs from the loader's start)."""
        return self.end - self.start

    @property
    def idle_ratio(self) -> float:
        """Accelerator-idle ratio over the window, :func:`idle_ratio` of the consumer's times."""
        return idle_ratio(self.wait_s, self.busy_s)

    @property
    def cold_wait_ratio(self) -> float:
        """The part of :attr:`idle_ratio` that was the wait for cold passes' first batches."""
        return idle_ratio(self.cold_wait_s, self.wait_s - self.cold_wait_s + self.busy_s)

    @property
    def steady_idle_ratio(self) -> float:
        """:attr:`idle_ratio` with the waits for cold passes' first batches left out (worker
        start-up, an epoch not prefetched): the share that the pipeline's pace leaves."""
        return idle_ratio(self.wait_s - self.cold_wait_s, self.busy_s)

    @property
    def samples_per_s(self) -> float:
        """Samples delivered per second of the window (NaN for an unknown or zero length)."""
        return self.samples / self.seconds if self.seconds > 0 else math.nan

    @property
    def batches_per_s(self) -> float:
        """Batches delivered per second of the window (NaN for an unknown or zero length)."""
        return self.batches / self.seconds if self.seconds > 0 else math.nan

    @property
    def step_s(self) -> float:
        """The training loop's step per batch, seconds (0.0 without a batch): the mean of the
        steps that ended in the window. Not ``busy_s / batches``: a window holds the part of
        the step under way at its end and of the one under way at its start, not whole
        steps, and read 1.86 s for steps of 2.0 s over 8 batches (trial 125); that ratio
        stands in where the snapshots do not count steps."""
        if self.steps > 0:
            return self.steps_s / self.steps
        return self.busy_s / self.batches if self.batches > 0 else 0.0

    @property
    def wait_per_batch_s(self) -> float:
        """Consumer wait per batch, seconds (0.0 without a batch)."""
        return self.wait_s / self.batches if self.batches > 0 else 0.0

    @property
    def samples_per_batch(self) -> float:
        """Mean samples per delivered batch (0.0 without a batch)."""
        return self.samples / self.batches if self.batches > 0 else 0.0

    @property
    def h2d_bytes_per_s(self) -> float | None:
        """Host-to-device bandwidth while copying, ``h2d_bytes / h2d_s`` in bytes/s; ``None``
        when no copy time was recorded (no CUDA, or no copy in the window)."""
        return self.h2d_bytes / self.h2d_s if self.h2d_s > 0 else None


def _grown(a: float | None, b: float | None) -> float | None:
    """A counter's growth from ``a`` to ``b``; ``None`` where ``b`` does not count it (``a``
    ``None``: from 0, it began counting after ``a``)."""
    return None if b is None else b - (a or 0.0)


def _stage(name: str, a: StageSnapshot | None, b: StageSnapshot, seconds: float) -> StageRates:
    return StageRates(
        name=name,
        seconds=seconds,
        items=b.items_total - (a.items_total if a is not None else 0),
        bytes=b.bytes_total - (a.bytes_total if a is not None else 0),
        service_s=b.service_seconds_total - (a.service_seconds_total if a is not None else 0.0),
        wait_s=b.wait_seconds_total - (a.wait_seconds_total if a is not None else 0.0),
        workers=b.workers,
        queue_len=b.queue_len,
        queue_capacity=b.queue_capacity,
        cpu_s=_grown(a.cpu_seconds_total if a is not None else None, b.cpu_seconds_total),
        runqueue_s=_grown(a.runqueue_seconds_total if a is not None else None,
                          b.runqueue_seconds_total),
    )


def between(a: LoaderSnapshot | None, b: LoaderSnapshot) -> Rates:
    """The :class:`Rates` of the window from snapshot ``a`` to the later snapshot ``b``.

    ``a=None`` measures from the loader's start (every counter from zero; the window's length
    is then unknown, NaN). A stage that ``b`` reports and ``a`` does not counts from zero
    (stage counters start at zero when the loader is built); a stage ``b`` does not report
    is left out.
    """
    start = a.time if a is not None else math.nan
    seconds = b.time - start

    def d(attr: str) -> float:
        return getattr(b, attr) - (getattr(a, attr) if a is not None else 0)

    return Rates(
        start=start,
        end=b.time,
        batches=int(d("batches_total")),
        samples=int(d("samples_total")),
        wait_s=d("consumer_wait_seconds_total"),
        busy_s=d("consumer_busy_seconds_total"),
        h2d_bytes=int(d("h2d_bytes_total")),
        h2d_s=d("h2d_seconds_total"),
        steps=int(d("consumer_steps_total")),
        steps_s=d("consumer_steps_seconds_total"),
        cold_wait_s=min(max(0.0, d("cold_start_wait_seconds_total")),
                        max(0.0, d("consumer_wait_seconds_total"))),
        cold_starts=int(d("cold_starts_total")),
        stages={
            name: _stage(name, a.stages.get(name) if a is not None else None, st, seconds)
            for name, st in b.stages.items()
        },
    )


def slim(s: LoaderSnapshot) -> LoaderSnapshot:
    """``s`` without its rings of recent timings, for keeping many snapshots.

    Rates read only the cumulative counters; a full snapshot carries up to
    :data:`~autominato.pipeline.stats.RECENT` floats per stage and for the consumer (600
    snapshots with five rings of 512 hold ~100 MB of Python floats).
    """
    stages = {n: replace(st, recent_service_s=(), recent_wait_s=()) for n, st in s.stages.items()}
    return replace(s, stages=stages, consumer_wait_recent_s=(), consumer_empty_recent=())


class Ring:
    """Snapshots of the last ``window_s`` seconds, for rates over a sliding window.

    :meth:`add` returns the rates from the earlier snapshot whose distance from the new one
    is nearest ``window_s`` (the oldest within the window or the latest before it; the older
    of two as near), and with none at all from the loader's start: so the window is
    ``window_s`` give or take half the time between two snapshots (trial 171: the oldest
    within the window made it one scrape interval short, and a 30 s window of 15 s scrapes
    flipped between 15 and 30 s with their jitter). One snapshot older than the window is
    kept for that. Snapshots are kept slim (:func:`slim`). Thread-safe.

    Args:
        window_s: length of the window, seconds (> 0).
        keep: the most snapshots kept, whatever their age.
    """

    def __init__(self, window_s: float, keep: int = 256) -> None:
        if not window_s > 0:
            raise ValueError(f"window must be > 0 seconds, got {window_s!r}")
        self.window_s = float(window_s)
        self._snaps: deque[LoaderSnapshot] = deque(maxlen=max(2, keep))
        self._lock = threading.Lock()

    def add(self, snap: LoaderSnapshot) -> Rates:
        """Keep ``snap`` and return the :class:`Rates` over the window that ends at it."""
        since = snap.time - self.window_s
        with self._lock:
            earlier = [s for s in self._snaps if s.time < snap.time]
            base = min(earlier, key=lambda s: abs(s.time - since), default=None)
            # Forget what has left the window, but keep one snapshot as the fallback base.
            while len(self._snaps) > 1 and self._snaps[1].time < since:
                self._snaps.popleft()
            self._snaps.append(slim(snap))
        return between(base, snap)

    def __len__(self) -> int:
        with self._lock:
            return len(self._snaps)
