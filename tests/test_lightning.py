"""Lightning as a first-class user: a Trainer fits from a Loader, the Loader follows
Lightning's epochs (its set_epoch on dataloader.sampler), and a Loader built before the
process group exists shards by rank once it does (Lightning's DDP starts the group late)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import warnings

import lightning as L
import pytest
import torch

from autominato import Loader
from autominato.pipeline.sampler import epoch_order
from autominato.resume import IterableRestartWarning


class Points:
    """Sample i is (x_i, y_i, i) of a linear target y = 3 x."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.tensor([float(i) / self.n])
        return x, 3 * x, i


class Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, int, list[int]]] = []  # (Lightning epoch, Loader epoch, indices)
        self.loaders: list[Loader] = []

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        loader = self.loaders[-1]
        self.seen.append((self.current_epoch, loader.epoch, i.tolist()))
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        loader = Loader(Points(), batch_size=4, shuffle=True, seed=11, workers=0, in_order=True,
                        autotune=False)
        self.loaders.append(loader)
        return loader


def quiet_trainer(**kw) -> L.Trainer:
    """A one-device CPU Trainer that logs, checkpoints and prints nothing (``kw`` adds to it)."""
    base = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**base, **kw})


def test_lightning_fit_of_a_few_steps_follows_lightning_epochs_even_when_reloading_loaders():
    model = Linear()
    weight = model.lin.weight.detach().clone()
    trainer = quiet_trainer(max_steps=6, reload_dataloaders_every_n_epochs=1)
    try:
        trainer.fit(model)
    finally:
        for loader in model.loaders:
            loader.close()
    assert trainer.global_step == 6 and not torch.equal(model.lin.weight, weight)
    # A new Loader each epoch (reload_dataloaders_every_n_epochs=1) still runs Lightning's
    # epoch: Lightning's set_epoch on loader.sampler reached it, so the shuffles differ.
    assert len(model.loaders) == 3
    by_epoch: dict[int, list[int]] = {}
    for lightning_epoch, loader_epoch, indices in model.seen:
        assert loader_epoch == lightning_epoch
        by_epoch.setdefault(lightning_epoch, []).extend(indices)
    assert sorted(by_epoch) == [0, 1, 2]
    for e, indices in by_epoch.items():
        assert sorted(indices) == list(range(8))  # each epoch exactly once
        assert set(indices[:4]) == set(epoch_order(8, epoch=e, seed=11, shuffle=True)[:4])
    # (the three epochs' first batches differ, so a Loader stuck at epoch 0 would fail above)
    assert len({frozenset(epoch_order(8, epoch=e, seed=11, shuffle=True)[:4]) for e in range(3)}) == 3


