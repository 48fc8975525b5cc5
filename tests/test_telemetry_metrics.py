"""Prometheus metrics of a real loader: families, values, labels, promtool, exporter, NVML."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from autominato import Loader
from autominato.control.rule import Decision
from autominato.telemetry import PortInUseError, attach, serve
from autominato.telemetry import nvml as nvml_module
from autominato.telemetry.metrics import COLLECTED, bounded_reason

N, B = 22, 4  # 6 batches, the last one short; index 5 fails under on_error="skip"

#: A loopback address of its own for a test whose exporter must be its alone: port 0 reuses
#: the process's exporter on a host, such as the module fixture's on 127.0.0.1.
OWN_HOST = "127.0.0.2"


class Volumes:
    """``slow``: an index whose read takes 0.3 s, so later samples overtake it (a straggler)."""

    def __init__(self, slow: int | None = None) -> None:
        self.slow = slow

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if i == 5:
            raise OSError("truncated file")
        if i == self.slow:
            time.sleep(0.3)
        return np.full((4, 4, 4), i, np.float32), np.int64(i)


def shift(sample, rng):
    image, label = sample
    return image + 1.0, label


def scrape(url: str) -> dict[str, dict]:
    """family name -> {"type": ..., "samples": [(name, labels, value), ...]}."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {
            "type": fam.type,
            "samples": [(s.name, s.labels, s.value) for s in fam.samples],
        }
    return out


def value(fams, sample_name: str, **labels) -> float:
    family = sample_name
    for suffix in ("_total", "_sum", "_count", "_bucket"):
        if family.endswith(suffix) and family[: -len(suffix)] in fams:
            family = family[: -len(suffix)]
    hits = [
        v
        for name, lab, v in fams[family]["samples"]
        if name == sample_name and all(lab.get(k) == str(x) for k, x in labels.items())
    ]
    assert len(hits) == 1, (sample_name, labels, hits)
    return hits[0]


@pytest.fixture(scope="module")
def ran():
    """One short run with the exporter on; yields (loader, scraped families, exposition)."""
    loader = Loader(
        Volumes(slow=1),
        batch_size=B,
        transform=shift,
        worker_kind="thread",
        workers=2,
        in_order=False,  # completion order: the straggler joins a later batch
        on_error="skip",
        metrics_port=0,
        autotune=False,
        seed=0,
        prefetch_next_epoch=False,  # one epoch's figures exactly, none of the next started ahead
    )
    batches = list(loader)
    # What the online controller reports for each knob change it makes.
    loader.report_decision(Decision("workers", 2, 3, "transform_bound", "transform share 1.4"))
    handle = loader._telemetry
    with urllib.request.urlopen(handle.url, timeout=5) as r:
        text = r.read().decode()
    yield loader, scrape(handle.url), text, batches
    loader.close()


def test_every_metric_family_is_present_after_a_short_run(ran):
    _, fams, _, _ = ran
    expected = {
        "autominato_stage_service_seconds": "histogram",
        "autominato_stage_wait_seconds": "histogram",
        "autominato_consumer_wait_seconds": "histogram",
        "autominato_consumer_step_seconds": "histogram",
        "autominato_h2d_copy_seconds": "histogram",
        "autominato_controller_decisions": "counter",
    }
    for name, (kind, _, _) in COLLECTED.items():
        expected[name.removesuffix("_total")] = kind
    for name, kind in expected.items():
        assert name in fams, name
        assert fams[name]["type"] == kind, name


def test_stage_histograms_and_counters_moved(ran):
    loader, fams, _, _ = ran
    done = N - 1  # one sample skipped
    for stage in ("read", "transform"):
        assert value(fams, "autominato_stage_service_seconds_count", stage=stage, rank=0) >= done
        assert value(fams, "autominato_stage_service_seconds_sum", stage=stage, rank=0) > 0
        assert value(fams, "autominato_stage_wait_seconds_count", stage=stage, rank=0) >= done
        assert value(fams, "autominato_stage_items_total", stage=stage, rank=0) >= done
    # 21 samples x 64 float32 = 5376 bytes transformed; collated batches add label bytes.
    assert value(fams, "autominato_stage_bytes_total", stage="transform", rank=0) == done * 256
    assert value(fams, "autominato_stage_items_total", stage="batch", rank=0) == 6
    assert value(fams, "autominato_stage_bytes_total", stage="batch", rank=0) > done * 256
    assert value(fams, "autominato_stage_workers", stage="transform", rank=0) == 2
    assert (
        value(fams, "autominato_stage_workers", stage="read", rank=0) == loader.knobs.read_threads
    )
    assert (
        value(fams, "autominato_stage_queue_capacity_items", stage="transfer", rank=0)
        == loader.knobs.depth
    )
    # Behind a read stage of its own the transform queue holds the read-ahead (trial 138:
    # pool_size was exported, for a queue that never held that many)
    assert (value(fams, "autominato_stage_queue_capacity_items", stage="transform", rank=0)
            == loader.knobs.workers + loader.knobs.read_threads)
    assert value(fams, "autominato_stage_queue_items", stage="transfer", rank=0) == 0  # drained
    # Buckets are cumulative and end in +Inf == count.
    buckets = [
        (float(lab["le"]), v)
        for name, lab, v in fams["autominato_stage_service_seconds"]["samples"]
        if name.endswith("_bucket") and lab["stage"] == "read"
    ]
    assert buckets[0][0] == 0.0001 and buckets[-2][0] == 100.0
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)
    assert counts[-1] == value(fams, "autominato_stage_service_seconds_count", stage="read", rank=0)


