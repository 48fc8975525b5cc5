"""``autominato tune``: find the loader settings that minimise accelerator idle time.

Runs an Optuna study over the search space (``tuner/default.yaml`` or ``--space FILE``): each
trial builds the user's pipeline with one configuration, warms it up, then measures the idle
ratio of a window of batches against the training step (``--step-time`` simulated, or
``--model``). The study lives in SQLite (``OUT/study.db``), so running the same command again
resumes it with more trials. Writes ``OUT/loader.yaml`` (read by ``Loader(config=...)``,
``autominato run --config`` and the online controller), ``OUT/objective.png`` and
``OUT/importance.png``.

Examples::

    autominato tune --recipe kits19 --data data/kits19-prepared --trials 20
    autominato tune --dataset mypkg.data:make_dataset --transform mypkg.aug:augment \\
        --batch-size 2 --step-time 0.3 --space my-space.yaml --memory-budget 16GiB

The library API is :mod:`autominato.tuning` (re-exported here).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from rich.console import Console

from autominato.cli import int_at_least, seconds
from autominato.config import ConfigError
from autominato.tuning import (
    PipelineFailed,
    PipelineSpecError,
    SpaceError,
    TuneResult,
    load_space,
    make_pipeline,
    run_study,
)
from autominato.tuning.report import print_summary
from autominato.tuning.study import default_study_name

__all__ = [
    "TuneResult",
    "add_arguments",
    "load_space",
    "make_pipeline",
    "parse_size",
    "run",
    "run_study",
]

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30}
_UNITS.update({"gib": 2**30, "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9})
_UNITS["tb"] = 10**12


def parse_size(text: str) -> int:
    """Bytes in ``"16GiB"``, ``"512M"``, ``"1.5GB"`` or ``"1000000"`` (K/M/G/T and KiB...
    are powers of 1024, KB/MB/GB/TB powers of 1000).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 16GiB, 512MiB, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autominato tune``."""
    p = parser.add_argument_group("pipeline")
    p.add_argument(
        "--recipe", help="built-in pipeline (tuner/recipes/NAME.yaml, e.g. kits19) or a recipe file"
    )
    p.add_argument(
        "--data", help="dataset folder, passed to the dataset factory (a recipe may need it)"
    )
    p.add_argument("--dataset", help="module:factory returning a map-style dataset")
    p.add_argument(
        "--transform", help="module:callable, transform(sample, rng) or transform(sample)"
    )
    p.add_argument(
        "--batch-size", type=int_at_least(1), help="samples per batch (default: recipe's, else 1)"
    )
    p.add_argument("--step-time", type=seconds, help="simulated training step, seconds per batch")
    p.add_argument("--model", help="module:factory returning step(batch), a real training step")
    p.add_argument("--device", help="Loader device (e.g. cuda) for a real step")
    s = parser.add_argument_group("search")
    s.add_argument("--space", type=Path, help="search-space YAML (default tuner/default.yaml)")
    s.add_argument(
        "--trials", type=int_at_least(0), default=20,
        help="trials to add in this run (default 20; 0: none, the study's trials so far are "
             "confirmed and written: the end of an interrupted study)"
    )
    s.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
    s.add_argument(
        "--warmup", type=int_at_least(0), help="warm-up batches per trial (overrides the space file)"
    )
    s.add_argument(
        "--window", type=int_at_least(1), help="measured batches per trial (overrides the space file)"
    )
    s.add_argument("--memory-budget", type=parse_size, help="e.g. 16GiB; a trial above it fails")
    s.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    s.add_argument(
        "--no-baseline", action="store_true", help="do not measure the default configuration"
    )
    g = parser.add_argument_group("tune vs grid (autominato/tuning/grid.py)")
    g.add_argument(
        "--compare-grid", action="store_true",
        help="after the study, measure a full grid of the space and tell how close the "
        "configuration written is to the grid's optimum (slow: one trial per point)",
    )
    g.add_argument(
        "--grid-levels", type=int_at_least(2), default=3,
        help="values per searched integer parameter in the grid (default 3)",
    )
    g.add_argument(
        "--grid-repeats", type=int_at_least(1), default=3,
        help="measurements of tune's choice and of the grid optimum at the end (default 3)",
    )
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, help="output folder (default runs/tune/STUDY-NAME)")
    o.add_argument("--storage", help="Optuna storage URL (default sqlite:///OUT/study.db)")
    o.add_argument("--study-name", help="default: derived from the pipeline, so reruns resume")
    o.add_argument(
        "--config-out",
        type=Path,
        help="configuration file (default OUT/loader.yaml; .json for JSON)",
    )
    o.add_argument(
        "--no-progress", action="store_true", help="no progress bar (one line per trial)"
    )


def loader_problem(pipeline: Any, space: Any) -> str | None:
    """Why no ``autominato.Loader`` can be built for ``pipeline`` with the space's fixed
    settings (its dataset, device or arguments), or ``None``: a Loader is built and closed.
    The error's cause, where it has one, is named too."""
    try:
        with pipeline.build_loader(dict(space.fixed)):
            return None
    except Exception as e:  # noqa: BLE001 - reported, the study never starts
        cause = e.__cause__ or e.__context__
        why = f"{type(e).__name__}: {e}"
        if cause is not None and str(cause) not in why:
            why += f" (caused by {type(cause).__name__}: {cause})"
        return (f"the Loader cannot be built for this pipeline ({why}); no configuration "
                "can fix that, so no trial ran")


