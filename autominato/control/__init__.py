"""The online controller: retunes depth, read threads, workers and pool size while training runs.

``Controller`` is the thread; the decision rule behind it is a pure function of a stats history
(:class:`Rule`, default :class:`StageBasedRule`) so that it can be swapped and tested alone.
See ``docs/controller.md``.
"""

from autominato.control.controller import Controller
from autominato.control.rule import (
    REASONS,
    Budget,
    Decision,
    Rule,
    RuleState,
    StageBasedRule,
    Window,
    measure,
    predicted_memory,
)

__all__ = [
    "REASONS",
    "Budget",
    "Controller",
    "Decision",
    "Rule",
    "RuleState",
    "StageBasedRule",
    "Window",
    "measure",
    "predicted_memory",
]
