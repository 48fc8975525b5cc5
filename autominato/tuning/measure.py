"""One trial's measurement: run a loader against a training step and time the step's waits.

The training loop is the consumer: the time it spends blocked in ``next(loader)`` is time the
accelerator would sit idle. Over a measured window of batches (after a warm-up that lets
workers start and queues fill) the objective is::

    idle_ratio = wait / (wait + busy)

where ``wait`` sums the seconds blocked in ``next()`` and ``busy`` the seconds in the step,
both timed here around the calls, so the number does not depend on the loader's own
bookkeeping. The window's reports (Optuna's ``trial.report`` and pruning check, a database
write, and the memory reading) run on a thread of their own: on the step's thread they took
5-40 ms each on the 2-core machine, time in which the loader went on filling its queues
unseen by either sum, so a loader too slow for a 40 ms step measured 1.5-14% idle instead of
~25%. CPU seconds (user + system of this process and the loader's worker processes)
and peak memory over the window are measured for breaking ties between equally idle
configurations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from autominato.models.step import Step
from autominato.telemetry.process import ProcessMeter, Reading
from autominato.telemetry.window import idle_ratio

#: ``on_report(batches_measured, idle_ratio_so_far)``; may raise to stop the trial
#: (``optuna.TrialPruned``).
ReportFn = Callable[[int, float], None]


class MemoryBudgetExceeded(RuntimeError):
    """The loader's processes used more memory than the budget; the configuration is infeasible.

    Attributes:
        used_bytes: the processes' memory footprint (PSS, with the shared memory gained
            since the trial started counted even where no process maps it:
            ``Reading.footprint_bytes``), bytes.
        budget_bytes: the budget, bytes.
    """

    def __init__(self, used_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"memory {_size(used_bytes)} over the budget of {_size(budget_bytes)} "
            "(training process + loader workers: proportional set size and shared memory)"
        )
        self.used_bytes = used_bytes
        self.budget_bytes = budget_bytes


def _size(nbytes: int) -> str:
    """``nbytes`` in GiB, or MiB under 1 GiB (a budget of 1 MiB read "0.00 GiB": trial 146)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class NoBatches(RuntimeError):
    """The loader yielded no batch in a whole epoch (empty dataset, or drop_last on too few)."""


@dataclass(frozen=True)
class Measurement:
    """What one trial measured over its window.

    Attributes:
        idle_ratio: ``wait_s / (wait_s + busy_s)`` in [0, 1], the objective.
        wait_s: seconds the step loop spent blocked in ``next()``.
        busy_s: seconds spent in the training step.
        batches / samples: delivered in the window.
        cpu_s: CPU seconds (user + system) of this process and the loader's workers.
        peak_memory_bytes: highest footprint of this process and the workers
            (``Reading.footprint_bytes``), bytes.
        warmup_s / window_s: wall seconds of the warm-up and of the window.
    """

    idle_ratio: float
    wait_s: float
    busy_s: float
    batches: int
    samples: int
    cpu_s: float
    peak_memory_bytes: int
    warmup_s: float
    window_s: float

    @property
    def cpu_s_per_sample(self) -> float:
        return self.cpu_s / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: the leading size of its first tensor or array (1 if none)."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    elif isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape else 1


