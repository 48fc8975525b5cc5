"""The Data Monitor's diagnosis: pure rule on synthetic histories, then three real pipelines."""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from autominato.pipeline.stats import LoaderSnapshot, StageSnapshot
from autominato.telemetry import diagnose, format_report
from autominato.telemetry.cores import CPU_SECONDS_KEY
from autominato.telemetry.monitor import IDLE_THRESHOLD, SATURATED

B = 4  # samples per batch in the synthetic histories


def _stage(name: str, t: float, items: int, service_s: float, workers: int) -> StageSnapshot:
    return StageSnapshot(
        name=name,
        time=t,
        items_total=items,
        bytes_total=items * 1000,
        service_seconds_total=items * service_s,
        wait_seconds_total=0.0,
        queue_len=0,
        queue_capacity=0 if workers == 0 else 8,  # a read fused into the workers has no queue
        workers=workers,
        busy_workers=0,
    )


def snapshot(
    t: float,
    batches: int,
    *,
    step_s: float,
    wait_s: float,
    read_s: float = 0.001,
    transform_s: float = 0.001,
    collate_s: float = 0.0005,
    read_workers: int = 2,
    transform_workers: int = 2,
    h2d_s: float = 0.0,
    h2d_bytes_per_batch: int = 0,
    waits: tuple[float, ...] | None = None,
) -> LoaderSnapshot:
    """A steady pipeline after ``batches`` batches: every figure per batch times ``batches``."""
    samples = batches * B
    stages = {
        "read": _stage("read", t, samples, read_s, read_workers),
        "transform": _stage("transform", t, samples, transform_s, transform_workers),
        "batch": _stage("batch", t, batches, collate_s, 1),
    }
    if h2d_s:
        stages["transfer"] = _stage("transfer", t, batches, h2d_s, 1)
    return LoaderSnapshot(
        time=t,
        stages=stages,
        consumer_wait_seconds_total=batches * wait_s,
        consumer_wait_recent_s=waits if waits is not None else (wait_s,) * min(batches, 512),
        consumer_busy_seconds_total=batches * step_s,
        batches_total=batches,
        samples_total=samples,
        epoch=0,
        stragglers_total=0,
        skipped_total=0,
        worker_restarts_total=0,
        h2d_bytes_total=batches * h2d_bytes_per_batch,
        h2d_seconds_total=batches * h2d_s,
        knobs={
            "depth": 2,
            "read_threads": read_workers,
            "workers": transform_workers,
            "pool_size": 12,
        },
        sample_bytes=1000.0,
        pool_bytes=12000,
    )


def history(**kw) -> list[LoaderSnapshot]:
    return [snapshot(10.0, 100, **kw), snapshot(20.0, 200, **kw)]


def test_slow_read_is_io_bound_and_suggests_more_read_threads():
    # 50 ms per read x 4 samples / 2 threads = 100 ms per batch against a 10 ms step.
    d = diagnose(history(step_s=0.010, wait_s=0.090, read_s=0.050))
    assert d.kind == "io" and d.stage == "read"
    assert d.shares["read"] == pytest.approx(10.0)
    # ceil(2 x 10 / 0.8) = 25 readers would be needed: storage first, 4x the threads meanwhile.
    assert d.suggestion.startswith("faster storage")
    assert "needs about 25 readers" in d.suggestion and "read_threads 2 -> 8" in d.suggestion


def test_moderately_slow_read_suggests_the_read_threads_needed():
    # 6 ms x 4 samples / 2 threads = 12 ms per batch against a 10 ms step: share 1.2.
    d = diagnose(history(step_s=0.010, wait_s=0.002, read_s=0.006))
    assert d.kind == "io"
    assert d.suggestion.startswith("more readers (read_threads 2 -> 3)")


def test_slow_transform_is_cpu_bound_and_suggests_workers_up_to_the_cores(monkeypatch):
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 8)
    d = diagnose(history(step_s=0.010, wait_s=0.040, transform_s=0.025))
    assert d.kind == "cpu" and d.stage == "transform"
    assert d.shares["transform"] == pytest.approx(5.0)
    # ceil(2 x 5 / 0.8) = 13 workers would be needed; 8 cores cap the advice.
    assert "workers 2 -> 8" in d.suggestion
    assert "cheaper transforms" in d.suggestion


def test_cpu_bound_without_spare_cores_suggests_cheaper_transforms(monkeypatch):
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    d = diagnose(history(step_s=0.010, wait_s=0.040, transform_s=0.025))
    assert d.kind == "cpu"
    assert "no spare cores (2 usable)" in d.suggestion
    assert "cheaper transforms" in d.suggestion


def test_slow_copy_is_transfer_bound():
    d = diagnose(history(step_s=0.010, wait_s=0.010, h2d_s=0.020, h2d_bytes_per_batch=20_000_000))
    assert d.kind == "transfer" and d.stage == "transfer"
    bandwidth = next(r for r in d.rows if r.metric == "H2D bandwidth")
    assert bandwidth.current == pytest.approx(1e9)  # 20 MB in 20 ms
    assert bandwidth.threshold == pytest.approx(2e9)  # 20 MB must move within the 10 ms step
    assert bandwidth.status == "bad"
    assert "pinned" in d.suggestion


def test_slow_consumer_means_the_loader_keeps_up():
    d = diagnose(history(step_s=0.100, wait_s=0.001, read_s=0.010, transform_s=0.010))
    assert d.kind == "consumer" and d.stage is None
    assert d.idle_ratio == pytest.approx(0.001 / 0.101)


def test_a_consumer_bound_run_gets_fewer_workers_only_where_they_would_keep_up():
    # Fused reads: read + transform on the same 2 workers. 1 + 20 ms x 4 samples / 2 = 42 ms
    # of a 100 ms step: one worker would need 0.84 < 0.9, so one fewer would do.
    d = diagnose(history(step_s=0.100, wait_s=0.001, read_s=0.001, transform_s=0.020,
                         read_workers=0))
    assert d.kind == "consumer"
    assert "fewer workers would do" in d.suggestion and "0.84 with 1" in d.suggestion
    # 45 ms per sample: 0.92 of the step with both workers (trial 75 saw 0.99 and was told
    # fewer workers would do): one fewer would starve the training loop.
    d = diagnose(history(step_s=0.100, wait_s=0.001, read_s=0.001, transform_s=0.045,
                         read_workers=0))
    assert d.kind == "consumer"
    assert "fewer would make it the bottleneck" in d.suggestion
    assert "fewer workers would do" not in d.suggestion
    # The busiest stage is collation (one thread), the workers' needs 0.08: fewer would do
    # (review 76: the advice had looked at the collate thread's count).
    d = diagnose(history(step_s=0.100, wait_s=0.001, read_s=0.001, transform_s=0.003,
                         collate_s=0.030, read_workers=0))
    assert d.kind == "consumer" and max(d.shares, key=d.shares.get) == "batch"
    assert "fewer workers would do" in d.suggestion


