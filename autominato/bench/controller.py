"""``autominato bench controller``: the online controller against the best static setting.

Two arms on the same workload, consumer and seeds:

* **controller**: ``autominato.Loader`` started from a bad configuration (1 worker, depth 1)
  with the online controller (:mod:`autominato.control`) retuning it;
* **best static**: the setting with the highest throughput in a grid sweep of workers x depth
  (short probes on the stationary workload, as an offline tuning before a long run would do),
  fixed for the whole run.

Two workloads: **stationary** (every sample costs ``cost_ms``) and **shifting** (the cost
doubles from ``shift_at`` of the epoch on: the offline tuning could not see it coming). The
consumer is a simulated accelerator step (a sleep of ``step_ms`` per batch), so its wait in
``next()`` is accelerator idle time.

Reported per run: throughput (samples/s), idle ratio, idle ratio over the last quarter of the
batches, the controller's decisions, and for the controller arm the time until its throughput
over a rolling window first reaches 90 % of the best static throughput, and the final ratio of
its throughput to the static one's over the last quarter of the batches. A CSV of the time
series (and a PNG with matplotlib) goes to ``--out``.

Transforms wait (``--cost wait``, the default: I/O-like work such as remote reads or a
decoder on another device, which more workers speed up on any machine) or burn CPU
(``--cost cpu``: on a machine with few cores the grid's best is simply the core count).
"""

from __future__ import annotations

import argparse
import csv
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autominato.models.step import SleepStep
from autominato.telemetry.window import idle_ratio

log = logging.getLogger("autominato.bench.controller")

#: Rolling window over which throughput is compared with the static arm's, seconds.
ROLLING_S = 2.0


class WaitTransform:
    """Waits the sample's ``cost_s`` seconds (no CPU), then scales the image.

    Input and output as :func:`autominato.bench.workload.synthetic_transform`.
    """

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        time.sleep(sample["cost_s"])
        image = sample["image"]
        image *= np.float32(rng.uniform(0.9, 1.1))
        return {"image": image}


@dataclass
class Run:
    """One epoch of one arm: per-batch times seen by the consumer.

    Attributes:
        arm, workload: labels.
        start_knobs / end_knobs: knob values at the start and the end.
        t: when each batch was returned, seconds since the epoch started, shape ``(B,)``.
        wait_s: time the consumer was blocked in ``next()`` for each batch, shape ``(B,)``.
        samples: samples in each batch, shape ``(B,)``.
        step_s: the consumer's step per batch, seconds.
        decisions: the controller's decisions, one line each.
    """

    arm: str
    workload: str
    start_knobs: dict[str, int]
    end_knobs: dict[str, int] = field(default_factory=dict)
    t: np.ndarray = field(default_factory=lambda: np.zeros(0))
    wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_s: float = 0.0
    decisions: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0

    def throughput(self, first: int = 0) -> float:
        """Samples/s from batch ``first`` to the end (from the epoch start when 0)."""
        t0 = float(self.t[first - 1]) if first > 0 else 0.0
        span = self.seconds - t0
        return float(self.samples[first:].sum()) / span if span > 0 else 0.0

    def idle(self, first: int = 0) -> float:
        """Accelerator-idle ratio ``wait / (wait + step)`` from batch ``first`` on."""
        wait = float(self.wait_s[first:].sum())
        busy = self.step_s * len(self.wait_s[first:])
        return idle_ratio(wait, busy)

    def rolling(self, window_s: float = ROLLING_S) -> tuple[np.ndarray, np.ndarray]:
        """``(times, samples/s)`` over the trailing ``window_s`` at each batch."""
        cum = np.cumsum(self.samples)
        rates = np.zeros(len(self.t))
        for i, ti in enumerate(self.t):
            j = int(np.searchsorted(self.t, ti - window_s, side="right"))
            if j == 0:
                rates[i] = cum[i] / ti if ti > 0 else 0.0
            else:
                rates[i] = (cum[i] - cum[j - 1]) / (ti - self.t[j - 1])
        return self.t, rates

    def time_to(self, rate: float, window_s: float = ROLLING_S) -> float | None:
        """First time (s) the rolling throughput reaches ``rate`` after one full window."""
        t, r = self.rolling(window_s)
        ok = np.nonzero((t >= window_s) & (r >= rate))[0]
        return float(t[ok[0]]) if len(ok) else None


