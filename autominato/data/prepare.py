"""``autominato prepare kits19 RAW_DIR OUT_DIR``: the MLPerf 3D-UNet preprocessing of KiTS19.

After mlcommons/training ``image_segmentation/pytorch/preprocess_dataset.py``: per case,
resample to spacing [1.6, 1.2, 1.2] mm (linear for the image, nearest for the label), clip the
image to [-79, 304] HU, normalise it as (x - 101) / 76.9, pad every spatial size to >= 128
(edge values, split evenly between the two sides), and save ``case_XXXXX_x.npy`` (float32,
``(1, D, H, W)``) and ``case_XXXXX_y.npy`` (uint8). Resampling uses ``scipy.ndimage.zoom``
with the reference's output shape ``floor(shape * spacing / target)`` and corner-aligned
sampling (the reference's ``align_corners=True``); its nearest-neighbour label grid follows
the same corner alignment, where the reference's ``interpolate(mode="nearest")`` floors.

Inputs: the KiTS19 layout (``case_XXXXX/imaging.nii.gz`` + ``segmentation.nii.gz``) or a flat
folder of ``case_XXXXX.nii.gz`` masks. A case with a mask and no image needs
``--synthesize-ct``, which paints a CT-like volume on the mask's grid
(:func:`autominato.data.synthetic.synthesize_ct`); ``prepare.json`` and the output then say so.

With ``--ray [ADDRESS]`` each case is one Ray task, spread over the cluster's CPUs (the raw
and output folders must then be on a file system that every node mounts at the same path);
the output is the same file for file.

Cases already written are skipped, so an interrupted run resumes; files are written under a
temporary name and renamed, so a case on disk is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import scipy.ndimage

from autominato.data.kits19 import MANIFEST, image_file, label_file, read_manifest
from autominato.data.nifti import CT_CLIP, CT_MEAN, CT_STD, load_nifti

#: MLPerf reference constants (preprocess_dataset.py: TARGET_SPACING, TARGET_SHAPE).
TARGET_SPACING = (1.6, 1.2, 1.2)
MIN_SHAPE = (128, 128, 128)
_FLAT = re.compile(r"^(case_\d+)\.nii(\.gz)?$")


@dataclass(frozen=True)
class Case:
    """One raw case: its name, image file (None: mask only) and label file."""

    name: str
    image: Path | None
    label: Path


def is_prepared(out: str | Path, name: str) -> bool:
    """Whether case ``name``'s image and label are in the prepared folder ``out``."""
    return image_file(out, name).exists() and label_file(out, name).exists()


def find_cases(raw: str | Path) -> list[Case]:
    """The cases of a KiTS19 folder (``case_*/`` sub-folders) or a flat folder of masks.

    Sub-folders without ``segmentation.nii.gz`` (the KiTS19 test cases) are left out.

    Raises:
        FileNotFoundError: ``raw`` does not exist or holds no case.
    """
    raw = Path(raw)
    if not raw.is_dir():
        raise FileNotFoundError(f"{raw}: " + ("not a folder" if raw.exists() else "no such folder"))
    cases = []
    for p in sorted(raw.iterdir()):
        if p.is_dir() and p.name.startswith("case_"):
            label = p / "segmentation.nii.gz"
            if label.exists():
                image = p / "imaging.nii.gz"
                cases.append(Case(p.name, image if image.exists() else None, label))
        elif (m := _FLAT.match(p.name)) and p.is_file():
            cases.append(Case(m.group(1), None, p))
    if not cases:
        raise FileNotFoundError(
            f"{raw}: no KiTS19 cases (expected case_XXXXX/segmentation.nii.gz [+ imaging.nii.gz] "
            "or case_XXXXX.nii.gz masks)"
        )
    return cases


