"""Every dashboard query returns series from a real Prometheus that scraped a running Loader.

A real ``autominato.Loader`` serves its metrics (``metrics_port``); Debian's ``prometheus``
(``tests/prometheus_server.py``, 1 s scrape interval) scrapes it while a short training loop
runs. Each panel's PromQL, with ``$__rate_interval`` / ``$__range`` / ``$job`` / ``$rank`` /
``$gpu`` substituted the way Grafana substitutes them, must return at least one series.

Exempt, by name: the three panels of the GPU row ("GPU utilisation", "GPU memory used",
"PCIe bandwidth"). They read only NVML (``autominato_gpu_*``) and DCGM exporter
(``DCGM_FI_*``) metrics, which exist only on a host with an NVIDIA GPU; this machine has none.
Also exempt, only while the loader made no host-to-device copy (there is no CUDA device here):
the exporter's bandwidth gauge, query A of "Host-to-device bandwidth". The telemetry leaves that
gauge out until the first copy, because a bandwidth of no copies is undefined; query B of the
same panel (bytes / copy seconds from counters) is checked.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("grafana_foundation_sdk")

from prometheus_server import PrometheusServer, free_port, require_prometheus  # noqa: E402

from autominato import Loader, cli  # noqa: E402
from autominato.telemetry import dashboard as dash  # noqa: E402

#: Panels that read only NVML / DCGM metrics: no series without an NVIDIA GPU.
GPU_PANELS = {"GPU utilisation", "GPU memory used", "PCIe bandwidth"}

#: Seconds of training while Prometheus scrapes every second: enough scrapes for rate().
TRAIN_SECONDS = 6.0


class Volumes:
    """Small float32 volumes ``(1, 8, 16, 16)`` with an int64 label, made in memory."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return np.full((1, 8, 16, 16), float(i), np.float32), np.int64(i % 3)


def flip(sample: tuple[np.ndarray, np.int64], rng: np.random.Generator) -> tuple:
    volume, label = sample
    time.sleep(0.002)  # a transform that takes time, so stage timings are not all ~0
    return (volume[:, ::-1].copy() if rng.random() < 0.5 else volume), label


@pytest.fixture(scope="module")
def scraped():
    """``(prometheus, start, end)`` after a loader trained ~6 s and changed one knob."""
    require_prometheus()
    port = free_port()
    # autotune=False: the test makes one decision itself, so the run is the same every time.
    loader = Loader(
        Volumes(), batch_size=4, shuffle=True, transform=flip, seed=0,
        metrics_port=port, autotune=False, workers=1,  # (processes: the loader CPU panel)
    )
    try:
        with PrometheusServer([f"127.0.0.1:{port}"]) as prom:
            start = time.time()
            prom.wait_for('autominato_knob_value{knob="workers"} == 1', timeout=30)
            t0, epoch, decided = time.monotonic(), 0, False
            while time.monotonic() - t0 < TRAIN_SECONDS:
                loader.set_epoch(epoch)
                for _ in loader:
                    time.sleep(0.005)  # the training step
                epoch += 1
                if not decided and time.monotonic() - t0 > TRAIN_SECONDS / 2:
                    # What the controller does on a decision: turn the knob, then report it.
                    new = loader.knobs.set("workers", 2)
                    loader.report_decision(
                        SimpleNamespace(
                            knob="workers", old=1, new=new, reason="transform_bound",
                            detail="test decision",
                        )
                    )
                    decided = True
            prom.wait_for('autominato_knob_value{knob="workers"} == 2', timeout=20)
            prom.wait_for("autominato_controller_decisions_total", timeout=20)
            # Two more scrapes after the last batch, so the final samples are in.
            time.sleep(2.5)
            yield prom, start, time.time()
    finally:
        loader.close()


def _check(prom, start, end, model=None):
    return dash.check_series(
        model or dash.build_dashboard(), dash.PrometheusAPI(prom.url),
        start=start, end=end, step_s=1.0, scrape_interval_s=1.0,
    )


def _no_h2d_copies(prom) -> bool:
    return all(float(s["value"][1]) == 0 for s in prom.query("autominato_h2d_bytes_total"))


def by(results, target):
    return next(r for r in results if (r.target.panel, r.target.ref_id) == target)


