"""Batch rows (pipeline/rows.py): process workers write finished samples into rows of shared
batch buffers; a batch whose samples are consecutive rows of one buffer is views of it.
What must hold: the rows handed out, the buffer's return to the pool only when its rows are
free and no batch views it, the values delivered, and exactly-once per epoch when rows and
completions disagree (holes, errors after a claim)."""

from __future__ import annotations

import gc
from collections import deque

import numpy as np
import pytest
import torch

from autominato import Loader
from autominato.pipeline.collate import BatchPool, collate
from autominato.pipeline.rows import RowAllocator, RowRef, RowsView, layout
from autominato.pipeline.shm import SlotPool, pack_prepared, prepare, unpack
from autominato.pipeline.worker import _Claimer

SIG = (((4, 8), "<f4"), ((3,), "<i8"))


@pytest.fixture
def pool():
    p = SlotPool(max_slots=8, budget_bytes=1 << 24)
    yield p
    p.close()


def test_layout_puts_each_array_position_in_a_region_of_its_own_rows():
    sizes, regions, nbytes = layout(SIG, 3)
    assert sizes == [128, 24]
    assert regions == [0, 384]  # 3 rows of 128 bytes, then the next region at a 64-byte line
    assert nbytes == 384 + 128  # 72 bytes rounded up to 64


def test_rows_are_handed_out_in_claim_order_and_a_full_buffer_makes_a_new_one(pool):
    rows = RowAllocator(pool)
    assert rows.claim((1, 0, 0), SIG) == ("norow",)  # run 1 is not open
    rows.open(1, 2)
    a = rows.claim((1, 0, 0), SIG)
    b = rows.claim((1, 5, 0), SIG)
    c = rows.claim((1, 3, 0), SIG)
    assert a[0] == b[0] == c[0] == "row"
    assert a[1] == b[1] != c[1]  # two rows per buffer
    assert a[3] == [0, 256] and b[3] == [128, 256 + 24]
    ra, rb, rc = rows.take((1, 0, 0)), rows.take((1, 5, 0)), rows.take((1, 3, 0))
    assert (ra.row, rb.row, rc.row) == (0, 1, 0) and ra.buf is rb.buf
    assert rows.take((1, 0, 0)) is None and rows.pending() == 0
    # The full buffer goes back to the pool when both its rows are free, not before.
    rows.release(ra)
    assert len(pool._free) == 0
    rows.release(rb)
    assert [s.name for s in pool._free] == [a[1]]
    # The forming buffer (one row out) goes back when its run ends and its row is free.
    rows.close_run(1)
    assert len(pool._free) == 1
    rows.release(rc)
    assert len(pool._free) == 2
    assert rows.claim((1, 9, 0), SIG) == ("norow",)  # closed


def test_samples_of_other_shapes_fill_buffers_of_their_own_and_runs_never_share_one(pool):
    from autominato.pipeline.rows import MAX_FORMING

    rows = RowAllocator(pool)
    rows.open(1, 4)
    rows.open(2, 4)
    a = rows.claim((1, 0, 0), SIG)
    b = rows.claim((2, 0, 0), SIG)
    other = (((5, 8), "<f4"), ((3,), "<i8"))
    c = rows.claim((1, 1, 0), other)
    d = rows.claim((1, 2, 0), SIG)
    assert len({a[1], b[1], c[1]}) == 3 and d[1] == a[1]  # the first shape's buffer goes on
    ra = rows.take((1, 0, 0))
    assert not ra.buf.closed
    # More shapes than MAX_FORMING at once: the oldest buffer takes no more rows.
    for k in range(MAX_FORMING + 2):  # (some close at once: they end where a batch starts)
        rows.claim((1, 10 + k, 0), (((6 + k, 8), "<f4"),))
    assert ra.buf.closed
    rows.release(ra)
    rows.release(rows.take((1, 2, 0)))
    assert [s.name for s in pool._free] == [a[1]]


