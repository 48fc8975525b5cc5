"""Where autominato's CPU goes on the KiTS19 bench workload: per thread of the training
process, per worker process (user, system, minor page faults), and the cores the workers
used in each half second, beside the consumer's waits.

    python scripts/cpu_split.py --labels ../shared/kits19/labels --cases 42 --epochs 3 \
        --step 0.08 [--set memory_aware=False ...]

A step shorter than the floor's share (``--step 0.08`` at 42 cases on 2 cores) keeps the
loader CPU bound, so that every idle core is the loader's; the autominato arm's Loader
(``autominato.bench.arms``, defaults with the controller on) with ``--set`` arguments added.
Compare the workers' CPU-seconds a sample with the floor's (``autominato bench``'s floor line:
floor x cores / samples). Measured in December 2026 (session 48): the training process's
threads 0.4 CPU-s for 126 samples (~3 ms a sample), the workers 121-149 ms a sample against
the floor's 131 (the machine's speed moves 20 % between runs), a third of it system time
(the read's copy out of the page cache, page faults).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import threading
import time

import psutil

TICK = os.sysconf("SC_CLK_TCK")


def _threads() -> dict[str, float]:
    """CPU-seconds of each thread of this process, by native thread id."""
    out = {}
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(task + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[task.rsplit("/", 1)[1]] = (int(fields[11]) + int(fields[12])) / TICK
        except OSError:
            pass
    return out


def _workers() -> dict[int, tuple[float, float, int]]:
    """(user s, system s, minor faults) of each descendant process."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            with open(f"/proc/{child.pid}/stat") as f:
                minflt = int(f.read().rsplit(")", 1)[1].split()[7])
            out[child.pid] = (t.user, t.system, minflt)
        except (psutil.Error, OSError):
            pass
    return out


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", required=True, help="KiTS19 label folder (bench --labels)")
    p.add_argument("--cases", type=int, default=42)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step", type=float, default=0.08, help="simulated step, seconds a batch")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                   help="Loader arguments added to the autominato arm's")
    args = p.parse_args()

    from autominato.bench import arms
    from autominato.bench.kits19 import kits19_workload

    wl = kits19_workload(labels=args.labels, cases=args.cases, step_s=args.step,
                         log=lambda s: None)
    params = dict(s.split("=", 1) for s in args.set)
    arm = arms.Arm("autominato", "autominato",
                   {"autotune": True, **{k: _value(v) for k, v in params.items()}})
    loader, close = arms.build(arm, wl, arms.Context(cores=psutil.cpu_count() or 1))

    timeline: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            timeline.append((time.perf_counter(), sum(u + s for u, s, _ in _workers().values())))

    t0 = time.perf_counter()
    before = _threads()
    threading.Thread(target=sample, name="cpu_split-sampler", daemon=True).start()
    waits, n = [], 0
    for _ in range(args.epochs):
        it = iter(loader)
        while True:
            w = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - w)
            n += 1
            time.sleep(args.step)
    wall = time.perf_counter() - t0
    after, workers = _threads(), _workers()
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    stop.set()
    snap = loader.snapshot()
    close()

    samples = n * wl.batch_size
    print(f"wall {wall:.2f} s, {n} batches, consumer waited {sum(waits):.2f} s, "
          f"memory waits {snap.memory_wait_seconds_total:.2f} s, knobs {snap.knobs}")
    by: dict[str, float] = collections.defaultdict(float)
    for tid, cpu in after.items():
        by[names.get(tid, f"thread {tid}")] += cpu - before.get(tid, 0.0)
    for name, cpu in sorted(by.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.005:
            print(f"  {name:32s} {cpu:6.2f} CPU-s")
    user = sum(u for u, _, _ in workers.values())
    system = sum(s for _, s, _ in workers.values())
    faults = sum(f for _, _, f in workers.values())
    print(f"workers: {user + system:.2f} CPU-s ({user:.2f} user, {system:.2f} system), "
          f"{(user + system) / samples * 1e3:.0f} ms and {faults / samples:.0f} minor faults "
          f"a sample (start-up included)")
    cores, prev = collections.OrderedDict(), None
    for t, cpu in timeline:
        if prev is not None:
            k = int((t - t0) / 0.5)
            cores[k] = cores.get(k, 0.0) + cpu - prev
        prev = cpu
    print("workers' cores each 0.5 s:", " ".join(f"{v / 0.5:.1f}" for v in cores.values()))


if __name__ == "__main__":
    main()
