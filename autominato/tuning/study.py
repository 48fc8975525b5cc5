"""The Optuna study: one trial per candidate configuration, stored so that it resumes.

Each trial builds the pipeline's loader with the configuration the sampler drew, measures it
(:func:`autominato.tuning.measure.measure`) and returns the window's idle ratio, which Optuna
minimises. Intermediate idle ratios go to a median pruner with a noise margin
(:class:`autominato.tuning.pruner.MarginMedianPruner`). Failures are sorted by cause:

* memory over the budget, or anything else that depends on the configuration (a worker killed,
  shared memory exhausted): the trial fails with its reason in the user attribute
  ``failure`` and the study goes on;
* an exception raised for a sample by the user's dataset or transform (it names the sample
  index and file): no configuration can fix it, so the trial is recorded as failed and
  :class:`PipelineFailed` stops the study. The stored study stays usable: fix the code and run
  the same command to resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autominato.config import ConfigError, load_config, save_config
from autominato.pipeline.errors import SampleError, SampleTimeout, WorkerDied
from autominato.pipeline.knobs import KNOB_NAMES
from autominato.tuning.measure import Measurement, MemoryBudgetExceeded, measure
from autominato.tuning.pipeline import Pipeline
from autominato.tuning.pruner import MarginMedianPruner
from autominato.tuning.report import fmt_params, save_plots, trial_line
from autominato.tuning.select import (
    IDLE_TOLERANCE,
    TWIN_ATTR,
    Confirmation,
    completed,
    confirm_best,
    pick,
    ranked,
    runs_said,
    select_best,
    unconfirmed,
)
from autominato.tuning.space import STATIC_NAMES, SearchSpace

log = logging.getLogger(__name__)

def same_error_key(failure: str | None) -> str | None:
    """What two trials' failures must share to count as the same error: the message with
    numbers and bracketed details (a sample's index, the shapes that met in a batch, which
    depend on the order samples completed in) left out.

    >>> same_error_key("CollateError: cannot stack: [(1,), (2,)]") == same_error_key(
    ...     "CollateError: cannot stack: [(1,), (2,), (3,)]")
    True
    """
    if failure is None:
        return None
    return re.sub(r"\d+", "#", re.sub(r"\[[^\]]*\]|\([^)]*\)", "(...)", failure))


#: This many consecutive trials failing with the same message (not a memory-budget failure)
#: stop the study: an error that follows every configuration is the pipeline's or the
#: installation's, and more trials would only repeat it.
REPEATED_FAILURES = 3


class PipelineFailed(RuntimeError):
    """The user's dataset or transform raised for a sample; the message names index and file."""


class TrialFailed(RuntimeError):
    """A configuration could not be measured (the cause is chained); the study goes on."""


@dataclass
class TuneResult:
    """What :func:`run_study` returns.

    Attributes:
        study: the Optuna study (all its trials, this run's and earlier ones).
        best: the best completed trial (:func:`select_best`), ``None`` if none completed.
        baseline: the default configuration measured in this run (``None`` if skipped).
        baseline_knobs: the knob values of that default configuration.
        config: the configuration written (``load_config`` form), ``None`` without a best.
        config_path: where it was written.
        plots: ``{"objective": path, "importance": path}`` for the PNGs written.
        elapsed_s: wall seconds of this run, baseline included.
        stopped: why the study stopped before ``n_trials`` (``None`` if it did not stop early
            for a failure; see :data:`REPEATED_FAILURES`).
        confirmation: the default and the best measured again (``None`` without a baseline,
            a best, or with ``confirm_repeats=0``); when the best did not beat the default
            beyond the noise, or could not be measured again, ``config`` is the default's.
            ``best`` is then the finalist that :func:`~autominato.tuning.select.pick` takes
            on the means of their runs again (see :data:`FINALISTS`), not necessarily the
            trial :func:`select_best` picked.
        finalists: the trial numbers measured again beside the default, best-ranked first.
    """

    study: optuna.Study
    best: FrozenTrial | None
    baseline: Measurement | None
    baseline_knobs: dict[str, int]
    config: dict[str, Any] | None
    config_path: Path | None
    plots: dict[str, Path] = field(default_factory=dict)
    elapsed_s: float = 0.0
    stopped: str | None = None
    confirmation: Confirmation | None = None
    finalists: tuple[int, ...] = ()

    @property
    def kept_default(self) -> bool:
        """The configuration written is the default one (nothing beat it beyond the noise)."""
        return self.confirmation is not None and not self.confirmation.keep_best


