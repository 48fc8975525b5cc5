"""Epochs without a boundary: the next epoch's samples start while this epoch's tail finishes.

Every assertion is on order and counts, never on wall-clock time: which epoch a sample was
augmented for is read back from the draw of its generator (seeded by ``(seed, epoch, index)``),
and "before the last straggler finishes" is made certain by a straggler that waits for a gate
the test opens only once the next epoch's first batch has been assembled.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from autominato import Loader
from autominato.pipeline.sampler import epoch_order
from autominato.pipeline.worker import sample_rng
from autominato.telemetry.collector import SnapshotCollector

SEED = 11


class StragglerTail:
    """Sample ``i`` is ``{"index": i}``; the last ``tail`` indices sleep ``tail_s`` first (so
    with sequential order every epoch ends with stragglers); index ``gated`` waits until the
    file ``gate`` exists."""

    def __init__(self, n: int, tail: int = 0, tail_s: float = 0.0,
                 gated: int | None = None, gate: str | None = None) -> None:
        self.n, self.tail, self.tail_s, self.gated, self.gate = n, tail, tail_s, gated, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i >= self.n - self.tail:
            time.sleep(self.tail_s)
        if i == self.gated:
            while not Path(self.gate).exists():
                time.sleep(0.005)
        return {"index": np.int64(i)}


def tag_epoch(sample: dict, rng: np.random.Generator) -> dict:
    """Adds the first draw of the sample's generator: it names the epoch it was made for."""
    return {"index": sample["index"], "draw": np.float64(rng.random())}


def epoch_of(index: int, draw: float, epochs: range) -> int:
    """The epoch whose generator for ``index`` draws ``draw`` first (-1 if none)."""
    for e in epochs:
        if sample_rng(SEED, e, index).random() == draw:
            return e
    return -1


def batches_of(loader) -> list[tuple[list[int], list[float]]]:
    return [(b["index"].tolist(), b["draw"].tolist()) for b in loader]


def wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_five_epochs_with_stragglers_deliver_each_sample_once_and_never_mix_epochs():
    n, epochs = 10, range(5)
    ds = StragglerTail(n, tail=2, tail_s=0.15)
    with Loader(ds, batch_size=3, transform=tag_epoch, seed=SEED, workers=2,
                autotune=False) as L:
        for e in epochs:
            seen = []
            for indices, draws in batches_of(L):
                made_for = {epoch_of(i, d, epochs) for i, d in zip(indices, draws, strict=True)}
                assert made_for == {e}, f"a batch of epoch {e} holds samples of {made_for}"
                seen += indices
            assert sorted(seen) == list(range(n)), f"epoch {e}: {sorted(seen)}"
        p = L._pipeline
        # Epochs 1..4 were each started ahead and adopted; nothing was thrown away.
        assert p.speculative_adopted == 4
        assert L.snapshot().speculative_discarded_total == 0


def test_set_epoch_out_of_sequence_discards_speculation_and_delivers_that_epochs_order():
    n, bs = 12, 3
    with Loader(StragglerTail(n), batch_size=bs, shuffle=True, in_order=True,
                transform=tag_epoch, seed=SEED, workers=2, autotune=False) as L:
        batches_of(L)  # epoch 0; epoch 1 is expected next and started
        p = L._pipeline
        spec = p.pending
        assert spec is not None and spec.epoch_no == 1
        wait_for(lambda: spec.taken > 0, "samples of epoch 1 to be dispatched")
        L.set_epoch(7)
        got = batches_of(L)
        taken = spec.taken  # no more after the discard: the run left the scheduler
        indices = [i for idx, _ in got for i in idx]
        assert indices == epoch_order(n, epoch=7, seed=SEED, shuffle=True)
        assert all(epoch_of(i, d, range(8)) == 7 for idx, dr in got for i, d in zip(idx, dr, strict=True))
        assert p.speculative_adopted == 0
        snap = L.snapshot()
        assert snap.speculative_discarded_total == taken > 0
        col = SnapshotCollector()
        col.add(1, "0", L.snapshot)
        exported = {s.name: s.value for m in col.collect() for s in m.samples}
        assert exported["autominato_speculative_samples_discarded_total"] == taken


def test_next_epochs_first_batch_is_assembled_before_this_epochs_last_straggler_finishes(tmp_path):
    n, bs = 8, 2
    gate = tmp_path / "gate"
    ds = StragglerTail(n, gated=n - 1, gate=str(gate))
    with Loader(ds, batch_size=bs, transform=tag_epoch, seed=SEED, workers=2,
                autotune=False) as L:
        first_epoch: list[int] = []
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                for indices, _ in batches_of(L):
                    first_epoch.extend(indices)
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        t = threading.Thread(target=consume)
        t.start()
        try:
            # Epoch 0's straggler (index n-1) cannot finish before the gate opens: epoch 1's
            # first batch must be assembled while it is still running.
            wait_for(lambda: L._pipeline.pending is not None and len(L._pipeline.pending.out) > 0,
                     "a batch of epoch 1 while epoch 0's straggler still runs")
            assert n - 1 not in first_epoch and t.is_alive()
            head = L._pipeline.pending.out[0]
            assert head[0] == "batch"
            ready = head[2]
        finally:
            gate.touch()
            t.join(timeout=60)
        assert not errors, errors
        assert sorted(first_epoch) == list(range(n))
        second = batches_of(L)
        assert second[0][0] == ready  # the batch assembled ahead is the one delivered first
        assert sorted(i for idx, _ in second for i in idx) == list(range(n))
        assert all(epoch_of(i, d, range(2)) == 1 for idx, dr in second for i, d in zip(idx, dr, strict=True))
        assert L._pipeline.speculative_adopted == 1


def test_a_distributed_sampler_is_followed_and_other_samplers_or_the_switch_turn_it_off():
    n = 8
    ds = StragglerTail(n)
    sampler = DistributedSampler(range(n), num_replicas=2, rank=1, shuffle=True, seed=3)
    with Loader(ds, batch_size=2, sampler=sampler, transform=tag_epoch, seed=SEED, workers=1,
                autotune=False) as L:
        for e in range(3):
            sampler.set_epoch(e)  # DDP's habit: the loop sets the sampler's epoch itself
            expect = copy.copy(sampler)
            got = sorted(i for idx, _ in batches_of(L) for i in idx)
            assert got == sorted(expect)
        assert L._pipeline.speculative_adopted == 2
        assert L.snapshot().speculative_discarded_total == 0
    with Loader(ds, batch_size=2, sampler=list(range(n)), seed=SEED, workers=1,
                autotune=False) as L:
        batches_of_plain = [b["index"].tolist() for b in L]
        assert sorted(sum(batches_of_plain, [])) == list(range(n))
        assert L._pipeline.pending is None  # a user's sampler may have side effects
    with Loader(ds, batch_size=2, seed=SEED, workers=1, autotune=False,
                prefetch_next_epoch=False) as L:
        list(L)
        assert L._pipeline.pending is None


