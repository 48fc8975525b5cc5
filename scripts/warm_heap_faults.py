"""What the warm heap saves: the memory the kernel faulted in (and zeroed) for a loader's
process tree over a KiTS19 run, beside the run's wall time and the tree's peak memory, per
Loader setting, each run in a fresh process, the settings interleaved.

Arms (``--arms``): ``defaults`` (``autominato.Loader`` as it comes: memory-aware dispatch
and its budgeted warm heap), ``memory-off`` (``memory_aware=False``: every worker keeps its
whole freed heap warm), ``cold-heap`` (``warm_heap=False``: every freed page goes back after
each sample). Each run: ``--epochs`` epochs of the prepared KiTS19 bench folder (``--data``,
as ``autominato bench --workload kits19`` prepares it), batch 2, the MLPerf transforms, a
``--step`` s sleep per batch for the training step, 2 workers (``num_workers``).

Printed per arm, medians [range] over ``--runs``: wall s; GiB faulted in as huge pages
(``thp_fault_alloc`` of ``/proc/vmstat`` x 2 MiB: NumPy maps each array of 4 MiB or more
with ``MADV_HUGEPAGE``, so a KiTS19 sample's large arrays are faulted 2 MiB at a time) and
every page fault (``pgfault``: of every kind and size, file-backed too): both counters are
the machine's, so run it on a quiet machine (a kernel without transparent huge pages has
no ``thp_fault_alloc``: nan); the workers' system CPU s (``psutil`` children, read after
each batch); the tree's peak memory (the bench's ``TreeSampler``: PSS, shared memory
counted once, MiB).

    python scripts/warm_heap_faults.py --runs 3 \\
        --data ~/.cache/autominato/bench/kits19-labels-42-scale1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {"defaults": {}, "memory-off": {"memory_aware": False}, "cold-heap": {"warm_heap": False}}


def _vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


def child(arm: str, data: Path, epochs: int, step: float) -> None:
    import psutil

    import autominato
    from autominato.bench.kits19 import kits19_workload

    wl = kits19_workload(data=data, log=lambda s: None)
    loader = autominato.Loader(wl.indexed_dataset(), batch_size=wl.batch_size, shuffle=True,
                               transform=wl.indexed_transform(), seed=0, num_workers=2,
                               **ARMS[arm])
    me = psutil.Process()
    system: dict[int, float] = {}
    v0, t0 = _vmstat(), time.perf_counter()
    for _ in range(epochs):
        for _batch in loader:
            time.sleep(step)
            for c in me.children(recursive=True):
                try:
                    system[c.pid] = c.cpu_times().system
                except psutil.Error:
                    pass
    wall, v1 = time.perf_counter() - t0, _vmstat()
    loader.close()
    huge = ((v1["thp_fault_alloc"] - v0["thp_fault_alloc"]) * 2 / 1024
            if "thp_fault_alloc" in v0 else float("nan"))
    print(json.dumps({"wall_s": wall,
                      "huge_gib": huge,
                      "page_faults": v1["pgfault"] - v0["pgfault"],
                      "workers_system_s": sum(system.values())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a prepared KiTS19 bench folder")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--step", type=float, default=0.1, help="seconds per batch (the step)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.data, a.epochs, a.step)
        return
    from autominato.bench.measure import TreeSampler

    rows: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    for run in range(a.runs):
        order = a.arms[run % len(a.arms):] + a.arms[:run % len(a.arms)]
        for arm in order:
            proc = subprocess.Popen([sys.executable, __file__, "--child", arm, "--data",
                                     str(a.data), "--epochs", str(a.epochs), "--step",
                                     str(a.step)], stdout=subprocess.PIPE, text=True)
            sampler = TreeSampler(interval=0.1, pid=proc.pid).start()
            out, _ = proc.communicate()
            usage = sampler.stop()
            if proc.returncode:
                raise SystemExit(f"{arm}: the run failed (exit {proc.returncode})")
            row = json.loads(out.strip().splitlines()[-1])
            row["peak_mib"] = usage.peak_memory_bytes / 2**20
            rows[arm].append(row)
            print(f"run {run} {arm}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()),
                  flush=True)
    print("medians [range] of", a.runs, "runs:")
    for arm, rs in rows.items():
        cells = []
        for k in ("wall_s", "huge_gib", "page_faults", "workers_system_s", "peak_mib"):
            v = [r[k] for r in rs]
            cells.append(f"{k} {statistics.median(v):.4g} [{min(v):.4g}-{max(v):.4g}]")
        print(f"  {arm:<11} " + ", ".join(cells))


if __name__ == "__main__":
    main()
