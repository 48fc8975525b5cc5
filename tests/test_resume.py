"""Mid-epoch checkpoint and resume: Loader.state_dict() / load_state_dict() (autominato.resume)."""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from autominato import Loader, resume
from autominato.resume import IterableRestartWarning

N = 30
B = 4
BATCHES = -(-N // B)
BLOCKED = 5  # its transform waits for GATE (thread workers only): in flight at the checkpoint
GATE = threading.Event()
GATE.set()


class RowDataset:
    """Sample i is the row ``[i, -1]`` (float64)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, -1.0])


def aug(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The augmentation: column 1 becomes a draw of the sample's generator."""
    if int(x[0]) == BLOCKED:
        GATE.wait(30)
    return np.array([x[0], rng.random()])


def make(**kw) -> Loader:
    args = dict(batch_size=B, shuffle=True, seed=11, transform=aug, autotune=False,
                num_workers=2, worker_kind="thread")
    args.update(kw)
    return Loader(RowDataset(args.pop("n", N)), **args)


def rows(batches) -> dict[int, float]:
    """Dataset index -> its augmented value; fails on an index delivered twice."""
    out: dict[int, float] = {}
    for b in batches:
        for i, v in b.tolist():
            assert int(i) not in out, f"index {int(i)} delivered twice"
            out[int(i)] = v
    return out


def reference(**kw) -> list[torch.Tensor]:
    """The uninterrupted epoch (epoch 0) of the same configuration."""
    with make(**kw) as loader:
        return list(loader)


@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [0, 3, BATCHES - 1])  # the start, the middle, before the end
def test_resume_delivers_the_rest_of_the_epoch_once_with_the_same_augmentation(k, workers, in_order):
    want = reference(in_order=in_order, num_workers=workers)
    block = workers > 0 and not in_order and k > 0
    if block:
        GATE.clear()  # sample BLOCKED is in flight when the checkpoint is taken
    try:
        with make(in_order=in_order, num_workers=workers) as loader:
            it = iter(loader)
            first = [next(it) for _ in range(k)]
            state = pickle.loads(pickle.dumps(loader.state_dict()))
    finally:
        GATE.set()
    before = rows(first)
    if block:
        assert BLOCKED not in before
    assert state["batches"] == k and not state["finished"]
    with make(in_order=in_order, num_workers=workers) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
        after_rows = rows(rest)
        assert not before.keys() & after_rows.keys()
        assert {**before, **after_rows} == rows(want)  # every index once, same augmentation
        assert len(rest) == BATCHES - k
        if in_order:  # the batches the uninterrupted epoch delivered after the checkpoint
            assert all(torch.equal(a, b) for a, b in zip(rest, want[k:], strict=True))
        # The next pass is the next epoch, from its start.
        nxt = rows(loader)
        assert loader.epoch == 1
    with make(in_order=in_order, num_workers=workers) as loader:
        list(loader)
        assert nxt == rows(loader)


def test_a_completion_order_state_resumes_in_order():
    GATE.clear()
    try:
        with make(shuffle=False, in_order=False) as loader:
            it = iter(loader)
            first = [next(it) for _ in range(2)]
            state = loader.state_dict()
    finally:
        GATE.set()
    done = {p for a, b in state["delivered"] for p in range(a, b)}
    assert len(done) == 2 * B and BLOCKED not in done  # a hole at BLOCKED's position
    with make(shuffle=False, in_order=True) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert {**rows(first), **rows(rest)} == rows(reference(shuffle=False))
    order = [int(i) for i in torch.cat(reference(shuffle=False, in_order=True))[:, 0]]
    assert [int(i) for i in torch.cat(rest)[:, 0]] == [i for p, i in enumerate(order) if p not in done]


def test_a_checkpoint_of_a_resumed_epoch_resumes_again():
    want = rows(reference())
    seen: dict[int, float] = {}
    state = None
    for take in (2, 3, None):
        with make() as loader:
            if state is not None:
                loader.load_state_dict(state)
            it = iter(loader)
            got = [next(it) for _ in range(take)] if take else list(it)
            state = loader.state_dict()
        part = rows(got)
        assert not part.keys() & seen.keys()
        seen.update(part)
    assert seen == want and state["finished"] and state["batches"] == BATCHES
    assert json.loads(json.dumps(state)) == state  # plain Python types


@pytest.mark.parametrize("in_order", [False, True])
def test_resume_with_ranks_keeps_each_shard_exactly_once(in_order):
    union: dict[int, float] = {}
    for rank in (0, 1):
        kw = dict(rank=rank, world_size=2, in_order=in_order, n=N + 1)  # padded, as DistributedSampler
        want = reference(**kw)
        with make(**kw) as loader:
            it = iter(loader)
            first = [next(it) for _ in range(2)]
            state = loader.state_dict()
        with make(**kw) as loader:
            loader.load_state_dict(state)
            rest = list(loader)
        got = [*first, *rest]
        assert sorted(torch.cat(got)[:, 0].tolist()) == sorted(torch.cat(want)[:, 0].tolist())
        assert rows(got) == rows(want)
        union.update(rows(got))
    assert sorted(union) == list(range(N + 1))


def test_drop_last_drops_the_same_indices_after_a_resume():
    want = rows(reference(drop_last=True))
    assert len(want) == N // B * B
    with make(drop_last=True) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        state = loader.state_dict()
    with make(drop_last=True) as loader:
        loader.load_state_dict(state)
        assert {**rows(first), **rows(loader)} == want


def test_batch_sampler_resumes_with_the_remaining_batches():
    groups = [[3, 1], [0, 7, 8], [2], [4, 5, 6], [9]]
    with make(batch_size=1, shuffle=None, batch_sampler=groups, in_order=True) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(2)]
        state = loader.state_dict()
    with make(batch_size=1, shuffle=None, batch_sampler=groups, in_order=True) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert [b[:, 0].long().tolist() for b in first + rest] == groups


