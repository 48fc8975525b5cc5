"""The controller thread around the rule, driven by a simulated loader (no worker processes)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from dataclasses import replace

import psutil
import pytest

from autominato.config import load_config, save_config
from autominato.control import Budget, Controller, Decision, Rule
from autominato.control.controller import MEMORY_FRACTION
from autominato.control.rule import CPU_SECONDS_KEY, WORKER_COUNT_KEY, WORKER_RSS_KEY
from autominato.control.sim import SimulatedLoader, Workload
from autominato.pipeline.knobs import Knobs

BOUNDS = {"depth": (1, 16), "read_threads": (1, 16), "workers": (1, 16), "pool_size": (4, 128)}


class SimLoader:
    """The surface of autominato.Loader that the controller uses, over a fluid model."""

    def __init__(self, workload: Workload, values: dict[str, int], config=None) -> None:
        self.knobs = Knobs(values, BOUNDS)
        self.sim = SimulatedLoader(workload, values)
        self.reported: list[Decision] = []
        self.config = config
        self.fail_next = 0

    def snapshot(self):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("snapshot exploded")
        self.sim.knobs = self.knobs.as_dict()
        return self.sim.step(1.0)

    def worker_pids(self) -> list[int]:
        return []

    def report_decision(self, decision: Decision) -> None:
        self.reported.append(decision)


def starved_loader() -> SimLoader:
    # CPU-bound transform, one worker for a consumer that wants eight workers' worth.
    return SimLoader(
        Workload(transform_s=0.1, step_s=0.05, cores=4),
        dict(depth=2, read_threads=1, workers=1, pool_size=16),
    )


def test_step_applies_logs_and_reports_each_decision(caplog):
    loader = starved_loader()
    ctl = Controller(loader, cores=4, memory_budget_bytes=1e12)
    with caplog.at_level(logging.INFO, logger="autominato.control"):
        for _ in range(30):
            ctl.step()
    assert loader.knobs.workers == 4  # the core limit
    assert [d.new for d in ctl.decisions] == [2, 4]
    assert loader.reported == ctl.decisions
    lines = [r.getMessage() for r in caplog.records if r.name == "autominato.control"]
    assert lines == [d.line() for d in ctl.decisions]
    assert lines[0].startswith("workers 1 -> 2 (transform_bound): idle ")


def test_decisions_are_clamped_to_the_live_bounds():
    class Greedy(Rule):
        def initial_state(self):
            return None

        def decide(self, history, bounds, budget, state):
            w = history[-1].knobs["workers"]
            return [Decision("workers", w, w + 100, "transform_bound")], state

    loader = starved_loader()
    ctl = Controller(loader, rule=Greedy(), cores=4, memory_budget_bytes=1e12)
    applied = ctl.step()
    assert applied == [Decision("workers", 1, 16, "transform_bound")]
    assert ctl.step() == []  # already at the bound: nothing changed, nothing reported
    assert len(loader.reported) == 1


def test_warm_start_from_a_tuned_configuration_file(tmp_path):
    path = save_config(
        {"knobs": {"workers": 3, "depth": 5}, "bounds": {"workers": [2, 6], "depth": [2, 8]}},
        tmp_path / "tuned.yaml",
    )
    loader = starved_loader()
    ctl = Controller(loader, config=path, cores=4)
    assert loader.knobs.workers == 3 and loader.knobs.depth == 5
    assert loader.knobs.bounds("workers") == (2, 6)
    assert loader.knobs.bounds("depth") == (2, 8)
    # The rule sees those bounds: it never drops workers below 2 however idle the workers.
    idle = SimLoader(Workload(transform_s=0.01, step_s=1.0, cores=8), loader.knobs.as_dict())
    idle.knobs = loader.knobs
    ctl.loader = idle
    for _ in range(300):
        ctl.step()
    assert loader.knobs.workers == 2


def test_warm_start_is_skipped_when_the_loader_applied_that_configuration(tmp_path):
    cfg = {"knobs": {"workers": 3}, "bounds": {"workers": [2, 6]}}
    loader = starved_loader()
    loader.config = load_config(cfg)
    loader.knobs.workers = 5  # an explicit argument that won over the file
    Controller(loader, config=cfg, cores=4)
    assert loader.knobs.workers == 5
    assert loader.knobs.bounds("workers") == BOUNDS["workers"]


def test_thread_runs_until_stopped():
    loader = starved_loader()
    ctl = Controller(loader, interval=0.01, cores=4, memory_budget_bytes=1e12).start()
    deadline = time.monotonic() + 30
    while len(ctl.history) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ctl.running and len(ctl.history) >= 20
    ctl.stop()
    assert not ctl.running
    assert not any(t.name == "autominato-controller" for t in threading.enumerate())
    n = len(ctl.history)
    time.sleep(0.05)
    assert len(ctl.history) == n
    assert loader.knobs.workers > 1


def test_a_failing_step_is_logged_and_the_thread_carries_on(caplog):
    loader = starved_loader()
    loader.fail_next = 2
    with caplog.at_level(logging.ERROR, logger="autominato.control"):
        with Controller(loader, interval=0.01, cores=4) as ctl:
            deadline = time.monotonic() + 30
            while len(ctl.history) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ctl.running
    failures = [r for r in caplog.records if "controller step failed" in r.getMessage()]
    assert len(failures) == 2
    assert "snapshot exploded" in failures[0].exc_text


def test_the_thread_ends_quietly_once_its_loader_is_collected(caplog):
    """Trial 115: a Loader collected without close() left its controller logging a
    ``ReferenceError`` traceback at every interval (its figures are read through a weak
    reference, which raises once the Loader is gone)."""
    loader = starved_loader()

    def gone():
        raise ReferenceError("the Loader was garbage-collected")

    loader.snapshot = gone
    with caplog.at_level(logging.DEBUG, logger="autominato.control"):
        ctl = Controller(loader, interval=0.01, cores=4).start()
        deadline = time.monotonic() + 10
        while ctl.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ctl.running
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("garbage-collected" in r.getMessage() for r in caplog.records)
    ctl.stop()


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval must be > 0"):
        Controller(starved_loader(), interval=0)


def test_history_keeps_totals_but_drops_the_recent_timing_rings():
    loader = starved_loader()
    real = loader.snapshot

    def with_rings():
        s = real()
        stages = {n: replace(st, recent_service_s=(0.1,) * 512) for n, st in s.stages.items()}
        return replace(s, stages=stages, consumer_wait_recent_s=(0.2,) * 512)

    loader.snapshot = with_rings
    ctl = Controller(loader, cores=4)
    ctl.step()
    s = ctl.history[-1]
    assert s.consumer_wait_recent_s == ()
    assert all(st.recent_service_s == () for st in s.stages.values())
    assert s.stages["transform"].items_total > 0
    assert {CPU_SECONDS_KEY, WORKER_RSS_KEY, WORKER_COUNT_KEY} <= set(s.extra)


def test_default_memory_budget_is_a_fraction_of_available_ram():
    ctl = Controller(starved_loader())
    expected = MEMORY_FRACTION * psutil.virtual_memory().available
    assert ctl.budget.memory_bytes == pytest.approx(expected, rel=0.2)
    assert isinstance(ctl.budget, Budget) and ctl.budget.cores >= 1


def test_history_carries_the_workers_cpu_and_private_memory():
    # A worker that burns 0.3 s of CPU and writes 64 MiB, says so, then sleeps.
    code = (
        "import time, sys\n"
        "x = bytearray(64 << 20)\n"
        "while time.process_time() < 0.3: pass\n"
        "print('done', flush=True)\n"
        "time.sleep(60)\n"
    )
    born = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    loader = starved_loader()
    real = loader.snapshot
    loader.snapshot = lambda: replace(real(), extra={})  # the simulator's own figures out
    loader.worker_pids = lambda: [child.pid]
    ctl = Controller(loader, cores=4, memory_budget_bytes=1e12)
    try:
        ctl.step()
        assert child.stdout.readline().strip() == "done"
        ctl.step()
        first, second = (s.extra for s in ctl.history)
        assert second[WORKER_COUNT_KEY] == 1.0
        assert second[WORKER_RSS_KEY] >= 32 << 20  # the 64 MiB it wrote is private memory
        burned = second[CPU_SECONDS_KEY]
        # The worker's whole 0.3 s (to the 10 ms clock tick), plus what it waited for a core
        # on this busy machine, which cannot exceed its life; not this process's CPU.
        assert 0.28 <= burned <= time.monotonic() - born + 0.05
        assert burned >= first[CPU_SECONDS_KEY]
    finally:
        child.kill()
        child.wait()
    ctl.step()
    gone = ctl.history[-1].extra
    assert gone[WORKER_COUNT_KEY] == 0.0
    assert gone[CPU_SECONDS_KEY] >= burned  # a worker leaving never makes the total go back