def test_waiting_with_no_saturated_stage_is_synchronisation_bound():
    # Every stage needs at most half the step, yet a quarter of the time is idle: jitter.
    waits = (0.0, 0.0, 0.030) * 170  # one batch in three finds the queue empty
    d = diagnose(history(step_s=0.020, wait_s=0.007, read_s=0.005, transform_s=0.005, waits=waits))
    assert d.kind == "sync"
    assert max(d.shares.values()) < SATURATED
    assert "depth 2 -> 4" in d.suggestion
    queue = next(r for r in d.rows if r.metric == "queue wait share")
    assert queue.current == pytest.approx(1 / 3, abs=0.01)


def test_the_queue_wait_share_counts_the_batches_whose_next_found_none_ready():
    """Trial 180: a loader ahead of a slow step read 23-31 % queue wait share ("bad") at 1 %
    idle: its next() took over 1 ms to hand over a batch that was ready. Where the loader
    says which next() found no batch ready, those are the share; the waits above the floor
    only for a snapshot rebuilt from the exported metrics (no flags)."""
    waits = (0.0015,) * 510  # each next() 1.5 ms: over the 1 ms floor
    hist = history(step_s=0.050, wait_s=0.0015, waits=waits)
    row = lambda h: next(r for r in diagnose(h).rows if r.metric == "queue wait share")  # noqa: E731
    assert row(hist).current == pytest.approx(1.0)  # (rebuilt: the waits)
    flags = (False, False, False, True) * 128  # one in four found the queue empty
    hist = [replace(s, consumer_empty_recent=flags[: min(s.batches_total, 512)]) for s in hist]
    assert row(hist).current == pytest.approx(0.25)
    assert row(hist).mean == pytest.approx(0.25)


def test_thresholds_scale_with_the_measured_step_time():
    fast = diagnose(history(step_s=0.010, wait_s=0.0))
    slow = diagnose(history(step_s=0.040, wait_s=0.0))

    def limit(d):
        return next(r.threshold for r in d.rows if r.metric == "load latency")

    # A read may take step x read threads / samples per batch: 10 ms x 2 / 4.
    assert limit(fast) == pytest.approx(0.005)
    assert limit(slow) == pytest.approx(4 * limit(fast))


def with_cpu(hist: list[LoaderSnapshot], cores_used: float) -> list[LoaderSnapshot]:
    """``hist`` with the loader's CPU seconds in ``extra``: ``cores_used`` cores throughout."""
    return [replace(s, extra={CPU_SECONDS_KEY: cores_used * s.time}) for s in hist]


def fused_history(**kw) -> list[LoaderSnapshot]:
    # read.workers == 0: the transform workers read. Each share alone is under the
    # saturation limit, together they are over it.
    return history(step_s=0.010, wait_s=0.020, read_s=0.003, transform_s=0.0025,
                   read_workers=0, transform_workers=2, **kw)


def test_fused_read_and_transform_add_up_and_idle_cpu_means_io(monkeypatch):
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 8)
    d = diagnose(with_cpu(fused_history(), cores_used=0.5))  # 0.5 of 8 cores: workers wait
    assert d.shares["read"] < SATURATED and d.shares["transform"] < SATURATED
    assert d.kind == "io" and d.stage == "read"
    assert "workers 2 -> 3" in d.suggestion and "fuse_read=False" in d.suggestion
    share = next(r for r in d.rows if r.metric == "read+transform share")
    assert share.current == pytest.approx(1.1) and share.status == "bad"  # the table agrees


def test_fused_workers_that_wait_in_the_transform_are_told_so_not_sent_to_storage(monkeypatch):
    """Trial 111: a transform that slept (0.0 ms reads, idle CPU) was diagnosed I/O bound in
    the read, with faster storage as the fix."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 8)
    hist = history(step_s=0.010, wait_s=0.020, read_s=0.0001, transform_s=0.006,
                   read_workers=0, transform_workers=2)
    d = diagnose(with_cpu(hist, cores_used=0.2))
    assert d.kind == "io" and d.stage == "transform", format_report(d)
    assert "waiting in the transform: 6.0 ms a sample against the read's 0.1 ms" in d.summary
    assert "workers 2 -> 4" in d.suggestion and "storage" not in d.suggestion
    assert "I/O bound (transform)" in format_report(d)
    # where the read is the slower part, it stays the read's (the test above)
    assert diagnose(with_cpu(fused_history(), cores_used=0.5)).stage == "read"


@pytest.mark.parametrize("cpu", [1.9, None])
def test_a_cpu_heavy_fused_read_is_cpu_bound_not_io(monkeypatch, cpu):
    # Decompressing .nii.gz in the read (MONAI LoadImage) on a 2-core machine: the two
    # workers use ~2 cores. Without a CPU figure the fused pair is CPU work as well.
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    hist = fused_history()
    d = diagnose(with_cpu(hist, cpu) if cpu is not None else hist)
    # the read does most of the work (3.0 ms against 2.5): it is named (trial 159)
    assert d.kind == "cpu" and d.stage == "read"
    assert "faster storage" not in d.suggestion and "a cheaper read" in d.suggestion
    assert "no spare cores (2 usable)" in d.suggestion  # 2 workers on 2 cores already
    assert d.summary.startswith("reads and transforms (in the same workers: the read 3.0 ms "
                                "a sample, the transform 2.5 ms) take 1.10x")
    assert "CPU bound (read)" in format_report(d)
    # where the transform does most, it is the transform's, as before
    d = diagnose(with_cpu(history(step_s=0.010, wait_s=0.020, read_s=0.0025, transform_s=0.003,
                                  read_workers=0, transform_workers=2), cpu)
                 if cpu is not None else
                 history(step_s=0.010, wait_s=0.020, read_s=0.0025, transform_s=0.003,
                         read_workers=0, transform_workers=2))
    assert d.kind == "cpu" and d.stage == "transform" and "cheaper transforms" in d.suggestion
    assert d.summary.startswith("reads and transforms (in the same workers) take 1.10x")


def test_monitor_and_controller_agree_on_the_core_budget():
    """The worker count the report suggests is the one the controller's rule would grow to."""
    from autominato.control import Budget, StageBasedRule
    from autominato.control.rule import measure

    rule, budget = StageBasedRule(), Budget(cores=2)
    cores = rule.core_budget(budget)
    bounds = {"depth": (1, 16), "read_threads": (1, 16), "workers": (1, 32), "pool_size": (4, 128)}
    for cpu, expect in ((1.95, "no spare cores"), (0.3, "workers 2 -> ")):
        # A slow transform, 2 workers on 2 cores, consumer starved: 20 batches of 50 ms a second.
        hist = with_cpu([snapshot(float(t), 20 * t, step_s=0.010, wait_s=0.040,
                                  transform_s=0.025) for t in range(1, 12)], cpu)
        d = diagnose(hist, budget=cores)
        assert d.kind == "cpu" and expect in d.suggestion
        decisions, _ = rule.decide(hist, bounds, budget, rule.initial_state())
        grown = [x.new for x in decisions if x.knob == "workers"]
        w = measure(hist[0], hist[-1], hist)
        cap = cores.worker_cap(2, w.cpu_cores)
        if cpu > 1:
            assert grown == [] and cap == 2  # neither grows past the spent cores
        else:
            suggested = int(d.suggestion.split("workers 2 -> ")[1].split(",")[0])
            assert cap > 2 and grown and grown[0] <= cap and suggested <= cap


