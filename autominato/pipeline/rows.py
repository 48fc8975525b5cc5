"""Batch rows: process workers write finished samples straight into the batch's memory.

Without this, a sample crosses memory twice on its way into a batch: the worker writes it into
a slot it was given with its task (held through the whole transform), then the batch stage
copies it from there into a batch buffer in the main process. With it, a worker that finished a
sample *claims a row* (a message to the loader, answered by the collector thread,
:meth:`RowAllocator.claim`), writes the sample's arrays into that row of a shared batch buffer
(a slot of ``batch_size`` rows, one region per array of the sample, so that each region is
already the stacked ``(B, *shape)`` array), and replies as before. When the batch stage gets a
group whose samples are the consecutive rows of one buffer, the batch is views of it
(:class:`RowsView`): no copy, and no slot per sample. Memory then holds a batch's rows from the
first claim (its first sample finished) to the end of its use, instead of a slot per sample
from dispatch plus a private batch buffer.

Where a sample's row is. In completion order, rows are handed out in claim order and batches
form in completion order (``epoch.Epoch``): the two agree unless two workers' claims and
replies cross, a sample fails after claiming, or a worker dies between its claim and its reply
(a hole). Where the batch a sample joins is known from its position (*placed* rows), the row
is its place in that batch, whatever order the samples finish in: with a batch sampler, and in
order when errors are raised (the DataLoader's fixed batches, ``epoch.Epoch``), its place in
its group; in order skipping errors, its place among the samples the epoch delivers, which
skips the positions that failed for good (:meth:`RowAllocator.hole`) or were delivered before a
checkpoint (a hole found after later samples claimed their rows leaves those rows where they
were: their batches are copied). A group that is not a run of rows of one
buffer, in its order, is copied into a pooled buffer as before, so where rows go never changes
what is delivered, only whether it costs a copy. A buffer never holds two runs' (epochs')
samples.

Used for map-style datasets with the default collate and process workers, without pinned
memory (a pinned batch is a copy anyway); everything else keeps slots.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from autominato.pipeline.shm import ALIGN, Slot, SlotPool

#: The ``out_slot`` of a process worker's task whose result claims a row (see the module doc).
CLAIM = "claim"

#: Buffers a run fills at once, one per signature (shapes and dtypes of a sample's arrays):
#: samples of a few shapes in one epoch each fill their own instead of closing each other's.
MAX_FORMING = 4

#: Buffers a run with placed rows fills at once (one per batch whose first sample finished):
#: beyond it a sample of another batch gets a slot of its own (its batch is copied); the
#: earliest batches, in order the ones delivered next, keep theirs.
MAX_PLACED = 16


class RowBuffer:
    """One shared batch buffer: ``rows`` rows of samples whose arrays have ``sig`` (shapes and
    dtypes), array ``i`` of row ``r`` at ``regions[i] + r * sizes[i]``."""

    __slots__ = ("slot", "sig", "rows", "sizes", "regions", "claimed", "out", "closed", "start", "cap",
                 "taken", "home")

    def __init__(self, slot: Slot, sig: tuple, rows: int, sizes: list[int], regions: list[int],
                 start: int = 0) -> None:
        self.slot = slot
        self.sig = sig
        self.rows = rows
        self.sizes = sizes
        self.regions = regions
        self.start = start  # the run's row claims before its first row
        self.cap = rows  # rows it hands out: fewer when batches move (RowAllocator.shift)
        self.claimed = 0  # rows handed out
        self.out = 0  # rows handed out and not released
        self.closed = False  # no more rows are handed out
        self.taken: set[int] | None = None  # placed rows: the rows handed out
        self.home: tuple | None = None  # placed rows: (its run's forming dict, its key there)


class _RunRows:
    """A run's rows: ``batch_size`` rows per buffer, the buffers being filled by signature,
    the row claims so far and the shift of batch boundaries (:meth:`RowAllocator.shift`).
    Placed rows (see the module doc): ``starts``, a batch sampler's groups' first positions
    (and the end), or ``holes``, in order, the positions that will not be delivered; the
    buffers being filled are then keyed by ``(batch, signature)``."""

    __slots__ = ("rows", "forming", "claims", "shift", "starts", "holes")

    def __init__(self, rows: int, starts: list[int] | None = None,
                 holes: list[int] | None = None) -> None:
        self.rows = rows
        self.forming: dict[tuple, RowBuffer] = {}
        self.claims = 0
        self.shift = 0
        self.starts = starts
        self.holes = holes

    @property
    def placed(self) -> bool:
        return self.starts is not None or self.holes is not None

    def place(self, pos: int) -> tuple[int, int, int]:
        """``(batch, row, rows)`` of position ``pos`` (placed rows): the batch it joins, its
        place there and the batch's size."""
        if self.starts is not None:
            g = bisect.bisect_right(self.starts, pos) - 1
            return g, pos - self.starts[g], self.starts[g + 1] - self.starts[g]
        q = pos - bisect.bisect_left(self.holes, pos)  # its place among the delivered
        return q // self.rows, q % self.rows, self.rows

    def cap(self, claimed: int, most: int) -> int:
        """Rows a buffer with ``claimed`` rows handed out (and room for ``most``) hands out:
        up to the claim where the next batch starts (claim ``i`` is completion ``i - shift``,
        batches start every ``rows`` completions; the next claim is ``claims``, whichever
        buffer it goes to)."""
        left = (self.shift - self.claims) % self.rows
        if left == 0 and claimed == 0:  # a batch starts at its first row: a whole buffer
            left = self.rows
        return min(most, claimed + left)