class CountingSampler:
    """A stateful sampler: each iteration draws a new permutation from its own counter."""

    def __init__(self, n: int) -> None:
        self.n, self.count = n, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.count)
        self.count += 1
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        self.count = sd["count"]


def test_a_stateful_sampler_is_restored_as_its_epoch_began():
    with make(shuffle=None, sampler=CountingSampler(N), in_order=True) as loader:
        list(loader)  # epoch 0 takes count 0
        want = list(loader)  # epoch 1 takes count 1
    with make(shuffle=None, sampler=CountingSampler(N), in_order=True) as loader:
        list(loader)
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        state = loader.state_dict()
    assert state["samplers"] == {"sampler": {"count": 1}}
    sampler = CountingSampler(N)
    with make(shuffle=None, sampler=sampler, in_order=True) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert all(torch.equal(a, b) for a, b in zip(first + rest, want, strict=True))
    assert sampler.count == 2


def test_state_before_iterating_and_after_an_epoch():
    with make() as loader:
        fresh = loader.state_dict()
        assert fresh["epoch"] == 0 and fresh["epoch_size"] is None and not fresh["finished"]
        list(loader)
        ended = loader.state_dict()
        assert ended["finished"] and ended["delivered"] == [[0, N]]
        want_next = rows(loader)  # epoch 1
    with make() as loader:
        loader.load_state_dict(fresh)
        assert rows(loader) == rows(reference())
    with make() as loader:
        loader.load_state_dict(ended)
        assert rows(loader) == want_next and loader.epoch == 1


def test_set_epoch_keeps_the_resume_of_its_own_epoch_and_drops_another(caplog):
    with make() as loader:
        loader.set_epoch(4)
        it = iter(loader)
        first = rows([next(it) for _ in range(3)])
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        loader.set_epoch(4)
        rest = rows(loader)
        assert len(first) + len(rest) == N and not first.keys() & rest.keys()
    with make() as loader, caplog.at_level(logging.WARNING, "autominato.pipeline"):
        loader.load_state_dict(state)
        loader.set_epoch(5)
        assert len(rows(loader)) == N
    assert "set_epoch(5) after load_state_dict() of epoch 4" in caplog.text


def test_the_knobs_come_back_tuned():
    with make(depth=2, pool_size=10) as loader:
        loader.knobs.depth = 6
        loader.knobs.pool_size = 20
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        assert (loader.knobs.depth, loader.knobs.pool_size) == (6, 20)


def test_a_state_saved_without_workers_keeps_the_workers_of_the_loader_that_loads_it():
    # num_workers=0 is a mode (everything in the training loop's thread), not a tuned count:
    # it used to become 1 worker (the knob's lowest bound) in a Loader built with 3.
    with make(num_workers=0) as loader:
        state = loader.state_dict()
    with make(num_workers=3) as loader:
        loader.load_state_dict(state)
        assert loader.num_workers == 3
        assert len(rows(loader)) == N


def test_a_loader_without_seed_takes_the_states_seed():
    with make(seed=None) as loader:
        it = iter(loader)
        first = rows([next(it) for _ in range(2)])
        state = loader.state_dict()
        drawn = loader.seed
    with make(seed=drawn) as loader:
        want = rows(loader)
    torch.manual_seed(drawn + 1)  # this Loader would draw another seed
    with make(seed=None) as loader:
        loader.load_state_dict(state)
        assert loader.seed == drawn
        assert {**first, **rows(loader)} == want


@pytest.mark.parametrize("change, message", [
    (dict(batch_size=5), "batch_size=4, this Loader has batch_size=5"),
    (dict(rank=1, world_size=2), "world_size=1, this Loader has world_size=2"),
    (dict(n=N + 1), "dataset_len=30, this Loader has dataset_len=31"),
    (dict(seed=12), "seed=11, this Loader has seed=12"),
    (dict(drop_last=True), "drop_last=False, this Loader has drop_last=True"),
    (dict(shuffle=False), "shuffle=True, this Loader has shuffle=False"),
])
def test_a_state_of_another_epoch_shape_is_refused_by_name(change, message):
    with make() as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with make(**change) as loader, pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


