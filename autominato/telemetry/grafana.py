"""``autominato dashboards``: generate, check or push the Grafana dashboard.

* ``generate`` writes :func:`autominato.telemetry.dashboard.dashboard_json` to
  ``dashboards/autominato.json`` (``--check`` only compares, for CI).
* ``check`` runs every panel query against a live Prometheus and lists those without series.
* ``push`` uploads a Prometheus data source and the dashboard through Grafana's HTTP API with
  ``grafana-client`` (the maintained fork of the archived ``grafana-api``).

Credentials come only from the environment: ``GRAFANA_TOKEN`` (a service-account token, sent
as ``Authorization: Bearer``) or ``GRAFANA_USER`` and ``GRAFANA_PASSWORD`` (HTTP basic auth).
The Grafana URL is ``--url`` or ``GRAFANA_URL``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from autominato.telemetry import dashboard as dash

log = logging.getLogger(__name__)

#: Where ``generate`` writes by default, relative to the working directory (the repo root).
DEFAULT_OUTPUT = Path("dashboards") / "autominato.json"
#: The data source URL that ``push`` registers: a Prometheus beside Grafana on this host.
DEFAULT_PROMETHEUS_URL = "http://localhost:9090"


class PushError(RuntimeError):
    """``dashboards push`` failed; the message says what to fix (URL, credentials, conflict).

    ``usage`` is true when the push could not start as written (no, a malformed or an
    unreachable Grafana URL, missing credentials): ``autominato``'s exit status 2, not 1.
    """

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(frozen=True)
class PushResult:
    """What ``push`` did: ``datasource`` is ``created``, ``updated`` or ``kept``; ``url`` is
    the dashboard's address that Grafana returned (relative to the server)."""

    datasource: str
    dashboard_uid: str
    dashboard_version: int | None
    url: str


def credential_from_env(env: Mapping[str, str]) -> str | tuple[str, str]:
    """The Grafana credential in ``env``: a token string or a ``(user, password)`` pair.

    ``GRAFANA_TOKEN`` wins over ``GRAFANA_USER`` / ``GRAFANA_PASSWORD``.

    Raises:
        PushError: neither is set, or only one of user and password.
    """
    token = env.get("GRAFANA_TOKEN", "").strip()
    if token:
        return token
    user, password = env.get("GRAFANA_USER", ""), env.get("GRAFANA_PASSWORD", "")
    if user and password:
        return (user, password)
    if user or password:
        missing = "GRAFANA_PASSWORD" if user else "GRAFANA_USER"
        raise PushError(f"GRAFANA_USER and GRAFANA_PASSWORD go together; {missing} is not set",
                        usage=True)
    raise PushError(
        "no Grafana credentials: set GRAFANA_TOKEN (a service-account token) or "
        "GRAFANA_USER and GRAFANA_PASSWORD in the environment", usage=True
    )


def datasource_payload(prometheus_url: str, scrape_interval: str) -> dict[str, Any]:
    """Body of ``POST /api/datasources`` for the Prometheus the dashboard reads.

    ``jsonData.timeInterval`` is the scrape interval, which Grafana uses for
    ``$__rate_interval`` (4 x scrape interval at least).
    """
    return {
        "name": dash.DATASOURCE_NAME,
        "uid": dash.DATASOURCE_UID,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "isDefault": False,
        "jsonData": {"timeInterval": scrape_interval, "httpMethod": "POST"},
    }


def push(
    url: str,
    credential: str | tuple[str, str],
    *,
    dashboard: Mapping[str, Any] | None = None,
    prometheus_url: str = DEFAULT_PROMETHEUS_URL,
    scrape_interval: str = "15s",
    overwrite: bool = False,
    folder_uid: str | None = None,
    timeout: float = 10.0,
) -> PushResult:
    """Create (or update) the Prometheus data source, then upload ``dashboard``.

    Requests (Grafana HTTP API): ``POST /api/datasources``; on 409 (it exists) with
    ``overwrite``, ``PUT /api/datasources/uid/<uid>``, without, the existing one is kept;
    then ``POST /api/dashboards/db`` with ``{"dashboard", "overwrite", "message"[, "folderUid"]}``.

    Args:
        url: Grafana's base URL, e.g. ``http://127.0.0.1:3000`` (no credentials in it).
        credential: from :func:`credential_from_env`.
        dashboard: the dashboard model; default :func:`~autominato.telemetry.dashboard.build_dashboard`.
        prometheus_url: the URL Grafana's server uses to reach Prometheus.
        scrape_interval: Prometheus duration, stored as the data source's ``timeInterval``.
        overwrite: replace an existing dashboard with the same uid and update the data source.
        folder_uid: Grafana folder to put the dashboard in (default: General).
        timeout: seconds per HTTP request.

    Raises:
        PushError: bad URL, server unreachable, 401 / 403, a conflict (409 / 412) without
            ``overwrite``, or any other error answer; the message names the server and the fix.
    """
    from grafana_client import GrafanaApi

    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PushError(f"Grafana URL must look like http://host:3000, got {url!r}", usage=True)
    if parsed.username or parsed.password:
        raise PushError(
            "put Grafana credentials in GRAFANA_TOKEN or GRAFANA_USER / GRAFANA_PASSWORD, "
            "not in the URL (it shows in shell history and process lists)", usage=True
        )
    model = dict(dashboard if dashboard is not None else dash.build_dashboard())
    # Grafana matches by uid; a stale numeric id from an export would make it look for a
    # dashboard that does not exist on this server.
    model["id"] = None
    api = GrafanaApi.from_url(url, credential=credential, timeout=timeout)
    try:
        return _push_with(api, url, credential, model, prometheus_url, scrape_interval,
                          overwrite, folder_uid)
    finally:
        # The HTTP session's connection pools each run a keep-alive watch thread until
        # closed (or collected): one left running keeps every later Loader of this
        # process from forking its workers (a new interpreter starts them instead).
        api.client.s.close()


