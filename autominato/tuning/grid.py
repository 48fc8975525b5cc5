"""How close ``autominato tune`` gets to a full grid's optimum (``autominato tune --compare-grid``).

A grid measures every combination of a few values of each searched parameter
(:func:`grid_points`); the grid's optimum is the point with the lowest idle ratio. The
configuration ``tune`` chose and that optimum are then measured again, alternating, so that
both figures carry the same noise (:func:`compare_with_grid`). The goal the project set:
tune's choice within 0.03 of the optimum's idle ratio (3 points of idle; a relative gap is
meaningless when the optimum idles 0) in at most 20 trials.

Units: idle ratios in [0, 1]; a grid point is a parameter dict as a trial's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna

from autominato.tuning.space import SearchSpace

#: Tune's choice must idle at most this much more than the grid's optimum (absolute).
GOAL_GAP = 0.03


def _levels(dist: optuna.distributions.IntDistribution, levels: int) -> list[int]:
    """``levels`` values from ``low`` to ``high`` (all of them when there are few), spaced
    geometrically for a log distribution, else evenly; on the distribution's step."""
    step = dist.step or 1
    count = (dist.high - dist.low) // step + 1
    if count <= levels:
        return list(range(dist.low, dist.high + 1, step))
    if dist.log and dist.low > 0:
        raw = [dist.low * (dist.high / dist.low) ** (i / (levels - 1)) for i in range(levels)]
    else:
        raw = [dist.low + (dist.high - dist.low) * i / (levels - 1) for i in range(levels)]
    snapped = [dist.low + step * round((v - dist.low) / step) for v in raw]
    return sorted({min(dist.high, max(dist.low, v)) for v in snapped})


def grid_points(space: SearchSpace, levels: int = 3) -> list[dict[str, Any]]:
    """Every combination of ``levels`` values of each searched integer parameter and every
    choice of each categorical one, with the space's fixed values added.

    Raises:
        ValueError: ``levels`` < 2.
    """
    if levels < 2:
        raise ValueError(f"levels must be >= 2, got {levels}")
    axes: dict[str, list[Any]] = {}
    for name, dist in space.searched.items():
        if isinstance(dist, optuna.distributions.IntDistribution):
            axes[name] = _levels(dist, levels)
        else:
            axes[name] = list(dist.choices)
    names = list(axes)
    return [{**space.fixed, **dict(zip(names, combo, strict=True))}
            for combo in itertools.product(*(axes[n] for n in names))]


@dataclass(frozen=True)
class GridComparison:
    """Tune's choice against the grid's optimum.

    Attributes:
        points: grid points measured (failed ones included).
        grid_best: the optimum's parameters.
        grid_idle / tune_idle: idle ratios of the optimum and of tune's choice, measured again
            (alternating) after the grid; a measurement that failed is left out (either may
            then hold fewer than ``repeats`` figures, or none).
        gap: ``mean(tune_idle) - mean(grid_idle)`` (negative: tune's choice did better); NaN
            when either finalist could not be measured again.
        within_goal: ``gap <= GOAL_GAP`` (False for a NaN gap).
    """

    points: int
    grid_best: dict[str, Any]
    grid_idle: tuple[float, ...]
    tune_idle: tuple[float, ...]
    gap: float
    within_goal: bool

    def line(self) -> str:
        if not self.grid_idle or not self.tune_idle:
            which = [name for name, got in (("tune's choice", self.tune_idle),
                                            ("the grid optimum", self.grid_idle)) if not got]
            return (f"tune vs grid: {' and '.join(which)} could not be measured again after "
                    f"the {self.points} grid points: no gap, NOT within the {GOAL_GAP:.2f} goal")
        g = sum(self.grid_idle) / len(self.grid_idle)
        t = sum(self.tune_idle) / len(self.tune_idle)
        # (a gap that rounds to 0.000 gets no share: "-0.000 (-17% of it)" read as a
        # contradiction, trial 146)
        rel = f" ({self.gap / g:+.0%} of it)" if g > 0 and abs(self.gap) >= 5e-4 else ""
        verdict = "within" if self.within_goal else "NOT within"
        n, m = len(self.tune_idle), len(self.grid_idle)
        runs = (f"{n} run{'s' if n != 1 else ''} each" if n == m else f"{n} and {m} runs")
        return (f"tune vs grid: tune's choice idle {t:.3f}, grid optimum idle {g:.3f} over "
                f"{self.points} points ({runs}): gap {self.gap:+.3f}"
                f"{rel}, {verdict} the {GOAL_GAP:.2f} goal")


Measure = Callable[[dict[str, Any]], float]


def compare_with_grid(
    measure: Measure,
    space: SearchSpace,
    chosen: dict[str, Any],
    *,
    levels: int = 3,
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> GridComparison:
    """Measure the grid, then tune's ``chosen`` parameters and the grid's optimum again.

    Args:
        measure: ``params -> idle ratio`` (one measurement; may raise for an infeasible point,
            which then counts as idle 1.0 in the grid; a finalist's failed re-measurement is
            logged and left out of its mean).
        space: the space the study searched.
        chosen: the parameters of the configuration tune wrote.
        levels: values per integer parameter (:func:`grid_points`).
        repeats: measurements of each of the two finalists after the grid (>= 1).

    Raises:
        ValueError: ``repeats`` < 1 or ``levels`` < 2.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    points = grid_points(space, levels)
    log(f"grid: {len(points)} points ({levels} values per integer parameter)")
    scored = []
    for i, params in enumerate(points):
        try:
            idle = measure(params)
        except Exception as e:  # noqa: BLE001 - an infeasible point is the worst, not an abort
            log(f"grid point {i}: failed ({type(e).__name__}: {e})")
            idle = 1.0
        scored.append((idle, i))
        log(f"grid point {i}: idle {idle:.3f} {_fmt(params, space)}")
    best = points[min(scored)[1]]
    grid_idle: list[float] = []
    tune_idle: list[float] = []
    finalists = (("grid optimum", best, grid_idle),
                 ("tune's choice", {**space.fixed, **chosen}, tune_idle))
    for r in range(repeats):
        for name, params, into in finalists:
            try:
                into.append(float(measure(params)))
            except Exception as e:  # noqa: BLE001 - a failed run is reported, not a traceback
                log(f"{name}, run {r + 1}: failed ({type(e).__name__}: {e})")
    if grid_idle and tune_idle:
        gap = sum(tune_idle) / len(tune_idle) - sum(grid_idle) / len(grid_idle)
    else:
        gap = math.nan
    return GridComparison(len(points), best, tuple(grid_idle), tuple(tune_idle), gap,
                          math.isfinite(gap) and gap <= GOAL_GAP + 1e-12)


def _fmt(params: dict[str, Any], space: SearchSpace) -> str:
    return " ".join(f"{k}={params[k]}" for k in space.searched if k in params)