def test_a_repeated_epoch_of_a_distributed_sampler_is_expected_as_the_loaders(caplog):
    """A loop that sets the same epoch on its ``DistributedSampler`` every pass: after one
    repeat the same epoch is expected (review 45: the sampler's copy always moved on by one,
    so every later pass discarded its speculation). The permutation then repeats: a warning
    says so, once (a trainer that sets the epoch only on a DataLoader's sampler, as MONAI's
    engines do, would else repeat it silently)."""
    n = 8
    sampler = DistributedSampler(range(n), num_replicas=2, rank=0, shuffle=True, seed=3)
    with caplog.at_level("WARNING", logger="autominato"), Loader(
            StragglerTail(n), batch_size=2, sampler=sampler, transform=tag_epoch, seed=SEED,
            workers=1, autotune=False) as L:
        for _ in range(4):
            sampler.set_epoch(5)
            got = sorted(i for idx, _ in batches_of(L) for i in idx)
            assert got == sorted(copy.copy(sampler))
        # pass 0 expects epoch 6 (discarded), passes 1-2 expect 5 (adopted)
        assert L._pipeline.speculative_adopted == 2
    told = [r for r in caplog.records if "epoch was 5 for two whole passes in a row and a third" in r.getMessage()]
    assert len(told) == 1
    caplog.clear()
    for named in (False, True):  # two passes an epoch (training, evaluation): no warning
        with caplog.at_level("WARNING", logger="autominato"), Loader(
                StragglerTail(n), batch_size=2, sampler=sampler, seed=SEED, workers=1,
                autotune=False) as L:
            for e in range(3):
                (L if named else sampler).set_epoch(e)
                list(L), list(L)
            assert not [r for r in caplog.records if "whole passes" in r.getMessage()]
            if named:  # a loop that names its epochs with loader.set_epoch: not warned
                L.set_epoch(3)
                list(L), list(L), list(L)
                assert not [r for r in caplog.records if "whole passes" in r.getMessage()]
    caplog.clear()
    with caplog.at_level("WARNING", logger="autominato"), Loader(
            StragglerTail(n), batch_size=2, sampler=sampler, seed=SEED, workers=1,
            autotune=False) as L:
        for e in range(3):
            L.set_epoch(e)
            list(L)
        for e in range(3, 6):  # review 103: an iter() before set_epoch is no epoch
            iter(L)
            sampler.set_epoch(e)
            list(L)
    assert not [r for r in caplog.records if "whole passes" in r.getMessage()]


@pytest.mark.parametrize("repeat_epoch", [True, False])
def test_a_pass_that_repeats_the_set_epoch_is_expected_after_one_repeat(repeat_epoch):
    """``set_epoch`` holds until set again: after one repeated pass the same epoch is expected
    next; a training loop that calls ``set_epoch(e)`` each time gets ``e + 1`` expected."""
    n = 6
    with Loader(StragglerTail(n), batch_size=2, shuffle=True, transform=tag_epoch, seed=SEED,
                workers=1, autotune=False) as L:
        for e in range(4):
            L.set_epoch(3 if repeat_epoch else e)
            got = batches_of(L)
            assert sorted(i for idx, _ in got for i in idx) == list(range(n))
        p = L._pipeline
        # Repeating: pass 0 expects epoch 4 (discarded), passes 1-2 expect 3 (adopted).
        # Counting up: every pass after the first was expected.
        assert p.speculative_adopted == (2 if repeat_epoch else 3)


@pytest.mark.parametrize("through", ["loader", "sampler"])
def test_a_loop_that_steps_its_epoch_by_two_is_expected_once_the_step_repeats(through):
    """``set_epoch(2 * e)`` (the Loader's, or a DistributedSampler's own, as a DDP loop
    calls it): the first move by 2 is taken for a jump (epoch e + 1 expected after it), the
    second for the loop's stride: every later pass was started ahead and adopted, each
    with its own epoch's order, each sample once."""
    n, passes = 8, 5
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=SEED)
    kwargs = dict(sampler=sampler) if through == "sampler" else dict(shuffle=True)
    with Loader(StragglerTail(n), batch_size=2, transform=tag_epoch, seed=SEED, workers=1,
                in_order=True, autotune=False, **kwargs) as L:
        for k in range(passes):
            (sampler if through == "sampler" else L).set_epoch(2 * k)
            got = batches_of(L)
            indices = [i for idx, _ in got for i in idx]
            if through == "sampler":
                sampler_ = copy.copy(sampler)
                assert indices == list(iter(sampler_))
            else:
                assert indices == epoch_order(n, epoch=2 * k, seed=SEED, shuffle=True)
                draws = [(i, d) for idx, dr in got for i, d in zip(idx, dr, strict=True)]
                assert all(epoch_of(i, d, range(2 * passes)) == 2 * k for i, d in draws)
        p = L._pipeline
        # passes 0-2 expected epochs 1, 3 and 6 (the first two discarded); 3 and 4 adopted
        assert p.speculative_adopted == passes - 3


def test_discarded_speculation_frees_its_shared_memory_slots():
    # Samples big enough (256 KiB) to travel through shared-memory slots.
    class Big(StragglerTail):
        def __getitem__(self, i: int) -> dict:
            return {"index": np.int64(i), "image": np.full((64, 1024), i, np.float32)}

    with Loader(Big(12), batch_size=2, seed=SEED, workers=2, autotune=False) as L:
        list(L)
        p = L._pipeline
        spec = p.pending
        wait_for(lambda: spec.taken > 0, "samples of epoch 1 to be dispatched")
        L.prefetch_next_epoch = False
        L.set_epoch(5)
        assert sorted(i for b in L for i in b["index"].tolist()) == list(range(12))
        assert p.pending is None
        pool = p.slots
        wait_for(lambda: len(pool._free) == len(pool._all), "every slot to be free")
        assert len(pool._all) > 0


def test_a_check_pass_that_delivers_no_batch_does_not_make_the_epoch_look_repeated():
    """Lightning's order: iter() once to check the loader (dropped at once), the first epoch's
    iterator, then set_epoch(0), set_epoch(1)... The check pass is no epoch (it delivers no
    batch), so it must not make the next pass expected to repeat epoch 0."""
    n = 6
    with Loader(StragglerTail(n), batch_size=2, shuffle=True, transform=tag_epoch, seed=SEED,
                workers=1, worker_kind="thread", autotune=False) as L:
        iter(L)  # the check
        for e in range(3):
            if e == 0:
                it = iter(L)
                L.set_epoch(e)
            else:
                L.set_epoch(e)
                it = iter(L)
            got = batches_of(it)
            assert sorted(i for idx, _ in got for i in idx) == list(range(n))
            assert {epoch_of(i, d, range(4)) for idx, ds in got for i, d in zip(idx, ds, strict=True)} == {e}
        p = L._pipeline
        assert p.speculative_adopted == 2


