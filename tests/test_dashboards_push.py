"""``autominato dashboards push`` against a local HTTP server that records every request.

No Grafana server can run here, so the server answers the way Grafana's HTTP API documents
(``POST /api/datasources``, ``PUT /api/datasources/uid/<uid>``, ``POST /api/dashboards/db``)
and the tests check what grafana-client actually sent: endpoints, payload keys, auth header,
and the error messages on 401, conflicts and a refused connection.
"""

from __future__ import annotations

import base64
import json
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("grafana_client")

from autominato import cli  # noqa: E402
from autominato.telemetry import dashboard as dash  # noqa: E402

DS_PATH = "/api/datasources"
DS_UID_PATH = f"/api/datasources/uid/{dash.DATASOURCE_UID}"
DASH_PATH = "/api/dashboards/db"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: object


@dataclass
class FakeGrafana:
    """Answers ``(method, path)`` from ``routes`` (status, JSON body); records each request."""

    routes: dict[tuple[str, str], tuple[int, dict]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    url: str = ""


def _handler(state: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            state.requests.append(
                Recorded(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            )
            status, answer = state.routes.get((self.command, self.path), (404, {"message": "not found"}))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
            pass

    return Handler


def _ok_routes() -> dict[tuple[str, str], tuple[int, dict]]:
    return {
        ("POST", DS_PATH): (200, {"id": 1, "message": "Datasource added", "name": dash.DATASOURCE_NAME}),
        ("PUT", DS_UID_PATH): (200, {"id": 1, "message": "Datasource updated"}),
        ("POST", DASH_PATH): (
            200,
            {
                "id": 7,
                "uid": dash.DASHBOARD_UID,
                "url": f"/d/{dash.DASHBOARD_UID}/autominato-data-loader",
                "status": "success",
                "version": 3,
            },
        ),
    }


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    state = FakeGrafana(routes=_ok_routes())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("GRAFANA_URL", "GRAFANA_TOKEN", "GRAFANA_USER", "GRAFANA_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main rewrites it; restore after
    return monkeypatch


def _push(*args: str) -> int:
    return cli.main(["dashboards", "push", *args])


def test_push_posts_datasource_then_dashboard_with_bearer_token(grafana, env, capsys):
    env.setenv("GRAFANA_TOKEN", "glsa_test_token")
    rc = _push("--url", grafana.url, "--prometheus-url", "http://prom.example:9090")
    out = capsys.readouterr().out
    assert rc == 0
    assert [(r.method, r.path) for r in grafana.requests] == [("POST", DS_PATH), ("POST", DASH_PATH)]
    assert all(r.headers["authorization"] == "Bearer glsa_test_token" for r in grafana.requests)

    ds = grafana.requests[0].body
    assert set(ds) >= {"name", "uid", "type", "access", "url", "jsonData"}
    assert (ds["uid"], ds["type"], ds["access"]) == (dash.DATASOURCE_UID, "prometheus", "proxy")
    assert ds["url"] == "http://prom.example:9090"
    assert ds["jsonData"]["timeInterval"] == "15s"

    body = grafana.requests[1].body
    assert set(body) == {"dashboard", "overwrite", "message"}
    assert body["overwrite"] is False
    sent = body["dashboard"]
    assert sent["uid"] == dash.DASHBOARD_UID and sent["id"] is None
    expected = dash.build_dashboard()
    assert [p["title"] for p in sent["panels"]] == [p["title"] for p in expected["panels"]]
    assert "created" in out and f"/d/{dash.DASHBOARD_UID}/" in out and "version 3" in out


def test_push_uses_basic_auth_and_grafana_url_from_environment(grafana, env):
    env.setenv("GRAFANA_URL", grafana.url)
    env.setenv("GRAFANA_USER", "alice")
    env.setenv("GRAFANA_PASSWORD", "s3cret")
    assert _push() == 0
    expected = "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert len(grafana.requests) == 2
    assert {r.headers["authorization"] for r in grafana.requests} == {expected}


def test_push_reports_rejected_credentials_on_401_and_stops(grafana, env, capsys):
    env.setenv("GRAFANA_TOKEN", "expired")
    grafana.routes[("POST", DS_PATH)] = (401, {"message": "invalid API key"})
    rc = _push("--url", grafana.url)
    err = capsys.readouterr().err
    assert rc == 1
    assert "HTTP 401" in err and "GRAFANA_TOKEN" in err and grafana.url in err
    assert [(r.method, r.path) for r in grafana.requests] == [("POST", DS_PATH)]


def test_push_reports_refused_connection(env, capsys):
    with socket.socket() as s:  # a port that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.setenv("GRAFANA_TOKEN", "t")
    rc = _push("--url", f"http://127.0.0.1:{port}", "--timeout", "3")
    err = capsys.readouterr().err
    assert rc == cli.EXIT_USAGE  # an unreachable URL, as `dashboards check` and `monitor`
    assert f"cannot reach Grafana at http://127.0.0.1:{port}" in err


def test_existing_datasource_is_kept_without_overwrite_and_updated_with_it(grafana, env, capsys):
    env.setenv("GRAFANA_TOKEN", "t")
    grafana.routes[("POST", DS_PATH)] = (409, {"message": "data source with the same name already exists"})
    assert _push("--url", grafana.url) == 0
    assert [(r.method, r.path) for r in grafana.requests] == [("POST", DS_PATH), ("POST", DASH_PATH)]
    assert "kept" in capsys.readouterr().out

    grafana.requests.clear()
    assert _push("--url", grafana.url, "--overwrite") == 0
    assert [(r.method, r.path) for r in grafana.requests] == [
        ("POST", DS_PATH),
        ("PUT", DS_UID_PATH),
        ("POST", DASH_PATH),
    ]
    assert grafana.requests[1].body["uid"] == dash.DATASOURCE_UID
    assert grafana.requests[2].body["overwrite"] is True
    assert "updated" in capsys.readouterr().out


@pytest.mark.parametrize("status", [409, 412])
def test_dashboard_conflict_names_the_uid_and_the_overwrite_flag(grafana, env, capsys, status):
    env.setenv("GRAFANA_TOKEN", "t")
    grafana.routes[("POST", DASH_PATH)] = (
        status,
        {"message": "A dashboard with the same uid already exists", "status": "name-exists"},
    )
    rc = _push("--url", grafana.url, "--folder-uid", "team-ml")
    err = capsys.readouterr().err
    assert rc == 1
    assert f"HTTP {status}" in err and dash.DASHBOARD_UID in err and "--overwrite" in err
    assert grafana.requests[-1].body["folderUid"] == "team-ml"


def test_push_without_credentials_sends_nothing(grafana, env, capsys):
    assert _push("--url", grafana.url) == cli.EXIT_USAGE
    assert "GRAFANA_TOKEN" in capsys.readouterr().err
    env.setenv("GRAFANA_USER", "alice")  # a user without a password is a mistake, not anonymous
    assert _push("--url", grafana.url) == cli.EXIT_USAGE
    assert "GRAFANA_PASSWORD is not set" in capsys.readouterr().err
    assert grafana.requests == []


def test_push_refuses_credentials_inside_the_url(grafana, env, capsys):
    env.setenv("GRAFANA_TOKEN", "t")
    url = grafana.url.replace("http://", "http://admin:admin@")
    assert _push("--url", url) == cli.EXIT_USAGE
    assert "not in the URL" in capsys.readouterr().err
    assert grafana.requests == []


def test_push_without_a_grafana_url_exits_2_as_every_command_with_a_missing_input(env, capsys):
    env.setenv("GRAFANA_TOKEN", "t")
    assert _push() == cli.EXIT_USAGE
    assert "no Grafana URL" in capsys.readouterr().err


def test_a_push_leaves_no_thread_running(grafana, env):
    """The HTTP session's keep-alive watch threads end with the push: a thread left running
    would keep every later Loader of the process from forking its workers."""
    import time

    env.setenv("GRAFANA_TOKEN", "glsa_test_token")
    before = set(threading.enumerate())
    assert _push("--url", grafana.url) == 0
    grafana.routes[("POST", DS_PATH)] = (401, {"message": "Invalid API key"})
    assert _push("--url", grafana.url) != 0
    deadline = time.monotonic() + 5.0
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, sorted(t.name for t in left)