def test_current_window_is_the_last_two_snapshots_and_mean_is_since_start():
    early = snapshot(10.0, 100, step_s=0.010, wait_s=0.0, read_s=0.001)
    # Between 10 s and 20 s reads became 9 ms slower on average per sample.
    late = snapshot(20.0, 200, step_s=0.010, wait_s=0.0, read_s=0.001)
    late_read = _stage("read", 20.0, 800, 0.0, 2)
    late_read = StageSnapshot(
        **{**late_read.__dict__, "service_seconds_total": 400 * 0.001 + 400 * 0.010}
    )
    late = LoaderSnapshot(**{**late.__dict__, "stages": {**late.stages, "read": late_read}})
    row = next(r for r in diagnose([early, late]).rows if r.metric == "load latency")
    assert row.current == pytest.approx(0.010)
    assert row.mean == pytest.approx(0.0055)


def test_no_batches_yet_says_so():
    empty = snapshot(1.0, 0, step_s=0.0, wait_s=0.0)
    assert diagnose([empty]).kind == "none"


def test_empty_history_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        diagnose([])


def test_report_table_lists_every_figure_and_the_diagnosis():
    text = format_report(
        diagnose(history(step_s=0.010, wait_s=0.090, read_s=0.050)), title="Data Monitor (rank 3)"
    )
    assert text.startswith("Data Monitor (rank 3)")
    for name in (
        "load latency",
        "transform share",
        "H2D bandwidth",
        "queue wait share",
        "accelerator idle",
        "running mean",
        "threshold",
        "status",
    ):
        assert name in text
    # trial 71: the load time per sample was shown twice, as "load time" and "load latency"
    assert "load time" not in text and text.count("load latency") == 1
    assert "50.00 ms" in text  # the read latency
    assert "diagnosis: I/O bound (read)" in text
    assert "suggestion: faster storage" in text
    assert "\x1b[" not in text  # plain text for log files


# --- the real loader on three synthetic pipelines -------------------------------------------

N = 48


class Volumes:
    """Small arrays; ``read_s`` seconds of sleep per read (a slow disk)."""

    def __init__(self, read_s: float = 0.0) -> None:
        self.read_s = read_s

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if self.read_s:
            time.sleep(self.read_s)
        return np.full((8, 8, 8), i, np.float32)


def cheap(sample, rng):
    return sample


def heavy(sample, rng):
    # ~20 ms of pure-Python CPU work: a slow augmentation.
    t = time.perf_counter()
    x = 0
    while time.perf_counter() - t < 0.020:
        x += 1
    return sample + (x % 2)


def run_pipeline(dataset, transform, step_s: float) -> list[LoaderSnapshot]:
    """Two epochs; snapshots after the first epoch (warm) and at the end."""
    from autominato import Loader

    with Loader(
        dataset,
        batch_size=B,
        transform=transform,
        worker_kind="thread",
        workers=2,
        read_threads=2,
        autotune=False,
        seed=0,
    ) as loader:
        for _ in loader:
            time.sleep(step_s)
        warm = loader.snapshot()
        for _ in loader:
            time.sleep(step_s)
        return [warm, loader.snapshot()]


def test_real_pipeline_with_slow_read_is_io_bound():
    d = diagnose(run_pipeline(Volumes(read_s=0.030), cheap, step_s=0.002))
    assert d.kind == "io", format_report(d)
    assert d.shares["read"] > d.shares["transform"]


class Stragglers(Volumes):
    """Every tenth sample reads for 0.2 s, the others for 0.01 s: the mean load (0.029 s)
    hides the tail."""

    def __getitem__(self, i: int):
        time.sleep(0.2 if i % 10 == 3 else 0.01)
        return np.full((8, 8, 8), i, np.float32)


_LOADS = itertools.count()


class SlowFirstEpoch(Volumes):
    """Index 3 reads for 0.2 s among the first N loads (epoch 0), then 2 ms as the others."""

    def __getitem__(self, i: int):
        first_epoch = next(_LOADS) < N
        time.sleep(0.2 if i == 3 and first_epoch else 0.002)
        return np.full((8, 8, 8), i, np.float32)


def test_the_slowest_read_of_a_window_is_that_windows():
    """Review 110: the row showed the slowest of the whole ring, samples of earlier windows
    and epochs included; since the start (one snapshot) it is the ring's."""
    warm, end = run_pipeline(SlowFirstEpoch(), cheap, step_s=0.002)
    window = {r.metric: r for r in diagnose([warm, end]).rows}["slowest read"].current
    whole = {r.metric: r for r in diagnose([end]).rows}["slowest read"].current
    assert window < 0.1 and 0.2 <= whole < 0.3, (window, whole)


def slow_tenth(sample, rng):
    """Every tenth sample's transform takes 0.15 s, the others' nothing."""
    if int(sample[0, 0, 0]) % 10 == 7:
        time.sleep(0.15)
    return sample


def test_the_slowest_rows_are_the_slowest_samples_read_and_transform_times():
    d = diagnose(run_pipeline(Stragglers(), slow_tenth, step_s=0.002))
    rows = {r.metric: r for r in d.rows}
    assert 0.2 <= rows["slowest read"].current < 0.3, format_report(d)
    assert 0.15 <= rows["slowest transform"].current < 0.25, format_report(d)
    assert rows["load latency"].current < 0.1  # (the mean read: 0.029 s)
    assert "slowest transform" in format_report(d)


def test_real_pipeline_with_slow_transform_is_cpu_bound():
    d = diagnose(run_pipeline(Volumes(), heavy, step_s=0.002))
    assert d.kind == "cpu" and d.stage == "transform", format_report(d)


def test_real_pipeline_with_slow_consumer_is_consumer_bound():
    d = diagnose(run_pipeline(Volumes(), cheap, step_s=0.030))
    assert d.kind == "consumer", format_report(d)
    assert d.idle_ratio <= IDLE_THRESHOLD


