"""``autominato bench``: a fair side-by-side benchmark against the loaders users would pick.

Every arm (torch DataLoader as users set it, its ``in_order=False`` variant and its best grid
setting, torchdata.nodes, SPDL, autominato with defaults and tuned) runs the same read and
transform functions on the same samples with the same collate, seeds and consumer, from a
fresh process, interleaved with the others and repeated. See ``docs/bench.md``.

Usage::

    autominato bench --workload kits19 synthetic --scenario balanced_stragglers --scale 0.5
    autominato bench controller ...      # the controller scenarios (autominato.bench.controller)

Public API: :func:`run_bench` (programmatic), :mod:`~autominato.bench.workload` (workloads),
:mod:`~autominato.bench.arms` (arms), :mod:`~autominato.bench.report` (CSV, table, plots).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run", "run_bench"]

#: Synthetic options that override a scenario's values (flag dest -> parameter, scale).
_SYNTH_OVERRIDES = {
    "read_latency_ms": ("read_latency_s", 1e-3),
    "cost_dist": ("cost_dist", None),
    "cost_ms": ("cost_s", 1e-3),
    "cost_sigma": ("sigma", None),
    "straggler_fraction": ("straggler_fraction", None),
    "straggler_factor": ("straggler_factor", None),
    "double_at": ("double_at", None),
    "step_factor": ("step_factor", None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``autominato bench``'s options, and the ``controller`` suite as a sub-command.

    ``autominato bench [options]`` runs the loaders benchmark; ``autominato bench controller
    [its options]`` runs :mod:`autominato.bench.controller` (its options follow the word).
    """
    parser.epilog = ("Without SUITE, the loaders benchmark runs. The table's columns and the "
                     "goals are explained in docs/bench.md (Figures).")
    from autominato.bench.arms import ARM_NAMES, DEFAULT_ARMS
    from autominato.bench.workload import COST_DISTRIBUTIONS, SCENARIOS

    parser.set_defaults(bench_suite="loaders")
    g = parser.add_argument_group("what to run")
    g.add_argument(
        "--workload",
        nargs="+",
        choices=["kits19", "synthetic"],
        default=["kits19", "synthetic"],
        help="workloads (default: both)",
    )
    g.add_argument(
        "--scenario",
        nargs="+",
        choices=[*SCENARIOS, "custom"],
        default=["balanced_stragglers"],
        help="synthetic scenario(s) (default balanced_stragglers); 'custom' uses "
        "only the options below",
    )
    g.add_argument(
        "--arms",
        nargs="+",
        choices=ARM_NAMES,
        default=list(DEFAULT_ARMS),
        help="arms to run (default: all but autominato-ray)",
    )
    g.add_argument("--repeats", type=int, default=3, help="timed runs per arm (default 3)")
    g.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="epochs per run, back to back, so that epoch boundaries are measured (default 1)",
    )
    g.add_argument(
        "--no-floor",
        action="store_true",
        help="skip measuring the floor (the reads' CPU and the transforms in `cores` processes)",
    )
    g.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="folder for CSV files and plots (default ./bench-results)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every arm takes each epoch in the same random order (autominato's shuffle for "
        "--seed), as training does (default); --no-shuffle: 0..n-1 every epoch (then an "
        "in-order DataLoader's workers get the same samples every epoch, which flatters its "
        "peak memory)",
    )
    g.add_argument(
        "--no-isolate",
        action="store_true",
        help="run every arm in this process instead of a fresh one per run",
    )
    g.add_argument(
        "--serial-samples",
        type=int,
        default=None,
        metavar="K",
        help="measure the limit's serial CPU cost on K samples and extrapolate (default: all)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one run may take, its process's start-up and the loader's build "
        "included (default 10x the limit + 120), and the floor (default 10x the serial "
        "measurement's CPU or wall time, whichever is more, over the cores + 120)",
    )

    g = parser.add_argument_group("consumer (accelerator)")
    g.add_argument(
        "--step",
        type=float,
        default=None,
        metavar="SECONDS",
        help="simulated step time per batch (default: calibrated, see --step-basis)",
    )
    g.add_argument(
        "--step-basis",
        choices=["floor", "cpu"],
        default=None,
        help="kits19's step: calibrated to floor = the first floor measured / the run's "
        "batches (the cores' output in parallel; the default), or cpu = serial CPU-s per "
        "batch / usable cores (the former default; the synthetic scenarios keep their own "
        "rule, cpu or io_bound's serial wall time). Ignored with --step or --unet",
    )
    g.add_argument(
        "--step-factor",
        type=float,
        default=None,
        help="multiply the calibrated step (scenarios set their own)",
    )
    g.add_argument(
        "--unet",
        choices=["auto", "on", "off"],
        default="auto",
        help="real 3D-UNet step for kits19 (auto: when CUDA is available)",
    )
    g.add_argument("--unet-model", choices=["mlperf", "compact"], default="mlperf")
    g.add_argument(
        "--nvml",
        action="store_true",
        help="sample GPU utilisation and PCIe throughput (nvidia-ml-py)",
    )

    g = parser.add_argument_group("arms")
    g.add_argument(
        "--tuned-config",
        nargs="+",
        default=None,
        metavar="[WORKLOAD=]FILE",
        help="configuration written by `autominato tune` for autominato-tuned: one FILE for "
        "every workload, or WORKLOAD=FILE each (e.g. kits19=k.yaml "
        "synthetic-balanced_stragglers=s.yaml)",
    )
    g.add_argument(
        "--grid-workers",
        type=int,
        nargs="+",
        default=None,
        help="DataLoader grid: num_workers values (default: cores, 2x cores)",
    )
    g.add_argument("--grid-prefetch", type=int, nargs="+", default=[2, 4])
    g.add_argument(
        "--grid-fraction",
        type=float,
        default=0.5,
        help="part of the epoch each grid probe runs (default 0.5)",
    )
    g.add_argument(
        "--spdl-executor",
        choices=["thread", "process"],
        default="thread",
        help="SPDL transform stage executor (default thread, SPDL's own default)",
    )

    g = parser.add_argument_group("synthetic workload")
    g.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per epoch (synthetic default 128; kits19 default one per case)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per batch (default 2, as MLPerf 3D-UNet)",
    )
    g.add_argument(
        "--sample-mb",
        type=float,
        default=8.0,
        help="MB per sample (default 8: one 128^3 float32 patch)",
    )
    g.add_argument("--on-disk", action="store_true", help="read samples from .npy files")
    g.add_argument("--read-latency-ms", type=float, default=None)
    g.add_argument("--cost-dist", choices=COST_DISTRIBUTIONS, default=None)
    g.add_argument("--cost-ms", type=float, default=None, help="base transform CPU cost")
    g.add_argument("--cost-sigma", type=float, default=None, help="lognormal log-space sigma")
    g.add_argument("--straggler-fraction", type=float, default=None)
    g.add_argument("--straggler-factor", type=float, default=None)
    g.add_argument(
        "--double-at",
        type=float,
        default=None,
        help="fraction of the epoch after which the cost doubles",
    )

    g = parser.add_argument_group("kits19 workload")
    g.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder prepared by `autominato prepare` (default: prepare from --labels with "
        "synthesised CT, cached; without --labels, 8 generated demo cases)",
    )
    g.add_argument(
        "--labels",
        type=Path,
        default=None,
        help="KiTS19 label folder to prepare from (default: generated demo masks)",
    )
    g.add_argument("--cases", type=int, default=None, help="cases to use (default: all)")
    g.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="each epoch is rank 0's share when this many GPUs split it (MLPerf 3D-UNet on 8 "
        "GPUs: --ranks 8, 21 of 168 cases per epoch; default 1)",
    )
    g.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="resolution factor of volumes and patch: 1 = MLPerf's (default), 0.5 = half "
        "per axis for quick runs; above 1 they grow",
    )
    g.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where prepared cases are cached (default ~/.cache/autominato)",
    )
    suites = parser.add_subparsers(dest="suite", metavar="SUITE", required=False)
    if importlib.util.find_spec("autominato.bench.controller") is not None:
        from autominato.bench import controller

        p = suites.add_parser(
            "controller",
            help="the online controller against the best static setting",
            description=(controller.__doc__ or "").splitlines()[0],
        )
        controller.add_arguments(p)
        p.set_defaults(bench_suite="controller")