def measure(
    loader: Any,
    step: Step,
    *,
    warmup_batches: int,
    window_batches: int,
    report_every: int = 0,
    on_report: ReportFn | None = None,
    memory_budget_bytes: int | None = None,
) -> Measurement:
    """Run ``loader`` against ``step`` and measure the accelerator-idle ratio of a window.

    Iterates over epochs (``loader.set_epoch``) as needed until ``warmup_batches`` plus
    ``window_batches`` batches have been stepped on. Memory is read every
    :data:`MEMORY_EVERY_S` over the window (on a thread of its own, started after the
    window's first batch), at each report and at its end.

    Args:
        loader: an iterable of batches (an ``autominato.Loader``; ``worker_pids()`` and
            ``set_epoch()`` are used when present).
        step: the training step, called once per batch.
        warmup_batches: batches run before the window starts (not measured).
        window_batches: batches measured (>= 1).
        report_every: call ``on_report`` every this many measured batches (0: never).
        on_report: receives ``(batches_measured, idle_ratio_so_far)``; may raise to stop.
        memory_budget_bytes: raise :class:`MemoryBudgetExceeded` when a sample exceeds it.

    Raises:
        MemoryBudgetExceeded: memory over ``memory_budget_bytes``.
        NoBatches: an epoch yielded no batch.
        Exception: whatever the loader raises for a sample (it names the sample and file).
    """
    if window_batches < 1:
        raise ValueError(f"window_batches must be >= 1, got {window_batches}")
    # (full PSS reads of each process every PSS_EVERY_S, its private memory's growth in
    # between: the watch reads it every MEMORY_EVERY_S)
    meter = ProcessMeter(pss=True, pss_every=PSS_EVERY_S, runqueue=False)
    pids_fn = getattr(loader, "worker_pids", None)
    meter_lock = threading.Lock()  # one reader at a time: the watch, a report, the end

    def read() -> Reading:
        with meter_lock:
            return meter.read(list(pids_fn()) if callable(pids_fn) else [])

    # CPU at the window's ends from a meter of its own, without PSS: a full PSS read of every
    # process (due again once the workers started) took tens of ms between the warm-up and
    # the window, which the loader spent stocking batches that the window then ate (trial
    # 182: 6 workers on 2 cores read 0.41-0.44 idle in a 24-batch window, 0.49-0.50 in 120,
    # and tune wrote them as a gain over the default's 0.51).
    cpu_meter = ProcessMeter(runqueue=False)

    def cpu_s() -> float:
        return cpu_meter.read(list(pids_fn()) if callable(pids_fn) else []).cpu_seconds_total

    read()  # the baseline of shared memory (Reading.footprint_bytes): before the trial's batches

    batches = _batches(loader)
    wait = busy = 0.0
    samples = 0
    peak = 0

    peak_lock = threading.Lock()  # (the watch and a report may read at once)

    def check_memory(reading: Reading | None = None) -> None:
        nonlocal peak
        used = (reading or read()).footprint_bytes
        with peak_lock:
            peak = max(peak, used)
        if memory_budget_bytes is not None and used > memory_budget_bytes:
            raise MemoryBudgetExceeded(used, memory_budget_bytes)

    def on_window_report(i: int, idle: float) -> None:
        check_memory()
        if on_report is not None:
            on_report(i, idle)

    t0 = time.perf_counter()
    for _ in range(warmup_batches):
        step(next(batches))
    cpu0 = cpu_s()
    t1 = time.perf_counter()
    reporter = _Reporter(on_window_report) if report_every else None
    watch = _Watch(check_memory, MEMORY_EVERY_S)
    finished = False
    try:
        for i in range(1, window_batches + 1):
            watch.raise_error()  # a memory overrun seen between two batches stops here
            if reporter is not None:
                reporter.raise_error()  # a pruned trial or a memory overrun stops here
            a = time.perf_counter()
            batch = next(batches)
            b = time.perf_counter()
            # after a batch, as the reports' thread: by then the loader built its workers
            watch.start()
            step(batch)
            c = time.perf_counter()
            wait += b - a
            busy += c - b
            samples += batch_len(batch)
            if reporter is not None and i % report_every == 0 and i < window_batches:
                reporter.post(i, idle_ratio(wait, busy))
        t2 = time.perf_counter()
        finished = True
    finally:
        watch.close()
        if reporter is not None:
            # the meter is read by one thread at a time; a report still pending is dropped
            # when the loop is raising
            reporter.close(drain=finished)
    watch.raise_error()
    if reporter is not None:
        reporter.raise_error()
    cpu = cpu_s() - cpu0
    check_memory()
    return Measurement(
        idle_ratio=idle_ratio(wait, busy),
        wait_s=wait,
        busy_s=busy,
        batches=window_batches,
        samples=samples,
        cpu_s=cpu,
        peak_memory_bytes=peak,
        warmup_s=t1 - t0,
        window_s=t2 - t1,
    )


#: Seconds between two readings of the memory over the measured window (:class:`_Watch`):
#: a sample whose working set lasts a second or two (a large 3D volume) peaks between two
#: reports, which alone read 0.71 GiB where one sample needed 1.9 (trial 125).
MEMORY_EVERY_S = 0.1

#: Seconds between two full PSS reads of one process (``ProcessMeter(pss_every=...)``, as
#: the bench's ``TreeSampler.PSS_EVERY_S`` of 2 s): reading every process's ``smaps_rollup``
#: every 0.1 s would take a tenth of a core or more from the trial measured.
PSS_EVERY_S = 1.0


class _Watch:
    """Calls ``check()`` every ``every`` seconds on a thread of its own, from :meth:`start`
    until :meth:`close`;
    the first exception it raises (:class:`MemoryBudgetExceeded`) is kept for the step's
    thread (:meth:`raise_error`), and the watch stops."""

    def __init__(self, check: Callable[[], None], every: float) -> None:
        self._check = check
        self._every = every
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="autominato-tune-memory",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._check()
            except BaseException as e:  # noqa: BLE001 -- handed to the step's thread
                self.error = e
                return

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)  # (a daemon: a /proc read that hangs does not hang the trial)


class _Reporter:
    """Runs the window's reports on a thread of its own, started at the first report (by
    then the loader has built its workers: a thread running while it does would make
    autominato's loader start them from a new interpreter, see ``spawn.can_fork_now``).

    At most one report waits: one posted while the thread is still busy replaces the one
    not yet taken (the newer idle ratio supersedes it), so reports slower than the batches
    never build a backlog. The first exception a report raises (``optuna.TrialPruned``,
    :class:`MemoryBudgetExceeded`) is kept for the step's thread, which raises it before its
    next batch; the reports after it are dropped.
    """

    def __init__(self, report: ReportFn) -> None:
        self._report = report
        self._cond = threading.Condition()
        self._pending: tuple[int, float] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def post(self, batches: int, idle: float) -> None:
        with self._cond:
            self._pending = (batches, idle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="autominato-tune-report",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                item, self._pending = self._pending, None
            if item is None:
                return  # closed, nothing left
            if self.error is None:
                try:
                    self._report(*item)
                except BaseException as e:  # noqa: BLE001 -- handed to the step's thread
                    self.error = e

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, drain: bool = True) -> None:
        """End the thread: after the report that waits (``drain``) or dropping it."""
        with self._cond:
            self._closed = True
            if not drain:
                self._pending = None
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()


def _batches(loader: Iterable[Any]):
    """Endless batches from ``loader``, advancing its epoch at each end."""
    epoch = 0
    set_epoch = getattr(loader, "set_epoch", None)
    while True:
        if callable(set_epoch):
            set_epoch(epoch)
        n = 0
        for batch in loader:
            n += 1
            yield batch
        if n == 0:
            raise NoBatches(f"epoch {epoch} of the loader yielded no batch")
        epoch += 1