def test_consumer_and_delivery_counters_match_the_batches_received(ran):
    _, fams, _, batches = ran
    assert len(batches) == 6
    delivered = sum(len(b[1]) for b in batches)
    assert delivered == N - 1
    assert value(fams, "autominato_samples_total", rank=0) == delivered
    assert value(fams, "autominato_batches_total", rank=0) == 6
    assert value(fams, "autominato_consumer_wait_seconds_count", rank=0) == 6
    assert value(fams, "autominato_consumer_step_seconds_count", rank=0) == 6
    assert value(fams, "autominato_samples_skipped_total", rank=0) == 1
    idle = value(fams, "autominato_accelerator_idle_ratio", rank=0)
    # The loop did nothing between next() calls, so it waited most of the time.
    assert 0.5 < idle <= 1.0
    assert value(fams, "autominato_epoch", rank=0) == 0
    assert value(fams, "autominato_pool_bytes", rank=0) > 0
    # Index 1 took 0.3 s while the others took microseconds: it joined a later batch.
    assert value(fams, "autominato_stragglers_total", rank=0) >= 1
    assert value(fams, "autominato_worker_restarts_total", rank=0) == 0  # thread workers


class FailsAt:
    """12 samples of shape (2,); ``bad`` raise, sample ``odd`` is (3,) (its batch does not stack)."""

    def __init__(self, bad=(), odd=None) -> None:
        self.bad, self.odd = set(bad), odd

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return np.full(3 if i == self.odd else 2, i, np.int64)


class StreamFailsAt(torch.utils.data.IterableDataset):
    """Yields 0..11 (no sharding: use it without workers); ``bad`` raise and the iterator
    goes on (a class, not a generator that a raise would end)."""

    def __init__(self, bad=()) -> None:
        self.bad = set(bad)

    def __iter__(self):
        return _Counting(self.bad)


class _Counting:
    def __init__(self, bad) -> None:
        self.bad, self.i = bad, 0

    def __next__(self):
        i, self.i = self.i, self.i + 1
        if i >= 12:
            raise StopIteration
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return np.full(2, i, np.int64)


@pytest.mark.parametrize("workers, in_order, data, errors, lost", [
    (0, True, StreamFailsAt(bad=[4]), 1, 2),  # iterable: 4 and its batch's 3 (as DataLoader's)
    (0, True, FailsAt(bad=[4, 5]), 1, 3),  # one batch, [3, 4, 5], lost (as DataLoader's)
    (2, True, FailsAt(bad=[4, 9]), 2, 6),  # two batches lost
    (2, False, FailsAt(bad=[4, 9]), 2, 2),  # completion order: the failing samples alone
    (2, True, FailsAt(odd=4), 1, 3),  # the batch that does not stack
    (0, True, FailsAt(odd=4), 1, 3),
])
def test_errors_raised_and_samples_lost_are_the_losses_the_loop_saw(workers, in_order, data,
                                                                     errors, lost):
    with Loader(data, 3, num_workers=workers, in_order=in_order, metrics_port=0,
                autotune=False, prefetch_next_epoch=False) as loader:
        it, got, seen = iter(loader), 0, 0
        while True:
            try:
                got += len(next(it))
            except StopIteration:
                break
            except (ValueError, RuntimeError):
                seen += 1
        assert (seen, got) == (errors, 12 - lost)
        fams, rank = scrape(loader._telemetry.url), loader._telemetry.rank  # ("0-1": the
        # module's other loader is "0")
    assert value(fams, "autominato_errors_raised_total", rank=rank) == errors
    assert value(fams, "autominato_samples_lost_total", rank=rank) == lost
    assert value(fams, "autominato_samples_total", rank=rank) == 12 - lost


def test_counters_go_on_when_a_resume_rebuilds_the_pipeline():
    """load_state_dict with a drawn seed rebuilds the pipeline: its counters went back to 0
    (a skip counted before vanished; review 40)."""
    with Loader(FailsAt(bad=[5]), 3, num_workers=2, worker_kind="thread", on_error="skip",
                autotune=False) as loader:
        assert len([b for b in loader]) == 4
        assert loader.snapshot().skipped_total == 1
        with Loader(FailsAt(), 3, num_workers=0, autotune=False) as other:
            state = other.state_dict()
        loader.load_state_dict(state)  # another drawn seed: the pipeline is rebuilt
        assert loader._pipeline is None and loader.snapshot().skipped_total == 1
        list(loader)
        assert loader.snapshot().skipped_total == 2


def test_knob_values_and_controller_decisions_are_exported(ran):
    loader, fams, _, _ = ran
    for knob, v in loader.knobs.as_dict().items():
        assert value(fams, "autominato_knob_value", knob=knob, rank=0) == v
    assert (
        value(
            fams,
            "autominato_controller_decisions_total",
            knob="workers",
            reason="transform_bound",
            rank=0,
        )
        == 1
    )


def test_without_a_device_the_copy_figures_stay_empty(ran):
    _, fams, _, _ = ran
    assert value(fams, "autominato_h2d_bytes_total", rank=0) == 0
    assert value(fams, "autominato_h2d_copy_seconds_count", rank=0) == 0
    # No copy, no bandwidth: absent rather than a misleading 0 bytes/s.
    assert fams["autominato_h2d_bandwidth_bytes_per_second"]["samples"] == []