def test_an_interrupt_while_a_pass_starts_leaves_no_run_without_an_iterator(monkeypatch):
    # Ctrl-C while iter() builds the next epoch's speculative run (after it adopted this
    # epoch's): the adopted run had no iterator and kept its samples and batches until close().
    from autominato.pipeline import scheduler

    orig, calls = scheduler.Pipeline._new_run, []

    def new_run(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return orig(self, *a, **k)

    monkeypatch.setattr(scheduler.Pipeline, "_new_run", new_run)
    with Loader(StragglerTail(24), 4, shuffle=True, seed=SEED, num_workers=2,
                autotune=False) as L:
        assert sorted(int(i) for b in L for i in b["index"]) == list(range(24))
        with pytest.raises(KeyboardInterrupt):
            iter(L)  # adopts epoch 1's speculative run, then fails on epoch 2's
        deadline = time.monotonic() + 10
        while L._pipeline.runs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not L._pipeline.runs
        for _ in range(2):  # and the next passes deliver each sample once
            assert sorted(int(i) for b in L for i in b["index"]) == list(range(24))


def consumer_time(s0, s1) -> tuple[float, float, float]:
    """Seconds between epochs, stepping and waiting from snapshot ``s0`` to ``s1``."""
    return (s1.between_epochs_seconds_total - s0.between_epochs_seconds_total,
            s1.consumer_busy_seconds_total - s0.consumer_busy_seconds_total,
            s1.consumer_wait_seconds_total - s0.consumer_wait_seconds_total)


def exported_of(loader) -> dict[str, float]:
    col = SnapshotCollector()
    col.add(1, "0", loader.snapshot)
    return {s.name: s.value for m in col.collect() for s in m.samples}


@pytest.mark.parametrize("workers", [0, 2])
def test_cold_starts_count_the_epochs_that_were_not_prefetched(workers):
    # Prefetched, only the first epoch starts cold; a set_epoch out of sequence discards the
    # prefetched one (a cold start); without prefetching (or workers) every epoch does.
    with Loader(StragglerTail(6), batch_size=2, seed=SEED, workers=workers,
                autotune=False) as L:
        for _ in range(3):
            batches_of_any = list(L)
            assert len(batches_of_any) == 3
        L.set_epoch(9)
        list(L)
        want = 4 if workers == 0 else 2
        assert L.snapshot().cold_starts_total == want
        assert exported_of(L)["autominato_epoch_cold_starts_total"] == want
    with Loader(StragglerTail(6), batch_size=2, seed=SEED, workers=2, autotune=False,
                prefetch_next_epoch=False) as L:
        for _ in range(3):
            list(L)
        assert L.snapshot().cold_starts_total == 3


def test_the_cold_start_count_never_goes_back_across_a_restarted_pass(monkeypatch):
    """Review 200: a pass restarted by set_epoch after iter() takes back the cold start of
    the pass it replaces once the fresh one began; a snapshot in between read one more, and
    the exported counter then fell (Prometheus reads that as a reset to 0)."""
    with Loader(StragglerTail(6), batch_size=2, seed=SEED, workers=2, autotune=False) as L:
        it = iter(L)  # epoch 0's pass (the first: cold)
        seen = []
        begin = Loader._map_pass

        def spy(self, *a, **kw):
            fresh = begin(self, *a, **kw)
            seen.append(self.snapshot().cold_starts_total)  # the fresh pass began
            return fresh

        monkeypatch.setattr(Loader, "_map_pass", spy)
        L.set_epoch(5)  # before the first batch: the pass restarts as epoch 5 (cold)
        rest = [next(it)] + list(it)
        assert len(rest) == 3 and seen == [2]
        assert L.snapshot().cold_starts_total == 2  # not 1 after 2


def test_time_between_epochs_is_counted_apart_from_steps_and_waits():
    # The training loop sleeps 0.1 s a step and 0.5 s between epochs (a validation loop);
    # after a break it also leaves the pass. Steps, waits and the time between epochs add up
    # to the wall time, and the last is the 1.5 s of the three pauses.
    with Loader(StragglerTail(6), batch_size=2, seed=SEED, workers=2, autotune=False) as L:
        list(L)  # workers up, the first epoch's costs out of the measured span
        t0 = time.monotonic()
        s0 = L.snapshot()
        for e in range(3):
            for k, _ in enumerate(L):
                time.sleep(0.1)
                if e == 2 and k == 1:
                    break  # the pass is dropped after its second step
            time.sleep(0.5)
        s1 = L.snapshot()
        wall = time.monotonic() - t0
        between, busy, wait = consumer_time(s0, s1)
        assert 1.5 <= between < 1.5 + 0.5, between
        assert 0.8 <= busy < 0.8 + 0.5, busy  # 8 steps of 0.1 s
        assert abs(wall - (between + busy + wait)) < 0.1, (wall, between, busy, wait)
        assert exported_of(L)["autominato_between_epochs_seconds_total"] == pytest.approx(
            L.snapshot().between_epochs_seconds_total, abs=0.05)


class FailsAt:
    """``{"index": i}``, except index ``bad``, which raises."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.bad:
            raise ValueError(f"sample {i} is broken")
        return {"index": np.int64(i)}


def test_time_after_an_error_that_ends_the_epoch_is_time_between_epochs():
    # The training loop catches the error outside its for loop and validates for 0.4 s,
    # twice: the 0.8 s is neither step nor wait but time between epochs. (With no worker the
    # error kept by pytest.raises holds the pass, which stays live: not counted there.)
    with Loader(FailsAt(6, bad=5), batch_size=2, seed=SEED, workers=2,
                autotune=False, in_order=True) as L:
        s0 = L.snapshot()
        t0 = time.monotonic()
        for _ in range(2):
            with pytest.raises(ValueError, match="broken"):
                for _ in L:
                    time.sleep(0.05)
            time.sleep(0.4)
        s1 = L.snapshot()
        wall = time.monotonic() - t0
        between, busy, wait = consumer_time(s0, s1)
        assert 0.8 <= between < 0.8 + 0.4, between
        assert abs(wall - (between + busy + wait)) < 0.1, (wall, between, busy, wait)


def test_an_older_pass_dropped_later_is_no_leave():
    # Lightning's habit: a pass it never uses, then the epoch's. The unused one, dropped
    # from another thread while the epoch's first batch is awaited, is no leave: that wait
    # must not count again as time between epochs.
    with Loader(StragglerTail(4, tail=4, tail_s=0.5), batch_size=2, seed=SEED, workers=2,
                autotune=False) as L:
        unused = [iter(L)]
        it = iter(L)
        s0 = L.snapshot()
        threading.Timer(0.1, unused.clear).start()
        next(it)
        next(it)
        s1 = L.snapshot()
        assert not unused
        assert s1.consumer_wait_seconds_total - s0.consumer_wait_seconds_total > 0.4
        assert s1.between_epochs_seconds_total - s0.between_epochs_seconds_total < 0.05


def test_an_epoch_left_early_refills_and_counts_as_a_cold_start():
    # A break after 2 of 20 batches (the window holds 6 samples: most of the epoch is never
    # handed out): the next epoch's prefetched run waited behind the pass left early and
    # starts empty when adopted: a cold start, as a discarded one.
    with Loader(StragglerTail(40), batch_size=2, seed=SEED, workers=2, autotune=False,
                pool_size=6) as L:
        for _ in range(3):
            for k, _ in enumerate(L):
                if k == 1:
                    break
        assert L._pipeline.speculative_adopted == 2
        assert L.snapshot().cold_starts_total == 3
        list(L)  # whole from here: its prefetched run waited (a cold start) ...
        assert L.snapshot().cold_starts_total == 4
        spec = L._pipeline.pending
        wait_for(lambda: spec.taken > 0, "the next epoch's prefetch")
        list(L)  # ... and the next one's did not
        assert L._pipeline.speculative_adopted == 4
        assert L.snapshot().cold_starts_total == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_peek_inside_the_loop_is_no_leave(workers):
    # next(iter(loader)) inside the training loop (review 76): the peeking pass ends at once,
    # but the loop is still in its epoch: none of it is time between epochs.
    with Loader(StragglerTail(6), batch_size=2, seed=SEED, workers=workers,
                autotune=False) as L:
        s0 = L.snapshot()
        for _ in L:
            next(iter(L))
            time.sleep(0.1)
        time.sleep(0.3)
        s1 = L.snapshot()
        between = s1.between_epochs_seconds_total - s0.between_epochs_seconds_total
        assert 0.3 <= between < 0.3 + 0.2, between  # the pause after the epoch alone


def test_time_between_epochs_stops_at_close():
    L = Loader(StragglerTail(6), batch_size=2, seed=SEED, workers=2, autotune=False)
    list(L)
    it = iter(L)
    next(it)
    time.sleep(0.1)
    L.close()
    s0 = L.snapshot()
    del it  # dropped after close: no leave
    time.sleep(0.3)
    assert L.snapshot().between_epochs_seconds_total == s0.between_epochs_seconds_total


class _BrokenUntil:
    """Index 5 raises until ``flag`` exists (a file repaired on disk between epochs); each
    load of index 5 adds a line to ``tries`` (seen from worker processes too)."""

    def __init__(self, flag: Path, tries: Path) -> None:
        self.flag, self.tries = flag, tries

    def __len__(self) -> int:
        return 12

    def _fail(self) -> None:
        raise KeyError("corrupt volume 5")

    def __getitem__(self, i: int):
        if i == 5:
            broken = not self.flag.exists()  # read before the line is written: a test that
            with open(self.tries, "a") as f:  # sees the line knows the load's outcome (a
                f.write("x\n")  # `make test` run saw the ahead load read the repaired file)
            if broken:
                self._fail()
        time.sleep(0.01)
        return np.full(2, i, np.float32)


def _one_pass(it) -> tuple[list[int], list[BaseException]]:
    got, errors = [], []
    while True:
        try:
            got += [int(x) for x in next(it)[:, 0]]
        except StopIteration:
            return got, errors
        except KeyError as e:
            errors.append(e)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("kind,on_error", [("thread", "raise"), ("process", "raise"),
                                           ("thread", "skip")])
def test_a_sample_that_failed_while_loaded_ahead_is_loaded_again_when_its_epoch_begins(
        tmp_path, kind, on_error):
    # Trial 79: a file repaired between epochs still failed in the next epoch, whose samples
    # were read before the repair; the DataLoader reads them after it and delivers them all.
    flag, tries = tmp_path / "repaired", tmp_path / "tries"
    # pool_size: the whole next epoch may be loaded ahead, index 5 with it, whatever the lead
    # rule holds (8 samples ahead: index 5, fast since it fails, goes last among them).
    with Loader(_BrokenUntil(flag, tries), 2, num_workers=2, worker_kind=kind,
                on_error=on_error, autotune=False, pool_size=12, in_order=False) as L:
        got, errors = _one_pass(iter(L))
        assert sorted(got) == [i for i in range(12) if i != 5]
        assert len(errors) == (on_error == "raise")
        deadline = time.monotonic() + 10
        while _lines(tries) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the next epoch's index 5 is loaded ahead, and fails
        assert _lines(tries) == 2
        flag.touch()
        got, errors = _one_pass(iter(L))
        assert sorted(got) == list(range(12)) and not errors
        # loaded again, once, when epoch 1 began (and maybe ahead for epoch 2 by now)
        assert 3 <= _lines(tries) <= 4
        assert L.snapshot().skipped_total == (on_error == "skip")  # epoch 0's only


class _ReadBeforeRepair:
    """Index 5 reads its file state (``broken``) on entry, then, from its second load on,
    waits for ``gate`` before it raises with what it read: a load that began before the
    repair and ends after it."""

    def __init__(self) -> None:
        self.broken = True
        self.loads = 0
        self.entered, self.gate = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        if i == 5:
            broken = self.broken
            self.loads += 1
            if self.loads >= 2:
                self.entered.set()
                self.gate.wait(10)
            if broken:
                raise KeyError(f"corrupt volume {i}")
        return np.full(2, i, np.float32)


def test_a_sample_loaded_ahead_that_fails_after_its_epoch_began_is_loaded_again():
    ds = _ReadBeforeRepair()
    with Loader(ds, 2, num_workers=2, worker_kind="thread", autotune=False) as L:
        got, errors = _one_pass(iter(L))
        assert len(errors) == 1 and 5 not in got
        assert ds.entered.wait(10)  # epoch 1's index 5 is loading ahead, as broken
        ds.broken = False  # repaired between the epochs
        it = iter(L)  # epoch 1 begins (adopted) ...
        time.sleep(0.2)
        ds.gate.set()  # ... before that load fails
        got, errors = _one_pass(it)
        assert sorted(got) == list(range(12)) and not errors


class _StalledUntil(_BrokenUntil):
    """Index 5 stalls (a hung mount) from its second load on, unless ``flag`` exists when its
    load begins; each load of it adds a line to ``tries``."""

    def _fail(self) -> None:
        if _lines(self.tries) >= 2:
            time.sleep(30)

    def __getitem__(self, i: int):
        time.sleep(0.01)  # (20 ms: not sent in chunks, where a timeout is a worker's death)
        return super().__getitem__(i)


def test_a_sample_that_timed_out_while_loaded_ahead_is_loaded_again_when_its_epoch_begins(
        tmp_path):
    # Review 81: a load ahead that timed out (a stalled mount, fixed between the epochs)
    # was reported in the next epoch, as a raised one was before.
    flag, tries = tmp_path / "repaired", tmp_path / "tries"
    with Loader(_StalledUntil(flag, tries), 2, num_workers=2, sample_timeout=0.5,
                on_error="skip", autotune=False) as L:
        got, _ = _one_pass(iter(L))
        assert sorted(got) == list(range(12))
        deadline = time.monotonic() + 20
        while _lines(tries) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # epoch 1's index 5 is loading ahead, and stalls
        assert _lines(tries) == 2
        time.sleep(0.1)
        flag.touch()
        got, _ = _one_pass(iter(L))
        assert sorted(got) == list(range(12))
        assert L.snapshot().skipped_total == 0 and _lines(tries) >= 3


class _KillsOnceArmed:
    """Index 6 kills its worker process (``os._exit``) once while the file ``armed`` exists
    (it removes it first), after the file ``die`` exists where one is named; every other
    load takes ``sample_s`` (10 ms: sent alone, not in chunks; 0: in chunks)."""

    def __init__(self, armed: Path, die: Path | None = None, sample_s: float = 0.01) -> None:
        self.armed, self.die, self.sample_s = str(armed), die and str(die), sample_s

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == 6 and os.path.exists(self.armed):
            os.unlink(self.armed)
            deadline = time.monotonic() + 60
            while self.die and not os.path.exists(self.die) and time.monotonic() < deadline:
                time.sleep(0.005)
            os._exit(1)
        time.sleep(self.sample_s)
        return np.full(2, i, np.float32)


@pytest.mark.parametrize("death", ["raise", "retry-skip"])
def test_a_sample_that_killed_its_worker_while_loaded_ahead_is_loaded_again_when_its_epoch_begins(
        tmp_path, death):
    """Review 185: a death while the next epoch was loaded ahead was acted on at once. With
    ``on_worker_death="raise"`` the error went into that epoch behind its batches: adopted,
    the epoch raised ``WorkerDied`` after a few batches (else it was discarded, depending on
    how far the error had got); with ``"retry"``, ``max_tries=1`` and ``on_error="skip"``
    the sample was skipped in an epoch it never loaded in. As the README says, it is loaded
    again when its epoch begins, and the epoch loaded ahead is kept."""
    armed = tmp_path / "armed"
    kw = ({"on_worker_death": "raise"} if death == "raise"
          else {"on_worker_death": "retry", "max_tries": 1, "on_error": "skip"})
    with Loader(_KillsOnceArmed(armed), 2, num_workers=2, pool_size=8, depth=2,
                autotune=False, **kw) as L:
        got = []
        for k, b in enumerate(L):
            got += [int(x) for x in b[:, 0]]
            if k == 10:
                armed.touch()  # (index 6 ran long ago in this epoch)
            if k == 19:  # the last step: epoch 1 loads ahead meanwhile, index 6 with it
                wait_for(lambda: not armed.exists(), "index 6 loaded ahead")
                wait_for(lambda: L.snapshot().worker_restarts_total >= 1, "the death seen")
        assert sorted(got) == list(range(40))
        adopted = L._pipeline.speculative_adopted
        got = [int(x) for b in L for x in b[:, 0]]
        assert sorted(got) == list(range(40))
        assert L._pipeline.speculative_adopted == adopted + 1  # (not discarded for the death)
        assert L.snapshot().speculative_discarded_total == 0
        assert L.snapshot().skipped_total == 0


def test_a_chunk_loaded_ahead_whose_worker_dies_after_its_epoch_began_is_sent_again(
        tmp_path, monkeypatch):
    """Review 186: a chunk of samples loaded ahead (index 6 and others, sent together) whose
    worker died once the epoch had been adopted raised ``WorkerDied`` under
    ``on_worker_death="raise"`` at that first death; its samples are sent again alone, and
    only a death of the sample's own raises. (Chunks made likely by a larger chunk budget;
    the death comes once the scheduler has taken the epoch as adopted, review 187; before the
    fix the test failed whenever index 6 went in a chunk.)"""
    import autominato.pipeline.executors as executors

    monkeypatch.setattr(executors, "CHUNK_BUDGET_S", 1.0)
    armed, die = tmp_path / "armed", tmp_path / "die"
    with Loader(_KillsOnceArmed(armed, die, sample_s=0.0), 2, num_workers=2, pool_size=8, depth=2,
                autotune=False, on_worker_death="raise") as L:
        got = []
        for k, b in enumerate(L):
            got += [int(x) for x in b[:, 0]]
            if k == 10:
                armed.touch()
            if k == 19:  # epoch 1 loads ahead meanwhile, index 6 with it, which waits
                wait_for(lambda: not armed.exists(), "index 6 loaded ahead")
        assert sorted(got) == list(range(40))
        assert L._pipeline.procs.chunk >= 2
        adopted = L._pipeline.speculative_adopted
        it = iter(L)
        assert L._pipeline.speculative_adopted == adopted + 1
        got = [int(x) for x in next(it)[:, 0]]
        wait_for(lambda: not it.run.speculative, "the adoption handled")
        die.touch()
        got += [int(x) for b in it for x in b[:, 0]]
        assert sorted(got) == list(range(40))
        assert L.snapshot().worker_restarts_total == 1


def test_a_pass_restarted_after_it_adopted_the_epoch_loaded_ahead_counts_that_work_discarded():
    """Review 185: ``set_epoch`` out of sequence between ``iter()`` and the first batch of a
    pass that had adopted the epoch loaded ahead threw those samples away, counted as
    adopted and not in ``speculative_discarded_total``."""
    n = 32
    with Loader(StragglerTail(n), batch_size=4, shuffle=True, in_order=True, transform=tag_epoch,
                seed=SEED, workers=2, pool_size=8, autotune=False) as L:
        for _ in range(2):
            batches_of(L)
        p = L._pipeline
        wait_for(lambda: p.pending is not None and p.pending.taken > 0, "epoch 2 loading ahead")
        adopted = p.speculative_adopted
        it = iter(L)  # epoch 2: adopts it
        assert p.speculative_adopted == adopted + 1
        L.set_epoch(0)  # out of sequence, before the first batch: the pass restarts as epoch 0
        got = [i for idx, _ in batches_of(it) for i in idx]
        assert got == epoch_order(n, epoch=0, seed=SEED, shuffle=True)
        assert p.speculative_adopted == adopted
        ahead = it.run.taken_ahead
        assert ahead > 0
        wait_for(lambda: L.snapshot().speculative_discarded_total == ahead, "the discard counted")


def test_a_next_epoch_never_asked_for_before_close_is_counted_as_discarded():
    """Trial 97: the samples started for the epoch after the last one were counted nowhere."""
    n = 10
    ds = StragglerTail(n, tail=2, tail_s=0.15)
    L = Loader(ds, batch_size=2, transform=tag_epoch, seed=SEED, workers=2, autotune=False)
    with L:
        assert sorted(i for idx, _ in batches_of(L) for i in idx) == list(range(n))
        deadline = time.monotonic() + 5
        while L._pipeline.pending.taken == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the next epoch's samples start
        assert L.snapshot().speculative_discarded_total == 0  # (it may still be asked for)
    started = L._pipeline.speculative_discarded
    assert started > 0 and L.snapshot().speculative_discarded_total == started


class MiB:
    """Sample ``i``: a 1 MiB float32 array filled with ``i``."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((256, 1024), i, np.float32)


