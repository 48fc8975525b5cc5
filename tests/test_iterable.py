"""Iterable datasets (``torch.utils.data.IterableDataset``, any iterable without
``__getitem__``): each worker iterates its shard as under the DataLoader (issue 13, point 3)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from autominato import Loader
from autominato.pipeline.errors import WorkerDied


class Numbers(IterableDataset):
    """Yields 0..n-1; each worker (``get_worker_info()``) takes every num_workers-th number
    from its id, the sharding idiom of torch's documentation. A sample is
    ``[i, worker id, num_workers]`` (-1s without a worker); listed numbers sleep."""

    def __init__(self, n: int, slow: dict[int, float] | None = None, sized: bool = True) -> None:
        self.n, self.slow, self.sized = n, slow or {}, sized

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no len")
        return self.n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (-1, -1) if info is None else (info.id, info.num_workers)
        for i in range(max(wid, 0), self.n, max(nw, 1)):
            if i in self.slow:
                time.sleep(self.slow[i])
            yield np.array([i, wid, nw], np.int64)


class Uneven(IterableDataset):
    """Worker w yields 3 + 4 * w samples ``[w, k]`` (shards of different lengths)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w = 0 if info is None else info.id
        for k in range(3 + 4 * w):
            yield np.array([w, k], np.int64)


def rows(loader) -> list[list[int]]:
    return [r for b in loader for r in b.tolist()]


@pytest.mark.parametrize("kind", ["process", "thread"])
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_each_sample_is_delivered_once_per_epoch_and_workers_shard_the_dataset(kind, workers):
    with Loader(Numbers(50), 4, num_workers=workers, worker_kind=kind, autotune=False) as L:
        for _ in range(2):
            got = rows(L)
            assert sorted(i for i, _, _ in got) == list(range(50))
            if workers == 0:  # no worker: get_worker_info() is None, as under the DataLoader
                assert {(w, n) for _, w, n in got} == {(-1, -1)}
            else:  # worker w iterated exactly the numbers of its shard
                assert {n for _, _, n in got} == {workers}
                assert all(i % workers == w for i, w, _ in got)
        assert len(L) == 13


class Plain:
    """An iterable that is no IterableDataset and has no __getitem__ or __len__."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter([np.int64(i) for i in range(start, 10, step)])


@pytest.mark.parametrize("start_method", ["auto", "forkserver"])
def test_a_plain_iterable_without_getitem_is_iterated_too(start_method):
    with Loader(Plain(), 3, num_workers=2, start_method=start_method, autotune=False) as L:
        assert sorted(x for b in L for x in b.tolist()) == list(range(10))
        with pytest.raises(TypeError, match="no len"):
            len(L)


@pytest.mark.parametrize("workers", [0, 2])
def test_drop_last_drops_the_final_short_batch(workers):
    with Loader(Numbers(50), 4, num_workers=workers, drop_last=True, autotune=False) as L:
        batches = list(L)
        assert len(batches) == len(L) == 12 and all(len(b) == 4 for b in batches)
        seen = [r[0] for b in batches for r in b.tolist()]
        assert len(set(seen)) == 48


@pytest.mark.parametrize(("drop_last", "kind"), [(False, "process"), (True, "process"),
                                                 (True, "thread")])
def test_in_order_gives_dataloaders_batches_round_robin_over_the_workers(drop_last, kind):
    ds = Uneven()
    expected = [b.tolist() for b in DataLoader(ds, 2, num_workers=3, drop_last=drop_last)]
    with Loader(ds, 2, num_workers=3, drop_last=drop_last, in_order=True, worker_kind=kind,
                autotune=False) as L:
        assert [b.tolist() for b in L] == expected
    # worker 0's shard ends first and leaves the round; short last batches per worker
    assert [b[0][0] for b in expected[:3]] == [0, 1, 2]


def test_the_dataloaders_checks_for_an_iterable_dataset():
    with pytest.raises(ValueError, match="shuffle"):
        Loader(Numbers(4), 2, shuffle=True, autotune=False)
    with pytest.raises(ValueError, match="sampler"):
        Loader(Numbers(4), 2, sampler=[0, 1], autotune=False)
    with Loader(Numbers(4, sized=False), 2, num_workers=0, autotune=False) as L:
        with pytest.raises(TypeError, match="no len"):
            len(L)


def noisy(sample, rng):
    return sample * 1000 + rng.integers(0, 1000)


def test_augmentation_follows_seed_epoch_worker_and_position_in_the_shard():
    def epochs(**kw):
        with Loader(Numbers(24), 4, num_workers=2, transform=noisy, seed=7, autotune=False, **kw) as L:
            out = []
            for _ in range(2):
                out.append({r[0] // 1000: r[0] % 1000 for b in L for r in b.tolist()})
            return out

    a, b = epochs(), epochs(worker_kind="thread")
    assert a == b  # neither the worker kind nor the completion order changes a sample's draw
    assert a[0] != a[1]  # a new epoch draws anew
    # the k-th sample of worker w's shard: SeedSequence([seed, epoch, w, k])
    i = 5  # worker 1's third sample (1, 3, 5, ...)
    rng = np.random.default_rng(np.random.SeedSequence([7, 0, 1, 2]))
    assert a[0][i] == rng.integers(0, 1000)


class ShuffledShard(IterableDataset):
    """Each worker shuffles its shard of 0..15 with a generator seeded from
    ``get_worker_info().seed`` (the idiom of a stream that shuffles itself); a sample is
    ``[i, seed]``."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = list(range(info.id, 16, info.num_workers))
        np.random.default_rng(info.seed).shuffle(mine)
        for i in mine:
            yield np.array([i, info.seed % (1 << 62)], np.int64)