def test_another_ranks_state_is_taken_with_a_warning_in_completion_order_and_as_is_in_order():
    """Lightning writes its checkpoint from rank 0 alone: every rank loads rank 0's state. In
    completion order its positions stand for rank 1's, with a warning, and rank 1 has as many
    batches left as rank 0 (trial 153: a ValueError ended the
    resumed DDP fit on rank 1)."""
    from autominato.resume import OtherRankStateWarning

    for in_order in (False, True):
        kw = dict(world_size=2, in_order=in_order, n=N + 1)
        with make(rank=0, **kw) as loader:
            it = iter(loader)
            next(it)
            next(it)
            state = loader.state_dict()
            left0 = len(list(it))
        with make(rank=1, **kw) as loader:
            if not in_order:
                with pytest.warns(OtherRankStateWarning, match=r"rank 0's delivered positions"
                                  r" of epoch 0 as its own and has as many batches left"):
                    loader.load_state_dict(state)
                rest = list(loader)
                assert len(rest) == left0
                positions = set(range(-(-(N + 1) // 2))) - set(
                    resume.from_ranges(state["delivered"], state["epoch_size"]))
                assert sum(len(b) for b in rest) == len(positions)
                continue
            want = reference(rank=1, **kw)
            loader.load_state_dict(state)  # rank 1 stepped as often: the same prefix
            rest = list(loader)
            assert all(torch.equal(a, b) for a, b in zip(rest, want[2:], strict=True))


def test_malformed_states_are_refused():
    with make() as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        with pytest.raises(TypeError, match="dict"):
            loader.load_state_dict([state])
        with pytest.raises(ValueError, match="version"):
            loader.load_state_dict({**state, "version": 99})
        with pytest.raises(ValueError, match="lacks knobs"):
            loader.load_state_dict({k: v for k, v in state.items() if k != "knobs"})
        with pytest.raises(ValueError, match="outside the epoch's 30 positions"):
            loader.load_state_dict({**state, "delivered": [[0, 31]]})
        for key in ("sampler_epochs", "began_sampler_epochs"):
            with pytest.raises(ValueError, match=f"{key} is not a dict"):
                loader.load_state_dict({**state, key: {"sampler": "3"}})


def test_a_stateful_samplers_state_needs_a_stateful_sampler():
    with make(shuffle=None, sampler=CountingSampler(N)) as loader:
        state = loader.state_dict()
    with make(shuffle=None, sampler=list(range(N))) as loader:
        with pytest.raises(ValueError, match="no sampler with load_state_dict"):
            loader.load_state_dict(state)


@pytest.mark.parametrize("seed", range(5))
def test_delivered_positions_round_trip_through_ranges(seed):
    mask = np.random.default_rng(seed).random(50) < 0.6
    ranges = resume.to_ranges(mask)
    assert all(a < b for a, b in ranges)
    assert all(b0 < a1 for (_, b0), (a1, _) in zip(ranges, ranges[1:], strict=False))  # sorted, disjoint
    assert resume.from_ranges(ranges, 50) == np.flatnonzero(mask).tolist()


def test_a_sampler_that_changes_its_length_is_caught_at_the_resume():
    with make(shuffle=None, sampler=list(range(N))) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with make(shuffle=None, sampler=list(range(N - 2))) as loader:
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match="28 positions, it had 30"):
            iter(loader)
        # The checkpoint stays pending: the epoch does not start afresh, delivering again what
        # was delivered before it (review 45)
        with pytest.raises(ValueError, match="28 positions, it had 30"):
            iter(loader)


def _weighted(reseeded: bool):
    """An oversampling sampler: a plain WeightedRandomSampler draws each epoch from one
    generator (a new one in a new process replays epoch 0's order); the subclass reseeds it
    per epoch (the workaround the error names)."""

    class Reseeded(torch.utils.data.WeightedRandomSampler):
        def set_epoch(self, epoch: int) -> None:
            self.generator = torch.Generator().manual_seed(1000 + epoch)

    cls = Reseeded if reseeded else torch.utils.data.WeightedRandomSampler
    return cls([10.0, 10.0] + [1.0] * (N - 2), 24, replacement=True,
               generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("reseeded", [False, True], ids=["plain", "reseeded"])
def test_a_sampler_that_gives_another_order_on_resume_is_caught(reseeded):
    """Trial 50: resuming epoch 2 of a plain WeightedRandomSampler in a new Loader delivered
    positions 8-23 of epoch 0's order, silently; its order's fingerprint now catches it, and a
    sampler that rebuilds its epoch's order resumes exactly."""

    def run(loader, epochs=3, stop=None):
        for e in range(epochs):
            loader.set_epoch(e)
            if e == epochs - 1 and stop is not None:
                it = iter(loader)
                return [next(it)[:, 0].tolist() for _ in range(stop)], loader.state_dict()
            got = [b[:, 0].tolist() for b in loader]
        return got, None

    with make(shuffle=None, sampler=_weighted(reseeded), in_order=True) as loader:
        whole, _ = run(loader)
    with make(shuffle=None, sampler=_weighted(reseeded), in_order=True) as loader:
        head, state = run(loader, stop=2)
    assert head == whole[:2]
    with make(shuffle=None, sampler=_weighted(reseeded), in_order=True) as loader:
        loader.load_state_dict(state)
        if not reseeded:
            for _ in range(2):  # and the checkpoint stays pending
                with pytest.raises(ValueError, match="another order than at the checkpoint"):
                    iter(loader)
            return
        assert head + [b[:, 0].tolist() for b in loader] == whole


def test_the_order_check_spares_a_state_with_nothing_delivered_and_other_ranks_orders():
    """Review 51: a checkpoint before the first batch names no sample (the epoch restarts
    exactly); a DistributedSampler given its rank (Horovod, torch-XLA: the Loader is rank 0)
    loads rank 0's in-order state with an order of its own."""
    with make(shuffle=None, sampler=_weighted(False), in_order=True) as loader:
        loader.set_epoch(1)
        iter(loader)
        state = loader.state_dict()
    assert state["order_digest"] is None
    with make(shuffle=None, sampler=_weighted(False), in_order=True) as loader:
        loader.load_state_dict(state)
        assert len([b for b in loader]) == 6  # 24 positions, batches of 4

    def shard(rank):
        return torch.utils.data.DistributedSampler(RowDataset(), num_replicas=2, rank=rank,
                                                   shuffle=True, seed=3)

    with make(shuffle=None, sampler=shard(0), in_order=True) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    assert state["order_digest"] is not None and state["order_rank"] == 0
    with make(shuffle=None, sampler=shard(1), in_order=True) as loader:
        whole = [b[:, 0].tolist() for b in loader]
    with make(shuffle=None, sampler=shard(1), in_order=True) as loader:
        loader.load_state_dict(state)
        assert [b[:, 0].tolist() for b in loader] == whole[1:]


class IterableWithLength(torch.utils.data.IterableDataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, -1.0])

    def __iter__(self):
        return iter(range(N))


class IterableRows:
    """An iterable without ``__getitem__`` that is no ``IterableDataset`` (a generator's)."""

    def __iter__(self):
        return (np.array([i, -1.0]) for i in range(N))


@pytest.mark.parametrize("dataset", [IterableWithLength, IterableRows])
def test_an_iterable_datasets_mid_epoch_state_restarts_its_epoch_and_its_state_between_epochs_is_taken(dataset):
    with Loader(dataset(), batch_size=B, num_workers=0, autotune=False) as loader:
        fresh = loader.state_dict()  # before any epoch: the start of epoch 0
        it = iter(loader)
        next(it)
        next(it)
        with pytest.warns(IterableRestartWarning, match="within epoch 0 .2 batches delivered. "
                          "is not saved.*restarts the epoch"):
            mid = loader.state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert loader.state_dict() == mid  # told once per pass
        list(it)
        ended = loader.state_dict()  # epoch 0 ended
        it = iter(loader)
        next(it)
        with pytest.warns(IterableRestartWarning, match="within epoch 1"):  # the next pass: again
            loader.state_dict()
        list(it)
    assert mid["epoch"] == 0 and not mid["finished"] and mid["epoch_size"] is None
    assert mid["batches"] == 0 and mid["delivered"] == [] and mid["restarted"] == 2
    assert ended["finished"] and ended["epoch"] == 0 and ended["epoch_size"] is None
    assert not fresh["restarted"] and not ended["restarted"]
    for state, epoch in ((fresh, 0), (mid, 0), (ended, 1)):
        with Loader(dataset(), batch_size=B, num_workers=0, autotune=False) as loader:
            with warnings.catch_warnings(record=True) as told:
                warnings.simplefilter("always")
                loader.load_state_dict(state)
            restart = [w for w in told if issubclass(w.category, IterableRestartWarning)]
            assert len(restart) == (state is mid)
            if state is mid:
                assert "after 2 batches" in str(restart[0].message)
            rows = np.concatenate([b.numpy() for b in loader])
            assert loader.epoch == epoch
            ids = rows[:, 0] if rows.ndim == 2 else rows
            assert sorted(ids.tolist()) == list(range(N))  # the whole epoch, once each
    with Loader(dataset(), batch_size=B, num_workers=0, autotune=False) as loader:
        with pytest.raises(TypeError, match="dataset .* is iterable"):
            loader.load_state_dict({**ended, "finished": False, "epoch_size": N})


class UnevenShards(torch.utils.data.IterableDataset):
    """``n`` = 10 samples in 2 shards of 5: with batch 4, 2 + 2 batches, though len() says 3."""

    n = 10

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        return (np.array([i, -1.0]) for i in range(w, self.n, k))


class EvenShards(UnevenShards):
    """8 samples in 2 shards of 4: with batch 4, exactly len() = 2 batches."""

    n = 8


@pytest.mark.parametrize("kind", ["thread", "process"])
@pytest.mark.parametrize("in_order", [False, True])
def test_a_sized_iterables_state_after_its_last_batch_is_the_epochs_end_with_workers(kind, in_order):
    """Lightning's end-of-epoch checkpoint comes right after the len()-th batch, before the
    workers may have said their shards ended: still the ended epoch, no restart warning."""
    for _ in range(3):
        with Loader(EvenShards(), batch_size=4, num_workers=2, worker_kind=kind,
                    in_order=in_order, autotune=False) as loader:
            it = iter(loader)
            for _ in range(len(loader)):
                next(it)
            with warnings.catch_warnings():
                warnings.simplefilter("error", IterableRestartWarning)
                state = loader.state_dict()
            assert state["finished"] and not state["restarted"]


def test_a_sized_iterables_state_after_len_batches_with_more_to_come_restarts_it():
    """Shards of uneven lengths make more batches than len(): after len() batches the epoch is
    not over, so its state is a restart's (not an ended epoch's, which lost sample 9)."""
    with Loader(UnevenShards(), batch_size=4, num_workers=2, in_order=True,
                autotune=False) as loader:
        it = iter(loader)
        for _ in range(len(loader)):
            next(it)
        with pytest.warns(IterableRestartWarning):
            state = loader.state_dict()
        assert len(list(it)) == 1  # the batch len() did not count
    assert not state["finished"] and state["restarted"] == 3


def test_a_sized_iterables_state_after_len_batches_is_its_epochs_end():
    """Lightning stops an epoch after len(loader) batches, without the next() that would end
    it: the state there is the ended epoch's, with no restart warning."""
    with Loader(IterableWithLength(), batch_size=B, num_workers=0, autotune=False) as loader:
        it = iter(loader)
        for _ in range(len(loader)):
            next(it)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            state = loader.state_dict()
    assert state["finished"] and state["epoch"] == 0 and not state["restarted"]


CHILD = """
import pickle, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_resume import make
state = pickle.load(open({state!r}, "rb"))
with make(seed=None, num_workers=2, worker_kind="process", in_order={in_order}) as loader:
    loader.load_state_dict(state)
    np.save({out!r}, np.concatenate([b.numpy() for b in loader]))
"""


@pytest.mark.parametrize("in_order", [False, True])
def test_resume_in_a_fresh_process(tmp_path: Path, in_order: bool):
    with make(seed=None, num_workers=2, worker_kind="process", in_order=in_order) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        state = loader.state_dict()
        seed = loader.seed
    (tmp_path / "state.pkl").write_bytes(pickle.dumps(state))
    out = tmp_path / "rest.npy"
    code = CHILD.format(tests=str(Path(__file__).parent), state=str(tmp_path / "state.pkl"),
                        out=str(out), in_order=in_order)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    rest = torch.from_numpy(np.load(out))
    want = rows(reference(seed=seed, in_order=in_order))
    assert {**rows(first), **rows([rest])} == want
    if in_order:
        assert torch.equal(torch.cat(first + [rest]), torch.cat(reference(seed=seed, in_order=True)))


def test_lightning_checkpoint_resumes_the_loader_mid_epoch(tmp_path: Path):
    """Lightning saves ``state_dict()`` of a stateful train loader in its checkpoint and
    loads it when ``fit(ckpt_path=...)`` restarts mid-epoch."""
    pl = pytest.importorskip("lightning.pytorch")
    # Closed at the end: a fit stopped by max_steps leaves its loader running, and its threads
    # would keep every later Loader of the process from forking its workers until collected.
    made: list[Loader] = []

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[torch.Tensor] = []

        def train_dataloader(self) -> Loader:
            made.append(make())
            return made[-1]

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen.append(batch.clone())
            return self.layer(batch[:, 1:].float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def trainer(**kw):
        return pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, **kw)

    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    first, second = Recorder(), Recorder()
    try:
        trainer(max_steps=3, callbacks=[ckpt]).fit(first)
        saved = torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)
        (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        assert state["batches"] == 3 and not state["finished"]
        trainer(enable_checkpointing=False).fit(second,
                                                ckpt_path=tmp_path / "epoch=0-step=3.ckpt")
    finally:
        for loader in made:
            loader.close()
    assert len(first.seen) == 3 and len(second.seen) == BATCHES - 3
    with make() as loader:  # the epoch the checkpoint interrupted, uninterrupted
        loader.set_epoch(state["epoch"])
        want = rows(loader)
    assert {**rows(first.seen), **rows(second.seen)} == want


def test_resume_with_a_distributed_sampler_cuts_the_rest_from_the_same_epoch():
    # From a new user's trial: the sampler's epoch was not restored, so the rest of epoch 1
    # came from epoch 0's permutation (samples repeated and lost).
    from torch.utils.data import DistributedSampler

    ds = list(range(30))

    def make():
        s = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=5)
        return Loader(ds, 3, sampler=s, num_workers=0, in_order=True, autotune=False)

    with make() as L:
        L.set_epoch(1)
        full = [b.tolist() for b in L]
    with make() as L:
        L.set_epoch(1)
        it = iter(L)
        part = [next(it).tolist() for _ in range(2)]
        state = L.state_dict()
    with make() as L:
        L.load_state_dict(state)
        rest = [b.tolist() for b in L]
    assert part + rest == full