def test_cpu_read_before_the_worker_processes_started_is_not_compared_with_theirs(monkeypatch):
    """The first snapshot of a loader comes before its worker processes exist: its CPU
    figure is this process's (imports, training loop), the next ones the workers' only.
    Their difference is no CPU figure (it read 0.00 cores, so a CPU-heavy fused read
    looked I/O-like and the controller's cap on workers went past the cores): the workers'
    own total, all spent since they started, is (without it the end-of-run report of a run
    shorter than the report interval had no CPU row with process workers)."""
    from autominato.control.controller import process_figures
    from autominato.telemetry.cores import cpu_cores_used
    from autominato.telemetry.process import ProcessUsage, Reading

    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    main = ProcessUsage(pid=1, root=True, cpu_s=30.0, rss_bytes=0, private_bytes=0,
                        pss_bytes=None)
    worker = ProcessUsage(pid=2, root=False, cpu_s=9.5, rss_bytes=0, private_bytes=0,
                          pss_bytes=None)
    before = process_figures(Reading(0.0, 30.0, (main,)))  # no worker process yet
    after = process_figures(Reading(10.0, 49.0, (main, worker), worker_cpu_seconds_total=19.0))
    a, b = fused_history()
    a, b = replace(a, extra=before), replace(b, extra=after)
    assert cpu_cores_used(a, b) == pytest.approx(19.0 / (b.time - a.time))
    assert cpu_cores_used(b, replace(a, time=b.time + 1.0)) is None  # workers gone: no figure
    d = diagnose([a, b])
    assert d.kind == "cpu" and "faster storage" not in d.suggestion
    [row] = [r for r in d.rows if r.metric == "loader CPU demand"]
    assert row.current == pytest.approx(19.0 / (b.time - a.time))