def test_labels_have_bounded_cardinality(ran):
    _, fams, _, _ = ran
    allowed = {"rank", "stage", "knob", "reason", "le", "gpu", "UUID", "worker_kind", "iterable",
               "memory_aware", "warm_heap"}
    for name, fam in fams.items():
        if not name.startswith("autominato_"):
            continue
        for _, labels, _ in fam["samples"]:
            assert set(labels) <= allowed, (name, labels)
            assert labels.get("stage", "read") in ("read", "transform", "batch", "transfer")
            assert labels.get("worker_kind", "ray") in ("process", "thread", "ray")
            for flag in ("iterable", "memory_aware", "warm_heap"):
                assert labels.get(flag, "true") in ("true", "false")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_check_metrics_passes_on_the_real_exposition(ran):
    _, _, text, _ = ran
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "" and done.stderr.strip() == ""


def test_reason_label_is_bounded():
    assert bounded_reason("queue_starved") == "queue_starved"
    assert bounded_reason("/data/case_00042.nii.gz failed") == "other"
    assert bounded_reason("Idle 43%") == "other"


def test_two_loaders_in_one_process_keep_separate_rank_series():
    a = Loader(
        Volumes(),
        batch_size=B,
        rank=0,
        world_size=2,
        worker_kind="thread",
        on_error="skip",
        metrics_port=0,
        autotune=False,
        seed=0,
    )
    b = Loader(
        Volumes(),
        batch_size=B,
        rank=1,
        world_size=2,
        worker_kind="thread",
        on_error="skip",
        metrics_port=a._telemetry.port,
        autotune=False,
        seed=0,
    )
    c = Loader(
        Volumes(),
        batch_size=B,
        rank=0,
        world_size=2,
        worker_kind="thread",
        on_error="skip",
        autotune=False,
        seed=0,
    )
    handle_c = attach(c)  # a second live loader of rank 0 (say, validation)
    try:
        got_a, got_b = list(a), list(b)
        assert a._telemetry.url == b._telemetry.url  # one exporter per process
        ra, rb, rc = a._telemetry.rank, b._telemetry.rank, handle_c.rank
        # Other live rank-0 loaders of this module may hold "0": ours are distinct anyway.
        assert rb == "1" and len({ra, rb, rc}) == 3
        assert ra.split("-")[0] == rc.split("-")[0] == "0"
        fams = scrape(a._telemetry.url)
        ranks = {lab["rank"] for _, lab, _ in fams["autominato_batches"]["samples"]}
        assert {ra, rb, rc} <= ranks
        assert value(fams, "autominato_samples_total", rank=ra) == sum(len(x[1]) for x in got_a)
        assert value(fams, "autominato_samples_total", rank=rb) == sum(len(x[1]) for x in got_b)
        assert value(fams, "autominato_samples_total", rank=rc) == 0
        b.close()
        fams = scrape(a._telemetry.url)
        # a closed loader's gauges go; its counters stay as it left them (for the label's
        # next loader, and so that Prometheus sees the end of its pass: trial 168)
        ranks = {lab["rank"] for _, lab, _ in fams["autominato_epoch"]["samples"]}
        assert rb not in ranks and {ra, rc} <= ranks
        assert value(fams, "autominato_samples_total", rank=rb) == sum(len(x[1]) for x in got_b)
    finally:
        handle_c.close()
        c.close()
        b.close()
        a.close()


def test_a_loader_built_before_the_process_group_relabels_its_series_with_its_rank(monkeypatch):
    """Lightning's DDP starts the process group in Trainer.fit, after the script built the
    Loader: its series must carry the rank the first pass reads, not the 0 of construction."""
    import torch.distributed as dist

    loader = Loader(Volumes(), batch_size=B, worker_kind="thread", on_error="skip",
                    metrics_port=0, autotune=False, seed=0)
    try:
        handle = loader._telemetry
        before = handle.rank
        base, _, suffix = before.partition("-")
        assert base == "0"
        after = "1" + (f"-{suffix}" if suffix else "")  # a second live loader keeps its suffix
        handle._on_decision(Decision("workers", 2, 3, "transform_bound"))
        handle._on_decision(Decision("workers", 3, 4, "transform_bound"))
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
        got = list(loader)
        assert loader.rank == 1 and handle.rank == after
        fams = scrape(handle.url)
        assert value(fams, "autominato_samples_total", rank=after) == sum(len(x[1]) for x in got)
        # The old label keeps what was counted under it (nothing but the decisions: no pass
        # ran before the move), as a closed loader's; the new one counts from the move, its
        # counters and histograms alike (trial 168)
        assert value(fams, "autominato_samples_total", rank=before) == 0
        assert value(fams, "autominato_consumer_wait_seconds_count", rank=before) == 0
        assert value(fams, "autominato_consumer_wait_seconds_count", rank=after) == len(got)
        assert value(fams, "autominato_controller_decisions_total", knob="workers",
                     reason="transform_bound", rank=before) == 2
        assert before not in {lab["rank"] for _, lab, _ in fams["autominato_epoch"]["samples"]}
        assert f"rank {after}" in handle.report()
        loader.close()
    finally:
        loader.close()


def scrape_registry() -> dict[str, dict]:
    """The default registry's exposition (the exporter of a closed loader is gone)."""
    from prometheus_client import generate_latest

    from autominato.telemetry.metrics import REGISTRY

    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        out[fam.name] = {"samples": [(s.name, s.labels, s.value) for s in fam.samples]}
    return out