def test_every_panel_query_returns_series_from_a_scraped_loader(scraped):
    prom, start, end = scraped
    assert GPU_PANELS == set(dash.gpu_panel_titles())
    results = _check(prom, start, end)
    assert len(results) == len(dash.dashboard_targets(dash.build_dashboard()))
    # Without a device the copy figures are no data (the gauge absent, the rates and quantiles
    # NaN: trial 168, they counted as data); the loader reads in its worker processes, so the
    # read threads' CPU has no series.
    exempt_targets = set(dash.READ_THREAD_TARGETS)
    if _no_h2d_copies(prom):
        exempt_targets |= dash.DEVICE_TARGETS
        assert all(by(results, t).series == 0 for t in dash.DEVICE_TARGETS)
    assert all(by(results, t).series == 0 for t in dash.READ_THREAD_TARGETS)
    empty = [
        f"{r.target.panel} [{r.target.ref_id}]: {r.query}"
        for r in results
        if r.series == 0
        and r.target.panel not in GPU_PANELS
        and (r.target.panel, r.target.ref_id) not in exempt_targets
    ]
    assert empty == []
    checked = [r for r in results if r.target.panel not in GPU_PANELS]
    assert len(checked) >= 25  # the exemptions leave almost every query checked
    # Variables resolve as a user's first look would: the scrape job, rank 0, no GPU label.
    chosen = dash.resolve_variables(dash.build_dashboard(), dash.PrometheusAPI(prom.url), start, end)
    assert (chosen["job"], chosen["rank"]) == ("autominato", "0")
    by_panel = {(r.target.panel, r.target.ref_id): r for r in results}
    # The per-stage panels see the stages that ran (read, transform, batch at least).
    assert by_panel[("Stage throughput", "A")].series >= 3
    assert by_panel[("Knob values", "A")].series == 4  # one series per knob
    # The knob change appears as an annotation.
    assert by_panel[("annotation: Knob changes", "")].series >= 1


@pytest.mark.parametrize(
    ("metric", "panel"),
    [
        ("autominato_stage_queue_items", "Queue fill"),  # gauge
        ("autominato_samples_total", "Samples per second"),  # counter under rate()
        ("autominato_stage_service_seconds_bucket", "Stage service time"),  # histogram
        ("autominato_controller_decisions_total", "Controller decisions"),
    ],
)
def test_a_mutated_metric_name_fails_the_check(scraped, metric, panel):
    prom, start, end = scraped
    model = copy.deepcopy(dash.build_dashboard())
    for p in model["panels"]:
        for t in p.get("targets", []):
            t["expr"] = t["expr"].replace(metric, metric.replace("autominato_", "autominato_x"))
    results = _check(prom, start, end, model)
    empty = {r.target.panel for r in results if r.series == 0} - GPU_PANELS
    assert panel in empty


def test_dashboards_check_command_passes_against_the_scraped_loader(scraped, monkeypatch, capsys):
    prom, start, end = scraped
    monkeypatch.setattr("sys.argv", ["autominato"])
    span = f"{int(time.time() - start) + 1}s"
    rc = cli.main(
        ["dashboards", "check", "--prometheus-url", prom.url, "--range", span,
         "--scrape-interval", "1s"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out  # on a CPU host too
    assert "0 without series" in out
    if _no_h2d_copies(prom):
        # Without CUDA the H2D queries have no data, and say why.
        assert "Host-to-device bandwidth [A]" in out and "expected without a CUDA device" in out
        assert out.count("expected without a CUDA device") == len(dash.DEVICE_TARGETS)
    assert "expected where the worker processes read" in out


def test_the_check_passes_a_run_in_which_no_knob_changed(scraped, monkeypatch, capsys):
    """Trial 171: with autotune=False (or a controller that held), the decisions panel and
    the knob changes' annotation have no data, and the check failed a healthy run. Here
    Prometheus is made to answer as after such a run: no decision, no knob change."""
    prom, start, end = scraped
    undecided = ("autominato_controller_decisions_total", "changes(autominato_knob_value")
    for name in ("query", "query_range"):
        real = getattr(dash.PrometheusAPI, name)

        def answer(self, expr, *a, _real=real, **kw):
            return [] if any(m in expr for m in undecided) else _real(self, expr, *a, **kw)

        monkeypatch.setattr(dash.PrometheusAPI, name, answer)
    span = f"{int(time.time() - start) + 1}s"
    rc = cli.main(["dashboards", "check", "--prometheus-url", prom.url, "--range", span,
                   "--scrape-interval", "1s"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("no controller decision in the range") == len(dash.DECISION_TARGETS)


def test_the_read_threads_query_is_checked_where_read_threads_are_measured(
        scraped, monkeypatch, capsys):
    """Review 172: the read threads' query was exempt whatever the loader, so a broken one
    could never fail the check. Here Prometheus answers as for a loader with a read stage of
    its own (its CPU counter exported) whose panel query finds nothing: a missing series."""
    prom, start, end = scraped
    real_range = dash.PrometheusAPI.query_range

    def answer(self, expr, *a, **kw):
        if expr == "autominato_stage_cpu_seconds_total":
            return [{"metric": {"stage": "read"}, "values": [[end, "1.5"]]}]
        return real_range(self, expr, *a, **kw)

    monkeypatch.setattr(dash.PrometheusAPI, "query_range", answer)
    span = f"{int(time.time() - start) + 1}s"
    rc = cli.main(["dashboards", "check", "--prometheus-url", prom.url, "--range", span,
                   "--scrape-interval", "1s"])
    out = capsys.readouterr().out
    assert rc == 1, out
    # (its two queries: ran on, and ran on or waited for)
    assert f"{len(dash.READ_THREAD_TARGETS)} without series" in out
    assert "expected where the worker processes read" not in out