class Drawn:
    """Sample i is ``(i, a draw of the sample's generator)``."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> int:
        return i


def _draw(i: int, rng: np.random.Generator) -> tuple[int, int]:
    return i, int(rng.integers(1 << 30))


def _sharded(workers: int):
    from torch.utils.data import DistributedSampler

    s = DistributedSampler(Drawn(), num_replicas=2, rank=1, shuffle=True)
    return s, Loader(Drawn(), 3, sampler=s, transform=_draw, seed=7, num_workers=workers,
                     autotune=False)


def _pairs(batches) -> list[tuple[int, int]]:
    return sorted((int(i), int(d)) for b in batches for i, d in zip(*b, strict=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_epoch_the_loop_sets_itself_is_resumed(workers):
    # From a new user's trial (20): a job restarted at epoch 3 runs
    # ``for epoch in range(3, n): sampler.set_epoch(epoch)``; the state held the Loader's
    # epoch (its pass count, 0) and load_state_dict set the sampler to it, so the rest of the
    # epoch came from epoch 0's order: "the sampler gave another order", no resume.
    s, L = _sharded(workers)
    with L:
        s.set_epoch(3)
        want = _pairs(L)  # the uninterrupted pass
    for again in (False, True):
        s, L = _sharded(workers)
        with L:
            s.set_epoch(3)
            it = iter(L)
            part = [next(it) for _ in range(2)]
            state = L.state_dict()
            del it
        assert state["sampler_epochs"] == {"sampler": 3}
        s, L = _sharded(workers)
        with L:
            L.load_state_dict(state)
            assert s.epoch == 3
            if again:
                s.set_epoch(3)  # the restarted loop sets it again
            rest = list(L)
        assert _pairs(part + rest) == want


@pytest.mark.parametrize("workers", [0, 2])
def test_passes_between_a_loops_set_epoch_calls_are_epochs_of_their_own(workers):
    # Review 68 of a first fix that took the sampler's epoch as the Loader's: a second pass
    # in the same sampler epoch (an evaluation pass over the training loader) drew the same
    # augmentation as the next epoch. Each pass draws anew, as the DataLoader's workers do.
    s, L = _sharded(workers)
    with L:
        draws = []
        for e in range(2):
            s.set_epoch(e)
            for _ in range(2):
                draws.append({d for _, d in _pairs(L)})
        assert L.epoch == 3
    assert all(not (x & y) for i, x in enumerate(draws) for y in draws[i + 1:])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_epoch_the_loop_never_sets_is_resumed(workers):
    # Review 68: the loop never sets its DistributedSampler's epoch (0 throughout, the same
    # order every pass, as with the DataLoader) while the Loader's passes count 0, 1, 2: a
    # checkpoint in pass 2 set the sampler to epoch 2 at the resume, another order.
    s, L = _sharded(workers)
    with L:
        list(L), list(L)
        it = iter(L)
        part = [next(it) for _ in range(2)]
        state = L.state_dict()
        rest_here = list(it)
    s, L = _sharded(workers)
    with L:
        L.load_state_dict(state)
        rest = list(L)
        assert s.epoch == 0 and L.epoch == 2
        share = sorted(s)
    assert _pairs(rest) == _pairs(rest_here)
    assert sorted(i for i, _ in _pairs(part + rest)) == share  # each index of the share once


def test_an_ended_epochs_state_gives_the_samplers_the_next_epoch_and_a_mid_epoch_its_own():
    # Review 69: (a) restoring an ended epoch's sampler epochs ran the next epoch in the old
    # epoch's order under Lightning, which calls iter() before it sets the sampler's epoch;
    # (b) a loop that calls Loader.set_epoch and sampler.set_epoch with other numbers (a job
    # restarted at sampler epoch 3) must get the sampler's back for a mid-epoch resume.
    from torch.utils.data import DistributedSampler

    ds = list(range(16))

    def mk():
        s = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True)
        return s, Loader(ds, 2, sampler=s, num_workers=0, autotune=False)

    def share(e):
        s = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True)
        s.set_epoch(e)
        return sorted(s)

    s, L = mk()
    with L:
        s.set_epoch(0)
        list(L)
        state = L.state_dict()
    s, L = mk()
    with L:
        L.load_state_dict(state)
        it = iter(L)  # Lightning's order: iter(), then the sampler's set_epoch
        s.set_epoch(1)
        assert sorted(int(i) for b in it for i in b) == share(1) != share(0)
    s, L = mk()
    with L:
        L.set_epoch(0)
        s.set_epoch(3)
        it = iter(L)
        part = [int(i) for i in next(it)]
        state = L.state_dict()
        del it
    s, L = mk()
    with L:
        L.set_epoch(0)
        s.set_epoch(3)
        L.load_state_dict(state)
        assert s.epoch == 3
        assert sorted(part + [int(i) for b in L for i in b]) == share(3)


@pytest.mark.parametrize("set_epoch", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_after_the_last_batch_resumes_at_the_next_epoch(workers, set_epoch):
    # The training loop saves after its step on the epoch's last batch, before the next()
    # that would end the epoch (Lightning's checkpoint at a step that ends an epoch): every
    # position is delivered, so the epoch ended. With set_epoch too: Lightning creates a
    # resumed fit's first iterator before it calls set_epoch.
    with make(num_workers=workers) as loader:
        if set_epoch:
            loader.set_epoch(0)
        it = iter(loader)
        first = [next(it) for _ in range(BATCHES)]
        state = loader.state_dict()
        want = []
        for e in (1, 2):  # the uninterrupted run's next epochs
            if set_epoch:
                loader.set_epoch(e)
            want.append(rows(loader))
    assert len(rows(first)) == N and state["finished"]
    with make(num_workers=workers) as loader:
        loader.load_state_dict(state)
        got = [rows(loader)]  # epoch 1, not epoch 0 again (nor an empty pass)
        assert loader.epoch == 1
        if set_epoch:
            loader.set_epoch(2)
        got.append(rows(loader))
        assert got == want and loader.epoch == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_that_delivers_no_batch_keeps_the_resume_for_the_next(workers):
    # iter() once to check the loader (Lightning's habit), dropped at once: no batch was
    # delivered, so the next pass still resumes the epoch (it restarted it from its start,
    # delivering again the samples delivered before the checkpoint).
    with make(num_workers=workers) as loader:
        it = iter(loader)
        first = rows([next(it) for _ in range(3)])
        state = loader.state_dict()
    with make(num_workers=workers) as loader:
        loader.load_state_dict(state)
        iter(loader)  # dropped
        rest = rows(loader)
        assert loader.epoch == 0
    assert not first.keys() & rest.keys() and {**first, **rest} == rows(reference())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_lost_to_a_collate_error_is_not_loaded_again_after_a_resume(workers):
    """As the DataLoader's lost batch: a checkpoint taken after its error counts its samples
    as gone (resumed, they raised the error again; after the last batch a loop that does not
    catch errors then crashed on resume)."""
    def take(it, n):
        seq = []
        for _ in range(n):
            try:
                seq.append(next(it)[:, 0].tolist())
            except RuntimeError:
                seq.append("error")
        return seq

    from test_parity import OddShapeAt  # (pytest puts the tests' folder on sys.path)

    kw = dict(batch_size=3, num_workers=workers, in_order=True, autotune=False, seed=0,
              prefetch_next_epoch=False)
    with Loader(OddShapeAt(12, 4), **kw) as L:
        it = iter(L)
        seq = take(it, 2)  # the first batch, then the error
        state = json.loads(json.dumps(L.state_dict()))
        assert take(it, 2) == [[6, 7, 8], [9, 10, 11]]
        # After the epoch's last batch, before StopIteration: the epoch is over.
        assert L.state_dict()["finished"] is True
        del it
    with Loader(OddShapeAt(12, 4), **kw) as L:
        L.load_state_dict(state)
        rest = [b[:, 0].tolist() for b in L]
    assert seq + rest == [[0, 1, 2], "error", [6, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize("workers, in_order", [(0, True), (2, True), (2, False)])
def test_a_samples_error_loses_its_samples_for_a_resume_too(workers, in_order):
    """What an error lost (in order its whole batch, as the DataLoader's; in completion order
    the sample) is not loaded again by a resume from a checkpoint taken after it: resumed,
    the failing sample raised again."""
    from test_parity import FailsAt

    kw = dict(batch_size=3, num_workers=workers, in_order=in_order, autotune=False, seed=0,
              prefetch_next_epoch=False)
    got = []
    with Loader(FailsAt(12, 4), **kw) as L:
        it = iter(L)
        while True:
            try:
                got += next(it)[:, 0].tolist()
            except ValueError:
                break
        state = json.loads(json.dumps(L.state_dict()))
        del it
    with Loader(FailsAt(12, 4), **kw) as L:
        L.load_state_dict(state)
        rest = [i for b in L for i in b[:, 0].tolist()]  # no error: sample 4 is not loaded
    lost = {3, 4, 5} if in_order else {4}
    assert sorted(got + rest) == sorted(set(range(12)) - lost)
    if in_order:
        assert got + rest == [0, 1, 2, 6, 7, 8, 9, 10, 11]


class _Pickles:
    """Sample i is i; ``hold`` can be set to something that does not pickle."""

    def __init__(self, n: int) -> None:
        self.n, self.hold = n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.float32(i)


def test_a_pass_that_cannot_start_leaves_the_checkpoint_of_the_pass_before():
    """``persistent_workers=False`` sends the dataset again at each pass; a dataset that no
    longer pickles fails that pass's start. The loader stays where it was: its state is the
    interrupted epoch's, and a resume from it delivers the rest of that epoch."""
    ds = _Pickles(12)
    L = Loader(ds, batch_size=3, num_workers=1, persistent_workers=False, seed=1,
               autotune=False)
    with L:
        list(L)
        it = iter(L)
        got = [next(it), next(it)]
        before = L.state_dict()
        assert before["epoch"] == 1 and not before["finished"]
        del it
        ds.hold = threading.Lock()  # pickles with neither pickle nor cloudpickle
        with pytest.raises(Exception, match="(?i)pickle|lock"):
            iter(L)
        assert L.state_dict() == before
        ds.hold = None
        again = list(L)  # a new pass, as after any dropped iterator: the next epoch, whole
        assert L.state_dict()["epoch"] == 2
        assert sorted(float(v) for b in again for v in b) == [float(i) for i in range(12)]
    with Loader(_Pickles(12), batch_size=3, num_workers=1, seed=1, autotune=False) as M:
        M.load_state_dict(before)
        rest = list(M)
    assert sorted(float(v) for b in got + rest for v in b) == [float(i) for i in range(12)]


