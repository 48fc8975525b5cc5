"""The ``kits19`` workload: MLPerf-preprocessed KiTS19 cases and the MLPerf training transforms.

The cases come from ``--data DIR`` (a folder ``autominato prepare kits19`` wrote) or are
prepared once into a cache from KiTS19 label masks (``--labels DIR``, with synthesised CT),
or, with neither, from a few generated demo masks (said so in the log, never a silent
preparation of a whole data set).
One sample is one random crop of one case; ``samples`` larger than the number of cases cycles
through the cases (each sample has its own augmentation generator, so its crop differs).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from autominato.bench.workload import Workload

#: The MLPerf 3D-UNet patch edge (voxels) and batch size.
MLPERF_PATCH = 128
MLPERF_BATCH = 2


def default_cache() -> Path:
    return Path.home() / ".cache" / "autominato" / "bench"


def patch_for(scale: float, multiple: int = 16) -> int:
    """The patch edge for ``scale``: ``128 * scale`` rounded to a multiple of ``multiple``.

    ``multiple`` is the UNet's divisor (``2 ** levels``: 32 for the MLPerf model) when the real
    step runs; at least one ``multiple``, at most 128.
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    p = int(round(MLPERF_PATCH * min(scale, 1.0) / multiple)) * multiple
    return max(multiple, p)


class CycledDataset:
    """``n`` samples over ``inner``'s cases: ``dataset[i] = inner[i % len(inner)]``."""

    def __init__(self, inner: Any, n: int) -> None:
        if n < 1:
            raise ValueError(f"samples must be >= 1, got {n}")
        self.inner = inner
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.n:
            raise IndexError(f"sample index {index} out of range [0, {self.n})")
        return self.inner[index % len(self.inner)]

    def sample_path(self, index: int) -> str | None:
        fn = getattr(self.inner, "sample_path", None)
        return fn(index % len(self.inner)) if fn is not None else None


def write_demo_masks(folder: Path, n: int, seed: int = 0) -> Path:
    """Write ``n`` generated KiTS19-like masks (``autominato.data.synthetic.demo_case``) as
    ``case_XXXXX.nii.gz`` with their voxel spacing in the affine; returns ``folder``."""
    import nibabel
    import numpy as np

    from autominato.data.synthetic import demo_case

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        path = folder / f"case_{i:05d}.nii.gz"
        if path.exists():
            continue
        mask, spacing = demo_case(np.random.default_rng((seed, i)))
        nibabel.save(nibabel.Nifti1Image(mask, np.diag([*spacing, 1.0])), str(path))
    return folder


def _prepare_jobs() -> int:
    # The data engineer measured up to about 3 GB per worker on the largest KiTS19 case.
    import psutil

    from autominato.pipeline.knobs import usable_cores

    return max(1, min(usable_cores(), int(psutil.virtual_memory().available / 3e9)))