def _written(rows, key, sample):
    """What a worker does with a row: claim, write, reply (the descriptor)."""
    prep = prepare(sample)
    ans = rows.claim(key, prep.signature())
    assert ans[0] == "row"
    ref = rows.take(key)
    desc, _ = pack_prepared(prep, ref.buf.slot.mmap, ans[3])
    return ref, unpack(desc, ref.buf.slot.mmap)


def test_a_group_of_consecutive_rows_is_a_view_and_its_buffer_waits_for_the_batch(pool):
    rows = RowAllocator(pool)
    rows.open(1, 2)
    refs, samples = zip(*[_written(rows, (1, i, 0), (np.full((4, 8), i, np.float32),
                                                      torch.arange(3) + 10 * i)) for i in range(2)], strict=True)
    view = RowsView(BatchPool(), refs[0].buf, rows)
    batch = collate(list(samples), view)
    assert rows.views == 2  # both array positions: no copy
    assert batch[0][:, 0, 0].tolist() == [0.0, 1.0] and batch[1].tolist() == [[0, 1, 2], [10, 11, 12]]
    slot = refs[0].buf.slot
    assert batch[0].data_ptr() == slot.addr  # the buffer's memory itself
    del samples
    for r in refs:
        rows.release(r)
    assert slot in pool._free and slot.lent
    # The training loop holds the batch: the pool does not hand its memory out again.
    other = pool.acquire(slot.size)
    assert other is not slot
    del batch
    gc.collect()
    assert pool.acquire(slot.size) is slot  # dropped: reused
    pool.release(other)


def test_rows_out_of_order_or_of_two_buffers_are_copied(pool):
    rows = RowAllocator(pool)
    rows.open(1, 2)
    got = [_written(rows, (1, i, 0), np.full((4, 8), i, np.float32)) for i in range(3)]
    refs = [r for r, _ in got]
    samples = [s for _, s in got]
    # rows 0 and 0 of two buffers: not one run of rows
    batch = collate([samples[0], samples[2]], RowsView(BatchPool(), refs[0].buf, rows))
    assert rows.views == 0 and batch[:, 0, 0].tolist() == [0.0, 2.0]
    # rows 1 then 0 of one buffer: the scheduler sorts them first; unsorted they are copied
    batch = collate([samples[1], samples[0]], RowsView(BatchPool(), refs[0].buf, rows))
    assert rows.views == 0 and batch[:, 0, 0].tolist() == [1.0, 0.0]


def test_a_viewed_slot_keeps_its_pages_and_its_bytes_count_until_the_batch_is_dropped(pool):
    import time

    rows = RowAllocator(pool)
    rows.open(1, 1)
    ref, sample = _written(rows, (1, 0, 0), (np.full((4, 8), 7, np.float32),
                                             torch.full((6,), 1.5, dtype=torch.bfloat16)))
    batch = collate([sample], RowsView(BatchPool(), ref.buf, rows))
    assert rows.views == 2 and batch[1].dtype == torch.bfloat16 and batch[1][0, 0].item() == 1.5
    del sample
    rows.release(ref)
    slot = ref.buf.slot
    assert pool.decay(now=time.monotonic() + 60) == 0 and slot.warm  # no hole under the batch
    held = pool.bytes
    pool.set_max_slots(0)  # dropped from the pool: an orphan whose bytes still count
    assert slot.name not in pool._all and pool.bytes == held
    assert batch[0][0, 0, 0].item() == 7.0 and batch[1][0, 5].item() == 1.5
    del batch
    gc.collect()
    pool.set_max_slots(4)
    pool.acquire(64)
    assert pool.bytes == 4096  # the orphan is forgotten, the new slot counted


def test_without_room_for_a_buffer_a_sample_gets_a_slot_of_its_own_and_no_warning(caplog):
    pool = SlotPool(max_slots=8, budget_bytes=3 * 4096)
    try:
        rows = RowAllocator(pool)
        rows.open(1, 64)  # 64 rows of 4 KiB do not fit 12 KiB
        sig = (((1024,), "<f4"),)
        with caplog.at_level("WARNING"):
            ans = rows.claim((1, 0, 0), sig)
        assert ans[0] == "slot" and ans[2] == 4096 and rows.singles == 1
        assert not [r for r in caplog.records if "cannot grow" in r.getMessage()]
        slot = rows.take((1, 0, 0))
        assert slot is pool._all[ans[1]]
        assert rows.claim((1, 0, 0), sig)[0] == "slot"  # its result is in: a new attempt may
        assert rows.claim((1, 0, 0), sig) == ("norow",)  # but a task claims once
    finally:
        pool.close()


