"""Batch assembly into reusable buffers.

:func:`collate` behaves like ``torch.utils.data.default_collate`` (arrays and tensors are
stacked along a new first dimension, numbers become tensors, strings stay as they are (a list
of them, a tuple for a field of tuple samples), tuples / lists / dicts are collated
element-wise) but writes stacked arrays into buffers taken from a :class:`BatchPool` instead
of allocating new ones per batch.

A buffer goes back to the pool only when nothing outside the pool references it any more
(the training loop dropped the batch and every view of it): a NumPy array's reference count
says so, because every torch tensor made with ``torch.from_numpy`` keeps its array alive.
"""

from __future__ import annotations

import copy
import mmap
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from autominato.pipeline import shm
from autominato.pipeline.errors import CollateError
from autominato.pipeline.shm import has_flat_bytes, is_array, slot_dtype
from autominato.pipeline.tree import for_leaves, map_leaves

try:  # where torch keeps the per-type collate functions that default_collate dispatches on
    from torch.utils.data._utils.collate import default_collate_fn_map
except ImportError:  # pragma: no cover - a torch without it: no subclass registers one
    default_collate_fn_map = {}
try:  # default_collate's message for what it cannot batch (its own TypeError's text)
    from torch.utils.data._utils.collate import default_collate_err_msg_format
except ImportError:  # pragma: no cover
    default_collate_err_msg_format = ("default_collate: batch must contain tensors, numpy arrays, "
                                      "numbers, dicts or lists; found {}")


def _refcount(bufs: list, i: int) -> int:
    return sys.getrefcount(bufs[i])


# What _refcount says of a buffer that only the pool holds: measured rather than assumed,
# since temporary references differ between Python versions.
_IDLE = _refcount([np.empty(0)], 0)

#: Unpinned buffers at least this large are anonymous memory maps of their own, whose pages an
#: idle buffer gives back (``MADV_DONTNEED``) after ``shm.DECAY_S`` seconds; smaller ones come
#: from the allocator (their pages are cheap to keep).
DECAY_MIN_BYTES = 1 << 20
_CAN_DECAY = hasattr(mmap, "MADV_DONTNEED")


class _Meta:
    __slots__ = ("used", "idle_since", "map", "warm")

    def __init__(self, used: float, map_: mmap.mmap | None) -> None:
        self.used = used  # time.monotonic() of its last acquire
        self.idle_since: float | None = None  # when a decay pass first saw it idle
        self.map = map_
        self.warm = True