@pytest.mark.parametrize("prefetch_next_epoch", [True, False])
def test_batches_left_in_an_ended_run_go_when_the_loop_drops_its_iterator(prefetch_next_epoch):
    """A loop that leaves an epoch (``break``) after its last batches were collated: they go
    at once, not when the run object does (a pending next epoch refers to it: review 99 found
    all 7 batches still held until the next ``iter()``)."""
    import gc
    import weakref

    with Loader(MiB(), batch_size=4, num_workers=2, seed=1, autotune=False, prefetch_factor=8,
                prefetch_next_epoch=prefetch_next_epoch) as loader:
        list(loader)
        it = iter(loader)
        next(it)
        run = it.run
        wait_for(lambda: run.closed, "the run's end in its output")
        refs = [weakref.ref(item[1]) for item in run.out if item[0] == "batch"]
        assert len(refs) >= 2
        del it  # the loop leaves the epoch
        gc.collect()
        wait_for(lambda: all(item[0] != "batch" for item in list(run.out)),
                 "the dropped run's batches cleared", timeout_s=10)
        assert [item[0] for item in run.out] == ["end"]  # (it tells that the run ended)

        def freed() -> bool:
            gc.collect()
            return all(r() is None for r in refs)

        wait_for(freed, "the dropped run's batches freed", timeout_s=10)
        assert run.unconsumed == 0
        assert sorted(int(b[:, 0, 0].sum()) for b in loader) == sorted(
            int(sum(range(k, k + 4))) for k in range(0, 32, 4))  # the next epoch whole