def run(args: argparse.Namespace) -> int:
    """Run the command. Exit status: 0 done, 1 no usable result or a pipeline failure, 2 bad
    input (search space, recipe, import path), 130 interrupted (rerun the command to resume)."""
    # soft_wrap: long paths stay on one line; a file or a pipe gets a table wider than 80.
    console = Console(soft_wrap=True)
    if not console.is_terminal:
        console = Console(soft_wrap=True, width=160)
    try:
        space = load_space(args.space).with_trial(
            warmup_batches=args.warmup, window_batches=args.window
        )
        pipeline = make_pipeline(
            dataset=args.dataset,
            transform=args.transform,
            recipe=args.recipe,
            data=args.data,
            batch_size=args.batch_size,
            step_time=args.step_time,
            model=args.model,
            device=args.device,
        )
    except (SpaceError, PipelineSpecError, ConfigError) as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 2
    problem = loader_problem(pipeline, space)
    if problem is not None:
        # (no configuration of the space can build it: trial 146 saw each of 20 trials fail
        # alike, for a dataset that is no dataset or a device this machine lacks)
        console.print(f"[red]error:[/red] {problem}", highlight=False)
        return 2
    name = args.study_name or default_study_name(pipeline, space)
    try:
        result = run_study(
            pipeline,
            space,
            n_trials=args.trials,
            out_dir=args.out or Path("runs") / "tune" / name,
            timeout=args.timeout,
            storage=args.storage,
            study_name=name,
            memory_budget_bytes=args.memory_budget,
            seed=args.seed,
            baseline=not args.no_baseline,
            config_path=args.config_out,
            console=console,
            progress=not args.no_progress,
        )
    except PipelineFailed as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        console.print("the study is kept: fix the pipeline and run the same command to resume")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted: the study is kept; run the same command to resume")
        return 130
    print_summary(console, result)
    if args.compare_grid and result.best is not None:
        from autominato.tuning.grid import compare_with_grid
        from autominato.tuning.study import measure_config

        def idle(params: dict) -> float:
            return measure_config(pipeline, space, params,
                                  memory_budget_bytes=args.memory_budget)[0].idle_ratio

        chosen = {} if result.kept_default else dict(result.best.params)
        try:
            cmp = compare_with_grid(idle, space, chosen, levels=args.grid_levels,
                                    repeats=args.grid_repeats,
                                    log=lambda m: console.print(m, highlight=False))
        except ValueError as e:
            console.print(f"[red]error:[/red] {e}", highlight=False)
            return 2
        except KeyboardInterrupt:
            console.print("interrupted during the grid comparison: the study and the "
                          "configuration written are kept")
            return 130
        done = sum(t.state.name == "COMPLETE" for t in result.study.get_trials(deepcopy=False))
        console.print(f"{cmp.line()}; tune used {len(result.study.trials)} trials "
                      f"({done} complete)", highlight=False)
    if result.stopped:
        console.print(f"[red]stopped:[/red] {result.stopped}", highlight=False)
        return 1
    if result.best is None:
        console.print("[red]no trial completed[/red]: no configuration written")
        return 1
    return 0