@pytest.mark.parametrize("persistent", [None, False, True])
@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_shard_shuffled_from_the_worker_seed_as_dataloader_across_epochs(persistent, kind):
    # The DataLoader's workers start afresh each epoch with a new base seed (its default,
    # persistent_workers=False): a shard shuffled from get_worker_info().seed comes in a new
    # order each epoch; its persistent workers keep one seed. The Loader's default is
    # persistent workers: that default gave one order for every epoch (trial 141's note).
    kw = {} if persistent is None else {"persistent_workers": persistent}
    ref = DataLoader(ShuffledShard(), batch_size=4, num_workers=2,
                     persistent_workers=bool(persistent))
    want = [[r[0] for r in rows(ref)] for _ in range(3)]
    with Loader(ShuffledShard(), batch_size=4, num_workers=2, worker_kind=kind, in_order=True,
                seed=3, autotune=False, **kw) as L:
        got = [rows(L) for _ in range(3)]
    orders = [[r[0] for r in g] for g in got]
    seeds = [{r[1] for r in g} for g in got]
    assert all(sorted(o) == list(range(16)) for o in orders)
    if persistent:
        assert orders[0] == orders[1] == orders[2] and want[0] == want[1] == want[2]
        assert seeds[0] == seeds[1] == {3, 4}  # the Loader's seed plus the worker id
    else:
        assert len({tuple(o) for o in orders}) == 3 and len({tuple(w) for w in want}) == 3
        assert seeds[0] == {3, 4} and not seeds[1] & seeds[0] and not seeds[2] & seeds[1]


class FailsAt(Numbers):
    def __iter__(self):
        for row in super().__iter__():
            if row[0] == 13:
                raise_in_stream(row)
            yield row


def raise_in_stream(row):
    raise KeyError(f"bad record {int(row[0])}")