class BatchPool:
    """Reusable host buffers for batches, keyed by (shape, dtype), bounded in bytes.

    Args:
        max_per_key: buffers kept per key (batches in flight: depth + the one the training
            loop holds + one being filled).
        pin: allocate page-locked (pinned) memory, for asynchronous host-to-device copies.
        budget_bytes: most bytes (all keys together) the pool keeps; None (the default):
            twice the most bytes its buffers have had in use at once, so that the idle
            buffers kept never outweigh the working set of batches in flight. A new buffer
            that would exceed the budget first evicts buffers not in use, least recently used
            key first; if it still does not fit (the rest are in use) it is handed out without
            being kept. Whole-volume validation (a new shape almost every batch) thus holds a
            few recent shapes instead of one buffer per shape ever seen. A live setting (like
            ``max_per_key``): a new value applies at the next allocation. With ``pin``, an
            evicted buffer goes back to torch's pinned-memory cache, which keeps it
            page-locked for later pinned allocations until
            ``torch.accelerator.empty_host_cache()`` (recent torch) releases it.

    An unpinned buffer of at least :data:`DECAY_MIN_BYTES` that no batch has taken for
    ``shm.DECAY_S`` seconds while idle gives its pages back to the system and keeps its place
    (its next batch pays the page faults again): the pool keeps the memory of the batches in
    flight lately, not of the most ever in flight at once. An idle buffer that still has its
    pages is taken first, the most recently used one first.

    Counters: ``bytes`` (held now, bytes, cold buffers included), ``budget`` (the budget in
    force, bytes), ``allocations`` (buffers allocated), ``reuses`` (batches written into a kept
    buffer), ``evictions`` (buffers dropped), ``released`` (times an idle buffer gave its pages
    back).
    """

    def __init__(self, max_per_key: int = 4, pin: bool = False,
                 budget_bytes: int | None = None) -> None:
        self.max_per_key = max_per_key
        self.pin = pin
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        # Least recently used key first.
        self._bufs: OrderedDict[tuple, list[np.ndarray]] = OrderedDict()
        self._peak_in_use = 0
        self._meta: dict[int, _Meta] = {}  # id(buffer) -> its use, while the pool keeps it
        self.bytes = 0
        self.allocations = 0
        self.reuses = 0
        self.evictions = 0
        self.released = 0

    @property
    def budget(self) -> int:
        """The budget in force (bytes): ``budget_bytes``, or the automatic one."""
        return 2 * self._peak_in_use if self.budget_bytes is None else self.budget_bytes

    def acquire(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A buffer of ``shape`` and NumPy ``dtype`` that nothing else uses (contents stale)."""
        dtype = np.dtype(dtype)
        key = (tuple(shape), dtype.str)
        now = time.monotonic()
        with self._lock:
            bufs = self._bufs.get(key)
            if bufs is not None:
                self._bufs.move_to_end(key)
                best, rank = -1, None
                for i in range(len(bufs)):
                    if _refcount(bufs, i) <= _IDLE:
                        m = self._meta[id(bufs[i])]
                        r = (m.warm, m.used)
                        if rank is None or r > rank:
                            best, rank = i, r
                if best >= 0:
                    self.reuses += 1
                    buf = bufs[best]
                    m = self._meta[id(buf)]
                    m.used, m.idle_since, m.warm = now, None, True
                    return buf
            buf, map_ = self._allocate(shape, dtype)
            self.allocations += 1
            if (bufs is None or len(bufs) < self.max_per_key) and self._make_room(buf.nbytes):
                self._bufs.setdefault(key, []).append(buf)
                self._meta[id(buf)] = _Meta(now, map_)
                self.bytes += buf.nbytes
            return buf

    def resident_bytes(self, releasable: bool = False) -> int:
        """Bytes of the kept buffers that have their pages (:attr:`bytes` counts all);
        ``releasable``: only those that :meth:`decay` can take the pages of (mapped: not
        pinned, not under ``DECAY_MIN_BYTES``)."""
        with self._lock:
            return sum(b.nbytes for bufs in self._bufs.values() for b in bufs
                       if self._meta[id(b)].warm
                       and (not releasable or self._meta[id(b)].map is not None))

    def decay(self, now: float | None = None, at_once: bool = False) -> int:
        """Buffers idle for ``shm.DECAY_S`` seconds (since a pass first saw only the pool
        hold them, not since their last acquire: a batch may wait in the prefetch queue and
        the training step for longer) give their pages back; returns how many did. Called
        from the scheduler's periodic tick. ``at_once``: every idle unpinned buffer gives
        them back now (memory-aware dispatch measures the samples or holds one back, and the
        pool's memory counts in its budget)."""
        now = time.monotonic() if now is None else now
        done = 0
        with self._lock:
            for bufs in self._bufs.values():
                for i in range(len(bufs)):
                    m = self._meta[id(bufs[i])]
                    if not m.warm or m.map is None:
                        continue
                    if _refcount(bufs, i) > _IDLE:
                        m.idle_since = None
                    elif m.idle_since is None and not at_once:
                        m.idle_since = now
                    elif at_once or now - m.idle_since >= shm.DECAY_S:
                        m.map.madvise(mmap.MADV_DONTNEED)
                        m.warm = False
                        self.released += 1
                        done += 1
        return done

    def _make_room(self, nbytes: int) -> bool:
        """Evict idle buffers, least recently used first, until ``nbytes`` more fit the budget;
        False (and nothing evicted) when they cannot fit."""
        # Indexing, not iterating: a loop variable would be one more reference.
        idle = sum(bufs[i].nbytes for bufs in self._bufs.values()
                   for i in range(len(bufs)) if _refcount(bufs, i) <= _IDLE)
        in_use = self.bytes - idle + nbytes
        self._peak_in_use = max(self._peak_in_use, in_use)
        budget = self.budget
        if in_use > budget:
            return False
        for key in list(self._bufs):
            if self.bytes + nbytes <= budget:
                break
            bufs = self._bufs[key]
            i = 0
            while i < len(bufs) and self.bytes + nbytes > budget:
                if _refcount(bufs, i) <= _IDLE:
                    gone = bufs.pop(i)
                    self._meta.pop(id(gone), None)
                    self.bytes -= gone.nbytes
                    self.evictions += 1
                else:
                    i += 1
            if not bufs:
                del self._bufs[key]
        return True

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, mmap.mmap | None]:
        if self.pin:
            t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
            return t.numpy(), None
        n = int(np.prod(shape, dtype=np.int64))
        if n * dtype.itemsize < DECAY_MIN_BYTES or not _CAN_DECAY:
            return np.empty(shape, dtype), None
        # Its own mapping: freed with the array, and its pages can be given back while kept.
        map_ = mmap.mmap(-1, n * dtype.itemsize, flags=mmap.MAP_PRIVATE)
        # Its base is the map itself, so a view of it (buf[0]) holds buf's reference count up.
        return np.ndarray(shape, dtype, buffer=map_), map_

    def stacked(self, arrays: Sequence[Any], dtype: np.dtype) -> np.ndarray | None:
        """Arrays already stacked in memory, as a batch array (see ``rows.RowsView``); a
        pool's own buffers never are: None."""
        return None

    def clear(self) -> None:
        with self._lock:
            self._meta.clear()
            self._bufs.clear()
            self.bytes = 0
            self._peak_in_use = 0


def collate(samples: Sequence[Any], pool: BatchPool | None = None) -> Any:
    """Stack a list of samples into a batch (see the module docstring).

    Tensors of any dtype (``bfloat16`` and ``float8`` included) are stacked into a pooled
    buffer, and a ``torch.Tensor`` subclass stays one, as with ``default_collate``: the copy
    is ``torch.stack(samples, 0, out=buffer)``, which runs the subclass's
    ``__torch_function__`` (torchvision's ``tv_tensors`` unwrap to ``torch.Tensor``). MONAI's
    ``MetaTensor`` s are stacked into the pool and given MONAI's batch metadata, as
    ``monai.data.DataLoader`` collates them (see :func:`_meta_batch`).

    Raises:
        CollateError: (a ``RuntimeError``, as ``default_collate``'s, and a ``ValueError``)
            arrays of one field differ in shape across samples (the message gives the field's
            shapes and dtypes), or sequences in length. Arrays of one shape and different
            dtypes are stacked with torch's type promotion, as ``default_collate`` stacks them
            (in fresh memory, not the pool's).
        TypeError: a NumPy array of strings or Python objects, ``None`` or another type that
            ``default_collate`` refuses, as ``default_collate``; a field whose first sample
            is a tensor and another is not (a NumPy array: torch.stack's words, then the
            batch's positions and types concerned).
    """
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return _stack_tensors(samples, pool)
    if isinstance(first, np.ndarray) and first.dtype.kind in "SaUO":
        # As default_collate (its np_str_obj_array_pattern): strings and objects are no batch.
        raise TypeError(default_collate_err_msg_format.format(first.dtype))
    if isinstance(first, np.ndarray) and is_array(first):
        if all(type(s) is np.ndarray for s in samples):
            return _stack_arrays(samples, pool)
        # each made a tensor (a number too, None refused), as default_collate's
        # torch.as_tensor: then stacked as tensors
        return _stack_tensors([_as_tensor(s) if isinstance(s, (np.ndarray, torch.Tensor))
                               else torch.as_tensor(s) for s in samples], pool)
    if isinstance(first, (bool, int, float, np.number, np.bool_)):
        t = type(first)
        if all(type(s) is t for s in samples):  # one type: default_collate's dtype, faster
            return torch.as_tensor(np.asarray(samples))
        # default_collate's dtypes: float64 for Python floats, torch.tensor's inference for
        # ints (float32 once a float is among them), NumPy's for NumPy scalars
        return default_collate(list(samples))
    if isinstance(first, (str, bytes)):
        # Arrays among them may be views into a slot that is reused once the batch is made.
        # A tuple for a field of tuple samples, a list for a dict's, as default_collate.
        out = [map_leaves(s, _owned, is_array) for s in samples]
        return tuple(out) if isinstance(samples, tuple) else out
    if isinstance(first, dict):
        out = {}
        for k in first:
            try:
                out[k] = collate([s[k] for s in samples], pool)
            except CollateError as e:  # (trial 179: which field's shapes differ was not said)
                e.add_note(f"[autominato] in the samples' field {k!r}")
                raise
        if type(first) is dict:
            return out
        try:  # an OrderedDict, a MONAI or user mapping stays one, as default_collate keeps it
            clone = copy.copy(first)
            clone.update(out)
            return clone
        except TypeError:
            return out
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(collate(f, pool) for f in zip(*samples, strict=True)))
    if isinstance(first, (tuple, list)):
        n = len(first)
        if any(len(s) != n for s in samples):
            raise CollateError("cannot collate samples: sequences of different lengths in one batch")
        # A list for tuple samples too, as torch's default_collate returns.
        out = [collate(f, pool) for f in zip(*samples, strict=True)]
        if type(first) is list or isinstance(first, tuple):
            return out
        try:  # a user's list subclass stays one, as default_collate keeps it (a copy of it)
            clone = copy.copy(first)
            for i, field in enumerate(out):
                clone[i] = field
        except TypeError:
            return out
        return clone
    # Anything else (None, an object of the user's): default_collate's own rule, a function
    # registered in its collate_fn_map or its TypeError, as with the DataLoader.
    return default_collate(list(samples))