def test_relabelled_loaders_keep_which_one_has_the_suffix():
    """Lightning's sanity check iterates the validation loader (built second: "0-1") first: on
    rank 1 it must become "1-1", and the training loader "1", as on rank 0."""
    from autominato.telemetry.handle import TelemetryHandle

    loaders = [Loader(Volumes(), batch_size=B, worker_kind="thread", autotune=False)
               for _ in range(2)]
    handles = [TelemetryHandle(x) for x in loaders]
    try:
        old = [h.rank.partition("-") for h in handles]  # (base, "-", suffix or "")
        assert old[0][0] == old[1][0] == "0" and old[0][2] != old[1][2]
        handles[1].set_rank(1)  # the one built second first
        handles[0].set_rank(1)
        assert [h.rank for h in handles] == ["-".join(filter(None, ("1", o[2]))) for o in old]
    finally:
        for h in handles:
            h.close()
        for x in loaders:
            x.close()


def test_exporter_stops_when_its_last_loader_closes():
    loader = Loader(
        Volumes(),
        batch_size=B,
        worker_kind="thread",
        on_error="skip",
        metrics_port=0,
        metrics_host=OWN_HOST,  # not the module fixture's server, which port 0 would reuse
        autotune=False,
    )
    port = loader._telemetry.port
    assert scrape(f"http://{OWN_HOST}:{port}/metrics")
    loader.close()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        s.bind((OWN_HOST, port))  # nothing listens there any more


def test_a_telemetry_close_cut_short_is_finished_by_the_loader_s_next_close(interrupt_once):
    """Review 162: the handle marked itself closed on entry, so a close that a Ctrl-C cut
    short (here as it unregisters the loader's series) returned at once the next time: the
    exporter kept its port and the loader's series stayed registered."""
    from autominato.telemetry.collector import COLLECTOR

    loader = Loader(Volumes(), batch_size=B, worker_kind="thread", on_error="skip",
                    metrics_port=0, metrics_host=OWN_HOST, autotune=False)
    handle = loader._telemetry
    port = handle.port
    hits = interrupt_once(COLLECTOR, "remove")
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert hits and handle._closed
    loader.close()  # (what the exit hook calls)
    assert handle._key not in COLLECTOR._sources
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((OWN_HOST, port))  # the exporter let its port go


def test_two_loaders_on_port_zero_are_one_scrape_target(caplog):
    # Trial 77: each opened its own port, and each port served both loaders' series, so a
    # Prometheus scraping the two counted every series twice.
    def make():
        return Loader(Volumes(), batch_size=B, worker_kind="thread", on_error="skip",
                      metrics_port=0, metrics_host=OWN_HOST, autotune=False)

    train = make()  # (the module fixture's server on 127.0.0.1 may have it warn: another host)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autominato.telemetry.exporter"):
        val = make()
    try:
        assert val.telemetry.port == train.telemetry.port
        assert "already serves" not in caplog.text
        for _ in train:
            pass
        for _ in val:
            pass
        samples = scrape(train.telemetry.url)["autominato_samples"]["samples"]
        ranks = {lab["rank"]: v for name, lab, v in samples if name == "autominato_samples_total"}
        tr, vr = train.telemetry.rank, val.telemetry.rank  # (the module fixture's loader is "0")
        assert tr != vr and ranks[tr] == ranks[vr] == N - 1  # index 5 is skipped
        port = train.telemetry.port
        train.close()  # the validation loader's series stay served
        samples = scrape(f"http://{OWN_HOST}:{port}/metrics")["autominato_epoch"]["samples"]
        left = {lab["rank"] for _, lab, _ in samples}
        assert vr in left and tr not in left
    finally:
        train.close()
        val.close()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((OWN_HOST, port))  # the last one closed it


def test_a_label_taken_again_goes_on_from_the_counters_its_last_loader_left():
    """A validation loader built anew each epoch takes the label of the one closed before it:
    its counters and histograms go on from what that one left, so that every series stays
    monotonic (from 0 again, Prometheus read a reset, and a pass as long as the last one,
    scraped after it passed the old count, as no increase at all)."""
    batches = samples = 0
    for k in range(3):
        val = Loader(Volumes(), batch_size=B, worker_kind="thread", on_error="skip", rank=3,
                     world_size=4, metrics_port=0, metrics_host=OWN_HOST, autotune=False,
                     seed=0)
        try:
            assert val.telemetry.rank == "3"  # (no other loader of rank 3 in this process)
            got = list(val)
            batches, samples = batches + len(got), samples + sum(len(x[1]) for x in got)
            val.report_decision(Decision("workers", 2, 3, "transform_bound"))
            fams = scrape(val.telemetry.url)
            assert value(fams, "autominato_samples_total", rank="3") == samples
            assert value(fams, "autominato_batches_total", rank="3") == batches
            assert value(fams, "autominato_consumer_wait_seconds_count", rank="3") == batches
            assert value(fams, "autominato_controller_decisions_total", knob="workers",
                         reason="transform_bound", rank="3") == k + 1
            assert value(fams, "autominato_epoch", rank="3") == 0  # a gauge: its own
        finally:
            val.close()
        fams = scrape_registry()  # closed: its gauges go, its counters stay as it left them
        assert "3" not in {lab.get("rank") for _, lab, _ in fams["autominato_epoch"]["samples"]}
        assert value(fams, "autominato_samples_total", rank="3") == samples
        assert value(fams, "autominato_consumer_wait_seconds_count", rank="3") == batches
    assert samples > 0


