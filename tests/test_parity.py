"""DataLoader's arguments, taken with DataLoader's meaning (issue: DataLoader parity).

Each test builds the same thing with ``torch.utils.data.DataLoader`` where it can, and compares.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from autominato import Loader


class Indexed:
    """Sample i is a (2,) int64 array filled with i; listed indices sleep."""

    def __init__(self, n: int, slow: dict[int, float] | None = None) -> None:
        self.n, self.slow = n, slow or {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.slow:
            time.sleep(self.slow[i])
        return np.full(2, i, np.int64)


class Where(Indexed):
    """Sample i records the process and thread that loaded it."""

    def __getitem__(self, i: int):
        return {"i": i, "pid": os.getpid(), "thread": threading.get_ident()}


def firsts(loader) -> list[list[int]]:
    return [b[:, 0].tolist() for b in loader]


def test_dataloader_positional_arguments_mean_the_same():
    ds = Indexed(10)
    # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
    #            pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator)
    args = (ds, 3, False, None, None, 2, None, False, True, 0, None, None, None)
    with Loader(*args, in_order=True, autotune=False) as L:
        assert firsts(L) == firsts(DataLoader(*args)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        assert len(L) == len(DataLoader(*args)) == 3
        assert (L.dataset, L.batch_size, L.num_workers, L.drop_last, L.timeout) == (ds, 3, 2, True, 0)


def test_without_shuffle_batches_come_in_the_datasets_order_as_evaluation_needs():
    """``shuffle=False`` (evaluation, prediction: outputs matched to the dataset's rows by
    position) delivers the DataLoader's batches in its order by default, a slow sample
    included (review 100: it joined the last batch); ``in_order=False`` or a shuffle keeps
    completion order."""
    slow = Indexed(12, slow={2: 0.3})
    want = [[i, i + 1] for i in range(0, 12, 2)]
    with Loader(slow, 2, num_workers=2, autotune=False, seed=0) as L:
        assert L.in_order is True
        assert firsts(L) == want
        assert firsts(L) == want  # the next epoch too (loaded ahead)
    with Loader(slow, 2, num_workers=2, autotune=False, seed=0, in_order=False) as L:
        got = firsts(L)
    assert got != want and sorted(i for b in got for i in b) == list(range(12))


class KeptSequential(SequentialSampler):
    """A subclass for a name or an attribute: its order is SequentialSampler's."""


class ReversedSequential(SequentialSampler):
    def __iter__(self):
        return iter(range(len(self.data_source) - 1, -1, -1))


@pytest.mark.parametrize("kwargs, in_order", [
    ({}, True),
    ({"shuffle": True}, False),
    ({"sampler": SequentialSampler(range(8))}, True),
    ({"sampler": DistributedSampler(range(8), num_replicas=2, rank=1, shuffle=False)}, True),
    ({"sampler": DistributedSampler(range(8), num_replicas=2, rank=1)}, False),
    ({"sampler": torch.utils.data.RandomSampler(range(8))}, False),
    ({"sampler": torch.utils.data.SubsetRandomSampler([1, 3, 5])}, False),
    ({"sampler": [7, 6, 5, 4, 3, 2, 1, 0]}, True),
    ({"sampler": range(8)}, True),
    ({"sampler": np.array([0, 2, 4])}, True),
    ({"batch_sampler": BatchSampler(SequentialSampler(range(8)), 2, False)}, True),
    ({"batch_sampler": [[0, 1], [2, 3]]}, True),
    ({"sampler": torch.arange(0, 8, 2)}, True),
    ({"sampler": KeptSequential(range(8))}, True),
    ({"sampler": ReversedSequential(range(8))}, False),
    ({"batch_sampler": BatchSampler(KeptSequential(range(8)), 2, False)}, True),
], ids=["none", "shuffle", "sequential", "dist-noshuffle", "dist-shuffle", "random",
        "subset-random", "list", "range", "array", "batch-sequential", "batch-list", "tensor",
        "sequential-subclass", "sequential-subclass-own-iter", "batch-sequential-subclass"])
def test_in_order_defaults_to_whether_the_epochs_order_is_fixed_in_advance(kwargs, in_order):
    """Trial 102: a validation split given as a list (or ``range``) of indices came in
    completion order; a list fixes the order as much as ``shuffle=False`` does. Trial 179: so
    do a tensor of indices (``torch.nonzero(mask).flatten()``), a subclass of
    ``SequentialSampler`` that keeps its order, and a list of batches."""

    batch = {} if "batch_sampler" in kwargs else {"batch_size": 2}
    with Loader(Indexed(8), num_workers=0, **batch, **kwargs) as L:
        assert L.in_order is in_order
        if not batch:
            assert L.collate_fn is not None  # DataLoader's attribute is never None
    with Loader(Indexed(8), num_workers=0, in_order=not in_order, **batch, **kwargs) as L:
        assert L.in_order is (not in_order)  # given: it wins


def test_an_iterable_dataset_keeps_completion_order_by_default():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with Loader(Stream(), 2, num_workers=0) as L:
        assert L.in_order is False


def test_num_workers_zero_loads_in_the_training_loops_thread():
    with Loader(Where(6), 2, num_workers=0, autotune=False) as L:
        batches = list(L)
        assert L.worker_pids() == [] and L._pipeline is None
    assert [i for b in batches for i in b["i"].tolist()] == list(range(6))
    assert {p for b in batches for p in b["pid"].tolist()} == {os.getpid()}
    assert {t for b in batches for t in b["thread"].tolist()} == {threading.get_ident()}


def test_num_workers_is_the_workers_knob_and_conflicts_are_refused():
    with Loader(Indexed(4), 2, num_workers=3, autotune=False) as L:
        assert L.knobs.workers == L.num_workers == 3
        L.num_workers = 2
        assert L.knobs.workers == 2
    with pytest.raises(ValueError, match="num_workers=2 and workers=3"):
        Loader(Indexed(4), 2, num_workers=2, workers=3, autotune=False)


def test_num_workers_takes_a_bool_as_the_dataloader_does():
    # Trial: num_workers=True was refused; the DataLoader takes a bool as the int it is
    # (True: one worker process, False: none). Other non-integers stay refused by name.
    for flag, workers in ((True, 1), (False, 0)):
        want = firsts(DataLoader(Indexed(4), 2, num_workers=flag))
        with Loader(Indexed(4), 2, num_workers=flag, in_order=True, autotune=False) as L:
            assert L.num_workers == workers and (L._pipeline is None) == (not flag)
            assert firsts(L) == want == [[0, 1], [2, 3]]
    with Loader(Indexed(4), 2, num_workers=2, autotune=False) as L:
        L.num_workers = True  # (the setter too)
        assert L.num_workers == 1
    for bad in ("1", 1.0):
        with pytest.raises(TypeError, match="num_workers must be an integer"):
            Loader(Indexed(4), 2, num_workers=bad, autotune=False)


def test_prefetch_factor_is_the_depth_knob_and_needs_workers():
    with Loader(Indexed(4), 2, num_workers=1, prefetch_factor=5, autotune=False) as L:
        assert L.knobs.depth == L.prefetch_factor == 5
    with pytest.raises(ValueError, match="prefetch_factor"):
        Loader(Indexed(4), 2, num_workers=0, prefetch_factor=2, autotune=False)
    # without workers nothing is prepared ahead: None, as the DataLoader's (trial 179: 2)
    with Loader(Indexed(4), 2, num_workers=0, autotune=False) as L:
        assert L.prefetch_factor is DataLoader(Indexed(4), 2).prefetch_factor is None


