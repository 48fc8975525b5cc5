"""Loader configuration files: what ``autominato tune`` writes and ``Loader(config=...)`` reads.

A configuration is YAML or JSON with these top-level keys (all optional)::

    knobs:  {depth: 4, read_threads: 2, workers: 2, pool_size: 16}   # starting values
    bounds: {depth: [1, 16], workers: [1, 8]}                        # the controller's range
    loader: {worker_kind: process, in_order: false, batch_size: 2,   # static settings
             memory_aware: true}
    study:  {...}                                                    # provenance, free form

The online controller starts from ``knobs`` and stays inside ``bounds``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from autominato.pipeline.knobs import KNOB_MIN, KNOB_NAMES

log = logging.getLogger("autominato.config")

LOADER_KEYS = ("worker_kind", "in_order", "batch_size", "drop_last", "shuffle", "memory_aware")
TOP_KEYS = ("knobs", "bounds", "loader", "study")


class ConfigError(ValueError):
    """A configuration file or mapping is invalid; the message names the file and the key."""


class LoadedConfig(os.PathLike):
    """A configuration read from a file, carried with its path: what a copy of a Loader
    (pickled to a spawned rank, deep-copied) is built from, so that it runs with what the
    original read, not with the file as it is then (rewritten by a later ``autominato tune``,
    gone, or a relative path read from another working directory: trial 205). Reads as its
    path (``os.fspath``, ``str``) in messages."""

    def __init__(self, path: str | Path, cfg: dict[str, Any]) -> None:
        self.path = str(path)
        self.cfg = cfg

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"LoadedConfig({self.path!r})"


def load_config(source: str | Path | LoadedConfig | dict[str, Any]) -> dict[str, Any]:
    """Read and validate a configuration.

    Args:
        source: a path to a ``.yaml``/``.yml``/``.json`` file, an already parsed mapping,
            or a :class:`LoadedConfig` (validated again, its path naming it).

    Returns:
        ``{"knobs": {name: int}, "bounds": {name: (low, high)}, "loader": {...}, "study": {...}}``.

    Raises:
        ConfigError: unreadable file, unknown key, or a value of the wrong type or range.
    """
    where = "<dict>"
    if isinstance(source, LoadedConfig):
        where, raw = source.path, source.cfg
    elif isinstance(source, (str, Path)):
        where = str(source)
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read configuration: {e}") from e
        import yaml  # here: ~100 ms of `import autominato` for a Loader given no file

        try:
            raw = json.loads(text) if where.endswith(".json") else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"{where}: not valid YAML/JSON: {e}") from e
    else:
        raw = source
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in TOP_KEYS:
            hint = ("; it reads as a search space (autominato tune --space), not the "
                    "configuration tune writes (OUT/loader.yaml)"
                    if key in ("params", "trial", "pruner") else "")
            raise ConfigError(f"{where}: unknown key {key!r} (expected one of "
                              f"{', '.join(TOP_KEYS)}){hint}")
    out: dict[str, Any] = {"knobs": {}, "bounds": {}, "loader": {}, "study": dict(raw.get("study") or {})}
    for name, value in (raw.get("knobs") or {}).items():
        if name not in KNOB_NAMES:
            raise ConfigError(f"{where}: knobs.{name}: unknown knob (knobs are {', '.join(KNOB_NAMES)})")
        low = KNOB_MIN[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{where}: knobs.{name}: expected an integer >= {low}, got {value!r}")
        out["knobs"][name] = value
    for name, value in (raw.get("bounds") or {}).items():
        if name not in KNOB_NAMES:
            raise ConfigError(f"{where}: bounds.{name}: unknown knob (knobs are {', '.join(KNOB_NAMES)})")
        low = KNOB_MIN[name]
        ok = (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        )
        if not ok:
            raise ConfigError(f"{where}: bounds.{name}: expected [low, high] integers, got {value!r}")
        if value[0] < low:
            raise ConfigError(f"{where}: bounds.{name}: the low bound must be >= {low}, got "
                              f"{value[0]}")
        if value[0] > value[1]:
            raise ConfigError(f"{where}: bounds.{name}: low {value[0]} > high {value[1]}")
        out["bounds"][name] = (int(value[0]), int(value[1]))
    for name, value in out["knobs"].items():
        lo, hi = out["bounds"].get(name, (value, value))
        if not lo <= value <= hi:
            # The Loader clamped it without a word (trial 197); refused, it failed the files
            # tune wrote before December 2026 (a pool_size raised to a batch size above
            # the space's range, review 198): the knob stands and the range takes it in.
            widened = (min(lo, value), max(hi, value))
            log.warning("%s: knobs.%s: %d is outside bounds.%s [%d, %d]: the bounds taken "
                        "are [%d, %d]", where, name, value, name, lo, hi, *widened)
            out["bounds"][name] = widened
    for name, value in (raw.get("loader") or {}).items():
        if name not in LOADER_KEYS:
            raise ConfigError(f"{where}: loader.{name}: unknown setting (expected one of {', '.join(LOADER_KEYS)})")
        out["loader"][name] = value
    batch = out["loader"].get("batch_size")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ConfigError(f"{where}: loader.batch_size: expected a positive integer, got {batch!r}")
    kind = out["loader"].get("worker_kind")
    if kind is not None and kind not in ("process", "thread"):
        raise ConfigError(f"{where}: loader.worker_kind: expected 'process' or 'thread', got {kind!r}")
    for name in ("in_order", "memory_aware"):
        flag = out["loader"].get(name)
        if flag is not None and not isinstance(flag, bool):
            raise ConfigError(f"{where}: loader.{name}: expected true or false, got {flag!r}")
    return out


def save_config(cfg: dict[str, Any], path: str | Path) -> Path:
    """Write ``cfg`` (as returned by :func:`load_config`) to ``path`` (YAML unless ``.json``)."""
    path = Path(path)
    data = {
        "knobs": dict(cfg.get("knobs", {})),
        "bounds": {k: list(v) for k, v in cfg.get("bounds", {}).items()},
        "loader": dict(cfg.get("loader", {})),
        "study": dict(cfg.get("study", {})),
    }
    load_config(data)  # never write a file that cannot be read back
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n")
    else:
        import yaml

        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