def test_an_error_while_answering_a_claim_refuses_it_and_keeps_the_collector(caplog):
    from types import SimpleNamespace

    from autominato.pipeline.executor import ProcessWorkers

    def boom(key, sig):
        raise OSError(24, "Too many open files")

    with caplog.at_level("WARNING"):
        ans = ProcessWorkers._answer_claim(SimpleNamespace(on_claim=boom), (1, 0, 0), SIG)
    assert ans == ("norow",)
    assert any("Too many open files" in r.getMessage() for r in caplog.records)


def test_a_lent_slot_that_is_still_viewed_is_given_up_when_the_pool_is_full():
    pool = SlotPool(max_slots=1, budget_bytes=1 << 24)
    try:
        rows = RowAllocator(pool)
        rows.open(1, 1)
        ref, sample = _written(rows, (1, 0, 0), np.full((4, 8), 7, np.float32))
        batch = collate([sample], RowsView(BatchPool(), ref.buf, rows))
        del sample
        rows.release(ref)
        # The one slot allowed is viewed by the batch kept: a new one replaces it in the pool,
        # and the batch keeps its memory.
        new = pool.acquire(4096)
        assert new is not None and new is not ref.buf.slot and len(pool._all) == 1
        np.frombuffer(new.mmap, np.uint8)[:] = 0
        assert batch[0, 0, 0].item() == 7.0
    finally:
        pool.close()


class _FakeConn:
    def __init__(self, incoming):
        self.incoming = deque(incoming)
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)

    def recv(self):
        return self.incoming.popleft()


def test_a_worker_waiting_for_its_row_keeps_control_messages_for_after_the_task():
    pending = deque()
    conn = _FakeConn([("threads", 2), None, ("row", "n", 64, [0])])
    claim = _Claimer(conn, pending)
    assert claim((1, 2, 0), SIG) == ("row", "n", 64, [0])
    assert conn.sent == [("claim", (1, 2, 0), SIG)]
    assert list(pending) == [("threads", 2), None]
    assert claim.flush_now() and not claim.flush_now()


# -- through the Loader ---------------------------------------------------------------------

class Bomb:
    """Ends the worker that pickles it the first time (``flag`` does not exist yet): after the
    sample's arrays were written into its row, before its reply."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        import os

        if not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os._exit(3)
        return (str, ("ok",))


class Volumes:
    """Samples of 64 KiB (rows are for samples that would take a slot), 10 ms each (rows are for
    samples that go one per message)."""

    def __init__(self, n: int, bad: frozenset = frozenset(), bomb: tuple = (None, None)) -> None:
        self.n = n
        self.bad = bad
        self.bomb = bomb

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import time

        time.sleep(0.01)
        s = {"x": np.full((32, 32, 16), i, np.float32), "y": torch.full((5,), i), "i": i}
        if i in self.bad:  # written into its row, then fails to pickle: a hole in a buffer
            s["i"] = lambda: i
        if self.bomb[0] is not None:  # every sample has the key (a batch's dicts must match)
            s["b"] = Bomb(self.bomb[1]) if i == self.bomb[0] else "ok"
        return s


def _mapped_shm(tag: str) -> int:
    """Bytes of the pool's shared-memory files that this process maps, unlinked ones included
    (the memory /dev/shm holds for them), from /proc/self/maps."""
    seen = {}
    with open("/proc/self/maps") as f:
        for line in f:
            if tag in line:
                span, _, _, _, inode = line.split()[:5]
                lo, hi = (int(x, 16) for x in span.split("-"))
                seen[inode] = max(seen.get(inode, 0), hi - lo)
    return sum(seen.values())


def _all_free(p) -> bool:
    """Every slot of the pipeline's pool is back in the free list (rows all released)."""
    return {id(x) for x in p.slots._free} == {id(x) for x in p.slots._all.values()}


