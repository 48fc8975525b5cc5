"""``autominato run``: the main job, a 3D-UNet trained on KiTS19-style volumes fed by the Loader.

The workload the project measures: the MLPerf 3D-UNet (mlcommons/training
``image_segmentation/pytorch``) on 128^3 patches of KiTS19 cases, with the MLPerf training
augmentation running in :class:`autominato.Loader`'s workers. ``--data`` is a folder prepared
by ``autominato prepare kits19`` or a NIfTI folder (KiTS19 or Decathlon layout; intensities
z-scored per volume). Without ``--data`` a small demo set is generated first (ellipsoid
kidney/tumour masks with synthetic CT, cached) and the output says that it is synthetic.

The run ends with a summary: samples/s, steps, the time the loop waited for data (seconds and
percent of wall time), the stragglers the loader deferred, and the loss at start and end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autominato.cli import int_at_least, port, seconds
from autominato.models.step import LEARNING_RATE

#: Demo set size: enough cases for a few batches per epoch, small enough to prepare in seconds.
DEMO_CASES = 8


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/autominato`` (default ``~/.cache/autominato``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autominato"


def prepare_demo(root: Path, cases: int = DEMO_CASES, seed: int = 0,
                 log: Any = print) -> Path:
    """Generate ``cases`` demo masks under ``root/raw`` and prepare them into ``root/prepared``.

    The masks come from :func:`autominato.data.synthetic.demo_case` and the images from
    :func:`~autominato.data.synthetic.synthesize_ct`: nothing here is patient data. Cases
    already on disk are kept (a second run starts at once).

    Returns:
        the prepared folder.
    """
    import nibabel
    import numpy as np

    from autominato.data.prepare import prepare_kits19
    from autominato.data.synthetic import demo_case

    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for i in range(cases):
        path = raw / f"case_{i:05d}.nii.gz"
        if path.exists():
            continue
        mask, spacing = demo_case(np.random.default_rng([seed, i]))
        img = nibabel.Nifti1Image(mask, np.diag([*spacing, 1.0]))
        img.header.set_zooms(spacing)
        tmp = raw / f".case_{i:05d}.partial.nii.gz"
        nibabel.save(img, str(tmp))
        os.replace(tmp, path)
    prepare_kits19(raw, root / "prepared", synthesize_ct=True, limit=cases, seed=seed,
                   progress=False, log=lambda m: None)
    return root / "prepared"


def open_dataset(path: Path) -> Any:
    """A :class:`KiTS19Dataset` when ``path`` holds ``case_*_x.npy``, else a NIfTI dataset.

    Raises:
        FileNotFoundError: ``path`` holds neither.
    """
    from autominato.data import KiTS19Dataset, NiftiDataset

    if any(path.glob("case_*_x.npy")):
        return KiTS19Dataset(path)
    return NiftiDataset(path, normalize="zscore")


@dataclass
class TrainResult:
    """What one run measured. Times in seconds (``time.perf_counter``)."""

    steps: int = 0
    samples: int = 0
    epochs_started: int = 0
    wall_s: float = 0.0
    data_wait_s: float = 0.0
    first_wait_s: float = 0.0
    compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    stragglers: int = 0
    skipped: int = 0
    knobs: dict[str, int] = field(default_factory=dict)
    decisions: int = 0
    memory_aware: bool | None = None  # the Loader's setting (a --config may turn it off)
    #: the configuration file the Loader applied, and its worker kind and order (trial 209)
    config: str | None = None
    worker_kind: str = ""
    in_order: bool | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        return self.data_wait_s / self.wall_s if self.wall_s > 0 else 0.0


def _device(name: str) -> Any:
    """The ``torch.device`` of ``--device``.

    Raises:
        ValueError: a name torch does not know, or ``cuda`` without CUDA (names ``--device``).
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {name}: not a device torch knows ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available")
    if dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except Exception as e:  # noqa: BLE001 - torch's error names the cause
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"--device {name}: not available here ({first})") from None
    return dev


