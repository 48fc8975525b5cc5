"""The search space of ``autominato tune``: a YAML file under the top-level ``tuner/`` folder.

A space file has three sections (see ``tuner/default.yaml`` for the documented default)::

    params:                       # what a trial sets; each a fixed value or a range
      depth: {type: int, low: 1, high: 8}
      workers: {type: int, low: 0, high: cores}
      worker_kind: {type: categorical, choices: [process, thread]}
      in_order: false             # fixed: not searched
      batch_size: null            # null: not set here (the loader's default / the command line)
    trial: {warmup_batches: 4, window_batches: 24, report_every: 4}
    pruner: {n_startup_trials: 4, n_warmup_steps: 1, margin: 0.02}

Keys a file leaves out are taken from ``tuner/default.yaml``, so a user's copy may hold only
what it changes. Every error names the file and the key (``space.yaml: params.workers.high:
...``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna
import yaml

from autominato.pipeline.knobs import KNOB_MIN, KNOB_NAMES, usable_cores

log = logging.getLogger(__name__)


#: The top-level ``tuner/`` folder of a source checkout (search spaces and recipes).
def _tuner_dir() -> Path:
    """The ``tuner/`` folder: the checkout's (editable install), else the copy that a wheel
    installs under ``<prefix>/share/autominato/tuner`` (pyproject's data-files)."""
    checkout = Path(__file__).resolve().parents[2] / "tuner"
    if checkout.is_dir():
        return checkout
    import sysconfig

    return Path(sysconfig.get_path("data")) / "share" / "autominato" / "tuner"


TUNER_DIR = _tuner_dir()
DEFAULT_SPACE = TUNER_DIR / "default.yaml"

#: Loader settings that are not live knobs but may be searched (they need a new loader).
STATIC_NAMES = ("worker_kind", "in_order", "memory_aware", "batch_size")
PARAM_NAMES = (*KNOB_NAMES, *STATIC_NAMES)
#: Smallest meaningful value of each integer parameter (0 workers = transform in-process).
MINIMUM = {**KNOB_MIN, "batch_size": 1}
SECTIONS = {
    "params": None,
    "trial": {"warmup_batches": 0, "window_batches": 1, "report_every": 1},
    "pruner": {"n_startup_trials": 0, "n_warmup_steps": 0, "margin": 0.0},
}


class SpaceError(ValueError):
    """A search-space file is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class SearchSpace:
    """A validated search space.

    Attributes:
        searched: parameter name -> Optuna distribution (``IntDistribution`` or
            ``CategoricalDistribution``) for the parameters a trial draws.
        fixed: parameter name -> value for parameters set but not searched.
        trial: ``warmup_batches``, ``window_batches``, ``report_every`` (batches).
        pruner: ``n_startup_trials``, ``n_warmup_steps``, ``margin`` of
            :class:`autominato.tuning.pruner.MarginMedianPruner`.
        source: the file(s) it was read from, for messages.
    """

    searched: dict[str, optuna.distributions.BaseDistribution]
    fixed: dict[str, Any]
    trial: dict[str, int]
    pruner: dict[str, float]
    source: str = "<dict>"
    cores: int = field(default=1, compare=False)
    #: Parameters of the file not searched because no configuration of the space would use
    #: them (``read_threads`` where process workers read): :meth:`with_dropped` puts them
    #: back for a pipeline that reads in threads (``fuse_read=False``).
    dropped: dict[str, optuna.distributions.BaseDistribution] = field(
        default_factory=dict, compare=False)

    def suggest(self, trial: optuna.trial.BaseTrial) -> dict[str, Any]:
        """Draw one configuration: the searched parameters from ``trial``, plus the fixed ones."""
        params = dict(self.fixed)
        for name, dist in self.searched.items():
            if isinstance(dist, optuna.distributions.IntDistribution):
                params[name] = trial.suggest_int(
                    name, dist.low, dist.high, step=dist.step, log=dist.log
                )
            else:
                params[name] = trial.suggest_categorical(name, dist.choices)
        return params

    def knob_bounds(self) -> dict[str, tuple[int, int]]:
        """``{knob: (low, high)}`` of the searched knobs: the online controller's range."""
        out: dict[str, tuple[int, int]] = {}
        for name, dist in self.searched.items():
            if name not in KNOB_NAMES:
                continue
            if isinstance(dist, optuna.distributions.IntDistribution):
                out[name] = (dist.low, dist.high)
            else:
                out[name] = (min(dist.choices), max(dist.choices))
        return out

    def with_trial(self, **overrides: int | None) -> SearchSpace:
        """A copy whose ``trial`` settings take the non-``None`` ``overrides`` (validated)."""
        trial = dict(self.trial)
        for key, value in overrides.items():
            if value is not None:
                trial[key] = _check_count(
                    f"{self.source}: trial.{key}", value, SECTIONS["trial"][key]
                )
        return replace(self, trial=trial)

    def with_dropped(self) -> SearchSpace:
        """A copy that searches :attr:`dropped` too."""
        return replace(self, searched={**self.searched, **self.dropped}, dropped={})


def load_space(
    path: str | Path | None = None,
    *,
    cores: int | None = None,
    base: str | Path | None = DEFAULT_SPACE,
) -> SearchSpace:
    """Read and validate a search-space file.

    Args:
        path: the YAML file; ``None`` reads ``base`` alone.
        cores: what ``cores`` in a bound means; default :func:`usable_cores` of this machine.
        base: the file whose keys fill what ``path`` leaves out (``tuner/default.yaml``);
            ``None`` for none, so that ``path`` must be complete.

    Raises:
        SpaceError: unreadable or invalid YAML, an unknown or missing key, a bound of the wrong
            type, ``low > high``, a value below the parameter's minimum.
    """
    cores = usable_cores() if cores is None else cores
    sources: list[str] = []
    merged: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    files = [p for p in (base, path) if p is not None]
    if not files:
        raise SpaceError("no search-space file given and no default")
    for file in dict.fromkeys(Path(p).resolve() for p in files):
        where = str(file if file.parent != TUNER_DIR else Path("tuner") / file.name)
        raw = _read_yaml(file, where)
        sources.append(where)
        for section, values in raw.items():
            if section not in SECTIONS:
                raise SpaceError(
                    f"{where}: unknown key {section!r} (expected one of {', '.join(SECTIONS)})"
                )
            if values is None:
                continue
            if not isinstance(values, dict):
                raise SpaceError(f"{where}: {section}: expected a mapping, got {values!r}")
            for key, value in values.items():
                merged[section][key] = (where, value)
    searched: dict[str, optuna.distributions.BaseDistribution] = {}
    fixed: dict[str, Any] = {}
    for name, (where, spec) in merged["params"].items():
        key = f"{where}: params.{name}"
        if name not in PARAM_NAMES:
            raise SpaceError(f"{key}: unknown parameter (expected one of {', '.join(PARAM_NAMES)})")
        if isinstance(spec, dict):
            searched[name] = _distribution(key, name, spec, cores)
        elif spec is not None:
            fixed[name] = _check_value(key, name, spec)
    settings: dict[str, dict[str, Any]] = {}
    for section in ("trial", "pruner"):
        settings[section] = {}
        for key, minimum in SECTIONS[section].items():
            if key not in merged[section]:
                raise SpaceError(f"{' + '.join(sources)}: {section}.{key}: missing")
            where, value = merged[section][key]
            check = _check_number if isinstance(minimum, float) else _check_count
            settings[section][key] = check(f"{where}: {section}.{key}", value, minimum)
        for key, (where, _) in merged[section].items():
            if key not in SECTIONS[section]:
                raise SpaceError(
                    f"{where}: {section}.{key}: unknown key "
                    f"(expected one of {', '.join(SECTIONS[section])})"
                )
    dropped: dict[str, optuna.distributions.BaseDistribution] = {}
    if "read_threads" in searched and _workers_read(searched, fixed):
        # Process workers read inside themselves (the Loader's fuse_read, the default):
        # there are no read threads, and every value would measure the same loader (trial
        # 138: the default space drew it over 1..4, and the result named a value). Left at
        # the Loader's default, out of the knobs' bounds; searched again for a pipeline
        # whose loader reads in threads (run_study: fuse_read=False).
        log.info("%s: read_threads is not searched: the %s workers read inside themselves "
                 "and workers 0 loads in the training loop's thread (a read stage of threads "
                 "runs with worker_kind thread)",
                 " + ".join(sources), fixed.get("worker_kind", "process"))
        dropped["read_threads"] = searched.pop("read_threads")
    threads = "worker_kind" not in searched and fixed.get("worker_kind") == "thread"
    if "memory_aware" in searched and (threads or fixed.get("workers") == 0):
        # Thread workers are never held back for memory and keep no warm heap of their own,
        # and workers 0 loads in the training loop's thread: both values would measure the
        # same loader.
        log.info("%s: memory_aware is not searched: %s", " + ".join(sources),
                 "thread workers are not held back for memory and keep no warm heap"
                 if threads else "workers 0 loads each sample in the training loop's thread")
        del searched["memory_aware"]
    return SearchSpace(
        searched, fixed, settings["trial"], settings["pruner"], " + ".join(sources), cores,
        dropped,
    )


def _workers_read(searched: dict[str, Any], fixed: dict[str, Any]) -> bool:
    """Whether no configuration of the space has read threads: the worker kind fixed to
    process (the Loader's default when not given), whose workers read inside themselves;
    ``workers=0`` loads each sample in the training loop's thread, with no read threads
    either (trial 146: the docs said it read in them)."""
    return "worker_kind" not in searched and fixed.get("worker_kind", "process") == "process"


def _read_yaml(file: Path, where: str) -> dict[str, Any]:
    try:
        text = file.read_text()
    except OSError as e:
        raise SpaceError(f"{where}: cannot read search space: {e}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpaceError(f"{where}: not valid YAML: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpaceError(f"{where}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def _check_count(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpaceError(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _check_number(key: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise SpaceError(f"{key}: expected a number >= {minimum}, got {value!r}")
    return float(value)


def _check_value(key: str, name: str, value: Any) -> Any:
    """Validate one value of parameter ``name`` (a fixed value or a categorical choice)."""
    if name == "worker_kind":
        if value not in ("process", "thread"):
            raise SpaceError(f"{key}: expected 'process' or 'thread', got {value!r}")
    elif name in ("in_order", "memory_aware"):
        if not isinstance(value, bool):
            raise SpaceError(f"{key}: expected true or false, got {value!r}")
    else:
        _check_count(key, value, MINIMUM[name])
    return value


def _bound(key: str, name: str, value: Any, cores: int) -> int:
    """An integer bound, or the word ``cores`` (this machine's usable cores), or ``N*cores``
    (``N`` times them: ``4*cores`` is the online controller's own bound on workers,
    ``loader.default_knobs``)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(?:([0-9]+)\s*\*\s*)?cores\s*", value)
        if m is None:  # (trial 173: the word was not named)
            raise SpaceError(f"{key}: expected an integer >= {MINIMUM[name]}, the word `cores` "
                             f"(this machine's usable cores, {cores}) or `N*cores`, got {value!r}")
        value = cores * int(m.group(1) or 1)
    return _check_count(key, value, MINIMUM[name])


def _distribution(
    key: str, name: str, spec: dict[str, Any], cores: int
) -> optuna.distributions.BaseDistribution:
    kind = spec.get("type")
    allowed = {"int": {"type", "low", "high", "step", "log"}, "bool": {"type"}}
    allowed["categorical"] = {"type", "choices"}
    if kind not in allowed:
        raise SpaceError(f"{key}.type: expected one of int, bool, categorical, got {kind!r}")
    for extra in spec.keys() - allowed[kind]:
        raise SpaceError(
            f"{key}.{extra}: not a key of a {kind} range (expected {', '.join(sorted(allowed[kind]))})"
        )
    if kind == "bool":
        if name not in ("in_order", "memory_aware"):
            raise SpaceError(f"{key}.type: bool applies to in_order and memory_aware only")
        return optuna.distributions.CategoricalDistribution([False, True])
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SpaceError(f"{key}.choices: expected a non-empty list, got {choices!r}")
        return optuna.distributions.CategoricalDistribution(
            [_check_value(f"{key}.choices", name, c) for c in choices]
        )
    if name not in MINIMUM:
        hint = ("{type: bool}" if name in ("in_order", "memory_aware")
                else "{type: categorical, choices: [...]}")
        raise SpaceError(f"{key}.type: {name} is not an integer; use {hint}")
    for bound in ("low", "high"):
        if bound not in spec:
            raise SpaceError(f"{key}.{bound}: missing")
    low = _bound(f"{key}.low", name, spec["low"], cores)
    high = _bound(f"{key}.high", name, spec["high"], cores)
    if low > high:
        raise SpaceError(f"{key}: low {low} > high {high} (`cores` is {cores} on this machine)")
    step = _check_count(f"{key}.step", spec.get("step", 1), 1)
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError(f"{key}.log: expected true or false, got {log!r}")
    if log and (low < 1 or step != 1):
        raise SpaceError(f"{key}.log: a log range needs low >= 1 and no step")
    return optuna.distributions.IntDistribution(low, high, log=log, step=step)