def test_errors_in_a_stream_follow_on_error(caplog):
    with Loader(FailsAt(30), 4, num_workers=2, on_error="skip", autotune=False) as L:
        with caplog.at_level(logging.WARNING, logger="autominato.pipeline"):
            got = sorted(r[0] for r in rows(L))
    told = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert told and all("sample of the iterable dataset: KeyError" in m for m in told)
    assert not any("index -1" in m for m in told)
    # a generator that raised is over: worker 1's shard ends at 13, as under the DataLoader
    assert got == [i for i in range(30) if i % 2 == 0 or i < 13]
    with Loader(FailsAt(30), 4, num_workers=2, autotune=False) as L:
        with pytest.raises(KeyError, match="bad record 13") as e:
            rows(L)
        assert "shard 1 of 2" in "".join(getattr(e.value, "__notes__", []))
        # A loop that catches it gets the rest, as from DataLoader's iterator: the other
        # worker's shard goes on; the generator that raised is over. (DataLoader also loses
        # the samples of the batch its worker was filling, 9 and 11.)
        for last, loader in ((13, L), (9, DataLoader(FailsAt(30), 4, num_workers=2))):
            got, it = [], iter(loader)
            while True:
                try:
                    got += [r[0] for r in next(it).tolist()]
                except StopIteration:
                    break
                except KeyError:
                    got.append("error")
            assert got.count("error") == 1
            assert sorted(x for x in got if x != "error") == [
                i for i in range(30) if i % 2 == 0 or i < last]


@pytest.mark.parametrize("batch_size", [2, 4])
def test_in_order_a_streams_error_comes_as_with_dataloader(batch_size):
    """With in_order, the error takes the place of the batch it was in, in the round-robin,
    and the samples of that batch before it are lost with it (batch 4: worker 1's 9 and 11),
    as a DataLoader worker's fetch; with batch 2 it starts a batch. autominato kept them for
    the shard's next batch, so every later batch of that shard differed."""
    def seq(loader):
        out, it = [], iter(loader)
        while True:
            try:
                out.append([r[0] for r in next(it).tolist()])
            except StopIteration:
                return out
            except KeyError:
                out.append("error")

    want = seq(DataLoader(FailsAt(30), batch_size, num_workers=2))
    assert "error" in want
    with Loader(FailsAt(30), batch_size, num_workers=2, in_order=True, autotune=False) as L:
        assert seq(L) == want


def test_a_worker_killed_mid_stream_ends_the_epoch_with_an_error_naming_the_shard():
    slow = {i: 0.05 for i in range(60)}
    with Loader(Numbers(60, slow), 2, num_workers=2, autotune=False) as L:
        it = iter(L)
        next(it)
        os.kill(L.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerDied, match="shard .* of 2 of the iterable dataset"):
            for _ in it:
                pass
        # the next epoch starts fresh streams on the replacement worker
        assert sorted(r[0] for r in rows(L)) == list(range(60))


def test_the_workers_knob_takes_effect_at_the_next_epoch(caplog):
    with Loader(Numbers(40, {i: 0.01 for i in range(40)}), 2, num_workers=2,
                autotune=False) as L:
        it = iter(L)
        first = [r for r in next(it).tolist()]
        with caplog.at_level(logging.INFO, logger="autominato.pipeline"):
            L.knobs.workers = 3
            rest = [r for b in it for r in b.tolist()]
        got = first + rest
        assert sorted(r[0] for r in got) == list(range(40))
        assert {r[2] for r in got} == {2}  # this epoch keeps its 2 shards
        assert "workers=3 takes effect at the next epoch" in caplog.text
        got = rows(L)
        assert sorted(r[0] for r in got) == list(range(40)) and {r[2] for r in got} == {3}


class Endless(IterableDataset):
    """Counts the samples it yielded (thread workers share it)."""

    def __init__(self) -> None:
        self.made = 0
        self.lock = threading.Lock()

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k = info.id
        while True:
            with self.lock:
                self.made += 1
            yield np.int64(k)
            k += info.num_workers


def test_workers_never_run_far_ahead_of_the_training_loop():
    ds = Endless()
    with Loader(ds, 2, num_workers=2, worker_kind="thread", pool_size=6, depth=2,
                autotune=False) as L:
        it = iter(L)
        for _ in range(3):
            next(it)
        # the loop pauses: the workers fill the window, then stop
        made, deadline = -1, time.monotonic() + 30
        while ds.made != made and time.monotonic() < deadline:
            made = ds.made
            time.sleep(0.3)
        assert ds.made == made, "the workers did not stop"
        # consumed 6; at most the window (pool_size), the batches waiting (depth) and the one
        # being collated, and one pull per shard that was under way, are ahead
        assert made <= 6 + 6 + 2 * 2 + 2 + 2 * 2, made


