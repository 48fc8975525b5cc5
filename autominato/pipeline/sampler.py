"""The order of one epoch: which dataset indices, in which order, on this rank.

Semantics equal those of ``torch.utils.data.DataLoader`` with its ``RandomSampler`` /
``SequentialSampler`` and, when ``world_size > 1``, ``DistributedSampler`` (the same class is
used, so padding and per-rank strides are identical). ``drop_last`` drops the indices that
the DataLoader's ``BatchSampler`` would leave in its last, short batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.data import DistributedSampler


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
        order = [int(i) for i in sampler]
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
