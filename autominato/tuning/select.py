"""Choosing the best trial: lowest idle ratio, ties broken by memory-aware dispatch, CPU
seconds, then memory.

Pure functions of finished trials, so that the rule is tested without running a study.
Measured idle ratios carry noise (a few hundredths on a busy machine), so "tied" means within
a tolerance, not equal: among the trials whose idle ratio is within ``idle_tolerance`` of the
lowest, those with ``memory_aware`` on are kept where any is (turning it off trades peak
memory, and the protection against large samples running together, for speed: taken only
where it buys a lower idle ratio; it also spends less CPU in the kernel, so the CPU rule
alone would pick it at equal idle), then those within ``cpu_tolerance`` (relative) of the
fewest CPU seconds per sample, and of these the one with the least peak memory wins.

:func:`confirm_best` then decides whether the winner beats the default configuration beyond
the noise of measuring them again (the same default measured 0.431 and 0.356 in two runs on
a loaded machine: far more than the tie tolerance).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState
from scipy.stats import t as student_t

#: Idle ratios closer than this are a tie (absolute; about the run-to-run spread seen on a
#: loaded 2-core machine for a pipeline that keeps up).
IDLE_TOLERANCE = 0.01
#: CPU seconds per sample within this fraction of the lowest are a tie.
CPU_TOLERANCE = 0.10
#: Study user attribute that holds the check of a chosen ``memory_aware: false`` against the
#: same settings with it on (``tuning.study._memory_aware_twin``; the summary reads it).
TWIN_ATTR = "memory_aware_check"


def completed(trials: Iterable[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that finished with a value (pruned and failed ones are left out)."""
    return [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]


def _cpu(t: FrozenTrial) -> float:
    return float(t.user_attrs.get("cpu_s_per_sample", math.inf))


def _memory(t: FrozenTrial) -> float:
    return float(t.user_attrs.get("peak_memory_bytes", math.inf))


def select_best(
    trials: Iterable[FrozenTrial],
    *,
    idle_tolerance: float = IDLE_TOLERANCE,
    cpu_tolerance: float = CPU_TOLERANCE,
) -> FrozenTrial | None:
    """The best completed trial (``None`` if none completed); see the module docstring.

    Reads ``trial.value`` (idle ratio) and the user attributes ``cpu_s_per_sample`` (seconds)
    and ``peak_memory_bytes`` (bytes); a missing attribute counts as infinitely costly.
    """
    done = completed(trials)
    if not done:
        return None
    return done[pick([float(t.value) for t in done], done,  # type: ignore[arg-type]
                     idle_tolerance=idle_tolerance, cpu_tolerance=cpu_tolerance)]


def pick(
    idle: Sequence[float],
    trials: Sequence[FrozenTrial],
    *,
    idle_tolerance: float = IDLE_TOLERANCE,
    cpu_tolerance: float = CPU_TOLERANCE,
) -> int:
    """The module docstring's rule over ``trials`` whose idle ratios are ``idle`` (their
    trial values, or their means when measured again, see ``tuning.study._confirm``): the
    position of the winner. Ties left after memory go to the lower idle ratio, then to the
    lower trial number. CPU seconds per sample and peak memory are the trials' attributes;
    ``memory_aware`` their parameter (on where not searched).

    Raises:
        ValueError: no trials, or ``idle`` and ``trials`` of different lengths.
    """
    if not trials or len(idle) != len(trials):
        raise ValueError(f"pick needs as many idle ratios as trials, at least one: got "
                         f"{len(idle)} and {len(trials)}")
    low = min(idle)
    tied = [i for i, v in enumerate(idle) if v <= low + idle_tolerance]
    tied = [i for i in tied if trials[i].params.get("memory_aware", True)] or tied
    low_cpu = min(_cpu(trials[i]) for i in tied)
    if math.isfinite(low_cpu):
        tied = [i for i in tied if _cpu(trials[i]) <= low_cpu * (1.0 + cpu_tolerance)]
    return min(tied, key=lambda i: (_memory(trials[i]), idle[i], trials[i].number, i))


def ranked(trials: Iterable[FrozenTrial]) -> list[FrozenTrial]:
    """Completed trials, best first: :func:`select_best`'s winner, then by idle, CPU, memory
    (the report's order)."""
    done = completed(trials)
    best = select_best(done)
    rest = sorted(
        (t for t in done if t is not best), key=lambda t: (t.value, _cpu(t), _memory(t), t.number)
    )
    return ([best] if best is not None else []) + rest