def prepared_folder(
    labels: Path | None,
    cases: int | None,
    scale: float,
    cache: Path | None,
    log: Callable[[str], None] = print,
) -> Path:
    """A folder of prepared cases, prepared into ``cache`` on first use and reused after.

    ``autominato.data.prepare.prepare_kits19`` with synthesised CT; cases already prepared are
    skipped, so a second benchmark starts at once.

    Args:
        labels: KiTS19 label folder; ``None`` means generated demo masks.
        cases: how many cases (the first, sorted); ``None``: all the labels (demo: 8).
        scale: volume scale of the preparation (1.0 is MLPerf's).
        cache: parent folder of prepared sets (default ``~/.cache/autominato/bench``).

    Raises:
        FileNotFoundError: ``labels`` is given but missing.
        RuntimeError: a case failed to prepare.
    """
    from autominato.data.prepare import find_cases, is_prepared, prepare_kits19

    cache = cache or default_cache()
    if labels is not None and not Path(labels).is_dir():
        raise FileNotFoundError(f"KiTS19 labels not found at {labels} (give --labels or --data)")
    if labels is None:
        cases = cases or 8
        labels = write_demo_masks(cache / "demo-masks", cases)
        source = "demo"
    else:
        source = "labels"
    out = cache / f"kits19-{source}-{cases or 'all'}-scale{scale:g}"
    if source == "labels":
        found = find_cases(labels)
        n, chosen = len(found), found[:cases] if cases else found
        ready = sum(1 for c in chosen if is_prepared(out, c.name))
        if ready == len(chosen):  # (trial 189: "preparing" was said at every run)
            log(f"kits19: {len(chosen)} of the {n} cases in {labels} at scale {scale:g}, "
                f"prepared before in {out}")
        else:
            log(f"kits19: preparing {len(chosen) - ready} of the {n} cases in {labels} at "
                f"scale {scale:g} into {out} (once; cached; {ready} there already). At scale 1 "
                "a case takes tens of MB and seconds to minutes: --cases N or --scale 0.5 make "
                "it smaller, --data DIR uses a prepared set")
    else:
        log(f"kits19: no --data and no --labels: {cases} generated DEMO cases (not patient "
            f"data) at scale {scale:g} in {out}")
    result = prepare_kits19(
        labels,
        out,
        synthesize_ct=True,
        limit=cases,
        scale=scale,
        jobs=_prepare_jobs(),
        progress=False,
        log=log,
    )
    if result["failed"]:
        raise RuntimeError(f"kits19: {len(result['failed'])} case(s) failed: {result['failed']}")
    return out


def kits19_workload(
    *,
    data: Path | None = None,
    labels: Path | str | None = None,
    cases: int | None = None,
    samples: int | None = None,
    scale: float = 1.0,
    batch_size: int = MLPERF_BATCH,
    step_s: float | None = None,
    step_factor: float = 1.0,
    step_basis: str = "floor",
    patch_multiple: int = 16,
    seed: int = 0,
    cache: Path | None = None,
    log: Callable[[str], None] = print,
) -> Workload:
    """The KiTS19 workload: prepared cases, ``mlperf_train_transform(patch)``, batch 2.

    Args:
        data: a prepared folder; when ``None`` one is prepared (see :func:`prepared_folder`).
        labels: KiTS19 label folder; ``None`` (or ``"none"``) uses generated demo masks.
        cases: use the first ``cases`` cases.
        samples: samples per epoch (default: one per case).
        scale: shrinks the prepared volumes and the patch (``patch_for(scale)``).
        step_s: simulated step seconds (``None``: calibrated by the runner).
        step_basis: what the runner calibrates the step to (default the floor: the cores'
            output in parallel; see :func:`~autominato.bench.workload.calibrate_step`).

    Raises:
        FileNotFoundError: no prepared cases and no labels.
        ImportError: ``autominato.data`` is not available.
    """
    from autominato.data.kits19 import KiTS19Dataset
    from autominato.data.transforms import mlperf_train_transform

    if data is None:
        src = None if labels in (None, "") or str(labels).lower() == "none" else Path(labels)
        data = prepared_folder(src, cases, scale, cache, log)
    ds = KiTS19Dataset(data)
    if cases is not None and cases < len(ds):
        ds = KiTS19Dataset(data, cases=list(range(cases)))
    n_cases = len(ds)
    dataset: Any = CycledDataset(ds, samples) if samples and samples != n_cases else ds
    patch = patch_for(scale, patch_multiple)
    kind = "synthetic CT" if getattr(ds, "synthetic", False) else "CT"
    return Workload(
        name="kits19",
        dataset=dataset,
        transform=mlperf_train_transform(patch),
        batch_size=batch_size,
        step_s=step_s,
        seed=seed,
        description=(
            f"{len(dataset)} samples of {n_cases} cases ({kind}, scale {scale:g}), "
            f"MLPerf transforms, patch {patch}^3"
        ),
        step_basis=step_basis,
        step_factor=step_factor,
    )
