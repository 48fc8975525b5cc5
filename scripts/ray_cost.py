"""What going through Ray costs per sample, and the controller growing actors from one.

    python scripts/ray_cost.py [--samples 96] [--mb 8] [--cost-ms 40] [--cpus 2]

On a local Ray instance of ``--cpus`` CPUs (or ``RAY_ADDRESS``'s cluster), with samples of
``--mb`` MiB (float32) that cost ``--cost-ms`` of CPU each (``bench.workload.burn_cpu``):

1. samples/s of one epoch with process workers and with Ray actors, ``workers=--cpus`` each,
   controller off, timed from the first batch (worker start-up excluded), arms interleaved;
2. the Ray overhead per sample from the loader's own figures (``snapshot().nodes``): round
   trip (sent to the actor -> result here) minus the actor's service time, i.e. scheduling plus
   the object-store transfer of the sample's bytes; measured at ``--mb`` and at 4 KiB;
3. the controller on, starting from ``workers=1`` with a consumer step that the actors can keep
   up with only at ``--cpus`` actors: the ``workers`` knob over time and its decisions.

Prints one line per figure. These are the inputs of docs/scale-out.md's estimate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray

from autominato import Loader
from autominato.bench.workload import burn_cpu


class Volumes:
    def __init__(self, n: int, mb: float) -> None:
        self.n, self.shape = n, (max(1, int(mb * 2**20 / 4)),)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(self.shape, i, np.float32)


class Augment:
    """The transform: ``cost_s`` CPU-seconds per sample."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s = cost_s

    def __call__(self, x):
        burn_cpu(self.cost_s)
        return x


def epoch_rate(loader: Loader) -> float:
    it = iter(loader)
    first = next(it)
    n = len(first)
    t = time.perf_counter()
    for b in it:
        n += len(b)
    return (n - len(first)) / (time.perf_counter() - t)


def overhead(loader: Loader) -> tuple[float, float, float]:
    """(round trip, service, bytes) per sample, from the loader's node figures."""
    nodes = loader.snapshot().nodes
    items = sum(nd.items_total for nd in nodes)
    rt = sum(nd.round_trip_seconds_total for nd in nodes) / items
    sv = sum(nd.service_seconds_total for nd in nodes) / items
    return rt, sv, sum(nd.bytes_total for nd in nodes) / items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--cost-ms", type=float, default=40.0)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    ray.init(num_cpus=a.cpus, include_dashboard=False, log_to_driver=False)
    ds = Volumes(a.samples, a.mb)
    aug = Augment(a.cost_ms / 1e3)
    kw = dict(batch_size=2, workers=a.cpus, autotune=False, seed=0)
    rates: dict[str, list[float]] = {"process": [], "ray": []}
    with (Loader(ds, worker_kind="process", transform=aug, **kw) as proc,
          Loader(ds, worker_kind="ray", transform=aug, **kw) as rl):
        for _ in range(a.repeats):
            for name, loader in (("process", proc), ("ray", rl)):
                rates[name].append(epoch_rate(loader))
        rt, sv, nbytes = overhead(rl)
    for name, r in rates.items():
        print(f"{name:8s} workers={a.cpus}: {statistics.median(r):.1f} samples/s "
              f"(median of {a.repeats}: {', '.join(f'{x:.1f}' for x in r)})")
    print(f"ray per sample at {nbytes / 2**20:.2f} MiB: round trip {rt * 1e3:.1f} ms, service "
          f"{sv * 1e3:.1f} ms, overhead {(rt - sv) * 1e3:.1f} ms")
    while ray.available_resources().get("CPU", 0) < a.cpus:
        time.sleep(0.1)
    with Loader(Volumes(a.samples, 4 / 1024), worker_kind="ray", **kw) as small:
        epoch_rate(small)
        epoch_rate(small)
        rt, sv, nbytes = overhead(small)
    print(f"ray per sample at {nbytes / 1024:.1f} KiB: round trip {rt * 1e3:.2f} ms, service "
          f"{sv * 1e3:.2f} ms, overhead {(rt - sv) * 1e3:.2f} ms")
    while ray.available_resources().get("CPU", 0) < a.cpus:
        time.sleep(0.1)
    # The consumer's step: what `cpus` actors deliver a batch in (2 samples of cost_ms each).
    step_s = 2 * a.cost_ms / 1e3 / a.cpus
    t0 = time.monotonic()
    with Loader(Volumes(10_000, a.mb), batch_size=2, worker_kind="ray", transform=aug,
                workers=1, seed=0) as grow:
        last = None
        for k, _ in enumerate(grow):
            time.sleep(step_s)
            w = grow.knobs.workers
            if w != last:
                print(f"t={time.monotonic() - t0:6.1f} s batch {k:4d}: workers={w}")
                last = w
            if w == a.cpus and k > 20 or time.monotonic() - t0 > 120:
                break
        for d in grow.controller.decisions:
            print(f"decision: {d.line()}")
    ray.shutdown()


if __name__ == "__main__":
    main()
