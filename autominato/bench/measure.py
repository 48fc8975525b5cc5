"""What the benchmark measures, the same way for every arm.

* :class:`TreeSampler`: a thread (:class:`ForkedTreeSampler`: a forked child process) that
  reads a process tree with the process meter
  (:mod:`autominato.telemetry.process`) and sums CPU-seconds and memory: the tree's footprint
  (PSS, proportional set size, which splits shared pages between the processes that map them
  so that the sum counts each page once, with the shared memory the machine gained since the
  first sample in place of the tree's shared pages where that is more: shared memory that no
  process has mapped, such as prefetched batches the consumer has not touched, is in no PSS).
* :class:`NvmlSampler`: GPU utilisation and PCIe throughput from NVML (``pynvml``), when a GPU
  and ``nvidia-ml-py`` are present.
* :func:`consume`: the training loop. It times the span from building the loader to the end of
  the last step, each ``next()`` (consumer wait, i.e. accelerator idle) and each step, and
  collects the sample indices that arrived.
"""

from __future__ import annotations

import bisect
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from typing import Any

import numpy as np
import psutil

from autominato.telemetry.process import ProcessMeter


@dataclass(frozen=True)
class TreeUsage:
    """Resource use of a process tree over one sampled span.

    Attributes:
        cpu_s: user + system CPU-seconds spent during the span by the root and every process
            seen in its tree (a child that lives only between two listings of the tree,
            ``TreeSampler.TREE_EVERY_S``, is missed).
        peak_memory_bytes: highest footprint of the tree at any sample (``Reading.
            footprint_bytes`` of :mod:`autominato.telemetry.process`), bytes.
        start_memory_bytes: the footprint when sampling started, bytes (the baseline).
        samples: number of samples taken.
    """

    cpu_s: float
    peak_memory_bytes: int
    start_memory_bytes: int
    samples: int