def test_reports_from_two_threads_take_their_snapshots_one_at_a_time():
    """The monitor's thread and ``TelemetryHandle.report()`` (or the final report after a
    join that timed out) may report at once: the process meter they share is not
    thread-safe, and two snapshots kept out of order make a window that runs backwards."""
    import itertools
    import threading

    from autominato.telemetry import DataMonitor

    guard, inside, most = threading.Lock(), [0], [0]
    clock = itertools.count(1)

    def snap() -> LoaderSnapshot:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            t = next(clock)
        time.sleep(0.2)  # long enough for the other report to come in
        with guard:
            inside[0] -= 1
        return snapshot(10.0 * t, 100 * t, step_s=0.010, wait_s=0.0)

    monitor = DataMonitor(snap, 60.0)  # not started: only the two reports below run
    threads = [threading.Thread(target=monitor.report) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert most[0] == 1
    times = [s.time for s in monitor.history()]
    assert times == sorted(times) and len(times) == 3


def test_work_done_ahead_of_delivery_does_not_inflate_the_shares_of_a_short_run():
    """After 5 batches of 2 samples, the workers have read and transformed 24 samples (the
    pool, the prefetched batches and the next epoch's speculative start): the work per
    delivered batch is still 2 samples' worth, as the controller counts it."""
    s = snapshot(10.0, 5, step_s=1.5, wait_s=0.05, read_s=0.03, transform_s=0.09)
    s = replace(s, samples_total=10, stages={
        "read": _stage("read", 10.0, 24, 0.03, 2),
        "transform": _stage("transform", 10.0, 24, 0.09, 2),
        "batch": _stage("batch", 10.0, 12, 0.02, 1),
    })
    d = diagnose([s])
    assert d.shares["transform"] == pytest.approx(0.09 * 2 / 2 / 1.5)
    assert d.shares["read"] == pytest.approx(0.03 * 2 / 2 / 1.5)
    assert d.shares["batch"] == pytest.approx(0.02 / 1.5)
    latency = next(r for r in d.rows if r.metric == "load latency")
    assert latency.threshold == pytest.approx(1.5 * 2 / 2)  # step x threads / samples per batch


def test_a_saturated_fused_pair_is_the_bottleneck_even_when_collate_has_the_largest_single_share():
    # Read 0.6 and transform 0.6 of the step on the same two workers (1.2 together, the
    # table's "bad" row), collate 0.7: the workers, not the prefetch depth, hold the loop up.
    kw = dict(step_s=0.010, wait_s=0.090, read_s=0.003, transform_s=0.003, collate_s=0.007,
              read_workers=0, transform_workers=2)
    from autominato.telemetry.cores import CoreBudget

    d = diagnose(with_cpu(history(**kw), 1.9), budget=CoreBudget(2))
    share = next(r for r in d.rows if r.metric == "read+transform share")
    assert share.status == "bad" and d.shares["batch"] > d.shares["read"]
    assert d.kind == "cpu" and d.stage == "transform"
    assert d.summary.startswith("reads and transforms (in the same workers) take 1.20x")


def test_the_report_says_what_was_not_delivered_and_only_then():
    """Skips and caught errors, as the loader counted them (since it started), under the
    window line; nothing when every sample was delivered."""
    early = snapshot(0.0, 10, step_s=0.1, wait_s=0.01)
    late = snapshot(5.0, 60, step_s=0.1, wait_s=0.01)
    assert "not delivered" not in format_report(diagnose([early, late]))
    late = replace(late, skipped_total=2, errors_raised_total=3, samples_lost_total=7)
    d = diagnose([early, late])
    assert (d.skipped, d.errors, d.lost) == (2, 3, 7)
    assert ("not delivered since the start: 2 samples skipped (on_error='skip'), 7 samples "
            "lost with 3 errors the training loop caught") in format_report(d)
    d = diagnose([early, replace(late, skipped_total=0, errors_raised_total=1,
                                 samples_lost_total=1)])
    assert ("not delivered since the start: 1 sample lost with 1 error the training loop "
            "caught\n") in format_report(d)


def _holding(hist: list[LoaderSnapshot], waited: float = 4.0) -> list[LoaderSnapshot]:
    """``hist`` with memory-aware dispatch holding samples: ``waited`` worker-seconds more
    idle for memory in the last snapshot than in the one before."""
    return [replace(s, samples_held_for_memory_total=5 + i,
                    memory_wait_seconds_total=1.0 + i * waited) for i, s in enumerate(hist)]


def test_advice_of_more_workers_or_a_separate_read_says_what_it_does_to_memory_aware_dispatch(
        monkeypatch):
    """Trial 54: the report advised workers 2 -> 8 and fuse_read=False while memory-aware
    dispatch held samples; more workers raise its budget (measured outliers then ran in
    pairs) and a separate read stage turns it off. The advice says so, and the memory line
    gives the window's idle share: 4 worker-s over 2 workers x 10 s = 20%."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 8)
    d = diagnose(_holding(with_cpu(fused_history(), cores_used=0.5)))
    assert d.kind == "io"
    assert "fuse_read=False, which turns memory-aware dispatch off" in d.suggestion
    assert "more workers raise its budget" in d.suggestion
    assert d.memory_wait_s == pytest.approx(4.0) and d.memory_wait_share == pytest.approx(0.2)
    assert "idled 4.0 s for it in the window (20% of the workers' time)" in format_report(
        d, width=400)
    d = diagnose(_holding(history(step_s=0.010, wait_s=0.040, transform_s=0.025)))
    assert d.kind == "cpu" and "workers 2 -> 8" in d.suggestion
    assert "more workers raise its budget" in d.suggestion
    # nothing held: the advice as before
    d = diagnose(with_cpu(fused_history(), cores_used=0.5))
    assert "memory-aware" not in d.suggestion and "fuse_read=False)" in d.suggestion


def test_a_slow_collate_is_collate_bound_and_names_collate_fn_not_workers(monkeypatch):
    """The batch stage is one thread of the training process: more workers or cheaper
    transforms do not shorten it (trial 145: the report advised both, "no spare cores",
    for a collate_fn that slept 150 ms)."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 8)
    d = diagnose(history(step_s=0.050, wait_s=0.100, collate_s=0.150))
    assert d.kind == "collate" and d.stage == "batch"
    assert d.shares["batch"] == pytest.approx(3.0)
    assert "150.0 ms a batch" in d.summary and "collate_fn" in d.suggestion
    assert "workers" not in d.suggestion.replace("in the workers", "")
    assert "cores" not in d.suggestion and "cheaper transforms" not in d.suggestion
    assert "diagnosis: collate bound (batch)" in format_report(d)


@pytest.mark.parametrize("slow", ["read_s", "transform_s"])
def test_num_workers_0_is_told_to_use_worker_processes_not_read_threads(monkeypatch, slow):
    """With num_workers=0 the training loop's thread loads each sample (no read thread): the
    advice is worker processes (trial 146: "read_threads 2 -> 8", which changed nothing)."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 8)
    history_ = [replace(s, knobs={**s.knobs, "workers": 0})
                for s in history(step_s=0.020, wait_s=0.200, transform_workers=0,
                                 **{slow: 0.050})]
    d = diagnose(history_)
    assert d.kind == ("io" if slow == "read_s" else "cpu")
    assert "read_threads" not in d.suggestion and "num_workers=" in d.suggestion
    assert "training loop's thread" in d.summary


def test_ray_actors_are_never_advised_beyond_the_clusters_free_cpus():
    """Each Ray actor takes a CPU: on a cluster of 2 free CPUs the Loader keeps 2 actors, so
    "workers 2 -> 4" (advised for I/O-like workers, which may outnumber the cores of one
    machine) could not be followed (trial 146)."""
    from autominato.telemetry.cores import CoreBudget

    placed = CoreBudget(2, placed=True)
    assert placed.worker_cap(2, 0.1) == 2 and CoreBudget(2).worker_cap(2, 0.1) > 2
    for hist in (fused_history(),  # the read is the larger part
                 history(step_s=0.010, wait_s=0.020, read_s=0.0001, transform_s=0.006,
                         read_workers=0, transform_workers=2)):  # the transform waits
        d = diagnose(with_cpu(hist, cores_used=0.2), budget=placed)
        assert d.kind == "io", format_report(d)
        assert "workers 2 ->" not in d.suggestion
        assert "no more workers fit: 2 the Ray cluster's free CPUs" in d.suggestion
        d = diagnose(with_cpu(hist, cores_used=0.2), budget=CoreBudget(2))
        assert "workers 2 -> " in d.suggestion  # one machine's I/O-like workers may


class DecodingReads(Volumes):
    """Reads that run on a CPU for 10 ms (decoding in Python) in place of waiting."""

    def __getitem__(self, i: int):
        t = time.thread_time()
        while time.thread_time() - t < 0.010:
            pass
        return np.full((8, 8, 8), i, np.float32)


def test_real_pipeline_with_reads_that_decode_in_read_threads_is_cpu_bound_not_io():
    """Trial 168: a read stage of its own (threads of the training process) whose reads burn
    CPU was "I/O bound ... faster storage": the CPU figure counted worker processes only."""
    decoding = run_pipeline(DecodingReads(), cheap, step_s=0.002)
    d = diagnose(decoding)
    assert (d.kind, d.stage) == ("cpu", "read"), format_report(d)
    assert "on or waiting for a CPU in the training process's 2 read thread(s)" in d.summary
    assert "faster storage" not in d.suggestion
    assert "worker_kind='process'" in d.suggestion  # (thread workers: run_pipeline's)
    # Two threads of a Python loop share the GIL: each runs on a CPU for about half its
    # reads' time (more where the machine is busy and they wait for a core too), the two
    # on about one core in all
    row = next(r for r in d.rows if r.metric == "read CPU demand")
    assert row.current > 0.3, format_report(d)
    # The same run with its CPU figures taken away reads as reads that wait: the CPU
    # figures are what tells them apart
    waits = [replace(s, stages={**s.stages, "read": replace(
        s.stages["read"], cpu_seconds_total=0.0, runqueue_seconds_total=0.0)})
        for s in decoding]
    assert diagnose(waits).kind == "io", format_report(diagnose(waits))


def test_a_read_stage_of_its_own_is_judged_by_its_cpu_demand():
    def with_cpu(share: float, kind: str, waited: float = 0.0, threads: int = 2,
                 read_s: float = 0.050) -> list[LoaderSnapshot]:
        out = []
        for s in history(step_s=0.010, wait_s=0.090, read_s=read_s, read_workers=threads):
            rd = s.stages["read"]
            rd = replace(rd, cpu_seconds_total=share * rd.service_seconds_total,
                         runqueue_seconds_total=waited * rd.service_seconds_total)
            out.append(replace(s, stages={**s.stages, "read": rd}, worker_kind=kind))
        return out

    assert diagnose(with_cpu(0.05, "process")).kind == "io"
    # A read that decodes on a busy machine runs for part of its time and waits for a core
    # for much of the rest (review 172: read as I/O bound)
    assert diagnose(with_cpu(0.25, "process", waited=0.5)).kind == "cpu"
    # 16 read threads, each on a CPU for 7 % of its reads: 0.84 cores in all, about the
    # GIL's ceiling: more read threads add nothing, and the verdict does not claim decoding
    d = diagnose(with_cpu(0.07, "process", threads=16, read_s=0.3))
    assert (d.kind, d.stage) == ("cpu", "read"), format_report(d)
    assert "0.84 cores in all" in d.summary and "more read threads add nothing" in d.summary
    assert "decoding" not in d.summary
    # ... where at 2 % (0.24 cores) they wait on storage
    assert diagnose(with_cpu(0.02, "process", threads=16, read_s=0.3)).kind == "io"
    # On a busy machine GIL-bound threads wait in the run queue too: 0.48 cores ran, 0.96
    # asked for (review 174: the ran figure alone read as waiting on storage)
    d = diagnose(with_cpu(0.04, "process", waited=0.04, threads=16, read_s=0.3))
    assert (d.kind, d.stage) == ("cpu", "read"), format_report(d)
    assert "0.96 cores in all" in d.summary
    d = diagnose(with_cpu(0.9, "process"))
    assert (d.kind, d.stage) == ("cpu", "read")
    assert "fuse_read=True (the default): each worker process reads" in d.suggestion
    assert "worker_kind='process'" in diagnose(with_cpu(0.9, "thread")).suggestion
    assert "Ray worker" in diagnose(with_cpu(0.9, "ray")).suggestion
    # Unknown (rebuilt from the metrics): both
    both = diagnose(with_cpu(0.9, "")).suggestion
    assert "fuse_read=True" in both and "worker_kind='process'" in both


def test_one_worker_busy_on_one_core_of_two_is_cpu_bound_not_io():
    """Trial 175: one worker (num_workers=1) spinning on a CPU in its read, on 2 cores,
    demand 1.00 of 2: "I/O bound (read) ... faster storage", where the controller grew the
    workers as transform-bound. The CPU is weighed against the workers where fewer."""
    from autominato.telemetry.cores import CoreBudget

    hist = history(step_s=0.010, wait_s=0.020, read_s=0.003, transform_s=0.0025,
                   read_workers=0, transform_workers=1)
    busy = diagnose(with_cpu(hist, cores_used=1.0), budget=CoreBudget(2))
    assert busy.kind == "cpu", format_report(busy)
    assert "storage" not in busy.suggestion
    # the same worker mostly waiting is I/O bound still
    waiting = diagnose(with_cpu(hist, cores_used=0.3), budget=CoreBudget(2))
    assert waiting.kind == "io" and "storage" in waiting.suggestion


def test_more_workers_than_the_controller_takes_says_how_to_get_them(monkeypatch):
    """Trial 180: 30 ms sleeping reads on 2 cores, the controller at its bound of 8 workers,
    and the report advised "workers 8 -> 32" without a word that the controller stops at 8:
    the advice names num_workers= where it goes past that bound, and only there."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    hist = history(step_s=0.002, wait_s=0.015, read_s=0.030, transform_s=0.0001,
                   read_workers=0, transform_workers=8)

    def bound(h: list[LoaderSnapshot], n: int) -> list[LoaderSnapshot]:
        return [replace(s, workers_bound=n) for s in with_cpu(h, cores_used=0.2)]

    d = diagnose(bound(hist, 8))
    assert d.kind == "io" and d.stage == "read", format_report(d)
    assert "workers 8 -> 32 (num_workers=32 given to the Loader: its online controller goes " \
        "no higher than 8 by itself: 4 a usable core, at least 8)" in d.suggestion
    # a configuration's bound (review 181: the default's was named where it was not the one)
    assert "no higher than 12 by itself: a configuration's bounds" in diagnose(
        bound(hist, 12)).suggestion
    # no controller (autotune=False): the advice alone
    assert "num_workers=" not in diagnose(bound(hist, 0)).suggestion
    # within the controller's bound: no such note
    hist = history(step_s=0.010, wait_s=0.010, read_s=0.006, transform_s=0.0001,
                   read_workers=0, transform_workers=2)
    d = diagnose(bound(hist, 8))
    assert d.kind == "io" and "workers 2 -> " in d.suggestion, format_report(d)
    assert "num_workers=" not in d.suggestion


