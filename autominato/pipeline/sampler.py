"""The order of one epoch: which dataset indices, in which order, on this rank.

Semantics equal those of ``torch.utils.data.DataLoader`` with its ``RandomSampler`` /
``SequentialSampler`` and, when ``world_size > 1``, ``DistributedSampler`` (the same class is
used, so padding and per-rank strides are identical). ``drop_last`` drops the indices that
the DataLoader's ``BatchSampler`` would leave in its last, short batch.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

#: Indices (those of a ``batch_sampler``'s batches too) read from a user's sampler in one pass
#: at most, unless its ``len()`` says more: ``max(MAX_ORDER_PER_SAMPLE * len(dataset),
#: MAX_ORDER)``. A pass takes its whole order when it starts, so a sampler that never ends
#: (detectron2's ``TrainingSampler``, a ``while True`` generator) would fill the memory
#: forever; past the bound it is refused with an error instead. 2**20 ints are about 36 MB of
#: Python list and 0.1-0.3 s to read.
MAX_ORDER = 1 << 20
MAX_ORDER_PER_SAMPLE = 16


class _NotAnIndex(TypeError):
    pass


def _index(x: Any) -> int:
    """``x`` as an index (``operator.index``: ints, NumPy integers, integer 0-d tensors; not
    floats or strings, which the DataLoader would pass to ``__getitem__`` as they are)."""
    try:
        return operator.index(x)
    except TypeError:
        raise _NotAnIndex(f"{x!r}, a {type(x).__name__}") from None


def _exact(sampler: Any, batches: bool) -> bool:
    """Whether ``sampler`` is torch's ``RandomSampler`` as it is (its ``__iter__`` and
    ``__len__``), or torch's ``BatchSampler`` of one: it yields exactly ``len()`` items, and
    asked for one more it may draw from its generator before it ends (``num_samples`` a
    multiple of ``n``, the default: ``randperm(n)[:0]``, a whole permutation)."""
    if batches:
        if type(sampler) is not BatchSampler:
            return False
        sampler = sampler.sampler
    cls = type(sampler)
    return (isinstance(sampler, RandomSampler) and cls.__iter__ is RandomSampler.__iter__
            and cls.__len__ is RandomSampler.__len__)


def _finish(it: Any) -> None:
    """Run a sampler's iterator to its end (what it draws there)."""
    for _ in it:
        pass


def read_sampler(sampler: Any, n: int, name: str = "sampler", batches: bool = False,
                 at_end: list | None = None) -> list:
    """The indices of one pass over ``sampler`` (with ``batches``, a batch sampler's batches,
    each a list of ints), refusing a sampler that does not end.

    Args:
        sampler: a sampler or batch sampler (an iterable; its ``len()``, if any, raises the
            bound).
        n: the dataset's length.
        name: the argument's name in the error.
        batches: ``sampler`` yields batches (lists of indices).
        at_end: where given and ``sampler`` is torch's ``RandomSampler`` (or a
            ``BatchSampler`` of one), its ``len()`` items are read and the iterator is not
            asked for more: what runs it to its end is appended to ``at_end``, for the
            caller to run when its pass ends whole. Exhausted, a ``RandomSampler`` draws
            one more permutation from its generator (the last, empty, slice of
            ``num_samples``), which the DataLoader's sampler draws only when its pass
            reaches the end: a pass the loop leaves early (a ``break``) then draws one, not
            two, and the permutations after it are the DataLoader's (trial: with the same
            generator they differed from the next epoch on).

    Raises:
        ValueError: the pass gave more than ``max(MAX_ORDER_PER_SAMPLE * n, MAX_ORDER,
            2 * len(sampler))`` indices before it ended (a batch sampler: more than
            ``max(MAX_ORDER_PER_SAMPLE * n, MAX_ORDER)`` indices in its batches and more than
            ``2 * len(batch_sampler)`` batches): an endless sampler.
    """
    cap = max(MAX_ORDER_PER_SAMPLE * max(n, 1), MAX_ORDER)  # indices
    if at_end is not None and _exact(sampler, batches):
        it = iter(sampler)
        k = len(sampler)
        if batches:
            out = [list(map(_index, b)) for b in itertools.islice(it, k)]
        else:
            out = list(map(_index, itertools.islice(it, k)))
        at_end.append(functools.partial(_finish, it))
        return out
    try:
        items = 2 * int(len(sampler))  # what its length allows: indices, or batches
    except Exception:  # noqa: BLE001 - no length (or one that refuses): the bound as it is
        items = 0
    try:
        if not batches:
            cap = max(cap, items)
            out = list(map(_index, itertools.islice(sampler, cap + 1)))
            if len(out) <= cap:
                return out
        else:
            out = []
            read = 0
            for b in sampler:
                b = list(map(_index, b))
                read += len(b)
                out.append(b)
                if read > cap and len(out) > items:  # past both bounds
                    break
            else:
                return out
    except _NotAnIndex as e:
        raise TypeError(
            f"the {name} ({type(sampler).__name__}) gave a key that is not an integer index "
            f"({e.args[0]}): autominato's map-style datasets take integer indices (its orders, seeds "
            "and memory figures are per index); map other keys to indices in the dataset") from e
    what = f"{cap} indices" + (f" and {items} batches" if batches and items else "")
    raise ValueError(
        f"the {name} ({type(sampler).__name__}) gave more than {what} in one pass over a "
        f"dataset of {n}: an endless {name} is not supported. autominato takes each epoch's "
        "order when its pass starts (see docs/parity.md); give one whose iteration ends at "
        "the epoch's end (for step-based training, the steps between two evaluations), or "
        "call iter(loader) again for each such span")


def epoch_order(
    n: int,
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    sampler: Iterable[int] | None = None,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 1,
    drop_last: bool = False,
    at_end: list | None = None,
) -> list[int]:
    """Dataset indices of one epoch on one rank, in sampler order.

    Args:
        n: dataset length.
        epoch: epoch number; reseeds shuffling (``seed + epoch``, as ``DistributedSampler``).
        seed: base seed of the shuffle.
        shuffle: random permutation (``torch.randperm``) instead of ``0..n-1``.
        sampler: a user sampler, iterated as it is (its ``set_epoch`` is the caller's business,
            as with the DataLoader: overriding it would replay the wrong epoch on resume).
        rank, world_size: this process's share (``DistributedSampler`` semantics).
        batch_size, drop_last: with ``drop_last`` the last ``len % batch_size`` are dropped.
        at_end: see :func:`read_sampler` (``sampler``'s end, deferred).

    Returns:
        The list of indices (repeats allowed when the sampler repeats).
    """
    if sampler is not None:
        order = read_sampler(sampler, n, at_end=at_end)
    elif world_size > 1:
        ds = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=False
        )
        ds.set_epoch(epoch)
        order = list(ds)
    elif shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[: len(order) // batch_size * batch_size]
    return order
