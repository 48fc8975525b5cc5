"""Suite-wide hygiene: threads a test leaves behind.

A loader forks its workers from this process only while it runs one thread
(``autominato.pipeline.spawn.can_fork_now``); otherwise it starts them from a new interpreter
(~2.5 s importing torch). One thread left running by a test therefore slows every later test
that builds a loader (in one full run a read thread left running sent ~290 later tests to
new interpreters: 599 s, where ~450 s is usual). After each test (and its
fixtures) this waits briefly for the loader threads it started to end and lists, at the end of the run,
the tests that left some behind, with what each thread was doing.

Under pytest-xdist (``make test`` runs three processes, ``--dist loadfile``): each test file
runs whole in one process (its module fixtures, a Prometheus server, a Ray cluster, are set
up once), the Ray files share one process (one local Ray instance), and the files
that take longest go first, so that the processes end together.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import warnings

import pytest

#: How long a test's loader threads may take to end after it (a hung read abandoned after its
#: timeout sleeps on in the dataset's code, then ends by itself), seconds.
_GRACE_S = 2.0
_left: list[str] = []


@pytest.fixture
def interrupt_once(monkeypatch):
    """``interrupt_once(owner, name)`` patches ``owner.name`` so that its first call raises
    ``KeyboardInterrupt`` (a Ctrl-C landing there) and later calls run it; returns the list
    that gets an entry when the interrupt is raised."""

    def patch(owner, name: str) -> list:
        real, hits = getattr(owner, name), []

        def cut(*args, **kwargs):
            if not hits:
                hits.append(1)
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, cut)
        return hits

    return patch


def _ours(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith("autominato-") and t.is_alive() and t not in before]


def forget_ray_callback_threads() -> None:
    """After ``ray.shutdown()``: drop the ``_DummyThread`` entries of Ray's C++ threads that
    ran the Ray executor's ``ObjectRef.future()`` callbacks. Those threads outlive
    ``ray.shutdown()`` idle, and their entries stay in :mod:`threading` for the life of the
    process, so every later loader in that test process started its workers from a new
    interpreter (``spawn.can_fork_now``; 2-3 s a loader: one suite run lost ~100 s to it
    after the Ray files). A process whose Ray threads never called Python (no callback ran)
    forks after ``ray.shutdown()`` as it is; this puts the later test files in that state,
    as a fresh process would be. Only threads not running Python now (no frame): an idle
    C++ thread holds no Python lock."""
    in_python = sys._current_frames()
    with threading._active_limbo_lock:
        for ident, t in list(threading._active.items()):
            if isinstance(t, threading._DummyThread) and ident not in in_python:
                del threading._active[ident]


@pytest.fixture(autouse=True)
def _no_loader_thread_left(request):
    before = set(threading.enumerate())  # a module's fixture may hold a loader for its tests
    yield
    deadline = time.monotonic() + _GRACE_S
    while _ours(before) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = _ours(before)
    if left:
        frames = sys._current_frames()
        where = []
        for t in left:
            stack = traceback.format_stack(frames[t.ident])[-2:] if t.ident in frames else []
            where.append(f"  {t.name}:\n" + "".join("    " + line for s in stack
                                                     for line in s.splitlines(True)))
        _left.append(f"{request.node.nodeid}: {len(left)} thread(s)\n" + "".join(where))
        if os.environ.get("PYTEST_XDIST_WORKER"):
            warnings.warn(LoaderThreadLeftWarning(_left[-1]), stacklevel=1)


def _forget_metric_labels() -> None:
    collector = sys.modules.get("autominato.telemetry.collector")
    handle = sys.modules.get("autominato.telemetry.handle")
    if collector is not None:
        with collector.COLLECTOR._lock:
            collector.COLLECTOR._retired.clear()
    if handle is not None:
        from autominato.telemetry.metrics import (
            CONTROLLER_DECISIONS,
            RANKED_HISTOGRAMS,
            STAGE_HISTOGRAMS,
        )

        with handle._live_lock:
            live = set(handle._live_ranks.values())
            for metric in (*STAGE_HISTOGRAMS, *RANKED_HISTOGRAMS, CONTROLLER_DECISIONS):
                with metric._lock:
                    for labels in [k for k in metric._metrics if k[-1] not in live]:
                        del metric._metrics[labels]


@pytest.fixture(autouse=True)
def _fresh_metric_labels():
    """Each test, and a module fixture made for it, begins as a fresh process would: no
    ``rank`` label keeps the counters and histograms of a closed loader of an earlier test (a
    label's next loader goes on from them, so that the series stay monotonic:
    ``autominato.telemetry.collector``). Tests of that carry make it within the test."""
    _forget_metric_labels()
    yield
    _forget_metric_labels()  # (before the next test's module fixtures are made)


@pytest.fixture(autouse=True, scope="module")
def _fresh_metric_labels_for_the_module():
    """As :func:`_fresh_metric_labels`, once the last module's fixtures closed their loaders."""
    _forget_metric_labels()
    yield


#: Test files by measured duration (a full ``make test``'s JUnit times, December 2026, 2 cores),
#: longest first: the order in which the xdist processes take them (longest first keeps
#: one long file from running alone at the end). Files not listed follow in their order.
_LONGEST_FIRST = ("ray", "test_workers", "test_bench", "test_parity", "test_memory",
                  "test_reliability", "test_monai", "test_seamless", "test_telemetry_metrics",
                  "test_monitor_report", "test_loader", "test_tune", "test_resume",
                  "test_lightning", "test_loader_edges", "test_tune_noise", "test_lead",
                  "test_worker_info", "test_iterable", "test_dashboards_prometheus",
                  "test_train", "test_bench_kits19")


def _group_of(path_stem: str) -> str:
    return "ray" if path_stem.startswith("test_ray") else path_stem


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {g: i for i, g in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda it: rank.get(_group_of(it.path.stem), len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)  # unknown to pytest without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``: work units of one file each, except the Ray files, which
    share one (xdist's own ``loadgroup`` marks do not work with pytest 9: xdist 3.8 renames
    items through ``Item._nodeid``, which pytest 9 no longer reads)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # keep _LONGEST_FIRST, not the most tests first

    class Groups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _group_of(os.path.splitext(os.path.basename(path))[0])

    return Groups(config, log)


class LoaderThreadLeftWarning(UserWarning):
    """A test left loader threads running (reported through the warnings summary, which
    pytest-xdist brings back from its worker processes)."""


def pytest_terminal_summary(terminalreporter):
    if _left:
        terminalreporter.section("loader threads left running after a test")
        for line in _left:
            terminalreporter.write_line(line)
