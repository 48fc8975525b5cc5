"""A real Prometheus server scrapes a running loader's exporter."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_server import PrometheusServer, require_prometheus

from autominato import Loader


class Volumes:
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        time.sleep(0.002)
        return np.full((8, 8, 8), i, np.float32)


@pytest.mark.slow
def test_prometheus_scrapes_stage_latency_queue_fill_and_idle_of_a_running_loader():
    require_prometheus()
    stop = threading.Event()
    loader = Loader(
        Volumes(),
        batch_size=4,
        transform=lambda s, rng: s * 2.0,
        worker_kind="thread",
        workers=2,
        metrics_port=0,
        autotune=False,
        seed=0,
    )

    def train() -> None:
        while not stop.is_set():
            for _ in loader:
                time.sleep(0.005)  # the training step
                if stop.is_set():
                    return

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        with PrometheusServer([f"127.0.0.1:{loader._telemetry.port}"]) as prom:
            # The first sample lands after about 6 s with a 1 s scrape interval.
            latency = prom.wait_for(
                "histogram_quantile(0.9, sum by (le, stage) "
                '(autominato_stage_service_seconds_bucket{stage="read"}))',
                timeout=20.0,
            )
            fill = prom.wait_for("autominato_stage_queue_items", timeout=20.0)
            capacity = prom.wait_for("autominato_stage_queue_capacity_items", timeout=20.0)
            idle = prom.wait_for("autominato_accelerator_idle_ratio", timeout=20.0)
            items = prom.wait_for(
                'autominato_stage_items_total{stage="transform"} > 0', timeout=20.0
            )
            assert prom.targets_health() == ["up"]
    finally:
        stop.set()
        trainer.join(timeout=30)
        loader.close()

    # A read sleeps 2 ms: the p90 lies in the 2.5 ms or 5 ms bucket, certainly under 10 s.
    p90 = float(latency[0]["value"][1])
    assert 0.002 <= p90 <= 10.0
    assert {s["metric"]["stage"] for s in fill} == {"read", "transform", "batch", "transfer"}
    assert {s["metric"]["rank"] for s in fill} == {"0"}
    for s in fill:
        cap = next(c for c in capacity if c["metric"]["stage"] == s["metric"]["stage"])
        assert 0 <= float(s["value"][1]) <= max(float(cap["value"][1]), 1) * 2
    assert 0.0 <= float(idle[0]["value"][1]) <= 1.0
    assert float(items[0]["value"][1]) > 0