def resample(image: np.ndarray, label: np.ndarray, spacing: Sequence[float],
             target: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Resample ``(D, H, W)`` image (linear) and label (nearest) from ``spacing`` to ``target``.

    The output shape is ``floor(shape * spacing / target)`` (the reference's), at least 1.
    """
    if tuple(float(s) for s in spacing) == tuple(float(t) for t in target):
        return image, label
    shape = np.array(image.shape)
    new = np.maximum(1, (np.asarray(spacing) / np.asarray(target) * shape).astype(int))
    factors = new / shape
    # An explicit output array fixes the shape (zoom's own rounding may differ by one).
    out_image = np.empty(tuple(new), np.float32)
    scipy.ndimage.zoom(image, factors, output=out_image, order=1, mode="nearest")
    out_label = np.empty(tuple(new), label.dtype)
    scipy.ndimage.zoom(label, factors, output=out_label, order=0, mode="nearest")
    return out_image, out_label


def pad_to_min_shape(image: np.ndarray, label: np.ndarray,
                     min_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Pad ``(C, D, H, W)`` arrays with edge values so every spatial size is >= ``min_shape``.

    The padding is split as ``(n // 2, n - n // 2)`` before/after, as the reference does.
    """
    short = [max(0, m - s) for m, s in zip(min_shape, image.shape[1:], strict=True)]
    if not any(short):
        return image, label
    pads = [(0, 0)] + [(n // 2, n - n // 2) for n in short]
    return np.pad(image, pads, mode="edge"), np.pad(label, pads, mode="edge")


def preprocess_case(image_hu: np.ndarray, label: np.ndarray, spacing: Sequence[float],
                    target_spacing: Sequence[float] = TARGET_SPACING,
                    min_shape: Sequence[int] = MIN_SHAPE) -> tuple[np.ndarray, np.ndarray]:
    """The MLPerf preprocessing of one case.

    Args:
        image_hu: ``(D, H, W)`` CT in Hounsfield units.
        label: ``(D, H, W)`` integer mask.
        spacing: the input voxel size in mm per axis.

    Returns:
        image ``(1, D', H', W')`` float32 normalised, label ``(1, D', H', W')`` uint8.
    """
    if image_hu.shape != label.shape:
        raise ValueError(f"image shape {image_hu.shape} differs from label shape {label.shape}")
    image, lab = resample(image_hu.astype(np.float32, copy=False),
                          label.astype(np.uint8, copy=False), spacing, target_spacing)
    np.clip(image, *CT_CLIP, out=image)
    image -= np.float32(CT_MEAN)
    image /= np.float32(CT_STD)
    return pad_to_min_shape(image[None], lab[None], min_shape)


def _save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _case_seed(seed: int, name: str) -> list[int]:
    return [int(seed), int(name.split("_")[1])]


def prepare_one(case: Case, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Preprocess and save one case; returns its manifest entry (runs in a worker process).

    Raises:
        ValueError: the case cannot be read or processed; the message names the file.
    """
    t0 = time.perf_counter()
    try:
        limg = load_nifti(case.label)
        label = np.asarray(limg.dataobj)
        spacing = [float(z) for z in limg.header.get_zooms()[:3]]
    except Exception as e:
        raise ValueError(f"{case.label}: cannot read the mask: {type(e).__name__}: {e}") from e
    if case.image is not None:
        try:
            iimg = load_nifti(case.image)
            image = np.asarray(iimg.dataobj, dtype=np.float32)
            # The reference takes the image's spacing (pixdim[1:4]) for both volumes.
            spacing = [float(z) for z in iimg.header.get_zooms()[:3]]
        except Exception as e:
            raise ValueError(f"{case.image}: cannot read the image: {type(e).__name__}: {e}") from e
        source = "image"
    else:
        from autominato.data.synthetic import synthesize_ct

        rng = np.random.default_rng(_case_seed(settings["seed"], case.name))
        try:
            image = synthesize_ct(label, spacing, rng)
        except ValueError as e:
            raise ValueError(f"{case.label}: {e}") from e
        source = "synthetic"
    if image.shape != label.shape:
        raise ValueError(
            f"{case.label}: mask shape {label.shape} differs from image shape {image.shape}"
        )
    x, y = preprocess_case(image, label, spacing, settings["target_spacing"], settings["min_shape"])
    del image, label
    _save(image_file(out, case.name), x)
    _save(label_file(out, case.name), y)
    return {
        "shape": list(x.shape[1:]),
        "source_spacing": spacing,
        "image": source,
        "labels": [int(v) for v in np.unique(y)],
        "mean": round(float(x.mean()), 3),
        "std": round(float(x.std()), 3),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def prepare_kits19(
    raw: str | Path,
    out: str | Path,
    *,
    synthesize_ct: bool = False,
    cases: Sequence[str | int] | None = None,
    limit: int | None = None,
    scale: float = 1.0,
    jobs: int = 1,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Preprocess a KiTS19 folder into ``out`` (see the module docstring).

    Args:
        raw: KiTS19 folder or flat folder of masks.
        out: output folder (created).
        synthesize_ct: paint a CT-like image for cases that have only a mask.
        cases: case names (``"case_00001"``) or ids (``1``) to prepare; default all.
        limit: prepare at most this many cases (after ``cases``), in name order.
        scale: resolution factor: target spacing / scale and minimum shape 128 * scale, so
            0.5 halves every axis (about 1/8 of the voxels) for quick runs and 2 doubles it
            (1.0 is MLPerf's; other values are not MLPerf data).
        jobs: worker processes (each needs up to about 3 GB for the largest KiTS19 case).
        seed: seed of the synthetic images (each case draws from ``(seed, case id)``).
        force: redo cases already on disk, and accept a folder prepared with other settings.
        progress: show a progress bar.
        ray_address: run one Ray task per case (``jobs`` is then ignored): ``""`` connects
            to ``RAY_ADDRESS`` or starts a local Ray instance, else an address as
            ``ray.init`` takes it (``"auto"``, ``"ray://host:port"``). ``None``: no Ray.

    Returns:
        the manifest written to ``out/prepare.json`` plus ``"done"``, ``"skipped"`` and
        ``"failed"`` (``{case: message}``) of this run.

    Raises:
        FileNotFoundError: no cases, or a requested case is missing.
        ValueError: a case has no image and ``synthesize_ct`` is off, ``scale`` is not
            positive, or ``out`` was prepared with other settings (and not ``force``).
    """
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    out = Path(out)
    found = find_cases(raw)
    if cases is not None:
        wanted = [c if isinstance(c, str) else f"case_{int(c):05d}" for c in cases]
        by_name = {c.name: c for c in found}
        missing = [w for w in wanted if w not in by_name]
        if missing:
            raise FileNotFoundError(f"{raw}: no such case(s): {', '.join(missing)}")
        found = [by_name[w] for w in wanted]
    if limit is not None:
        found = found[: max(0, int(limit))]
    no_image = [c.name for c in found if c.image is None]
    if no_image and not synthesize_ct:
        raise ValueError(
            f"{raw}: {len(no_image)} case(s) have a mask but no imaging volume "
            f"({', '.join(no_image[:3])}{', ...' if len(no_image) > 3 else ''}); "
            "pass --synthesize-ct to make synthetic CT images from the masks"
        )
    settings = {
        "target_spacing": [round(t / scale, 6) for t in TARGET_SPACING],
        "min_shape": [max(1, round(m * scale)) for m in MIN_SHAPE],
        "seed": int(seed),
    }
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest and not force:
        old = {k: manifest.get(k) for k in settings}
        if old != settings:
            raise ValueError(
                f"{out} was prepared with other settings ({old}, now {settings}); "
                "use another folder or --force"
            )
    manifest = {
        "source": "kits19",
        "reference": "mlcommons/training image_segmentation/pytorch/preprocess_dataset.py",
        **settings,
        "synthetic_ct": bool(manifest.get("synthetic_ct", False)) or bool(no_image),
        "cases": dict(manifest.get("cases", {})),
    }
    if no_image:
        log(f"[prepare] {len(no_image)} of {len(found)} case(s) have no CT: their images are "
            "SYNTHETIC (painted on the real masks), not patient data")
    todo, skipped = [], []
    for c in found:
        (skipped if is_prepared(out, c.name) and not force else todo).append(c)
    if skipped:
        log(f"[prepare] {len(skipped)} case(s) already in {out}: skipped")
    failed: dict[str, str] = {}
    done_now: list[str] = []

    def record(name: str, entry: dict[str, Any]) -> None:
        manifest["cases"][name] = entry
        done_now.append(name)
        _write_manifest(out, manifest)

    _write_manifest(out, manifest)
    bar = _progress(progress, len(todo))
    with bar as p:
        task = p.add_task("prepare kits19", total=len(todo))
        if ray_address is not None and todo:
            _prepare_on_ray(todo, out, settings, ray_address, record, failed,
                            lambda: p.advance(task))
        elif jobs <= 1 or len(todo) <= 1:
            for c in todo:
                try:
                    record(c.name, prepare_one(c, out, settings))
                except ValueError as e:
                    failed[c.name] = str(e)
                p.advance(task)
        else:
            # spawn: the progress bar runs a thread, and forking a threaded process is unsafe.
            with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(prepare_one, c, out, settings): c for c in todo}
                for f in as_completed(futures):
                    c = futures[f]
                    try:
                        record(c.name, f.result())
                    except ValueError as e:
                        failed[c.name] = str(e)
                    p.advance(task)
    for name, msg in failed.items():
        log(f"[prepare] FAILED {name}: {msg}")
    entries = manifest["cases"]
    shapes = np.array([entries[c.name]["shape"] for c in found if c.name in entries])
    if len(shapes):
        med = np.median(shapes, axis=0).astype(int).tolist()
        log(f"[prepare] {out}: {len(done_now)} prepared, {len(skipped)} skipped, "
            f"{len(failed)} failed; median shape {med}, min {shapes.min(0).tolist()}, "
            f"max {shapes.max(0).tolist()}"
            + ("; images are SYNTHETIC CT" if manifest["synthetic_ct"] else ""))
    return {**manifest, "done": done_now, "skipped": [c.name for c in skipped], "failed": failed}


def _prepare_on_ray(todo: list[Case], out: Path, settings: dict[str, Any], address: str,
                    record: Callable[[str, dict[str, Any]], None], failed: dict[str, str],
                    advance: Callable[[], None]) -> None:
    """One Ray task per case (1 CPU each), recorded as each finishes."""
    import ray

    from autominato.pipeline.ray_executor import connect

    connect(address or None)
    task = ray.remote(num_cpus=1, max_retries=1)(prepare_one)
    out = out.resolve()  # the same path on every node, not relative to this process's folder
    pending = {}
    for c in todo:
        c = Case(c.name, c.image.resolve() if c.image is not None else None, c.label.resolve())
        pending[task.remote(c, out, settings)] = c
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        c = pending.pop(ready[0])
        try:
            record(c.name, ray.get(ready[0]))
        except ValueError as e:  # Ray re-raises the task's ValueError as one
            failed[c.name] = str(e).strip().splitlines()[-1]
        advance()


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    tmp = out / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, *a: Any, **k: Any) -> int:
        return 0

    def advance(self, *a: Any) -> None:
        return None


def _progress(enabled: bool, total: int) -> Any:
    if not enabled or total == 0:
        return _NoBar()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), transient=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=["kits19"], help="dataset layout (kits19)")
    parser.add_argument("raw", type=Path, help="KiTS19 folder (case_XXXXX/...) or folder of masks")
    parser.add_argument("out", type=Path, help="output folder of case_XXXXX_{x,y}.npy")
    parser.add_argument("--synthesize-ct", action="store_true",
                        help="make a synthetic CT image for cases that have only a mask")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case ids or names to prepare (default all)")
    parser.add_argument("--limit", type=int, default=None, help="prepare at most N cases")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="resolution factor: 1 = MLPerf's spacing, 0.5 = half the voxels "
                        "per axis for quick runs; above 1 the volumes grow (2 = 8x the voxels)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic images")
    parser.add_argument("--force", action="store_true", help="redo cases already prepared")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="one Ray task per case across a cluster (ADDRESS as ray.init takes "
                        "it; none: RAY_ADDRESS or a local Ray); the folders must be shared")


def run(args: argparse.Namespace) -> int:
    cases = None
    if args.cases:
        cases = [c if c.startswith("case_") else int(c) for c in args.cases.split(",") if c]
    try:
        result = prepare_kits19(
            args.raw, args.out, synthesize_ct=args.synthesize_ct, cases=cases, limit=args.limit,
            scale=args.scale, jobs=args.jobs, seed=args.seed, force=args.force,
            progress=not args.no_progress, ray_address=args.ray,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"autominato prepare: {e}", file=sys.stderr)
        return 2
    return 1 if result["failed"] else 0
