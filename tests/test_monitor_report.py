"""The Data Monitor in the logs, its environment switch, and ``autominato monitor URL``."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from autominato import Loader
from autominato.cli import main as cli_main
from autominato.telemetry import DataMonitor
from autominato.telemetry.handle import monitor_interval_from_env
from autominato.telemetry.remote import metrics_url


class Volumes:
    """``n`` samples; sample i: (4, 4, 4) float32 of i, after ``read_s`` of sleep (also
    tests/test_tune_measure.py's)."""

    def __init__(self, n: int = 24, read_s: float = 0.0) -> None:
        self.n, self.read_s = n, read_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.read_s:
            time.sleep(self.read_s)
        return np.full((4, 4, 4), i, np.float32)


def reports(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "autominato.monitor"]


def test_reports_come_at_most_every_interval_plus_one_at_the_end_whatever_the_epochs(caplog):
    caplog.set_level(logging.INFO, logger="autominato.monitor")
    interval = 0.5
    t0 = time.monotonic()
    with Loader(
        Volumes(n=4, read_s=0.002),
        batch_size=2,
        worker_kind="thread",
        monitor_interval=interval,
        autotune=False,
        seed=0,
    ) as loader:
        epochs = 0
        while time.monotonic() - t0 < 1.6 or epochs < 3:  # many 2-batch epochs
            loader.set_epoch(epochs)
            batches = iter(loader)
            while True:
                asked = time.time()  # LogRecord.created's clock, before the batch is counted
                if next(batches, None) is None:
                    break
                last_asked = asked
                time.sleep(0.005)
            epochs += 1
    elapsed = time.monotonic() - t0
    records = [r for r in caplog.records if r.name == "autominato.monitor"]
    texts = reports(caplog)
    assert epochs > 10
    # One per full interval (the thread may lag, never lead) and the end-of-run one.
    assert 1 <= len(texts) <= int(elapsed / interval) + 1
    if "end of run" not in texts[-1]:
        # The end-of-run report is left out only when no batch came after the last periodic
        # one (a lagging monitor thread took its snapshot after the last batch was counted).
        assert records[-1].created >= last_asked
    assert not any("end of epoch" in t for t in texts)
    for text in texts:
        assert "accelerator idle" in text and "diagnosis:" in text and "suggestion:" in text
        assert "window 0.0 s" not in text


def test_data_monitor_rejects_a_non_positive_interval():
    with pytest.raises(ValueError, match="interval must be > 0"):
        DataMonitor(lambda: None, 0)  # type: ignore[arg-type,return-value]


def test_environment_switch_turns_the_monitor_on_without_code_changes(monkeypatch, caplog):
    monkeypatch.setenv("AUTOMINATO_DATA_MONITOR", "1")
    monkeypatch.setenv("AUTOMINATO_DATA_MONITOR_INTERVAL", "0.25")
    caplog.set_level(logging.INFO, logger="autominato.monitor")
    with Loader(Volumes(), batch_size=4, worker_kind="thread", autotune=False) as loader:
        assert loader._telemetry is not None
        assert loader._telemetry.monitor.interval == 0.25
        assert loader._telemetry.exporter is None  # the monitor alone, no HTTP port
        list(loader)
    assert any("end of run" in t for t in reports(caplog))


@pytest.mark.parametrize(
    ("flag", "interval", "expected"),
    [("", "", None), ("0", "5", None), ("1", "", 5.0), ("true", "2.5", 2.5)],
)
def test_monitor_interval_from_env(monkeypatch, flag, interval, expected):
    monkeypatch.setenv("AUTOMINATO_DATA_MONITOR", flag)
    monkeypatch.setenv("AUTOMINATO_DATA_MONITOR_INTERVAL", interval)
    assert monitor_interval_from_env() == expected


def test_a_bad_interval_in_the_environment_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AUTOMINATO_DATA_MONITOR", "1")
    monkeypatch.setenv("AUTOMINATO_DATA_MONITOR_INTERVAL", "soon")
    with pytest.raises(ValueError, match="AUTOMINATO_DATA_MONITOR_INTERVAL='soon'"):
        monitor_interval_from_env()


def test_metrics_url_completes_host_port_and_path():
    assert metrics_url("node7:9464") == "http://node7:9464/metrics"
    assert metrics_url("http://node7:9464") == "http://node7:9464/metrics"
    assert metrics_url("https://x/y/metrics") == "https://x/y/metrics"


class DecodingVolumes(Volumes):
    """Reads that run on a CPU for ``read_s`` (decoding) in place of sleeping."""

    def __getitem__(self, i: int):
        t = time.thread_time()
        while time.thread_time() - t < self.read_s:
            pass
        return np.full((4, 4, 4), i, np.float32)


@pytest.mark.parametrize("decode", [False, True], ids=["wait", "decode"])
def test_autominato_monitor_prints_the_report_of_a_running_loader(capsys, decode):
    stop = threading.Event()
    # Slow reads and a fast step: the remote report must find the same bottleneck as the
    # training process's, I/O bound where the reads wait, CPU bound where they decode (trial
    # 168: both were "I/O bound").
    loader = Loader(
        (DecodingVolumes if decode else Volumes)(n=32, read_s=0.02),
        batch_size=4,
        transform=lambda s, rng: s,
        worker_kind="thread",
        workers=2,
        read_threads=2,
        metrics_port=0,
        autotune=False,
        seed=0,
    )

    def train() -> None:
        while not stop.is_set():
            for _ in loader:
                time.sleep(0.001)
                if stop.is_set():
                    return

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        rc = cli_main(["monitor", f"127.0.0.1:{loader._telemetry.port}", "--interval", "1.5"])
    finally:
        stop.set()
        trainer.join(timeout=30)
        loader.close()
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("Data Monitor (rank 0)")
    assert "load latency" in out and "queue wait share" in out
    assert ("diagnosis: CPU bound (read)" if decode else "diagnosis: I/O bound (read)") in out, out
    assert "read CPU demand" in out


class _Work:
    """Each sample sleeps (``burn=False``) or burns ``seconds`` of CPU (``burn=True``)."""

    def __init__(self, n: int, seconds: float, burn: bool) -> None:
        self.n, self.seconds, self.burn = n, seconds, burn

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.burn:
            t = time.thread_time()
            while time.thread_time() - t < self.seconds:
                pass
        else:
            time.sleep(self.seconds)
        return np.full(4, i, np.float32)


def _scrape_cpu(url: str) -> float:
    from autominato.telemetry.remote import _get, _samples, fetch

    return _get(_samples(fetch(url)), "autominato_loader_cpu_seconds_total", rank="0")


@pytest.mark.parametrize("burn", [False, True])
def test_the_loader_cpu_time_exported_is_what_its_workers_spent(burn):
    # 24 samples of 40 ms: burnt, the workers' CPU is at least 0.96 s; slept, it is about 0.
    with Loader(_Work(24, 0.04, burn), 4, workers=2, autotune=False, seed=0,
                metrics_port=0) as loader:
        assert sorted(int(x) for b in loader for x in b[:, 0]) == list(range(24))
        cpu = _scrape_cpu(loader._telemetry.url)
    if burn:
        assert 0.9 * 24 * 0.04 <= cpu < 24 * 0.04 + 3.0, cpu
    else:
        assert 0 <= cpu < 0.3 * 24 * 0.04, cpu  # (CPU time in 10 ms ticks: 0 is true)


class _FreshPages:
    """Each sample writes two fresh 64 MiB arrays (mapped on their own, unmapped when freed):
    the kernel faults in and zeroes every page."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        for _ in range(2):
            a = np.ones(64 << 20, np.uint8)
            del a
        return np.full(4, i, np.float32)


def test_the_workers_kernel_time_exported_is_their_system_time():
    """``autominato_loader_cpu_system_seconds_total`` is the workers' system time (psutil's
    reading of the same processes, within ticks), and for samples that take fresh pages it
    is most of their CPU time (``warm_heap=False``: every freed page goes back)."""
    import psutil

    from autominato.telemetry.remote import _get, _samples, fetch

    with Loader(_FreshPages(), 4, workers=2, autotune=False, seed=0, warm_heap=False,
                prefetch_next_epoch=False, metrics_port=0) as loader:
        assert sorted(int(x) for b in loader for x in b[:, 0]) == list(range(16))
        got = _samples(fetch(loader._telemetry.url))
        system = sum(psutil.Process(p).cpu_times().system for p in loader.worker_pids())
    kernel = _get(got, "autominato_loader_cpu_system_seconds_total", rank="0")
    cpu = _get(got, "autominato_loader_cpu_seconds_total", rank="0")
    assert kernel == pytest.approx(system, abs=0.05)
    assert 0.3 * cpu <= kernel <= cpu, (kernel, cpu)


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat")
                    or not hasattr(os, "sched_setaffinity"), reason="no Linux schedstat")
def test_workers_on_one_core_export_the_cpu_they_ran_apart_from_their_run_queue_wait():
    # Two workers that burn CPU, held to one core: together they run on it for about the
    # wall time, and one of them waits runnable meanwhile. autominato_loader_cpu_seconds_total
    # counted the wait too (rate() read two cores used of the one); now it is CPU time, and
    # the wait is its own counter.
    from autominato.telemetry.remote import _get, _samples, fetch

    def scrape(url: str) -> tuple[float, float]:
        got = _samples(fetch(url))
        return (_get(got, "autominato_loader_cpu_seconds_total", rank="0"),
                _get(got, "autominato_loader_runqueue_wait_seconds_total", rank="0"))

    with Loader(_Work(40, 0.05, True), 2, workers=2, autotune=False, seed=0,
                memory_aware=False, prefetch_next_epoch=False, metrics_port=0) as loader:
        it = iter(loader)
        taken = len(next(it))
        for pid in loader.worker_pids():
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
                    os.sched_setaffinity(int(tid), {0})
        url = loader._telemetry.url
        t0, (cpu0, wait0) = time.monotonic(), scrape(url)
        taken += sum(len(b) for b in it)
        wall, (cpu1, wait1) = time.monotonic() - t0, scrape(url)
    assert taken == 40
    ran, waited = cpu1 - cpu0, wait1 - wait0
    # One core: they cannot have run longer than the wall time (before: 5.3 s in 2.7 s), and
    # one of the two waited while the other ran. (How much they ran depends on what else the
    # machine runs on that core: other tests beside this one, review 167.)
    assert 0 < ran < 1.1 * wall + 0.1, (ran, waited, wall)
    assert waited > 0.3 * wall, (ran, waited, wall)


@pytest.mark.parametrize("burn", [False, True])
def test_autominato_monitor_tells_sleeping_workers_from_busy_ones(capsys, burn):
    # Audit 85: without the loader's CPU use, the remote report called workers that only
    # sleep (a slow disk) CPU bound, "no spare cores"; the in-process report said I/O bound.
    stop = threading.Event()
    loader = Loader(_Work(400, 0.05, burn), 4, workers=2, autotune=False, seed=0,
                    memory_aware=False, metrics_port=0)

    def train() -> None:
        while not stop.is_set():
            for _ in loader:
                time.sleep(0.005)
                if stop.is_set():
                    return

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        time.sleep(0.5)
        rc = cli_main(["monitor", f"127.0.0.1:{loader._telemetry.port}", "--interval", "2"])
    finally:
        stop.set()
        trainer.join(timeout=30)
        loader.close()
    out = capsys.readouterr().out
    assert rc == 0
    assert "loader CPU demand" in out
    assert ("diagnosis: CPU bound" if burn else "diagnosis: I/O bound") in out, out


def test_autominato_monitor_says_when_the_exporter_is_unreachable(capsys):
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli_main(["monitor", f"127.0.0.1:{port}", "--interval", "0.1", "--timeout", "2"])
    assert rc == 2
    assert f"cannot read http://127.0.0.1:{port}/metrics" in capsys.readouterr().err


def test_autominato_monitor_says_when_the_endpoint_is_not_prometheus(capsys):
    """An HTML page where the exporter was expected: one line and exit status 1, not the
    parser's traceback (trial 146)."""
    import http.server

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!DOCTYPE HTML><html><body>not metrics</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        rc = cli_main(["monitor", f"127.0.0.1:{port}", "--interval", "0.1", "--timeout", "2"])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert rc == 1
    err = capsys.readouterr().err
    assert "does not answer in Prometheus's text format" in err and "Traceback" not in err