def test_a_state_that_replaces_the_seed_stops_a_live_iterator_with_an_error():
    """A Loader that drew its seed takes the state's, which its running workers do not hold:
    an iterator live at that moment raises instead of ending as if its epoch were complete."""
    with Loader(_Pickles(12), batch_size=3, num_workers=1, seed=9, autotune=False) as other:
        list(other)
        state = other.state_dict()
    with Loader(_Pickles(12), batch_size=3, num_workers=1, autotune=False) as L:
        list(L)
        it = iter(L)
        next(it)
        L.load_state_dict(state)
        with pytest.raises(RuntimeError, match="load_state_dict"):
            list(it)
        assert L.seed == 9
        assert sorted(float(v) for b in L for v in b) == [float(i) for i in range(12)]


def test_a_state_that_replaces_the_seed_stops_a_live_iterator_without_workers_too():
    with Loader(_Pickles(12), batch_size=3, num_workers=0, seed=9, autotune=False) as other:
        state = other.state_dict()
    with Loader(_Pickles(12), batch_size=3, num_workers=0, autotune=False) as L:
        it = iter(L)
        next(it)
        L.load_state_dict(state)
        with pytest.raises(RuntimeError, match="load_state_dict"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
        assert sorted(float(v) for b in L for v in b) == [float(i) for i in range(12)]


def test_the_next_epochs_prefetch_dropped_by_a_new_seed_is_counted_as_discarded():
    with Loader(_Pickles(12), batch_size=3, num_workers=1, seed=9, autotune=False) as other:
        state = other.state_dict()
    with Loader(_Pickles(12), batch_size=3, num_workers=1, autotune=False) as L:
        list(L)  # the next epoch's samples start while this one's tail finishes
        assert L.snapshot().speculative_discarded_total == 0
        L.load_state_dict(state)  # the drawn seed's next epoch is not the state's
        assert L.snapshot().speculative_discarded_total > 0


def test_a_state_after_the_dataset_changed_length_drops_the_older_memory_figures():
    class Resizable(_Pickles):
        def __len__(self) -> int:
            return self.n

    ds = Resizable(6)
    with Loader(ds, batch_size=3, num_workers=0, seed=1, autotune=False) as L:
        state = L.state_dict()
        state["sample_memory"] = [1000] * 6  # figures of the 6 samples measured
        L.load_state_dict(state)
        assert L.state_dict()["sample_memory"] == [1000] * 6
        ds.n = 8
        grown = L.state_dict()
    assert grown["dataset_len"] == 8 and grown["sample_memory"] is None
    with Loader(Resizable(8), batch_size=3, num_workers=0, seed=1, autotune=False) as M:
        M.load_state_dict(grown)
        assert sorted(float(v) for b in M for v in b) == [float(i) for i in range(8)]


def test_workers_rebuilt_with_a_grown_dataset_name_the_length_of_their_copy():
    class Resizable(_Pickles):
        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            if i >= self.n:
                raise IndexError(f"index {i} of {self.n}")
            return np.float32(i)

    ds = Resizable(6)
    with Loader(Resizable(8), batch_size=3, num_workers=1, seed=9, autotune=False) as other:
        state = other.state_dict()
    with Loader(ds, batch_size=3, num_workers=1, autotune=False) as L:
        list(L)
        ds.n = 8
        L.load_state_dict(state)  # another seed: the workers are started again, with 8
        assert sorted(float(v) for b in L for v in b) == [float(i) for i in range(8)]
        ds.n = 10
        with pytest.raises(IndexError) as info:
            list(L)
    if sys.version_info >= (3, 11):
        assert "the dataset has 10 samples now, the workers' copy 8" in "\n".join(
            info.value.__notes__)


def test_a_process_group_that_starts_under_a_live_pass_does_not_stop_it(monkeypatch):
    """Only a seed that load_state_dict takes stops a live pass: the shuffle seed that a
    late process group sets (len(loader) reads the ranks again) leaves it running."""
    with Loader(_Pickles(12), batch_size=3, num_workers=0, autotune=False) as L:
        it = iter(L)
        first = next(it)
        dist = torch.distributed
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        assert len(L) == 2 and L.shuffle_seed == 0  # rank 0 of 2 now
        rest = list(it)  # the pass goes on as it began
    assert sorted(float(v) for b in [first, *rest] for v in b) == [float(i) for i in range(12)]


class _Sized(_Pickles):
    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return i


def test_a_mid_epoch_state_after_the_dataset_grew_resumes_the_epoch_it_began():
    ds = _Sized(20)
    with Loader(ds, batch_size=4, shuffle=True, num_workers=0, seed=0, autotune=False) as L:
        it = iter(L)
        got = [next(it), next(it)]
        ds.n = 24  # samples added in the middle of the epoch (active learning)
        state = L.state_dict()
    assert state["dataset_len"] == 20 and state["epoch_size"] == 20
    with Loader(_Sized(20), batch_size=4, shuffle=True, num_workers=0, seed=0,
                autotune=False) as M:
        M.load_state_dict(state)
        rest = list(M)
    assert sorted(int(v) for b in got + rest for v in b) == list(range(20))


def test_a_state_between_epochs_takes_a_dataset_of_another_length():
    with Loader(_Sized(20), batch_size=4, num_workers=0, seed=0, autotune=False) as L:
        before = L.state_dict()  # not begun
        list(L)
        ended = L.state_dict()  # an ended epoch
    for state in (before, ended):
        with Loader(_Sized(10), batch_size=4, num_workers=0, seed=0, autotune=False) as M:
            M.load_state_dict(state)  # bad cases filtered out since
            assert sorted(int(v) for b in M for v in b) == list(range(10))
    mid = dict(ended, finished=False, delivered=[[0, 8]], batches=2, epoch_size=20)
    with Loader(_Sized(10), batch_size=4, num_workers=0, seed=0, autotune=False) as M:
        with pytest.raises(ValueError, match="dataset_len=20"):
            M.load_state_dict(mid)  # positions of another epoch's order: refused by name


def test_a_state_begun_with_nothing_delivered_takes_a_dataset_of_another_length():
    with Loader(_Sized(20), batch_size=4, num_workers=0, seed=0, autotune=False) as L:
        it = iter(L)  # begun (Lightning's check pass, say), nothing delivered
        state = L.state_dict()
        del it
    state["sample_memory"] = [1000] * 20  # figures of the 20 samples
    assert state["epoch_size"] == 20 and not state["delivered"]
    with Loader(_Sized(10), batch_size=4, num_workers=0, seed=0, autotune=False) as M:
        M.load_state_dict(state)
        assert sorted(int(v) for b in M for v in b) == list(range(10))
        assert M.state_dict()["sample_memory"] is None  # the 20 figures are not this dataset's


class _Stream(torch.utils.data.IterableDataset):
    """16 samples split across the workers by get_worker_info(); len() says so."""

    def __len__(self) -> int:
        return 16

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info is not None else (0, 1)
        return (np.full(2, i, np.int64) for i in range(k, 16, n))


def test_an_iterable_epoch_whose_loop_took_len_batches_is_saved_as_finished():
    """A loop bounded by ``len()`` takes every batch and drops the iterator before the end
    item: the epoch ended, so the state says finished (review 101: clearing the dropped run's
    output took its end too, and the state restarted the epoch)."""
    with Loader(_Stream(), 4, num_workers=2, autotune=False) as L:
        for _ in range(2):
            import time

            for _step, _b in zip(range(len(L)), L, strict=False):
                time.sleep(0.05)
            time.sleep(0.3)  # the dropped iterator's stop reaches the scheduler
            state = L.state_dict()
            assert state["finished"] is True, state


class _Twenty:
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return np.full(2, i, np.float32)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["sampler", "loader"])
@pytest.mark.parametrize("order", ["load_then_set", "set_then_load"])
def test_a_loop_that_resumes_the_epoch_its_last_batch_was_checkpointed_in_gets_each_once(
        workers, mode, order):
    """Trial 158: DDP's loop saved the Loader's state after an epoch's last batch, inside the
    loop, with its own epoch counter; resumed, it sets that epoch again and iterates. That
    epoch was delivered again in full (set after the load), or the next epoch twice (set
    before it). The named ended epoch now ends at once, and the next ones follow."""
    from torch.utils.data import DistributedSampler

    def make():
        ds = _Twenty()
        if mode == "sampler":
            s = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
            return Loader(ds, 4, sampler=s, num_workers=workers, autotune=False, seed=1), s
        return Loader(ds, 4, shuffle=True, num_workers=workers, autotune=False, seed=1,
                      rank=0, world_size=2), None

    def set_epoch(L, s, e):
        (s.set_epoch if s is not None else L.set_epoch)(e)

    def ids(L):
        return sorted(int(x) for b in L for x in b[:, 0])

    L, s = make()
    ref = {}
    for e in range(4):
        set_epoch(L, s, e)
        ref[e] = ids(L)
    L.close()
    L, s = make()
    set_epoch(L, s, 0)
    list(L)
    set_epoch(L, s, 1)
    it = iter(L)
    taken = sorted(int(x) for _ in range(len(L)) for x in next(it)[:, 0])
    state = L.state_dict()  # after the epoch's last batch, before the next() that ends it
    L.close()
    assert state["finished"] and taken == ref[1]
    L, s = make()
    if order == "set_then_load":
        set_epoch(L, s, 1)
    L.load_state_dict(state)
    got = {}
    for e in range(1, 4):
        if order == "load_then_set" or e > 1:
            set_epoch(L, s, e)
        got[e] = ids(L)
    L.close()
    assert got == {1: [], 2: ref[2], 3: ref[3]}


