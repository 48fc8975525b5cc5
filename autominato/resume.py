"""The Loader's resumable state: what a mid-epoch checkpoint holds and how it is checked.

``Loader.state_dict()`` / ``Loader.load_state_dict(sd)`` (the names of torchdata's
``StatefulDataLoader``) save and restore the *most recent* iterator's progress: its epoch, the
positions of the epoch's order it delivered to the training loop, the seeds, the shape of the
epoch (rank, world size, batch size, ``drop_last``) and the live knobs. Positions, not dataset
indices, are the unit (a sampler may repeat an index); they are stored as sorted half-open
ranges ``[[start, stop], ...]``, a few numbers for an in-order checkpoint and few more in
completion order, where the delivered positions are a prefix with holes (the samples in flight,
and the fast ones slow first put off: at most about two lookaheads, ``costs.py``).

Samples in flight at the checkpoint (dispatched, not yet delivered) are simply done again after
the resume; their augmentation is the same, being seeded by ``(seed, epoch, index)``.

The state holds plain Python types (and whatever a stateful sampler's ``state_dict`` returns),
so ``torch.save`` / ``pickle`` / ``json`` store it beside the model's.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

#: Version of the state's layout; a state of another version is refused.
VERSION = 1

#: The epoch's shape: a state saved with other values cannot name the same positions.
_SHAPE = ("batch_size", "world_size", "dataset_len", "shuffle", "drop_last")


class Progress:
    """What one iterator delivered to the training loop in its epoch.

    Args:
        epoch: the epoch the iterator runs.
        size: positions in the epoch's order (after ``drop_last``'s truncation); ``None`` for
            an iterable dataset's epoch, where only batches are counted.
        done: positions delivered before (a resumed epoch).
        batches: batches yielded before (a resumed epoch).
        samplers: ``state_dict()`` of the stateful samplers as the epoch started.
        order: the epoch's order when a sampler of the user's made it (``None``: the
            Loader's own order, rebuilt from the checked seeds and shape), for :attr:`digest`.
        order_rank: the rank whose share ``order`` is (the sampler's own ``rank`` when it
            has one: a ``DistributedSampler`` given its rank while the Loader has none).
        empties: a ``batch_sampler``'s empty batches (``[]``, no position to mark) that
            reached the training loop before (a resumed epoch), delivered or as their
            collate error; they come first in their epoch's order of empty batches (see
            ``Epoch.done_empty``).
        empty_total: the epoch's empty batches.
    """

    def __init__(self, epoch: int, size: int | None, done: Iterable[int] = (), batches: int = 0,
                 samplers: dict | None = None, order: Sequence[int] | None = None,
                 order_rank: int = 0, empties: int = 0, empty_total: int = 0) -> None:
        self._order = order
        self._digest: str | None = None
        self.order_rank = order_rank
        self.epoch = epoch
        self.size = size
        self.delivered = None if size is None else np.zeros(size, dtype=bool)
        if self.delivered is not None:
            self.delivered[np.fromiter(done, dtype=np.int64)] = True
        # positions not delivered yet: all_delivered is read after every batch, and
        # delivered.all() made that O(epoch) a batch
        self._left = 0 if size is None else size - int(np.count_nonzero(self.delivered))
        self.batches = batches
        self.empties = empties
        self.empty_total = empty_total
        self.samplers = samplers or {}
        self.finished = False
        # An iterable's pass: whether every batch of the epoch has been delivered already
        # (set by the Loader; see build).
        self.drained: Callable[[], bool] = lambda: False
        #: the dataset's length when the pass made its order (set by the Loader; map-style)
        self.dataset_len: int | None = None
        #: :func:`sampler_epochs` as the epoch began (set by the Loader; map-style)
        self.sampler_epochs: dict[str, int] = {}
        #: what the DataLoader's sampler draws at its pass's end, done when this pass ends
        #: whole (set by the Loader; map-style): callables, and ``shuffle=True``'s
        #: permutations of ``len(dataset)`` from the Loader's ``generator``
        self.at_end: list[Callable[[], Any]] = []
        self.tail_draws = 0
        #: the DataLoader's BatchSampler reaches its sampler's end while it makes the last
        #: batch (a short one, ``drop_last=False``): those draws come with the last batch
        #: delivered, not at the ``next()`` after it (review 172: a loop of ``len(loader)``
        #: steps never asks for that one)
        self.tail_with_last = False
        #: the DistributedSampler's epoch repeats for a third pass: warned once this pass has
        #: delivered its last batch (Loader._same_order_check)
        self.same_order = False

    @property
    def digest(self) -> str | None:
        """:func:`order_digest` of the user sampler's order (computed at the first call: only
        a checkpoint needs it), else ``None``."""
        if self._digest is None and self._order is not None:
            self._digest = order_digest(self._order)
        return self._digest

    @property
    def all_delivered(self) -> bool:
        """Every position of a map-style epoch of one or more (or of one empty batch or more)
        was delivered (or lost with its batch's error), and its empty batches too: the epoch
        has ended for a checkpoint, whether or not the ``next()`` that ends it came
        (``False`` for an iterable's epoch, which counts no positions)."""
        return (self.delivered is not None and bool(self.delivered.size or self.empty_total)
                and self._left == 0 and self.empties >= self.empty_total)

    def deliver(self, positions: Iterable[int]) -> None:
        """One batch (its positions in the epoch's order) reached the training loop."""
        self._mark(positions)
        self.batches += 1

    def lose(self, positions: Iterable[int]) -> None:
        """An error reached the training loop instead of a batch (one that could not be
        made, or a sample's): its samples are not loaded again after a resume, as the
        DataLoader's lost batch; it is not counted as a batch yielded. No position: a batch
        sampler's empty batch (the default collate's ``IndexError``), passed all the same."""
        self._mark(positions)

    def _mark(self, positions: Iterable[int]) -> None:
        """Positions reached the training loop, as a batch or with its error; none: a batch
        sampler's empty batch (``[]``)."""
        if self.delivered is None:
            return
        pos = np.fromiter(positions, dtype=np.int64)
        if not pos.size:
            self.empties += 1
            return
        self._left -= int(np.count_nonzero(~self.delivered[np.unique(pos)]))
        self.delivered[pos] = True


def to_ranges(mask: np.ndarray) -> list[list[int]]:
    """Sorted half-open ranges ``[[start, stop], ...]`` of the true entries of a bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return edges.reshape(-1, 2).tolist()


def from_ranges(ranges: Any, size: int) -> list[int]:
    """The positions of ``ranges`` (see :func:`to_ranges`), checked against ``size``.

    Raises:
        ValueError: a range that is malformed or outside ``[0, size)``.
    """
    out: list[int] = []
    for r in ranges:
        try:
            start, stop = (int(v) for v in r)
        except (TypeError, ValueError):
            raise ValueError(f"state_dict: 'delivered' holds {r!r}, not a [start, stop] range") from None
        if not 0 <= start <= stop <= size:
            raise ValueError(f"state_dict: delivered range [{start}, {stop}) lies outside the "
                             f"epoch's {size} positions")
        out.extend(range(start, stop))
    return out


def order_digest(order: Sequence[int]) -> str:
    """A fingerprint of an epoch's order (dataset indices in order): BLAKE2b-64 of the int64
    indices, hex. A resumed epoch whose sampler gives another order is found by it."""
    data = np.asarray(order, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


#: Where a Loader's user samplers are, by the names a state gives them.
SAMPLER_PATHS = {"sampler": ("_sampler",), "batch_sampler": ("_batch_sampler",),
                  "batch_sampler.sampler": ("_batch_sampler", "sampler")}


def _is_epoch(value: Any) -> bool:
    """An integer epoch (Python or NumPy; not a bool), as ``DistributedSampler.epoch``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _sampler_at(loader: Any, name: str) -> Any:
    obj = loader
    for attr in SAMPLER_PATHS[name]:
        obj = getattr(obj, attr, None)
    return obj


def sampler_epochs(loader: Any) -> dict[str, int]:
    """The ``epoch`` of each of the user's samplers (the sampler, the batch sampler and its
    sampler) that has ``set_epoch`` and an integer ``epoch`` (``DistributedSampler``), by
    name: a training loop that sets them itself counts its epochs, which may not be the
    Loader's (a job restarted at epoch 3 sets 3 on its first pass)."""
    out = {}
    for name in SAMPLER_PATHS:
        obj = _sampler_at(loader, name)
        epoch = getattr(obj, "epoch", None)
        if obj is not None and callable(getattr(obj, "set_epoch", None)) and _is_epoch(epoch):
            out[name] = int(epoch)
    return out


def set_sampler_epochs(loader: Any, epochs: dict[str, int]) -> None:
    """``set_epoch`` on each of the loader's samplers named in ``epochs`` (names of
    :data:`SAMPLER_PATHS`, as a state's ``sampler_epochs``) that has one."""
    for name, epoch in epochs.items():
        obj = _sampler_at(loader, name)
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(int(epoch))


def sampler_states(loader: Any) -> dict[str, Any]:
    """``state_dict()`` of the loader's samplers that have one (and ``load_state_dict``)."""
    out = {}
    for name in ("sampler", "batch_sampler"):
        obj = _sampler_at(loader, name)
        if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            out[name] = obj.state_dict()
    return out


def check_dataset(dataset: Any, iterable: bool, mid_epoch: bool) -> None:
    """Refuse to *load* a mid-epoch state for an iterable dataset (``iterable``: an
    ``IterableDataset``, or any iterable without ``__getitem__``): its position in the stream is
    its own, not a set of positions of an order, and :func:`build` never writes such a state.

    Raises:
        TypeError: ``dataset`` is iterable and ``mid_epoch``.
    """
    if iterable and mid_epoch:
        raise TypeError(
            "Loader.load_state_dict(): the state holds positions delivered in the middle of an "
            f"epoch, and this Loader's dataset ({type(dataset).__name__}) is iterable (an "
            "IterableDataset, or an iterable without __getitem__): its stream has no positions "
            "to resume from. Load a state this Loader wrote, or use a map-style dataset")


class IterableRestartWarning(UserWarning):
    """A state of an iterable dataset's epoch taken, or loaded, in the middle of that epoch:
    the epoch restarts from its first sample at the resume (see :func:`build`). Its own class,
    so that ``warnings.filterwarnings("ignore", category=IterableRestartWarning)`` silences
    it alone."""


class OtherRankStateWarning(UserWarning):
    """A completion-order state saved by another rank was loaded (:func:`check`): its
    delivered positions stand for this rank's, approximately."""


def _warn_restart(text: str) -> None:
    warnings.warn(text, IterableRestartWarning, stacklevel=4)


def _figures(loader: Any, n: int | None) -> list[int] | None:
    """Memory-aware dispatch's figures for the state: one per index of a dataset of ``n``
    (``None`` when the dataset changed length since they were measured)."""
    p = loader._pipeline  # (read once: load_state_dict in another thread may drop it)
    for figures in (p.memory.saved() if p is not None else None, loader._memory_figures):
        if figures is not None and len(figures) == n:
            return figures
    return None


def _seconds(loader: Any, n: int | None) -> list[float] | None:
    """Slow-first dispatch's figures for the state, likewise (seconds per index)."""
    p = loader._pipeline
    for seconds in (p.costs.saved() if p is not None else None, loader._sample_seconds):
        if seconds is not None and len(seconds) == n:
            return seconds
    return None


def build(loader: Any) -> dict[str, Any]:
    """The state of ``loader``'s most recent iterator (see ``Loader.state_dict``)."""
    p: Progress | None = loader._progress
    started = p is not None and p.epoch == loader._epoch and p.batches > 0
    restarted, ended = 0, p is not None and p.finished
    if loader._iterable and started and not ended:
        if loader._n is not None and p.batches >= len(loader) and p.drained():
            # As many batches as len() and no more to come: Lightning ends the epoch there
            # without the next() that would end it (and so may any loop bounded by len). With
            # workers, shards of uneven lengths can make more batches than len(): the epoch
            # is then not over (its state restarts it, as any mid-epoch one).
            ended = True
        else:
            # Lightning saves a stateful loader's state at every checkpoint, mid-epoch ones
            # too: a TypeError here ended the training. DataLoader has no state, so Lightning
            # restarts its stream on resume: this state (the epoch, not started) does the same,
            # says so now, and again when it is loaded ("restarted").
            restarted, started = p.batches, False
            if loader._restart_warned is not p:  # once per pass
                loader._restart_warned = p
                _warn_restart(
                    f"Loader.state_dict(): the dataset ({type(loader.dataset).__name__}) is "
                    f"iterable, so its position within epoch {p.epoch} ({p.batches} batches "
                    "delivered) is not saved; resuming from this state restarts the epoch from "
                    "its first sample, as DataLoader's epoch under Lightning. Checkpoint "
                    "between epochs, or use a map-style dataset, to resume exactly")
    state = {
        "version": VERSION,
        "epoch": loader._epoch,
        "epoch_set": loader._epoch_set,
        "finished": False,
        "epoch_size": None,  # None: the epoch has not started
        "delivered": [],
        "batches": 0,
        "seed": loader.seed,
        "shuffle_seed": loader.shuffle_seed,
        "batch_size": loader._batch,
        "world_size": loader.world_size,
        "rank": loader.rank,
        "dataset_len": loader._n,
        "shuffle": loader.shuffle,
        "drop_last": bool(loader.drop_last),
        "in_order": bool(loader.in_order),
        "samplers": sampler_states(loader),
        # the epochs the training loop set on its samplers itself (see sampler_epochs)
        "sampler_epochs": sampler_epochs(loader),
        "knobs": loader.knobs.as_dict(),
        "restarted": restarted,  # batches an iterable's epoch had delivered (it restarts)
        "order_digest": None,  # a user sampler's mid-epoch order (see resumed_positions)
        "order_rank": None,  # the rank whose order it is
        # a batch sampler's empty batches ([]) that reached the loop (no position marks them)
        "empty_batches": 0,
        # memory-aware dispatch's figures (peak bytes per index), so a resumed run holds its
        # outliers apart from its first epoch
        "sample_memory": None,  # (below: for the state's dataset_len)
        # slow-first dispatch's figures (seconds per index), so a resumed run's first epoch
        # starts its slowest samples first
        "sample_seconds": None,  # (below, likewise)
    }
    loaded = getattr(loader, "_ended", None)
    # A pass whose sampler's epoch the loop set after iter(), before its first batch
    # (Lightning's order): its first next() starts it again (Loader._restart_pass), as the
    # ended epoch of a state loaded where that names it, else as the epoch it then takes
    restart = (p is not None and p.epoch == loader._epoch and p.batches == 0
               and not p.finished and not p.delivered.any() and loader._resumed is None
               and not loader._iterable and sampler_epochs(loader) != p.sampler_epochs)
    restart_epoch = loader._restart_epoch(False) if restart else None
    names_loaded = (restart and loaded is not None
                    and loader._named_ended(restart_epoch, peek=True) is not None)
    if p is None and loader._resume is None and loaded is None:
        # No pass yet: the first follows a DistributedSampler's epoch set above the Loader's
        # (Loader._followed_epoch; review 190: a resumed job's checkpoint before its first
        # pass resumed pass 0's augmentation)
        state["epoch"] = loader._followed_epoch() or state["epoch"]
    if loaded is not None and loader._resume is None and (loader._progress is None
                                                          or names_loaded):
        # An ended epoch's state loaded, no pass begun since: that state again (a checkpoint
        # taken now must resume as it would)
        state.update({k: loaded[2][k] for k in ("epoch", "epoch_set", "finished",
                                                "epoch_size", "delivered", "batches",
                                                "samplers", "sampler_epochs")})
        if loaded[2].get("began_sampler_epochs") is not None:
            state["began_sampler_epochs"] = loaded[2]["began_sampler_epochs"]
        state["dataset_len"] = loaded[2]["dataset_len"]
    elif loader._resume is not None:  # loaded and not iterated yet: pass it on
        pending = loader._resume
        state.update({k: pending[k] for k in ("epoch", "epoch_size", "delivered", "batches",
                                              "samplers")})
        state["empty_batches"] = pending.get("empty_batches", 0)
        if pending["epoch_size"] is not None:  # its positions are of its dataset's length
            state["dataset_len"] = pending["dataset_len"]
        state["order_digest"] = pending.get("order_digest")
        state["order_rank"] = pending.get("order_rank")
        if pending.get("sampler_epochs") is not None:
            state["sampler_epochs"] = pending["sampler_epochs"]
    elif loader._iterable:  # an epoch ended, or not started: no positions are counted
        if started and ended:
            state.update(finished=True, batches=p.batches)
    elif restart:
        # the state of the epoch it restarts as, not begun (review 191: the pass count was
        # recorded, the followed epoch's augmentation lost; review 192: from the count
        # before a follow at iter())
        state["epoch"] = loader._followed_epoch(above=restart_epoch) or restart_epoch
    elif p is not None and p.epoch == loader._epoch:
        # Every position delivered (a checkpoint after the epoch's last batch, before the
        # next() that ends it: Lightning's at a step that ends an epoch) is an ended epoch.
        ended = p.finished or p.all_delivered
        state.update(epoch=p.epoch, finished=ended, epoch_size=p.size,
                     delivered=to_ranges(p.delivered), batches=p.batches,
                     empty_batches=0 if ended else p.empties)
        if ended:
            # the samplers' epochs as the ended epoch began: a loop that sets them names
            # that epoch by setting them back (Loader._named_ended), not by setting the one
            # after it before the checkpoint (a key of its own: ``sampler_epochs`` is as the
            # checkpoint found them, in states of earlier versions too, review 191)
            state["began_sampler_epochs"] = p.sampler_epochs
        if not ended and p.dataset_len is not None:
            # the length its order was made for (the dataset may have changed since)
            state["dataset_len"] = p.dataset_len
        if not ended:  # the epoch is redone from its order: the samplers as it began
            state["samplers"] = p.samplers
            state["sampler_epochs"] = p.sampler_epochs
            if p.delivered.any():  # (nothing delivered: the epoch restarts exactly anyway)
                state["order_digest"] = p.digest
                state["order_rank"] = p.order_rank if p.digest is not None else None
    state["sample_memory"] = _figures(loader, state["dataset_len"])
    state["sample_seconds"] = _seconds(loader, state["dataset_len"])
    return state


def check(loader: Any, state: Any) -> dict[str, Any]:
    """``state`` checked against ``loader``: the same epoch shape and, when the loader's seed
    was given, the same seed.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: another version, a missing key, or a mismatch (the message names it).
    """
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict takes the dict of Loader.state_dict(), got "
                        f"{type(state).__name__}")
    if state.get("version") != VERSION:
        raise ValueError(f"load_state_dict: state version {state.get('version')!r}, this "
                         f"autominato reads version {VERSION}")
    missing = [k for k in ("epoch", "epoch_set", "finished", "epoch_size", "delivered",
                           "batches", "seed", "shuffle_seed", *_SHAPE, "rank", "in_order",
                           "samplers", "knobs")
               if k not in state]
    if missing:
        raise ValueError(f"load_state_dict: the state lacks {', '.join(missing)}")
    figures = state.get("sample_memory")
    if figures is not None and not (
            isinstance(figures, list) and len(figures) == state["dataset_len"]
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in figures)):
        raise ValueError("load_state_dict: the state's sample_memory is not a list of "
                         f"{state['dataset_len']} non-negative ints (peak bytes per index)")
    empties = state.get("empty_batches", 0)
    if isinstance(empties, bool) or not isinstance(empties, int) or empties < 0:
        raise ValueError("load_state_dict: the state's empty_batches is not an int >= 0 (a "
                         f"batch sampler's empty batches delivered), got {empties!r}")
    seconds = state.get("sample_seconds")
    if seconds is not None and not (
            isinstance(seconds, list) and len(seconds) == state["dataset_len"]
            and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and v >= 0 for v in seconds)):
        raise ValueError("load_state_dict: the state's sample_seconds is not a list of "
                         f"{state['dataset_len']} non-negative numbers (seconds per index)")
    mine = {"batch_size": loader._batch, "world_size": loader.world_size,
            "dataset_len": loader._n, "shuffle": loader.shuffle, "drop_last": bool(loader.drop_last)}
    # A state that names no positions (an ended epoch, one not begun, or one begun that
    # delivered nothing) starts its epoch from the beginning: a dataset that changed length
    # since (bad cases filtered out) is taken as it is.
    positions = (state["epoch_size"] is not None and not state["finished"]
                 and bool(state["delivered"]))
    for key in _SHAPE:
        if key == "dataset_len" and not positions:
            continue
        if state[key] != mine[key]:
            raise ValueError(f"load_state_dict: the state was saved with {key}={state[key]!r}, "
                             f"this Loader has {key}={mine[key]!r}")
    if state["rank"] != loader.rank and not _same_on_every_rank(state):
        # A checkpoint written by rank 0 alone (Lightning's) reaches every rank. In order, ranks
        # that stepped together delivered the same prefix of their own orders; in completion
        # order each rank's delivered positions are its own. Refusing it ended a resumed DDP
        # fit after a preemption on every rank but 0 (trial 153), with no other checkpoint to
        # go back to: the saving rank's positions are taken, which gives every rank the same
        # number of batches left (DDP's ranks must step alike), and the positions that may
        # differ are said.
        # (how many may differ is not known here: this rank's own holes are not in the
        # state, and a count from the saving rank's alone understated it: review 154)
        warnings.warn(
            f"Loader.load_state_dict(): a completion-order state saved by rank {state['rank']} "
            f"is loaded on rank {loader.rank} (a checkpoint written by one rank, as Lightning's "
            f"under DDP): this rank takes rank {state['rank']}'s delivered positions of epoch "
            f"{state['epoch']} as its own and has as many batches left; the samples that "
            "either rank delivered out of order before the checkpoint may come twice or be "
            "missed on this rank in that epoch. For an exact resume on every rank, use "
            "in_order=True (its state holds for every rank) or save each rank's own state",
            OtherRankStateWarning, stacklevel=3)
    if loader._seed_given and (state["seed"], state["shuffle_seed"]) != (loader.seed, loader.shuffle_seed):
        raise ValueError(f"load_state_dict: the state was saved with seed={state['seed']!r}, this "
                         f"Loader has seed={loader.seed!r} (give the same seed, or none to take "
                         "the state's)")
    check_dataset(loader.dataset, loader._iterable, state["epoch_size"] is not None)
    if state.get("restarted"):
        _warn_restart(
            f"Loader.load_state_dict(): the state was taken in the middle of epoch "
            f"{state['epoch']} of an iterable dataset, after {state['restarted']} batches, and "
            "holds no stream position: the epoch restarts from its first sample (those batches "
            "come again)")
    if state["epoch_size"] is not None:
        from_ranges(state["delivered"], state["epoch_size"])  # malformed ranges fail here
    for key in ("sampler_epochs", "began_sampler_epochs"):
        epochs = state.get(key)
        if epochs is not None and not (isinstance(epochs, dict) and all(
                k in SAMPLER_PATHS and _is_epoch(v) for k, v in epochs.items())):
            raise ValueError(f"load_state_dict: the state's {key} is not a dict of "
                             f"{', '.join(SAMPLER_PATHS)} to int epochs")
    for name in state["samplers"]:
        obj = _sampler_at(loader, name) if name in ("sampler", "batch_sampler") else None
        if not hasattr(obj, "load_state_dict"):
            raise ValueError(f"load_state_dict: the state holds the {name}'s state, this Loader "
                             f"has no {name} with load_state_dict")
    return state