def make_dataset(n: int, cost_ms: float, shift_at: float | None, sample_mb: float) -> Any:
    """The synthetic dataset of :mod:`autominato.bench.workload`, constant cost per sample."""
    from autominato.bench.workload import SyntheticDataset, draw_costs

    costs = draw_costs(n, "constant", cost_ms * 1e-3, double_at=shift_at)
    return SyntheticDataset(costs, sample_mb)


def run_epoch(
    dataset: Any,
    args: argparse.Namespace,
    arm: str,
    workload: str,
    knobs: dict[str, int],
    controller: bool,
) -> Run:
    """One epoch of ``dataset`` through ``autominato.Loader`` with a sleeping consumer."""
    from autominato.bench.workload import synthetic_transform
    from autominato.control import Controller
    from autominato.loader import Loader

    transform = WaitTransform() if args.cost == "wait" else synthetic_transform
    loader = Loader(
        dataset,
        args.batch_size,
        transform=transform,
        worker_kind=args.worker_kind,
        autotune=False,
        seed=0,
        in_order=False,  # completion order, as in training (the default follows shuffle=False)
        **knobs,
    )
    run = Run(arm, workload, dict(loader.knobs.as_dict()), step_s=args.step_ms * 1e-3)
    step = SleepStep(run.step_s)
    ctl = Controller(loader, interval=args.interval) if controller else None
    times, waits, sizes = [], [], []
    with loader:
        it = iter(loader)
        if ctl is not None:
            ctl.start()
        t0 = time.monotonic()
        while True:
            t_ask = time.monotonic()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = time.monotonic()
            times.append(now - t0)
            waits.append(now - t_ask)
            sizes.append(len(batch["image"]))
            step(batch)
        if ctl is not None:
            ctl.stop()
            run.decisions = [d.line() for d in ctl.decisions]
        run.end_knobs = loader.knobs.as_dict()
    run.t, run.wait_s, run.samples = np.array(times), np.array(waits), np.array(sizes)
    return run