def has_variation(study: optuna.Study) -> bool:
    """Whether parameter importance is defined: >= 2 completed trials whose values differ and
    a searched parameter that took >= 2 values among them (PED-ANOVA and fANOVA need both)."""
    done = completed(study.get_trials(deepcopy=False))
    if len({t.value for t in done}) < 2:
        return False
    names = {n for t in done for n in t.params}
    return any(len({repr(t.params.get(n)) for t in done}) >= 2 for n in names)


#: One-sided false-alarm rate of the noise check under normal noise: the chance that a best
#: no better than the default is written. The margin is Student's t quantile for it (with
#: the few repeats measured the standard deviation is itself an estimate: a fixed 2 standard
#: errors let 7 % through at the default 3 + 2 runs).
NOISE_ALPHA = 0.025


def runs_said(n: int) -> str:
    """``"1 run"``, ``"3 runs"``."""
    return f"{n} run" if n == 1 else f"{n} runs"


@dataclass(frozen=True)
class Confirmation:
    """The default against the best trial, each measured again (:func:`confirm_best`).

    Attributes:
        default_idle / best_idle: the idle ratios measured for each, in order; ``best_idle``
            is empty when the best could not be measured again (:func:`unconfirmed`).
        default_mean / best_mean: their means.
        noise_sd: pooled standard deviation of one measurement (0.0 with too few).
        margin: by how much the best's mean must undercut the default's to count.
        keep_best: the best beats the default by more than ``margin``.
    """

    default_idle: tuple[float, ...]
    best_idle: tuple[float, ...]
    default_mean: float
    best_mean: float
    noise_sd: float
    margin: float
    keep_best: bool

    def line(self) -> str:
        """One sentence for the console and the configuration's provenance."""
        if not self.best_idle:
            return ("kept the DEFAULT configuration, the best trial could not be measured "
                    f"again: default idle {self.default_mean:.3f} over "
                    f"{len(self.default_idle)} runs")
        figures = (
            f"default idle {self.default_mean:.3f} over {runs_said(len(self.default_idle))}, best "
            f"{self.best_mean:.3f} over {runs_said(len(self.best_idle))} (noise sd "
            f"{self.noise_sd:.3f}, margin {self.margin:.3f})"
        )
        if self.keep_best:
            return f"the best trial beats the default beyond the noise: {figures}"
        return f"kept the DEFAULT configuration, no trial beat it beyond the noise: {figures}"


def confirm_best(
    default_idle: Sequence[float],
    best_idle: Sequence[float],
    *,
    alpha: float = NOISE_ALPHA,
    tolerance: float = IDLE_TOLERANCE,
) -> Confirmation:
    """Whether the best trial's configuration really idles less than the default.

    ``best_idle`` must be measurements made again after the study (the trial's own value was
    picked for being the lowest of many, so it is biased low). The noise is the pooled sample
    standard deviation ``s`` of both groups around their means; the best is kept when
    ``mean(default) - mean(best) > max(tolerance, t * s * sqrt(1/n_default + 1/n_best))``,
    ``t`` being Student's t quantile ``1 - alpha`` with ``n_default + n_best - 2`` degrees of
    freedom (two means compared with a pooled variance: a one-sided t test at level
    ``alpha``). With one of each there is no variance estimate: the margin is ``tolerance``.

    Raises:
        ValueError: either sequence is empty.
    """
    d, b = [float(x) for x in default_idle], [float(x) for x in best_idle]
    if not d or not b:
        raise ValueError("confirm_best needs at least one measurement of the default and the best")
    dm, bm = sum(d) / len(d), sum(b) / len(b)
    dof = len(d) + len(b) - 2
    ss = sum((x - dm) ** 2 for x in d) + sum((x - bm) ** 2 for x in b)
    sd = math.sqrt(ss / dof) if dof > 0 else 0.0
    crit = float(student_t.ppf(1.0 - alpha, dof)) if dof > 0 else 0.0
    margin = max(tolerance, crit * sd * math.sqrt(1 / len(d) + 1 / len(b)))
    return Confirmation(tuple(d), tuple(b), dm, bm, sd, margin, dm - bm > margin)


def unconfirmed(default_idle: Sequence[float]) -> Confirmation:
    """The check when every new measurement of the best failed: the default is kept (a
    configuration that no longer runs, or runs over the memory budget, is not written on
    the strength of the one trial value that was picked for being the lowest).

    Raises:
        ValueError: ``default_idle`` is empty.
    """
    d = [float(x) for x in default_idle]
    if not d:
        raise ValueError("unconfirmed needs at least one measurement of the default")
    return Confirmation(tuple(d), (), sum(d) / len(d), math.nan, 0.0, math.nan, False)
