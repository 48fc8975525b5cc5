"""The tuner's pure parts: search-space files, best-trial selection, the output configuration,
import paths and recipes. No loader runs here."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from autominato.config import load_config, save_config
from autominato.tune import parse_size
from autominato.tuning import (
    PipelineSpecError,
    SleepStep,
    SpaceError,
    best_config,
    load_recipe,
    load_space,
    make_pipeline,
    select_best,
)
from autominato.tuning.pipeline import RECIPE_DIR, Pipeline, import_object, is_factory
from autominato.tuning.pruner import MarginMedianPruner
from autominato.tuning.select import has_variation, ranked
from autominato.tuning.space import DEFAULT_SPACE


def write(tmp_path: Path, text: str, name: str = "space.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_default_space_searches_the_three_live_knobs_and_memory_aware_with_cores_resolved():
    space = load_space(cores=6)
    # read_threads: the process workers read inside themselves (trial 138), so no value of
    # it changes the loader measured
    assert set(space.searched) == {"depth", "workers", "pool_size", "memory_aware"}
    assert space.searched["memory_aware"] == CategoricalDistribution([False, True])
    # (0: no worker processes; up to the online controller's own bound, 4 x cores: trial
    # 180's I/O-bound pipeline was held at the cores by the range written as its bounds)
    assert space.searched["workers"] == IntDistribution(1, 24, log=True)
    assert space.searched["pool_size"].log is True
    # Trial 88: a tuned thread kind changed what worker_init_fn and get_worker_info() do and
    # the draws of the global generators, without a word: only a user's space searches it
    assert space.fixed == {"in_order": False, "worker_kind": "process"}  # (batch_size: null)
    assert space.trial["window_batches"] >= 1 and space.pruner["n_startup_trials"] >= 0
    assert space.knob_bounds()["workers"] == (1, 24)
    assert "worker_kind" not in space.knob_bounds()


@pytest.mark.parametrize(("bound", "value"), [("cores", 3), ("2*cores", 6), (" 4 * cores ", 12)])
def test_a_bound_may_be_a_multiple_of_the_cores(tmp_path, bound, value):
    space = load_space(write(tmp_path, f"params:\n  workers: {{type: int, low: 1, high: '{bound}'}}\n"),
                       cores=3)
    assert space.searched["workers"] == IntDistribution(1, value)


def test_user_file_overrides_default_keys_and_keeps_the_rest(tmp_path):
    path = write(
        tmp_path,
        "params:\n  workers: {type: int, low: 2, high: 5}\n  worker_kind: thread\n"
        "  batch_size: {type: int, low: 1, high: 4, step: 1}\ntrial: {window_batches: 7}\n",
    )
    space = load_space(path, cores=2)
    assert space.searched["workers"] == IntDistribution(2, 5)
    assert space.fixed["worker_kind"] == "thread" and "worker_kind" not in space.searched
    assert space.searched["batch_size"] == IntDistribution(1, 4)
    assert space.searched["depth"] == load_space(cores=2).searched["depth"]  # from the default
    assert space.trial["window_batches"] == 7
    assert space.trial["warmup_batches"] == load_space(cores=2).trial["warmup_batches"]
    assert space.with_trial(warmup_batches=1, window_batches=None).trial["warmup_batches"] == 1


def test_suggest_draws_inside_the_ranges_and_adds_fixed_values(tmp_path):
    path = write(tmp_path, "params:\n  in_order: {type: bool}\n  depth: 3\n")
    space = load_space(path, cores=4)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        params = space.suggest(study.ask())
        assert params["depth"] == 3
        assert 1 <= params["workers"] <= 16 and 4 <= params["pool_size"] <= 64
        assert params["in_order"] in (False, True)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("params:\n  wrokers: 2\n", "params.wrokers: unknown parameter"),
        ("params:\n  workers: {type: int, low: 0, high: many}\n", "params.workers.high"),
        ("params:\n  workers: {type: int, low: 0, high: 2*core}\n", "or `N*cores`, got '2*core'"),
        ("params:\n  workers: {type: int, low: 0, high: \"\u0663*cores\"}\n", "or `N*cores`, got"),
        ("params:\n  depth: {type: int, low: 1, high: 0*cores}\n", "params.depth.high: expected an integer >= 1"),
        ("params:\n  workers: {type: int, low: 5, high: 2}\n", "params.workers: low 5 > high 2"),
        ("params:\n  depth: {type: int, low: 0, high: 4}\n", "params.depth.low: expected an integer >= 1"),
        ("params:\n  depth: {type: int, high: 4}\n", "params.depth.low: missing"),
        ("params:\n  depth: {type: float, low: 1, high: 4}\n", "params.depth.type"),
        ("params:\n  depth: {type: int, low: 1, high: 4, lgo: true}\n", "params.depth.lgo"),
        ("params:\n  worker_kind: {type: categorical, choices: [process, fork]}\n",
         "params.worker_kind.choices: expected 'process' or 'thread'"),
        ("params:\n  in_order: yes please\n", "params.in_order: expected true or false"),
        ("params:\n  pool_size: {type: int, low: 0, high: 8, log: true}\n", "params.pool_size.low"),
        ("trial: {window_batches: 0}\n", "trial.window_batches: expected an integer >= 1"),
        ("trial: {windows: 3}\n", "trial.windows: unknown key"),
        ("pruner: {n_startup_trials: -1}\n", "pruner.n_startup_trials"),
        ("pruner: {margin: -0.1}\n", "pruner.margin: expected a number >= 0.0"),
        ("prams: {}\n", "unknown key 'prams'"),
        ("params: [1, 2]\n", "params: expected a mapping"),
        ("params:\n  depth: {type: int\n", "not valid YAML"),
        ("- just\n- a list\n", "top level must be a mapping"),
    ],
)
def test_invalid_space_file_names_the_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(SpaceError) as err:
        load_space(path, cores=2)
    assert key in str(err.value)
    assert str(path) in str(err.value)


def test_space_without_a_default_must_be_complete(tmp_path):
    path = write(tmp_path, "params:\n  depth: 2\n")
    with pytest.raises(SpaceError, match=r"trial\.warmup_batches: missing"):
        load_space(path, base=None)
    with pytest.raises(SpaceError, match="cannot read"):
        load_space(tmp_path / "absent.yaml")


def trial(number, idle, cpu, mem, state=TrialState.COMPLETE, **params):
    params = params or {"workers": number + 1}
    return create_trial(
        state=state,
        value=idle if state == TrialState.COMPLETE else None,
        params=params,
        distributions={k: IntDistribution(0, 64) for k in params},
        user_attrs={"cpu_s_per_sample": cpu, "peak_memory_bytes": mem},
    )


def with_numbers(trials):
    for i, t in enumerate(trials):
        t.number = i
    return trials


def test_select_best_prefers_lowest_idle_outside_the_tolerance():
    ts = with_numbers([trial(0, 0.30, 0.01, 1e9), trial(1, 0.05, 0.09, 9e9), trial(2, 0.20, 0.0, 0)])
    assert select_best(ts).number == 1


def test_select_best_breaks_idle_ties_by_cpu_then_memory():
    ts = with_numbers(
        [
            trial(0, 0.000, 0.050, 1 * 2**30),  # lowest idle, but costly CPU
            trial(1, 0.008, 0.020, 3 * 2**30),  # idle tie, cheap CPU, more memory
            trial(2, 0.009, 0.021, 2 * 2**30),  # idle tie, CPU tie with 1, least memory
            trial(3, 0.050, 0.001, 0),  # cheapest of all but clearly more idle
            trial(4, 0.0, 0.0, 0, state=TrialState.PRUNED),
            trial(5, 0.0, 0.0, 0, state=TrialState.FAIL),
        ]
    )
    assert select_best(ts).number == 2
    assert select_best(ts, idle_tolerance=0.0).number == 0
    assert select_best(ts, cpu_tolerance=0.0).number == 1
    assert [t.number for t in ranked(ts)] == [2, 0, 1, 3]


def test_select_best_turns_memory_aware_dispatch_off_only_for_a_lower_idle_ratio():
    """``memory_aware: false`` spends less CPU (no fresh pages zeroed for each sample), so
    the CPU rule alone would take it at equal idle: it trades peak memory, and the hold of
    large samples apart, for speed, taken only where the idle ratio is lower beyond the
    tolerance."""
    def t(number, idle, cpu, mem, aware):
        return create_trial(
            value=idle, params={"memory_aware": aware},
            distributions={"memory_aware": CategoricalDistribution([False, True])},
            user_attrs={"cpu_s_per_sample": cpu, "peak_memory_bytes": mem})

    tie = with_numbers([t(0, 0.005, 0.010, 3 * 2**30, False),  # cheaper, a tie on idle
                        t(1, 0.010, 0.020, 2 * 2**30, True)])
    assert select_best(tie).number == 1
    faster = with_numbers([t(0, 0.100, 0.010, 3 * 2**30, False),
                           t(1, 0.200, 0.020, 2 * 2**30, True)])
    assert select_best(faster).number == 0
    # where the space does not search it, every trial runs with it on (the Loader's default)
    assert select_best(with_numbers([trial(0, 0.01, 0.02, 0), trial(1, 0.012, 0.01, 0)])
                       ).number == 1


def test_memory_aware_is_searched_for_process_workers_only(tmp_path):
    space = load_space(write(tmp_path, "params:\n  memory_aware: {type: bool}\n"), cores=2)
    assert "memory_aware" in space.searched
    thread = load_space(write(tmp_path, "params:\n  memory_aware: {type: bool}\n"
                                        "  worker_kind: thread\n"), cores=2)
    assert "memory_aware" not in thread.searched  # thread workers are never held back
    both = load_space(write(tmp_path, "params:\n  memory_aware: {type: bool}\n  worker_kind: "
                                      "{type: categorical, choices: [process, thread]}\n"), cores=2)
    assert "memory_aware" in both.searched
    no_workers = load_space(write(tmp_path, "params:\n  memory_aware: {type: bool}\n"
                                            "  workers: 0\n"), cores=2)
    assert "memory_aware" not in no_workers.searched  # loads in the training loop's thread
    fixed = load_space(write(tmp_path, "params:\n  memory_aware: false\n"), cores=2)
    assert fixed.fixed["memory_aware"] is False and "memory_aware" not in fixed.searched
    with pytest.raises(SpaceError, match=r"params\.memory_aware: expected true or false"):
        load_space(write(tmp_path, "params:\n  memory_aware: sometimes\n"), cores=2)
    with pytest.raises(SpaceError, match="bool applies to in_order and memory_aware only"):
        load_space(write(tmp_path, "params:\n  depth: {type: bool}\n"), cores=2)
    with pytest.raises(SpaceError, match=r"memory_aware is not an integer; use \{type: bool\}"):
        load_space(write(tmp_path, "params:\n  memory_aware: {type: int, low: 0, high: 1}\n"),
                   cores=2)


def test_select_best_without_completed_trials_is_none():
    assert select_best([trial(0, 0.0, 0, 0, state=TrialState.FAIL)]) is None
    assert select_best([]) is None


def test_importance_is_defined_only_with_two_differing_trials():
    study = optuna.create_study()
    study.add_trial(trial(0, 0.5, 0, 0, workers=1))
    assert not has_variation(study)
    study.add_trial(trial(1, 0.5, 0, 0, workers=2))
    assert not has_variation(study)  # same value: nothing to attribute
    study.add_trial(trial(2, 0.1, 0, 0, workers=3))
    assert has_variation(study)


@pytest.mark.parametrize("params, searched", [
    ("", False),  # process workers, at least one: they read
    ("  worker_kind: thread\n", True),  # a read stage of threads
    # 0: loads in the training loop's thread, no read threads either (trial 146)
    ("  workers: {type: int, low: 0, high: 2}\n", False),
    ("  worker_kind: {type: categorical, choices: [process, thread]}\n", True),
    ("  workers: 0\n", False),
    ("  workers: 2\n", False),
])
def test_read_threads_are_searched_only_where_a_read_stage_of_threads_runs(tmp_path, params,
                                                                           searched):
    space = load_space(write(tmp_path, "params:\n" + params), cores=4)
    assert ("read_threads" in space.searched) is searched
    assert ("read_threads" in space.knob_bounds()) is searched
    # a pipeline whose loader reads in threads (fuse_read=False) searches it again
    assert "read_threads" in space.with_dropped().searched


def test_best_config_round_trips_and_bounds_are_the_search_ranges(tmp_path):
    space = load_space(write(tmp_path, "params:\n  worker_kind: thread\n"), cores=4)
    best = create_trial(
        value=0.01,
        params={"depth": 3, "read_threads": 2, "workers": 4, "pool_size": 12},
        distributions={k: space.searched[k] for k in ("depth", "read_threads", "workers", "pool_size")},
        user_attrs={"knobs": {"depth": 3, "read_threads": 2, "workers": 4, "pool_size": 12}},
    )
    pipeline = Pipeline([0], None, 2, SleepStep(0.1), {"dataset": "x:y"})
    cfg = best_config(best, space, pipeline, {"name": "s", "idle_ratio": 0.01})
    path = save_config(cfg, tmp_path / "loader.yaml")
    back = load_config(path)
    assert back["knobs"] == {"depth": 3, "read_threads": 2, "workers": 4, "pool_size": 12}
    assert back["bounds"] == {"depth": (1, 8), "read_threads": (1, 4), "workers": (1, 16), "pool_size": (4, 64)}
    assert back["loader"] == {"worker_kind": "thread", "in_order": False, "batch_size": 2}
    assert back["study"]["idle_ratio"] == 0.01
    json_back = load_config(save_config(cfg, tmp_path / "loader.json"))
    assert json_back == back


def test_simulated_step_scales_with_a_searched_batch_size():
    pipeline = Pipeline([0], None, 2, SleepStep(0.1), {})
    assert pipeline.step_for(2).seconds == pytest.approx(0.1)
    assert pipeline.step_for(6).seconds == pytest.approx(0.3)


def test_study_name_is_stable_and_depends_on_the_pipeline():
    a = Pipeline([0], None, 2, SleepStep(0.1), {"dataset": "pkg.mod:make", "step": "sleep 0.1 s"})
    b = Pipeline([0], None, 2, SleepStep(0.1), {"dataset": "pkg.mod:make", "step": "sleep 0.2 s"})
    assert a.study_name() == Pipeline([1], None, 2, SleepStep(0.1), dict(a.identity)).study_name()
    assert a.study_name() != b.study_name()
    assert a.study_name().startswith("make-b2-")


def make_list_dataset(data=None, n=5):
    return list(range(n if data is None else int(data)))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'module:attribute'"),
        ("surely_not_a_module_xyz:f", "cannot import 'surely_not_a_module_xyz'"),
        (f"{__name__}:no_such_attr", "has no 'no_such_attr'"),
    ],
)
def test_bad_import_path_is_a_clear_error(spec, message):
    with pytest.raises(PipelineSpecError, match=message):
        import_object(spec, "--dataset")


def test_make_pipeline_calls_the_factory_with_data_and_requires_a_step():
    p = make_pipeline(dataset=f"{__name__}:make_list_dataset", data="7", step_time=0.01)
    assert p.dataset == list(range(7)) and isinstance(p.step, SleepStep) and p.batch_size == 1
    with pytest.raises(PipelineSpecError, match="--step-time"):
        make_pipeline(dataset=f"{__name__}:make_list_dataset")
    with pytest.raises(PipelineSpecError, match="--dataset module:factory or --recipe"):
        make_pipeline(step_time=0.1)


def plain_transform(sample, rng=None):
    return sample


def transform_factory(scale: float = 2.0):
    return lambda sample, rng: sample * scale


def test_a_transform_without_required_arguments_is_a_factory_and_is_called():
    assert not is_factory(plain_transform) and is_factory(transform_factory)
    assert is_factory(dict) and not is_factory(print)
    p = make_pipeline(
        dataset=f"{__name__}:make_list_dataset", transform=f"{__name__}:transform_factory", step_time=0
    )
    assert p.transform(3, None) == 6.0
    p = make_pipeline(
        dataset=f"{__name__}:make_list_dataset", transform=f"{__name__}:plain_transform", step_time=0
    )
    assert p.transform is plain_transform


def test_recipes_in_tuner_are_valid_and_unknown_ones_are_named(tmp_path):
    recipes = sorted(RECIPE_DIR.glob("*.yaml"))
    assert recipes, "tuner/recipes/ holds at least the kits19 recipe"
    for path in recipes:
        assert load_recipe(path.stem)["dataset"]
    with pytest.raises(PipelineSpecError, match="recipe 'nope'.*kits19"):
        load_recipe("nope")
    bad = write(tmp_path, "dataset: a:b\nstep_tiem: 1\n", "r.yaml")
    with pytest.raises(PipelineSpecError, match="unknown key 'step_tiem'"):
        load_recipe(str(bad))
    with pytest.raises(PipelineSpecError, match="needs --data"):
        make_pipeline(recipe="kits19")


def test_default_space_file_is_in_the_tuner_folder():
    assert DEFAULT_SPACE.parent.name == "tuner" and DEFAULT_SPACE.is_file()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("16GiB", 16 * 2**30), ("512M", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1000", 1000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_nonsense():
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size("lots")
    assert math.isclose(parse_size("0.5k"), 512)


def test_categorical_knob_bounds_span_the_choices(tmp_path):
    path = write(tmp_path, "params:\n  depth: {type: categorical, choices: [2, 8, 4]}\n")
    space = load_space(path, cores=2)
    assert space.searched["depth"] == CategoricalDistribution([2, 8, 4])
    assert space.knob_bounds()["depth"] == (2, 8)


def with_reports(values: dict[int, float], final: float = 1.0):
    return create_trial(value=final, intermediate_values=values, params={}, distributions={})


def test_pruner_stops_only_trials_worse_than_the_median_by_more_than_the_margin():
    pruner = MarginMedianPruner(n_startup_trials=3, n_warmup_steps=1, margin=0.02)
    study = optuna.create_study()
    for idle in (0.00, 0.01, 0.40):
        study.add_trial(with_reports({4: idle, 8: idle}, final=idle))
    # median at step 8 is 0.01
    assert not pruner.prune(study, with_reports({4: 0.9, 8: 0.025}))  # noise-level: kept
    assert pruner.prune(study, with_reports({4: 0.9, 8: 0.2}))
    assert not pruner.prune(study, with_reports({4: 0.9}))  # its first report: warm-up
    assert not pruner.prune(study, with_reports({4: 0.9, 12: 0.9}))  # no one reported at 12
    assert not MarginMedianPruner(n_startup_trials=4).prune(study, with_reports({4: 0.9, 8: 0.9}))
    with pytest.raises(ValueError, match="margin"):
        MarginMedianPruner(margin=-1)


def test_an_edited_space_names_another_study_and_the_same_space_the_same(tmp_path):
    # a rerun with an edited --space resumed the old study: its best (depth 5) was written
    # beside the new space's bounds (depth 1-4)
    from autominato.tuning.study import default_study_name

    p = Pipeline([1], None, 2, SleepStep(0.1), {"dataset": "m:make"})
    a, b = load_space(None), load_space(None)
    assert default_study_name(p, a) == default_study_name(p, b)
    assert default_study_name(p, a).startswith(p.study_name() + "-s")
    longer = a.with_trial(window_batches=a.trial["window_batches"] + 1)
    assert default_study_name(p, longer) != default_study_name(p, a)
    edited = tmp_path / "space.yaml"
    edited.write_text("params:\n  depth: {type: int, low: 1, high: 4}\n")
    assert default_study_name(p, load_space(edited)) != default_study_name(p, a)


def test_a_study_whose_loader_reads_in_threads_searches_read_threads(tmp_path, monkeypatch):
    """run_study puts read_threads back in the search for a pipeline whose loader reads in a
    stage of threads (``fuse_read=False``; review 140: the space dropped it there too)."""
    from autominato.tuning import study

    seen = []

    class Seen(Exception):
        pass

    def name(pipeline, space):
        seen.append(set(space.searched))
        raise Seen

    monkeypatch.setattr(study, "default_study_name", name)
    space = load_space(cores=4)
    for kwargs in ({}, {"fuse_read": False}):
        pipeline = Pipeline([0], None, 2, SleepStep(0.1), {"dataset": "x:y"}, loader_kwargs=kwargs)
        with pytest.raises(Seen):
            study.run_study(pipeline, space, n_trials=1, out_dir=tmp_path, progress=False)
    assert ["read_threads" in s for s in seen] == [False, True]


def test_a_knob_the_loader_ran_outside_the_searched_range_widens_the_bounds_written(tmp_path):
    """Trial 197: a pool_size range [1, 2] at batch 4 ran at 4 (the Loader holds a batch's
    samples at least) and the file said pool_size 4 with bounds [1, 2]."""
    space = load_space(write(tmp_path, "params:\n  pool_size: {type: int, low: 1, high: 2}\n"),
                       cores=2)
    best = create_trial(
        value=0.01, params={"pool_size": 2}, distributions={"pool_size": space.searched["pool_size"]},
        user_attrs={"knobs": {"depth": 2, "read_threads": 2, "workers": 2, "pool_size": 4}},
    )
    pipeline = Pipeline([0], None, 4, SleepStep(0.1), {"dataset": "x:y"})
    back = load_config(save_config(best_config(best, space, pipeline, {}), tmp_path / "l.yaml"))
    assert back["knobs"]["pool_size"] == 4 and back["bounds"]["pool_size"] == (1, 4)


@pytest.mark.parametrize("knobs, bounds, said", [
    ({"depth": 0}, {}, "knobs.depth: expected an integer >= 1, got 0"),
    ({"pool_size": 0}, {}, "knobs.pool_size: expected an integer >= 1, got 0"),
    ({}, {"depth": [0, 8]}, "bounds.depth: the low bound must be >= 1, got 0"),
    ({}, {"pool_size": [-4, 64]}, "bounds.pool_size: the low bound must be >= 1, got -4"),
    ({}, {"pool_size": [9, 8]}, "bounds.pool_size: low 9 > high 8"),
])
def test_a_configurations_knob_or_bound_below_its_least_value_is_refused(knobs, bounds, said):
    """Trial 197: depth 0 loaded as 1 without a word, where prefetch_factor=0 is refused;
    trial 199: a bound of 0 was taken for depth, and a negative one named the wrong fault."""
    from autominato.config import ConfigError

    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
        load_config({"knobs": knobs, "bounds": bounds})
    assert load_config({"knobs": {"workers": 0}})["knobs"] == {"workers": 0}


def test_a_knob_outside_its_files_bounds_stands_and_the_bounds_take_it_in(caplog):
    """Trial 197: depth 9 with bounds [1, 8] loaded as 8 without a word. Review 198: refused,
    it failed the files tune wrote before (pool_size raised to a batch size of 128 above the
    space's [4, 64]); the knob stands, the range takes it in, and a warning says so."""
    import logging

    caplog.set_level(logging.WARNING, "autominato.config")
    old = load_config({"knobs": {"pool_size": 128, "depth": 2},
                       "bounds": {"pool_size": [4, 64], "depth": [1, 8]}})
    assert old["knobs"]["pool_size"] == 128 and old["bounds"]["pool_size"] == (4, 128)
    assert "knobs.pool_size: 128 is outside bounds.pool_size [4, 64]: the bounds taken are " \
        "[4, 128]" in caplog.text