def test_persistent_workers_given_without_workers_is_refused_as_by_dataloader():
    # Trial 77: accepted, where DataLoader raises. The Loader's own default (persistent)
    # stays silent with num_workers=0, and False is accepted there as by DataLoader.
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
        DataLoader(Indexed(4), 2, num_workers=0, persistent_workers=True)
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
        Loader(Indexed(4), 2, num_workers=0, persistent_workers=True, autotune=False)
    for kwargs in ({}, {"persistent_workers": False}):
        with Loader(Indexed(4), 2, num_workers=0, autotune=False, **kwargs) as L:
            assert [len(b) for b in L] == [2, 2]
            assert L.persistent_workers is False  # (trial 79: it read True, with no worker)
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
        Loader(Indexed(4), 2, workers=0, persistent_workers=True, autotune=False)  # the knob
    with Loader(Indexed(4), 2, num_workers=1, autotune=False) as L:
        assert L.persistent_workers is True


def test_persistent_workers_with_a_configuration_of_no_workers(tmp_path):
    from autominato.config import save_config

    cfg = save_config({"knobs": {"workers": 0}, "loader": {}}, tmp_path / "tuned.yaml")
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0.*"
                                         "tuned.yaml sets workers: 0"):
        Loader(Indexed(4), 2, config=cfg, persistent_workers=True, autotune=False)
    with Loader(Indexed(4), 2, config=cfg, autotune=False) as L:
        assert L.persistent_workers is False and [len(b) for b in L] == [2, 2]
    with Loader(Indexed(4), 2, config=cfg, num_workers=1, persistent_workers=True,
                autotune=False) as L:  # the argument wins over the file
        assert L.persistent_workers is True and [len(b) for b in L] == [2, 2]


def test_timeout_fires_on_a_stuck_batch_and_zero_waits():
    with Loader(Indexed(4, slow={1: 3.0}), 2, num_workers=1, worker_kind="thread", timeout=0.5,
                autotune=False, in_order=True) as L:
        it = iter(L)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out after 0.5 seconds"):
            next(it)
        assert time.monotonic() - t0 < 2.5
        it.stop()
    with Loader(Indexed(4, slow={1: 1.0}), 2, num_workers=1, worker_kind="thread", timeout=0,
                autotune=False) as L:
        assert sorted(i for b in firsts(L) for i in b) == [0, 1, 2, 3]


def _slow_start(worker_id: int) -> None:
    time.sleep(1.5)  # a worker that takes 1.5 s to start (a fresh interpreter takes ~1-2.5 s)


def test_timeout_does_not_count_the_workers_start_and_fires_once_they_run(monkeypatch):
    """Trial 108: workers started from a fresh interpreter (``start_method="spawn"``, what
    "auto" does where the process runs threads: ~1-2.5 s) timed the first batch out under a
    ``timeout`` that a DataLoader's forked workers never reach. Their start (here a 1.5 s
    ``worker_init_fn``) is not counted, also when a worker gets ready in the middle of one
    of the iterator's waits (review 109); a stuck sample once they run still times out, and
    so does a start past the grace (the control)."""
    import autominato.loader as loader_module

    ds = Indexed(6, slow={2: 3.0})
    for attempt in range(3):  # (where a worker gets ready in the wait's 0.5 s slices varies)
        with Loader(ds, 2, num_workers=1, worker_init_fn=_slow_start, timeout=0.6,
                    autotune=False, in_order=True) as L:
            it = iter(L)
            t0 = time.monotonic()
            assert next(it).tolist() == [[0, 0], [1, 1]]
            assert time.monotonic() - t0 > 1.5
            if attempt == 0:
                with pytest.raises(RuntimeError, match=r"timed out after 0.6 seconds"):
                    next(it)  # sample 2 takes 3 s
            it.stop()
    monkeypatch.setattr(loader_module, "START_GRACE_S", 0.0)  # the control: counted
    with Loader(ds, 2, num_workers=1, worker_init_fn=_slow_start, timeout=0.6, autotune=False,
                in_order=True) as L:
        with pytest.raises(RuntimeError, match=r"timed out after 0.6 seconds"):
            next(iter(L))


def test_a_timeout_with_no_worker_is_said_once_not_ignored_silently():
    """The DataLoader refuses it (AssertionError at iter()); the Loader warns once (trial
    111) and loads as without it."""
    with pytest.raises(AssertionError):
        iter(DataLoader(Indexed(4), 2, num_workers=0, timeout=0.5))
    with pytest.warns(UserWarning, match=r"timeout=0.5 is not applied with num_workers=0"):
        L = Loader(Indexed(4), 2, num_workers=0, timeout=0.5, autotune=False)
    with L:
        assert [len(b) for b in L] == [2, 2]


@pytest.mark.parametrize("timeout", [0, 10])
def test_the_consumers_wait_counts_the_workers_start_whatever_the_timeout(timeout):
    """Review 110: with a timeout, the clock's grace for the workers' start was taken off
    the consumer's wait too (the accelerator-idle figures then depended on timeout=)."""
    with Loader(Indexed(4), 2, num_workers=1, worker_init_fn=_slow_start, timeout=timeout,
                autotune=False, in_order=True) as L:
        it = iter(L)
        t0 = time.monotonic()
        next(it)
        took = time.monotonic() - t0
        wait = L.snapshot().consumer_wait_seconds_total
        # (the worker may begin its 1.5 s start before t0: the Loader starts it when built;
        # a CI run read 1.489 s)
        assert took > 1.0 and wait == pytest.approx(took, abs=0.1)
        it.stop()