@pytest.mark.parametrize("url, says", [
    ("http://[bad", "'http://[bad' is not a URL"),
    ("localhost:abc", "'localhost:abc' is not a URL"),
    ("ftp://host:1/metrics", "scheme must be http or https, got 'ftp'"),
    ("http://:9100/metrics", "names no host"),
])
def test_autominato_monitor_names_a_malformed_url_without_a_traceback(capsys, url, says):
    rc = cli_main(["monitor", url, "--interval", "0.1"])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err


@pytest.mark.parametrize("flag, v", [("--timeout", "0"), ("--timeout", "inf"), ("--interval", "-1"),
                                     ("--interval", "nan"), ("--interval", "inf")])
def test_autominato_monitor_names_a_bad_duration(capsys, flag, v):
    rc = cli_main(["monitor", "127.0.0.1:1", flag, v])
    err = capsys.readouterr().err
    assert rc == 2 and f"{flag} must be a finite number of seconds > 0" in err


@pytest.mark.parametrize("url", ["https://host:9100/metrics", "http://[::1]:9100", "[::1]:9100",
                                 "host:9100", "localhost", "HTTP://host:9100/custom/path",
                                 "user:pw@host:9100"])
def test_monitor_urls_that_can_be_fetched_pass_the_check(url):
    from autominato.telemetry.remote import url_problem

    assert url_problem(url) is None


