"""The order of one epoch: which dataset indices, in which order, on this rank.

Semantics equal those of ``torch.utils.data.DataLoader`` with its ``RandomSampler`` /
``SequentialSampler`` and, when ``world_size > 1``, ``DistributedSampler`` (the same class is
used, so padding and per-rank strides are identical). ``drop_last`` drops the indices that
the DataLoader's ``BatchSampler`` would leave in its last, short batch.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DistributedSampler

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


def read_sampler(sampler: Any, n: int, name: str = "sampler", batches: bool = False) -> list:
    """The indices of one pass over ``sampler`` (with ``batches``, a batch sampler's batches,
    each a list of ints), refusing a sampler that does not end.

    Args:
        sampler: a sampler or batch sampler (an iterable; its ``len()``, if any, raises the
            bound).
        n: the dataset's length.
        name: the argument's name in the error.
        batches: ``sampler`` yields batches (lists of indices).

    Raises:
        ValueError: the pass gave more than ``max(MAX_ORDER_PER_SAMPLE * n, MAX_ORDER,
            2 * len(sampler))`` indices before it ended (a batch sampler: more than
            ``max(MAX_ORDER_PER_SAMPLE * n, MAX_ORDER)`` indices in its batches and more than
            ``2 * len(batch_sampler)`` batches): an endless sampler.
    """
    cap = max(MAX_ORDER_PER_SAMPLE * max(n, 1), MAX_ORDER)  # indices
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

    Returns:
        The list of indices (repeats allowed when the sampler repeats).
    """
    if sampler is not None:
        order = read_sampler(sampler, n)
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
