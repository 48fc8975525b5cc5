"""The `autominato` command line: no abbreviated options, one exit-status convention."""

from __future__ import annotations

import pytest

from autominato import cli
from autominato.bench.kits19 import kits19_workload, write_demo_masks


def parse(*argv: str):
    return cli.build_parser(list(argv)).parse_args(list(argv))


def test_bench_controller_cost_cpu_parses():
    args = parse("bench", "controller", "--cost", "cpu")
    assert args.bench_suite == "controller" and args.cost == "cpu"


def test_an_abbreviated_option_is_refused_not_guessed(capsys):
    with pytest.raises(SystemExit) as e:
        parse("bench", "--cost-m", "5")  # --cost-ms abbreviated: an unknown option now
    assert e.value.code == cli.EXIT_USAGE
    assert "error:" in capsys.readouterr().err  # not taken as --cost-ms


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--data", "{missing}", "--steps", "1", "--no-progress"],
        ["prepare", "kits19", "{missing}", "{tmp}/out", "--no-progress"],
    ],
    ids=["run", "prepare"],
)
def test_a_missing_input_folder_exits_2_in_every_command(argv, tmp_path, capsys):
    argv = [a.format(missing=tmp_path / "nowhere", tmp=tmp_path) for a in argv]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "nowhere" in capsys.readouterr().err


def test_kits19_without_data_or_labels_uses_a_few_demo_cases_and_says_so(tmp_path):
    logged: list[str] = []
    wl = kits19_workload(cases=2, scale=0.25, step_s=0.0, cache=tmp_path, log=logged.append)
    assert len(wl) == 2
    assert "no --data and no --labels: 2 generated DEMO cases" in logged[0]


def test_kits19_from_labels_says_how_many_cases_it_prepares_before_it_starts(tmp_path):
    labels = write_demo_masks(tmp_path / "labels", 3)
    logged: list[str] = []
    kits19_workload(labels=labels, cases=1, scale=0.25, step_s=0.0, cache=tmp_path / "c",
                    log=logged.append)
    assert logged[0].startswith("kits19: preparing 1 of the 3 cases in")
    # the second time, from the cache: said so, not "preparing" (trial 189)
    logged.clear()
    kits19_workload(labels=labels, cases=1, scale=0.25, step_s=0.0, cache=tmp_path / "c",
                    log=logged.append)
    assert logged[0].startswith("kits19: 1 of the 3 cases in") and "prepared before" in logged[0]


def test_a_grid_of_fewer_than_two_levels_is_refused_before_the_study_runs(capsys):
    """``--grid-levels 1`` used to be found out only after every trial had run."""
    with pytest.raises(SystemExit) as e:
        parse("tune", "--compare-grid", "--grid-levels", "1")
    assert e.value.code == cli.EXIT_USAGE
    assert "--grid-levels" in capsys.readouterr().err


def test_shared_argument_types_refuse_bad_values_with_exit_status_2(capsys):
    import argparse

    from autominato.cli import int_at_least, port, seconds

    assert int_at_least(2)("3") == 3 and port("0") == 0 and seconds("0.5") == 0.5
    for fn, text in ((int_at_least(1), "0"), (int_at_least(1), "x"), (port, "65536"),
                     (seconds, "-1"), (seconds, "inf"), (seconds, "nan")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)
    from autominato.cli import main

    for argv in (["run", "--metrics-port", "99999"], ["run", "--steps", "0"],
                 ["tune", "--dataset", "m:f", "--step-time", "-1"],
                 ["tune", "--dataset", "m:f", "--grid-levels", "1"],
                 ["tune", "--dataset", "m:f", "--warmup", "-1"],  # (trial 197: blamed the
                 ["tune", "--dataset", "m:f", "--warmup", "abc"]):  # space file)
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert f"argument {argv[-2]}" in capsys.readouterr().err, argv