def test_workers_that_wait_for_cores_more_than_they_run_are_not_sent_to_a_cheaper_read(
        monkeypatch):
    """Trial 180: 32 workers sleeping 30 ms in their reads on 2 cores, beside a step that
    spun on a core: "ran on or waited for 1.98 of 2 cores", 0.5 of it run, and the advice
    was "a cheaper read" (0.09 ms of CPU). Where the workers wait for a core more than they
    run, other work holds the cores: the advice says so; where they run, it is unchanged."""
    from autominato.telemetry.cores import CPU_OF_WORKERS_KEY, CPU_TIME_SECONDS_KEY

    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)

    def split(demand: float, ran: float) -> list[LoaderSnapshot]:
        hist = history(step_s=0.0039, wait_s=0.0027, read_s=0.0306, transform_s=0.0004,
                       read_workers=0, transform_workers=32)
        return [replace(s, knobs={**s.knobs, "workers": 32},
                        extra={CPU_SECONDS_KEY: demand * s.time,
                               CPU_TIME_SECONDS_KEY: ran * s.time, CPU_OF_WORKERS_KEY: 1.0})
                for s in hist]

    d = diagnose(split(1.98, 0.5))
    assert d.kind == "cpu" and d.stage == "read", format_report(d)
    assert "ran on or waited for 1.98 of 2 cores (ran on 0.50, waited runnable for 1.48)" \
        in d.summary
    assert d.suggestion.startswith("free cores for the workers: they waited for one more "
                                   "than they ran")
    assert "fewer workers: 32 take turns on 2 cores" in d.suggestion
    assert "a cheaper read helps only as far as it needs the CPU it waits for" in d.suggestion
    d = diagnose(split(1.98, 1.9))  # the workers run on the cores: the read's CPU is the cost
    assert d.kind == "cpu" and "free cores" not in d.suggestion
    assert "a cheaper read (less decoding" in d.suggestion


def test_one_worker_that_keeps_up_is_not_told_fewer_would_starve_the_loop():
    """Trial 182: "read+transform needs 0.00 of each step with 1 worker(s), so fewer would
    make it the bottleneck": fewer than one is no worker process at all."""
    hist = history(step_s=0.050, wait_s=0.0005, read_s=0.0001, transform_s=0.0001,
                   read_workers=0, transform_workers=1)
    d = diagnose([replace(s, knobs={**s.knobs, "workers": 1}) for s in hist])
    assert d.kind == "consumer", format_report(d)
    assert d.suggestion.startswith("nothing to change on the loader (read+transform needs")
    assert "fewer" not in d.suggestion