@pytest.mark.parametrize("gen", [None, 5])
@pytest.mark.parametrize("kwargs", [
    {"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}])
def test_a_shuffled_pass_draws_what_the_dataloaders_random_sampler_draws(kwargs, gen):
    # Trial 141: shuffle=True's DataLoader iterates a RandomSampler at every pass, which
    # draws its permutation's seed from the global generator (or two permutations from
    # ``generator``); the Loader shuffles on its own and drew none of them, so the training
    # loop's numbers after a shuffled pass (dropout, say) were not the DataLoader's.
    def run(make) -> list:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(gen) if gen is not None else None
        loader, seen = make(list(range(10)), batch_size=2, shuffle=True, generator=g,
                            **kwargs), []
        for _ in range(3):
            assert sum(1 for _ in loader) == 5
            seen += [torch.rand(2).tolist(), None if g is None else torch.rand(1, generator=g)]
        getattr(loader, "close", lambda: None)()
        return [x if not isinstance(x, torch.Tensor) else x.tolist() for x in seen]

    assert run(Loader) == run(DataLoader)


def _ordered(*args, **kw) -> Loader:
    """A Loader in the sampler's order, no controller: to set beside a DataLoader."""
    return Loader(*args, in_order=True, autotune=False, **kw)


@pytest.mark.parametrize("how", ["shuffle", "sampler", "batch_sampler"])
@pytest.mark.parametrize("kwargs", [
    {"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}])
def test_a_pass_left_early_draws_from_the_generator_what_the_dataloaders_draws(kwargs, how):
    # Trial: a pass the loop left with a break drew two permutations from generator= (the
    # DataLoader's RandomSampler draws the second only when its pass reaches the end), and
    # a RandomSampler of the user's was read to its end, drawing one more too: with the same
    # generator the next epochs' orders (and the loop's own draws) were not the DataLoader's.
    from torch.utils.data import RandomSampler

    ds = list(range(40))  # (10 batches: the DataLoader's workers prefetch 4 + 1 a batch)

    def run(make) -> list:
        g = torch.Generator().manual_seed(7)
        if how == "shuffle":
            loader = make(ds, 4, shuffle=True, generator=g, **kwargs)
        elif how == "sampler":
            loader = make(ds, 4, sampler=RandomSampler(ds, generator=g), generator=g, **kwargs)
        else:
            bs = BatchSampler(RandomSampler(ds, generator=g), 4, drop_last=False)
            loader = make(ds, batch_sampler=bs, generator=g, **kwargs)
        seen = []
        for stop in (2, None, 1, None, 3):  # batches taken before a break (None: whole)
            got = []
            for batch in loader:
                got.append(batch.tolist())
                if len(got) == stop:
                    break
            seen += [got if how != "shuffle" else len(got),  # (the Loader's own shuffle)
                     torch.randperm(8, generator=g).tolist()]
        getattr(loader, "close", lambda: None)()
        return seen

    assert run(_ordered) == run(DataLoader)


@pytest.mark.parametrize("how", ["shuffle", "sampler"])
@pytest.mark.parametrize(("n", "workers"), [(12, 0), (10, 0), (12, 2), (10, 2)])
def test_a_loop_of_len_batches_draws_the_samplers_end_where_the_dataloader_does(n, workers, how):
    # Review 172: the DataLoader's BatchSampler runs its RandomSampler to the end (a last
    # permutation from the generator) while it makes a short last batch, and with workers
    # its prefetching reads the end before the last batch whatever its size (review 174);
    # the Loader drew it only at the next() after it, which a loop of len(loader) steps
    # never makes.
    from torch.utils.data import RandomSampler

    ds = list(range(n))

    def run(make) -> list:
        g = torch.Generator().manual_seed(7)
        if how == "shuffle":
            loader = make(ds, 4, shuffle=True, generator=g, num_workers=workers)
        else:
            loader = make(ds, 4, sampler=RandomSampler(ds, generator=g), generator=g,
                          num_workers=workers)
        seen = []
        for _ in range(3):
            it = iter(loader)
            got = [next(it).tolist() for _ in range(len(loader))]  # no StopIteration asked
            seen += [got if how != "shuffle" else len(got),
                     torch.randperm(8, generator=g).tolist()]
        getattr(loader, "close", lambda: None)()
        return seen

    assert run(_ordered) == run(DataLoader)


def test_generator_seeds_shuffling_when_seed_is_not_given():
    def order(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        with Loader(Indexed(12), 4, shuffle=True, generator=g, num_workers=0, autotune=False) as L:
            return firsts(L)

    assert order(7) == order(7) != order(8)


@pytest.mark.parametrize("kwargs", [
    {"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True},
    {"num_workers": 2, "persistent_workers": False}, {"num_workers": 2, "seed": 3},
    {"num_workers": 2, "persistent_workers": True, "seed": 3}, {"num_workers": 0, "gen": 1}])
@pytest.mark.parametrize("how", ["loop", "lightning", "copy", "empty"])
def test_each_pass_draws_from_the_generator_where_the_dataloader_would(kwargs, how):
    # Review 134: the DataLoader draws its workers' base seed at every iter() (persistent
    # workers: at the first only); the Loader drew once, when built, so a RandomSampler
    # without a generator (and the loop's own draws) went another way from epoch 1 on.
    # Review 135: Lightning asks a Loader (not a DataLoader) for an iterator it never uses
    # before its epochs (that pass reads a RandomSampler's order: a sequential one here); a
    # Loader copied (deepcopy; ddp_spawn pickles it to a rank that seeds itself) had drawn
    # nothing for its first pass.
    import copy

    from torch.utils.data import RandomSampler

    ds = list(range(12 if how != "empty" else 0))  # (empty: passes asked, no batch)
    kwargs = dict(kwargs)
    gen = kwargs.pop("gen", None)
    shuffled = how not in ("lightning", "empty")

    def run(make, loader_side: bool) -> list:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(gen) if gen is not None else None
        loader, seen = make(g, RandomSampler(ds) if shuffled else None), []
        if how == "copy":
            if loader_side:
                original, loader = loader, copy.deepcopy(loader)
                original.close()  # (left open, its threads made later loaders spawn)
            torch.manual_seed(0)  # the rank's own seeding
            if g is not None:
                g.manual_seed(gen)
        if loader_side and how == "lightning":
            iter(loader)  # _check_dataloader_iterable's (dropped at once)
        for _ in range(3):
            seen += [[int(x) for b in loader for x in b], torch.rand(2).tolist(),
                     None if g is None else torch.rand(1, generator=g).tolist()]
        getattr(loader, "close", lambda: None)()
        return seen

    dl_kwargs = {k: v for k, v in kwargs.items() if k != "seed"}
    want = run(lambda g, s: DataLoader(ds, 3, sampler=s, generator=g, **dl_kwargs), False)
    got = run(lambda g, s: Loader(ds, 3, sampler=s, in_order=True, generator=g, **kwargs),
              True)
    if how == "copy" and gen is not None:
        # (a generator is deep-copied with the Loader: the copy's draws leave the test's
        # own generator alone, as the DataLoader's copy would)
        want = [x if i % 3 != 2 else None for i, x in enumerate(want)]
        got = [x if i % 3 != 2 else None for i, x in enumerate(got)]
    assert got == want


def test_multiprocessing_context_names_the_start_method():
    with Loader(Indexed(6), 2, num_workers=1, multiprocessing_context="spawn",
                autotune=False) as L:
        assert L._cfg.start_method == "spawn"
        assert sorted(i for b in firsts(L) for i in b) == list(range(6))
    ctx = multiprocessing.get_context("forkserver")
    with Loader(Indexed(2), 2, num_workers=1, multiprocessing_context=ctx, autotune=False) as L:
        assert L._cfg.start_method == "forkserver" and L.multiprocessing_context is ctx
    # without workers the DataLoader refuses it, in these words (trial 141: accepted silently)
    for dl in (DataLoader, Loader):
        with pytest.raises(ValueError, match=r"multiprocessing_context can only be used with "
                           r"multi-process loading \(num_workers > 0\), but got num_workers=0"):
            dl(Indexed(2), 2, num_workers=0, multiprocessing_context=ctx)
    with pytest.raises(ValueError, match="multiprocessing_context"):
        Loader(Indexed(2), 2, multiprocessing_context="threads", autotune=False)


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_batch_sampler_batches_are_the_samplers_lists(in_order, workers):
    ds = Indexed(12, slow={1: 1.0})
    bs = [[0, 1, 2], [5], [3, 4], [11, 10, 9, 8, 7, 6]]
    with Loader(ds, batch_sampler=bs, num_workers=workers, in_order=in_order,
                autotune=False) as L:
        got = firsts(L)
        assert len(L) == 4 and L.batch_size is None
    want = firsts(DataLoader(ds, batch_sampler=bs))
    assert (got if in_order else sorted(got)) == (want if in_order else sorted(want))
    if not in_order and workers:
        assert got.index([0, 1, 2]) > 0  # the batch with the straggler is not first


def _empty_or_firsts(samples: list) -> object:
    """A user's collate_fn that takes an empty batch: ``("empty", 0)`` for it."""
    return ("empty", 0) if not samples else [int(s[0]) for s in samples]


def _each(it) -> list:
    """Every batch (first column, or what the collate_fn made) and error (its type's name)
    of an iterator whose loop catches errors and goes on, in the order they came."""
    out = []
    while True:
        try:
            b = next(it)
        except StopIteration:
            return out
        except Exception as e:  # noqa: BLE001 - the loop goes on, as after a DataLoader's
            out.append(type(e).__name__)
            continue
        out.append(b[:, 0].tolist() if isinstance(b, torch.Tensor) else b)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("collate_fn", [None, _empty_or_firsts], ids=["default", "user"])
@pytest.mark.parametrize("workers, kind, in_order", [
    (0, "process", True), (2, "process", True), (2, "process", False), (2, "thread", True),
    (2, "thread", False)])
def test_an_empty_batch_from_the_batch_sampler_is_collated_as_the_dataloaders(
        workers, kind, in_order, collate_fn, on_error):
    # Trial: a batch sampler's [] was skipped, so one batch fewer than len(loader) came. The
    # DataLoader fetches nothing and calls collate_fn([]): default_collate's IndexError takes
    # the batch's place (the loop may catch it and go on), a user's collate_fn's result is
    # the batch. on_error="skip" skips samples, and an empty batch has none: the same.
    ds = Indexed(8)
    bs = [[0, 1], [], [2, 3], [4, 5, 6], [], [7], []]
    want = _each(iter(DataLoader(ds, batch_sampler=bs, collate_fn=collate_fn)))
    empty = "IndexError" if collate_fn is None else ("empty", 0)
    assert want == [[0, 1], empty, [2, 3], [4, 5, 6], empty, [7], empty]
    with Loader(ds, batch_sampler=bs, collate_fn=collate_fn, num_workers=workers,
                worker_kind=kind, in_order=in_order, on_error=on_error, autotune=False) as L:
        for _ in range(2):  # (two epochs: the next pass is whole too)
            got = _each(iter(L))
            assert len(got) == len(L) == 7
            if in_order or not workers:
                assert got == want
            else:  # (complete at once: the empty ones first, then as they complete)
                assert got[:3] == [empty] * 3
                assert sorted(map(str, got[3:])) == sorted(map(str, [[0, 1], [2, 3], [4, 5, 6], [7]]))
        if collate_fn is None:
            snap = L.snapshot()
            assert snap.errors_raised_total == 6 and snap.samples_lost_total == 0
        assert L.state_dict()["finished"]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_empty_batch_is_delivered_once_across_a_resume(workers):
    # A checkpoint after the batch sampler's [] (no position marks it, Progress.empties
    # counts it) resumes after it; one before it resumes with it: the batches after the
    # checkpoint are those of the uninterrupted epoch.
    ds = Indexed(6)
    bs = [[], [0, 1], [], [2, 3], [4, 5], []]
    kw = dict(batch_sampler=bs, collate_fn=_empty_or_firsts, num_workers=workers,
              in_order=True, autotune=False, seed=0)
    with Loader(ds, **kw) as L:
        whole = list(L)
    assert whole == [("empty", 0), [0, 1], ("empty", 0), [2, 3], [4, 5], ("empty", 0)]
    for k in range(1, len(whole) + 1):
        with Loader(ds, **kw) as L:
            it = iter(L)
            assert [next(it) for _ in range(k)] == whole[:k]
            state = L.state_dict()
        # (every sample delivered, the last [] not: the epoch has not ended)
        assert state["finished"] == (k == len(whole))
        with Loader(ds, **kw) as L:
            L.load_state_dict(state)
            # (an ended epoch's state: the next pass is the next epoch)
            assert list(L) == (whole[k:] if k < len(whole) else whole), k


def test_batch_sampler_set_epoch_reaches_its_sampler_and_excludes_batch_args():
    ds = Indexed(8)
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=0)
    bs = BatchSampler(sampler, 2, drop_last=False)
    with Loader(ds, batch_sampler=bs, num_workers=0, autotune=False) as L:
        L.set_epoch(3)
        got = firsts(L)
    sampler.set_epoch(3)
    assert got == firsts(DataLoader(ds, batch_sampler=bs))
    for bad in (dict(batch_size=2), dict(batch_size=None), dict(shuffle=True),
                dict(drop_last=True), dict(sampler=SequentialSampler(ds))):
        with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
            Loader(ds, batch_sampler=bs, autotune=False, **bad)


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_attribute_is_a_batch_sampler_as_dataloaders(drop_last):
    ds = Indexed(7)
    dl = DataLoader(ds, 3, shuffle=True, drop_last=drop_last)
    with Loader(ds, 3, shuffle=True, drop_last=drop_last, seed=4, num_workers=0,
                in_order=True, autotune=False) as L:
        b, want = L.batch_sampler, dl.batch_sampler
        assert type(b) is type(want) is BatchSampler
        assert (b.batch_size, b.drop_last, len(b)) == (want.batch_size, want.drop_last, len(want))
        assert b.sampler is L.sampler and L.batch_sampler is b  # one object, as DataLoader's
        L.set_epoch(2)
        assert list(b) == firsts(L)  # the epoch's lists, as the Loader delivers them in order
    bs = [[0, 1], [2]]
    with Loader(ds, batch_sampler=bs, num_workers=0, autotune=False) as L:
        assert L.batch_sampler is bs  # the user's, as given
    with Loader(ds, batch_size=None, num_workers=0, autotune=False) as L:
        assert L.batch_sampler is None and DataLoader(ds, batch_size=None).batch_sampler is None


class Pair(list):
    """A user's list subclass as the sample type: built from its items as arguments, with an
    attribute of its own (review 107: rebuilt as ``Pair(items)`` it held one item, the list,
    and lost its tag)."""

    def __init__(self, *items, tag: str = "none") -> None:
        super().__init__(items)
        self.tag = tag


class Pairs(Indexed):
    def __getitem__(self, i):
        return Pair(super().__getitem__(i), i, tag="mine")


@pytest.mark.parametrize("workers", [0, 1])
def test_a_list_subclass_sample_comes_as_its_type_from_the_workers_as_dataloaders(workers):
    want = next(iter(DataLoader(Pairs(4), 2)))
    with Loader(Pairs(4), 2, num_workers=workers, in_order=True, autotune=False) as L:
        got = next(iter(L))
    assert type(got) is type(want) is Pair and got.tag == want.tag == "mine"
    assert len(got) == len(want) == 2
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class Coerced(list):
    """A list subclass whose ``__setitem__`` converts what it stores to a tensor (review
    109: the transport's placeholders went through it and the batch held indices)."""

    def __setitem__(self, i, v):
        super().__setitem__(i, v if isinstance(i, slice) else torch.as_tensor(v))


class CoercedSamples(Indexed):
    def __getitem__(self, i):
        c = Coerced()
        c.extend([np.full(3000, 10 + i, np.float32), 20 + i])  # (12 KB: through a slot too)
        return c


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_list_subclass_with_its_own_setitem_crosses_the_workers_intact(kind):
    want = next(iter(DataLoader(CoercedSamples(4), 2)))
    with Loader(CoercedSamples(4), 2, num_workers=1, worker_kind=kind, in_order=True,
                autotune=False) as L:
        got = next(iter(L))
    assert type(got) is type(want) is Coerced
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class Record(dict):
    """A user's dict subclass as the sample type: built from named fields, not from a dict,
    with an attribute of its own (rebuilt as ``Record(items)`` it raised, and it crossed the
    workers as a plain dict without its tag)."""

    def __init__(self, image, label, tag: str = "none") -> None:
        super().__init__(image=image, label=label)
        self.tag = tag


class Records(Indexed):
    def __getitem__(self, i):
        return Record(np.full(3000, i, np.float32), i, tag="mine")  # (12 KB: through a slot)


class Counts(Indexed):
    def __getitem__(self, i):
        from collections import defaultdict

        d = defaultdict(list)
        d["x"] = np.full(3, i, np.float32)
        return d


@pytest.mark.parametrize("kind,workers", [("process", 0), ("process", 2), ("thread", 1)])
def test_a_dict_subclass_sample_comes_as_its_type_from_the_workers_as_dataloaders(kind, workers):
    from collections import defaultdict

    want = next(iter(DataLoader(Records(4), 2)))
    with Loader(Records(4), 2, num_workers=workers, worker_kind=kind, in_order=True,
                autotune=False) as L:
        got = next(iter(L))
    assert type(got) is type(want) is Record and got.tag == want.tag == "mine"
    assert list(got) == list(want) == ["image", "label"]
    assert torch.equal(got["image"], want["image"]) and torch.equal(got["label"], want["label"])
    want = next(iter(DataLoader(Counts(4), 2)))  # a defaultdict with a factory that pickles
    with Loader(Counts(4), 2, num_workers=workers, worker_kind=kind, in_order=True,
                autotune=False) as L:
        got = next(iter(L))
    assert type(got) is type(want) is defaultdict and got.default_factory is list
    assert torch.equal(got["x"], want["x"]) and got["new"] == []


class Mirrored(dict):
    """An EasyDict-like container: each item is also an attribute (review 112: the copy kept
    the old arrays as attributes, pickled into the skeleton beside the slot's, and moved to a
    device they stayed behind)."""

    def __init__(self, d=None, **kwargs):
        for k, v in dict(d or {}, **kwargs).items():
            setattr(self, k, v)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        super().__setitem__(name, value)

    __setitem__ = __setattr__

    def update(self, e=None, **f):
        for k, v in dict(e or {}, **f).items():
            setattr(self, k, v)


class Converting(dict):
    """A container whose ``__setitem__`` makes tensors of what it stores (review 112:
    unpickling the skeleton called it with the transport's placeholders, and the batch held
    their indices instead of the arrays)."""

    def __setitem__(self, k, v):
        super().__setitem__(k, torch.as_tensor(v))


class CopiesAsItself(dict):
    def __copy__(self):
        return self


def _container(kind, i):
    x = np.full(3000, i, np.float32)  # (12 KB: through a slot)
    if kind == "mirrored":
        return Mirrored(x=x, y=i)
    if kind == "converting":
        d = Converting()
        d["x"], d["y"] = x, i
        return d
    return CopiesAsItself(x=x, y=i)


class Containers(Indexed):
    def __init__(self, kind):
        super().__init__(4)
        self.kind = kind

    def __getitem__(self, i):
        return _container(self.kind, i)


@pytest.mark.parametrize("kind", ["mirrored", "converting", "copies-as-itself"])
def test_dict_subclasses_with_their_own_methods_cross_the_workers_as_dataloaders(kind):
    want = next(iter(DataLoader(Containers(kind), 2)))
    with Loader(Containers(kind), 2, num_workers=2, in_order=True, autotune=False) as L:
        got = next(iter(L))
    assert type(got) is type(want) and list(got) == list(want) == ["x", "y"]
    for k in ("x", "y"):
        assert got[k].shape == want[k].shape and torch.equal(got[k], want[k])
        if kind == "mirrored":
            assert getattr(got, k) is got[k]


def test_a_mirrored_containers_attributes_follow_its_items_to_the_device():
    from autominato.pipeline.collate import to_device

    batch = Mirrored(x=torch.ones(2), y=torch.zeros(2))
    moved = to_device(batch, "meta")
    assert type(moved) is Mirrored and moved.x is moved["x"] and moved.x.device.type == "meta"
    assert batch.x.device.type == "cpu"  # the batch given is left as it was


def test_batch_size_none_delivers_samples_unbatched_as_dataloader():
    ds = Indexed(5)
    want = list(DataLoader(ds, batch_size=None))
    for workers in (0, 2):
        with Loader(ds, batch_size=None, num_workers=workers, in_order=True, autotune=False) as L:
            got = list(L)
            assert len(L) == 5 and L.batch_size is None
        assert all(isinstance(g, torch.Tensor) and g.shape == (2,) for g in got)
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
    with Loader(ds, batch_size=None, num_workers=1, collate_fn=lambda s: int(s[0]) * 10,
                in_order=True, autotune=False) as L:
        assert list(L) == [0, 10, 20, 30, 40]
    with pytest.raises(ValueError, match="drop_last"):
        Loader(ds, batch_size=None, drop_last=True, autotune=False)


class _Layouts:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        image = torch.arange(60.0).reshape(1, 3, 4, 5).to(memory_format=torch.channels_last)
        return {"image": image[0] + i, "mask": np.asfortranarray(np.full((3, 4), i))}


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_unbatched_samples_keep_their_memory_layout_as_dataloader(kind):
    # batch_size=None hands the samples over as they are: a channels-last image stays one
    # (trial: process workers gave it back C-contiguous; values equal, strides not).
    want = list(DataLoader(_Layouts(), batch_size=None, num_workers=2))
    with Loader(_Layouts(), batch_size=None, num_workers=2, worker_kind=kind, in_order=True,
                autotune=False) as L:
        got = list(L)
    for g, w in zip(got, want, strict=True):
        assert g["image"].stride() == w["image"].stride() and torch.equal(g["image"], w["image"])
        assert g["mask"].stride() == w["mask"].stride() and torch.equal(g["mask"], w["mask"])


def test_pin_memory_without_an_accelerator_warns_and_delivers(recwarn):
    if torch.cuda.is_available():
        pytest.skip("this host has an accelerator")
    with pytest.warns(UserWarning, match="no accelerator is found"):
        L = Loader(Indexed(4), 2, num_workers=1, pin_memory=True, autotune=False)
    with L:
        assert L.pin_memory and not L._cfg.pin_memory
        assert sorted(i for b in firsts(L) for i in b) == [0, 1, 2, 3]


def test_bad_types_name_the_argument():
    for kw, err, word in [
        (dict(num_workers="4"), TypeError, "num_workers"),
        (dict(num_workers=-1), ValueError, "num_workers"),
        (dict(prefetch_factor=0, num_workers=1), ValueError, "prefetch_factor"),
        (dict(worker_init_fn=3), TypeError, "worker_init_fn"),
        (dict(generator=7), TypeError, "generator"),
        (dict(seed="a"), TypeError, "seed"),
        (dict(timeout="1"), ValueError, "timeout"),
    ]:
        with pytest.raises(err, match=word):
            Loader(Indexed(4), 2, autotune=False, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_two_live_iterators_each_deliver_a_whole_epoch(workers):
    with Loader(Indexed(10), 3, shuffle=True, seed=1, num_workers=workers, autotune=False) as L:
        pairs = list(zip(L, L, strict=True))
        assert len(pairs) == len(L) == 4
        for side in (0, 1):
            assert sorted(i for p in pairs for i in p[side][:, 0].tolist()) == list(range(10))


def test_a_cuda_device_without_cuda_names_the_argument():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(ValueError, match="device='cuda'"):
        Loader(Indexed(4), 2, device="cuda", autotune=False)


class Growing(Indexed):
    """Sample i has i + 1 elements: no two samples of a batch stack."""

    def __getitem__(self, i: int):
        return np.full(i + 1, i, np.int64)


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_that_do_not_stack_raise_runtime_error_as_dataloader(workers):
    dl_it = iter(DataLoader(Growing(4), 2, num_workers=workers))
    with pytest.raises(RuntimeError, match="equal size"):
        next(dl_it)
    if workers:  # (an iterator without workers has none to stop)
        shut_down(dl_it)
    with Loader(Growing(4), 2, num_workers=workers, autotune=False) as loader:
        with pytest.raises(RuntimeError, match="shapes differ"):
            next(iter(loader))


def shut_down(dl_iterator) -> None:
    """Stop a DataLoader iterator's workers now. One that raised is held by a reference cycle
    (the error's frames) until the garbage collector frees it, and then Python may close its
    index queues' feeder threads before it asks its workers to stop: each worker then sits out
    its join timeout, 5 s (``torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL``), and the
    feeder threads left meanwhile make a later loader start its workers from a new
    interpreter. (The DataLoader has no public close.)"""
    dl_iterator._shutdown_workers()


class FailsAt(Indexed):
    """Sample ``bad`` raises."""

    def __init__(self, n: int, bad: int | range) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int):
        if i == self.bad or (not isinstance(self.bad, int) and i in self.bad):
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


def drain(it) -> tuple[list, list[BaseException]]:
    """Every batch (first column) and error (as "error") of an iterator whose loop catches
    errors and goes on, in the order they came; and the errors."""
    seq, errors = [], []
    while True:
        try:
            seq.append(next(it)[:, 0].tolist())
        except StopIteration:
            return seq, errors
        except ValueError as e:
            errors.append(e)
            seq.append("error")


@pytest.mark.parametrize("workers, in_order", [(0, True), (2, True), (2, False)])
def test_a_loop_that_catches_a_samples_error_gets_the_rest_of_the_epoch(workers, in_order):
    """DataLoader's iterator goes on after an error (it loses that batch); so does the
    Loader's: in order it loses that batch too (the same batches as DataLoader's), in
    completion order only the failing sample."""
    seq, errors = drain(iter(DataLoader(FailsAt(12, 4), 3, num_workers=workers)))
    assert seq == [[0, 1, 2], "error", [6, 7, 8], [9, 10, 11]] and len(errors) == 1
    with Loader(FailsAt(12, 4), 3, num_workers=workers, in_order=in_order, seed=0,
                autotune=False) as loader:
        for _ in range(2):  # and the next epoch is whole again
            seq, errors = drain(iter(loader))
            assert len(errors) == 1 and "bad sample 4" in str(errors[0])
            got = [b for b in seq if b != "error"]
            if in_order:  # the DataLoader's batches
                assert seq == [[0, 1, 2], "error", [6, 7, 8], [9, 10, 11]]
            else:
                assert sorted(i for b in got for i in b) == [i for i in range(12) if i != 4]
                assert [len(b) for b in got] == [3, 3, 3, 2]


class Buckets:
    """A sampler that keeps samples of a shape together, ``bucket`` to a batch (shuffled
    buckets, as a shape-bucketing sampler does)."""

    def __init__(self, n: int, bucket: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.order = [int(i) for b in rng.permutation(n // bucket)
                      for i in range(b * bucket, (b + 1) * bucket)]

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


class ShapeByBucket(FailsAt):
    """Sample i is a (2 + i // 4,) array: only samples of one bucket of 4 stack."""

    def __getitem__(self, i: int):
        super().__getitem__(i)
        return np.full(2 + i // 4, i, np.int64)


@pytest.mark.parametrize("workers, kind", [(0, "process"), (2, "process"), (2, "thread")])
def test_in_order_errors_leave_a_bucketing_samplers_batches_as_dataloaders(workers, kind):
    """In order the batches are the DataLoader's, errors or not: a failing sample loses its
    batch and the later batches keep their buckets (they moved up a place, mixing shapes, so
    every batch after an error failed to stack)."""
    bad = range(5, 40, 9)
    ds, sampler = ShapeByBucket(40, bad), Buckets(40, 4, seed=3)
    want, _ = drain(iter(DataLoader(ds, 4, sampler=sampler, num_workers=2)))
    assert want.count("error") == 4 and len(want) == 10
    with Loader(ds, 4, sampler=sampler, num_workers=workers, worker_kind=kind, in_order=True,
                autotune=False) as loader:
        for _ in range(2):
            assert drain(iter(loader))[0] == want


class SlowFirstFailure(FailsAt):
    """Samples 1 and 2 raise, 1 after 0.3 s: 2 fails first."""

    def __getitem__(self, i: int):
        if i == 1:
            time.sleep(0.3)
        return super().__getitem__(i)


@pytest.mark.parametrize("workers, kind", [(2, "process"), (2, "thread")])
def test_in_order_the_error_is_the_batchs_first_in_sampler_order_whatever_fails_first(workers, kind):
    ds = SlowFirstFailure(8, {1, 2})
    seq, errors = drain(iter(DataLoader(ds, 4, num_workers=2)))
    assert seq == ["error", [4, 5, 6, 7]] and "bad sample 1" in str(errors[0])
    with Loader(ds, 4, num_workers=workers, worker_kind=kind, in_order=True,
                autotune=False) as loader:
        got, errs = drain(iter(loader))
    assert got == seq and "bad sample 1" in str(errs[0])


class OddShapeAt(Indexed):
    """Sample ``odd`` is a (3,) array: the batch it joins cannot be stacked."""

    def __init__(self, n: int, odd: int) -> None:
        super().__init__(n)
        self.odd = odd

    def __getitem__(self, i: int):
        return np.full(3 if i == self.odd else 2, i, np.int64)


@pytest.mark.parametrize("workers, in_order", [(0, True), (2, True), (2, False)])
def test_a_batch_that_cannot_be_collated_is_an_error_and_the_epoch_goes_on(workers, in_order):
    """DataLoader raises default_collate's RuntimeError for that batch and goes on; the
    Loader's epoch ended there (every later batch was lost)."""
    def drain_runtime(it):
        seq = []
        while True:
            try:
                seq.append(next(it)[:, 0].tolist())
            except StopIteration:
                return seq
            except RuntimeError:
                seq.append("error")

    assert drain_runtime(iter(DataLoader(OddShapeAt(12, 4), 3, num_workers=workers))) == [
        [0, 1, 2], "error", [6, 7, 8], [9, 10, 11]]
    with Loader(OddShapeAt(12, 4), 3, num_workers=workers, in_order=in_order, autotune=False,
                prefetch_next_epoch=False) as loader:
        for _ in range(2):
            seq = drain_runtime(iter(loader))
            assert seq.count("error") == 1
            got = sorted(i for b in seq if b != "error" for i in b)
            assert len(got) == 9 and 4 not in got  # the batch with sample 4 is lost, as DL's
            if in_order:
                assert seq == [[0, 1, 2], "error", [6, 7, 8], [9, 10, 11]]


def test_strings_of_tuple_samples_collate_to_a_tuple_as_default_collate():
    samples = [(np.full(2, i, np.int64), f"case_{i}", i) for i in range(3)]
    from torch.utils.data import default_collate

    from autominato.pipeline.collate import collate

    ours, theirs = collate(samples), default_collate(samples)
    assert type(ours[1]) is type(theirs[1]) is tuple and ours[1] == theirs[1]
    dicts = [{"id": f"case_{i}"} for i in range(2)]
    assert collate(dicts) == default_collate(dicts) == {"id": ["case_0", "case_1"]}


@pytest.mark.parametrize("workers", [2])
def test_an_error_the_loop_does_not_catch_stops_its_run(workers):
    """The error leaves the loop; nothing may keep its iterator (and so its run, its window
    and its slots) alive: not the loader's threads, not a cycle through the traceback."""
    import gc

    with Loader(FailsAt(40, 4), 3, num_workers=workers, autotune=False) as loader:

        def loop():
            for _ in loader:
                pass

        gc.disable()
        try:
            with pytest.raises(ValueError):
                loop()
            pipeline = loader._pipeline
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(not r.speculative
                                                      for r in pipeline.runs.values()):
                time.sleep(0.02)
            assert [r for r in pipeline.runs.values() if not r.speculative] == []
        finally:
            gc.enable()


@pytest.mark.parametrize("in_order", [True, False])
def test_batch_sampler_batches_larger_than_the_pool_complete(in_order):
    """pool_size bounds the samples in flight (6 here); a batch sampler's batch of 32 must
    still complete (it hung: its group never filled)."""
    bs = BatchSampler(SequentialSampler(range(64)), 32, drop_last=False)
    with Loader(Indexed(64), batch_sampler=bs, num_workers=2, in_order=in_order,
                timeout=30) as loader:
        assert loader.knobs.pool_size < 32
        assert [b[:, 0].tolist() for b in loader] == [list(range(32)), list(range(32, 64))]


def test_errors_wait_for_the_consumer_as_batches_do():
    """An iterator not being read does not work through an epoch of failing samples: the
    errors count in its window and its prefetch depth."""
    with Loader(FailsAt(400, range(3, 400)), 2, num_workers=2, autotune=False,
                in_order=False) as loader:
        it = iter(loader)
        first = next(it)[:, 0].tolist()  # completion order: two of the good samples 0, 1, 2
        assert len(set(first)) == 2 and set(first) <= {0, 1, 2}
        time.sleep(1.0)
        (run,) = [r for r in loader._pipeline.runs.values() if not r.speculative]
        assert run.taken <= loader.knobs.pool_size + 2 * loader.knobs.depth + 2
        got, errors = drain(it)
        # (the good sample the first batch did not take: 2, or 0 or 1 when it finished last)
        rest = sorted({0, 1, 2} - set(first))
        assert [b for b in got if b != "error"] == [rest] and len(errors) == 397


def kept_error(loader) -> ValueError | None:
    """The error a loop over ``loader`` raised, kept as a notebook keeps ``sys.last_value``."""
    try:
        for _ in loader:
            pass
    except ValueError as e:
        del loader  # (the error's traceback holds this frame: not the loader with it)
        return e
    return None


def test_a_kept_error_does_not_keep_its_run():
    """A notebook keeps the last error (sys.last_value), a debugger its traceback: that must
    not keep the iterator's run, its window and slots."""
    with Loader(FailsAt(40, 4), 3, num_workers=2, autotune=False) as loader:
        kept = kept_error(loader)
        pipeline = loader._pipeline
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(not r.speculative
                                                  for r in pipeline.runs.values()):
            time.sleep(0.02)
        assert kept is not None
        assert [r for r in pipeline.runs.values() if not r.speculative] == []


@pytest.mark.parametrize("workers", [1, 2])
def test_a_kept_error_does_not_keep_the_dropped_loader_or_its_workers(workers):
    """Review 87: the frame of next() that counts the wait held the loader, so a kept error
    kept the loader, its worker processes and shared memory after the training loop dropped
    it. (With num_workers=0 the sample's own frames in the traceback hold the iterator, as the
    DataLoader's do: no process or thread is kept there.)"""
    import gc
    import weakref

    import psutil

    loader = Loader(FailsAt(8, 3), 1, num_workers=workers, autotune=False, seed=0,
                    in_order=True)
    kept = kept_error(loader)
    assert kept is not None
    pids, ref = loader.worker_pids(), weakref.ref(loader)
    assert 1 <= len(pids) <= workers  # (the error may come before every worker said ready)
    del loader
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_what_makes_the_epochs_cannot_be_set_after_init_as_with_dataloader():
    ds = Indexed(10)
    for name, value in [("batch_size", 2), ("sampler", [0, 1, 2]), ("drop_last", True),
                        ("dataset", Indexed(4)), ("batch_sampler", None),
                        ("persistent_workers", True)]:
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after "
                                             "DataLoader is initialized"):
            setattr(DataLoader(ds, 4), name, value)
        with Loader(ds, 4, num_workers=1, autotune=False) as L:
            with pytest.raises(ValueError, match=f"{name} attribute should not be set after "
                                                 "Loader is initialized"):
                setattr(L, name, value)
            assert [len(b) for b in L] == [4, 4, 2]  # nothing half applied
    with Loader(ds, 4, num_workers=1, autotune=False) as L:
        L.num_workers = 2  # knobs, not part of the epoch's shape: settable
        L.prefetch_factor = 3
        assert (L.num_workers, L.prefetch_factor) == (2, 3)
        with pytest.raises(ValueError, match=r"num_workers=0 is outside this Loader's bounds"):
            L.num_workers = 0  # (a Loader without workers is another Loader, not a clamp)
        for name, value in [("collate_fn", list), ("in_order", True), ("pin_memory", True),
                            ("generator", torch.Generator())]:
            with pytest.raises(ValueError, match=f"{name} cannot be set after the Loader"):
                setattr(L, name, value)  # the DataLoader applies it later; never ignored
        assert [len(b) for b in L] == [4, 4, 2] and L.num_workers == 2


def test_prefetch_factor_above_the_default_bound_is_taken_as_given():
    """The DataLoader takes any prefetch_factor; a value above the depth knob's default upper
    bound (32) was clamped by the constructor and refused by the setter."""
    ds = Indexed(10)
    with Loader(ds, 2, num_workers=1, prefetch_factor=100, autotune=False) as L:
        assert L.prefetch_factor == 100 and L.knobs.bounds("depth")[1] == 100
        L.prefetch_factor = 200
        assert L.prefetch_factor == 200 and L.knobs.bounds("depth") == (1, 200)
        L.prefetch_factor = 4  # the raised bound falls back (review 68): the controller's 32
        assert L.prefetch_factor == 4 and L.knobs.bounds("depth") == (1, 32)
        L.prefetch_factor = 100
        assert sorted(int(r[0]) for b in L for r in b) == list(range(10))
    with Loader(ds, 2, num_workers=1, pool_size=300, autotune=False) as L:
        assert L.knobs.pool_size == 300
    with Loader(ds, 2, num_workers=1, autotune=False) as L:
        L.knobs.set_bounds("depth", 1, 8)  # narrowed otherwise (a tuned configuration's)
        L.prefetch_factor = 6  # within it: the bound stays (review 69)
        assert L.knobs.bounds("depth") == (1, 8)
        L.prefetch_factor = 12
        L.prefetch_factor = 3
        assert L.knobs.bounds("depth") == (1, 8)


class Resizable:
    """Sample i is items[i]; ``items`` may be replaced between epochs."""

    def __init__(self, n: int) -> None:
        self.items = list(range(n))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return np.full(1, self.items[i], np.int64)


@pytest.mark.parametrize("kw", [dict(num_workers=0),
                                dict(num_workers=2, worker_kind="thread"),
                                dict(num_workers=1, persistent_workers=False)])
def test_a_dataset_that_shrinks_or_grows_between_epochs_is_read_as_it_is(kw):
    """DataLoader's samplers take len(dataset) at each pass; so does the Loader's order."""
    seen = {}
    for make in (DataLoader, Loader):
        ds = Resizable(6)
        args = {k: v for k, v in kw.items() if k != "worker_kind"} if make is DataLoader else kw
        extra = {} if make is DataLoader else dict(autotune=False, seed=0)
        loader = make(ds, batch_size=2, shuffle=True, **args, **extra)
        got = [sorted(int(x) for b in loader for x in b)]
        ds.items = ds.items[:4]
        got.append((len(loader), sorted(int(x) for b in loader for x in b)))
        ds.items = list(range(8))
        got.append((len(loader), sorted(int(x) for b in loader for x in b)))
        seen[make] = got
        if make is Loader:
            loader.close()
    assert seen[Loader] == seen[DataLoader] == [
        list(range(6)), (2, list(range(4))), (4, list(range(8)))]


def test_workers_that_keep_an_older_copy_of_a_grown_dataset_say_so():
    ds = Resizable(6)
    with Loader(ds, batch_size=2, num_workers=1, autotune=False) as L:  # persistent workers
        list(L)
        ds.items = list(range(8))
        with pytest.raises(IndexError) as info:
            list(L)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "the dataset has 8 samples now, the workers' copy 6" in notes
        assert "persistent_workers=False" in notes


class Endless(torch.utils.data.Sampler):
    """detectron2's TrainingSampler's shape: permutations forever, no __len__."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            yield from torch.randperm(self.n, generator=g).tolist()


@pytest.mark.parametrize("workers", [0, 1])
def test_an_endless_sampler_is_refused_by_name_instead_of_filling_the_memory(workers, monkeypatch):
    from autominato.pipeline import sampler as S

    monkeypatch.setattr(S, "MAX_ORDER", 1000)  # (the bound's size does not change the rule)
    with Loader(Indexed(5), 2, sampler=Endless(5), num_workers=workers, autotune=False) as L:
        with pytest.raises(ValueError, match=r"the sampler \(Endless\) gave more than 1000 "
                                             "indices in one pass.*endless sampler"):
            next(iter(L))
    batches = BatchSampler(Endless(5), 2, drop_last=False)
    with Loader(Indexed(5), batch_sampler=batches, num_workers=workers, autotune=False) as L:
        with pytest.raises(ValueError, match="the batch_sampler .* gave more than 1000 indices"):
            next(iter(L))
    # a sampler without a length that ends is read whole, as long as it is
    with Loader(Indexed(5), 2, sampler=(i % 5 for i in range(999)), num_workers=workers,
                autotune=False) as L:
        assert sum(len(b) for b in L) == 999


def test_a_long_finite_batch_sampler_with_a_length_is_read_whole(monkeypatch):
    """maskrcnn-benchmark's IterationBasedBatchSampler: many batches, an honest len()."""
    from autominato.pipeline import sampler as S

    monkeypatch.setattr(S, "MAX_ORDER", 1000)

    class Iterations:
        def __len__(self) -> int:
            return 600

        def __iter__(self):
            return ([i % 5, (i + 1) % 5, (i + 2) % 5] for i in range(600))  # 1800 indices

    with Loader(Indexed(5), batch_sampler=Iterations(), num_workers=0, autotune=False) as L:
        assert len(L) == 600 and sum(1 for _ in L) == 600


def test_a_sampler_of_keys_that_are_not_integer_indices_is_refused_by_name():
    """The DataLoader passes any key to __getitem__; autominato's orders, seeds and memory
    figures are per integer index: a string or float key is refused, never cast."""
    for keys in (["a", "b"], [0, 1.0]):
        with Loader(Indexed(3), 2, sampler=keys, num_workers=0, autotune=False) as L:
            with pytest.raises(TypeError, match=r"the sampler \(list\) gave a key that is not "
                                                "an integer index"):
                list(L)
    with Loader(Indexed(3), 2, sampler=[np.int64(2), torch.tensor(0), 1], num_workers=0,
                autotune=False) as L:
        assert firsts(L) == [[2, 0], [1]]  # NumPy and 0-d tensor integers are indices


def _iterate_copy(loader) -> list[int]:
    """One epoch's indices."""
    return sorted(int(i) for b in loader for i in b[:, 0])


def _copy_port(loader) -> int | None:
    return loader._telemetry.port


def _run_copy(fn, loader, out) -> None:
    with loader:
        out.put(fn(loader))


def in_spawned_process(fn, loader):
    """``fn(copy)`` where ``copy`` is ``loader`` pickled into a spawned process (Lightning's
    ddp_spawn sends the loaders so); asserts that the process ended well."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_run_copy, args=(fn, loader, q))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    return got


def test_a_loader_pickles_and_copies_as_its_arguments_with_its_seed():
    """A DataLoader pickles and deep-copies (Lightning's ddp_spawn pickles the loaders given
    to fit; review 100: the Loader raised TypeError). The copy draws the same orders (the
    drawn seed travels), begins at the epoch set, and is a Loader of its own."""
    import copy
    import pickle

    torch.manual_seed(5)
    with Loader(Indexed(10), 2, shuffle=True, num_workers=2, autotune=False) as L:
        L.set_epoch(3)
        want = L._order(3)[0]
        for other in (pickle.loads(pickle.dumps(L)), copy.deepcopy(L), copy.copy(L)):
            with other:
                assert other is not L and other.seed == L.seed and other.epoch == 3
                assert other._order(3)[0] == want
                assert sorted(int(i) for b in other for i in b[:, 0]) == list(range(10))
        assert in_spawned_process(_iterate_copy, L) == list(range(10))


def test_a_subclass_with_its_own_init_is_told_to_define_reduce():
    import pickle

    class Mine(Loader):
        def __init__(self, ds):
            super().__init__(ds, 2, num_workers=0)

    with Mine(Indexed(4)) as L, pytest.raises(TypeError, match="define __reduce__"):
        pickle.dumps(L)


def test_a_copy_of_a_loader_whose_metrics_port_is_taken_binds_another():
    """Review 103: each ddp_spawn rank unpickles the loader while the parent holds its
    metrics port: the copy raised PortInUseError. It takes a free port (logged). (In the
    same process a copy shares the running endpoint.)"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Loader(Indexed(4), 2, num_workers=0, metrics_port=port) as L:
        assert L._telemetry.port == port
        assert in_spawned_process(_copy_port, L) not in (None, port)
