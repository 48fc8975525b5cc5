"""Test helper: a real Prometheus server (Debian's ``prometheus``) on a free 127.0.0.1 port.

Usage in a test::

    from prometheus_server import PrometheusServer, require_prometheus

    def test_scraped(...):
        require_prometheus()                      # skips cleanly when the binary is absent
        with PrometheusServer([f"127.0.0.1:{port}"]) as prom:
            series = prom.wait_for("autominato_stage_items_total", timeout=20.0)

The server gets a temporary configuration with a 1 s scrape interval, a temporary TSDB
directory, and is stopped (then killed if it lingers) and cleaned up on exit. With a 1 s
interval the first sample of a target usually lands about 2 to 6 s after start-up, so
:meth:`PrometheusServer.wait_for` polls (default up to 20 s) rather than sleeping a fixed time.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType

#: The binary name; CI installs it with ``apt-get install prometheus`` (see ``.ci/run``).
PROMETHEUS = "prometheus"


def prometheus_path() -> str | None:
    """Path of the ``prometheus`` executable, or None when it is not installed."""
    return shutil.which(PROMETHEUS)


def require_prometheus() -> str:
    """Return the ``prometheus`` path, or skip the calling test when it is not installed."""
    import pytest

    path = prometheus_path()
    if path is None:
        pytest.skip("Debian's `prometheus` is not installed (apt-get install prometheus)")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """A Prometheus server scraping ``targets`` (``"host:port"`` strings) every ``scrape_interval``.

    Args:
        targets: scrape targets, each ``"host:port"``; ``/metrics`` is scraped on each.
        scrape_interval: Prometheus duration string (``"1s"``).
        job: the ``job`` label of the targets.
        ready_timeout: seconds to wait for ``/-/ready`` before giving up.

    Raises:
        FileNotFoundError: ``prometheus`` is not installed (call :func:`require_prometheus`
            first in tests so that they skip instead).
        RuntimeError: the server exited or was not ready within ``ready_timeout`` (its log
            tail is in the message).
    """

    def __init__(
        self,
        targets: list[str],
        *,
        scrape_interval: str = "1s",
        job: str = "autominato",
        ready_timeout: float = 30.0,
    ) -> None:
        self.targets = list(targets)
        self.scrape_interval = scrape_interval
        self.job = job
        self.ready_timeout = ready_timeout
        self.port = 0
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:41234``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        binary = prometheus_path()
        if binary is None:
            raise FileNotFoundError("`prometheus` is not installed (apt-get install prometheus)")
        self._dir = Path(tempfile.mkdtemp(prefix="autominato-prom-"))
        config = self._dir / "prometheus.yml"
        targets = ", ".join(f"'{t}'" for t in self.targets)
        config.write_text(
            "global:\n"
            f"  scrape_interval: {self.scrape_interval}\n"
            f"  evaluation_interval: {self.scrape_interval}\n"
            "scrape_configs:\n"
            f"  - job_name: {self.job}\n"
            f"    scrape_interval: {self.scrape_interval}\n"
            "    static_configs:\n"
            f"      - targets: [{targets}]\n"
        )
        self._log = self._dir / "prometheus.log"
        # The port is picked before the server binds it, so another process may take it in
        # between: retry a few times with a fresh port rather than fail the test.
        last_error = ""
        for _ in range(3):
            self.port = free_port()
            with open(self._log, "wb") as log:
                self._proc = subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={self._dir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self._dir,
                )
            try:
                self._wait_ready()
                return self
            except RuntimeError as e:
                last_error = str(e)
                self._terminate()
        self.stop()
        raise RuntimeError(last_error)

    def _log_tail(self, n: int = 20) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-n:])

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self._proc.returncode}:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"prometheus not ready after {self.ready_timeout} s:\n{self._log_tail()}"
        )

    def _terminate(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None

    def stop(self) -> None:
        """Stop the server and remove its temporary directory (idempotent)."""
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> dict:
        """GET ``/api/v1/<path>`` with query ``params``; returns the decoded ``data`` field.

        Raises:
            RuntimeError: the API answered with ``status != "success"``.
        """
        qs = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{qs}", timeout=5.0) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus API {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query ``expr`` (PromQL); returns the result vector (``[]`` when no series)."""
        return self.api("query", query=expr)["result"]

    def targets_health(self) -> list[str]:
        """``health`` of each active target (``"up"``, ``"down"`` or ``"unknown"``)."""
        return [t["health"] for t in self.api("targets")["activeTargets"]]

    def wait_for(self, expr: str, timeout: float = 20.0, interval: float = 0.5) -> list[dict]:
        """Poll ``query(expr)`` until it returns at least one series; return them.

        Raises:
            TimeoutError: no series within ``timeout`` seconds (target health and the log
                tail are in the message).
        """
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no series for {expr!r} after {timeout} s; targets "
                    f"{self.targets_health()}; log:\n{self._log_tail()}"
                )
            time.sleep(interval)
