"""Batch assembly into reusable buffers.

:func:`collate` behaves like ``torch.utils.data.default_collate`` (arrays and tensors are
stacked along a new first dimension, numbers become tensors, strings stay lists, tuples /
lists / dicts are collated element-wise) but writes stacked arrays into buffers taken from a
:class:`BatchPool` instead of allocating new ones per batch.

A buffer goes back to the pool only when nothing outside the pool references it any more
(the training loop dropped the batch and every view of it): a NumPy array's reference count
says so, because every torch tensor made with ``torch.from_numpy`` keeps its array alive.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from autominato.pipeline.shm import is_array
from autominato.pipeline.tree import map_leaves


class BatchPool:
    """Reusable host buffers for batches, keyed by (shape, dtype).

    Args:
        max_per_key: buffers kept per key (batches in flight: depth + the one the training
            loop holds + one being filled).
        pin: allocate page-locked (pinned) memory, for asynchronous host-to-device copies.
    """

    def __init__(self, max_per_key: int = 4, pin: bool = False) -> None:
        self.max_per_key = max_per_key
        self.pin = pin
        self._lock = threading.Lock()
        self._bufs: dict[tuple, list[np.ndarray]] = {}
        self.bytes = 0
        self.allocations = 0
        self.reuses = 0

    def acquire(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            bufs = self._bufs.setdefault(key, [])
            for b in bufs:
                # References: the list, the loop variable and getrefcount's argument.
                if sys.getrefcount(b) <= 3:
                    self.reuses += 1
                    return b
            buf = self._allocate(shape, dtype)
            self.allocations += 1
            if len(bufs) < self.max_per_key:
                bufs.append(buf)
                self.bytes += buf.nbytes
            return buf

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.pin:
            t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
            return t.numpy()
        return np.empty(shape, dtype)

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()
            self.bytes = 0


def collate(samples: Sequence[Any], pool: BatchPool | None = None) -> Any:
    """Stack a list of samples into a batch (see the module docstring).

    Raises:
        ValueError: arrays of one field differ in shape or dtype across samples; the message
            gives the field's shapes.
    """
    first = samples[0]
    if is_array(first):
        arrays = [s.detach().cpu().numpy() if isinstance(s, torch.Tensor) else s for s in samples]
        shape = arrays[0].shape
        dtype = arrays[0].dtype
        for a in arrays:
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(
                    "cannot stack samples into a batch: shapes/dtypes differ: "
                    f"{sorted({(tuple(x.shape), str(x.dtype)) for x in arrays})}; "
                    "give a collate_fn or make the transform produce equal shapes"
                )
        out = pool.acquire((len(arrays), *shape), dtype) if pool else np.empty((len(arrays), *shape), dtype)
        for i, a in enumerate(arrays):
            out[i] = a
        return torch.from_numpy(out)
    if isinstance(first, (bool, int, float, np.number, np.bool_)):
        return torch.as_tensor(np.asarray(samples))
    if isinstance(first, (str, bytes)) or first is None:
        return list(samples)
    if isinstance(first, dict):
        return {k: collate([s[k] for s in samples], pool) for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(collate(list(f), pool) for f in zip(*samples, strict=True)))
    if isinstance(first, (tuple, list)):
        n = len(first)
        if any(len(s) != n for s in samples):
            raise ValueError("cannot collate samples: sequences of different lengths in one batch")
        # A list for tuple samples too, as torch's default_collate returns.
        return [collate(list(f), pool) for f in zip(*samples, strict=True)]
    return list(samples)


def batch_nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.numel()
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v) for v in batch)
    return 0


def to_device(batch: Any, device: torch.device) -> Any:
    """Copy every tensor of ``batch`` to ``device`` (non-blocking from pinned memory)."""
    return map_leaves(batch, lambda t: t.to(device, non_blocking=True), _is_tensor)


def record_stream(batch: Any, stream: Any) -> None:
    """Tell the CUDA caching allocator that ``stream`` uses the tensors of ``batch``."""
    map_leaves(batch, lambda t: t.record_stream(stream) if t.is_cuda else None, _is_tensor)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)
