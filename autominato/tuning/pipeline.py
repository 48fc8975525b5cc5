"""The user's pipeline as a trial builds it: dataset, transform, batch size and training step.

A pipeline comes from import paths (``--dataset module:factory``, ``--transform
module:callable``, ``--model module:factory``) or from a recipe, a YAML file under
``tuner/recipes/`` that names the same import paths (``--recipe kits19`` reads
``tuner/recipes/kits19.yaml``)::

    dataset: autominato.data.kits19:KiTS19Dataset   # called as factory(DIR) when --data DIR
    dataset_kwargs: {cases: [0, 1, 2]}              # extra keyword arguments of the factory
    transform: autominato.data.transforms:mlperf_train_transform
    transform_kwargs: {patch: 128}                  # a factory: called with these
    batch_size: 2
    step_time: 0.3                                  # seconds per batch, simulated
    needs_data: true

Command-line values override the recipe's.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autominato.models.step import SleepStep, Step
from autominato.pipeline.knobs import KNOB_NAMES
from autominato.tuning.space import TUNER_DIR

RECIPE_DIR = TUNER_DIR / "recipes"
RECIPE_KEYS = (
    "description",
    "dataset",
    "dataset_kwargs",
    "transform",
    "transform_kwargs",
    "batch_size",
    "step_time",
    "needs_data",
)


class PipelineSpecError(ValueError):
    """An import path, a recipe or a combination of options does not describe a pipeline."""


def import_object(spec: str, what: str) -> Any:
    """Import ``module:attribute`` (``attribute`` may be dotted).

    The current directory is importable, as with ``python -m``, so a user's own module next to
    the command works.

    Raises:
        PipelineSpecError: malformed spec, module not found, or no such attribute.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineSpecError(f"{what} {spec!r}: expected 'module:attribute'")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise PipelineSpecError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PipelineSpecError(f"{what} {spec!r}: {module_name!r} has no {attr!r}") from None
    return obj


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """Read a recipe by name (``tuner/recipes/NAME.yaml``) or path.

    Raises:
        PipelineSpecError: no such recipe, invalid YAML, or an unknown key (named).
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = RECIPE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")) if RECIPE_DIR.is_dir() else []
        raise PipelineSpecError(
            f"recipe {name_or_path!r}: no file {path} (recipes: {', '.join(known) or 'none'})"
        )
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise PipelineSpecError(f"{path}: cannot read recipe: {e}") from e
    if not isinstance(raw, dict):
        raise PipelineSpecError(f"{path}: top level must be a mapping")
    for key in raw:
        if key not in RECIPE_KEYS:
            raise PipelineSpecError(
                f"{path}: unknown key {key!r} (expected one of {', '.join(RECIPE_KEYS)})"
            )
    if "dataset" not in raw:
        raise PipelineSpecError(f"{path}: dataset: missing")
    raw["name"] = path.stem
    return raw


def is_factory(obj: Any) -> bool:
    """Whether ``obj`` builds a transform rather than being one: a class, or a callable with
    no required argument (a transform takes at least the sample)."""
    if isinstance(obj, type):
        return True
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: take it as a transform
        return False
    required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    varargs = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
    return not varargs and not any(p.kind in required and p.default is p.empty for p in params)


@dataclass
class Pipeline:
    """Everything a trial needs besides the searched parameters.

    Attributes:
        dataset: a map-style dataset (``__len__``, ``__getitem__``).
        transform: ``transform(sample, rng)`` or ``transform(sample)``; ``None`` for none.
        batch_size: samples per batch when the space does not search ``batch_size``.
        step: the training step; a :class:`SleepStep` scales with a searched batch size.
        identity: what defines the objective (import paths, data, batch size, step): two runs
            with equal identities may share a study.
        loader_kwargs: further ``Loader`` arguments (``device``, ``seed``, ...).
        step_note: how the step was chosen, printed by ``autominato tune`` (a recipe's
            placeholder step time says so).
    """

    dataset: Any
    transform: Callable[..., Any] | None
    batch_size: int
    step: Step
    identity: dict[str, Any]
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    step_note: str = ""

    def step_for(self, batch_size: int) -> Step:
        """The step for batches of ``batch_size`` samples (a simulated step scales linearly)."""
        if isinstance(self.step, SleepStep) and batch_size != self.batch_size:
            return SleepStep(self.step.seconds * batch_size / self.batch_size)
        return self.step

    def study_name(self) -> str:
        """A readable, stable name for the study of this pipeline (slug + short hash)."""
        blob = json.dumps(self.identity, sort_keys=True, default=str)
        digest = hashlib.sha1(blob.encode()).hexdigest()[:8]
        label = self.identity.get("recipe") or self.identity.get("dataset") or "pipeline"
        slug = re.sub(r"[^A-Za-z0-9]+", "-", str(label).rsplit(":", 1)[-1]).strip("-").lower()
        return f"{slug or 'pipeline'}-b{self.batch_size}-{digest}"

    def build_loader(self, params: dict[str, Any]) -> Any:
        """An ``autominato.Loader`` for one configuration, controller off (the trial holds it).

        ``params`` holds knob values and the static settings ``worker_kind``, ``in_order``,
        ``memory_aware``, ``batch_size``; absent ones keep the Loader's defaults. A map-style dataset is
        shuffled with a fixed seed so that every trial sees the same sample order.
        """
        from autominato import Loader
        from autominato.loader import is_iterable_dataset

        # (an iterable dataset, the Loader's kind of one, takes no shuffle: trial 146 got the
        # Loader's ValueError for an argument the user never gave; review 150: a duck-typed one)
        shuffle = not is_iterable_dataset(self.dataset)
        kwargs: dict[str, Any] = {"shuffle": shuffle, "seed": 0, **self.loader_kwargs}
        kwargs.update({k: params[k] for k in ("worker_kind", "in_order", "memory_aware")
                       if k in params})
        kwargs.update({k: int(params[k]) for k in KNOB_NAMES if k in params})
        return Loader(
            self.dataset,
            int(params.get("batch_size", self.batch_size)),
            transform=self.transform,
            autotune=False,
            **kwargs,
        )


def make_pipeline(
    *,
    dataset: str | None = None,
    transform: str | None = None,
    recipe: str | None = None,
    data: str | None = None,
    batch_size: int | None = None,
    step_time: float | None = None,
    model: str | None = None,
    device: str | None = None,
) -> Pipeline:
    """Resolve command-line style specifications into a :class:`Pipeline`.

    The dataset is ``factory(data, **dataset_kwargs)`` when ``data`` is given, else
    ``factory(**dataset_kwargs)``; an attribute that already is a dataset (has ``__len__``
    and is not a class) is used as is. A transform attribute that is a factory
    (:func:`is_factory`), or a recipe transform with ``transform_kwargs``, is called (with
    them) to build the transform. ``model`` names a
    factory called with no arguments that returns ``step(batch)``.

    Raises:
        PipelineSpecError: neither ``dataset`` nor ``recipe``; a recipe that needs ``data``
            without it; neither ``step_time`` nor ``model`` (nor a recipe step time); a
            factory that raised.
    """
    rec: dict[str, Any] = load_recipe(recipe) if recipe else {}
    dataset = dataset or rec.get("dataset")
    if not dataset:
        raise PipelineSpecError("no pipeline: give --dataset module:factory or --recipe NAME")
    if rec.get("needs_data") and not data:
        raise PipelineSpecError(f"recipe {rec['name']!r} needs --data DIR (its prepared dataset)")
    transform = transform or rec.get("transform")
    batch_size = batch_size or rec.get("batch_size") or 1
    note = f"--model {model}" if model else f"--step-time {step_time}"
    if step_time is None and model is None:
        step_time = rec.get("step_time")
        note = (f"recipe {rec.get('name')!r}'s PLACEHOLDER step_time {step_time} s, not a "
                "measurement of your model: time one step on your accelerator and pass "
                "--step-time, or --model for a real step")
    if step_time is None and model is None:
        raise PipelineSpecError(
            "no training step: give --step-time SECONDS or --model module:factory"
        )

    ds_obj = import_object(dataset, "--dataset")
    ds_args = [data] if data else []
    if isinstance(ds_obj, type) or not hasattr(ds_obj, "__len__"):
        try:
            ds_obj = ds_obj(*ds_args, **(rec.get("dataset_kwargs") or {}))
        except Exception as e:
            raise PipelineSpecError(
                f"--dataset {dataset!r}: building the dataset failed: {e}"
            ) from e
    tf_obj = import_object(transform, "--transform") if transform else None
    if tf_obj is not None and (is_factory(tf_obj) or rec.get("transform_kwargs")):
        try:
            tf_obj = tf_obj(**(rec.get("transform_kwargs") or {}))
        except Exception as e:
            raise PipelineSpecError(f"--transform {transform!r}: building it failed: {e}") from e
    if model is not None:
        try:
            step = import_object(model, "--model")()
        except PipelineSpecError:
            raise
        except Exception as e:
            raise PipelineSpecError(f"--model {model!r}: building the step failed: {e}") from e
        if not callable(step):
            raise PipelineSpecError(f"--model {model!r}: the factory must return step(batch)")
    else:
        step = SleepStep(float(step_time))
    identity = {
        "recipe": rec.get("name"),
        "dataset": dataset,
        "transform": transform,
        "data": str(Path(data).resolve()) if data else None,
        "batch_size": batch_size,
        "step": model or f"sleep {step_time:g} s",
    }
    return Pipeline(
        dataset=ds_obj,
        transform=tf_obj,
        batch_size=int(batch_size),
        step=step,
        identity=identity,
        loader_kwargs={"device": device} if device else {},
        step_note=note,
    )