def test_with_ray_workers_the_monitor_budgets_the_cores_the_controller_does(monkeypatch):
    # Ray actors are bounded by the cluster's free CPUs (here 16), not this machine's: the
    # report's "workers N -> M" / "no spare cores" must use that budget too.
    from conftest import forget_ray_callback_threads  # (tests/ is on sys.path)

    ray = pytest.importorskip("ray")
    monkeypatch.setattr("autominato.loader._ray_capacity", lambda address, options: 16)
    # (workers=1: with none there is no actor. The Loader starts its actor when built, on a
    # Ray instance of this test's own: "local", as one Ray's auto-init started would join
    # another test process's by its address file. Shut down after: its threads left running
    # made this file's later loaders start their workers from a new interpreter.)
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with Loader(Volumes(8), batch_size=2, worker_kind="ray", workers=1,
                    monitor_interval=60) as loader:
            assert loader.controller.budget.cores == 16
            assert loader.telemetry.monitor.budget is not None
            assert loader.telemetry.monitor.budget.cores == loader.controller.budget.cores
    finally:
        ray.shutdown()
        forget_ray_callback_threads()


@pytest.mark.parametrize(("kind", "hint"), [("cpu", True), ("sync", True), ("io", True),
                                            ("consumer", False), ("none", False)])
