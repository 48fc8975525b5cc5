"""Metrics of a loader whose reads run inside the transform worker processes (the default)."""

from __future__ import annotations

import time

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from autominato import Loader
from autominato.telemetry import REGISTRY, attach
from autominato.telemetry.cores import reads_fused


class Volumes:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        time.sleep(0.01)  # the read
        return np.full((4, 4, 4), i, np.float32)


def _samples(rank: str) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if s.labels.get("rank") == rank and "stage" in s.labels:
                out[(s.name, s.labels["stage"])] = s.value
    return out


def test_a_fused_read_exports_its_workers_and_no_false_bandwidth():
    # (prefetch_next_epoch=False: the figures of exactly one epoch's work)
    with Loader(Volumes(), batch_size=4, workers=2, autotune=False, seed=0,
                prefetch_next_epoch=False) as loader:
        handle = attach(loader)
        try:
            for _ in loader:
                pass
            snap = loader.snapshot()
            got = _samples(handle.rank)
        finally:
            handle.close()
    assert reads_fused(snap)
    # The read runs on the two transform workers: utilisation has a denominator.
    assert got[("autominato_stage_workers", "read")] == got[("autominato_stage_workers", "transform")] == 2
    assert got[("autominato_stage_items_total", "read")] == 16
    # The bytes read are not measured inside the workers: no series, not a bandwidth of 0.
    assert ("autominato_stage_bytes_total", "read") not in got
    assert got[("autominato_stage_bytes_total", "transform")] == 16 * 4 * 4 * 4 * 4
    # Read seconds were recorded per sample (>= the 10 ms sleep each).
    assert got[("autominato_stage_service_seconds_sum", "read")] >= 16 * 0.01


def test_cpu_demand_counts_a_spinning_worker_and_not_a_sleeping_one():
    import subprocess
    import sys

    from autominato.telemetry.cores import loader_cpu_seconds
    from autominato.telemetry.process import ProcessMeter

    def demand(code: str) -> tuple[float, float]:
        child = subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\n" + code],
                                 stdout=subprocess.PIPE, text=True)
        meter = ProcessMeter()
        try:
            assert child.stdout.readline().strip() == "up"  # past the interpreter's start-up
            before = meter.read([child.pid])
            time.sleep(1.0)
            after = meter.read([child.pid])
        finally:
            child.kill()
            child.wait()
        cpu = after.worker_cpu_seconds_total - before.worker_cpu_seconds_total
        return loader_cpu_seconds(after) - loader_cpu_seconds(before), cpu

    slept, _ = demand("import time; time.sleep(30)")
    spun, cpu = demand("while True: pass")
    assert slept < 0.05  # blocked, not runnable: no demand for a core
    # Runnable the whole 1 s: on a core or waiting for one (this machine is shared; a wait
    # still under way is not in /proc's schedstat yet: 0.45 s of 0.8 s was seen in a full run).
    assert spun >= cpu and spun >= 0.4
