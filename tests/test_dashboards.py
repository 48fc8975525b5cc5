"""The Grafana dashboard, its provisioning files and the docker-compose stack, checked offline.

No Grafana server can run here: the dashboard is checked against the pinned
grafana-foundation-sdk's typed schema, the compose file with Debian's ``docker-compose``, the
Prometheus configuration with ``promtool``. The queries are checked against a real Prometheus
in ``test_dashboards_prometheus.py``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytest.importorskip("grafana_foundation_sdk")

from autominato import cli  # noqa: E402
from autominato.telemetry import dashboard as dash  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "dashboards" / "autominato.json"
COMPOSE = ROOT / "docker-compose.yml"
PROVISIONING = ROOT / "dashboards" / "provisioning"

#: The metric names that autominato.telemetry.metrics defines (the binding list of issue 7).
LOADER_METRICS = {
    "autominato_stage_service_seconds",
    "autominato_stage_wait_seconds",
    "autominato_stage_items_total",
    "autominato_stage_bytes_total",
    "autominato_stage_cpu_seconds_total",
    "autominato_stage_runqueue_wait_seconds_total",
    "autominato_stage_queue_items",
    "autominato_stage_queue_capacity_items",
    "autominato_stage_workers",
    "autominato_consumer_wait_seconds",
    "autominato_consumer_step_seconds",
    "autominato_accelerator_idle_ratio",
    "autominato_samples_total",
    "autominato_batches_total",
    "autominato_h2d_bytes_total",
    "autominato_h2d_copy_seconds",
    "autominato_h2d_bandwidth_bytes_per_second",
    "autominato_stragglers_total",
    "autominato_samples_skipped_total",
    "autominato_samples_lost_total",
    "autominato_worker_restarts_total",
    "autominato_knob_value",
    "autominato_controller_decisions_total",
    "autominato_pool_bytes",
    "autominato_memory_wait_seconds_total",
    "autominato_loader_cpu_seconds_total",
    "autominato_loader_runqueue_wait_seconds_total",
    "autominato_loader_cpu_system_seconds_total",
}
NVML_METRICS = {
    "autominato_gpu_utilization_ratio",
    "autominato_gpu_memory_used_bytes",
    "autominato_gpu_pcie_tx_bytes_per_second",
    "autominato_gpu_pcie_rx_bytes_per_second",
}
DCGM_METRICS = {
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_PROF_PCIE_RX_BYTES",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _metric_names(expr: str) -> set[str]:
    names = set()
    for name in re.findall(r"\b(?:autominato_\w+|DCGM_FI_\w+)", expr):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in LOADER_METRICS:
                name = name[: -len(suffix)]
        names.add(name)
    return names


# --- the dashboard --------------------------------------------------------------------------


def test_committed_dashboard_equals_the_generated_one():
    assert COMMITTED.read_text() == dash.dashboard_json(), (
        "dashboards/autominato.json is stale: run `autominato dashboards generate`"
    )


def test_generate_check_says_a_missing_file_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # outside the repository: no dashboards/ folder here
    monkeypatch.setattr("sys.argv", ["autominato"])
    assert cli.main(["dashboards", "generate", "--check"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "not the generated" not in err


def test_generate_check_flags_a_stale_file_and_generate_rewrites_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["autominato"])
    out = tmp_path / "autominato.json"
    out.write_text(COMMITTED.read_text().replace("Throughput", "Throughput (edited)"))
    assert cli.main(["dashboards", "generate", "-o", str(out), "--check"]) == 1
    assert "not the generated dashboard" in capsys.readouterr().err
    assert cli.main(["dashboards", "generate", "-o", str(out)]) == 0
    assert out.read_text() == dash.dashboard_json()
    assert cli.main(["dashboards", "generate", "-o", str(out), "--check"]) == 0


def test_dashboard_is_valid_for_the_pinned_schema():
    model = json.loads(COMMITTED.read_text())
    assert dash.schema_problems(model) == []
    # The SDK for Grafana 10.1 writes schema version 36; Grafana 10.1 migrates it on load.
    assert model["schemaVersion"] == 36


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["panels"][2].__setitem__("id", d["panels"][1]["id"]), "already used by"),
        (lambda d: d["panels"][1]["targets"][0].pop("refId"), "has no refId"),
        (lambda d: d["panels"][1]["targets"][0].pop("datasource"), "no datasource"),
        (lambda d: d["panels"][1].__setitem__("colour", "red"), "not in the schema"),
        (lambda d: d["panels"][1].__setitem__("type", "graph-v2"), "unknown panel type"),
        (lambda d: d["panels"][2]["gridPos"].__setitem__("x", 0), "overlaps"),
        (lambda d: d.__setitem__("schemaVersion", 39), "schemaVersion"),
        (
            lambda d: d["panels"][1]["targets"][0].__setitem__("expr", "up{job=~\"$jbo\"}"),
            "$jbo",
        ),
    ],
    ids=["dup-id", "no-refId", "no-datasource", "unknown-key", "panel-type", "overlap",
         "schema-version", "undefined-variable"],
)
def test_schema_check_catches_each_kind_of_defect(mutate, expected):
    model = copy.deepcopy(dash.build_dashboard())
    mutate(model)
    problems = dash.schema_problems(model)
    assert any(expected in p for p in problems), problems


def test_every_target_reads_prometheus_through_the_datasource_variable():
    model = dash.build_dashboard()
    targets = [t for p in model["panels"] for t in p.get("targets", [])]
    assert len(targets) == len(dash.dashboard_targets(model)) - 1  # the annotation has no refId
    assert {json.dumps(t["datasource"], sort_keys=True) for t in targets} == {
        json.dumps({"type": "prometheus", "uid": "${datasource}"}, sort_keys=True)
    }
    assert [v["name"] for v in model["templating"]["list"]] == ["datasource", "job", "rank", "gpu"]


def test_dashboard_queries_use_exactly_the_binding_metric_names():
    used = set().union(*(_metric_names(t.expr) for t in dash.dashboard_targets(dash.build_dashboard())))
    assert used == LOADER_METRICS | NVML_METRICS | DCGM_METRICS


def test_each_required_view_is_on_the_dashboard():
    model = dash.build_dashboard()
    by_title = {p["title"]: p for p in model["panels"]}
    exprs = {t: " ".join(q["expr"] for q in p.get("targets", [])) for t, p in by_title.items()}
    assert "histogram_quantile(0.5," in exprs["Stage service time"]
    assert "histogram_quantile(0.99," in exprs["Stage service time"]
    assert "autominato_stage_queue_capacity_items" in exprs["Queue fill"]
    assert "rate(autominato_samples_total" in exprs["Samples per second"]
    assert "autominato_accelerator_idle_ratio" in exprs["Accelerator idle ratio"]
    assert "autominato_h2d_bandwidth_bytes_per_second" in exprs["Host-to-device bandwidth"]
    assert {"autominato_gpu_pcie_tx_bytes_per_second", "DCGM_FI_PROF_PCIE_TX_BYTES"} <= _metric_names(
        exprs["PCIe bandwidth"]
    )
    assert "histogram_quantile(0.5, sum by (le, rank) (rate(autominato_consumer_step_seconds_bucket" in (
        exprs["Consumer step time"]
    )
    # Utilisation divides by the workers only where a stage has some (no division by zero).
    assert "rate(autominato_stage_service_seconds_sum" in exprs["Stage utilisation"]
    assert "(sum by (stage) (autominato_stage_workers" in exprs["Stage utilisation"]
    assert exprs["Stage utilisation"].endswith("> 0)")
    assert by_title["Knob values"]["type"] == "state-timeline"
    assert "autominato_controller_decisions_total" in exprs["Controller decisions"]
    assert "changes(autominato_knob_value" in model["annotations"]["list"][0]["expr"]
    assert "autominato_stragglers_total" in exprs["Stragglers, skips, losses, restarts"]
    assert "autominato_samples_lost_total" in exprs["Stragglers, skips, losses, restarts"]
    assert "rate(autominato_memory_wait_seconds_total" in exprs["Workers idle for memory"]
    # The GPU row holds exactly the panels that read NVML / DCGM metrics.
    gpu = {t for t, e in exprs.items() if _metric_names(e) & (NVML_METRICS | DCGM_METRICS)}
    assert gpu == set(dash.gpu_panel_titles()) == {"GPU utilisation", "GPU memory used", "PCIe bandwidth"}


def test_interpolate_follows_grafanas_rate_interval_definition():
    expr = 'rate(x{rank=~"$rank", job=~"${job}"}[$__rate_interval]) + increase(y[$__range])'
    # max($__interval + scrape, 4 * scrape): 4 x 15 s dominates a 1 s step ...
    got = dash.interpolate(expr, {"rank": "0", "job": ".*"}, interval_s=1, range_s=900, scrape_interval_s=15)
    assert got == 'rate(x{rank=~"0", job=~".*"}[60s]) + increase(y[900s])'
    # ... and a long step dominates a short scrape interval.
    got = dash.interpolate("[$__rate_interval]", {}, interval_s=30, range_s=1, scrape_interval_s=1)
    assert got == "[31s]"
    with pytest.raises(KeyError, match=r"\$gpu"):
        dash.interpolate('x{gpu=~"$gpu"}', {}, interval_s=1, range_s=1, scrape_interval_s=1)


def test_every_interpolated_query_is_valid_promql(tmp_path):
    """promtool parses each query (as a recording rule) after substitution, including values
    with regex metacharacters escaped the way Grafana escapes them."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    variables = {
        "job": dash.regex_escape("train.v2 (a|b)"),
        "rank": dash.regex_escape("0-1"),
        "gpu": dash.ALL_VALUE,
    }
    targets = dash.dashboard_targets(dash.build_dashboard())
    rules = [
        {
            "record": f"autominato:dashboard_query_{i}",
            "expr": dash.interpolate(
                t.expr, variables, interval_s=15, range_s=900, scrape_interval_s=15
            ),
        }
        for i, t in enumerate(targets)
    ]
    assert 'job=~"train\\\\.v2 \\\\(a\\\\|b\\\\)"' in rules[0]["expr"]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(targets)} rules found" in r.stdout