def test_an_iterator_whose_start_the_closed_pipeline_never_took_ends_with_its_error(monkeypatch):
    """``load_state_dict`` replacing the seeds closes the pipeline with an error; an iterator
    made just before, whose start the scheduler had not read yet, raises it instead of waiting
    for ever (review 99). The scheduler is held busy for a second so that the start waits in
    its queue."""
    from autominato.pipeline import scheduler

    with Loader(MiB(), batch_size=4, num_workers=1, seed=9, autotune=False) as other:
        list(other)
        state = other.state_dict()
    loader = Loader(MiB(), batch_size=4, num_workers=1, autotune=False, prefetch_next_epoch=False)
    try:
        list(loader)
        expire = scheduler.Pipeline._expire
        busy = threading.Event()

        def slow_expire(self):
            if busy.is_set():
                busy.clear()
                time.sleep(1.0)
            return expire(self)

        monkeypatch.setattr(scheduler.Pipeline, "_expire", slow_expire)
        busy.set()
        wait_for(lambda: not busy.is_set(), "the scheduler inside its slow pass")
        it = iter(loader)  # its start waits in the scheduler's queue
        loader.load_state_dict(state)  # another seed: the pipeline closes with an error
        out: dict = {}

        def consume() -> None:
            try:
                out["got"] = len(list(it))
            except RuntimeError as e:
                out["got"] = str(e)

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        t.join(20)
        assert "got" in out, "next() still waits"
        assert "load_state_dict() took the state's seed" in str(out["got"])
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_after_iter_and_before_the_first_batch_names_that_passs_epoch(workers, caplog):
    """As the DataLoader's sampler with no worker, read at the first ``next()``: Lightning
    makes a fit's first iterator, then calls ``set_epoch`` (trial 151: a fit resumed from an
    end-of-epoch checkpoint ran its first epoch as the Loader's epoch 0). Order and
    augmentation are then the named epoch's, each sample once; a ``set_epoch`` of the pass's
    own epoch changes nothing."""
    n, bs = 12, 3
    caplog.set_level(logging.INFO, logger="autominato")
    with Loader(StragglerTail(n), batch_size=bs, shuffle=True, in_order=True,
                transform=tag_epoch, seed=SEED, workers=workers, autotune=False) as L:
        batches_of(L)  # epoch 0 (with workers, epoch 1 is started ahead)
        it = iter(L)
        L.set_epoch(7)
        got = batches_of(it)
        assert [i for idx, _ in got for i in idx] == epoch_order(n, epoch=7, seed=SEED,
                                                                 shuffle=True)
        assert {epoch_of(i, d, range(9)) for idx, dr in got
                for i, d in zip(idx, dr, strict=True)} == {7}
        assert "epoch 7 starts from its beginning" in caplog.text
        caplog.clear()
        it = iter(L)
        L.set_epoch(7)  # the pass's own epoch: no restart
        assert [i for idx, _ in batches_of(it) for i in idx] == epoch_order(
            n, epoch=7, seed=SEED, shuffle=True)
        assert "starts from its beginning" not in caplog.text
        assert L.state_dict()["epoch"] == 7


@pytest.mark.parametrize("workers", [0, 2])
def test_a_user_samplers_set_epoch_after_iter_names_the_passs_order(workers):
    """Lightning calls ``loader.sampler.set_epoch``: with a ``DistributedSampler`` of the
    user's, the pass takes the order its epoch gives at the first ``next()``."""
    n = 12
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=3)
    with Loader(StragglerTail(n), batch_size=3, sampler=sampler, in_order=True,
                transform=tag_epoch, seed=SEED, workers=workers, autotune=False) as L:
        batches_of(L)
        it = iter(L)
        sampler.set_epoch(5)
        want = copy.copy(sampler)
        assert [i for idx, _ in batches_of(it) for i in idx] == list(want)


def _epochs_of(batches, epochs: range) -> set[int]:
    return {epoch_of(i, d, epochs) for idx, dr in batches for i, d in zip(idx, dr, strict=True)}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batched", [False, True])