def test_a_second_explicit_port_warns_that_it_serves_the_same_series(caplog):
    first = serve(0)
    try:
        with caplog.at_level(logging.WARNING, logger="autominato.telemetry.exporter"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                free = s.getsockname()[1]
            second = serve(free)
        try:
            assert second.port != first.port
            assert f"already serves the same metrics on {first.url}" in caplog.text
        finally:
            second.close()
    finally:
        first.close()


def test_port_in_use_gives_a_clear_error_or_a_free_port_when_asked(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"metrics port {taken} on 127.0.0.1 is already"):
            serve(taken)
        with caplog.at_level(logging.WARNING, logger="autominato.telemetry.exporter"):
            exporter = serve(taken, free_if_busy=True)
        try:
            assert exporter.port != taken
            assert f"serving on port {exporter.port} instead" in caplog.text
            assert "autominato_" in urllib.request.urlopen(exporter.url, timeout=5).read().decode()
            again = serve(taken, free_if_busy=True)  # (review 78: a second fallback server)
            assert again is exporter
            again.close()
            # a caller who did not accept another port is not given it (review 83)
            with pytest.raises(PortInUseError):
                serve(taken)
        finally:
            exporter.close()


def test_localhost_and_its_address_are_one_server():
    # Review 78: hosts were compared as strings: two servers, every series scraped twice.
    if socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM,
                          flags=socket.AI_PASSIVE)[0][4][0] != "127.0.0.1":
        pytest.skip("localhost resolves to another address first here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    a = serve(free, "127.0.0.1")
    try:
        b = serve(free, "localhost")
        assert b is a
        b.close()
    finally:
        a.close()


def test_an_empty_host_binds_every_interface_as_0000_and_is_one_server_with_it():
    # As socketserver's "": prometheus_client cannot resolve it, and it was a key of its own.
    a = serve(0, "")
    try:
        assert a.host == "0.0.0.0" and a._server.server_address[0] == "0.0.0.0"
        b = serve(a.port, "0.0.0.0")
        assert b is a
        b.close()
    finally:
        a.close()


def test_exporter_binds_loopback_by_default():
    exporter = serve(0)
    try:
        assert exporter.host == "127.0.0.1"
        assert exporter._server.server_address[0] == "127.0.0.1"
    finally:
        exporter.close()


# --- NVML -----------------------------------------------------------------------------------


def _gpu_families(url: str) -> set[str]:
    return {n for n in scrape(url) if n.startswith("autominato_gpu_")}


@pytest.fixture
def fresh_nvml():
    nvml_module._reset_for_tests()
    yield
    nvml_module._reset_for_tests()


def test_without_nvidia_ml_py_gpu_metrics_are_absent_and_silent(monkeypatch, caplog, fresh_nvml):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails like a missing package
    with caplog.at_level(logging.INFO):
        loader = Loader(
            Volumes(),
            batch_size=B,
            worker_kind="thread",
            on_error="skip",
            metrics_port=0,
            autotune=False,
        )
        try:
            assert len(list(loader)) == 6
            assert _gpu_families(loader._telemetry.url) == set()
            assert "autominato_batches" in scrape(loader._telemetry.url)
        finally:
            loader.close()
    telemetry_warnings = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("autominato.telemetry")
    ]
    assert telemetry_warnings == []
    assert nvml_module.nvml_collector() is None


def test_nvml_without_a_driver_is_silent(caplog, fresh_nvml):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass  # the case under test: a machine without the NVIDIA driver
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    with caplog.at_level(logging.DEBUG, logger="autominato.telemetry.nvml"):
        assert nvml_module.nvml_collector() is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


class FakeNvml:
    """Just the nvidia-ml-py calls the collector makes, with fixed figures for one GPU."""

    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("h", i)

    def nvmlDeviceGetUUID(self, h):
        return b"GPU-0b2c"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        if counter == self.NVML_PCIE_UTIL_RX_BYTES:
            raise self.NVMLError("Not Supported")
        return 2_000_000  # KB/s


def test_nvml_figures_are_converted_to_base_units_with_dcgm_labels():
    collector = nvml_module.NvmlCollector(FakeNvml())
    fams = {f.name: f.samples for f in collector.collect()}
    util = fams["autominato_gpu_utilization_ratio"][0]
    assert util.labels == {"gpu": "0", "UUID": "GPU-0b2c"}
    assert util.value == pytest.approx(0.37)
    assert fams["autominato_gpu_memory_used_bytes"][0].value == 3 * 2**30
    assert fams["autominato_gpu_pcie_tx_bytes_per_second"][0].value == 2_000_000 * 1024
    # A counter the GPU does not support is left out, not reported as 0.
    assert "autominato_gpu_pcie_rx_bytes_per_second" not in fams


