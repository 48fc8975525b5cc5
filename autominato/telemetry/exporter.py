"""The HTTP endpoint that Prometheus scrapes (``/metrics`` of the telemetry registry).

One server per ``(host, port)`` per process, shared by every loader that asks for it (two
ranks in one process, a training and a validation loader) and shut down when the last user
closes it. Every server of a process serves the whole registry, so port 0 ("any free port")
reuses the process's server on that host when it has one: two loaders built with
``metrics_port=0`` are one scrape target, not two that each serve both loaders' series (a
Prometheus scraping both would count every series twice). Binds to 127.0.0.1 unless told
otherwise: the metrics carry no paths or sample indices but still describe the job, and a
training node's ports are seldom meant to be public.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import start_http_server

from autominato.telemetry.metrics import REGISTRY

log = logging.getLogger(__name__)

#: The port the project documents for the exporter (OpenTelemetry's Prometheus exporter
#: default, unassigned by IANA, so it seldom collides with a node's other services).
DEFAULT_PORT = 9464


class PortInUseError(OSError):
    """The exporter's port is taken by another process (or another server in this one)."""


@dataclass
class Exporter:
    """A running exporter; :meth:`close` once per :func:`serve` call that returned it."""

    host: str
    port: int
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _users: int = 1

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Drop one user; the last one stops the server and frees the port."""
        with _lock:
            self._users -= 1
            if self._users > 0:
                return
            for key, exp in list(_servers.items()):
                if exp is self:
                    del _servers[key]
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


_lock = threading.Lock()
# (the address bound, the port asked for or bound) -> its server
_servers: dict[tuple[str, int], Exporter] = {}


def bind_host(host: str) -> str:
    """``host`` as the exporter binds it: ``""`` (socketserver's every interface, which
    prometheus_client cannot resolve) is ``"0.0.0.0"``; any other host is itself."""
    return "0.0.0.0" if host == "" else host


def _address(host: str) -> str:
    """The address ``host`` binds (the first that ``getaddrinfo`` gives, as
    ``prometheus_client.start_http_server`` takes it), so that ``localhost`` and ``127.0.0.1``
    are one server; ``host`` itself when it does not resolve (the bind then says why)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM,
                                      flags=socket.AI_PASSIVE)[0][4][0])
    except (OSError, UnicodeError):
        return host


def serve(
    port: int = DEFAULT_PORT, host: str = "127.0.0.1", *, free_if_busy: bool = False
) -> Exporter:
    """Serve the telemetry registry on ``http://host:port/metrics`` from a daemon thread.

    Args:
        port: TCP port; 0: this process's exporter on ``host`` when there is one (it serves
            the same registry), else a free port the OS picks (read it back from ``.port``).
            A second port asked for explicitly gets a second server of the same series (a
            warning says so: scrape one of them).
        host: address to bind; ``"0.0.0.0"`` (or ``""``, as in :mod:`socketserver`) widens
            it to every interface.
        free_if_busy: when ``port`` is taken, bind a free port instead of failing (logged at
            warning level with the port chosen).

    Returns:
        The :class:`Exporter` (shared with earlier callers of the same ``host:port`` in this
        process); call ``close()`` when done.

    Raises:
        PortInUseError: ``port`` is taken and ``free_if_busy`` is False.
        OSError: any other failure to bind (e.g. an address this machine does not have).
    """
    host = bind_host(host)
    addr = _address(host)
    with _lock:
        existing = _servers.get((addr, port))
        if existing is not None and existing.port != port and not free_if_busy:
            existing = None  # (a fallback's alias: only for callers who accept one)
        if existing is None and port == 0:
            existing = next((e for (h, _), e in _servers.items() if h == addr), None)
        if existing is not None:
            existing._users += 1
            return existing
        if _servers:
            log.warning(
                "metrics port %d: this process already serves the same metrics on %s; a "
                "Prometheus scraping both counts every series twice (scrape one, or give every "
                "loader the same metrics_port or 0)",
                port, ", ".join(dict.fromkeys(e.url for e in _servers.values())),
            )
        try:
            server, thread = start_http_server(port, addr=host, registry=REGISTRY)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            if not free_if_busy:
                raise PortInUseError(
                    errno.EADDRINUSE,
                    f"metrics port {port} on {host} is already in use (another job or "
                    "exporter?); pick another port, pass 0 for a free one, or "
                    "free_if_busy=True",
                ) from e
            server, thread = start_http_server(0, addr=host, registry=REGISTRY)
            log.warning(
                "metrics port %d on %s is in use; serving on port %d instead",
                port,
                host,
                server.server_port,
            )
        exporter = Exporter(host, int(server.server_port), server, thread)
        _servers[(addr, exporter.port)] = exporter
        if port:  # (a fallback port: the next caller of the busy one shares it)
            _servers[(addr, port)] = exporter
        log.info("autominato metrics on %s", exporter.url)
        return exporter