@pytest.mark.parametrize("workers", [0, 2])
def test_two_live_iterators_each_deliver_a_whole_epoch(workers):
    with Loader(Numbers(21), 4, num_workers=workers, autotune=False) as L:
        pairs = list(zip(L, L, strict=True))
        assert len(pairs) == len(L) == 6
        for side in (0, 1):
            assert sorted(r[0] for p in pairs for r in p[side].tolist()) == list(range(21))


class NoSharding(IterableDataset):
    """Yields 0..7 in every worker: it does not take a share by get_worker_info()."""

    def __iter__(self):
        return iter(range(8))


def test_an_iterable_dataset_without_num_workers_warns_that_each_worker_iterates_it():
    """DataLoader's default (no worker) yields any iterable dataset once; the Loader's default
    starts workers, each of which iterates it: the user is told, and ``num_workers`` given
    (0 here: DataLoader's default) says which (review 100)."""
    with pytest.warns(UserWarning, match="NoSharding is an IterableDataset and num_workers was "
                      "not given.*get_worker_info"):
        L = Loader(NoSharding(), 4, autotune=False)
    L.close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Loader(NoSharding(), 4, num_workers=0) as L:
            assert sorted(int(v) for b in L for v in b) == list(range(8))
        Loader(NoSharding(), 4, num_workers=2, autotune=False).close()


class _ReportsThreeYieldsEight(torch.utils.data.IterableDataset):
    def __len__(self) -> int:
        return 3

    def __iter__(self):
        return iter(range(8))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_that_yields_more_batches_than_the_reported_length_warns_as_dataloader(workers):
    # Trial 141: the DataLoader warns (its only hint that len(loader), which progress bars
    # and schedulers read, is wrong); the Loader said nothing. Once a pass here, after
    # len(loader) was read, as the DataLoader; nothing when len() was never asked.
    import warnings

    ds = _ReportsThreeYieldsEight()
    with Loader(ds, batch_size=2, num_workers=workers) as loader:
        with warnings.catch_warnings(record=True) as quiet:
            warnings.simplefilter("always")
            assert sum(1 for _ in loader) == (4 if workers == 0 else 8)  # (list() asks len())
        assert not [w for w in quiet if "Length of IterableDataset" in str(w.message)]
        assert len(loader) == 2
        for _ in range(2):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                for _ in loader:
                    pass
            said = [w for w in said if "Length of IterableDataset" in str(w.message)]
            assert len(said) == 1 and said[0].filename == __file__
            assert "was reported to be 3(when accessing len(dataloader)), but 4 samples" in str(
                said[0].message)
            assert ("replica at each worker" in str(said[0].message)) == (workers > 0)
    # list() reads len() after iter(): that pass does not warn, the next does (the
    # DataLoader reads the length when the iterator is made: review 143)
    for make in (DataLoader, Loader):
        loader = make(_ReportsThreeYieldsEight(), batch_size=2, num_workers=workers)
        counts = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                list(loader)
            counts.append(min(1, sum("Length of IterableDataset" in str(w.message)
                                     for w in said)))
        getattr(loader, "close", lambda: None)()
        assert counts == [0, 1], make


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_negative_epoch_still_gives_each_shard_a_worker_seed(kind):
    # Review 167: the epoch's base seed refused a negative epoch (SeedSequence takes no
    # negative entropy) and the shard's worker died; set_epoch(-1) ran before.
    with Loader(ShuffledShard(), batch_size=4, num_workers=2, worker_kind=kind, seed=3,
                autotune=False) as L:
        L.set_epoch(-1)
        assert sorted(r[0] for r in rows(L)) == list(range(16))