def test_latency_histograms_count_values_in_prometheus_le_buckets():
    from autominato.telemetry.metrics import (
        LATENCY_BUCKETS,
        STAGE_SERVICE_SECONDS,
        STAGE_WAIT_SECONDS,
    )

    labels = ("read", "le-test")  # a rank no loader uses

    def samples(hist):
        (fam,) = hist.collect()
        return [s for s in fam.samples if s.labels.get("rank") == "le-test"]

    def buckets(hist):
        return {s.labels["le"]: s.value for s in samples(hist) if s.name.endswith("_bucket")}

    service, wait = STAGE_SERVICE_SECONDS.labels(*labels), STAGE_WAIT_SECONDS.labels(*labels)
    try:
        # A value equal to a bound belongs to that bucket (le is inclusive); 200 s is over
        # the last bound, 100 s.
        for s, w in ((0.0001, 0.0), (0.00011, 0.0), (100.0, 0.0), (200.0, 0.003)):
            service.observe(s)
            wait.observe(w)
        got = buckets(STAGE_SERVICE_SECONDS)
        assert got["0.0001"] == 1 and got["0.000125"] == 2
        assert got["80.0"] == 2 and got["100.0"] == 3 and got["+Inf"] == 4
        assert len(got) == len(LATENCY_BUCKETS) + 1
        total = next(
            s.value
            for s in samples(STAGE_SERVICE_SECONDS)
            if s.name == "autominato_stage_service_seconds_sum"
        )
        assert total == pytest.approx(300.00021)
        waits = buckets(STAGE_WAIT_SECONDS)
        assert waits["0.0001"] == 3 and waits["0.0025"] == 3 and waits["0.00315"] == 4
    finally:
        STAGE_SERVICE_SECONDS.remove(*labels)
        STAGE_WAIT_SECONDS.remove(*labels)
    assert samples(STAGE_SERVICE_SECONDS) == [] and samples(STAGE_WAIT_SECONDS) == []
    with pytest.raises(ValueError, match="label count"):
        STAGE_SERVICE_SECONDS.labels("read", "le-test", "extra")


class _Watching(torch.utils.data.Sampler):
    """A sampler that reads the loader's telemetry while the epoch's order is drawn."""

    def __init__(self) -> None:
        self.loader, self.seen = None, []

    def __len__(self) -> int:
        return 8

    def __iter__(self):
        if self.loader is not None:
            self.seen.append(self.loader.snapshot().batches_total)
        return iter(range(8))


def test_a_sampler_may_read_the_loaders_snapshot():
    """snapshot() took the lock that __iter__ holds while it draws the sampler's order: the
    training loop hung (review 42)."""
    sampler = _Watching()
    with Loader(FailsAt(), 2, sampler=sampler, num_workers=2, worker_kind="thread",
                autotune=False) as loader:
        sampler.loader = loader
        out = []
        t = threading.Thread(target=lambda: out.append(sum(1 for _ in loader)), daemon=True)
        t.start()
        t.join(20)
        assert out == [4]
    assert sampler.seen and sampler.seen[0] == 0