def test_a_distributed_samplers_epoch_set_by_the_loop_is_the_loaders_epoch(workers, batched):
    """DDP's loop resumed at epoch 3 that sets only its sampler's epoch: each pass is that
    epoch, order and augmentation (trial 189: pass 0's augmentation with epoch 3's order),
    ``loader.epoch`` too, and what was loaded ahead is used; also where the loop sets it
    after ``iter()`` (Lightning's order) and with the sampler in a ``BatchSampler``."""
    from torch.utils.data import BatchSampler

    n = 12
    sampler = DistributedSampler(range(n), num_replicas=2, rank=1, shuffle=True, seed=3)
    kw = (dict(batch_sampler=BatchSampler(sampler, 2, drop_last=False)) if batched
          else dict(batch_size=2, sampler=sampler))
    with Loader(StragglerTail(n), transform=tag_epoch, seed=SEED, workers=workers,
                in_order=True, autotune=False, **kw) as L:
        for e in range(3, 6):
            sampler.set_epoch(e)
            got = batches_of(L)
            assert [i for idx, _ in got for i in idx] == list(copy.copy(sampler))
            assert _epochs_of(got, range(8)) == {e}
            assert L.epoch == e and L.snapshot().epoch == e  # (the autominato_epoch gauge's)
        it = iter(L)  # (Lightning: the iterator first, then set_epoch)
        sampler.set_epoch(7)
        got = batches_of(it)
        assert [i for idx, _ in got for i in idx] == list(copy.copy(sampler))
        assert _epochs_of(got, range(9)) == {7} and L.epoch == 7
        if workers and not batched:
            assert L._pipeline.speculative_adopted == 2  # epochs 4 and 5 were loaded ahead
        L.set_epoch(1)  # the Loader's own set_epoch names both from now on
        sampler.set_epoch(6)
        got = batches_of(L)
        assert _epochs_of(got, range(8)) == {1} and L.epoch == 1


def test_a_distributed_samplers_epoch_at_or_below_the_loaders_leaves_it_counting_passes():
    """A loop that never sets the sampler's epoch: the order repeats (warned), but the
    augmentation moves on each pass, as the DataLoader's draws do; a loop resumed at epoch 3
    that makes two passes an epoch (training, then evaluation over the training loader)
    draws anew in each (review 68), from epoch 3 on."""
    n = 8
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=3)
    with Loader(StragglerTail(n), batch_size=2, sampler=sampler, transform=tag_epoch,
                seed=SEED, workers=1, in_order=True, autotune=False) as L:
        for e in range(3):
            got = batches_of(L)
            assert _epochs_of(got, range(4)) == {e} and L.epoch == e
            assert [i for idx, _ in got for i in idx] == list(copy.copy(sampler))
    with Loader(StragglerTail(n), batch_size=2, sampler=sampler, transform=tag_epoch,
                seed=SEED, workers=1, in_order=True, autotune=False) as L:
        epochs = []
        for e in range(3, 5):
            sampler.set_epoch(e)
            for _ in range(2):
                got = batches_of(L)
                assert [i for idx, _ in got for i in idx] == list(copy.copy(sampler))
                (drawn,) = _epochs_of(got, range(8))
                epochs.append(drawn)
        assert epochs == [3, 4, 5, 6]


def _ddp(n: int, **kw):
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=3)
    return sampler, Loader(StragglerTail(n), batch_size=2, sampler=sampler, transform=tag_epoch,
                           seed=SEED, in_order=True, autotune=False, **kw)


def _resumed_pass(state: dict, n: int, workers: int, epoch: int) -> tuple[list, int]:
    """A new job's first pass from ``state``, the loop setting its sampler to ``epoch`` after
    the load: its batches (checked to be in the sampler's order) and ``loader.epoch``."""
    s, L = _ddp(n, workers=workers)
    with L:
        L.load_state_dict(state)
        s.set_epoch(epoch)
        got = batches_of(L)
        assert [i for idx, _ in got for i in idx] == list(copy.copy(s))
        return got, L.epoch


def _ended_state(n: int, workers: int, epochs: int) -> dict:
    """The state after a DDP loop's epochs ``0 .. epochs - 1`` (each ``sampler.set_epoch(e)``,
    one pass), taken after the last: an ended epoch's."""
    s, L = _ddp(n, workers=workers)
    with L:
        for e in range(epochs):
            s.set_epoch(e)
            list(L)
        return L.state_dict()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("lightning", [False, True])
def test_a_checkpoint_before_a_resumed_jobs_first_pass_resumes_the_samplers_epoch(
        workers, lightning):
    """Review 190: a job resumed at epoch 3 that checkpoints before its first pass (the
    state's epoch was the Loader's count, 0) resumed pass 0's augmentation."""
    n = 8
    s, L = _ddp(n, workers=workers)
    with L:
        s.set_epoch(3)
        state = L.state_dict()
    assert state["epoch"] == 3
    s, L = _ddp(n, workers=workers)
    with L:
        L.load_state_dict(state)
        if lightning:
            it = iter(L)
            s.set_epoch(3)
        else:
            s.set_epoch(3)
            it = iter(L)
        got = batches_of(it)
        assert [i for idx, _ in got for i in idx] == list(copy.copy(s))
        assert _epochs_of(got, range(6)) == {3} and L.epoch == 3
        s.set_epoch(4)
        assert _epochs_of(batches_of(L), range(6)) == {4}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loop_of_two_passes_an_epoch_resumed_after_its_training_pass_loses_no_epoch(workers):
    """Review 190: a loop resumed at epoch 3 that makes a training pass, checkpoints, then
    an evaluation pass, each sampler epoch: the Loader's ended epoch (5) is the number the
    loop sets its sampler to next, which was taken as the loop naming that ended epoch, and
    the resumed epoch delivered nothing."""
    n = 8
    s, L = _ddp(n, workers=workers)
    with L:
        for e in (3, 4):
            s.set_epoch(e)
            list(L)
            state = L.state_dict()
            list(L)  # (evaluation over the training loader)
    assert state["finished"] and state["epoch"] == 5 and state["sampler_epochs"] == {"sampler": 4}
    _, epoch = _resumed_pass(state, n, workers, 5)
    assert epoch > 5  # (a new epoch's augmentation: not one the run drew)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_earlier_autominatos_state_below_its_samplers_epoch_resumes_each_sample_once(
        workers, monkeypatch):
    """A mid-epoch state of a loop that sets only its sampler's epoch, taken before the Loader
    followed it (epoch 1 with the sampler at 8): an iterator made and dropped unused
    (Lightning's check) leaves it pending, and the pass after it resumes it, each sample
    once (review 190: the pass followed the sampler to epoch 8 and delivered from the
    epoch's start again)."""
    n = 12
    s, L = _ddp(n, workers=workers)
    with monkeypatch.context() as m, L:
        m.setattr(Loader, "_followed_epoch", lambda self, sampler=None: None)
        list(L)
        s.set_epoch(8)
        it = iter(L)
        part = [next(it) for _ in range(2)]
        state = L.state_dict()
    assert state["epoch"] == 1 and state["sampler_epochs"] == {"sampler": 8}
    s, L = _ddp(n, workers=workers)
    with L:
        L.load_state_dict(state)
        s.set_epoch(8)
        del it
        unused = iter(L)
        del unused
        rest = [i for b in L for i in b["index"].tolist()]
        assert L.epoch == 1
        s.set_epoch(9)
        assert _epochs_of(batches_of(L), range(12)) == {9}
    assert sorted(rest + [i for b in part for i in b["index"].tolist()]) == list(range(n))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("earlier", [False, True])
def test_an_ended_epochs_state_taken_after_the_loop_set_the_next_epoch_resumes_the_next(
        workers, earlier):
    """A loop that checkpoints at the top of each epoch, after ``sampler.set_epoch(e)``: the
    state is of epoch e - 1, ended, with the sampler already at e; resumed, the loop sets e
    and gets epoch e whole. Also for a state of an earlier autominato, which has no
    ``began_sampler_epochs`` (review 191: its ``sampler_epochs``, e, read as the ended
    epoch's own, named it, and epoch e delivered nothing)."""
    n = 8
    s, L = _ddp(n, workers=workers)
    with L:
        for e in range(4):
            s.set_epoch(e)
            state = L.state_dict()
            if e == 3:
                break
            list(L)
    assert state["finished"] and state["epoch"] == 2 and state["sampler_epochs"] == {"sampler": 3}
    if earlier:
        del state["began_sampler_epochs"]
    s, L = _ddp(n, workers=workers)
    with L:
        L.load_state_dict(state)
        for e in (3, 4):
            s.set_epoch(e)
            got = batches_of(L)
            assert [i for idx, _ in got for i in idx] == list(copy.copy(s))
            assert _epochs_of(got, range(6)) == {e} and L.epoch == e


