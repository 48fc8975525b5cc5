"""Stopping hopeless trials early: a median rule with a noise margin.

Optuna's ``MedianPruner`` stops a trial whose intermediate value is worse than the median of
completed trials at the same step. Idle ratios of configurations that all keep up differ by
measurement noise alone (a few hundredths), and a plain median rule then stops half of them at
random, so they never reach the tie-break on CPU seconds and memory
(:mod:`autominato.tuning.select`). This rule is the median rule (Optuna's, "median stopping
rule" of Golovin et al., Google Vizier, KDD 2017) with a margin: a trial is stopped only when it
is worse than the median by more than ``margin``.
"""

from __future__ import annotations

import statistics

import optuna
from optuna.trial import FrozenTrial, TrialState


class MarginMedianPruner(optuna.pruners.BasePruner):
    """Prune when the intermediate idle ratio exceeds the completed trials' median + ``margin``.

    Args:
        n_startup_trials: no pruning until this many trials have completed.
        n_warmup_steps: the first this many reports of a trial are never pruned (the window
            has measured only a few batches, where noise is largest).
        margin: idle-ratio points (absolute, in [0, 1]) above the median that still count
            as a tie.
    """

    def __init__(self, n_startup_trials: int = 4, n_warmup_steps: int = 1, margin: float = 0.02):
        if n_startup_trials < 0 or n_warmup_steps < 0 or margin < 0:
            raise ValueError("n_startup_trials, n_warmup_steps and margin must be >= 0")
        self.n_startup_trials = n_startup_trials
        self.n_warmup_steps = n_warmup_steps
        self.margin = margin

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or len(trial.intermediate_values) <= self.n_warmup_steps:
            return False
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if len(done) < max(1, self.n_startup_trials):
            return False
        at_step = [t.intermediate_values[step] for t in done if step in t.intermediate_values]
        if not at_step:
            return False
        return trial.intermediate_values[step] > statistics.median(at_step) + self.margin