def _check(batch):
    i = batch["i"]
    assert (batch["x"][:, 0, 0, 0].long() == i).all() and (batch["x"][:, -1, -1, -1].long() == i).all()
    assert (batch["y"][:, 0] == i).all()
    return i.tolist()


def test_batches_kept_by_the_training_loop_are_never_overwritten():
    with Loader(Volumes(48), batch_size=4, num_workers=2, shuffle=True, autotune=False) as L:
        L._pipeline.slots.budget_bytes = 12 * (32 * 32 * 16 * 4 * 4 + 4096)  # 12 buffers
        kept = []
        for _ in range(3):
            seen = []
            for b in L:
                seen += _check(b)
                kept.append(b)
            assert sorted(seen) == list(range(48))
        p = L._pipeline
        assert p.rows.views > 0  # the batches were views of rows
        # The kept batches filled the budget: later samples had no buffer, and the pool held
        # no more /dev/shm than its budget, the kept batches' included.
        assert p.rows.refused + p.rows.singles > 0
        assert p.slots.bytes <= p.slots.budget_bytes
        assert _mapped_shm(p.slots._tag) <= p.slots.budget_bytes  # what /dev/shm really holds
        for b in kept:  # every batch of the three epochs still holds its own samples
            _check(b)


def test_a_sample_that_fails_after_its_row_was_written_leaves_a_hole_and_loses_nothing_else():
    bad = frozenset({3, 17, 30})
    with Loader(Volumes(40, bad), batch_size=4, num_workers=2, shuffle=True, on_error="skip",
                autotune=False, prefetch_next_epoch=False) as L:
        for _ in range(2):
            seen = []
            for b in L:
                seen += _check(b)
            del b
            assert sorted(seen) == [i for i in range(40) if i not in bad]
            p = L._pipeline
            assert p.rows.pending() == 0  # every claim's result came in and let its row go
            assert _all_free(p)
        assert p.rows.claims == 80
        # The holes made batches of rows of two buffers: copied, the others views.
        assert 0 < p.rows.views < 2 * 2 * 10


def test_after_a_hole_the_next_batches_are_views_again():
    """One worker, in order: each hole costs one copied batch (36 of the 40 batch arrays are
    views); without moving the buffers' boundaries every batch after the first hole of an
    epoch was copied (4 of 40)."""
    with Loader(Volumes(40, frozenset({3, 17, 30})), batch_size=4, num_workers=1, on_error="skip",
                autotune=False, prefetch_next_epoch=False) as L:
        for _ in range(2):
            seen = [i for b in L for i in _check(b)]
            assert len(seen) == 37
        assert L._pipeline.rows.views >= 32


def test_a_worker_that_dies_between_its_claim_and_its_reply_loses_nothing(tmp_path):
    flag = str(tmp_path / "died")
    with Loader(Volumes(24, bomb=(5, flag)), batch_size=4, num_workers=2, shuffle=True,
                autotune=False, prefetch_next_epoch=False) as L:
        seen = []
        for b in L:
            seen += _check(b)
        del b
        assert sorted(seen) == list(range(24))  # sample 5 went again, in a new worker
        p = L._pipeline
        assert p.procs.restarts >= 1 and p.rows.claims == 25
        assert p.rows.pending() == 0 and _all_free(p)


def test_a_users_collate_keeps_slots():
    with Loader(Volumes(8), batch_size=2, num_workers=2, autotune=False,
                collate_fn=lambda b: b) as L:
        assert len(list(L)) == 4
        assert L._pipeline.rows.claims == 0


class Uneven(Volumes):
    """Volumes whose samples in ``slow`` take 80 ms (the others finish first) and whose
    samples in ``broken`` raise in ``__getitem__`` (before any row is claimed)."""

    def __init__(self, n: int, bad: frozenset = frozenset(), slow: frozenset = frozenset(),
                 broken: frozenset = frozenset()) -> None:
        super().__init__(n, bad)
        self.slow = slow
        self.broken = broken

    def __getitem__(self, i: int):
        import time

        if i in self.slow:
            time.sleep(0.08)
        if i in self.broken:
            raise ValueError(f"sample {i} is broken")
        return super().__getitem__(i)