class SameLoader(Linear):
    """Returns one Loader at every reload, over a sampler that has no set_epoch."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.loader = Loader(Points(), batch_size=4, workers=workers, autotune=False,
                             sampler=torch.utils.data.RandomSampler(Points()))
        self.loaders.append(self.loader)

    def train_dataloader(self):
        return self.loader


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_reloaded_each_epoch_over_a_plain_sampler_counts_lightnings_epochs(workers):
    """At each reloaded epoch Lightning starts a pass it never uses before the one it runs
    (review 62): the pass it runs is its epoch, not the one after."""
    model = SameLoader(workers)
    trainer = quiet_trainer(max_epochs=4, reload_dataloaders_every_n_epochs=1)
    try:
        trainer.fit(model)
    finally:
        model.loader.close()
    pairs = sorted({(lightning, ours) for lightning, ours, _ in model.seen})
    assert pairs == [(0, 0), (1, 1), (2, 2), (3, 3)]
    for e in range(4):
        assert sorted(i for le, _, ix in model.seen if le == e for i in ix) == list(range(8))


def test_loader_sampler_set_epoch_is_the_loaders():
    with Loader(Points(), batch_size=4, shuffle=True, seed=5, workers=0, autotune=False) as loader:
        loader.sampler.set_epoch(4)
        assert loader.epoch == 4
        assert list(loader.sampler) == epoch_order(8, epoch=4, seed=5, shuffle=True)
        assert len(loader.sampler) == 8
        got = sorted(i for batch in loader for i in batch[2].tolist())
        assert got == list(range(8)) and loader.epoch == 4  # the pass used the epoch set


def _rank_main(rank: int, store: str, out: str) -> None:
    loader = Loader(Points(10), batch_size=2, shuffle=True, workers=0, autotune=False)
    before = loader.world_size
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        n = len(loader)
        indices = [i for batch in loader for i in batch[2].tolist()]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"before": before, "rank": loader.rank, "world": loader.world_size,
                       "len": n, "indices": indices}, f)
    finally:
        loader.close()
        torch.distributed.destroy_process_group()


def test_a_loader_built_before_the_process_group_shards_by_rank_once_it_exists(tmp_path):
    """What Lightning's DDP does: the script builds the Loader, Trainer.fit then initialises
    the process group. Each rank must take its own disjoint share (seed not given: one
    permutation on every rank, DistributedSampler's seed 0)."""
    torch.multiprocessing.start_processes(
        _rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["before"] for r in runs] == [1, 1]
    assert [(r["rank"], r["world"], r["len"]) for r in runs] == [(0, 2, 3), (1, 2, 3)]
    a, b = (set(r["indices"]) for r in runs)
    assert len(a) == len(b) == 5 and not a & b and a | b == set(range(10))


def test_a_pass_that_delivers_no_batch_is_not_an_epoch():
    """Lightning calls iter() once to check a loader before epoch 0's pass (as RandomSampler
    draws its permutation only at the first batch, such a pass draws nothing)."""
    with Loader(Points(), batch_size=4, shuffle=True, seed=2, workers=0, in_order=True,
                autotune=False) as loader:
        iter(loader)  # dropped at once
        first = [i for batch in loader for i in batch[2].tolist()]
        second = [i for batch in loader for i in batch[2].tolist()]
        assert loader.epoch == 1
    assert first == epoch_order(8, epoch=0, seed=2, shuffle=True)
    assert second == epoch_order(8, epoch=1, seed=2, shuffle=True)


class Stream(torch.utils.data.IterableDataset):
    """The samples of :class:`Points` as a stream (no length)."""

    def __iter__(self):
        return iter(Points()[i][:2] for i in range(8))


class StreamLinear(Linear):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def train_dataloader(self):
        return Loader(Stream(), batch_size=4, workers=0, autotune=False)


def test_a_fit_over_an_iterable_dataset_saves_its_end_of_epoch_checkpoints(tmp_path):
    """Lightning saves every stateful loader's state_dict() in its checkpoints (ModelCheckpoint
    at each epoch's end by default): an iterable dataset's state between epochs is taken."""
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                        default_root_dir=tmp_path, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(StreamLinear())
    (ckpt,) = (tmp_path / "checkpoints").iterdir()
    (state,) = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"][
        "combined_loader"]
    assert state["finished"] and state["epoch"] == 1


def test_a_fit_resumed_from_a_checkpoint_at_an_epochs_last_step_runs_the_next_epochs(tmp_path):
    """A checkpoint every 2 steps with 2 batches an epoch falls on each epoch's last step
    (before the loader's StopIteration). Resumed from the step-2 one, the fit runs epochs 1
    and 2, each whole and in its own shuffle (it ran epoch 1 with no batch: the Loader resumed
    epoch 0, every sample of which had been delivered)."""
    by_epoch = _resumed_at_step_2(Linear, tmp_path)
    assert by_epoch == {e: epoch_order(8, epoch=e, seed=11, shuffle=True) for e in (1, 2)}