# --- provisioning and the compose stack ----------------------------------------------------


def test_grafana_image_matches_the_sdk_grafana_line():
    sdk = importlib.metadata.version("grafana_foundation_sdk")  # "1769699998!10.1.0"
    major_minor = ".".join(sdk.split("!")[-1].split(".")[:2])
    assert dash.GRAFANA_VERSION.startswith(major_minor + ".")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["grafana"]["image"] == f"grafana/grafana:{dash.GRAFANA_VERSION}"


def test_provisioned_datasource_is_the_one_the_dashboard_selects():
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [(d["uid"], d["name"], d["type"]) for d in ds] == [
        (dash.DATASOURCE_UID, dash.DATASOURCE_NAME, "prometheus")
    ]
    prom = yaml.safe_load((PROVISIONING / "prometheus" / "prometheus.yml").read_text())
    # Grafana's $__rate_interval is right only if timeInterval is the real scrape interval.
    assert ds[0]["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
    current = dash.build_dashboard()["templating"]["list"][0]["current"]
    assert current["value"] == dash.DATASOURCE_UID


def test_provisioning_loads_the_json_that_compose_mounts():
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "autominato.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts[f"{path}/autominato.json"] == "./dashboards/autominato.json"
    assert mounts["/etc/grafana/provisioning/datasources"] == "./dashboards/provisioning/datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == "./dashboards/provisioning/dashboards"
    for source in mounts.values():
        if source.startswith("./"):
            assert (ROOT / source).exists(), source


def test_prometheus_config_is_valid_and_scrapes_the_training_job():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    config = PROVISIONING / "prometheus" / "prometheus.yml"
    r = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = {j["job_name"]: j for j in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs["autominato"]["static_configs"][0]["targets"] == ["train:9100"]


def _compose(*args: str, password: str | None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("Debian's docker-compose is not installed")
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    if password is not None:
        env["GRAFANA_ADMIN_PASSWORD"] = password
    return subprocess.run(
        [exe, "-f", str(COMPOSE), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )


@pytest.fixture(scope="module")
def resolved_compose() -> dict:
    """``docker-compose config`` output (the file as Compose reads it) with a test password."""
    r = _compose("config", password="pw-from-env")
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_compose_file_is_valid():
    r = _compose("config", "-q", password="test-only")
    assert r.returncode == 0, r.stderr


def test_compose_requires_the_admin_password_from_the_environment(resolved_compose):
    raw = COMPOSE.read_text()
    assert "GF_SECURITY_ADMIN_PASSWORD: ${GRAFANA_ADMIN_PASSWORD:?" in raw
    r = _compose("config", "-q", password=None)
    assert r.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in r.stderr
    assert resolved_compose["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "pw-from-env"


def test_compose_training_job_command_is_accepted_by_autominato_run(resolved_compose):
    train = pytest.importorskip("autominato.train")
    script = resolved_compose["services"]["train"]["command"][-1]
    words = shlex.split(script.split("exec ", 1)[1].replace("$$STEPS", "10"))
    assert words[:2] == ["autominato", "run"]
    parser = argparse.ArgumentParser(prog="autominato run")
    train.add_arguments(parser)
    try:
        args = parser.parse_args(words[2:])
    except SystemExit as e:
        raise AssertionError(f"`autominato run` rejects the compose command {words}") from e
    assert (args.metrics_port, args.metrics_host) == (9100, "0.0.0.0")


def test_compose_publishes_ports_on_loopback_only(resolved_compose):
    services = resolved_compose["services"]
    published = {name: s.get("ports", []) for name, s in services.items()}
    assert set(published) >= {"train", "prometheus", "grafana"}
    assert published["grafana"] and published["prometheus"]
    for name, ports in published.items():
        for port in ports:
            text = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}"
            assert text.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_compose_ray_profile_is_a_head_and_a_worker_that_joins_it():
    r = _compose("--profile", "ray", "config", password="test-only")
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    head, worker = services["ray-head"], services["ray-worker"]
    assert head["profiles"] == worker["profiles"] == ["ray"]
    assert "--head --port=6379" in head["environment"]["RAY_START_ARGS"]
    assert worker["environment"]["RAY_START_ARGS"] == "--address=ray-head:6379"
    for node in (head, worker):
        script = node["command"][-1]
        assert '"/opt/autominato[ray]"' in script and script.endswith("ray start $$RAY_START_ARGS --block")
        assert any(str(v).split(":")[1] == "/data" for v in node["volumes"] if str(v).startswith("ray-data"))


def test_dashboards_check_reports_an_unreachable_prometheus(monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a port that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr("sys.argv", ["autominato"])
    rc = cli.main(["dashboards", "check", "--prometheus-url", f"http://127.0.0.1:{port}"])
    assert rc == 2  # the check cannot start: autominato.cli's exit status for that
    assert f"cannot reach Prometheus at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_queue_fill_leaves_out_a_stage_without_a_queue_rather_than_dividing_by_zero(tmp_path):
    """A read fused into the transform workers (the default) has no queue (capacity 0): its
    fill is undefined, so it has no series, as the utilisation panel does for a stage
    without workers, instead of a NaN line (0 / 0 in PromQL)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    query = next(q.expr for _, specs in dash.ROWS for s in specs if s.title == "Queue fill"
                 for q in s.queries)
    expr = dash.interpolate(query, {"job": dash.ALL_VALUE, "rank": dash.ALL_VALUE},
                            interval_s=15, range_s=900, scrape_interval_s=15)
    series = [
        (f'autominato_stage_queue_{m}{{job="j", rank="0", stage="{stage}"}}', v)
        for stage, items, cap in (("read", 0, 0), ("transform", 3, 8))
        for m, v in (("items", items), ("capacity_items", cap))
    ]
    (tmp_path / "none.yml").write_text("groups: []\n")
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["none.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": f"{v}x5"} for s, v in series],
            "promql_expr_test": [{
                "expr": expr,
                "eval_time": "2m",
                "exp_samples": [{"labels": '{stage="transform"}', "value": 0.375}],
            }],
        }],
    }))
    r = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_exempt_targets_name_the_queries_they_exempt():
    """The (panel, refId) pairs that ``dashboards check`` exempts are the queries of the
    figures they are exempt for: a query added before them shifts their refIds (the kernel
    series shifted the read-thread ones, and the check failed a healthy run)."""
    exprs = {(t.panel, t.ref_id): t.expr
             for t in dash.dashboard_targets(json.loads(dash.dashboard_json()))}
    for targets, metric in ((dash.WORKER_PROCESS_TARGETS, "autominato_loader_"),
                            (dash.READ_THREAD_TARGETS, 'stage="read"'),
                            (dash.DEVICE_TARGETS, "autominato_h2d_"),
                            (dash.DECISION_TARGETS, "autominato_")):
        for where in targets:
            assert metric in exprs[where], (where, exprs.get(where))
    assert all('stage="read"' not in exprs[w] for w in dash.WORKER_PROCESS_TARGETS)
    assert {w: exprs[w] for w in dash.DECISION_TARGETS
            if "decisions" not in exprs[w] and "autominato_knob_value" not in exprs[w]} == {}