def _push_with(api: Any, url: str, credential: str | tuple[str, str], model: dict[str, Any],
               prometheus_url: str, scrape_interval: str, overwrite: bool,
               folder_uid: str | None) -> PushResult:
    """:func:`push`'s requests through ``api``."""
    import niquests.exceptions
    from grafana_client.client import GrafanaClientError, GrafanaException

    def explain(e: Exception, action: str) -> PushError:
        if isinstance(e, niquests.exceptions.ConnectionError) or (
            isinstance(e, GrafanaException) and e.status_code == 0
        ):
            return PushError(f"cannot reach Grafana at {url} ({action}): {e}", usage=True)
        status = getattr(e, "status_code", None)
        if status == 401:
            which = "GRAFANA_TOKEN" if isinstance(credential, str) else "GRAFANA_USER/PASSWORD"
            return PushError(
                f"Grafana at {url} rejected the credentials from {which} (HTTP 401) while "
                f"trying to {action}: check that the token or password is valid"
            )
        if status == 403:
            return PushError(
                f"Grafana at {url} refused to {action} (HTTP 403): the account needs the "
                "Editor role (dashboards) and Admin role (data sources)"
            )
        message = getattr(e, "message", str(e))
        return PushError(f"Grafana at {url} failed to {action}: {message}")

    ds = datasource_payload(prometheus_url, scrape_interval)
    try:
        try:
            api.datasource.create_datasource(ds)
            ds_state = "created"
        except GrafanaClientError as e:
            if e.status_code != 409:
                raise
            if overwrite:
                api.datasource.update_datasource_by_uid(dash.DATASOURCE_UID, ds)
                ds_state = "updated"
            else:
                ds_state = "kept"
    except (GrafanaException, niquests.exceptions.RequestException) as e:
        raise explain(e, f"create data source {dash.DATASOURCE_NAME!r}") from e

    body: dict[str, Any] = {
        "dashboard": model,
        "overwrite": overwrite,
        "message": "autominato dashboards push",
    }
    if folder_uid:
        body["folderUid"] = folder_uid
    uid = str(model.get("uid", ""))
    try:
        answer = api.dashboard.update_dashboard(body)
    except GrafanaClientError as e:
        # Grafana answers 412 (version-mismatch, name-exists) from /api/dashboards/db and 409
        # from newer endpoints when the dashboard exists already.
        if e.status_code in (409, 412):
            raise PushError(
                f"dashboard {uid!r} already exists on Grafana at {url} (HTTP {e.status_code}: "
                f"{e.message}); rerun with --overwrite to replace it"
            ) from e
        raise explain(e, f"upload dashboard {uid!r}") from e
    except (GrafanaException, niquests.exceptions.RequestException) as e:
        raise explain(e, f"upload dashboard {uid!r}") from e
    answer = answer if isinstance(answer, dict) else {}
    return PushResult(ds_state, str(answer.get("uid", uid)), answer.get("version"), answer.get("url", ""))


def _load_dashboard(path: str | None) -> dict[str, Any]:
    if path is None:
        return dash.build_dashboard()
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"autominato dashboards: cannot read dashboard {path}: {e}", file=sys.stderr)
        raise SystemExit(2) from e


def _duration_s(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError) as e:
        raise argparse.ArgumentTypeError(f"expected a duration like 30s, 15m or 2h: {text!r}") from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    gen = sub.add_parser("generate", help="write the dashboard JSON generated from code")
    gen.add_argument(
        "-o", "--output", default=str(DEFAULT_OUTPUT),
        help=f"file to write, '-' for stdout (default {DEFAULT_OUTPUT})",
    )
    gen.add_argument(
        "--check", action="store_true",
        help="write nothing; exit 1 if the file differs from the generated dashboard",
    )

    chk = sub.add_parser("check", help="list panel queries that return no series from Prometheus")
    chk.add_argument("--prometheus-url", default=DEFAULT_PROMETHEUS_URL)
    chk.add_argument("--range", type=_duration_s, default=900.0, help="time range (default 15m)")
    chk.add_argument(
        "--scrape-interval", type=_duration_s, default=15.0,
        help="the data source's scrape interval, for $__rate_interval (default 15s)",
    )
    chk.add_argument("--dashboard", help="dashboard JSON file (default: the generated one)")

    p = sub.add_parser(
        "push",
        help="upload the Prometheus data source and the dashboard to Grafana",
        description="Credentials: GRAFANA_TOKEN, or GRAFANA_USER and GRAFANA_PASSWORD.",
    )
    p.add_argument("--url", default=None, help="Grafana base URL (default: $GRAFANA_URL)")
    p.add_argument(
        "--prometheus-url", default=DEFAULT_PROMETHEUS_URL,
        help=f"Prometheus URL as Grafana's server reaches it (default {DEFAULT_PROMETHEUS_URL})",
    )
    p.add_argument("--scrape-interval", default="15s", help="Prometheus scrape interval (15s)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing dashboard with the same uid and update the data source",
    )
    p.add_argument("--folder-uid", default=None, help="Grafana folder uid (default: General)")
    p.add_argument("--dashboard", help="dashboard JSON file (default: the generated one)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")


