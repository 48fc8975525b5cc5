"""A fluid model of the pipeline that produces synthetic snapshot histories for rules.

A decision rule is a pure function of a history of snapshots, so it can be exercised without
threads, processes or clocks: :class:`SimulatedLoader` turns a :class:`Workload` (service
times, consumer step time, cores, bytes) and the current knobs into the
:class:`~autominato.pipeline.stats.LoaderSnapshot` the real loader would report after each
interval, and :func:`run_rule` closes the loop. The model is steady-state queueing, not a
discrete-event simulation:

* a stage with ``n`` workers and service time ``s`` serves at most ``n / s`` samples/s;
* CPU-bound transforms share the cores: with ``n > cores`` workers each takes ``s x n / cores``;
* the pool caps samples in flight, so by Little's law the rate is at most
  ``pool_size / (read latency + transform latency)``;
* the consumer takes ``step_s`` per batch and waits ``max(0, batch / rate - step_s)`` for the
  next, plus ``burst_s / depth`` when the producer is bursty (a deeper prefetch absorbs bursts);
* with ``epoch_batches``, an epoch ends every that many batches: the training loop then spends
  ``between_s`` outside the loader, and an epoch that was not ``prefetched`` starts cold (the
  consumer waits ``cold_wait_s`` while the pipeline fills).

Use it to test a rule (``tests/test_control_rule.py``) or to try one on a workload before
running it on a real job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from autominato.control.rule import (
    CPU_SECONDS_KEY,
    WORKER_COUNT_KEY,
    WORKER_RSS_KEY,
    Budget,
    Decision,
    Rule,
)
from autominato.pipeline.knobs import KNOB_NAMES
from autominato.pipeline.stats import LoaderSnapshot, StageSnapshot
from autominato.telemetry.cores import CPU_OF_WORKERS_KEY


@dataclass(frozen=True)
class Workload:
    """What the simulated job costs.

    Attributes:
        transform_s: transform service time per sample on an idle core, seconds.
        read_s: read service time per sample, seconds (I/O: does not use a core).
        step_s: consumer (training step) time per batch, seconds.
        batch_size: samples per batch.
        cores: cores the transform workers share.
        cpu_bound: the transform burns CPU (``True``) or sleeps / waits on I/O (``False``).
        sample_bytes: bytes of one transformed sample.
        worker_rss_bytes: private memory of one worker process, bytes.
        burst_s: extra consumer wait per batch at depth 1 from a bursty producer, seconds.
        noise: relative standard deviation of service and step times per interval.
        epoch_batches: batches per epoch (0: one epoch that never ends).
        prefetched: each later epoch's samples start before it does (the Loader's
            ``prefetch_next_epoch``); else each starts cold.
        between_s: seconds the training loop spends between two epochs (validation).
        cold_wait_s: the consumer's extra wait at a cold start, seconds.
    """

    transform_s: float = 0.05
    read_s: float = 0.005
    step_s: float = 0.1
    batch_size: int = 4
    cores: int = 4
    cpu_bound: bool = True
    sample_bytes: float = 8e6
    worker_rss_bytes: float = 200e6
    burst_s: float = 0.0
    noise: float = 0.0
    epoch_batches: int = 0
    prefetched: bool = True
    between_s: float = 0.0
    cold_wait_s: float = 1.0


class SimulatedLoader:
    """Advances a :class:`Workload` one interval at a time and reports snapshots.

    Args:
        workload: the costs; may be replaced between calls (``sim.workload = ...``) to model
            a shift.
        knobs: starting knob values (all four of :data:`KNOB_NAMES`).
        seed: seed of the noise generator.
    """

    def __init__(self, workload: Workload, knobs: Mapping[str, int], seed: int = 0) -> None:
        self.workload = workload
        self.knobs = {n: int(knobs[n]) for n in KNOB_NAMES}
        self.rng = np.random.default_rng(seed)
        self.time = 0.0
        self.epoch = 0
        self.cold_starts = 1  # the first epoch's
        self._tot = dict.fromkeys(
            ("batches", "wait", "busy", "t_items", "t_serv", "r_items", "r_serv", "cpu",
             "between"), 0.0
        )

    def rate(self, knobs: Mapping[str, int] | None = None) -> tuple[float, float, float]:
        """``(samples/s, transform service s, read service s)`` at ``knobs`` without noise."""
        k = self.knobs if knobs is None else knobs
        w = self.workload
        workers, readers = k["workers"], max(1, k["read_threads"])
        t_s = w.transform_s
        if workers == 0:
            # Inline transforms run in the read threads.
            r_s = w.read_s + t_s * (max(1.0, readers / w.cores) if w.cpu_bound else 1.0)
            caps = [readers / r_s]
            latency = r_s
            t_s = 0.0
        else:
            if w.cpu_bound:
                t_s *= max(1.0, workers / w.cores)
            r_s = w.read_s
            caps = [workers / t_s, readers / r_s]
            latency = t_s + r_s
        if k["pool_size"] > 0:
            caps.append(k["pool_size"] / latency)
        return min(caps), t_s, r_s

    def _noise(self) -> float:
        """A multiplicative factor, mean 1, relative deviation ``workload.noise``."""
        if not self.workload.noise:
            return 1.0
        return max(0.2, 1.0 + self.workload.noise * float(self.rng.standard_normal()))

    def step(self, dt: float = 1.0) -> LoaderSnapshot:
        """Run ``dt`` seconds at the current knobs and return the snapshot at the end."""
        w = self.workload
        rate, t_s, r_s = self.rate()
        rate /= self._noise()
        step = w.step_s * self._noise()
        wait = max(0.0, w.batch_size / rate - step) + w.burst_s / max(1, self.knobs["depth"])
        batches = dt / (step + wait)
        samples = batches * w.batch_size
        tot = self._tot
        extra = 0.0
        if w.epoch_batches > 0:
            ended = int((tot["batches"] + batches) // w.epoch_batches) - int(
                tot["batches"] // w.epoch_batches)
            for _ in range(ended):
                self.epoch += 1
                tot["between"] += w.between_s
                extra += w.between_s
                if not w.prefetched:
                    self.cold_starts += 1
                    tot["wait"] += w.cold_wait_s
                    extra += w.cold_wait_s
        tot["batches"] += batches
        tot["wait"] += batches * wait
        tot["busy"] += batches * step
        tot["t_items"] += samples if self.knobs["workers"] else 0
        tot["t_serv"] += samples * t_s
        tot["r_items"] += samples
        tot["r_serv"] += samples * r_s
        cpu_per_sample = w.transform_s if w.cpu_bound else 0.02 * w.transform_s
        tot["cpu"] += samples * cpu_per_sample + 0.05 * dt
        self.time += dt + extra
        return self.snapshot(samples / dt)

    def snapshot(self, rate: float = 0.0) -> LoaderSnapshot:
        """The snapshot at the current time; ``rate`` (samples/s) sets the busy counts."""
        k, w, tot = self.knobs, self.workload, self._tot
        _, t_s, r_s = self.rate()
        stages = {
            "read": StageSnapshot(
                "read",
                self.time,
                int(tot["r_items"]),
                int(tot["r_items"] * w.sample_bytes),
                tot["r_serv"],
                0.0,
                0,
                k["pool_size"],  # a separate read stage's queue, as the pipeline wires it
                max(1, k["read_threads"]),
                min(max(1, k["read_threads"]), round(rate * r_s)),
            ),
        }
        if k["workers"] > 0:
            stages["transform"] = StageSnapshot(
                "transform",
                self.time,
                int(tot["t_items"]),
                int(tot["t_items"] * w.sample_bytes),
                tot["t_serv"],
                0.0,
                0,
                0,
                k["workers"],
                min(k["workers"], round(rate * t_s)),
            )
        buffered = k["pool_size"] + k["depth"] * w.batch_size
        procs = k["workers"]
        return LoaderSnapshot(
            time=self.time,
            stages=stages,
            consumer_wait_seconds_total=tot["wait"],
            consumer_wait_recent_s=(),
            consumer_busy_seconds_total=tot["busy"],
            batches_total=int(tot["batches"]),
            samples_total=int(tot["batches"]) * w.batch_size,
            epoch=self.epoch,
            cold_starts_total=self.cold_starts,
            between_epochs_seconds_total=tot["between"],
            stragglers_total=0,
            skipped_total=0,
            worker_restarts_total=0,
            h2d_bytes_total=0,
            h2d_seconds_total=0.0,
            knobs=dict(k),
            sample_bytes=w.sample_bytes,
            pool_bytes=int(buffered * w.sample_bytes),
            extra={
                CPU_SECONDS_KEY: tot["cpu"],
                CPU_OF_WORKERS_KEY: 1.0,  # the worker processes' CPU alone
                WORKER_RSS_KEY: procs * w.worker_rss_bytes,
                WORKER_COUNT_KEY: float(procs),
            },
        )


@dataclass
class Trace:
    """What :func:`run_rule` saw.

    Attributes:
        history: the snapshots, the starting one first (``len = steps + 1``).
        decisions: the decisions, as applied.
        at: for each decision, the index into ``history`` of the snapshot it was taken on.
        knobs: the knob values after each step (``len = steps``).
    """

    history: list[LoaderSnapshot]
    decisions: list[Decision]
    at: list[int]
    knobs: list[dict[str, int]]


def run_rule(
    rule: Rule,
    sim: SimulatedLoader,
    bounds: Mapping[str, tuple[int, int]],
    budget: Budget,
    steps: int,
    dt: float = 1.0,
    on_step: Callable[[int, SimulatedLoader], None] | None = None,
) -> Trace:
    """Run ``rule`` against ``sim`` for ``steps`` intervals of ``dt`` seconds.

    ``on_step(i, sim)`` runs before interval ``i`` (e.g. to shift the workload). Decisions are
    applied clamped to ``bounds``, as :class:`~autominato.pipeline.knobs.Knobs` would.
    """
    state = rule.initial_state()
    trace = Trace([sim.snapshot()], [], [], [])
    for i in range(steps):
        if on_step is not None:
            on_step(i, sim)
        trace.history.append(sim.step(dt))
        decisions, state = rule.decide(trace.history, bounds, budget, state)
        for d in decisions:
            lo, hi = bounds[d.knob]
            new = max(lo, min(hi, d.new))
            sim.knobs[d.knob] = new
            trace.decisions.append(replace(d, new=new))
            trace.at.append(len(trace.history) - 1)
        trace.knobs.append(dict(sim.knobs))
    return trace


__all__ = ["SimulatedLoader", "Trace", "Workload", "run_rule"]