def patch_for_data(data: Path, patch: tuple[int, int, int] | None,
                   divisor: int = 32) -> tuple[int, int, int]:
    """The crop of ``autominato run`` for the prepared folder ``data``: ``patch`` when given,
    else MLPerf's 128^3 shrunk, per axis, to the largest multiple of ``divisor`` that fits the
    smallest case (the case shapes of its ``prepare.json``, each padded to ``min_shape``;
    cases prepared with ``--scale`` < 1 are smaller than MLPerf's).

    Raises:
        ValueError: ``patch`` (given) has a size that is no multiple of ``divisor`` or below
            ``2 * divisor`` (the model's limits), or is larger than the smallest case; or no
            patch the model takes fits the cases.
    """
    from autominato.data.kits19 import read_manifest

    def text(shape: Sequence[int]) -> str:
        return "x".join(map(str, shape))

    if patch is not None and any(p % divisor or p < 2 * divisor for p in patch):
        raise ValueError(f"--patch {text(patch)}: every size must be a multiple of {divisor} and "
                         f"at least {2 * divisor}")
    manifest = read_manifest(data) if data.is_dir() else {}
    floor = manifest.get("min_shape") or [0, 0, 0]
    shapes = [c.get("shape") for c in (manifest.get("cases") or {}).values()]
    shapes = [sh for sh in shapes if isinstance(sh, list) and len(sh) == 3]
    if not shapes:
        return patch or (128, 128, 128)  # nothing known of the cases: the loader will say
    smallest = [max(f, min(sh[a] for sh in shapes)) for a, f in enumerate(floor)]
    if patch is not None:
        if any(p > m for p, m in zip(patch, smallest, strict=True)):
            raise ValueError(f"--patch {text(patch)} is larger than the smallest case of {data} "
                             f"({text(smallest)}): give a smaller --patch")
        return patch
    fit = tuple(min(128, m // divisor * divisor) for m in smallest)
    if min(fit) < 2 * divisor:
        raise ValueError(
            f"the smallest case of {data} is {text(smallest)}, smaller than the smallest patch "
            f"the model takes ({2 * divisor}^3): prepare the cases with a larger --scale")
    return fit  # type: ignore[return-value]


def train(
    dataset: Any,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    batch_size: int = 2,
    patch: tuple[int, int, int] = (128, 128, 128),
    device: str = "auto",
    full_size: bool = False,
    lr: float = LEARNING_RATE,
    seed: int = 0,
    config: str | Path | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    monitor_interval: float | None = None,
    progress: bool = True,
    loader_kwargs: dict[str, Any] | None = None,
) -> TrainResult:
    """Train a 3D-UNet on ``dataset`` through :class:`autominato.Loader`.

    Args:
        dataset: map-style, samples ``(image (1, D, H, W) float32, label (1, D, H, W) uint8)``
            with every spatial size >= ``patch``.
        steps: stop after this many optimiser steps; ``epochs``: after this many epochs (the
            first reached wins; one epoch when neither is given).
        patch: crop size ``(D, H, W)``, each a multiple of the model's ``divisor`` (32) and at
            least twice it (the bottleneck's instance norm needs more than one voxel).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        full_size: the MLPerf reference width (31 M parameters) instead of the compact model.
        lr: SGD learning rate of the shared training step
            (:class:`autominato.models.step.UNetStep`: SGD with Nesterov momentum as in the
            MLPerf reference, bfloat16 autocast on CUDA).
        config: a configuration written by ``autominato tune`` (knobs, bounds, loader settings).
        metrics_port: serve Prometheus metrics on this port; ``metrics_host``: on this
            address (``0.0.0.0`` for a Prometheus in another container).
        monitor_interval: log the Data Monitor report every this many seconds and at the end
            of the run (``None``: only when ``AUTOMINATO_DATA_MONITOR`` asks for it).
        loader_kwargs: further :class:`autominato.Loader` arguments (tests use them).

    Returns:
        the :class:`TrainResult`.

    Raises:
        ValueError: bad ``steps``/``epochs``/``patch``, or no batch per epoch.
        autominato.pipeline.errors.SampleError (and the dataset's ``DatasetError``): a sample
            failed; the message names its index and file.
    """
    import torch

    from autominato import Loader
    from autominato.data.transforms import mlperf_train_transform
    from autominato.models.step import UNetStep

    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if epochs is not None and epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if steps is None and epochs is None:
        epochs = 1
    dev = _device(device)
    torch.manual_seed(seed)
    step = UNetStep("mlperf" if full_size else "compact", dev, lr=lr)
    divisor = step.model.divisor
    if any(p % divisor or p < 2 * divisor for p in patch):
        # Instance norm needs more than one voxel at the bottleneck (patch / divisor) to train.
        raise ValueError(
            f"patch {patch}: every size must be a multiple of {divisor} and at least "
            f"{2 * divisor}"
        )

    loader = Loader(
        dataset, batch_size, shuffle=True, transform=mlperf_train_transform(patch, 0.4),
        seed=seed, device=dev if dev.type == "cuda" else None, config=config,
        metrics_port=metrics_port, metrics_host=metrics_host, monitor_interval=monitor_interval,
        **(loader_kwargs or {}),
    )
    res = TrainResult()
    bar = _Progress(progress, steps if steps is not None else (epochs or 1) * len(loader))
    try:
        if len(loader) == 0:
            raise ValueError(f"no batch per epoch ({len(dataset)} samples, batch {batch_size})")
        t_start = time.perf_counter()
        with bar:
            epoch = 0
            while (epochs is None or epoch < epochs) and (steps is None or res.steps < steps):
                loader.set_epoch(epoch)
                res.epochs_started += 1
                it = iter(loader)
                while steps is None or res.steps < steps:
                    t0 = time.perf_counter()
                    try:
                        image, label = next(it)
                    except StopIteration:
                        break
                    t1 = time.perf_counter()
                    res.data_wait_s += t1 - t0
                    if res.steps == 0:
                        res.first_wait_s = t1 - t0
                    value = step((image, label))  # returns once the device is done
                    res.compute_s += time.perf_counter() - t1
                    res.losses.append(value)
                    res.steps += 1
                    res.samples += int(image.shape[0])
                    bar.update(res, epoch)
                epoch += 1
        res.wall_s = time.perf_counter() - t_start
        snap = loader.snapshot()
        res.stragglers = snap.stragglers_total
        res.skipped = snap.skipped_total
        res.knobs = dict(snap.knobs)
        res.decisions = len(loader.decisions)
        res.memory_aware = getattr(loader, "memory_aware", None)
        res.config = None if config is None else str(config)
        res.worker_kind = str(getattr(loader, "worker_kind", ""))
        res.in_order = getattr(loader, "in_order", None)
    finally:
        loader.close()
    return res


class _Progress:
    """A rich progress bar of the steps with the latest loss and rate (or nothing)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.p = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.p = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.p.add_task("train", total=total, info="")

    def __enter__(self) -> _Progress:
        if self.p is not None:
            self.p.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.p is not None:
            self.p.stop()

    def update(self, res: TrainResult, epoch: int) -> None:
        if self.p is not None:
            info = f"epoch {epoch} loss {res.losses[-1]:.4f} wait {res.data_wait_s:.1f}s"
            self.p.update(self.task, completed=res.steps, info=info)


def summary(res: TrainResult, batch_size: int) -> str:
    """The closing summary of a run, one figure per line."""
    k = min(5, len(res.losses))
    first = sum(res.losses[:k]) / k if k else math.nan
    last = sum(res.losses[-k:]) / k if k else math.nan
    start = res.losses[0] if res.losses else math.nan
    end = res.losses[-1] if res.losses else math.nan
    lines = [
        f"  steps           {res.steps} (batch {batch_size}, {res.samples} samples, "
        f"{res.epochs_started} epoch(s) started)",
        f"  samples/s       {res.samples_per_s:.2f}",
        f"  wall time       {res.wall_s:.1f} s (training compute {res.compute_s:.1f} s)",
        f"  data wait       {res.data_wait_s:.1f} s = {100 * res.wait_fraction:.1f}% of wall time "
        f"(first batch {res.first_wait_s:.1f} s)",
        f"  stragglers      {res.stragglers} deferred to a later batch"
        + (f", {res.skipped} skipped" if res.skipped else ""),
        f"  loss            start {start:.4f} -> end {end:.4f} "
        f"(mean of first {k}: {first:.4f}, last {k}: {last:.4f})",
        f"  loader knobs    {res.knobs} ({res.decisions} controller decision(s))"
        + ("" if res.memory_aware is None
           else f", memory_aware={res.memory_aware}"),
    ]
    if res.config is not None:
        lines.append(f"  configuration   {res.config} (worker_kind={res.worker_kind}, "
                     f"in_order={res.in_order})")
    return "\n".join(lines)


def _patch(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.replace("x", ",").split(",") if p]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--patch: expected N or D,H,W, got {text!r}")
    return (parts[0], parts[1], parts[2])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, default=None,
                        help="prepared KiTS19 folder or NIfTI folder (default: a generated, "
                        "synthetic demo set)")
    parser.add_argument("--steps", type=int_at_least(1), default=None, help="optimiser steps to run")
    parser.add_argument("--epochs", type=int_at_least(1), default=None,
                        help="epochs to run (default 1 when --steps is not given)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=None,
                        help="samples per batch (default: the --config's, else 2)")
    parser.add_argument("--patch", type=_patch, default=None,
                        help="crop size N or D,H,W, each a multiple of 32 and at least 64 "
                        "(default 128, MLPerf's; smaller for cases prepared with --scale < 1)")
    parser.add_argument("--config", type=Path, default=None,
                        help="loader configuration written by `autominato tune`")
    parser.add_argument("--metrics-port", type=port, default=None,
                        help="serve Prometheus metrics on this port (127.0.0.1)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics endpoint binds (0.0.0.0 or \"\" for every "
                        "interface, inside a container)")
    parser.add_argument("--monitor-interval", type=seconds, default=60.0,
                        help="seconds between Data Monitor reports in the log (0: only at the "
                        "end of the run)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda")
    parser.add_argument("--full-size", action="store_true",
                        help="the MLPerf reference 3D-UNet (31 M parameters) instead of compact")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE,
                        help="SGD learning rate of the training step (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo-dir", type=Path, default=None,
                        help=f"where the demo set is cached (default {default_cache()}/demo)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check_host(host: str) -> None:
    """Raises ValueError naming ``--metrics-host`` when it resolves to no address."""
    import socket

    from autominato.telemetry.exporter import bind_host

    try:
        socket.getaddrinfo(bind_host(host), None)  # ("": every interface, as the exporter)
    except OSError as e:
        raise ValueError(f"--metrics-host {host}: not an address this machine can bind ({e})") from None


def _qualified(obj: Any) -> str:
    """``module:qualname``, as ``autominato tune`` records a dataset or transform."""
    return f"{obj.__module__}:{obj.__qualname__}"


def _say_other_pipeline(config: Path, cfg: dict[str, Any], dataset: Any, out: Any) -> None:
    """Say where ``config`` (read: ``cfg``) was tuned for another dataset or transform than
    this run's (the file's ``study.pipeline``; trial 209: a file tuned on the user's own dataset was applied
    to the KiTS19 demo without a word). Its knobs still apply: they are loader settings.
    Names of this package's objects are compared as the objects they import
    (``autominato.data:KiTS19Dataset`` is ``autominato.data.kits19:KiTS19Dataset``); a
    user's module is not imported for it (its names are compared as written)."""
    from autominato.data.transforms import mlperf_train_transform

    study = cfg.get("study")
    tuned = study.get("pipeline") if isinstance(study, dict) else None
    if not isinstance(tuned, dict):  # (free-form provenance: review 210)
        return
    ours = {"dataset": type(dataset), "transform": mlperf_train_transform}

    def same(spec: Any, obj: Any) -> bool:
        if not isinstance(spec, str) or spec == _qualified(obj):
            return True  # (not a name: nothing to compare)
        if spec.split(":", 1)[0].split(".")[0] == "autominato":
            from autominato.tuning.pipeline import import_object

            try:
                return import_object(spec, "study.pipeline") is obj
            except Exception:  # noqa: BLE001 - renamed since: another object
                return False
        return False

    other = [f"{k} {tuned[k]}" for k in ("dataset", "transform")
             if tuned.get(k) and not same(tuned[k], ours[k])]
    if other:
        mine = _qualified(type(dataset))
        how = ("autominato tune --recipe kits19 --data DIR tunes for it"
               if mine == "autominato.data.kits19:KiTS19Dataset"
               else "autominato tune --dataset ... --transform ... tunes for it: docs/tune.md")
        print(f"[run] note: {config} was tuned for {' and '.join(other)}; this run trains "
              f"{mine} with autominato.data.transforms:mlperf_train_transform: its knobs "
              f"apply, but were not measured on this pipeline ({how})", file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``autominato run``; returns the exit status."""
    # The training loop shares the cores with the loader's workers. OpenMP threads that spin
    # while waiting then steal the workers' time: on the 2-core machine, a compact-model step
    # took 9.7 s (4.5 CPU-s) with spinning and 5.0 s (2.2 CPU-s) with passive waiting while
    # other processes kept the cores busy. It must be set before torch starts OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from autominato.config import ConfigError, load_config
    from autominato.pipeline.errors import SampleError

    out = sys.stdout
    try:
        batch_size = args.batch_size
        tuned_cfg = load_config(args.config) if args.config is not None else None
        if tuned_cfg is not None and batch_size is None:
            batch_size = tuned_cfg["loader"].get("batch_size")
        batch_size = 2 if batch_size is None else int(batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} in {args.config}: must be >= 1")
        _device(args.device)
        if args.data is None:
            root = args.demo_dir or default_cache() / "demo"
            print(f"[run] no --data: preparing a SYNTHETIC demo set of {DEMO_CASES} cases in "
                  f"{root} (generated ellipsoid kidney/tumour masks, synthetic CT; not patient "
                  "data)", file=out, flush=True)
            data = prepare_demo(root, seed=args.seed)
        else:
            data = args.data
        if args.metrics_port is not None:
            _check_host(args.metrics_host)
        dataset = open_dataset(data)
        patch = patch_for_data(Path(data), args.patch)
        if args.patch is None and patch != (128, 128, 128):
            print(f"[run] patch {'x'.join(map(str, patch))}: MLPerf's 128^3 shrunk to fit the "
                  f"smallest case (--patch to choose)", file=out, flush=True)
        kind = type(dataset).__name__
        synthetic = getattr(dataset, "synthetic", False)
        if tuned_cfg is not None:
            _say_other_pipeline(args.config, tuned_cfg, dataset, out)
        print(f"[run] data {data}: {len(dataset)} samples ({kind}"
              + (", SYNTHETIC CT images" if synthetic else "") + ")", file=out, flush=True)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        # The command cannot start as written (autominato.cli's convention: 2).
        print(f"autominato run: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        res = train(
            dataset, steps=args.steps, epochs=args.epochs, batch_size=batch_size,
            patch=patch, device=args.device, full_size=args.full_size, lr=args.lr,
            seed=args.seed, config=args.config, metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            monitor_interval=args.monitor_interval if args.monitor_interval > 0 else 1e9,
            progress=not args.no_progress,
        )
    except (FileNotFoundError, ValueError, ConfigError, SampleError) as e:
        # The loader's note names the sample and file of an error raised in a transform.
        notes = "".join(f"\n  {n}" for n in getattr(e, "__notes__", []))
        print(f"autominato run: {type(e).__name__}: {e}{notes}", file=sys.stderr)
        return 1
    model = "MLPerf 3D-UNet (full size)" if args.full_size else "compact 3D-UNet"
    print(f"autominato run: {model} on {_device(args.device)}, patch "
          f"{'x'.join(map(str, patch))}, data {data}"
          + (" (SYNTHETIC)" if synthetic else ""), file=out)
    print(summary(res, batch_size), file=out, flush=True)
    loss_ok = all(math.isfinite(v) for v in res.losses)
    if not loss_ok:
        print("autominato run: the loss is not finite", file=sys.stderr)
    return 0 if loss_ok else 1
