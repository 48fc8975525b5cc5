"""Per-sample overhead of the loader against DataLoader, on samples that cost nothing.

    python scripts/bench_overhead.py [--samples 2000] [--batch-size 32] [--workers 2] [--repeats 5]

Both loaders serve ``--samples`` int64[4] samples (no transform) in batches of
``--batch-size`` with ``--workers`` worker processes; DataLoader with
``persistent_workers=True``. Each repeat times one epoch after the first batch (worker
start-up excluded), the arms interleaved (A B A B ...) so that a change in the machine's load
hits both. Prints each arm's median microseconds per sample and the ratio
autominato / DataLoader (the core-v2 issue's target: <= 1.0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from autominato import Loader


class Tiny:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4, i, np.int64)


def epoch_us_per_sample(loader, n: int) -> float:
    it = iter(loader)
    first = next(it)
    seen = len(first)
    t0 = time.perf_counter()
    for b in it:
        seen += len(b)
    dt = time.perf_counter() - t0
    assert seen == n, (seen, n)
    return dt / (n - len(first)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ds = Tiny(a.samples)
    auto = Loader(ds, a.batch_size, workers=a.workers, autotune=False)
    dl = DataLoader(ds, a.batch_size, num_workers=a.workers, persistent_workers=True)
    times: dict[str, list[float]] = {"dataloader": [], "autominato": []}
    try:
        epoch_us_per_sample(dl, a.samples)  # warm both (worker start-up)
        epoch_us_per_sample(auto, a.samples)
        for _ in range(a.repeats):
            times["dataloader"].append(epoch_us_per_sample(dl, a.samples))
            times["autominato"].append(epoch_us_per_sample(auto, a.samples))
    finally:
        auto.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:11s} median {med[k]:7.1f} us/sample  (runs: {', '.join(f'{x:.1f}' for x in v)})")
    print(f"ratio autominato / dataloader: {med['autominato'] / med['dataloader']:.2f}x")


if __name__ == "__main__":
    main()