def _chunks(seq, n):
    return [list(seq[k:k + n]) for k in range(0, len(seq), n)]


def test_in_order_batches_are_views_of_rows_in_sampler_order():
    """in_order=True: a sample's row is its place in the sampler's batch, whatever order the
    samples finish in; every batch is the DataLoader's, and is views of one buffer."""
    with Loader(Uneven(24, slow=frozenset({1, 6, 13, 22})), batch_size=4, num_workers=2,
                in_order=True, autotune=False, prefetch_next_epoch=False) as L:
        for _ in range(2):
            assert [_check(b) for b in L] == _chunks(range(24), 4)
        p = L._pipeline
        assert p.rows.claims == 48 and p.rows.pending() == 0
        assert p.rows.views == 2 * 6 * 2  # "x" and "y" of every batch: no copy
        gc.collect()
        assert _all_free(p)


def test_in_order_rows_move_past_samples_that_fail_before_or_after_their_claim():
    """Skipped samples shorten the epoch, not a batch: the batches after one are made of the
    next samples, so the rows move with them. With one worker a failure is known before the
    samples after it claim rows: a hole costs its batch and at most the next, not the rest of
    the epoch. Sample 3 fails after its row was written, 9 before it claims one."""
    lost = {3, 9, 30}
    with Loader(Uneven(40, bad=frozenset({3, 30}), broken=frozenset({9}), slow=frozenset({2, 20})),
                batch_size=4, num_workers=1, in_order=True, on_error="skip", autotune=False,
                prefetch_next_epoch=False) as L:
        for _ in range(2):
            got = [_check(b) for b in L]
            assert got == _chunks([i for i in range(40) if i not in lost], 4)
        p = L._pipeline
        # 10 batches an epoch, each hole costs at most its batch and the next: >= 4 views.
        assert p.rows.views >= 2 * 2 * 4
        assert p.rows.pending() == 0 and _all_free(p)


@pytest.mark.parametrize("in_order", [True, False])
def test_a_batch_samplers_batches_are_views_of_rows(in_order):
    groups = [[5, 0, 7], [3, 4], [1, 2, 6, 8], [9], [11, 10]]
    with Loader(Uneven(12, slow=frozenset({5, 3})), batch_sampler=groups, num_workers=2,
                in_order=in_order, autotune=False, prefetch_next_epoch=False) as L:
        for _ in range(2):
            got = [_check(b) for b in L]
            assert (got if in_order else sorted(got)) == (groups if in_order else sorted(groups))
        p = L._pipeline
        assert p.rows.views == 2 * 2 * len(groups)
        assert p.rows.pending() == 0


def test_in_order_rows_follow_positions_and_a_taken_row_gets_a_slot_of_its_own(pool):
    rows = RowAllocator(pool)
    rows.open(1, 3, in_order=True)
    a = rows.claim((1, 4, 0), SIG)  # position 4: row 1 of the second batch (positions 3-5)
    b = rows.claim((1, 3, 0), SIG)  # row 0 of it
    assert a[1] == b[1] and (a[3][0], b[3][0]) == (128, 0)
    rows.hole(1, 0)  # position 0 will not be delivered: batches 1-3 | 4-6 | ...
    c = rows.claim((1, 5, 0), SIG)  # now row 1 of the second batch: position 4 has it
    assert c[0] == "slot"
    d = rows.claim((1, 6, 0), SIG)  # row 2 of the second batch: the same buffer
    assert d[1] == a[1] and d[3][0] == 2 * 128
    e = rows.claim((1, 7, 0), SIG)  # that buffer is full: the third batch's row 0, a new one
    assert e[0] == "row" and e[1] != a[1] and e[3][0] == 0
    single = rows.take((1, 5, 0))
    assert type(single) is not RowRef
    pool.release(single)
    for key in ((1, 4, 0), (1, 3, 0), (1, 6, 0), (1, 7, 0)):
        rows.release(rows.take(key))
    rows.close_run(1)
    assert rows.pending() == 0 and len(pool._free) == len(pool._all) == 3


