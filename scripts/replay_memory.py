"""Weigh memory-aware dispatch's rules on a workload's measured samples, without noise.

Measures every sample of ``--epochs`` epochs of the KiTS19 bench workload serially (seconds
and peak memory each, as a worker measures it), then replays dispatch to ``--workers`` on a
simulated clock under each rule of ``autominato.bench.replay.RULES`` (the loader's own
admission code) in ``--orders`` sampler orders, and prints each rule's wall time against the
rule ``off`` (no sample held back; the time until the training loop's last step ends), the
worker-seconds idle for memory and the largest sum of the peaks running together. With
``--margins``, the rule ``scan`` is replayed again at each budget headroom on the same
measurement (``MARGIN`` of ``autominato/pipeline/memory.py``). What the replay leaves out:
see ``autominato/bench/replay.py``.

    python scripts/replay_memory.py --labels ../shared/kits19/labels --cases 8 --orders 20 \
        --margins 1.25 1.35 1.45
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from autominato.bench.kits19 import kits19_workload
from autominato.bench.replay import RULES, measure, replay
from autominato.pipeline.memory import MARGIN

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="rules: off = memory_aware=False; fifo = a held sample holds back every later "
               "one; stop = later ones overtake it until a second refusal stops the scan (the "
               "rule before session 17); scan = the current rule (up to 16 refusals passed)")
    ap.add_argument("--labels", default=None,
                    help="KiTS19 label folder (default: generated demo masks, whose samples "
                         "are too small and alike for any to be held back)")
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=None,
                    help="samples taken and not yet taken by the training loop at most "
                         "(queued, running or finished; default: the Loader's pool_size, "
                         "2 * batch + workers + 2)")
    ap.add_argument("--orders", type=int, default=6,
                    help="sampler orders: 0 .. n-1, then shuffles (seeded)")
    ap.add_argument("--step", type=float, default=None,
                    help="seconds of the training loop's step per batch (default: mean "
                         "serial seconds per batch / workers, the bench's balanced step "
                         "before it was calibrated to the floor; "
                         "0: none, a run the loader bounds)")
    ap.add_argument("--margins", type=float, nargs="*", default=[],
                    help=f"budget headrooms to replay the rule scan at (the rules above use "
                         f"the loader's, {MARGIN:g}; give it here too to see its peaks): mean "
                         "wall time against off, median and largest peak")
    a = ap.parse_args()
    wl = kits19_workload(labels=a.labels, cases=a.cases, log=lambda s: None)
    in_flight = (a.in_flight if a.in_flight is not None
                 else 2 * wl.batch_size + a.workers + 2)
    print(f"measuring {a.epochs} epochs of {len(wl)} samples serially ...", flush=True)
    runs = measure(wl, a.epochs)
    n = len(wl)
    peaks = [max(p for _, i, _, p in runs if i == k) / MiB for k in range(n)]
    secs = [statistics.median(s for _, i, s, _ in runs if i == k) for k in range(n)]
    print("index peak MiB (largest of the epochs):", [round(p) for p in peaks])
    print("index median seconds:", [round(s, 2) for s in secs])
    step = (a.step if a.step is not None
            else statistics.mean(s for _, _, s, _ in runs) * wl.batch_size / a.workers)
    print(f"replay: {a.workers} workers, {in_flight} samples in flight, a step of "
          f"{step * 1e3:.0f} ms per batch of {wl.batch_size}, figures learnt as samples end "
          "(the first epoch unprotected)")
    ratios: dict[str, list[float]] = {r: [] for r in RULES}
    by_margin: dict[float, list[tuple[float, float]]] = {m: [] for m in a.margins}
    off_peaks: list[float] = []
    for o in range(a.orders):
        samples = []
        for e in range(a.epochs):
            order = list(range(n)) if o == 0 else list(np.random.default_rng((o, e)).permutation(n))
            by = {i: (s, p) for ee, i, s, p in runs if ee == e}
            samples += [(int(i), *by[int(i)]) for i in order]
        kw = dict(in_flight=in_flight, n_indices=n, batch_size=wl.batch_size, step_s=step)
        base = replay(samples, a.workers, rule="off", **kw)
        off_peaks.append(base.peak_bytes / MiB)
        for m in a.margins:
            r = replay(samples, a.workers, rule="scan", margin=m, **kw)
            by_margin[m].append((r.makespan_s / base.makespan_s, r.peak_bytes / MiB))
        cells = []
        for rule in RULES:
            r = replay(samples, a.workers, rule=rule, **kw)
            ratios[rule].append(r.makespan_s / base.makespan_s)
            cells.append(f"{rule} x{r.makespan_s / base.makespan_s:.3f} idle {r.held_idle_s:.2f} s "
                         f"peak {r.peak_bytes / MiB:.0f} MiB")
        print(f"order {o}: off {base.makespan_s:.2f} s peak {base.peak_bytes / MiB:.0f} MiB | "
              + " | ".join(cells[1:]))
    if not any(r.held_back for r in [replay(samples, a.workers, rule="fifo", **kw)]):
        print("note: no sample was held back in the last order: the samples are alike (with "
              "demo masks, pass --labels)")
    print("mean wall time against off: "
          + ", ".join(f"{r} x{statistics.mean(v):.3f}" for r, v in ratios.items()))
    if a.margins:
        print(f"off: peak median {statistics.median(off_peaks):.0f} MiB, largest "
              f"{max(off_peaks):.0f}")
    for m, v in by_margin.items():
        peaks = [p for _, p in v]
        print(f"scan at margin {m:g}: wall x{statistics.mean(w for w, _ in v):.3f} against off, "
              f"peak median {statistics.median(peaks):.0f} MiB, largest {max(peaks):.0f}")


if __name__ == "__main__":
    main()
