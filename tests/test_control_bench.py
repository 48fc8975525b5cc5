"""``autominato bench controller``: its figures, and a small end-to-end run."""

from __future__ import annotations

import argparse
import csv

import numpy as np
import pytest

from autominato.bench import controller as bench


def make_run(arm, t, wait, samples=4, step_s=0.1):
    r = bench.Run(arm, "w", {"workers": 1})
    r.t = np.asarray(t, dtype=float)
    r.wait_s = np.asarray(wait, dtype=float)
    r.samples = np.full(len(r.t), samples)
    r.step_s = step_s
    return r


def test_run_figures():
    # 10 batches of 4 samples, one every 0.2 s: 20 samples/s; waits 0.1 s of each 0.2 s.
    r = make_run("controller", np.arange(1, 11) * 0.2, [0.1] * 10)
    assert r.seconds == pytest.approx(2.0)
    assert r.throughput() == pytest.approx(20.0)
    assert r.throughput(5) == pytest.approx(20.0)
    assert r.idle() == pytest.approx(0.5)
    t, rates = r.rolling(window_s=1.0)
    assert rates[-1] == pytest.approx(20.0)
    assert r.time_to(19.0, window_s=1.0) == pytest.approx(1.0)
    assert r.time_to(25.0, window_s=1.0) is None


def test_summary_compares_the_controller_with_the_static_arm():
    static = make_run("best static", np.arange(1, 21) * 0.1, [0.0] * 20)  # 40 samples/s
    # Two slow batches (10 samples/s for 0.8 s), then 40 batches as fast as the static arm.
    t = np.concatenate([[0.4, 0.8], 0.8 + np.arange(1, 41) * 0.1])
    ctl = make_run("controller", t, [0.3, 0.3] + [0.0] * 40)
    rows = {r["arm"]: r for r in bench.summarise([static, ctl])}
    assert "final_ratio" not in rows["best static"]
    assert rows["controller"]["final_ratio"] == pytest.approx(1.0)
    assert rows["controller"]["overall_ratio"] == pytest.approx((42 * 4 / 4.8) / 40)
    # The 2 s rolling window first holds only fast batches at 2.8 s: 40 samples/s >= 36.
    assert 2.75 < rows["controller"]["time_to_90pct_s"] < 2.95  # 2.8 or 2.9 by rounding


def test_bench_runs_end_to_end_and_writes_its_series(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--samples", "96", "--probe-samples", "48", "--cost-ms", "4", "--step-ms", "8",
            "--grid-workers", "1", "2", "--grid-depth", "1", "--interval", "0.05",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "best static: {'workers': " in out
    table = [line.split() for line in out.splitlines()]
    for name in ("stationary", "shifting"):
        assert [name, "controller"] in [row[:2] for row in table]
        assert [name, "best", "static"] in [row[:3] for row in table]
    with (tmp_path / "controller_bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    arms = {(r["workload"], r["arm"]) for r in rows}
    assert arms == {
        (w, a) for w in ("stationary", "shifting") for a in ("controller", "best static")
    }
    for w in ("stationary", "shifting"):
        for a in ("controller", "best static"):
            n = sum(int(r["samples"]) for r in rows if r["workload"] == w and r["arm"] == a)
            assert n == 96