def _synthetic(args: argparse.Namespace, scenario: str) -> Any:
    from autominato.bench.workload import synthetic_workload

    overrides = {}
    for dest, (param, scale) in _SYNTH_OVERRIDES.items():
        v = getattr(args, dest)
        if v is not None:
            overrides[param] = v * scale if scale else v
    return synthetic_workload(
        None if scenario == "custom" else scenario,
        samples=args.samples or 128,
        batch_size=args.batch_size or 2,
        sample_mb=args.sample_mb,
        on_disk=args.on_disk,
        step_s=args.step,
        seed=args.seed,
        **overrides,
    )


def _is_kits19(wl: Any) -> bool:
    """A KiTS19 workload (``kits19``, or ``kits19-rank0ofR`` of ``--ranks``)."""
    return wl.name.startswith("kits19")


def _unet_divisor(model: str) -> int:
    """What every spatial size of the UNet's input must divide by (one halving per level)."""
    from autominato.models.unet3d import UNet3D

    return (UNet3D.mlperf() if model == "mlperf" else UNet3D.compact()).divisor


def _tuned_configs(specs: list[str], workloads: list[str]) -> dict[str, str]:
    """``{workload: config path}`` from ``FILE`` (every workload) or ``WORKLOAD=FILE`` items.

    Raises:
        ValueError: an unknown workload name or a missing file.
    """
    from autominato.bench.workload import RANK_SUFFIX

    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        # a workload --ranks renamed (kits19-rank0of8) answers to its own name too
        named = [w for w in workloads if name in (w, w.split(RANK_SUFFIX)[0])]
        if name and not named:
            raise ValueError(f"{spec}: no workload {name!r} in this run ({', '.join(workloads)})")
        if not Path(path).is_file():
            raise ValueError(f"{spec}: no such file {path}")
        for wl in named if name else workloads:
            out[wl] = str(path)
    return out