class _SleepRead:
    """Each sample's read sleeps 30 ms (a known read time)."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        time.sleep(0.03)
        return np.full(8, i, np.float32)


def test_a_separate_read_stage_counts_each_sample_once_at_its_read_time():
    # Audit 85: with fuse_read=False the workers' results carried a read time of ~0 (the
    # sample came read) that was recorded again: 40 reads of 20 samples, the mean halved.
    from autominato import Loader

    # (prefetch_next_epoch=False: a loader that reads the next epoch's first sample ahead
    # counts that read too, 21 of 20, seen in CI)
    with Loader(_SleepRead(), 4, workers=2, fuse_read=False, read_threads=2, autotune=False,
                seed=0, prefetch_next_epoch=False) as loader:
        assert sorted(int(x) for b in loader for x in b[:, 0]) == list(range(20))
        read = loader.snapshot().stages["read"]
    assert read.items_total == 20
    assert 0.6 <= read.service_seconds_total < 1.5
    assert 0.03 <= read.mean_service_s < 0.075


class _Gated:
    """Sample i waits for ``gate`` (set by the test) before it returns."""

    def __init__(self, gate) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        self.gate.wait(30)
        return np.array([i])


def test_a_loop_blocked_in_next_counts_as_waiting_before_its_batch_arrives():
    """Audit 85: the wait of a next() was counted only when its batch arrived, so a loop blocked
    on its first batch (or on a straggler) read accelerator idle 0 on the gauge; the figure is
    now the wait so far, and the whole wait once the batch is returned (never less)."""
    from autominato.telemetry.collector import SlidingWindow

    gate = threading.Event()
    with Loader(_Gated(gate), 2, workers=0, worker_kind="thread", autotune=False,
                seed=0) as loader:
        it = iter(loader)
        got = []
        t = threading.Thread(target=lambda: got.append(next(it)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.4)
        window = SlidingWindow(window_s=10.0)
        snap = loader.snapshot()
        blocked = snap.time - t0
        assert 0.3 <= snap.consumer_wait_seconds_total <= blocked + 0.05
        assert snap.batches_total == 0
        assert window.update(snap)[0] == 1.0  # waiting, nothing else: idle all the time
        time.sleep(0.2)
        later = loader.snapshot().consumer_wait_seconds_total
        assert later >= snap.consumer_wait_seconds_total + 0.15
        gate.set()
        t.join(10)
        done = loader.snapshot()
        assert got and done.batches_total == 1
        assert later <= done.consumer_wait_seconds_total <= time.monotonic() - t0
        list(it)  # the pass's end: the time in its last next() is wait too, never less
        assert loader.snapshot().consumer_wait_seconds_total >= done.consumer_wait_seconds_total


def test_the_consumer_wait_never_goes_back_when_a_snapshot_falls_inside_a_delivery():
    """Review 87: a snapshot taken between next() reading the time of its batch and recording
    it counted the wait further than the record; the total then went back (Prometheus reads a
    reset). The interleaving is forced here."""
    with Loader(list(range(8)), batch_size=1, num_workers=0, autotune=False, seed=0) as loader:
        t0 = time.monotonic()
        loader._back(t0, asking=True)  # the training loop enters next()
        time.sleep(0.05)
        now = time.monotonic()  # next() reads the time of its batch ...
        time.sleep(0.02)  # ... and a scrape runs before it records it
        a = loader.snapshot().consumer_wait_seconds_total
        loader._delivered(now, now - t0, 1, 1)
        b = loader.snapshot().consumer_wait_seconds_total
        assert b >= a >= 0.07
        loader._end_step()


def test_reads_fused_into_process_workers_have_no_queue_in_the_figures():
    """Reads fused into the process workers (the default): samples go to free workers only,
    so the transform stage's queue has no places of its own (it holds only samples waiting
    for memory, and those put for free workers until the scheduler's pump sends them) and
    its capacity is 0, not pool_size; the read stage, inside the workers, has no queue at
    all: its reads are counted, no wait is (trial 138: a wait histogram of zeros)."""
    seen = []
    with Loader(Volumes(), batch_size=B, workers=2, autotune=False, on_error="skip",
                prefetch_next_epoch=False) as loader:
        for _ in loader:
            st = loader.snapshot().stages["transform"]
            seen.append(st.queue_capacity)
        assert loader.knobs.pool_size > 0
        read = loader.snapshot().stages["read"]
    assert seen and set(seen) == {0}
    assert read.items_total >= N - 1 and read.service_seconds_total > 0
    assert read.recent_wait_s == () and read.wait_seconds_total == 0



def test_a_loader_is_attached_once_and_a_failed_attach_takes_no_rank_label():
    """A second attach() exported every series again under rank "0-1" (Prometheus sums
    counted the loader twice), and an attach() of a DataLoader failed after taking rank "0",
    so the only live Loader was exported as "0-1" (trial 146)."""
    from autominato.telemetry.handle import TelemetryHandle, _live_ranks

    labels = dict(_live_ranks)  # (a module fixture's loader may hold "0")
    with pytest.raises(TypeError, match="autominato.Loader"):
        attach(torch.utils.data.DataLoader(list(range(4))))
    assert _live_ranks == labels  # the failed attach took no label
    loader = Loader(Volumes(), batch_size=B, worker_kind="thread", autotune=False)
    try:
        handle = TelemetryHandle(loader)
        with pytest.raises(ValueError, match="attached already"):
            attach(loader)
        assert len(_live_ranks) == len(labels) + 1
        rank = handle.rank
        handle.close()
        again = attach(loader)  # once closed, it may be attached again
        assert again.rank == rank
        again.close()
        assert _live_ranks == labels
    finally:
        loader.close()


def test_the_cpu_time_is_exported_as_read_and_a_scrape_racing_a_close_is_not_undercut():
    """Review 167: the CPU time exported as the demand less the wait moved back by an ulp now
    and then (100.37 -> 100.36999999999999: a counter reset to Prometheus); and a label kept
    the close's final figures even where a scrape that raced the close exported more."""
    from dataclasses import replace

    from test_monitor_diagnosis import snapshot

    from autominato.telemetry.collector import SnapshotCollector
    from autominato.telemetry.cores import (
        CPU_OF_WORKERS_KEY,
        CPU_SECONDS_KEY,
        CPU_TIME_SECONDS_KEY,
        RUNQUEUE_SECONDS_KEY,
    )

    def with_cpu(s, cpu, wait):
        return replace(s, extra={CPU_SECONDS_KEY: cpu + wait, RUNQUEUE_SECONDS_KEY: wait,
                                 CPU_TIME_SECONDS_KEY: cpu, CPU_OF_WORKERS_KEY: 1.0})

    box = {"snap": with_cpu(snapshot(10.0, 20, step_s=0.1, wait_s=0.01), 100.37, 60.12)}
    col = SnapshotCollector()
    col.add(1, "7", lambda: box["snap"])

    def exported(name: str, rank: str | None = None) -> float:
        fam = {m.name: m for m in col.collect()}[name]
        got = [s.value for s in fam.samples if s.labels.get("rank") == (rank or label[0])]
        assert len(got) == 1, got  # (once: a loader closed during the scrape too)
        return got[0]

    label = ["7"]

    assert exported("autominato_loader_cpu_seconds") == 100.37  # (160.49 - 60.12 != 100.37)
    assert exported("autominato_loader_runqueue_wait_seconds") == 60.12
    final = box["snap"]
    box["snap"] = replace(final, batches_total=25)  # a scrape while the close ran
    assert exported("autominato_batches") == 25
    col.remove(1, final)  # the close's snapshot, taken before that scrape
    assert exported("autominato_batches") == 25  # closed: its counters stay exported
    col.add(2, "7", lambda: replace(final, batches_total=0))
    assert exported("autominato_batches") == 25  # the next loader goes on from the larger

    # A scrape that overlaps the close: it read the loader (30 batches) while the close
    # retired the label with fewer (26); the next loader must not go below 30 (trial 168:
    # 361 -> 353, a reset to Prometheus).
    def closing():
        col.remove(3, replace(final, batches_total=26))
        return replace(final, batches_total=30)

    col.remove(2, replace(final, batches_total=0))
    label[0] = "8"
    col.add(3, "8", closing)
    assert exported("autominato_batches") == 30
    col.add(4, "8", lambda: replace(final, batches_total=1))
    assert exported("autominato_batches") == 31