def test_the_memory_line_suggests_turning_it_off_only_when_the_loader_is_the_bottleneck(kind, hint):
    """Review 53: beside 'consumer bound' the report said memory_aware=False gives the idle
    worker time back; workers idle for memory cost nothing while the training loop sets the
    pace."""
    from autominato.telemetry.monitor import Diagnosis, format_report

    d = Diagnosis(kind, None, "summary", "suggestion", (), 0.1, 0.5, memory_held=3,
                  memory_wait_s=1.25)
    text = format_report(d, width=400)
    assert ("3 samples waited for room in the memory budget since the start; free workers "
            "idled 1.2 s for it since the start (summed over workers)") in text
    assert ("memory_aware=False may give part of it back" in text) is hint
    # over a window of known length, the share of the workers' time (trial 54)
    text = format_report(replace(d, window_s=5.0, memory_wait_share=0.125), width=400)
    assert "idled 1.2 s for it in the window (12% of the workers' time)" in text
    assert "memory-aware" not in format_report(Diagnosis(kind, None, "s", "s", (), 0.1, 0.5))
    # Trial 88: one small sample held once, a few ms of wait: no line in every report; and no
    # hint where the accelerator does not idle or the wait is a sliver of the workers' time
    assert "memory-aware" not in format_report(replace(d, memory_held=1, memory_wait_s=0.004))
    assert "memory_aware=False" not in format_report(replace(d, idle_ratio=0.0), width=400)
    sliver = replace(d, window_s=60.0, memory_wait_share=0.01)
    text = format_report(sliver, width=400)
    assert "memory-aware dispatch" in text and "memory_aware=False" not in text