def run_bench(jobs: list[tuple[Any, Any]], out: Path, console: Any = None) -> dict[str, Any]:
    """Run each ``(workload, options)`` job, write CSV and plots under ``out``, print tables.

    Args:
        jobs: :class:`~autominato.bench.workload.Workload` and
            :class:`~autominato.bench.runner.Options` pairs, run in order.
        out: output folder (created).

    Returns:
        ``{"results": [WorkloadResult], "runs": path, "summary": path, "plots": [paths],
        "rows": summary rows}``.
    """
    from autominato.bench.report import write_all
    from autominato.bench.runner import run_workload

    results = []
    try:
        for wl, opts in jobs:
            results.append(run_workload(wl, opts))
    finally:
        for wl, _ in jobs:
            wl.remove_files()
    return {"results": results, **write_all(results, Path(out), console)}


def run(args: argparse.Namespace) -> int:
    """Entry point of ``autominato bench``; returns the exit status (1 if any run failed)."""
    if getattr(args, "bench_suite", "loaders") == "controller":
        from autominato.bench import controller

        return int(controller.run(args) or 0)

    from autominato.bench.arms import Context
    from autominato.bench.report import goal_caveats, goals, is_synthetic, make_console
    from autominato.bench.runner import Options
    from autominato.pipeline.knobs import usable_cores

    if args.repeats < 1 or args.epochs < 1:
        print("--repeats and --epochs must be >= 1", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    console = make_console()
    unet = args.unet == "on" or (args.unet == "auto" and cuda)
    if unet and not cuda:
        print("--unet on needs CUDA", file=sys.stderr)
        return 2
    workloads = []
    if "kits19" in args.workload:
        from autominato.bench.kits19 import kits19_workload

        try:
            workloads.append(
                kits19_workload(
                    data=args.data,
                    labels=args.labels,
                    cases=args.cases,
                    samples=args.samples,
                    scale=args.scale,
                    patch_multiple=_unet_divisor(args.unet_model) if unet else 16,
                    batch_size=args.batch_size or 2,
                    step_s=args.step,
                    seed=args.seed,
                    cache=args.cache,
                    step_factor=args.step_factor or 1.0,
                    log=lambda m: console.print(m, highlight=False, markup=False),
                ).shard(args.ranks)
            )
        except (FileNotFoundError, ImportError, ValueError) as e:
            console.print(f"[red]kits19 workload unavailable:[/] {e}")
            return 2
    if "synthetic" in args.workload:
        for scenario in args.scenario:
            workloads.append(_synthetic(args, scenario))
    if args.shuffle:
        workloads = [replace(wl, shuffle=True) for wl in workloads]
    if args.step_basis is not None:  # kits19's only: a floor ignores a read's latency
        workloads = [replace(wl, step_basis=args.step_basis)
                     if _is_kits19(wl) else wl for wl in workloads]
        why = ("--step gives the step" if args.step is not None
               else "the real UNet step is timed (--unet)" if unet
               else "no kits19 workload runs (the synthetic scenarios keep their own rule)"
               if not any(map(_is_kits19, workloads)) else None)
        if why is not None:
            console.print(f"--step-basis {args.step_basis} is ignored: {why}", highlight=False,
                          markup=False)
    try:
        tuned = _tuned_configs(args.tuned_config or [], [wl.name for wl in workloads])
    except ValueError as e:
        print(f"--tuned-config: {e}", file=sys.stderr)
        return 2
    ctx = Context(
        cores=usable_cores(), device="cuda" if cuda else "cpu", spdl_executor=args.spdl_executor
    )
    grid = None
    if args.grid_workers is not None or args.grid_prefetch != [2, 4]:
        from autominato.bench.arms import dataloader_grid

        grid = dataloader_grid(ctx.cores, args.grid_workers, args.grid_prefetch)
    jobs = []
    for wl in workloads:
        opts = Options(
            arms=args.arms,
            repeats=args.repeats,
            isolate=not args.no_isolate,
            ctx=replace(ctx, tuned_config=tuned.get(wl.name)),
            grid=grid,
            grid_fraction=args.grid_fraction,
            serial_samples=args.serial_samples,
            # The real step is for the KiTS19 volumes only: synthetic samples are not images.
            step="unet" if unet and _is_kits19(wl) else "sleep",
            unet_model=args.unet_model,
            nvml=args.nvml,
            epochs=args.epochs,
            floor=not args.no_floor,
            timeout_s=args.timeout,
            log=lambda m: console.print(m, highlight=False, markup=False),
        )
        jobs.append((wl, opts))
    res = run_bench(jobs, args.out, console)
    failed = False
    for r in res["results"]:
        console.print(f"goals for autominato on {r.workload.name}:")
        for goal, met, fig in goals(res["rows"], r.workload.name):
            mark = "n/a" if met is None else ("met" if met else "NOT met")
            console.print(f"  {goal:32s} {mark:8s} {fig}")
        if is_synthetic(r.workload.name):
            console.print("  (the one goal set for a synthetic scenario; the figures behind "
                          "the other, KiTS19, goals are in the table: docs/bench.md, Goals)")
        for line in goal_caveats(res["rows"], r.workload.name):
            console.print(f"  ({line})")
        failed |= any(
            not x.ok and not x.status.startswith(("missing", "not given")) for x in r.records
        )
    console.print(f"wrote {res['runs']}, {res['summary']} and {len(res['plots'])} plots")
    return 1 if failed else 0