class TreeSampler:
    """Samples CPU-seconds and memory (footprint) of the process tree rooted at ``pid``
    every ``interval`` s.

    The readings come from the process meter (:class:`~autominato.telemetry.process.
    ProcessMeter` over the root and all its descendants, with PSS and the machine's shared
    memory): CPU time is that of every process seen in the tree since sampling started (a
    child that lives only between two listings of the tree, :attr:`TREE_EVERY_S`, is
    missed). Every sample is kept as ``(time.monotonic(), CPU-seconds so far,
    footprint bytes)``, so that :meth:`usage_between` can cut out a span that another process
    timed (CLOCK_MONOTONIC is system-wide on Linux).

    Sampling ``pid`` from another process keeps the sampler's thread out of the measured
    process: a loader that forks its workers only while it is the sole thread (autominato's
    ``start_method="auto"``) then behaves as it would in a training script.
    """

    #: Seconds between two full PSS reads of one process (``ProcessMeter(pss_every=...)``;
    #: in between, its last PSS plus the growth of its private memory; all of them again
    #: when a process starts or exits; what that misses: the meter's doc). Reading every
    #: process's ``smaps_rollup`` at every sample took 9.6-14.7% of a core at 0.2 s (see
    #: ``runner.SAMPLER_INTERVAL_S``) from the loaders measured, and no floor pays it.
    PSS_EVERY_S = 2.0

    #: Seconds between two listings of the tree's processes (``ProcessMeter(tree_every=...)``,
    #: ~2 ms each): a loader's workers live for an epoch or the run, and one found late still
    #: brings its CPU-seconds since it started.
    TREE_EVERY_S = 0.5

    def __init__(self, interval: float = 0.05, pid: int | None = None,
                 exclude: Iterable[int] = ()) -> None:
        self.interval = interval
        self.meter = ProcessMeter(pid, children=True, pss=True, pss_every=self.PSS_EVERY_S,
                                  tree_every=self.TREE_EVERY_S, runqueue=False, exclude=exclude)
        self._own: tuple[float, int] | None = None  # (when read, bytes): _own_share's
        self._base = 0.0
        self.series: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-tree-sampler", daemon=True)

    def _record(self) -> None:
        r = self.meter.read()
        cpu = max(0.0, r.cpu_seconds_total - self._base)
        self.series.append((r.time, cpu, r.footprint_bytes + self._own_share()))

    def _own_share(self) -> int:
        """Bytes to add to the tree's PSS: 0, or, for a sampler running in a process that it
        leaves out of the tree (:class:`ForkedTreeSampler`), that process's share of the pages
        it shares with the tree (its PSS minus its USS): after a fork the parent's PSS halves,
        109 -> 56 MiB measured, and this puts the tree's figure back to what it would be
        without the sampler. Read when the meter read the root's rollup (every
        :attr:`PSS_EVERY_S`, or at once where a process of the tree started or exited: a
        read walks this process's page tables, ~4 ms), so that the two agree on how many
        share the pages (review 142: read on a clock of its own after the root forked and
        before the meter listed the new workers, it split the pages with them while the
        root's figure did not: 116 MiB read for 152)."""
        if os.getpid() not in self.meter.exclude:
            return 0
        now = time.monotonic()
        if self._own is not None and self.meter.root.pid not in self.meter.rollups_read:
            return self._own[1]
        try:
            mem = psutil.Process().memory_full_info()
        except psutil.Error:
            return 0
        self._own = (now, max(0, int(mem.pss) - int(mem.uss)))
        return self._own[1]

    def _first_sample(self) -> None:
        r = self.meter.read()
        self._base = r.cpu_seconds_total
        self.series = [(r.time, 0.0, r.footprint_bytes + self._own_share())]

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._record()

    def start(self) -> TreeSampler:
        self._first_sample()
        self._thread.start()
        return self

    def stop(self) -> TreeUsage:
        """Take a last sample, stop the thread and return the usage since :meth:`start`."""
        self._stop.set()
        self._thread.join()
        self._record()
        return self.usage_between(self.series[0][0], self.series[-1][0])

    def usage_between(self, t0: float, t1: float) -> TreeUsage:
        """Usage over ``[t0, t1]`` (``time.monotonic()`` seconds).

        CPU-seconds: the cumulative CPU time interpolated linearly at ``t0`` and ``t1``
        between the samples around each (review 67: taking the samples outside the span
        added up to an interval of start-up before it and of a loader's prefetch after it).
        Peak memory: the largest footprint sampled inside the span (the samples around it
        when none is); start memory: the last sample at or before ``t0``."""
        series = self.series
        times = [row[0] for row in series]

        def cpu_at(t: float) -> float:
            j = bisect.bisect_left(times, t)
            if j <= 0:
                return series[0][1]
            if j >= len(times):
                return series[-1][1]
            (ta, ca, _), (tb, cb, _) = series[j - 1], series[j]
            return cb if tb <= ta else ca + (cb - ca) * (t - ta) / (tb - ta)

        i = max(0, bisect.bisect_right(times, t0) - 1)
        j = min(len(times) - 1, bisect.bisect_left(times, t1))
        rows = series[i : j + 1]
        inside = [r for r in rows if t0 <= r[0] <= t1] or rows
        return TreeUsage(
            cpu_s=cpu_at(t1) - cpu_at(t0),
            peak_memory_bytes=int(max(r[2] for r in inside)),
            start_memory_bytes=int(rows[0][2]),
            samples=len(inside),
        )


