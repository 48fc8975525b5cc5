"""Offline search of loader settings (``autominato tune``): the library behind the command.

::

    space.py     the YAML search space (tuner/default.yaml) -> Optuna distributions
    pipeline.py  the user's dataset / transform / step from import paths or a recipe
    measure.py   one trial: warm-up, measured window, idle ratio, CPU seconds, memory
    select.py    the best trial: lowest idle ratio, ties by CPU seconds then memory
    pruner.py    the median stopping rule with a noise margin
    steps.py     --model factories of the shared 3D-UNet step (autominato.models.step)
    study.py     the Optuna study (SQLite, pruning, failures) and the output config
    report.py    per-trial lines, the final table, the PNG plots

Example::

    from autominato.tuning import load_space, make_pipeline, run_study

    pipeline = make_pipeline(dataset="mypkg.data:make_dataset", transform="mypkg.aug:augment",
                             batch_size=2, step_time=0.3)
    result = run_study(pipeline, load_space(), n_trials=20, out_dir="runs/tune/mine")
    print(result.best.params, result.config_path)   # Loader(config=result.config_path)
"""

from autominato.models.step import SleepStep
from autominato.tuning.measure import Measurement, MemoryBudgetExceeded, NoBatches, measure
from autominato.tuning.pipeline import Pipeline, PipelineSpecError, load_recipe, make_pipeline
from autominato.tuning.select import select_best
from autominato.tuning.space import SearchSpace, SpaceError, load_space
from autominato.tuning.study import (
    PipelineFailed,
    TrialFailed,
    TuneResult,
    best_config,
    measure_config,
    run_study,
)

__all__ = [
    "Measurement",
    "MemoryBudgetExceeded",
    "NoBatches",
    "Pipeline",
    "PipelineFailed",
    "PipelineSpecError",
    "SearchSpace",
    "SleepStep",
    "SpaceError",
    "TrialFailed",
    "TuneResult",
    "best_config",
    "load_recipe",
    "load_space",
    "make_pipeline",
    "measure",
    "measure_config",
    "run_study",
    "select_best",
]