class RowRef:
    """Row ``row`` of ``buf``: what a sample written there holds instead of a slot."""

    __slots__ = ("buf", "row")

    def __init__(self, buf: RowBuffer, row: int) -> None:
        self.buf = buf
        self.row = row


def layout(sig: tuple, rows: int) -> tuple[list[int], list[int], int]:
    """``(sizes, regions, nbytes)`` of a buffer of ``rows`` samples of signature ``sig``:
    each array's bytes, the offset of its region (64-byte aligned), and the buffer's size."""
    sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in sig]
    regions = []
    off = 0
    for n in sizes:
        regions.append(off)
        off += -(-(n * rows) // ALIGN) * ALIGN
    return sizes, regions, off


class RowAllocator:
    """Hands out rows of shared batch buffers to finished samples, per run, in claim order.

    Thread-safe: :meth:`claim` runs in the process workers' collector thread, the rest in the
    scheduler and batch threads. Buffers are slots of ``pool`` (its count and byte budgets
    apply); when none can be had the claim is refused and the worker sends its sample as if
    it had no slot (a memory file).
    """

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._runs: dict[int, _RunRows] = {}
        self._claims: dict[tuple, RowRef | Slot] = {}  # task key -> its row (or slot), until its result is in
        self.claims = 0  # rows handed out
        self.refused = 0  # claims answered without a row or a slot
        self.singles = 0  # claims answered with a slot of the sample's own (no buffer could be had)
        self.views = 0  # batch arrays that are views of a buffer (not copied; RowsView)

    def open(self, gen: int, batch_size: int, *, in_order: bool = False,
             groups: Sequence[int] | None = None, done: Iterable[int] = ()) -> None:
        """Run ``gen``'s samples may claim rows, ``batch_size`` to a buffer, in claim order;
        placed (see the module doc) with ``groups`` (a batch sampler's batch sizes, in position
        order: a buffer per batch) or ``in_order`` (``done``: positions delivered before a
        checkpoint, which the epoch steps over)."""
        starts = holes = None
        if groups is not None:
            starts = [0]
            for n in groups:
                starts.append(starts[-1] + int(n))
        elif in_order:
            holes = sorted(set(int(p) for p in done))
        with self._lock:
            self._runs[gen] = _RunRows(max(1, int(batch_size)), starts, holes)

    def active(self, gen: int) -> bool:
        return gen in self._runs

    def close_run(self, gen: int) -> None:
        """Run ``gen`` ended: no more rows for it (rows claimed stay until released)."""
        with self._lock:
            run = self._runs.pop(gen, None)
            if run is not None:
                for buf in run.forming.values():
                    self._close(buf)
                run.forming.clear()  # (a placed buffer refers back to it: no cycle left)

    def shift(self, gen: int, by: int) -> None:
        """Batches form every ``batch_size`` completions, rows are handed out ``batch_size``
        to a buffer: a claimed row that does not complete (``by=+1``: its sample failed after
        claiming, its worker died, or the completion was discarded) or a completion without a
        row (``by=-1``) moves the batch boundaries against the buffers' for the rest of the
        run. Buffers being filled end early (and later ones start) where batches now start,
        so that one such event costs a copy or two, not every batch after it."""
        with self._lock:
            run = self._runs.get(gen)
            if run is None or run.placed:  # placed rows do not depend on completions
                return
            run.shift += by
            for sig, buf in list(run.forming.items()):
                buf.cap = run.cap(buf.claimed, buf.rows)
                if buf.claimed >= buf.cap:
                    del run.forming[sig]
                    self._close(buf)

    def hole(self, gen: int, pos: int) -> None:
        """In order, skipping errors: position ``pos`` of run ``gen`` will not be delivered (it
        failed for good); the samples after it move up a place (for the rows claimed from now
        on). A run placed by groups ignores it."""
        with self._lock:
            run = self._runs.get(gen)
            if run is not None and run.holes is not None:
                i = bisect.bisect_left(run.holes, pos)
                if i == len(run.holes) or run.holes[i] != pos:
                    run.holes.insert(i, pos)

    def claim(self, key: tuple, sig: tuple) -> tuple:
        """A row for the sample of task ``key`` (``(gen, pos, attempt)``) whose arrays have
        ``sig`` (``((shape, dtype str), ...)``): ``("row", slot name, slot size, [offset of each
        array])``; ``("slot", name, size)`` when no batch buffer can be had (the pool's count
        or byte budget: a slot of the sample's own, copied into its batch as without rows); or
        ``("norow",)`` (the run ended, nor a slot could be had: the worker sends the sample in
        a memory file)."""
        with self._lock:
            run = self._runs.get(key[0])
            if run is None or not sig or key in self._claims:
                self.refused += 1  # a task claims once: a second claim is not given a row
                return ("norow",)
            if run.placed:
                return self._claim_placed(run, key, sig)
            forming = run.forming
            buf = forming.get(sig)
            if buf is not None:  # (samples of other shapes may have claimed since its last row)
                buf.cap = run.cap(buf.claimed, buf.rows)
                if buf.claimed >= buf.cap:  # a batch starts here
                    del forming[sig]
                    self._close(buf)
                    buf = None
            if buf is None:
                rows = run.cap(0, run.rows)  # a buffer only as large as the rows it hands out
                sizes, regions, nbytes = layout(sig, rows)
                slot = self.pool.acquire(nbytes, quiet=True, batch=True)
                if slot is None:
                    return self._single(key, sig)
                if len(forming) >= MAX_FORMING:  # the oldest shape's buffer takes no more rows
                    self._close(forming.pop(next(iter(forming))))
                forming[sig] = buf = RowBuffer(slot, sig, rows, sizes, regions, run.claims)
            return self._hand_out(run, sig, buf, buf.claimed, key)

    def _claim_placed(self, run: _RunRows, key: tuple, sig: tuple) -> tuple:
        """:meth:`claim` for placed rows: the row of the sample's place in its batch's buffer;
        a slot of its own when that row was handed out already (rows moved by a hole found
        after later samples claimed theirs), :data:`MAX_PLACED` buffers are being filled, or
        no buffer can be had. (A retried sample whose first attempt claimed its row finds a
        new buffer: releasing that row closed the first, see :meth:`release`.)"""
        g, row, rows = run.place(key[1])
        fk = (g, sig)
        buf = run.forming.get(fk)
        if buf is None:
            if len(run.forming) >= MAX_PLACED:
                return self._single(key, sig)
            sizes, regions, nbytes = layout(sig, rows)
            slot = self.pool.acquire(nbytes, quiet=True, batch=True)
            if slot is None:
                return self._single(key, sig)
            buf = run.forming[fk] = RowBuffer(slot, sig, rows, sizes, regions)
            buf.taken = set()
            buf.home = (run.forming, fk)
        if row in buf.taken:
            return self._single(key, sig)
        buf.taken.add(row)
        return self._hand_out(run, fk, buf, row, key)

    def _hand_out(self, run: _RunRows, fk: tuple, buf: RowBuffer, row: int, key: tuple) -> tuple:
        """Row ``row`` of ``buf`` (``run.forming[fk]``) to task ``key``: the claim's answer;
        the buffer leaves ``forming`` once it handed out all it hands out (``cap``)."""
        buf.claimed += 1
        buf.out += 1
        run.claims += 1
        if buf.claimed >= buf.cap:
            buf.closed = True
            del run.forming[fk]
        self._claims[key] = RowRef(buf, row)
        self.claims += 1
        return ("row", buf.slot.name, buf.slot.size,
                [r + row * n for r, n in zip(buf.regions, buf.sizes, strict=True)])

    def _single(self, key: tuple, sig: tuple) -> tuple:
        slot = self.pool.acquire(layout(sig, 1)[2])
        if slot is None:
            self.refused += 1
            return ("norow",)
        self._claims[key] = slot
        self.singles += 1
        return ("slot", slot.name, slot.size)

    def take(self, key: tuple) -> RowRef | Slot | None:
        """The row (or slot, see :meth:`claim`) that task ``key`` claimed (its result is in),
        or None."""
        if not self._claims:
            return None
        with self._lock:
            return self._claims.pop(key, None)

    def release(self, ref: RowRef) -> None:
        """The sample in ``ref`` is in a batch (or dropped): its row is free; a closed buffer
        whose rows are all free goes back to the pool (which waits for a batch made of views
        of it to be dropped before it hands it out again: ``Slot.viewed``). A buffer of placed
        rows takes no more rows once one is released: its batch is being made (a row not
        claimed by then is a sample that failed), or a sample in it was dropped."""
        with self._lock:
            self._release(ref)

    def _release(self, ref: RowRef) -> None:
        buf = ref.buf
        buf.out -= 1
        if buf.home is not None and not buf.closed:
            forming, fk = buf.home
            if forming.get(fk) is buf:
                del forming[fk]
            buf.closed = True
        if buf.closed and buf.out == 0:
            self.pool.release(buf.slot)

    def _close(self, buf: RowBuffer) -> None:
        buf.closed = True
        if buf.out == 0:
            self.pool.release(buf.slot)

    def pending(self) -> int:
        """Claims whose result has not come in (for tests and leak checks)."""
        with self._lock:
            return len(self._claims)


def _ptr(a: Any) -> int:
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.__array_interface__["data"][0]


def _contiguous(a: Any) -> bool:
    return a.is_contiguous() if isinstance(a, torch.Tensor) else a.flags.c_contiguous


def _nbytes(a: Any) -> int:
    return a.element_size() * a.numel() if isinstance(a, torch.Tensor) else a.nbytes


class RowsView:
    """The batch pool for a group whose samples lie in consecutive rows of one buffer: an
    array position whose arrays are exactly those rows, in order, is a view of the buffer
    (:meth:`stacked`); anything else is stacked into ``pool`` as usual (:meth:`acquire`)."""

    def __init__(self, pool: Any, buf: RowBuffer, rows: RowAllocator) -> None:
        self.pool = pool
        self.slot = buf.slot
        self.rows = rows

    def acquire(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self.pool.acquire(shape, dtype)

    def stacked(self, arrays: list, dtype: np.dtype) -> np.ndarray | None:
        """A ``(len(arrays), *shape)`` view of the slot of NumPy ``dtype`` when ``arrays``
        (equal in shape and dtype, checked by the caller) lie back to back in it in order;
        None otherwise (the caller copies them)."""
        slot = self.slot
        base = slot.addr
        n = _nbytes(arrays[0])
        p0 = _ptr(arrays[0])
        if n == 0 or p0 < base or p0 + n * len(arrays) > base + slot.size:
            return None
        for k, a in enumerate(arrays):
            if _ptr(a) != p0 + k * n or not _contiguous(a):
                return None
        slot.lent = True  # before the view exists: the pool must not hand it out under it
        self.rows.views += 1
        # frombuffer holds a buffer export on the mapping (np.ndarray(buffer=) does not): the
        # mapping then outlives the slot (SlotPool may unlink it) for as long as the batch lives.
        count = len(arrays) * n // np.dtype(dtype).itemsize
        return np.frombuffer(slot.mmap, dtype, count, p0 - base).reshape(len(arrays), *arrays[0].shape)