class OwnEpochs:
    """A sampler of the user's with ``set_epoch`` and ``epoch`` (not a DistributedSampler:
    the Loader counts its passes beside it): a seeded permutation of its epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(np.random.default_rng(self.epoch).permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_counting_one_ahead_of_the_loader_resumes_its_next_epoch(workers):
    """A loop that numbers its epochs from 1 on a sampler the Loader does not follow, and
    sets the next one before the load: the load set the sampler to the Loader's next epoch,
    the ended epoch's own number for that sampler, read as the loop naming it (review 191:
    the resumed pass delivered nothing); each sampler now takes its own next."""
    n = 8
    s = OwnEpochs(n)
    kw = dict(batch_size=2, transform=tag_epoch, seed=SEED, in_order=True, autotune=False,
              workers=workers)
    with Loader(StragglerTail(n), sampler=s, **kw) as L:
        for e in (1, 2, 3):
            s.set_epoch(e)
            list(L)
        state = L.state_dict()
    assert state["epoch"] == 2 and state["began_sampler_epochs"] == {"sampler": 3}
    s = OwnEpochs(n)
    with Loader(StragglerTail(n), sampler=s, **kw) as L:
        s.set_epoch(4)
        L.load_state_dict(state)
        got = [i for b in L for i in b["index"].tolist()]
    want = OwnEpochs(n)
    want.set_epoch(4)
    assert got == list(want) and s.epoch == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_between_iter_and_the_samplers_set_epoch_records_the_epoch_named(workers):
    """Lightning's order in a job resumed at epoch 3 without the Loader's state: ``iter()``,
    then ``sampler.set_epoch(3)``, and a checkpoint before the first batch (review 191: the
    state recorded the pass count, 0, and the resumed pass drew epoch 0's augmentation)."""
    n = 8
    s, L = _ddp(n, workers=workers)
    with L:
        it = iter(L)
        s.set_epoch(3)
        state = L.state_dict()
        del it
    assert state["epoch"] == 3 and state["epoch_size"] is None
    got, epoch = _resumed_pass(state, n, workers, 3)
    assert _epochs_of(got, range(6)) == {3} and epoch == 3


class BucketSampler(DistributedSampler):
    """A DistributedSampler subclass that yields batches (VITS's ``DistributedBucketSampler``
    is one), given as ``batch_sampler``."""

    def __iter__(self):
        out = list(super().__iter__())
        return iter([out[i:i + 2] for i in range(0, len(out), 2)])

    def __len__(self) -> int:
        return -(-super().__len__() // 2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_distributed_sampler_given_as_batch_sampler_is_followed(workers):
    n = 8
    b = BucketSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=3)
    with Loader(StragglerTail(n), batch_sampler=b, transform=tag_epoch, seed=SEED,
                in_order=True, autotune=False, workers=workers) as L:
        b.set_epoch(3)
        got = batches_of(L)
        assert [idx for idx, _ in got] == list(copy.copy(b))
        assert _epochs_of(got, range(6)) == {3} and L.epoch == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_set_back_after_iter_restarts_the_pass_from_its_count(workers):
    """Review 192: a DistributedSampler left at epoch 3 (an earlier fit) moved the pass up to
    3 at ``iter()``; Lightning's ``set_epoch(0)`` then restarted it from 3, not from the
    count, and the fit ran augmentation epochs 3, 4 with orders 0, 1. Before the first pass,
    ``loader.epoch`` is the one the pass will take (the state's)."""
    n = 8
    s, L = _ddp(n, workers=workers)
    s.set_epoch(3)
    with L:
        assert L.epoch == 3 and L.snapshot().epoch == 3 and L.state_dict()["epoch"] == 3
        it = iter(L)
        s.set_epoch(0)
        assert L.state_dict()["epoch"] == 0
        got = batches_of(it)
        assert [i for idx, _ in got for i in idx] == list(copy.copy(s))
        assert _epochs_of(got, range(6)) == {0} and L.epoch == 0
        it = iter(L)
        s.set_epoch(1)
        assert _epochs_of(batches_of(it), range(6)) == {1} and L.epoch == 1
    s, L = _ddp(n, workers=workers)
    s.set_epoch(3)
    with L:  # Lightning's order (review 193): a check iter(), the fit's iter(), set_epoch
        iter(L)
        it = iter(L)
        s.set_epoch(0)
        assert L.state_dict()["epoch"] == 0
        assert _epochs_of(batches_of(it), range(6)) == {0} and L.epoch == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_under_an_iterator_made_before_it_keeps_the_states_epoch(workers):
    """Review 193: an iterator made before ``load_state_dict`` of an ended epoch restarted,
    at its first ``next()``, from the count of the Loader's earlier passes (5), not the
    state's next epoch (2)."""
    n = 8
    ended = _ended_state(n, workers, 2)
    s, L = _ddp(n, workers=workers)
    with L:
        for _ in range(5):
            list(L)
        it = iter(L)
        L.load_state_dict(ended)
        got = batches_of(it)
        assert [i for idx, _ in got for i in idx] == list(copy.copy(s))
        assert _epochs_of(got, range(8)) == {2} and L.epoch == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_after_iter_and_a_set_epoch_naming_the_ended_epoch_is_that_state(workers):
    """Review 192: after loading an ended epoch's state, ``iter()`` then the sampler set back
    to that epoch (its pass has nothing left): a checkpoint before the first batch recorded
    the next epoch, not begun, and a job resumed from it delivered the ended epoch again."""
    n = 8
    ended = _ended_state(n, workers, 3)
    s, L = _ddp(n, workers=workers)
    with L:
        L.load_state_dict(ended)
        it = iter(L)
        s.set_epoch(2)
        mid = L.state_dict()
        assert list(it) == []
    assert mid["epoch"] == 2 and mid["finished"]
    s, L = _ddp(n, workers=workers)
    with L:
        L.load_state_dict(mid)
        it = iter(L)
        s.set_epoch(2)
        assert list(it) == []
        s.set_epoch(3)
        got = batches_of(L)
        assert sorted(i for idx, _ in got for i in idx) == list(range(n))
        assert _epochs_of(got, range(6)) == {3}


def test_a_sampler_never_set_is_warned_at_the_third_epochs_start_under_ignite(caplog):
    """MONAI's engines (ignite) end a pass at the next epoch's first ``next()``: the warning
    comes as the third epoch starts (review 192: at three whole passes it came an epoch
    later)."""
    n = 8
    s, L = _ddp(n, workers=1)
    warned_at = None
    with caplog.at_level("WARNING", logger="autominato"), L:
        it = iter(L)
        for epoch in range(1, 5):  # ignite: len(loader) next()s an epoch, iter() again at the end
            for _ in range(len(L)):
                try:
                    next(it)
                except StopIteration:
                    it = iter(L)
                    next(it)
            if warned_at is None and "two whole passes" in caplog.text:
                warned_at = epoch
    assert warned_at == 3
    assert caplog.text.count("two whole passes") == 1
    caplog.clear()
    s, L = _ddp(n, workers=1)
    with caplog.at_level("WARNING", logger="autominato"), L:
        for e in range(3):  # training, evaluation, then a peek at a batch (review 193)
            s.set_epoch(e)
            list(L), list(L)
            next(iter(L))
    assert "whole passes" not in caplog.text


class SelfMoving(DistributedSampler):
    """A sampler that moves its own epoch on at the end of ``__iter__`` (accelerate's
    ``SeedableRandomSampler``), and records the epochs it was read at."""

    def __init__(self, n: int) -> None:
        super().__init__(range(n), num_replicas=1, rank=0, shuffle=True, seed=3)
        self.read: list[int] = []

    def __iter__(self):
        self.read.append(self.epoch)
        out = list(super().__iter__())
        self.set_epoch(self.epoch + 1)
        return iter(out)


def _order_of(n: int, epoch: int) -> list[int]:
    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=3)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_that_moves_its_own_epoch_while_read_is_read_once_a_pass(workers):
    """Its move is not a ``set_epoch`` after ``iter()`` (review 152: every pass restarted and
    read it twice, so the passes ran epochs 1, 3, 5)."""
    n = 8
    sampler = SelfMoving(n)
    with Loader(StragglerTail(n), batch_size=4, sampler=sampler, in_order=True, seed=SEED,
                workers=workers, autotune=False) as L:
        got = [[int(i) for b in L for i in b["index"]] for _ in range(3)]
    assert got == [_order_of(n, e) for e in range(3)]
    assert sampler.read[:3] == [0, 1, 2]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_older_pass_asked_after_a_newer_one_began_keeps_its_epoch_and_the_newers_state(
        workers):
    """Only the Loader's latest pass follows a ``set_epoch`` (review 152: an older iterator
    asked once replaced the state of the loop's pass, and its resume delivered 6 samples a
    second time)."""
    n = 12
    kw = dict(batch_size=3, shuffle=True, in_order=True, transform=tag_epoch, seed=SEED,
              workers=workers, autotune=False)
    with Loader(StragglerTail(n), **kw) as L:
        L.set_epoch(0)
        a = iter(L)
        L.set_epoch(1)
        b = iter(L)
        got = [int(i) for _ in range(3) for i in next(b)["index"]]
        first = next(a)
        assert [epoch_of(int(i), d, range(3)) for i, d in zip(first["index"], first["draw"],
                                                              strict=True)] == [0, 0, 0]
        sd = L.state_dict()
    assert sd["epoch"] == 1 and sd["batches"] == 3
    with Loader(StragglerTail(n), **kw) as L2:
        L2.load_state_dict(sd)
        rest = [int(i) for bt in L2 for i in bt["index"]]
    assert sorted(got + rest) == list(range(n))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restarted_pass_is_one_cold_start_and_the_epoch_after_it_is_loaded_ahead(workers):
    """A second fit's pass begins at the epoch the Loader ran last, then ``set_epoch(0)``: one
    pass, one cold start (review 152: two), and the epoch loaded ahead is 1, not the pass's
    stride of 0 (the load ahead thrown away)."""
    n = 8
    with Loader(StragglerTail(n), batch_size=4, shuffle=True, in_order=True,
                transform=tag_epoch, seed=SEED, workers=workers, autotune=False) as L:
        for e in range(3):
            L.set_epoch(e)
            batches_of(L)
        colds = L.snapshot().cold_starts_total
        it = iter(L)  # (Lightning's first iterator of a second fit, at the Loader's epoch 2)
        L.set_epoch(0)
        assert [i for idx, _ in batches_of(it) for i in idx] == epoch_order(
            n, epoch=0, seed=SEED, shuffle=True)
        assert L.snapshot().cold_starts_total == colds + 1
        if workers:
            assert L._pipeline.pending is not None and L._pipeline.pending.epoch_no == 1
            L.set_epoch(1)
            batches_of(L)
            assert L._pipeline.speculative_adopted >= 3


