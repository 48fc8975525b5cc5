"""Telemetry overhead: samples/s with telemetry on against off, in one run.

Usage: python scripts/bench_telemetry_overhead.py [PAIRS]

One loader, one run: epochs alternate telemetry on (hooks + scrape-time collector + Data
Monitor every 1 s; an outside curl scrapes /metrics every 1 s) and off. Paired adjacent epochs,
median of per-pair ratios (cancels the drift of a shared, loaded machine)."""

import statistics
import subprocess
import sys
import time

import numpy as np

from autominato import Loader
from autominato.telemetry import attach, serve


class Tiny:
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        return np.full((4,), i, np.float32)


class Vol:
    def __len__(self):
        return 160

    def __getitem__(self, i):
        return np.full((64, 64, 64), i % 7, np.float32)


def flip(s, rng):
    return s[::-1].copy() * 1.01


def epoch(L):
    c0, t0 = time.process_time(), time.perf_counter()
    n = 0
    for b in L:
        n += b.shape[0]
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    exporter = serve(0)
    scraper = subprocess.Popen(
        ["bash", "-c", f"while true; do curl -s -o /dev/null {exporter.url}; sleep 1; done"]
    )
    cases = {
        "tiny (4 floats), workers=0": (Tiny(), dict(workers=0)),
        "64^3 float32 + flip, 2 thread workers": (
            Vol(),
            dict(worker_kind="thread", workers=2, transform=flip),
        ),
    }
    try:
        for name, (ds, kw) in cases.items():
            L = Loader(ds, batch_size=8, autotune=False, seed=0, **kw)
            epoch(L)  # warm-up
            rate, cpu, on_rates, off_rates = [], [], [], []
            for p in range(pairs):
                res = {}
                for flag in (False, True) if p % 2 == 0 else (True, False):
                    h = attach(L, monitor_interval=1.0) if flag else None
                    res[flag] = epoch(L)
                    if h:
                        h.close()
                rate.append(res[True][0] / res[False][0])
                cpu.append(res[True][1] / res[False][1])
                on_rates.append(res[True][0])
                off_rates.append(res[False][0])
            L.close()
            q = statistics.quantiles(rate, n=4)
            print(
                f"{name}: {pairs} epoch pairs; samples/s median off {statistics.median(off_rates):.0f} "
                f"on {statistics.median(on_rates):.0f}; per-pair on/off samples/s median {statistics.median(rate):.3f} "
                f"(quartiles {q[0]:.3f}-{q[2]:.3f}); CPU/sample on/off median {statistics.median(cpu):.3f}"
            )
    finally:
        scraper.kill()
        exporter.close()