def test_an_ended_epoch_loaded_is_named_only_by_the_loop_and_survives_a_checkpoint():
    """Review 162 of the rule above: the sampler at the ended epoch E before the load, then
    moved on by the loop, gives E + 1 (not an empty E); naming E after iter(), before the
    first batch, gives E empty; a second load is no naming; a state taken right after the
    load is the loaded one (so a loop that names E after reloading it still gets E empty)."""
    from torch.utils.data import DistributedSampler

    ds = _Twenty()

    def make(sampler=False):
        if sampler:
            s = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
            return Loader(ds, 4, sampler=s, num_workers=0, autotune=False, seed=1), s
        return Loader(ds, 4, shuffle=True, num_workers=0, autotune=False, seed=1, rank=0,
                      world_size=2), None

    def ids(L):
        return sorted(int(x) for b in L for x in b[:, 0])

    def ended_at(E, sampler=False):
        L, s = make(sampler)
        for e in range(E + 1):
            (s or L).set_epoch(e)
            it = iter(L)
            for _ in range(len(L)):
                next(it)
        return L, s, L.state_dict()

    L, s = make(sampler=True)
    ref = {}
    for e in range(5):
        s.set_epoch(e)
        ref[e] = ids(L)
    L.close()
    L, s, state = ended_at(2, sampler=True)  # the sampler is at 2
    L.load_state_dict(state)
    s.set_epoch(3)  # the loop moves on
    assert ids(L) == ref[3] and L.epoch == 3
    L.close()

    L, _, st2 = ended_at(2)
    L.close()
    _, _, st3 = ended_at(3)
    L, _ = make()
    L.load_state_dict(st2)
    it = iter(L)
    L.set_epoch(2)  # after iter(), before the first batch
    assert sorted(int(x) for b in it for x in b[:, 0]) == []
    L.set_epoch(3)
    assert len(ids(L)) == 10
    L.close()

    L, _ = make()
    L.load_state_dict(st2)
    L.load_state_dict(st3)  # a second load names nothing: the next epoch is 4
    assert len(ids(L)) == 10 and L.epoch == 4
    L.close()

    L, _ = make()
    L.load_state_dict(st2)
    again = L.state_dict()
    L.close()
    assert again["finished"] and again["epoch"] == 2
    L, _ = make()
    L.load_state_dict(again)
    L.set_epoch(2)
    assert ids(L) == []
    L.close()