def _resumed_at_step_2(make, tmp_path, **trainer_kw) -> dict[int, list[int]]:
    """Fit ``make()`` for one epoch with a checkpoint every 2 steps, then a new ``make()``
    for 3 epochs from the step-2 checkpoint; the indices the resumed fit trained on, by
    Lightning's epoch (each batch's Loader epoch checked to be Lightning's)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                         default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False, **trainer_kw,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2,
                                                    save_top_k=-1)])

    first = make()
    trainer(1).fit(first)
    resumed = make()
    trainer(3).fit(resumed, ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    for model in (first, resumed):
        for loader in model.loaders:
            loader.close()
    by_epoch: dict[int, list[int]] = {}
    for lightning_epoch, loader_epoch, indices in resumed.seen:
        assert loader_epoch == lightning_epoch
        by_epoch.setdefault(lightning_epoch, []).extend(indices)
    return by_epoch


class Cut(Linear):
    """16 samples, 4 batches an epoch, of which limit_train_batches keeps 2; shuffled by the
    Loader, or by a DistributedSampler of the user's (whose set_epoch Lightning calls)."""

    def __init__(self, workers: int, sampler: bool = False) -> None:
        super().__init__()
        self.workers, self.sampler = workers, sampler

    def train_dataloader(self):
        kw = (dict(sampler=torch.utils.data.DistributedSampler(
            Points(16), num_replicas=1, rank=0, shuffle=True, seed=11))
              if self.sampler else dict(shuffle=True, seed=11))
        loader = Loader(Points(16), batch_size=4, workers=self.workers, in_order=True,
                        autotune=False, **kw)
        self.loaders.append(loader)
        return loader


def _cut_order(epoch: int, sampler: bool, n: int = 16) -> list[int]:
    """Epoch ``epoch``'s order of ``n`` samples: the Loader's shuffle (seed 11), or a
    ``DistributedSampler``'s (``sampler``)."""
    if not sampler:
        return epoch_order(n, epoch=epoch, seed=11, shuffle=True)
    s = torch.utils.data.DistributedSampler(Points(n), num_replicas=1, rank=0, shuffle=True,
                                            seed=11)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("workers, sampler", [(0, False), (1, False), (1, True)])
def test_a_fit_resumed_after_an_epoch_that_limit_train_batches_cut_runs_the_next_epochs(
        tmp_path, workers, sampler):
    """The checkpoint at the cut epoch's last step holds that epoch unfinished (the Loader
    does not know Lightning's limit); the resumed fit makes its first iterator, then calls
    set_epoch(1): epoch 1 runs from its beginning, not epoch 0's leftovers (trial 147: 4
    batches of them, where the DataLoader's sampler, read at the first next(), gives epoch
    1); also where Lightning sets the epoch on the user's DistributedSampler (review 150)."""
    by_epoch = _resumed_at_step_2(lambda: Cut(workers, sampler), tmp_path,
                                  limit_train_batches=2)
    assert by_epoch == {e: _cut_order(e, sampler)[:8] for e in (1, 2)}


class Kept(Cut):
    """8 samples, 2 batches an epoch, one Loader for every fit of the module."""

    def __init__(self, workers: int, sampler: bool = False) -> None:
        super().__init__(workers, sampler)
        kw = (dict(sampler=torch.utils.data.DistributedSampler(
            Points(), num_replicas=1, rank=0, shuffle=True, seed=11))
              if sampler else dict(shuffle=True, seed=11))
        self.loader = Loader(Points(), batch_size=4, workers=workers, in_order=True,
                             autotune=False, **kw)
        self.loaders.append(self.loader)

    def train_dataloader(self):
        return self.loader