class ForkedTreeSampler(TreeSampler):
    """A :class:`TreeSampler` of this process's tree that runs in a forked child process
    (which it leaves out of the tree, adding back its share of the pages it shares: see
    :meth:`TreeSampler._own_share`) instead of a thread: this process keeps one thread, so a
    loader built in it forks its workers as in a training script (with a sampler thread
    beside it, autominato's ``start_method="auto"`` starts them from a new interpreter,
    ~2.5 s). Fork only while this process runs one thread (:func:`~autominato.pipeline.
    spawn.can_fork_now`); the child runs nothing but the meter.

    The child is stopped by a message on one pipe and answers with its series on another:
    processes forked from this one later (the loader's) inherit both pipes, so neither end's
    closing can be the signal. It ignores SIGINT (a Ctrl-C reaches the whole process group;
    this process decides).
    """

    #: Seconds :meth:`stop` waits for the child to end before it kills it.
    REAP_TIMEOUT_S = 5.0

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.series = []
        self._pid = 0
        self._stop_w: Connection | None = None
        self._out_r: Connection | None = None

    def start(self) -> ForkedTreeSampler:
        """Fork the child and wait for its first sample.

        Raises:
            RuntimeError: the child ended before its first sample.
        """
        stop_r, self._stop_w = Pipe(duplex=False)
        self._out_r, out_w = Pipe(duplex=False)
        root = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover -- the child; its figures come back to the parent
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                self._stop_w.close()
                self._out_r.close()
                sampler = TreeSampler(self.interval, pid=root, exclude=[os.getpid()])
                sampler._first_sample()
                out_w.send_bytes(b"+")  # the span may start
                while not stop_r.poll(self.interval):
                    sampler._record()
                sampler._record()
                out_w.send(sampler.series)
                code = 0
            finally:
                os._exit(code)
        self._pid = pid
        stop_r.close()
        out_w.close()
        try:
            self._out_r.recv_bytes()
        except (EOFError, OSError):
            self._reap()
            raise RuntimeError("the forked tree sampler ended before its first sample") from None
        return self

    def stop(self) -> TreeUsage:
        """Stop the child, take its series and return the usage since :meth:`start`.

        Raises:
            RuntimeError: the child ended without its series (or :meth:`stop` ran before).
        """
        series = None
        try:
            if self._pid:
                self._stop_w.send_bytes(b".")
                series = self._out_r.recv()
        except (EOFError, OSError):
            pass  # it is gone (end of file, a broken pipe): said below
        finally:
            self._reap()
        if not series:
            raise RuntimeError("the forked tree sampler ended without its figures")
        self.series = series
        return self.usage_between(self.series[0][0], self.series[-1][0])

    def _reap(self) -> None:
        """Close this side's pipes and wait for the child (killed after REAP_TIMEOUT_S)."""
        for conn in (self._stop_w, self._out_r):
            if conn is not None:
                conn.close()
        pid, self._pid = self._pid, 0
        if not pid:
            return
        deadline = time.monotonic() + self.REAP_TIMEOUT_S
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)


@dataclass(frozen=True)
class GpuUsage:
    """NVML readings over a span: means of utilisation (%) and PCIe throughput (bytes/s)."""

    util_mean: float
    pcie_rx_bytes_per_s: float
    pcie_tx_bytes_per_s: float
    series: tuple[tuple[float, float], ...] = ()  # (monotonic seconds, utilisation %)