def test_the_readers_the_step_needs_are_said_uncapped(monkeypatch):
    """Trial 182: "the step needs about 74 readers" was the core budget's cap of the count,
    where the share called for 129."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    hist = history(step_s=0.002, wait_s=0.015, read_s=0.030, transform_s=0.0001,
                   read_workers=0, transform_workers=8)
    d = diagnose(with_cpu(hist, cores_used=0.2))
    share = d.shares["read"] + d.shares["transform"]
    assert f"needs about {math.ceil(8 * share / 0.8)} readers" in d.suggestion, d.suggestion


def test_a_slow_start_is_left_out_of_the_verdict_and_said_in_the_summary():
    """Trial 197: a 1.5 s worker_init_fn, then one batch of 69 waited: the idle (the first
    batch's wait) read "synchronisation bound: deeper prefetch", which changed nothing. The
    waits for cold passes' first batches are left out of the verdict's idle."""
    def cold(s: LoaderSnapshot, wait: float, starts: int = 1) -> LoaderSnapshot:
        return replace(s, consumer_wait_seconds_total=s.consumer_wait_seconds_total + wait,
                       cold_start_wait_seconds_total=wait, cold_starts_total=starts)

    steady = dict(step_s=0.050, wait_s=0.0005, read_s=0.005, transform_s=0.005)
    one = cold(snapshot(5.0, 69, **steady), 1.56)
    d = diagnose([one])
    assert d.idle_ratio > IDLE_THRESHOLD  # the row: the whole wait, the first batch's too
    assert d.kind == "consumer", format_report(d)
    assert "1.56 s of it for the first batch of 1 pass that started cold" in d.summary
    assert "prefetch_next_epoch" not in d.suggestion  # one cold start: the first
    rows = {r.metric: r for r in d.rows}
    assert rows["cold-start wait"].mean == pytest.approx(1.56 / (69 * 0.0505 + 1.56))
    # Without the figure (an exporter from before it) the same history reads as before.
    assert diagnose([replace(one, cold_start_wait_seconds_total=0.0)]).kind == "sync"
    # Every epoch cold (persistent_workers=False): the advice names the defaults that fix it.
    every = diagnose([cold(snapshot(5.0, 69, **steady), 1.56, starts=6)])
    assert every.kind == "consumer" and "persistent_workers=True" in every.suggestion
    # An iterable dataset's passes all start cold, whatever the settings (trial 199)
    stream = diagnose([replace(cold(snapshot(5.0, 69, **steady), 1.56, starts=6), iterable=True)])
    assert "do it once, in __init__ or worker_init_fn, with persistent_workers=True" \
        in stream.suggestion
    # Two cold starts among 100 epochs (one left early) are no cold epochs (review 198)
    rare = diagnose([replace(cold(snapshot(5.0, 69, **steady), 1.56, starts=2), epoch=99)])
    assert rare.kind == "consumer" and "persistent_workers" not in rare.suggestion
    # A pipeline that is slow between the cold starts too is still diagnosed on that.
    slow = diagnose([cold(snapshot(5.0, 69, step_s=0.010, wait_s=0.040, read_s=0.001,
                                   transform_s=0.025), 1.56)])
    assert slow.kind == "cpu", format_report(slow)
    # Review 198: passes all short (a loop of next(iter(loader))) are all cold starts; a
    # pipeline far slower than the step is no consumer-bound one for that.
    short = diagnose([cold(snapshot(5.0, 69, step_s=0.010, wait_s=0.0005, read_s=0.001,
                                    transform_s=0.5), 30.0, starts=69)])
    assert short.kind == "cpu", format_report(short)


def test_the_cpu_demand_leaves_out_the_wait_for_a_cold_pass(monkeypatch):
    """Trial 199: a CPU-bound transform after a 4 s worker_init_fn read 0.73 of 2 cores over
    its window (the workers asleep for most of it) and was "I/O bound (transform)", told to
    add workers beyond the cores. The CPU demand is over the time not spent waiting for a
    cold pass's first batch."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    a = snapshot(10.0, 10, step_s=0.010, wait_s=0.040, read_s=0.0001, transform_s=0.020,
                 read_workers=0)
    b = snapshot(15.0, 110, step_s=0.010, wait_s=0.0001, read_s=0.0001, transform_s=0.020,
                 read_workers=0)
    # 4 s of the 5 s window waited for the first batch; the workers ran 1.9 cores the rest
    a = replace(a, extra={CPU_SECONDS_KEY: 10.0})
    b = replace(b, extra={CPU_SECONDS_KEY: 11.9}, cold_starts_total=1,
                cold_start_wait_seconds_total=4.0,
                consumer_wait_seconds_total=a.consumer_wait_seconds_total + 4.2)
    d = diagnose([a, b])
    assert (d.kind, d.stage) == ("cpu", "transform"), format_report(d)
    row = next(r for r in d.rows if r.metric == "loader CPU demand")
    # 1.9 CPU-s over the 1 s not waited and the 40.2 ms that the first batch takes the
    # stages (4 samples of 0.1 + 20 ms on 2 workers)
    assert row.current == pytest.approx(1.9 / (5.0 - 4.0 + 0.0402))
    # the same window without the cold wait: its 0.38 cores read as workers that wait
    assert diagnose([a, replace(b, cold_start_wait_seconds_total=0.0)]).kind == "io"


def test_a_loop_of_short_passes_is_not_read_as_cpu_work_for_its_cold_waits(monkeypatch):
    """Review 200: where every pass is short (20 cold passes of one batch in 5 s), the cold
    waits are the samples' own making, not a start-up: the workers' 0.16 of 2 cores read
    1.6 once those waits were taken out of the window, and a transform that sleeps was
    "CPU bound: no spare cores"."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    kw = dict(step_s=0.010, wait_s=0.0, read_s=0.001, transform_s=0.12, read_workers=0)
    a = replace(snapshot(10.0, 100, **kw), extra={CPU_SECONDS_KEY: 10.0}, cold_starts_total=100,
                cold_start_wait_seconds_total=24.0, consumer_wait_seconds_total=24.0)
    b = replace(snapshot(15.0, 120, **kw), extra={CPU_SECONDS_KEY: 10.8}, cold_starts_total=120,
                cold_start_wait_seconds_total=28.8, consumer_wait_seconds_total=28.8)
    d = diagnose([a, b])
    assert d.kind == "io", format_report(d)
    row = next(r for r in d.rows if r.metric == "loader CPU demand")
    assert row.current == pytest.approx(0.16)


def test_the_cold_start_wait_is_the_first_batchs_wait_of_each_cold_pass():
    """The counter's truth on a real loader: a worker_init_fn of 0.6 s makes the first
    batch wait, the epoch's other batches are ready; persistent_workers=False starts every
    epoch cold. The counter equals the first next()'s waits, measured here, and the report
    calls the run consumer bound."""
    from autominato import Loader

    def init(_):
        time.sleep(0.6)

    with Loader(Volumes(), batch_size=B, num_workers=2, worker_init_fn=init,
                persistent_workers=False, autotune=False, seed=0) as loader:
        firsts, mid = [], []
        for epoch in range(2):
            it = iter(loader)  # (outside the clock: the wait is next()'s)
            if epoch == 1:
                # a snapshot while the loop waits for the first batch counts the wait so far
                # as cold-start wait too (review 198: a report window ending there read the
                # whole of it as the pipeline's)
                before = loader.snapshot()
                timer = threading.Timer(0.3, lambda: mid.append(loader.snapshot()))
                timer.start()
            t = time.monotonic()
            for i, _ in enumerate(it):
                if i == 0:
                    firsts.append(time.monotonic() - t)
                time.sleep(0.03)
        timer.join()
        s = loader.snapshot()
    assert s.cold_starts_total == 2
    assert min(firsts) > 0.5  # (the worker_init_fn's sleep)
    assert s.cold_start_wait_seconds_total == pytest.approx(sum(firsts), abs=0.01)
    assert s.cold_start_wait_seconds_total <= s.consumer_wait_seconds_total
    grew = mid[0].cold_start_wait_seconds_total - before.cold_start_wait_seconds_total
    waited = mid[0].consumer_wait_seconds_total - before.consumer_wait_seconds_total
    assert grew >= 0.25 and grew == pytest.approx(waited, abs=0.01)
    d = diagnose([s])
    assert d.kind == "consumer", format_report(d)
    assert "persistent_workers=True" in d.suggestion


class SlowStream(torch.utils.data.IterableDataset):
    """48 samples, each after a 20 ms wait (storage), shared among the workers."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(k, N, n):
            time.sleep(0.02)
            yield np.full((8, 8, 8), i, np.float32)