def sweep(args: argparse.Namespace) -> tuple[dict[str, int], list[tuple[dict[str, int], float]]]:
    """Grid of workers x depth on a stationary probe; returns the best and every score.

    Best is the highest throughput; settings within 2 % of it count as ties, broken by the
    fewest workers, then the smallest depth (the least resources that do the job).
    """
    probe = make_dataset(args.probe_samples, args.cost_ms, None, args.sample_mb)
    scores = []
    for workers in args.grid_workers:
        for depth in args.grid_depth:
            knobs = {"workers": workers, "depth": depth}
            r = run_epoch(probe, args, "grid", "probe", knobs, controller=False)
            # Leave out the pipeline's fill-up: the first quarter of the batches.
            scores.append((knobs, r.throughput(len(r.t) // 4)))
            log.info("grid workers=%d depth=%d: %.1f samples/s", workers, depth, scores[-1][1])
    top = max(s for _, s in scores)
    ties = [k for k, s in scores if s >= 0.98 * top]
    best = min(ties, key=lambda k: (k["workers"], k["depth"]))
    return best, scores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``autominato bench controller``."""
    g = parser.add_argument_group("controller scenarios")
    g.add_argument("--samples", type=int, default=1200, help="samples per epoch (default 1200)")
    g.add_argument("--batch-size", type=int, default=4, help="samples per batch (default 4)")
    g.add_argument("--cost-ms", type=float, default=20.0, help="transform cost per sample, ms")
    g.add_argument(
        "--cost", choices=["wait", "cpu"], default="wait", help="transform waits or burns CPU"
    )
    g.add_argument("--step-ms", type=float, default=30.0, help="consumer step per batch, ms")
    g.add_argument(
        "--shift-at", type=float, default=0.5, help="fraction of the epoch where the cost doubles"
    )
    g.add_argument("--sample-mb", type=float, default=0.25, help="sample size, MB")
    g.add_argument("--worker-kind", choices=["thread", "process"], default="thread")
    g.add_argument("--interval", type=float, default=0.25, help="controller interval, seconds")
    g.add_argument("--probe-samples", type=int, default=240, help="samples per grid probe")
    g.add_argument("--grid-workers", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    g.add_argument("--grid-depth", type=int, nargs="+", default=[1, 2, 4])
    g.add_argument("--out", type=Path, default=None, help="folder for the CSV and the plot")


def write_outputs(runs: list[Run], out: Path) -> list[Path]:
    """``controller_bench.csv`` (time series) and, with matplotlib, ``controller_bench.png``."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "controller_bench.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["workload", "arm", "t_s", "wait_s", "samples", "rolling_samples_per_s"])
        for r in runs:
            _, rates = r.rolling()
            for t, wait, n, rate in zip(r.t, r.wait_s, r.samples, rates, strict=True):
                w.writerow([r.workload, r.arm, f"{t:.4f}", f"{wait:.5f}", int(n), f"{rate:.2f}"])
    paths = [csv_path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    workloads = sorted({r.workload for r in runs})
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 6), squeeze=False)
    for col, name in enumerate(workloads):
        for r in (r for r in runs if r.workload == name):
            t, rates = r.rolling()
            axes[0][col].plot(t, rates, label=r.arm)
            idle = np.convolve(r.wait_s / (r.wait_s + r.step_s), np.ones(10) / 10, mode="same")
            axes[1][col].plot(t, idle, label=r.arm)
        axes[0][col].set_title(name)
        axes[0][col].set_ylabel(f"samples/s ({ROLLING_S:.0f} s window)")
        axes[1][col].set_ylabel("idle ratio (10 batches)")
        axes[1][col].set_xlabel("seconds")
        axes[0][col].legend()
    fig.tight_layout()
    png = out / "controller_bench.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return [*paths, png]


def summarise(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per run, with the controller's time to 90 % and final ratio against static."""
    rows = []
    for r in runs:
        tail = len(r.t) * 3 // 4
        row = {
            "workload": r.workload,
            "arm": r.arm,
            "seconds": r.seconds,
            "samples_per_s": r.throughput(),
            "idle": r.idle(),
            "idle_last_quarter": r.idle(tail),
            "start": r.start_knobs,
            "end": r.end_knobs,
            "decisions": len(r.decisions),
        }
        static = next(
            (s for s in runs if s.workload == r.workload and s.arm == "best static"), None
        )
        if r.arm == "controller" and static is not None:
            row["time_to_90pct_s"] = r.time_to(0.9 * static.throughput())
            row["final_ratio"] = r.throughput(tail) / static.throughput(len(static.t) * 3 // 4)
            row["overall_ratio"] = r.throughput() / static.throughput()
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    """Run the sweep and the four runs; print the summary. Returns 0."""
    t_start = time.monotonic()
    best, scores = sweep(args)
    print("grid (stationary probe, samples/s):")
    for knobs, s in scores:
        print(f"  workers={knobs['workers']} depth={knobs['depth']}: {s:7.1f}")
    print(f"best static: {best}")
    runs = []
    for name, shift in (("stationary", None), ("shifting", args.shift_at)):
        data = make_dataset(args.samples, args.cost_ms, shift, args.sample_mb)
        runs.append(run_epoch(data, args, "best static", name, best, controller=False))
        bad = {"workers": 1, "depth": 1}
        runs.append(run_epoch(data, args, "controller", name, bad, controller=True))
    rows = summarise(runs)
    need = args.batch_size / (args.step_ms * 1e-3)
    print(
        f"\nworkload: {args.samples} samples, cost {args.cost_ms:g} ms ({args.cost}), "
        f"step {args.step_ms:g} ms per batch of {args.batch_size} "
        f"(consumer-bound ceiling {need:.1f} samples/s), {args.worker_kind} workers"
    )
    head = f"{'workload':11} {'arm':12} {'samples/s':>9} {'idle':>6} {'idle(last1/4)':>13} "
    print(head + f"{'t->90%':>7} {'final':>6} {'decisions':>9}  knobs start -> end")
    for row in rows:
        t90 = row.get("time_to_90pct_s")
        t90s = "-" if "time_to_90pct_s" not in row else ("never" if t90 is None else f"{t90:.1f}s")
        fin = f"{row['final_ratio']:.2f}" if "final_ratio" in row else "-"
        print(
            f"{row['workload']:11} {row['arm']:12} {row['samples_per_s']:9.1f} {row['idle']:6.3f} "
            f"{row['idle_last_quarter']:13.3f} {t90s:>7} {fin:>6} {row['decisions']:9d}  "
            f"{row['start']} -> {row['end']}"
        )
    if args.out is not None:
        for p in write_outputs(runs, args.out):
            print(f"wrote {p}")
    print(f"bench took {time.monotonic() - t_start:.0f} s")
    return 0