def _owned(x: Any) -> Any:
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _mixed(samples: Sequence[Any]) -> bool:
    """Samples of one shape whose dtypes differ: ``default_collate`` stacks them with
    torch's type promotion (float32 and float64 give float64), in fresh memory."""
    dtype = samples[0].dtype
    return any(s.dtype != dtype for s in samples)


def _check_same(samples: Sequence[Any]) -> None:
    shape = samples[0].shape
    if any(s.shape != shape for s in samples):
        raise CollateError(
            "cannot stack samples into a batch: shapes differ: "
            f"{sorted({(tuple(s.shape), str(s.dtype)) for s in samples})}; "
            "give a collate_fn or make the transform produce equal shapes (a sampler that "
            "orders samples so that each batch has one shape needs in_order=True or a "
            "batch_sampler: in completion order a batch takes the samples that finished "
            "first)"
        )


def _stack_arrays(arrays: Sequence[np.ndarray], pool: BatchPool | None) -> torch.Tensor:
    _check_same(arrays)
    if _mixed(arrays):
        return default_collate(list(arrays))
    shape = (len(arrays), *arrays[0].shape)
    dtype = arrays[0].dtype
    if pool is not None:
        out = pool.stacked(arrays, dtype)  # the samples' rows of one buffer: no copy
        if out is not None:
            return torch.from_numpy(out)
    out = pool.acquire(shape, dtype) if pool else np.empty(shape, dtype)
    for i, a in enumerate(arrays):
        out[i] = a
    return torch.from_numpy(out)


