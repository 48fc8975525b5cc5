"""What a study shows its user: a per-trial line, the final table and two PNG plots."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.table import Table

from autominato.tuning.select import TWIN_ATTR, has_variation, ranked, runs_said, select_best

log = logging.getLogger(__name__)


def fmt_params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def trial_line(t: FrozenTrial) -> str:
    """One line on a finished trial, for the console while the study runs."""
    head = f"trial {t.number:>3}"
    if t.state == TrialState.COMPLETE:
        a = t.user_attrs
        return (
            f"{head}  idle {t.value:.3f}  cpu {a.get('cpu_s_per_sample', 0.0) * 1e3:.1f} ms/sample  "
            f"mem {a.get('peak_memory_bytes', 0) / 2**30:.2f} GiB  {fmt_params(t.params)}"
        )
    if t.state == TrialState.PRUNED:
        step = t.last_step
        value = t.intermediate_values.get(step, float("nan")) if step is not None else float("nan")
        return f"{head}  pruned after {step} batches (idle {value:.3f})  {fmt_params(t.params)}"
    reason = t.user_attrs.get("failure", "see the log")
    return f"{head}  failed: {reason}  {fmt_params(t.params)}"


def best_table(trials: list[FrozenTrial], top: int = 5, title: str = "Best trials",
               written: int | None = None) -> Table:
    """A rich table of the ``top`` best completed trials (best first, see ``select``), the
    trial numbered ``written`` (the configuration written) marked ``*`` and listed where it
    is not among them (trial 209: the rows above it read as the choice)."""
    rows = ranked(trials)[:top]
    if written is not None and all(t.number != written for t in rows):
        rows += [t for t in trials if t.number == written and t.value is not None]
    names = sorted({n for t in rows for n in t.params})
    table = Table(title=title if written is None else f"{title} (* written)")
    for col in ("trial", "idle", "CPU ms/sample", "memory GiB", *names):
        table.add_column(col, justify="right")
    for t in rows:
        a = t.user_attrs
        table.add_row(
            f"*{t.number}" if t.number == written else str(t.number),
            f"{t.value:.3f}",
            f"{a.get('cpu_s_per_sample', 0.0) * 1e3:.1f}",
            f"{a.get('peak_memory_bytes', 0) / 2**30:.2f}",
            *(str(t.params.get(n, "")) for n in names),
        )
    return table


def save_plots(
    study: optuna.Study, out_dir: Path, baseline_idle: float | None = None
) -> dict[str, Path]:
    """Write ``objective.png`` (idle ratio by trial, best so far, and the default
    configuration's idle ratio ``baseline_idle`` as a dashed line) and, where defined,
    ``importance.png`` (PED-ANOVA parameter importance; needs >= 2 completed trials with
    differing values, else it is skipped with a log line). Returns the paths written by kind.
    """
    import matplotlib.pyplot as plt
    from optuna.importance import PedAnovaImportanceEvaluator
    from optuna.visualization import matplotlib as ovm

    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    with warnings.catch_warnings():
        # The matplotlib plots are marked experimental; the warning says nothing to a user.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
            ax = ovm.plot_optimization_history(study, target_name="idle ratio")
            ax.set_title(f"autominato tune: {study.study_name}")
            if baseline_idle is not None:
                ax.axhline(baseline_idle, color="grey", linestyle="--", label="default configuration")
                ax.legend()
            written["objective"] = _save(ax.figure, out_dir / "objective.png", plt)
        else:
            log.info("no completed trial: objective.png not written")
        if has_variation(study):
            # PED-ANOVA: Optuna's own estimator, no scikit-learn needed (fANOVA needs it).
            ax = ovm.plot_param_importances(study, evaluator=PedAnovaImportanceEvaluator())
            written["importance"] = _save(ax.figure, out_dir / "importance.png", plt)
        else:
            log.info(
                "parameter importance needs >= 2 completed trials with differing idle ratios "
                "and a searched parameter that took >= 2 values among them: importance.png "
                "not written"
            )
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.set_size_inches(8, 4.5)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def memory_aware_line(result: Any) -> str | None:
    """What the configuration written gives up where the study turned ``memory_aware`` off
    (searched, and the best trial's, not the default kept): its idle ratio and peak memory
    against the same settings with it on (``study.TWIN_ATTR``, measured in turns after the
    study), or that they were not measured (no confirmation: ``--no-baseline``). ``None``
    where there is nothing to say (a space that fixes it says it itself)."""
    best = result.best
    if (result.config is None or result.config["loader"].get("memory_aware") is not False
            or best is None or best.params.get("memory_aware") is not False
            or result.kept_default):
        return None
    # (the study's check of this run: run_study clears one a run before left, review 206)
    check = result.study.user_attrs.get(TWIN_ATTR) or {}
    if check.get("trial") == best.number and check.get("off_wins"):
        on, off = check["on_idle"], check["off_idle"]
        figures = (f"idle {sum(off) / len(off):.3f} against {sum(on) / len(on):.3f} with it "
                   f"on at the same knobs, {len(off)} runs each in turns")
        if check.get("on_peak_memory_bytes") and check.get("off_peak_memory_bytes"):
            figures += (f", peak memory {check['off_peak_memory_bytes'] / 2**30:.2f} GiB "
                        f"against {check['on_peak_memory_bytes'] / 2**30:.2f} GiB in those "
                        "runs")
        said = f"memory_aware: false in the configuration written ({figures})"
    elif check.get("trial") == best.number and check.get("unmeasured"):
        said = ("memory_aware: false in the configuration written (not checked: the same "
                "settings with it on could not be measured again)")
    else:
        said = ("memory_aware: false in the configuration written (not measured against the "
                "same settings with it on: nothing was measured again after the study)")
    return (f"{said}; its workers keep their freed heap warm and large samples are no longer "
            "held apart: where large samples meet in a long run, its peak can pass what the "
            "trials saw (docs/memory.md; --memory-budget fails the trials above it, and "
            "memory_aware: true in the search space keeps memory-aware dispatch)")


def print_summary(console: Console, result: Any) -> None:
    """The closing lines: the table, the baseline comparison, where things were written."""
    trials = result.study.get_trials(deepcopy=False)
    states = {s: sum(t.state == s for t in trials) for s in TrialState}
    written = (result.best.number if result.best is not None and result.config_path is not None
               and not result.kept_default else None)
    console.print(best_table(trials, written=written))
    console.print(
        f"study {result.study.study_name!r}: {len(trials)} trials "
        f"({states[TrialState.COMPLETE]} complete, {states[TrialState.PRUNED]} pruned, "
        f"{states[TrialState.FAIL]} failed); this run {result.elapsed_s:.0f} s"
    )
    if result.baseline is not None:
        console.print(
            f"default configuration ({fmt_params(result.baseline_knobs)}): "
            f"idle {result.baseline.idle_ratio:.3f}"
        )
    if result.best is not None:
        lower = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
                 and t.value < result.best.value]
        # (trial 173: a trial lower in the table beside "best" read as a mistake: the pick is
        # the study's selection rule's, or the finalists' measured again; trial 180: name the
        # one that made it)
        ruled = select_best(trials)
        twin_of = result.best.user_attrs.get("twin_of")
        if twin_of is not None:
            # (review 206: it was said "picked when the best few were measured again")
            # (trial 209: "idle 0.025 over its runs" beside "best 0.070" in the line below,
            # with no word of which runs each was)
            n = len(result.best.user_attrs.get("idle_runs") or ())
            # (a twin stored before its runs were kept has none: review 210)
            why = (f" over its {runs_said(n) if n else 'runs'} beside memory_aware off "
                   f"(trial {twin_of}'s knobs with "
                   "memory_aware on, taken when memory_aware off did not beat them beyond the "
                   "noise, above; its runs beside the default are in the next line)")
        elif not lower:
            why = ""
        elif ruled is not None and ruled.number != result.best.number:
            why = (f" in its trial; picked over {len(lower)} lower in theirs when the best "
                   "few were measured again (above; docs/tune.md, \"Beating the default "
                   "beyond the noise\")")
        else:
            why = (f" in its trial; picked over {len(lower)} lower by the study's selection "
                   "rule (docs/tune.md, \"Choosing the best trial\": within the idle "
                   "tolerance, memory-aware dispatch on, less CPU, then less memory)")
        console.print(
            f"best: trial {result.best.number}, idle {result.best.value:.3f}{why}, "
            f"{fmt_params(result.best.params)}"
        )
    if result.confirmation is not None:
        console.print(result.confirmation.line(), highlight=False)
    said = memory_aware_line(result)
    if said is not None:
        console.print(said, highlight=False)
    if result.config_path is not None:
        what = "the DEFAULT configuration" if result.kept_default else "configuration"
        console.print(f"{what} written to {result.config_path}")
    for kind, path in result.plots.items():
        console.print(f"{kind} plot: {path}")