def _generate(args: argparse.Namespace) -> int:
    text = dash.dashboard_json()
    problems = dash.schema_problems(json.loads(text))
    if problems:
        print("generated dashboard is invalid:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if args.check:
        if not out.exists():
            print(f"{out} does not exist (run `autominato dashboards generate -o {out}` to "
                  "write it, or give -o the path of the dashboard to compare)", file=sys.stderr)
            return 2
        current = out.read_text()
        if current != text:
            print(
                f"{out} is not the generated dashboard; run `autominato dashboards generate`",
                file=sys.stderr,
            )
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} ({len(dash.dashboard_targets(json.loads(text)))} queries)")
    return 0


def _check(args: argparse.Namespace) -> int:
    model = _load_dashboard(args.dashboard)
    end = time.time()
    prom = dash.PrometheusAPI(args.prometheus_url)
    try:
        results = dash.check_series(
            model, prom, start=end - args.range, end=end,
            step_s=max(1.0, args.range / 300), scrape_interval_s=args.scrape_interval,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        print(f"autominato dashboards check: {e}", file=sys.stderr)
        return 2  # Prometheus unreachable or refusing: the check cannot start (cli's 2)
    gpu = set(dash.gpu_panel_titles())
    try:
        copied = any(
            float(s["value"][1]) > 0 for s in prom.query("autominato_h2d_bytes_total", end)
        )
    except (ConnectionError, RuntimeError, ValueError):
        copied = True  # unknown: the device queries are then checked as the others
    def exported(name: str) -> bool:
        """``name`` has a series in the range (unknown: True, so that the queries that need
        it are checked as the others)."""
        try:
            return bool(prom.query_range(name, end - args.range, end, max(1.0, args.range / 300)))
        except (ConnectionError, RuntimeError, ValueError):
            return True

    decided = exported("autominato_controller_decisions_total")
    read_threads = exported("autominato_stage_cpu_seconds_total")
    processes = exported("autominato_loader_cpu_seconds_total")
    missing = 0
    for r in results:
        note = ""
        if r.series == 0:
            where = (r.target.panel, r.target.ref_id)
            if r.target.panel in gpu:
                note = "  (no GPU metrics: expected without NVML / DCGM)"
            elif where in dash.DEVICE_TARGETS and not copied:
                note = "  (no host-to-device copy: expected without a CUDA device)"
            elif where in dash.DECISION_TARGETS and not decided:
                note = ("  (no controller decision in the range: expected with autotune=False "
                        "or while the controller holds every knob)")
            elif where in dash.WORKER_PROCESS_TARGETS and not processes:
                note = "  (no worker process: expected with thread workers or workers=0)"
            elif where in dash.READ_THREAD_TARGETS and not read_threads:
                note = ("  (no read stage of its own: expected where the worker processes "
                        "read, fuse_read=True, the default)")
            else:
                missing += 1
        print(f"{r.series:4d} series  {r.target.panel} [{r.target.ref_id}]{note}")
    print(f"{len(results)} queries, {missing} without series (not counted: GPU panels, "
          "device queries while nothing was copied to a device, decision queries while no "
          "knob changed, worker-process and read-thread queries while their figures are not "
          "exported)")
    return 1 if missing else 0


def _push(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("GRAFANA_URL", "")
    try:
        if not url:
            raise PushError("no Grafana URL: pass --url or set GRAFANA_URL", usage=True)
        result = push(
            url,
            credential_from_env(os.environ),
            dashboard=_load_dashboard(args.dashboard),
            prometheus_url=args.prometheus_url,
            scrape_interval=args.scrape_interval,
            overwrite=args.overwrite,
            folder_uid=args.folder_uid,
            timeout=args.timeout,
        )
    except PushError as e:
        print(f"autominato dashboards push: {e}", file=sys.stderr)
        return 2 if e.usage else 1
    print(
        f"data source {dash.DATASOURCE_NAME!r} {result.datasource}; dashboard "
        f"{result.dashboard_uid!r} version {result.dashboard_version} at "
        f"{url.rstrip('/')}{result.url}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``autominato dashboards``; returns the process exit status."""
    return {"generate": _generate, "check": _check, "push": _push}[args.action](args)