def is_sample_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's code failing on a sample, not the configuration failing.

    The loader tags such exceptions with ``sample_index``; a worker that died (OOM killer) or
    timed out also names a sample but may be the configuration's fault (too many workers).
    """
    return getattr(exc, "sample_index", None) is not None and not isinstance(
        exc, (WorkerDied, SampleTimeout)
    )


def default_study_name(pipeline: Pipeline, space: SearchSpace) -> str:
    """The pipeline's study name (:meth:`Pipeline.study_name`) plus a short hash of what the
    space searches and fixes and of its trial settings: rerunning the same command resumes the
    study, while an edited space starts a study of its own (its trials are not comparable,
    and a best from the old space could break the new one's bounds)."""
    blob = json.dumps({"searched": {k: repr(v) for k, v in space.searched.items()},
                       "fixed": space.fixed, "trial": space.trial}, sort_keys=True, default=str)
    return f"{pipeline.study_name()}-s{hashlib.sha1(blob.encode()).hexdigest()[:6]}"


def measure_config(
    pipeline: Pipeline,
    space: SearchSpace,
    params: dict[str, Any],
    *,
    on_report: Any = None,
    memory_budget_bytes: int | None = None,
) -> tuple[Measurement, dict[str, int]]:
    """Build the loader for ``params``, measure it, close it.

    Returns:
        The measurement and the knob values the loader applied (after its clamping), less
        the knobs the space dropped (:attr:`SearchSpace.dropped`: they do nothing there).

    Raises:
        PipelineFailed: the dataset or transform raised for a sample.
        MemoryBudgetExceeded: the configuration is over ``memory_budget_bytes``.
        optuna.TrialPruned: raised by ``on_report``.
        TrialFailed: any other failure of this configuration.
    """
    batch_size = int(params.get("batch_size", pipeline.batch_size))
    try:
        with pipeline.build_loader(params) as loader:
            # (a knob the space dropped does nothing in this loader, read_threads where the
            # workers read: not shown, stored or written as if it had been tuned, trial 173)
            knobs = {k: v for k, v in loader.knobs.as_dict().items() if k not in space.dropped}
            m = measure(
                loader,
                pipeline.step_for(batch_size),
                warmup_batches=space.trial["warmup_batches"],
                window_batches=space.trial["window_batches"],
                report_every=space.trial["report_every"],
                on_report=on_report,
                memory_budget_bytes=memory_budget_bytes,
            )
    except (MemoryBudgetExceeded, optuna.TrialPruned):
        raise
    except Exception as e:
        if is_sample_error(e):
            where = f"sample index {e.sample_index}"  # type: ignore[attr-defined]
            path = getattr(e, "sample_path", None)
            if path:
                where += f" (file {path})"
            # A SampleError's message already names the sample; a re-raised user exception's
            # does not (the loader adds it as a note, which str() leaves out).
            message = str(e) if isinstance(e, SampleError) else f"{type(e).__name__}: {e}"
            raise PipelineFailed(f"the dataset or transform failed on {where}: {message}") from e
        raise TrialFailed(f"{type(e).__name__}: {e}") from e
    return m, knobs


def _objective(pipeline: Pipeline, space: SearchSpace, memory_budget_bytes: int | None):
    def objective(trial: optuna.Trial) -> float:
        params = space.suggest(trial)

        def on_report(batches: int, idle: float) -> None:
            trial.report(idle, batches)
            if trial.should_prune():
                raise optuna.TrialPruned(
                    f"idle {idle:.3f} after {batches} batches is above the median of earlier trials"
                )

        try:
            m, knobs = measure_config(
                pipeline,
                space,
                params,
                on_report=on_report,
                memory_budget_bytes=memory_budget_bytes,
            )
        except (MemoryBudgetExceeded, TrialFailed, PipelineFailed) as e:
            trial.set_user_attr("failure", str(e))
            raise
        except KeyboardInterrupt:
            # (Optuna stores the trial as failed: its reason too, trial 173 found none)
            try:
                trial.set_user_attr("failure", "interrupted (Ctrl-C) while it ran: not a "
                                    "measurement; the study resumes with the same command")
            except Exception:  # noqa: BLE001 - the storage refused: the interrupt goes on
                pass
            raise
        for key, value in m.as_dict().items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("cpu_s_per_sample", m.cpu_s_per_sample)
        trial.set_user_attr("knobs", knobs)
        return m.idle_ratio

    return objective


def best_config(
    best: FrozenTrial, space: SearchSpace, pipeline: Pipeline, provenance: dict[str, Any]
) -> dict[str, Any]:
    """The configuration file's content for trial ``best`` (``autominato.config`` form).

    ``knobs``: the values the best trial's loader applied; ``bounds``: the searched knobs'
    ranges (the online controller stays inside them); ``loader``: the static settings
    (``worker_kind``, ``in_order``, ``memory_aware`` where set, and the batch size).
    """
    return _config({**space.fixed, **best.params}, best.user_attrs.get("knobs") or {}, space,
                   pipeline, provenance)


def _config(
    params: dict[str, Any],
    applied: dict[str, int],
    space: SearchSpace,
    pipeline: Pipeline,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    knobs = {
        k: int(applied.get(k, params.get(k))) for k in KNOB_NAMES if k in applied or k in params
    }
    loader = {k: params[k] for k in STATIC_NAMES if k in params}
    loader.setdefault("batch_size", pipeline.batch_size)
    if "memory_aware" in space.searched:
        loader.setdefault("memory_aware", True)  # (the default configuration: the Loader's)
    # A value the Loader applied outside the searched range (it raises pool_size to the batch
    # size: trial 197's range [1, 2] at batch 4 wrote pool_size 4 with bounds [1, 2]) widens
    # the range written, so that the file holds what ran and the controller may keep it.
    bounds = space.knob_bounds()
    for k, v in knobs.items():
        if k in bounds:
            lo, hi = bounds[k]
            bounds[k] = (min(lo, v), max(hi, v))
    return {"knobs": knobs, "bounds": bounds, "loader": loader, "study": provenance}


def _other_studies(pipeline: Pipeline, name: str, url: str,
                   out: Path) -> list[tuple[str, int, Path]]:
    """Studies of ``pipeline`` under another search space (another name's suffix): in the
    storage ``url`` (of the folder ``out``), and in the ``study.db`` of the folders beside
    ``out`` (``runs/tune/NAME`` each by default), as ``(name, trials, folder)``. Those are
    read through SQLite, read-only (Optuna's storage creates its tables in a file it opens:
    review 206 saw an empty ``study.db`` beside grow to 112 KiB), one query each; a file
    that does not read as a study database is passed over."""
    import sqlite3

    prefix = f"{pipeline.study_name()}-s"
    found: list[tuple[str, int, Path]] = []
    if url != default_storage(out):
        try:
            found += [(s.study_name, s.n_trials, out)
                      for s in optuna.get_all_study_summaries(url, include_best_trial=False)
                      if s.study_name.startswith(prefix) and s.study_name != name]
        except Exception:  # noqa: BLE001 - the storage did not answer: nothing to say
            pass
    files = ([out / "study.db"] if url == default_storage(out) else []) + [
        d / "study.db" for d in sorted(out.parent.glob(f"{prefix}*"))
        if d != out and (d / "study.db").is_file()]
    for file in files:
        try:
            con = sqlite3.connect(f"{file.resolve().as_uri()}?mode=ro", uri=True)
            try:
                rows = con.execute(
                    "SELECT s.study_name, COUNT(t.trial_id) FROM studies s LEFT JOIN trials t "
                    "ON t.study_id = s.study_id GROUP BY s.study_id").fetchall()
            finally:
                con.close()
        except sqlite3.Error:  # not a study database: nothing to say
            continue
        found += [(n, int(c), file.parent) for n, c in rows
                  if str(n).startswith(prefix) and n != name]
    return found


def _say_replaced(path: Path, config: dict[str, Any], console: Console) -> None:
    """Say what a configuration written before at ``path`` held where ``config`` changes
    its knobs or static settings (trial 205: ``--trials 0`` replaced a confirmed
    ``memory_aware: false`` by the default, the noise of the runs again, without a word)."""
    if not path.is_file():
        return
    try:
        old = load_config(path)
    except ConfigError as e:
        console.print(f"{path} did not read as a configuration, replaced: {e}",
                      highlight=False)
        return
    def flat(cfg: dict[str, Any]) -> dict[str, Any]:
        # (a setting left out reads as the Loader's default: a file written before tune
        # wrote memory_aware is the same configuration, review 206)
        return {"in_order": False, "memory_aware": True, **cfg["knobs"], **cfg["loader"],
                **{f"bounds.{k}": list(v) for k, v in cfg["bounds"].items()}}

    before, after = flat(old), flat(config)
    if before != after:
        console.print(f"{path} held another configuration, replaced: {fmt_params(before)} "
                      f"(study: {old['study'].get('confirmation', 'no confirmation')})",
                      highlight=False)


def default_storage(out_dir: Path) -> str:
    """``sqlite:///OUT/study.db``: one file that survives interruption and that
    ``optuna-dashboard`` opens."""
    return f"sqlite:///{out_dir / 'study.db'}"


def run_study(
    pipeline: Pipeline,
    space: SearchSpace,
    *,
    n_trials: int,
    out_dir: str | Path,
    timeout: float | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    memory_budget_bytes: int | None = None,
    seed: int = 0,
    baseline: bool = True,
    config_path: str | Path | None = None,
    console: Console | None = None,
    progress: bool = True,
    confirm_repeats: int = 2,
) -> TuneResult:
    """Run (or resume) a study of ``n_trials`` more trials and write its outputs.

    Args:
        pipeline: what a trial builds (:func:`autominato.tuning.pipeline.make_pipeline`).
        space: the search space (:func:`autominato.tuning.space.load_space`).
        n_trials: trials to add in this run (Optuna's ``optimize(n_trials=...)``).
        out_dir: folder for ``study.db`` (default storage), ``loader.yaml`` and the PNGs.
        timeout: stop starting trials after this many seconds (Optuna's ``timeout``).
        storage: an Optuna storage URL; default :func:`default_storage`.
        study_name: default :meth:`Pipeline.study_name`, so the same command resumes the study.
        memory_budget_bytes: a trial above it fails (the study goes on).
        seed: TPE seed; offset by the trials already stored so a resumed study draws new points.
        baseline: measure the default configuration first, for comparison: the Loader's
            defaults for every searched parameter, the space's fixed values for the rest.
        config_path: where to write the configuration; default ``out_dir/loader.yaml``.
        console: where lines, the progress bar and the table go.
        progress: show a progress bar.
        confirm_repeats: after the study, measure the default and the best-ranked
            configurations (the finalists) this many more times each, in turns; the one
            chosen on those runs is measured again afresh beside the default,
            :data:`CONFIRM_ROUNDS` rounds at least (this many where more), and written only
            if it beats the default's runs of those rounds beyond the noise
            (:func:`autominato.tuning.select.confirm_best`); else the default configuration
            is written, and the console says so (also when every new measurement of the
            best failed). 0: no check.

    Raises:
        PipelineFailed: the dataset or transform raised for a sample (the study stays usable).
        KeyboardInterrupt: the running trial is stored as failed; rerun to resume.
    """
    t0 = time.perf_counter()
    if space.dropped and pipeline.loader_kwargs.get("fuse_read") is False:
        # (its loader reads in a stage of threads: read_threads is live there, review 140)
        space = space.with_dropped()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console = console or Console()
    name = study_name or default_study_name(pipeline, space)
    url = storage or default_storage(out)
    existing = 0
    try:
        existing = len(optuna.load_study(study_name=name, storage=url).trials)
    except KeyError:
        pass
    study = optuna.create_study(
        study_name=name,
        storage=url,
        direction="minimize",
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=seed + existing),
        pruner=MarginMedianPruner(**space.pruner),
    )
    study.set_user_attr("pipeline", pipeline.identity)
    if study.user_attrs.get(TWIN_ATTR):
        study.set_user_attr(TWIN_ATTR, None)  # (a run before made it: review 206)
    console.print(
        f"study {name!r} in {url}: {existing} stored trials, adding {n_trials} "
        f"(window {space.trial['window_batches']} batches after {space.trial['warmup_batches']} "
        f"warm-up, space {space.source})"
    )
    if not existing:
        for other, trials, folder in _other_studies(pipeline, name, url, out):
            console.print(
                f"another study of this pipeline, with another search space, is stored: "
                f"{other!r} ({trials} trials) in {folder}. An edited space, or a default that "
                "searches more (memory_aware since December 2026), starts a study of its own; "
                f"to add to that one, rerun with its space (a space file written before: "
                f"with memory_aware: true added) and --study-name {other} --out {folder}",
                highlight=False)
    console.print(f"training step: {pipeline.identity.get('step')} per batch of "
                  f"{pipeline.batch_size} ({pipeline.step_note or 'as given'})", highlight=False)
    batch = space.fixed.get("batch_size") or pipeline.batch_size
    pool = space.knob_bounds().get("pool_size")
    if pool is not None and "batch_size" not in space.searched and pool[0] < batch:
        # (trial 197: a range [1, 2] at batch 4 ran every trial at 4, and nothing said so)
        console.print(f"pool_size below the batch size ({batch}) runs as {batch}: the Loader "
                      f"holds at least one batch's samples in flight (the space's range: "
                      f"[{pool[0]}, {pool[1]}])", highlight=False)
    base: Measurement | None = None
    base_knobs: dict[str, int] = {}
    default = _default_params(pipeline, space, console) if baseline else dict(space.fixed)
    if baseline:
        # The first loader of this process starts its workers' interpreter, and its first
        # reads of the files may come from disk: the default, measured first, read 0.80,
        # 0.63 and 0.85 idle in three KiTS19 studies where its later runs averaged 0.57,
        # 0.54 and 0.60, which put it behind every trial and widened the noise that a gain
        # must pass. One run of it, not counted, goes first.
        console.print("warming up: the default configuration once, not counted (the first "
                      "loader starts the workers' interpreter and may read the files from "
                      "disk)", highlight=False)
        over: MemoryBudgetExceeded | None = None
        try:
            measure_config(pipeline, space, default, memory_budget_bytes=memory_budget_bytes)
        except MemoryBudgetExceeded as e:
            over = e  # (no second run over the budget: review 206)
        except TrialFailed as e:
            console.print(f"the warm-up run failed: {e}", highlight=False)
        try:
            if over is not None:
                raise over
            base, base_knobs = measure_config(pipeline, space, default,
                                              memory_budget_bytes=memory_budget_bytes)
        except (TrialFailed, MemoryBudgetExceeded) as e:
            # (over the budget, it is no configuration to keep either: review 146)
            console.print(f"default configuration could not be measured: {e}", highlight=False)
        else:
            console.print(
                f"default configuration: idle {base.idle_ratio:.3f}  mem "
                f"{base.peak_memory_bytes / 2**30:.2f} GiB  {fmt_params(base_knobs)}"
                + ("  memory_aware=True" if "memory_aware" in space.searched else ""))
            study.set_user_attr("baseline", {"idle_ratio": base.idle_ratio, "knobs": base_knobs})

    bar = (
        Progress(
            TextColumn("[bold]tuning"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[best]}"),
            console=console,
            # Redrawn after each trial, not by a thread of its own: a trial's Loader built
            # while another thread runs starts its workers from a new interpreter (1-2 s, and
            # not the fork a training script's Loader gets), with advice to the user that
            # does not apply here (trial 145).
            auto_refresh=False,
        )
        if progress
        else None
    )
    task = bar.add_task("trials", total=n_trials, best="") if bar else None

    run_failures: list[str | None] = []
    stopped: list[str] = []

    def after_trial(study: optuna.Study, trial: FrozenTrial) -> None:
        line = trial_line(trial)
        failure = trial.user_attrs.get("failure") if trial.state == TrialState.FAIL else None
        if isinstance(failure, str) and "over the budget" in failure:
            failure = None  # a budget failure depends on the configuration by definition
        run_failures.append(failure)
        last = run_failures[-REPEATED_FAILURES:]
        if (len(last) == REPEATED_FAILURES and last[0] is not None
                and len({same_error_key(f) for f in last}) == 1):
            stopped.append(
                f"{REPEATED_FAILURES} trials in a row failed with the same error, which does not "
                f"look like the configurations' fault: {last[-1]}"
            )
            study.stop()
        if bar is not None:
            best = select_best(study.get_trials(deepcopy=False))
            shown = f"best idle {best.value:.3f} (trial {best.number})" if best else ""
            bar.update(task, advance=1, best=shown)
            bar.console.print(line)
            bar.refresh()
        else:
            console.print(line)

    verbosity = optuna.logging.get_verbosity()
    # Our per-trial line replaces Optuna's (which prints a traceback for every failed trial).
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with bar if bar is not None else nullcontext():
            study.optimize(
                _objective(pipeline, space, memory_budget_bytes),
                n_trials=n_trials,
                timeout=timeout,
                catch=(MemoryBudgetExceeded, TrialFailed),
                callbacks=[after_trial],
            )
    finally:
        optuna.logging.set_verbosity(verbosity)

    trials = study.get_trials(deepcopy=False)
    best = select_best(trials)
    config = written = None
    confirmation = None
    finalists: tuple[int, ...] = ()
    if best is not None and base is not None and confirm_repeats > 0:
        picks = _finalists(trials, space)
        finalists = tuple(t.number for t in picks)
        confirmation, best = _confirm(pipeline, space, picks, base, default, confirm_repeats,
                                      memory_budget_bytes, console, study)
        trials = study.get_trials(deepcopy=False)  # (with a twin the check added: trial 207)
    if best is not None:
        provenance = {
            "name": name,
            "best_trial": best.number,
            "best_trial_idle_ratio": round(float(best.value), 4),
            # of the configuration written: the best trial's, or the default's (below)
            "idle_ratio": round(float(best.value), 4),
            "baseline_idle_ratio": round(base.idle_ratio, 4) if base else None,
            "trials_complete": len(completed(trials)),
            "trials_total": len(trials),
            "pipeline": {k: v for k, v in pipeline.identity.items() if k != "data" and v},
            "window_batches": space.trial["window_batches"],
        }
        if confirmation is not None:
            provenance["confirmation"] = confirmation.line()
            provenance["kept_default"] = not confirmation.keep_best
            check = study.user_attrs.get(TWIN_ATTR)
            if check and check.get("line") and best.number in (check["trial"],
                                                               check.get("twin")):
                provenance["memory_aware_check"] = check["line"]
            # The idle ratio of the configuration written, over its runs after the study: the
            # default's, or the best's (its trial's value was picked for being among the
            # lowest of many, so it reads low: trial 159 saw 0.008 written for 0.06-0.17).
            provenance["idle_ratio"] = round(
                confirmation.best_mean if confirmation.keep_best else confirmation.default_mean,
                4)
        if confirmation is not None and not confirmation.keep_best:
            config = _config(default, base_knobs, space, pipeline, provenance)
        else:
            config = best_config(best, space, pipeline, provenance)
        target = Path(config_path or out / "loader.yaml")
        _say_replaced(target, config, console)
        written = save_config(config, target)
    plots = save_plots(study, out, base.idle_ratio if base else None)
    return TuneResult(
        study=study,
        best=best,
        baseline=base,
        baseline_knobs=base_knobs,
        config=config,
        config_path=written,
        plots=plots,
        elapsed_s=time.perf_counter() - t0,
        stopped=stopped[0] if stopped else None,
        confirmation=confirmation,
        finalists=finalists,
    )


def _default_params(pipeline: Pipeline, space: SearchSpace, console: Console) -> dict[str, Any]:
    """The default configuration: the space's fixed values, and the Loader's defaults for
    the searched knobs, each clamped into its searched range (a space that leaves the
    default out, ``workers: {low: 1, high: 1}`` on a machine whose default is 2, measured
    the default outside it and wrote it with bounds that exclude it: trial 146). Reads the
    defaults from a Loader built and closed at once."""
    params = dict(space.fixed)
    bounds = space.knob_bounds()
    if not bounds:
        return params
    try:
        with pipeline.build_loader(params) as loader:
            applied = loader.knobs.as_dict()
    except Exception:  # noqa: BLE001 - the baseline's measurement reports it
        return params
    for knob, (low, high) in bounds.items():
        value = applied.get(knob)
        if value is not None and not low <= value <= high:
            params[knob] = min(max(value, low), high)
            console.print(f"the Loader's default {knob}={value} is outside the space's "
                          f"[{low}, {high}]: the default configuration takes "
                          f"{knob}={params[knob]}", highlight=False)
    return params


#: Trials measured again beside the default after the study: :func:`select_best`'s pick and
#: the next ranked trials of other settings. The pick alone was chosen for the lowest of many
#: noisy values: trial 159 saw a 5-worker trial at idle 0.008 (0.06-0.17 measured again)
#: chosen over the 6 workers that kept up (0.031 in its trial, 0.01 measured again).
FINALISTS = 3


def _finalists(trials: Sequence[FrozenTrial], space: SearchSpace) -> list[FrozenTrial]:
    """Up to :data:`FINALISTS` completed trials, best-ranked first (:func:`ranked`), one per
    configuration (a configuration tried twice counts once, at its better rank)."""
    out: list[FrozenTrial] = []
    seen: set[str] = set()
    for t in ranked(trials):
        # (a trial stored before the space searched memory_aware ran with the default, on)
        aware = {"memory_aware": True} if "memory_aware" in space.searched else {}
        key = repr(sorted({**aware, **space.fixed, **t.params}.items()))
        if key not in seen:
            seen.add(key)
            out.append(t)
        if len(out) >= FINALISTS:
            break
    return out


def _confirm(
    pipeline: Pipeline,
    space: SearchSpace,
    finalists: Sequence[FrozenTrial],
    base: Measurement,
    default: dict[str, Any],
    repeats: int,
    memory_budget_bytes: int | None,
    console: Console,
    study: optuna.Study,
) -> tuple[Confirmation, FrozenTrial]:
    """Measure the default and each finalist ``repeats`` more times, in turns (so that a
    drift of the machine's load hits all alike); the finalist that :func:`~autominato.
    tuning.select.pick` takes on the means of their runs (the cheapest within the tie
    tolerance of the lowest mean) is then compared with the default. When no finalist could be
    measured again, the default is kept (:func:`~autominato.tuning.select.unconfirmed`) and
    the best-ranked is returned. Where several were measured, the one chosen is measured
    again afresh, :data:`CONFIRM_ROUNDS` rounds at least (``repeats``), in turns with the
    default, and compared on those runs alone (the runs it was chosen on read low); a lone
    finalist's runs are made up to as many rounds. Either way it is compared with the
    default's runs of the same rounds only (runs of other periods of the machine's load
    widened the noise). A chosen finalist that turns a searched ``memory_aware``
    off is measured beside the same settings with it on (:func:`_memory_aware_twin`): where
    it does not beat them beyond the noise, those (added to ``study`` as a trial) are the
    finalist. Returns the comparison and that finalist."""
    turns_default: list[float] = []  # the default's runs in turns with the finalists
    runs: list[list[float]] = [[] for _ in finalists]
    configs = [("the default", default, turns_default)] + [
        (f"trial {t.number}", {**space.fixed, **t.params}, into)
        for t, into in zip(finalists, runs, strict=True)]
    names = ", ".join(str(t.number) for t in finalists)
    console.print(f"measuring the default and the best trials ({names}) {repeats} more times "
                  "each, to tell a gain from noise")

    def in_turns(triples: Sequence[tuple[str, dict[str, Any], list[float]]],
                 rounds: int = repeats, first_round: int = 0) -> None:
        _in_turns(pipeline, space, triples, rounds, memory_budget_bytes, console,
                  first_round=first_round)

    in_turns(configs)
    measured = [i for i, r in enumerate(runs) if r]
    i = 0  # (none measured: the best-ranked)
    if measured:
        # The study's rule again (select.pick) on the means measured now: the cheapest of
        # those within the tie tolerance of the lowest, not the lowest mean (trial 197: a
        # 6-worker finalist 0.01 lower replaced the 4 workers that kept up at less CPU).
        means = [sum(runs[j]) / len(runs[j]) for j in measured]
        i = measured[pick(means, [finalists[j] for j in measured])]
        console.print("measured again, mean idle: " + ", ".join(
            f"{label} {sum(into) / len(into):.3f}" for label, _, into in configs if into),
            highlight=False)
    if i != 0:
        low = min(means)
        if sum(1 for v in means if v <= low + IDLE_TOLERANCE) == 1:
            why = "the lowest mean"  # (trial 207: a tie rule was named for it)
        else:
            why = (f"within {IDLE_TOLERANCE} of the lowest mean, then "
                   + ("memory-aware dispatch on, " if "memory_aware" in space.searched else "")
                   + "the least CPU and memory")
        console.print(f"trial {finalists[i].number} wins when measured again ({why}): it "
                      f"replaces trial {finalists[0].number} as the best", highlight=False)
    # The default's runs it is compared with are those of the same rounds, in turns: the
    # default's first measurement (before the study) and its runs beside the other
    # finalists came from other periods of the machine's load (a KiTS19 study measured the
    # default 0.287 before its trials and 0.45-0.50 after; pooled, the noise's sd read 0.135
    # and a gain of 0.185 over 9 runs of the best was not kept).
    rounds = max(repeats, CONFIRM_ROUNDS)
    chosen, default_idle = runs[i], turns_default
    label, params = configs[i + 1][0], configs[i + 1][1]
    if len(measured) > 1:
        # Its runs were picked for being the lowest of several: compared with the default
        # and written, they would read low again (review 161: a false keep 5.8 % of the time
        # at the 2.5 % level, the written figure 0.6 sd low). It is measured afresh.
        chosen, default_idle = [], []
        console.print(f"measuring trial {finalists[i].number} and the default {rounds} more "
                      "times each, afresh, in turns", highlight=False)
        in_turns([("the default", default, default_idle), (label, params, chosen)], rounds)
    elif chosen and repeats < rounds:  # the one finalist: its runs in turns, to `rounds`
        console.print(f"measuring trial {finalists[i].number} and the default "
                      f"{rounds - repeats} more time{'s' if rounds - repeats > 1 else ''} "
                      f"each, in turns ({rounds} rounds at least to tell a gain from noise)",
                      highlight=False)
        in_turns([("the default", default, default_idle), (label, params, chosen)],
                 rounds - repeats, first_round=repeats)
    if not default_idle:  # (every run of the default failed in those rounds)
        default_idle = [base.idle_ratio, *turns_default]
        if chosen:
            console.print(
                "every run of the default failed in those rounds: it is compared on its "
                f"{runs_said(len(default_idle))} from before them (other periods of the "
                "machine's load" + (", its first measurement, before the study, alone"
                                    if len(default_idle) == 1 else "") + ")", highlight=False)
    best = finalists[i]
    if chosen and "memory_aware" in space.searched \
            and best.params.get("memory_aware") is False:
        best, chosen, default_idle = _memory_aware_twin(
            pipeline, space, study, best, params, chosen, default, default_idle, rounds,
            memory_budget_bytes, console)
    c = confirm_best(default_idle, chosen) if chosen else unconfirmed(default_idle)
    console.print(c.line(), highlight=False)
    return c, best


#: Rounds at least of the final comparison with the default (:func:`_confirm`), each a run of
#: both in turns: with 2 and 2 runs Student's t has 2 degrees of freedom (4.30 at 97.5 %).
CONFIRM_ROUNDS = 3


#: Rounds at least of the check of a chosen ``memory_aware: false`` against the same knobs
#: with it on (:func:`_memory_aware_twin`).
TWIN_ROUNDS = 3


def _memory_aware_twin(
    pipeline: Pipeline,
    space: SearchSpace,
    study: optuna.Study,
    best: FrozenTrial,
    params: dict[str, Any],
    off_runs: list[float],
    default: dict[str, Any],
    default_idle: list[float],
    repeats: int,
    memory_budget_bytes: int | None,
    console: Console,
) -> tuple[FrozenTrial, list[float], list[float]]:
    """The chosen finalist turns ``memory_aware`` off: measure it and the same settings with
    it on, ``repeats`` times each (:data:`TWIN_ROUNDS` at least) in turns
    (:func:`_in_turns`), and keep it off only where it beats them on those runs beyond the
    noise (:func:`~autominato.tuning.select.confirm_best`): it trades peak memory
    and the hold of large samples apart for speed, the study's tie rule compares single
    noisy trials, and a search may never have drawn the same knobs with it on (review 204:
    with no effect of it at all, 6 of 12 noisy studies wrote it off).

    Kept off, the finalist is compared with the default on its runs from before this check
    (``off_runs`` and ``default_idle``, the default's of the same rounds, returned as they
    were): the runs that decided on against off would read low again against the default
    (review 206: 5.5 % false keeps at the 2.5 % level). Else the settings with it on are
    added to ``study`` as a trial (its value the mean of its runs here) and measured again
    afresh, ``repeats`` rounds in turns with the default; returned with those runs and the
    default's of those rounds. The check is stored in the study's :data:`TWIN_ATTR`; where
    either could not be measured, the finalist stands and the check says so.

    Returns:
        ``(trial, its runs, the default's runs of the same rounds)``."""
    on_params = {**params, "memory_aware": True}
    on_runs: list[float] = []
    off_here: list[float] = []
    # At least TWIN_ROUNDS each: with 2 and 2 runs Student's t has 2 degrees of freedom
    # (4.30 at 97.5 %), and a KiTS19 gain of 0.08 idle met a margin of 0.446; with 3 and 3,
    # 2.78 on a standard error 0.82 as large.
    rounds = max(repeats, TWIN_ROUNDS)
    console.print(f"trial {best.number} turns memory_aware off: measuring it and the same "
                  f"settings with it on {rounds} times each, in turns, to tell its gain from "
                  "noise", highlight=False)
    last, peaks = _in_turns(pipeline, space, [("memory_aware off", params, off_here),
                                              ("memory_aware on", on_params, on_runs)],
                            rounds, memory_budget_bytes, console)
    on = last.get("memory_aware on")
    said: dict[str, Any] = {"trial": best.number}
    if not on_runs or on is None or not off_here:
        said["line"] = ("the settings with memory_aware on (or off) could not be measured "
                        f"again: trial {best.number}'s stand")
        said["unmeasured"] = True
        study.set_user_attr(TWIN_ATTR, said)
        console.print(said["line"], highlight=False)
        return best, off_runs, default_idle
    check = confirm_best(on_runs, off_here)
    figures = (f"on idle {check.default_mean:.3f}, off {check.best_mean:.3f}, over "
               f"{len(on_runs)} and {len(off_here)} runs in turns (margin {check.margin:.3f})")
    said.update(on_idle=on_runs, off_idle=off_here, margin=check.margin,
                off_wins=check.keep_best, on_peak_memory_bytes=peaks.get("memory_aware on"),
                off_peak_memory_bytes=peaks.get("memory_aware off"))
    if check.keep_best:
        said["line"] = f"memory_aware off beats it on beyond the noise: {figures}"
        study.set_user_attr(TWIN_ATTR, said)
        console.print(said["line"], highlight=False)
        return best, off_runs, default_idle
    m, knobs = on
    attrs: dict[str, Any] = dict(m.as_dict())
    # (its value is the mean of its runs: the attributes say so, not its last run's alone)
    attrs.update(cpu_s_per_sample=m.cpu_s_per_sample, knobs=knobs, twin_of=best.number,
                 idle_ratio=sum(on_runs) / len(on_runs), idle_runs=on_runs,
                 peak_memory_bytes=peaks["memory_aware on"])
    twin_params = {**best.params, "memory_aware": True}
    study.add_trial(optuna.trial.create_trial(
        params=twin_params, distributions=best.distributions,
        value=sum(on_runs) / len(on_runs), user_attrs=attrs))
    # (the trial just added: another process may add to a shared storage meanwhile)
    twin = max((t for t in study.get_trials(deepcopy=False)
                if t.user_attrs.get("twin_of") == best.number and t.params == twin_params
                and t.state == TrialState.COMPLETE), key=lambda t: t.number)
    said["twin"] = twin.number
    said["line"] = (f"memory_aware off does not beat it on beyond the noise ({figures}): the "
                    f"same settings with it on are taken (trial {twin.number}), measured "
                    "again beside the default")
    study.set_user_attr(TWIN_ATTR, said)
    console.print(said["line"], highlight=False)
    fresh: list[float] = []
    beside: list[float] = []
    _in_turns(pipeline, space, [("the default", default, beside),
                                (f"trial {twin.number}", on_params, fresh)],
              repeats, memory_budget_bytes, console)
    if fresh and not beside:
        console.print("every run of the default failed in those rounds: it is compared on its "
                      "runs of the rounds before", highlight=False)
    return twin, fresh, beside or default_idle


def _in_turns(
    pipeline: Pipeline,
    space: SearchSpace,
    triples: Sequence[tuple[str, dict[str, Any], list[float]]],
    repeats: int,
    memory_budget_bytes: int | None,
    console: Console,
    first_round: int = 0,
) -> tuple[dict[str, tuple[Measurement, dict[str, int]]], dict[str, int]]:
    """Measure each ``(label, params, into)`` once a round, ``repeats`` rounds, the order
    reversed every other round (so that a drift of the machine's load hits all alike and
    none always follows another; rounds counted from ``first_round``, so that rounds that go
    on from earlier ones keep the alternation), appending each idle ratio to its ``into``; a
    failed run is said and left out. Returns each label's last measurement and applied
    knobs, and its highest peak memory (bytes)."""
    last: dict[str, tuple[Measurement, dict[str, int]]] = {}
    peaks: dict[str, int] = {}
    for round_ in range(first_round, first_round + repeats):
        for label, params, into in (triples[::-1] if round_ % 2 else triples):
            try:
                m, knobs = measure_config(pipeline, space, params,
                                          memory_budget_bytes=memory_budget_bytes)
            except (TrialFailed, MemoryBudgetExceeded) as e:
                console.print(f"could not measure again ({label}): {e}", highlight=False)
                continue
            into.append(m.idle_ratio)
            last[label] = (m, knobs)
            peaks[label] = max(peaks.get(label, 0), m.peak_memory_bytes)
    return last, peaks
