"""The one windowed-rate measurement: built snapshots with known totals give exact rates."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autominato.pipeline.stats import LoaderSnapshot, StageSnapshot
from autominato.telemetry.window import Ring, between, idle_ratio, slim


def stage(name, t, items, service_s, *, nbytes=0, wait_s=0.0, workers=2, queue=(0, 0)):
    return StageSnapshot(
        name=name,
        time=t,
        items_total=items,
        bytes_total=nbytes,
        service_seconds_total=service_s,
        wait_seconds_total=wait_s,
        queue_len=queue[0],
        queue_capacity=queue[1],
        workers=workers,
        busy_workers=0,
        recent_service_s=(0.1,) * 4,
        recent_wait_s=(0.0,) * 4,
    )


def snap(t, *, batches, samples, wait, busy, h2d=(0, 0.0), stages=()):
    return LoaderSnapshot(
        time=t,
        stages={s.name: s for s in stages},
        consumer_wait_seconds_total=wait,
        consumer_wait_recent_s=(0.01,) * 8,
        consumer_busy_seconds_total=busy,
        batches_total=batches,
        samples_total=samples,
        epoch=0,
        stragglers_total=0,
        skipped_total=0,
        worker_restarts_total=0,
        h2d_bytes_total=h2d[0],
        h2d_seconds_total=h2d[1],
        knobs={"workers": 2},
        sample_bytes=0.0,
        pool_bytes=0,
    )


A = snap(
    100.0,
    batches=10,
    samples=40,
    wait=1.0,
    busy=4.0,
    h2d=(1000, 0.5),
    stages=[
        stage("read", 100.0, 40, 2.0, nbytes=4000, wait_s=0.5, workers=1),
        stage("transform", 100.0, 40, 8.0, workers=4, queue=(1, 8)),
    ],
)
# 4 s later: 20 more batches of 4 samples, 3 s of wait and 5 s of step; the transform stage
# served 80 items in 12 worker-seconds on 4 workers, the read stage 80 items in 2 s on 1.
B = snap(
    104.0,
    batches=30,
    samples=120,
    wait=4.0,
    busy=9.0,
    h2d=(9000, 2.5),
    stages=[
        stage("read", 104.0, 120, 4.0, nbytes=12000, wait_s=1.5, workers=1),
        stage("transform", 104.0, 120, 20.0, workers=4, queue=(6, 8)),
        stage("batch", 104.0, 30, 0.3, workers=1),
    ],
)


def test_rates_between_two_snapshots_are_the_differences_over_the_window():
    r = between(A, B)
    assert (r.start, r.end, r.seconds) == (100.0, 104.0, 4.0)
    assert (r.batches, r.samples) == (20, 80)
    assert r.samples_per_s == 20.0 and r.batches_per_s == 5.0
    assert r.samples_per_batch == 4.0
    assert (r.wait_s, r.busy_s) == (3.0, 5.0)
    assert r.idle_ratio == 3.0 / 8.0
    assert r.step_s == 0.25 and r.wait_per_batch_s == 0.15
    assert r.h2d_bytes == 8000 and r.h2d_s == 2.0 and r.h2d_bytes_per_s == 4000.0


def test_the_step_time_is_the_mean_of_the_steps_that_ended_in_the_window():
    """Steps of 2 s, a window of 15 s from mid-step to mid-step: 8 batches delivered, 7 steps
    ended (14 s), the parts of the two under way 0.9 s of busy time besides. The step time
    is 2.0 s, not busy / batches = 1.86 s (trial 125's Data Monitor read 1859.85 ms)."""
    a = replace(snap(10.0, batches=3, samples=6, wait=0.1, busy=5.0),
                consumer_steps_total=2, consumer_steps_seconds_total=4.0)
    b = replace(snap(25.0, batches=11, samples=22, wait=0.2, busy=19.9),
                consumer_steps_total=9, consumer_steps_seconds_total=18.0)
    r = between(a, b)
    assert (r.batches, r.steps, r.steps_s) == (8, 7, 14.0)
    assert r.step_s == 2.0
    assert r.busy_s / r.batches == pytest.approx(1.8625)  # what it read before
    old = between(snap(10.0, batches=3, samples=6, wait=0.1, busy=5.0),
                  snap(25.0, batches=11, samples=22, wait=0.2, busy=19.9))
    assert old.step_s == pytest.approx(1.8625)  # snapshots that do not count steps


def test_stage_rates_give_service_per_item_utilisation_throughput_and_fill():
    r = between(A, B)
    t = r.stages["transform"]
    assert (t.items, t.service_s, t.workers) == (80, 12.0, 4)
    assert t.mean_service_s == 12.0 / 80
    assert t.utilisation == 12.0 / (4.0 * 4)  # 0.75 of four workers busy
    assert t.items_per_s == 20.0
    assert t.fill == 6 / 8
    rd = r.stages["read"]
    assert rd.bytes == 8000 and rd.bytes_per_s == 2000.0 and rd.wait_s == 1.0
    assert rd.utilisation == 0.5 and rd.fill == 0.0  # no bounded queue
    # A stage the older snapshot lacks counts from zero (its counters start at zero).
    assert r.stages["batch"].items == 30 and r.stages["batch"].mean_service_s == 0.01


def test_utilisation_is_capped_and_zero_for_a_stage_without_workers():
    r = between(A, B)
    busy = replace(r.stages["read"], service_s=9.0)
    assert busy.utilisation == 1.0  # items begun before the window count whole
    assert replace(busy, workers=0).utilisation == 0.0


def test_an_empty_window_has_no_rates_rather_than_made_up_ones():
    r = between(B, B)
    assert r.batches == 0 and r.step_s == 0.0 and r.wait_per_batch_s == 0.0
    assert r.idle_ratio == 0.0 and r.h2d_bytes_per_s is None
    assert math.isnan(r.samples_per_s) and r.stages["transform"].mean_service_s is None


def test_from_the_start_the_totals_are_the_rates_and_the_length_is_unknown():
    r = between(None, B)
    assert (r.batches, r.samples, r.wait_s, r.busy_s) == (30, 120, 4.0, 9.0)
    assert r.idle_ratio == 4.0 / 13.0 == idle_ratio(4.0, 9.0)
    assert r.stages["transform"].mean_service_s == 20.0 / 120
    assert math.isnan(r.seconds) and math.isnan(r.samples_per_s)
    assert math.isnan(r.stages["transform"].utilisation)


def test_idle_ratio_is_wait_over_wait_plus_busy():
    assert idle_ratio(1.0, 3.0) == 0.25
    assert idle_ratio(0.0, 0.0) == 0.0


def test_slim_drops_the_rings_and_keeps_every_total():
    s = slim(B)
    assert s.consumer_wait_recent_s == () and s.stages["read"].recent_service_s == ()
    assert slim(replace(B, consumer_empty_recent=(True,) * 8)).consumer_empty_recent == ()
    assert between(A, s) == between(A, B)


def at(t, batches, wait, busy):
    return snap(t, batches=batches, samples=batches, wait=wait, busy=busy)


def test_ring_measures_over_the_window_nearest_its_length():
    ring = Ring(window_s=10.0)
    first = ring.add(at(0.0, 10, 1.0, 1.0))
    assert first.batches == 10 and math.isnan(first.seconds)  # nothing earlier: the start
    assert ring.add(at(5.0, 20, 1.0, 2.0)).batches == 10  # from t=0
    r = ring.add(at(12.0, 40, 2.0, 3.0))  # 12 s from t=0 is nearer 10 s than 7 s from t=5
    assert (r.start, r.batches) == (0.0, 30)
    r = ring.add(at(16.0, 44, 2.0, 3.5))  # 11 s from t=5 is nearer than 4 s from t=12
    assert (r.start, r.batches, r.idle_ratio) == (5.0, 24, 0.4)
    r = ring.add(at(40.0, 50, 2.0, 4.0))  # nothing within 10 s: the latest earlier, t=16
    assert (r.start, r.batches) == (16.0, 6)
    assert len(ring) == 2  # one snapshot outside the window kept, plus t=40


def test_a_window_of_jittered_scrapes_stays_near_its_length():
    """Trial 171: a 30 s window of 15 s scrapes took the oldest snapshot within it, 15 s or
    30 s back as the scrapes' jitter fell; every window is now 30 s give or take the jitter."""
    ring = Ring(window_s=30.0)
    t, lengths = 0.0, []
    for k in range(40):
        t += 15.0 + (0.02 if k % 2 else -0.02)
        r = ring.add(at(t, k, 1.0, 1.0))
        if k >= 2:
            lengths.append(r.seconds)
    assert min(lengths) > 29.9 and max(lengths) < 30.1, lengths


def test_ring_needs_a_positive_window():
    with pytest.raises(ValueError, match="> 0 seconds"):
        Ring(0.0)


def test_the_collectors_idle_gauge_keeps_its_value_while_no_batch_arrives():
    from autominato.telemetry.collector import SlidingWindow

    w = SlidingWindow(window_s=10.0)
    assert w.update(at(0.0, 10, 1.0, 3.0)) == (0.25, None)  # since the start
    assert w.update(at(5.0, 20, 3.0, 5.0)) == (0.5, None)  # 2 s wait, 2 s step since t=0
    # No batch for 30 s: nothing to measure, so the gauge keeps its last value.
    assert w.update(at(40.0, 20, 3.0, 5.0)) == (0.5, None)


def test_a_loaders_snapshots_count_the_steps_that_ended():
    """A loop of 0.1 s steps, snapshots taken mid-step: the window's step time is its ended
    steps' mean, the step under way left out of it (it counts in ``busy`` for the idle
    ratio)."""
    import time

    from autominato import Loader

    with Loader(list(range(40)), 2, workers=0, autotune=False) as loader:
        snaps = []
        for i, _ in enumerate(loader):
            time.sleep(0.05)
            if i in (3, 15):
                snaps.append(loader.snapshot())  # mid-step: 0.05 s into it
            time.sleep(0.05)
    a, b = snaps
    assert (a.consumer_steps_total, b.consumer_steps_total) == (3, 15)
    r = between(a, b)
    assert (r.batches, r.steps) == (12, 12)
    assert 0.095 <= r.step_s <= 0.13, r.step_s
    assert b.consumer_busy_seconds_total - b.consumer_steps_seconds_total >= 0.045  # under way


def test_a_thread_whose_schedstat_cannot_be_read_counts_no_wait_and_spoils_no_other():
    """Review 174: one thread's failure to open its schedstat (EMFILE) turned the reading
    off for every thread, whose items in flight then added minus their whole wait."""
    import threading

    from autominato.pipeline import stats

    if not stats._SCHEDSTAT:
        pytest.skip("no /proc/thread-self/schedstat here")
    before = stats.thread_cpu()
    got = {}

    def broken():
        def refuse(self):
            raise OSError(24, "Too many open files")

        real = stats._SchedStat.__init__
        stats._SchedStat.__init__ = refuse
        try:
            got["cpu"], got["wait"] = stats.thread_cpu()
        finally:
            stats._SchedStat.__init__ = real

    t = threading.Thread(target=broken)
    t.start()
    t.join()
    assert got["wait"] is None and got["cpu"] >= 0
    after = stats.thread_cpu()  # this thread's reading goes on
    assert after[1] is not None and after[1] >= before[1]