def test_no_line_of_a_report_ends_in_spaces():
    """rich pads a centred title to the table's width; the log's lines carry none of it
    (trial 138: the header line of the report ended in spaces)."""
    from autominato.telemetry.monitor import diagnose, format_report

    loader = Loader(list(range(8)), batch_size=2, workers=0, autotune=False)
    with loader:
        list(loader)
        text = format_report(diagnose([loader.snapshot()]), title="Data Monitor (rank 0)")
    lines = text.splitlines()
    assert lines[0].strip().startswith("Data Monitor (rank 0)")
    assert len(lines) > 5 and all(line == line.rstrip() for line in lines)



@pytest.mark.parametrize(("sample_s", "step_s", "ahead"), [(0.0, 0.02, True), (0.03, 0.0, False)])
def test_the_loader_says_which_next_found_no_batch_ready(sample_s, step_s, ahead):
    """The queue wait share's flags (trial 180): a loader ahead of a slow step has its batches
    ready at (nearly) every next() after the first, however long the hand-over takes; one
    whose samples take longer than the loop has none ready (nearly) every time."""
    with Loader(Volumes(64, sample_s), batch_size=4, num_workers=1, autotune=False) as loader:
        for _ in loader:
            if step_s:
                time.sleep(step_s)
        flags = loader.snapshot().consumer_empty_recent
    assert len(flags) == 16
    later = flags[4:]
    if ahead:
        assert sum(later) <= 1, flags
    else:
        assert sum(later) >= len(later) - 1, flags


def test_without_workers_no_flag_and_the_bound_only_where_a_controller_runs():
    """num_workers=0 makes no batch ahead: no flag, so the queue wait share reads the waits
    (review 181: every batch flagged, 100 % "bad" at 1 % idle); the snapshot's workers
    bound is the controller's, 0 where none runs."""
    with Loader(Volumes(64), batch_size=4, num_workers=0) as loader:
        assert len(list(loader)) == 16
        snap = loader.snapshot()
    assert snap.consumer_empty_recent == () and snap.batches_total == 16
    with Loader(Volumes(64), batch_size=4, num_workers=2) as loader:
        assert loader.snapshot().workers_bound == loader.knobs.bounds("workers")[1] >= 8
    with Loader(Volumes(64), batch_size=4, num_workers=2, autotune=False) as loader:
        assert loader.snapshot().workers_bound == 0


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id if info else 0, 8, info.num_workers if info else 1):
            yield np.full(4, i, np.float32)


@pytest.mark.parametrize("iterable", [False, True])
def test_autominato_monitor_reads_what_the_loader_runs_and_the_kept_heap(iterable):
    """``autominato monitor URL`` rebuilds the worker kind, whether the dataset is iterable,
    the workers' kernel time and the whole warm heap's cap (``memory_aware=False``) as the
    training process has them: without them its report advised ``fuse_read=False`` to an
    iterable dataset, and never told the workers' kernel time."""
    from autominato.telemetry.cores import KERNEL_SECONDS_KEY
    from autominato.telemetry.remote import _samples, fetch, snapshot_from_samples

    ds = _Stream() if iterable else _Work(8, 0.0, False)
    with Loader(ds, 4, workers=2, autotune=False, seed=0, memory_aware=False,
                prefetch_next_epoch=False, metrics_port=0) as loader:
        assert len([b for b in loader]) == 2
        time.sleep(0.3)  # (the scheduler's tick sends the keep: 0.25 s)
        local = loader.snapshot()
        remote = snapshot_from_samples(_samples(fetch(loader._telemetry.url)), "0", 0.0)
    got = [(s.worker_kind, s.iterable, s.memory_aware, s.warm_heap) for s in (local, remote)]
    assert got[0] == got[1] == ("process", iterable, False, True)
    assert remote.worker_heap_keep_bytes == local.worker_heap_keep_bytes > 0
    assert KERNEL_SECONDS_KEY in remote.extra