def test_batch_sampler_rows_are_the_members_places_in_their_batch(pool):
    rows = RowAllocator(pool)
    rows.open(1, 1, groups=[3, 1, 2])  # batches: positions 0-2, 3, 4-5
    e = rows.claim((1, 5, 0), SIG)
    c = rows.claim((1, 2, 0), SIG)
    a = rows.claim((1, 0, 0), SIG)
    assert a[1] == c[1] != e[1]
    assert a[3][0] == 0 and c[3][0] == 2 * 128 and e[3][0] == 128
    ra, rc = rows.take((1, 0, 0)), rows.take((1, 2, 0))
    assert ra.buf.rows == 3 and (ra.row, rc.row) == (0, 2)
    # Position 1 was skipped: its batch is made of rows 0 and 2 (a copy); once they are
    # released the buffer takes no more rows and goes back to the pool.
    rows.release(ra)
    rows.release(rc)
    assert ra.buf.closed and ra.buf.slot in pool._free
    rows.release(rows.take((1, 5, 0)))
    rows.close_run(1)
    assert len(pool._free) == 2


def _lent_batch(pool):
    """A one-row batch viewing a slot of ``pool`` that is back in its free list."""
    rows = RowAllocator(pool)
    rows.open(1, 1)
    ref, sample = _written(rows, (1, 0, 0), np.full((1024,), 7, np.float32))
    batch = collate([sample], RowsView(BatchPool(), ref.buf, rows))
    del sample
    rows.release(ref)
    return batch, ref.buf.slot


def test_a_viewed_slot_is_not_given_up_when_that_frees_no_room():
    pool = SlotPool(max_slots=1, budget_bytes=4096)
    try:
        batch, slot = _lent_batch(pool)
        # Count and budget both full: dropping the viewed slot would keep its bytes (an
        # orphan) and still leave no room; it stays, reusable once the batch is dropped.
        assert pool.acquire(4096) is None
        assert slot.name in pool._all and not pool._orphans
        del batch
        gc.collect()
        assert pool.acquire(4096) is slot
    finally:
        pool.close()


def test_an_orphan_is_unmapped_at_the_next_decay_once_its_batch_is_dropped():
    pool = SlotPool(max_slots=1, budget_bytes=1 << 20)
    try:
        batch, slot = _lent_batch(pool)
        pool.set_max_slots(0)
        assert pool._orphans == [slot] and pool.resident_bytes() == slot.size
        assert _mapped_shm(pool._tag) == slot.size  # unlinked, still mapped: the batch's
        del batch
        gc.collect()
        pool.decay()
        assert not pool._orphans and pool.bytes == 0 and pool.resident_bytes() == 0
        assert _mapped_shm(pool._tag) == 0
    finally:
        pool.close()


def test_a_batch_buffer_that_dev_shm_cannot_hold_does_not_cap_the_pool(monkeypatch, caplog):
    import errno

    from autominato.pipeline import shm

    pool = SlotPool(max_slots=8, budget_bytes=1 << 30)
    try:
        real = shm.Slot

        def small_only(name, size):
            if size > 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(name, size)

        monkeypatch.setattr(shm, "Slot", small_only)
        rows = RowAllocator(pool)
        rows.open(1, 64)
        tried = []
        monkeypatch.setattr(shm, "Slot", lambda name, size: (tried.append(size), small_only(name, size))[1])
        with caplog.at_level("WARNING"):
            ans = rows.claim((1, 0, 0), (((65536,), "<f4"),))  # a 16 MiB buffer, a 256 KiB slot
        assert ans[0] == "slot" and pool.max_slots == 8
        assert not [r for r in caplog.records if "bytes free" in r.getMessage()]
        # The next claims do not try the refused size again at once (each try fills /dev/shm
        # up to the refusal, in the collector thread); they reuse the sample's slot.
        pool.release(rows.take((1, 0, 0)))
        for i in range(1, 4):
            assert rows.claim((1, i, 0), (((65536,), "<f4"),))[0] == "slot"
            pool.release(rows.take((1, i, 0)))
        assert sum(size > 1 << 20 for size in tried) == 1
    finally:
        pool.close()