def test_an_io_bound_iterable_dataset_is_not_advised_a_read_stage_it_cannot_have():
    """Trial 197: the advice for an I/O-bound IterableDataset named fuse_read=False, which
    does nothing there (its workers iterate it), and the Loader took fuse_read=False without
    a word."""
    from autominato import Loader
    from autominato.control.controller import process_figures
    from autominato.telemetry.process import ProcessMeter

    meter, snaps = ProcessMeter(), []
    with Loader(SlowStream(), batch_size=B, num_workers=2, autotune=False) as loader:
        for epoch in range(3):
            for _ in loader:
                time.sleep(0.001)
            if epoch != 1:
                # (the workers' CPU, as the monitor reads it: they mostly wait; over two
                # epochs, ~1 s: one of ~0.5 s is near MIN_CPU_WINDOW_S, below which no CPU
                # figure is read, and a pair without one reads CPU bound: review 198)
                figures = process_figures(meter.read(list(loader.worker_pids())))
                snaps.append(replace(loader.snapshot(), extra=figures))
    assert snaps[-1].iterable
    d = diagnose(snaps)
    assert d.kind == "io", format_report(d)
    assert "fuse_read" not in d.suggestion
    with pytest.warns(UserWarning, match="fuse_read=False does not apply to SlowStream"):
        Loader(SlowStream(), batch_size=B, num_workers=2, fuse_read=False).close()


def test_a_cpu_bound_verdict_says_when_the_workers_spend_their_cpu_in_the_kernel(monkeypatch):
    """Workers that spend 30% or more of their CPU time in the kernel (the KiTS19 bench:
    45-50%, fresh pages zeroed after the memory given back between samples) are told that
    ``memory_aware=False`` keeps their freed heaps warm; not below that share, not where
    they keep them already (``memory_aware=False``), nor where it would change nothing
    (``warm_heap=False``, an allocator the environment tunes: review 202), nor for thread
    workers."""
    import re

    from autominato.telemetry.cores import (
        CPU_OF_WORKERS_KEY,
        CPU_TIME_SECONDS_KEY,
        KERNEL_SECONDS_KEY,
    )

    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)

    def run(kernel: float, aware: bool = True, warm: bool = True, kind: str = "process",
            budget: float = 0.0, **kw):
        hist = history(**{"step_s": 0.010, "wait_s": 0.040, "transform_s": 0.025, **kw})
        return diagnose([replace(s, worker_kind=kind, memory_aware=aware, warm_heap=warm,
                                 sample_memory_budget_bytes=budget,
                                 extra={CPU_SECONDS_KEY: 1.95 * s.time,
                                        CPU_TIME_SECONDS_KEY: 1.9 * s.time,
                                        KERNEL_SECONDS_KEY: kernel * 1.9 * s.time,
                                        CPU_OF_WORKERS_KEY: 1.0})
                         for s in hist])

    d = run(0.47)
    assert d.kind == "cpu" and d.stage == "transform", format_report(d)
    assert ("the workers spent 47% of their CPU time in the kernel" in d.suggestion
            and "memory_aware=False keeps each worker's freed heap warm" in d.suggestion)
    row = next(r for r in d.rows if r.metric == "workers' kernel time")
    assert row.current == pytest.approx(0.47)
    assert re.search(r"workers' kernel time\s.*47%", format_report(d, width=200))
    for quiet in (run(0.2), run(0.47, aware=False), run(0.47, warm=False),
                  run(0.47, kind="thread")):
        assert quiet.kind == "cpu" and "kernel" not in quiet.suggestion
    # Fused reads (memory-aware dispatch): not before its figures, when the defaults' warm
    # heap is not decided yet (trial 201: 63% in the first report, 0-1% a window later)
    fused = {"read_workers": 0, "read_s": 0.001}
    assert "kernel" not in run(0.47, **fused).suggestion
    assert "spent 47% of their CPU time in the kernel" in run(0.47, budget=1e9, **fused).suggestion
    # a verdict that names the read: the kernel's part is likely the file reads (trial 201)
    d = run(0.94, budget=1e9, read_workers=0, read_s=0.030, transform_s=0.001)
    assert (d.kind, d.stage) == ("cpu", "read") and "kernel" not in d.suggestion, d.suggestion
    # no kernel figure (a remote exporter before December 2026, no worker process): no row
    d = diagnose(with_cpu(history(step_s=0.010, wait_s=0.040, transform_s=0.025), 1.95))
    assert all(r.metric != "workers' kernel time" for r in d.rows)
    # a first snapshot from before the workers existed (this process's CPU, no kernel figure:
    # a short run's end-of-run report) reads the later one's totals (review 202: no row)
    hist = history(step_s=0.010, wait_s=0.040, transform_s=0.025)
    a = replace(hist[0], worker_kind="process", memory_aware=True, warm_heap=True,
                extra={CPU_SECONDS_KEY: 3.0, CPU_TIME_SECONDS_KEY: 3.0, CPU_OF_WORKERS_KEY: 0.0})
    b = replace(hist[1], worker_kind="process", memory_aware=True, warm_heap=True,
                extra={CPU_SECONDS_KEY: 19.5, CPU_TIME_SECONDS_KEY: 19.0,
                       KERNEL_SECONDS_KEY: 9.5, CPU_OF_WORKERS_KEY: 1.0})
    d = diagnose([a, b])
    row = next(r for r in d.rows if r.metric == "workers' kernel time")
    assert row.current == pytest.approx(0.5) and "spent 50% of their CPU" in d.suggestion


def test_thread_workers_short_of_the_cores_are_pointed_to_process_workers(monkeypatch):
    """A CPU-bound transform in thread workers that use under 0.9 of the cores is held by the
    GIL (trial 201: a Python transform, 1.21 of 2 cores, was told "no spare cores")."""
    monkeypatch.setattr("autominato.telemetry.monitor.usable_cores", lambda: 2)
    hist = history(step_s=0.010, wait_s=0.040, transform_s=0.025)
    d = diagnose([replace(s, worker_kind="thread") for s in with_cpu(hist, 1.21)])
    assert d.kind == "cpu" and d.stage == "transform", format_report(d)
    assert d.suggestion.startswith("worker_kind='process' (thread workers share the training "
                                   "process's GIL"), d.suggestion
    assert "here 1.21 of 2" in d.suggestion
    for s in ([replace(s, worker_kind="thread") for s in with_cpu(hist, 1.95)],
              [replace(s, worker_kind="process") for s in with_cpu(hist, 1.21)]):
        assert "worker_kind='process'" not in diagnose(s).suggestion