@pytest.mark.parametrize("workers, sampler", [(0, False), (1, False), (1, True)])
def test_a_fit_from_an_end_of_epoch_checkpoint_and_a_second_fit_run_lightnings_epochs(
        tmp_path, workers, sampler):
    """Lightning restores no loader state from an end-of-epoch checkpoint and makes a fit's
    first iterator before it calls ``set_epoch``: the resumed fit's first epoch (2) ran as the
    new Loader's epoch 0, and a second fit on the same module (a new Trainer: epoch 0) as the
    epoch the Loader ran last, order and augmentation (trial 151). Each now runs Lightning's
    epoch, as the Loader's and as the user's ``DistributedSampler``'s."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                         default_root_dir=tmp_path, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)])

    first, resumed = Kept(workers, sampler), Kept(workers, sampler)
    try:
        trainer(2).fit(first)
        trainer(4).fit(resumed, ckpt_path=tmp_path / "epoch=1-step=4.ckpt")
        first.seen.clear()
        trainer(1).fit(first)  # a second fit on the same Loader
    finally:
        first.loader.close()
        resumed.loader.close()

    def by_epoch(seen) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for lightning_epoch, loader_epoch, indices in seen:
            assert sampler or loader_epoch == lightning_epoch
            out.setdefault(lightning_epoch, []).extend(indices)
        return out

    assert by_epoch(resumed.seen) == {e: _cut_order(e, sampler, 8) for e in (2, 3)}
    assert by_epoch(first.seen) == {0: _cut_order(0, sampler, 8)}


class Stream16(torch.utils.data.IterableDataset):
    """16 samples (x, 3 x, i) of a stream: an iterable dataset has no positions to resume."""

    def __iter__(self):
        for i in range(16):
            x = torch.tensor([i / 16.0])
            yield x, 3 * x, i


class StreamModel(Linear):
    def training_step(self, batch, batch_idx):
        x, y, i = batch
        self.seen.append((self.current_epoch, -1, i.tolist()))
        return torch.nn.functional.mse_loss(self.lin(x), y)


def _fit_stream(make_loader, tmp_path, ckpt_path=None):
    model = StreamModel()
    callbacks = [] if ckpt_path else [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)]
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=not ckpt_path, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = make_loader()
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    finally:
        getattr(loader, "close", lambda: None)()
    return trainer, model


def test_lightning_checkpoints_mid_epoch_with_an_iterable_dataset_and_resumes_as_with_dataloader(tmp_path):
    """Lightning saves a stateful loader's state at every checkpoint: with an iterable dataset
    the Loader's mid-epoch state restarts the epoch, as DataLoader's (no state) does, and says
    so when it is saved and when it is loaded."""
    runs = {}
    for name, make in (("dataloader", lambda: torch.utils.data.DataLoader(Stream16(), batch_size=2)),
                       ("autominato", lambda: Loader(Stream16(), batch_size=2, num_workers=0,
                                                     autotune=False))):
        folder = tmp_path / name
        with warnings.catch_warnings(record=True) as saved:
            warnings.simplefilter("always")
            trainer, _ = _fit_stream(make, folder)
        assert trainer.global_step == 16
        ckpt = folder / "epoch=0-step=3.ckpt"
        assert ckpt.exists(), sorted(p.name for p in folder.iterdir())
        with warnings.catch_warnings(record=True) as loaded:
            warnings.simplefilter("always")
            resumed, model = _fit_stream(make, folder, ckpt_path=str(ckpt))
        told = [str(w.message) for w in saved + loaded if w.category is IterableRestartWarning]
        runs[name] = (resumed.global_step, [i for _, _, b in model.seen for i in b], told)
    assert runs["dataloader"][2] == []
    told = runs["autominato"][2]
    assert any("state_dict(): the dataset (Stream16) is iterable" in t for t in told)
    # (after 3 steps Lightning had fetched 4 batches: it prefetches one)
    assert any(re.search(r"load_state_dict\(\): the state was taken in the middle of epoch 0 of an "
                         r"iterable dataset, after [34] batches", t) for t in told)
    assert runs["autominato"][0] == runs["dataloader"][0]
    steps, seen, _ = runs["autominato"]
    # epoch 0 again from its first sample, then epoch 1: each sample once per epoch
    assert sorted(seen[:16]) == list(range(16)) and sorted(seen[16:]) == list(range(16))
    assert seen[:2] == runs["dataloader"][1][:2] == [0, 1]


class SizedStream16(Stream16):
    def __len__(self) -> int:
        return 16


def test_a_sized_iterables_end_of_epoch_checkpoints_are_ended_epochs(tmp_path):
    """Lightning ends an epoch after len(loader) batches, without the next() that would end the
    pass: its end-of-epoch checkpoints hold the ended epoch, no restart."""
    model = StreamModel()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                        default_root_dir=tmp_path, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = Loader(SizedStream16(), batch_size=2, num_workers=0, autotune=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", IterableRestartWarning)
            trainer.fit(model, loader)
    finally:
        loader.close()
    (ckpt,) = (tmp_path / "checkpoints").iterdir()
    (state,) = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"][
        "combined_loader"]
    assert state["finished"] and state["epoch"] == 1 and not state["restarted"]


def test_seed_everything_with_workers_sets_its_worker_init_fn_and_the_fit_runs(monkeypatch):
    """Lightning's seed_everything(workers=True) sets dataloader.worker_init_fn after the
    loader is built (PL_SEED_WORKERS): accepted, not run (the Loader seeds its workers)."""
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    L.seed_everything(0, workers=True)
    model = Linear()
    loader = Loader(Points(), batch_size=4, num_workers=1, autotune=False)
    model.loaders.append(loader)
    trainer = quiet_trainer(max_epochs=1)
    try:
        trainer.fit(model, loader)
    finally:
        loader.close()
        monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    assert trainer.global_step == 2 and loader.worker_init_fn is not None
    assert sorted(i for _, _, ix in model.seen for i in ix) == list(range(8))


class LockedPoints(Points):
    """Points that cannot be pickled (they hold a lock): the workers must fork."""

    def __init__(self, n: int = 8) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


class TwoLoaders(Linear):
    """Fits from a training Loader and validates on another (both with worker processes and
    the controller's thread; the training one over a dataset that only a fork gives the
    workers)."""

    def __init__(self) -> None:
        super().__init__()
        # (start_method="fork": in a suite run a thread another test left running made the
        # default start pickle this dataset, which it cannot, twice in sessions 48-49)
        self.train_loader = Loader(LockedPoints(), batch_size=4, shuffle=True, seed=3,
                                   num_workers=2, start_method="fork")
        # (built while the first one's threads run: its workers start from a new
        # interpreter, which gets its dataset pickled)
        self.val_loader = Loader(Points(), batch_size=4, num_workers=1)
        self.loaders.append(self.train_loader)
        self.workers: set[int] = set()  # every worker seen while a batch was stepped

    def train_dataloader(self):
        return self.train_loader

    def val_dataloader(self):
        return self.val_loader

    def training_step(self, batch, batch_idx):
        self.workers.update(self.train_loader.worker_pids())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.workers.update(self.val_loader.worker_pids())


def _memory_segments() -> set[str]:
    """This process's shared-memory segments that hold memory (not the pools' lock files)."""
    from autominato.pipeline.shm import LOCK_SUFFIX, leftover_segments

    return {s for s in leftover_segments(os.getpid()) if not s.endswith(LOCK_SUFFIX)}


def test_the_workers_stop_when_lightning_ends_a_fit_and_fork_again_for_the_next():
    """Lightning shuts down a DataLoader's persistent workers when a fit or a validation ends
    (it resets ``_iterator`` of each loader that has one); the Loader's workers and shared
    memory go then too, not when the trainer and the module are deleted (trial 145: 6
    processes left after a fit). The same Loaders fit and validate again, their workers
    forked from the fork server kept (a dataset that does not pickle: review 148)."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # (another test's, if any)

    def ours() -> list[psutil.Process]:
        return [p for p in me.children(recursive=True) if p.pid not in before]

    def settled(workers: set[int]) -> None:
        """The workers ``workers`` have exited when the Lightning call returns (the park
        joins them, as the DataLoader's shutdown: trial 151 saw them exit 10-300 ms later);
        what is left of ours is the two Loaders' idle fork servers (the second one's forked
        from the first's), and no shared memory."""
        assert not [w for w in workers if psutil.pid_exists(w)]
        left = ours()
        assert not {p.pid for p in left} & workers
        assert len(left) <= 2, left
        assert _memory_segments() == set()

    model = TwoLoaders()
    train, val = model.train_loader, model.val_loader
    try:
        trainer = quiet_trainer(max_epochs=2)
        trainer.fit(model)
        assert trainer.global_step == 4 and len(model.workers) == 3
        settled(model.workers)
        assert train.worker_pids() == [] and val.worker_pids() == []
        for _, _, ix in model.seen:
            assert len(ix) == 4
        assert sorted(i for _, _, ix in model.seen for i in ix) == sorted(list(range(8)) * 2)
        quiet_trainer().validate(model, verbose=False)
        settled(model.workers)
        model.seen.clear()
        quiet_trainer(max_epochs=1).fit(model)  # the same Loaders fork new workers
        assert sorted(i for _, _, ix in model.seen for i in ix) == list(range(8))
        assert len(model.workers) >= 6
        settled(model.workers)
    finally:
        train.close()
        val.close()
    assert ours() == []


