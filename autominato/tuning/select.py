"""Choosing the best trial: lowest idle ratio, ties broken by CPU seconds, then memory.

Pure functions of finished trials, so that the rule is tested without running a study.
Measured idle ratios carry noise (a few hundredths on a busy machine), so "tied" means within
a tolerance, not equal: among the trials whose idle ratio is within ``idle_tolerance`` of the
lowest, those within ``cpu_tolerance`` (relative) of the fewest CPU seconds per sample are
kept, and of these the one with the least peak memory wins.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import optuna
from optuna.trial import FrozenTrial, TrialState

#: Idle ratios closer than this are a tie (absolute; about the run-to-run spread seen on a
#: loaded 2-core machine for a pipeline that keeps up).
IDLE_TOLERANCE = 0.01
#: CPU seconds per sample within this fraction of the lowest are a tie.
CPU_TOLERANCE = 0.10


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
    low = min(t.value for t in done)  # type: ignore[type-var]
    tied = [t for t in done if t.value <= low + idle_tolerance]  # type: ignore[operator]
    low_cpu = min(_cpu(t) for t in tied)
    if math.isfinite(low_cpu):
        tied = [t for t in tied if _cpu(t) <= low_cpu * (1.0 + cpu_tolerance)]
    return min(tied, key=lambda t: (_memory(t), t.value, t.number))


def ranked(trials: Iterable[FrozenTrial]) -> list[FrozenTrial]:
    """Completed trials, best first: :func:`select_best`'s winner, then by idle, CPU, memory."""
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