def _same_on_every_rank(state: dict[str, Any]) -> bool:
    """Whether ``state`` holds for every rank that took as many steps: nothing delivered, an
    ended epoch, or an in-order epoch (a prefix of the order)."""
    return (state["epoch_size"] is None or state["finished"] or not state["delivered"]
            or bool(state["in_order"]))


def resumed_positions(state: dict[str, Any], order: Sequence[int], epoch: int,
                      rank: int | None = None) -> list[int]:
    """The positions a resumed epoch over ``order`` (its dataset indices) starts with.

    ``rank``: the rank whose share ``order`` is (see ``Progress.order_rank``); the order's
    fingerprint (``order_digest``, saved for a user's sampler) is checked only on the rank
    that saved the state (an in-order state, written by rank 0, is loaded on every rank, each
    with an order of its own: there a sampler that changed its order goes unnoticed).

    Raises:
        ValueError: the epoch's order has another length, or other indices, than at the
            checkpoint (a sampler that is not deterministic for its epoch, such as a
            ``WeightedRandomSampler`` whose generator is not reseeded per epoch, or another
            dataset): the positions saved would name other samples.
    """
    size = len(order)
    if state["epoch_size"] is None or not state["delivered"]:
        return []  # (nothing delivered: the epoch starts from its beginning, whatever its size)
    if state["epoch_size"] != size:
        raise ValueError(f"resuming epoch {epoch}: its order has {size} positions, it had "
                         f"{state['epoch_size']} at the checkpoint (the sampler must give the "
                         "same order for an epoch)")
    digest = state.get("order_digest")
    saved_rank = state.get("order_rank", state["rank"])
    if digest is not None and (rank is None or rank == saved_rank) and order_digest(order) != digest:
        raise ValueError(
            f"resuming epoch {epoch}: the sampler gave another order than at the checkpoint, "
            "so the positions delivered before it would name other samples. A sampler must "
            "give the same order for an epoch when rebuilt: seed it from the epoch (a "
            "set_epoch(epoch) method, as DistributedSampler's, which Loader.set_epoch and "
            "Lightning call, and seeded for epoch 0 when built) or give it state_dict() / "
            "load_state_dict(). WeightedRandomSampler has neither: subclass it with a "
            "set_epoch that reseeds its generator, called from __init__ too (see "
            "docs/resume.md), or resume from the start of an epoch (a checkpoint between "
            "epochs)")
    return from_ranges(state["delivered"], size)