class Shifted(Points):
    """Points whose ``i`` is offset by ``off``: a dataset the training script changes."""

    off = 0

    def __getitem__(self, i: int):
        x, y, j = super().__getitem__(i)
        return x, y, j + self.off


class Stuck(Points):
    hang = True

    def __getitem__(self, i: int):
        if i == 5 and self.hang:
            time.sleep(60)
        return super().__getitem__(i)


@pytest.mark.parametrize("worker_kind", ["process", "thread"])
def test_workers_started_again_after_a_stop_see_the_dataset_as_it_is_now(worker_kind):
    """Changes made to the dataset between two fits (an active-learning loop grows it, a
    curriculum moves on) are seen by the workers the next pass starts, as by the DataLoader's
    new ones (review 149: the fork server's copy from the Loader's construction was used)."""
    ds = Shifted(8)
    with Loader(ds, batch_size=4, num_workers=2, worker_kind=worker_kind) as loader:
        assert sorted(int(i) for _, _, b in loader for i in b) == list(range(8))
        loader._iterator = None
        ds.off, ds.n = 100, 12  # (shifted, and grown)
        assert sorted(int(i) for _, _, b in loader for i in b) == list(range(100, 112))


def test_a_worker_busy_when_the_workers_stop_is_killed_after_a_grace(monkeypatch):
    """A sample that hangs (no sample_timeout) kept its worker after a fit for as long
    as it hung (review 149); like the DataLoader's shutdown, the Loader waits a grace, then
    kills it, with no death reported, and the next pass runs whole."""
    import psutil

    monkeypatch.setattr("autominato.pipeline.scheduler.PARK_GRACE_S", 0.5)
    ds = Stuck(8)
    with Loader(ds, batch_size=2, num_workers=2, autotune=False, in_order=False) as loader:
        it = iter(loader)
        next(it)
        time.sleep(0.3)  # (sample 5 is under way)
        busy = set(loader.worker_pids())
        loader._iterator = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status()
                                                  != psutil.STATUS_ZOMBIE for p in busy):
            time.sleep(0.05)
        assert not [p for p in busy if psutil.pid_exists(p)
                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert loader.snapshot().worker_restarts_total == 0
        ds.hang = False  # (the next pass's workers get the dataset as it is now)
        assert sorted(int(i) for _, _, b in loader for i in b) == list(range(8))


class SlowPoints(Points):
    def __getitem__(self, i: int):
        time.sleep(0.05)
        return super().__getitem__(i)


def test_a_pass_live_when_the_workers_stop_gets_the_batches_made_then_raises():
    loader = Loader(SlowPoints(64), batch_size=4, num_workers=2, autotune=False)
    try:
        it = iter(loader)
        first = next(it)
        loader._iterator = None
        got = [first]
        with pytest.raises(RuntimeError, match="workers were shut down") as raised:
            for batch in it:
                got.append(batch)
        assert len(got) < 16 and raised.value.__traceback__ is not None
        indices = [int(i) for _, _, b in got for i in b]
        assert len(set(indices)) == len(indices)  # nothing delivered twice
        assert sorted(int(i) for _, _, b in loader for i in b) == list(range(64))
        with pytest.raises(ValueError, match="only be set to None"):
            loader._iterator = object()
        del loader._iterator  # (the DataLoader's other idiom) between passes
        assert sorted(int(i) for _, _, b in loader for i in b) == list(range(64))
    finally:
        loader.close()


def test_a_large_in_memory_dataset_is_not_pickled_to_the_workers_after_a_stop(monkeypatch, caplog):
    """The first pass after a stop sends the dataset as it is now only when it pickles small
    (a list of files): a dataset of arrays stays the fork server's copy, shared with the
    workers, rather than a copy in each at every fit; the log says changes are not seen."""
    monkeypatch.setattr("autominato.pipeline.scheduler.PARK_RESEND_MAX_BYTES", 4096)
    ds = Shifted(8)
    ds.ballast = torch.zeros(4096)  # (16 KiB of pickle)
    caplog.set_level("INFO", logger="autominato")
    with Loader(ds, batch_size=4, num_workers=1, autotune=False) as loader:
        assert sorted(int(i) for _, _, b in loader for i in b) == list(range(8))
        loader._iterator = None
        ds.off = 100
        assert sorted(int(i) for _, _, b in loader for i in b) == list(range(8))
    assert any("changes made to it since are not seen" in r.getMessage() for r in caplog.records)