def test_a_relabel_leaves_the_old_label_the_decisions_an_earlier_loader_counted():
    """Review 167: set_rank removed the old label's decision counter, with the counts a closed
    loader of that label had left: its next loader read them back from fewer (a reset)."""

    def decide(loader):
        loader.telemetry._on_decision(Decision("workers", 2, 3, "transform_bound"))

    def count(url):
        return value(scrape(url), "autominato_controller_decisions_total", knob="workers",
                     reason="transform_bound", rank="5")

    make = lambda: Loader(Volumes(), batch_size=B, worker_kind="thread", on_error="skip",  # noqa: E731
                          rank=5, world_size=8, metrics_port=0, metrics_host=OWN_HOST,
                          autotune=False)
    with make() as first:
        decide(first)
    second = make()
    try:
        decide(second)
        assert count(second.telemetry.url) == 2
        second.telemetry.set_rank(6)  # (as Loader does once the process group names it)
        with make() as third:
            decide(third)
            assert count(third.telemetry.url) == 3
    finally:
        second.close()


def test_a_loader_relabelled_after_a_pass_keeps_each_labels_counters_whole_and_positive():
    """Review 169: after a relabel the carry is an offset (what the new label had, less the
    loader's counts at the move): a close with no scrape since put it, negative, into what
    the label kept; and a scrape that overlapped another loader's close of that label raised
    the offset as if it were a total (80 batches counted under both labels)."""
    from dataclasses import replace

    from test_monitor_diagnosis import snapshot

    from autominato.telemetry.collector import SnapshotCollector

    snap = snapshot(10.0, 80, step_s=0.1, wait_s=0.01)
    col = SnapshotCollector()

    def exported(rank: str) -> float:
        fam = {m.name: m for m in col.collect()}["autominato_batches"]
        got = [s.value for s in fam.samples if s.labels.get("rank") == rank]
        assert len(got) == 1, got
        return got[0]

    box = {"b": 80}
    col.add(1, "0", lambda: replace(snap, batches_total=box["b"]))
    assert exported("0") == 80
    col.relabel(1, "1", col.own_counters(replace(snap, batches_total=80)))
    assert exported("1") == 0 and exported("0") == 80  # the old label keeps them
    box["b"] = 90
    assert exported("1") == 10
    col.remove(1, None)  # no final figures: those last exported
    assert exported("1") == 10 and exported("0") == 80
    col.add(2, "1", lambda: replace(snap, batches_total=1))
    assert exported("1") == 11
    # a relabelled loader closed before any scrape since the move: nothing negative kept
    col.add(3, "5", lambda: replace(snap, batches_total=80))
    col.relabel(3, "6", col.own_counters(replace(snap, batches_total=80)))
    col.remove(3, None)
    assert exported("5") == 80
    assert all(s.value >= 0 for m in col.collect() for s in m.samples
               if s.labels.get("rank") == "6")


_BLOB = __import__("zlib").compress(
    np.random.default_rng(0).integers(0, 4, size=2_000_000, dtype=np.uint8).tobytes())


class TimedReads:
    """16 reads that decompress (CPU) or sleep (waiting on storage); each records the CPU
    time of its own thread."""

    def __init__(self, wait: bool) -> None:
        self.wait = wait
        self.cpu: list[float] = []

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        c = time.thread_time()
        if self.wait:
            time.sleep(0.02)
        else:
            for _ in range(2):
                __import__("zlib").decompress(_BLOB)
        self.cpu.append(time.thread_time() - c)
        return np.full(16, i, np.float32)


@pytest.mark.parametrize("wait", [False, True], ids=["decode", "sleep"])
def test_the_read_stages_cpu_seconds_are_its_threads_cpu_time(wait):
    """A read stage of its own (fuse_read=False: threads of the training process) exports
    the CPU time its threads spent on the reads: what tells a decoding read from a waiting
    one (trial 168: such a read was diagnosed I/O bound)."""
    reads = TimedReads(wait)
    with Loader(reads, batch_size=4, num_workers=2, fuse_read=False, metrics_port=0,
                autotune=False, prefetch_next_epoch=False) as loader:
        assert len(list(loader)) == 4
        fams = scrape(loader._telemetry.url)
        rank = loader._telemetry.rank  # (the module's loader may hold rank 0)
    exported = value(fams, "autominato_stage_cpu_seconds_total", stage="read", rank=rank)
    waited = value(fams, "autominato_stage_runqueue_wait_seconds_total", stage="read",
                   rank=rank)
    service = value(fams, "autominato_stage_service_seconds_sum", stage="read", rank=rank)
    own = sum(reads.cpu)
    assert len(reads.cpu) == 16
    # The reads' own CPU time, plus the read threads' little around them (packing 64 bytes)
    assert own <= exported <= 1.1 * own + 16 * 0.002, (own, exported)
    assert 0 <= waited <= service
    # What they asked of the CPU: ran on one, or waited for one (on a busy machine a read
    # that decodes runs for part of its time only: review 172 saw 45 % under two busy
    # processes)
    if wait:
        assert exported + waited < 0.1 * service
    else:
        assert exported + waited > 0.5 * service, (exported, waited, service)