def test_a_pass_never_asked_for_a_batch_lets_the_epoch_loaded_ahead_of_it_go():
    """Lightning checks a loader with an iterator it never uses, then starts the same epoch's
    pass after its sanity validation: the next epoch loaded ahead of the unused pass is
    discarded at once (review 152: its samples ran in the free workers meanwhile, 12 thrown
    away at each fit's start); a pass asked for a batch keeps it."""
    n = 12
    with Loader(StragglerTail(n), batch_size=3, shuffle=True, in_order=True,
                transform=tag_epoch, seed=SEED, workers=2, autotune=False) as L:
        it = iter(L)
        p = L._pipeline
        assert p.pending is not None and p.pending.epoch_no == 1
        del it
        assert p.pending is None
        got = batches_of(L)  # epoch 0 again (the unused pass was no epoch)
        assert [i for idx, _ in got for i in idx] == epoch_order(n, epoch=0, seed=SEED,
                                                                 shuffle=True)
        assert p.pending is not None and p.pending.epoch_no == 1  # loaded ahead again
        wait_for(lambda: p.pending.taken > 0, "samples of epoch 1 to be dispatched")
        it = iter(L)
        next(it)
        del it  # (asked once: the epoch after it stays loaded ahead)
        assert p.pending is not None and p.pending.epoch_no == 2
        assert L.snapshot().speculative_discarded_total == 0


class SlowFirst:
    """Sample ``i`` is ``{"index": i}``; index 0 sleeps ``slow_s`` first, in every epoch: with
    sequential order and completion-order batches it is a straggler of every epoch."""

    def __init__(self, n: int, slow_s: float = 0.3) -> None:
        self.n, self.slow_s = n, slow_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == 0:
            time.sleep(self.slow_s)
        return {"index": np.int64(i)}


@pytest.mark.parametrize("n,pool_size,prefetch_factor,live", [
    (12, 16, 8, False),  # the whole next epoch loaded ahead: its run has ended
    (60, 4, 2, True),  # part of it: its run still runs when the pass restarts (review 188)
])
def test_stragglers_of_an_epoch_loaded_ahead_are_not_counted_when_its_pass_restarts(
        n, pool_size, prefetch_factor, live):
    """Review 186 (low): the stragglers (and skips) of batches made while the next epoch was
    loaded ahead were counted when a pass adopted it, and stayed counted when ``set_epoch``
    then restarted that pass as another epoch, whose batches were thrown away. They count once
    the loop takes an item of the adopted pass."""
    bs = 2
    with Loader(SlowFirst(n), batch_size=bs, transform=tag_epoch, seed=SEED, workers=2,
                in_order=False, pool_size=pool_size, prefetch_factor=prefetch_factor,
                autotune=False) as L:
        for _ in range(2):
            batches_of(L)
        p = L._pipeline
        wait_for(lambda: sum(d for d in getattr(p.pending, "deferred", ())
                             if isinstance(d, int)) > 0, "a straggler of epoch 2 loaded ahead")
        wait_for(lambda: L.snapshot().stragglers_total == p.stragglers, "the counts settled")
        if live:
            time.sleep(0.2)  # (its window full: it waits for the loop)
        else:  # (its last batch made; the run's end follows on the scheduler's thread)
            wait_for(lambda: p.pending.gen not in p.runs, "the run loaded ahead ended")
        assert (p.pending.gen in p.runs) == live
        before = p.stragglers
        it = iter(L)  # epoch 2: adopts the look-ahead
        L.set_epoch(0)  # before its first batch: the pass restarts as epoch 0
        got = batches_of(it)
        assert sorted(i for idx, _ in got for i in idx) == list(range(n))
        assert {epoch_of(i, d, range(3)) for idx, dr in got
                for i, d in zip(idx, dr, strict=True)} == {0}
        own = it._delegate.run.epoch.stragglers  # the restarted pass's own
        assert it._delegate.run is not it.run and it.run.epoch.stragglers > 0
        wait_for(lambda: L.snapshot().speculative_discarded_total > 0, "the discard counted")
        assert p.stragglers == before + own, (p.stragglers, before, own)
        # an adopted pass that runs counts those of its batches made ahead, once each
        wait_for(lambda: p.pending is not None and p.pending.taken > 0, "the next loaded ahead")
        wait_for(lambda: L.snapshot().stragglers_total == p.stragglers, "the counts settled")
        before = p.stragglers
        L.set_epoch(p.pending.epoch_no)  # (the epoch loaded ahead: the pass adopts it)
        it = iter(L)
        assert it.run.adopted
        batches_of(it)
        wait_for(lambda: p.stragglers == before + it.run.epoch.stragglers,
                 f"{before} + the adopted pass's {it.run.epoch.stragglers} (got {p.stragglers})")