class NvmlSampler:
    """Samples GPU ``index``'s utilisation and PCIe RX/TX every ``interval`` seconds via NVML.

    ``nvmlDeviceGetPcieThroughput`` reports KB/s averaged over NVML's own 20 ms window; the
    figures are converted to bytes/s (x1024, NVML's KB).

    Raises:
        RuntimeError: NVML is not importable or no GPU ``index`` is present.
    """

    def __init__(self, index: int = 0, interval: float = 0.1) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise RuntimeError("NVML sampling needs nvidia-ml-py (import pynvml)") from e
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as e:
            raise RuntimeError(f"NVML: no GPU {index}: {e}") from e
        self._nvml = pynvml
        self.interval = interval
        self._rows: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-nvml", daemon=True)

    def _loop(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.wait(self.interval):
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
                tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
            except nv.NVMLError:
                continue
            self._rows.append((time.monotonic(), float(util), rx, tx))

    def start(self) -> NvmlSampler:
        self._thread.start()
        return self

    def stop(self) -> GpuUsage:
        """Stop sampling; the usage over every sample taken."""
        self._stop.set()
        self._thread.join()
        return self.usage_between(-np.inf, np.inf)

    def usage_between(self, t0: float, t1: float) -> GpuUsage:
        """Means over the samples taken in ``[t0, t1]`` (``time.monotonic()`` seconds)."""
        rows = [r for r in self._rows if t0 <= r[0] <= t1]
        if not rows:
            return GpuUsage(float("nan"), float("nan"), float("nan"))
        a = np.asarray(rows)
        series = tuple((float(t), float(u)) for t, u, _, _ in rows)
        return GpuUsage(float(a[:, 1].mean()), float(a[:, 2].mean()), float(a[:, 3].mean()), series)


@dataclass
class Consumption:
    """What the training loop saw over one or more epochs.

    Attributes:
        wall_s: seconds from the start of building the loader to the end of the last step.
        build_s: seconds spent building the loader (inside ``wall_s``).
        waits_s: per-batch seconds blocked in ``next()`` (the first includes start-up; the
            first of each later epoch includes its ``iter()`` call: the epoch-boundary wait).
        steps_s: per-batch step seconds.
        busy: ``(start, end)`` of each step, seconds since the build started.
        indices: sample indices delivered, in arrival order.
        epoch_ends: ``len(indices)`` at the end of each epoch, shape ``(epochs,)``.
        epoch_first: index into ``waits_s`` of each epoch's first batch.
        span_start: ``time.monotonic()`` when the build started (the span's start, comparable
            across processes); the span ends at ``span_start + wall_s``.
    """

    wall_s: float = 0.0
    build_s: float = 0.0
    waits_s: list[float] = field(default_factory=list)
    steps_s: list[float] = field(default_factory=list)
    busy: list[tuple[float, float]] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    epoch_ends: list[int] = field(default_factory=list)
    epoch_first: list[int] = field(default_factory=list)
    span_start: float = 0.0

    @property
    def span_end(self) -> float:
        return self.span_start + self.wall_s

    @property
    def busy_s(self) -> float:
        return float(sum(self.steps_s))

    @property
    def idle_ratio(self) -> float:
        """Fraction of the span in which the accelerator was not stepping, in [0, 1]."""
        return min(1.0, max(0.0, 1.0 - self.busy_s / self.wall_s)) if self.wall_s > 0 else 0.0

    @property
    def p99_wait_s(self) -> float:
        return float(np.quantile(self.waits_s, 0.99)) if self.waits_s else 0.0

    @property
    def next_epoch_wait_s(self) -> float:
        """Mean wait for the first batch of every epoch after the first (the epoch-boundary
        bubble), seconds; NaN with one epoch."""
        later = [self.waits_s[i] for i in self.epoch_first[1:] if i < len(self.waits_s)]
        return float(np.mean(later)) if later else float("nan")


def batch_indices(batch: Any) -> list[int]:
    """Sample indices of a batch collated from ``(index, sample)`` pairs.

    ``default_collate`` turns a list of pairs into ``[indices (B,) int64 tensor, samples]``.

    Raises:
        TypeError: the batch does not start with a 1-D tensor of indices.
    """
    head = batch[0] if isinstance(batch, (list, tuple)) and batch else None
    if head is None or not hasattr(head, "tolist") or getattr(head, "ndim", 0) != 1:
        raise TypeError(
            "benchmark batch must be collated from (index, sample) pairs; got "
            f"{type(batch).__name__} whose first element is {type(head).__name__}"
        )
    return [int(i) for i in head.tolist()]


def consume(
    build: Callable[[], tuple[Iterable[Any], Callable[[], None]]],
    step: Callable[[Any], None],
    epochs: int = 1,
) -> tuple[Consumption, Callable[[], None]]:
    """Build a loader, iterate ``epochs`` epochs and run ``step`` on every batch; time it all.

    Args:
        build: returns ``(iterable of batches, close)``; the iterable is iterated once per
            epoch; the build and the first ``iter()`` count in ``build_s`` (and ``wall_s``).
        step: the accelerator step, called with each batch.
        epochs: passes over the iterable, back to back as a training loop makes them.

    Returns:
        The consumption record and the loader's ``close`` (not yet called: shutting a loader
        down is outside the measured span, which ends with the last step).
    """
    c = Consumption(span_start=time.monotonic())
    t0 = time.perf_counter()
    iterable, close = build()
    it = iter(iterable)
    c.build_s = time.perf_counter() - t0
    try:
        for epoch in range(epochs):
            c.epoch_first.append(len(c.waits_s))
            t = time.perf_counter()
            if epoch:
                it = iter(iterable)  # in the wait of the epoch's first batch
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                c.indices.extend(batch_indices(batch))
                step(batch)
                t2 = time.perf_counter()
                c.waits_s.append(t1 - t)
                c.steps_s.append(t2 - t1)
                c.busy.append((t1 - t0, t2 - t0))
                t = time.perf_counter()
            c.epoch_ends.append(len(c.indices))
        c.wall_s = c.busy[-1][1] if c.busy else time.perf_counter() - t0
    except BaseException:
        close()
        raise
    return c, close


def utilisation_series(
    busy: list[tuple[float, float]], end_s: float, bins: int = 100
) -> tuple[np.ndarray, np.ndarray]:
    """Accelerator utilisation over time from step intervals.

    Returns:
        ``(t, u)``: bin centres in seconds, shape ``(bins,)``, and the busy fraction of each
        bin in [0, 1], shape ``(bins,)``.
    """
    edges = np.linspace(0.0, max(end_s, 1e-9), bins + 1)
    u = np.zeros(bins)
    for s, e in busy:
        lo = np.clip(edges[:-1], s, e)
        hi = np.clip(edges[1:], s, e)
        u += hi - lo
    width = np.diff(edges)
    return (edges[:-1] + edges[1:]) / 2, np.clip(u / width, 0.0, 1.0)