def _as_tensor(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        # from_numpy shares memory but refuses negative strides (a flipped array).
        return torch.from_numpy(x if x.flags.c_contiguous else x.copy(order="C"))
    return x


def _only_tensors(samples: Sequence[Any]) -> None:
    """A field whose first sample is a tensor stacks only tensors: ``default_collate`` stacks
    it with ``torch.stack``, which refuses anything else (a NumPy array of the same shape
    too, ``TypeError: expected Tensor as element 1 in argument 0, but got numpy.ndarray``),
    where the arrays were made tensors here and stacked (trial: a dataset returning a tensor
    for some samples and an array for others trained under the Loader and failed under the
    DataLoader). The other way round (an array first) ``default_collate`` makes every sample
    a tensor and stacks them, as :func:`collate` does."""
    odd = [(i, type(s)) for i, s in enumerate(samples) if not isinstance(s, torch.Tensor)]
    if odd:
        i, t = odd[0]
        # (as torch names a type: NumPy's and others' with their module, builtins' without)
        name = lambda c: (c.__qualname__ if c.__module__ == "builtins"  # noqa: E731
                          else f"{c.__module__}.{c.__qualname__}")
        raise TypeError(
            f"expected Tensor as element {i} in argument 0, but got {name(t)} (as torch.stack "
            f"in default_collate): sample 0 of the batch is a {name(type(samples[0]))}, "
            f"samples {[j for j, _ in odd]} of {len(samples)} are "
            f"{sorted({name(c) for _, c in odd})}; make the dataset return one type "
            "(torch.as_tensor) or give a collate_fn")


def _stack_tensors(samples: Sequence[Any], pool: BatchPool | None) -> Any:
    first = samples[0]
    cls = type(first)
    meta_tensor = getattr(sys.modules.get("monai.data.meta_tensor"), "MetaTensor", None)
    if not (cls is not torch.Tensor and cls in default_collate_fn_map
            and not (meta_tensor is not None and isinstance(first, meta_tensor))):
        # (a subclass's own collate function, registered with torch, decides for itself)
        _only_tensors(samples)
    if meta_tensor is not None and isinstance(first, meta_tensor) and has_flat_bytes(first):
        return _meta_batch(_stack_tensors([s.as_tensor() for s in samples], pool), samples)
    if (cls is not torch.Tensor and cls in default_collate_fn_map) or not has_flat_bytes(first):
        # A subclass that registered its own collate function with torch knows its metadata
        # best; sparse, nested, quantized and meta tensors have no flat bytes to pool. Both
        # get torch's default_collate as it is, in fresh memory.
        return default_collate(list(samples))
    samples = [_as_tensor(s) for s in samples]
    _check_same(samples)
    if (_mixed(samples) or not all(s.is_cpu for s in samples)
            or any(s.requires_grad for s in samples)):
        # promoted as torch.stack promotes; tensors on a device stacked there, as the
        # DataLoader's default_collate does (num_workers=0 over a dataset held on the GPU);
        # samples that need grad (made in this process: num_workers=0 or thread workers)
        # stacked into a batch that keeps their graph, as there (trial 108: detached),
        # which torch.stack(out=) refuses
        return default_collate(list(samples))
    parts = list(samples)
    shape = (len(parts), *first.shape)
    raw = slot_dtype(first.dtype)  # int16 for bfloat16: NumPy has no such type
    if pool is not None and all(type(p) is torch.Tensor for p in parts):
        # (a subclass's stack may add its metadata: it is stacked as before)
        buf = pool.stacked(parts, raw)  # the samples' rows of one buffer: no copy
        if buf is not None:
            out = torch.from_numpy(buf)
            return out.view(first.dtype) if out.dtype != first.dtype else out
    buf = pool.acquire(shape, raw) if pool else np.empty(shape, raw)
    out = torch.from_numpy(buf)
    if out.dtype != first.dtype:
        out = out.view(first.dtype)
    return torch.stack(parts, 0, out=out)


def _meta_batch(stacked: torch.Tensor, samples: Sequence[Any]) -> Any:
    """A batch of MONAI ``MetaTensor`` s as MONAI collates one
    (``monai.data.utils.collate_meta_tensor_fn``, MONAI 1.6, which ``monai.data.DataLoader``'s
    ``list_data_collate`` installs into ``default_collate``): the pooled ``stacked`` data
    ``(B, C, *spatial)``, the metadata keys common to all samples collated (``affine``
    ``(B, 4, 4)``, ``filename_or_obj`` a list of B), each sample's ``applied_operations`` in a
    list of B, ``is_batch=True``, so that ``decollate_batch`` and inverse transforms work."""
    from monai.data import MetaTensor
    from monai.utils import TraceKeys

    out = MetaTensor(stacked)  # shares the pooled buffer
    metas = [s.meta or TraceKeys.NONE for s in samples]
    common = set.intersection(*[set(d) for d in metas if isinstance(d, dict)])
    if common:
        metas = [{k: d[k] for k in common} if isinstance(d, dict) else TraceKeys.NONE for d in metas]
    out.meta = default_collate(metas)
    out.applied_operations = [s.applied_operations or TraceKeys.NONE for s in samples]
    out.is_batch = True
    out.spatial_ndim = min(min(getattr(s, "spatial_ndim", 3) for s in samples), max(out.ndim - 1, 1))
    return out


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


def pin(batch: Any) -> Any:
    """``batch`` with every CPU tensor in page-locked (pinned) memory (a copy unless it is
    pinned already), and an object with a ``pin_memory()`` method (a custom batch type)
    replaced by what it returns, as the DataLoader's pin-memory thread does to a
    ``collate_fn``'s output; ``batch`` itself where no accelerator is available (pinning
    needs one)."""
    if not torch.cuda.is_available():
        return batch
    return map_leaves(batch, _pin_leaf, _pinnable)


def _pinnable(x: Any) -> bool:
    """A tensor, or an object of the user's (a custom batch type) with a ``pin_memory()``
    method, which the DataLoader's pin-memory thread calls (containers are walked first)."""
    return isinstance(x, torch.Tensor) or (
        not isinstance(x, (dict, list, tuple, str, bytes))
        and callable(getattr(x, "pin_memory", None)))


def _pin_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x if x.is_pinned() or x.device.type != "cpu" else x.pin_memory()
    return x.pin_memory()


def record_stream(batch: Any, stream: Any) -> None:
    """Tell the CUDA caching allocator that ``stream`` uses the tensors of ``batch``."""
    for_leaves(batch, lambda t: t.record_stream(stream) if t.is_cuda else None, _is_tensor)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)
