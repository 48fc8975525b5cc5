"""The first epoch's peak memory with outliers not measured yet: autominato against the
DataLoader, and against itself with the files' sizes unused (``autominato-nosize``: no
estimate from them, no outlier by file).

The workload is trial 125's: KiTS19 masks at full resolution (no resampling), the
``--small`` smallest and the ``--large`` largest of ``--labels`` (by file size; 14 and 2 by
default: 32-106 slices against 735 and 1059 of 512 x 512 with ``../shared/kits19/labels``),
each read whole with nibabel, turned into a float32 "CT", normalised and cropped to 64^3
around the foreground or at random, then flipped: a working set of ~5 bytes a voxel, 30x
apart. Every run starts a fresh process per arm (one epoch from a cold start: nothing
measured), all arms of a run in the same random sampler order, the arms interleaved; the
process tree's footprint is read every 50 ms with the bench's meter
(``autominato.bench.measure.TreeSampler``: PSS, shared memory counted once). Printed per arm:
the peak's median [range] and its ratio to the DataLoader's, the runs in which the two
largest cases ran at once, the epoch's wall time (median [range]) and its ratio to the
DataLoader's in the same order (median [range] over the runs).

    python scripts/first_epoch_memory.py --labels ../shared/kits19/labels --runs 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
ARMS = ("autominato", "autominato-nosize", "dataloader")
CROP = 64


class MaskCrops:
    """Sample ``i``: ``files[i]`` read whole, a float32 volume made from it and normalised,
    a 64^3 crop (around the foreground with p = 0.67), random flips; returns the crop, its
    label, the index and ``span`` (``time.monotonic()`` at its start and end)."""

    def __init__(self, files: list[str]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def sample_path(self, i: int) -> str:
        return self.files[i]

    def __getitem__(self, i: int) -> dict:
        import nibabel

        t0 = time.monotonic()
        rng = np.random.default_rng(np.random.randint(0, 2**31))
        mask = np.asarray(nibabel.load(self.files[i]).dataobj)
        img = mask.astype(np.float32)
        img *= 100.0
        img += 40.0
        img -= img.mean()
        img /= img.std() + 1e-6
        if mask.shape[0] < CROP:
            pad = ((0, CROP - mask.shape[0]), (0, 0), (0, 0))
            mask, img = np.pad(mask, pad), np.pad(img, pad, constant_values=img.min())
        shape = np.array(mask.shape)
        if rng.random() < 0.67 and mask.any():
            coarse = mask[::4, ::8, ::8]
            hit = np.unravel_index(rng.choice(np.flatnonzero(coarse)), coarse.shape)
            centre = np.array(hit) * (4, 8, 8)
        else:
            centre = np.array([rng.integers(n) for n in shape])
        lo = np.clip(centre - CROP // 2, 0, shape - CROP)
        box = tuple(slice(a, a + CROP) for a in lo)
        im, lb = img[box].copy(), mask[box].astype(np.int64)
        for ax in range(3):
            if rng.random() < 0.5:
                im, lb = np.flip(im, ax), np.flip(lb, ax)
        return {"image": np.ascontiguousarray(im)[None], "label": np.ascontiguousarray(lb)[None],
                "index": i, "span": np.array([t0, time.monotonic()])}


def _seed_numpy(worker_id: int) -> None:
    import torch

    np.random.seed(torch.utils.data.get_worker_info().seed % 2**32)


def child(arm: str, files: list[str], order: list[int], workers: int, batch: int,
          step_s: float) -> dict:
    """One epoch of ``arm`` over ``files`` in ``order``; ``{"wall_s", "together_s"}``: the
    epoch's time from the loader's construction and the seconds the two largest cases ran
    at once."""
    from torch.utils.data import DataLoader

    from autominato import Loader
    from autominato.pipeline import memory

    ds = MaskCrops(files)
    t0 = time.monotonic()
    kw = dict(batch_size=batch, sampler=order, num_workers=workers, worker_init_fn=_seed_numpy)
    if arm == "dataloader":
        loader = DataLoader(ds, prefetch_factor=2, **kw)
    else:
        if arm == "autominato-nosize":  # (sizes unused: the median, as before)
            memory.SampleMemory.size_estimate = lambda self, index: 0.0
            memory.SampleMemory.file_outlier = lambda self, index: False
        loader = Loader(ds, **kw)
    spans = {}
    for b in loader:
        for i, s in zip(b["index"].tolist(), b["span"].tolist(), strict=True):
            spans[i] = s
        time.sleep(step_s)
    wall = time.monotonic() - t0
    if hasattr(loader, "close"):
        loader.close()
    if len(files) < 2:
        return {"wall_s": wall, "together_s": 0.0}
    a, b = spans[len(files) - 2], spans[len(files) - 1]  # (the two largest: the last files)
    return {"wall_s": wall, "together_s": max(0.0, min(a[1], b[1]) - max(a[0], b[0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", default="../shared/kits19/labels")
    ap.add_argument("--small", type=int, default=14)
    ap.add_argument("--large", type=int, default=2, help="the largest masks taken (2 or more)")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--step", type=float, default=0.3, help="seconds a training step sleeps")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.large < 2:
        ap.error("--large must be 2 or more: the two largest are the ones watched")
    if a.child:
        job = json.loads(a.child)
        print(json.dumps(child(job["arm"], job["files"], job["order"], a.workers, a.batch,
                               a.step)))
        return
    from autominato.bench.measure import TreeSampler

    names = sorted(f for f in os.listdir(a.labels) if f.endswith(".nii.gz"))
    by_size = sorted(names, key=lambda f: os.path.getsize(os.path.join(a.labels, f)))
    chosen = by_size[:a.small] + by_size[-a.large:]
    files = [os.path.join(a.labels, f) for f in chosen]
    print(f"{len(files)} masks: {a.small} smallest, {a.large} largest of {a.labels}; "
          f"{a.workers} workers, batch {a.batch}, step {a.step} s, {a.runs} runs", flush=True)
    got: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in a.arms}
    for run in range(a.runs):
        order = np.random.default_rng(run).permutation(len(files)).tolist()
        for arm in a.arms:
            job = json.dumps({"arm": arm, "files": files, "order": order})
            p = subprocess.Popen(
                [sys.executable, __file__, "--workers", str(a.workers), "--batch", str(a.batch),
                 "--step", str(a.step), "--child", job], stdout=subprocess.PIPE, text=True)
            sampler = TreeSampler(interval=0.05, pid=p.pid).start()
            out, _ = p.communicate()
            usage = sampler.stop()
            if p.returncode:
                sys.exit(f"{arm} run {run} failed ({p.returncode})")
            res = json.loads(out.strip().splitlines()[-1])
            got[arm].append((usage.peak_memory_bytes / MiB, res["together_s"], res["wall_s"]))
            print(f"run {run} {arm}: peak {usage.peak_memory_bytes / MiB:.0f} MiB, the two "
                  f"largest together {res['together_s']:.2f} s, epoch {res['wall_s']:.2f} s",
                  flush=True)
    dl = got.get("dataloader")
    base = statistics.median(r[0] for r in dl) if dl else None
    print(f"\n{'arm':<18} {'peak MiB':>22} {'vs DL':>6} {'together':>9} {'epoch s':>20} "
          f"{'epoch / DL':>22}")
    for arm, rows in got.items():
        peaks, walls = [r[0] for r in rows], [r[2] for r in rows]
        ratio = f"{statistics.median(peaks) / base:.2f}x" if base else "-"
        # (each run's epoch against the DataLoader's in the same order: the order decides
        # whether the two largest can overlap)
        paired = [r[2] / d[2] for r, d in zip(rows, dl, strict=True)] if dl else []
        pair = (f"{statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}]"
                if paired else "-")
        print(f"{arm:<18} {statistics.median(peaks):>8.0f} [{min(peaks):.0f}-{max(peaks):.0f}] "
              f"{ratio:>6} {sum(r[1] > 0 for r in rows):>4} of {len(rows):<2} "
              f"{statistics.median(walls):>7.2f} [{min(walls):.2f}-{max(walls):.2f}] {pair:>22}")


if __name__ == "__main__":
    main()