def test_after_a_hole_or_a_rowless_completion_buffers_end_where_batches_now_start(pool):
    rows = RowAllocator(pool)
    rows.open(1, 4)
    names = [rows.claim((1, i, 0), SIG)[1] for i in range(6)]
    assert names[:4] == [names[0]] * 4 and names[4] == names[5] != names[0]
    # Claim 1 turns out a hole: completions 0, 2, 3, 4 form the first batch, so batches now
    # start at claims 5, 9, 13. The buffer of claims 4 and 5 cannot end at 5 any more: it
    # ends at 8 (its 4 rows), claim 8 gets a buffer of one row, and from claim 9 on a buffer
    # is a batch again (two batches copied, none after).
    rows.shift(1, +1)
    for i in range(6, 14):
        rows.claim((1, i, 0), SIG)
    buf = {i: rows._claims[(1, i, 0)].buf for i in range(4, 14)}
    assert buf[4] is buf[7] and (buf[4].start, buf[4].cap) == (4, 4)
    assert (buf[8].start, buf[8].cap) == (8, 1)
    assert buf[9] is buf[12] and (buf[9].start, buf[9].cap) == (9, 4)
    assert (buf[13].start, buf[13].cap) == (13, 4)
    # A completion without a row (a small sample, or one given a slot of its own) moves them
    # back by one: batches start at claims 12 and 16, so the buffer being filled (claim 13)
    # takes 3 rows.
    rows.shift(1, -1)
    assert buf[13].cap == 3 and not buf[13].closed
    for i in range(14, 17):
        rows.claim((1, i, 0), SIG)
    assert rows._claims[(1, 15, 0)].buf is buf[13] and buf[13].closed
    assert rows._claims[(1, 16, 0)].buf.cap == 4


def test_with_samples_of_two_shapes_interleaved_buffers_still_end_where_batches_start(pool):
    rows = RowAllocator(pool)
    rows.open(1, 4)
    A, B = SIG, (((5, 8), "<f4"),)
    for i, sig in enumerate([A, B, A, B, A]):
        rows.claim((1, i, 0), sig)
    buf = {i: rows._claims[(1, i, 0)].buf for i in range(5)}
    # Batches start at claims 0 and 4, whichever shape claims: B's buffer (from claim 1) was
    # made for 3 rows and ends after claim 3; A's first ends after claim 2; claim 4 starts one.
    assert (buf[1].rows, buf[1].claimed) == (3, 2) and buf[1].closed and buf[1] is buf[3]
    assert buf[1].slot.size >= layout(B, 3)[2]
    assert buf[0] is buf[2] and buf[0].closed and buf[4] is not buf[0] and buf[4].start == 4
    # A hole moves the next batch's start to claim 5, the next claim: A's new buffer ends now.
    rows.shift(1, +1)
    assert buf[4].closed and buf[4].claimed == 1



def test_beyond_max_placed_buffers_a_later_batch_gets_slots_and_the_earliest_keep_theirs():
    from autominato.pipeline.rows import MAX_PLACED

    pool = SlotPool(max_slots=64, budget_bytes=1 << 24)
    try:
        rows = RowAllocator(pool)
        rows.open(1, 2, in_order=True)
        first = [rows.claim((1, 2 * g, 0), SIG) for g in range(MAX_PLACED)]  # a row each
        assert all(a[0] == "row" for a in first)
        assert rows.claim((1, 2 * MAX_PLACED, 0), SIG)[0] == "slot"  # one batch too many
        head = rows.claim((1, 1, 0), SIG)  # the head batch (delivered next) still fills its own
        assert head[0] == "row" and head[1] == first[0][1]
        for key in list(rows._claims):
            ref = rows.take(key)
            rows.release(ref) if type(ref) is RowRef else pool.release(ref)
        rows.close_run(1)
        assert rows.pending() == 0 and len(pool._free) == len(pool._all)
    finally:
        pool.close()
