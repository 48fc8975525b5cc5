"""Shared-memory slots: reuse, growth within the count limit, packing round trips of arrays,
tensors of every dtype and tensor subclasses."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

from autominato.pipeline.shm import SlotPool, leftover_segments, pack, packed_nbytes, unpack


def test_slot_pool_grows_by_replacing_a_free_slot_and_never_hands_out_a_dropped_one():
    before = set(leftover_segments(os.getpid()))  # live Loaders of earlier tests hold theirs
    pool = SlotPool(max_slots=2, budget_bytes=1 << 30)
    a, b = pool.acquire(4096), pool.acquire(4096)
    pool.release(a)
    pool.release(b)
    c = pool.acquire(10_000)  # no free slot is big enough: one small free slot is replaced
    assert c is not None and c.size >= 10_000 and len(pool._all) == 2
    d = pool.acquire(20_000)
    assert d is not None and d.size >= 20_000 and d is not c
    assert pool.acquire(1) is None  # both slots are held
    pool.release(c)
    assert pool.acquire(5_000) is c  # reuse, smallest fitting
    pool.release(c)
    pool.release(d)
    pool.set_max_slots(1)
    assert len(pool._all) == 1
    pool.close()
    assert set(leftover_segments(os.getpid())) - before == set()


def test_slot_pool_respects_its_byte_budget():
    pool = SlotPool(max_slots=10, budget_bytes=3 * 4096)
    held = [pool.acquire(4096) for _ in range(3)]
    assert all(s is not None for s in held)
    assert pool.acquire(4096) is None and pool.bytes == 3 * 4096
    pool.close()


def test_pack_round_trip_keeps_arrays_tensors_and_objects():
    sample = {
        "image": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        "label": torch.arange(6, dtype=torch.uint8).reshape(2, 3),
        "meta": ("case_00001", 3, [np.int64(5)]),
    }
    pool = SlotPool(max_slots=1, budget_bytes=1 << 20)
    slot = pool.acquire(packed_nbytes(sample))
    desc, need = pack(sample, slot.mmap)
    assert need == packed_nbytes(sample) > 0
    out = unpack(desc, slot.mmap, copy=True)
    np.testing.assert_array_equal(out["image"], sample["image"])
    assert isinstance(out["label"], torch.Tensor) and torch.equal(out["label"], sample["label"])
    assert out["meta"][0] == "case_00001" and out["meta"][2][0] == 5
    # Too small a buffer: the sample travels inline (pickled) and still reports its size.
    desc, need2 = pack(sample, None)
    assert need2 == need
    np.testing.assert_array_equal(unpack(desc, None)["image"], sample["image"])
    pool.close()


def test_segments_of_a_killed_loader_are_reaped_by_the_next_pool(tmp_path):
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal\n"
        "from autominato.pipeline.shm import SlotPool\n"
        "p = SlotPool(4, 1 << 20)\n"
        "held = [p.acquire(4096) for _ in range(3)]\n"
        "print(os.getpid(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL
    pid = int(out.stdout.split()[0])
    assert len(leftover_segments(pid)) == 4  # three slots and the owner's lock file
    SlotPool(1, 4096).close()  # any new pool reaps what dead owners left
    assert leftover_segments(pid) == []


# ---------------------------------------------------------------------------------------------
# What travels through a slot: tensor subclasses and dtypes that NumPy lacks


class TaggedTensor(torch.Tensor):
    """A user's tensor subclass that carries a Python attribute."""


def _tagged(t: torch.Tensor, tag: str) -> TaggedTensor:
    out = t.as_subclass(TaggedTensor)
    out.tag = tag
    return out


def _round_trips(sample):
    """The sample packed into a slot and unpacked, then packed inline and unpacked."""
    pool = SlotPool(max_slots=1, budget_bytes=1 << 20)
    try:
        slot = pool.acquire(max(4096, packed_nbytes(sample)))
        desc, _ = pack(sample, slot.mmap)
        through_slot = unpack(desc, slot.mmap, copy=True)
        desc, _ = pack(sample, None)
        inline = unpack(desc, None)
        return through_slot, inline
    finally:
        pool.close()


def test_tensor_subclasses_are_arrays_and_come_back_as_their_class_with_their_attributes():
    from autominato.pipeline.shm import is_array

    x = _tagged(torch.arange(6.0).reshape(2, 3), "ct")
    assert is_array(x) and is_array(torch.zeros(2)) and is_array(np.zeros(2))
    for out in _round_trips({"image": x, "label": torch.tensor(1)}):
        assert type(out["image"]) is TaggedTensor and out["image"].tag == "ct"
        assert torch.equal(out["image"].as_subclass(torch.Tensor), x.as_subclass(torch.Tensor))
    # Not carried as bytes, so pickled with the descriptor: object arrays, sparse tensors and
    # Parameters (their own __reduce_ex__), which still come back as they were.
    sparse = torch.eye(3).to_sparse()
    param = torch.nn.Parameter(torch.ones(2))
    assert not any(is_array(o) for o in (np.array([None]), sparse, param, "x", 3))
    for out in _round_trips((sparse, param)):
        assert torch.equal(out[0].to_dense(), torch.eye(3)) and type(out[1]) is torch.nn.Parameter


def test_monai_meta_tensor_comes_back_with_its_metadata():
    import monai.data as monai_data  # the test extra installs MONAI
    meta = {"filename_or_obj": "case_00001.nii.gz", "spacing": (1.0, 0.8, 0.8)}
    x = monai_data.MetaTensor(torch.rand(1, 4, 4, 4), affine=torch.diag(torch.tensor([2.0, 1, 1, 1])), meta=meta)
    for out in _round_trips((x, torch.tensor(0))):
        y = out[0]
        assert type(y) is monai_data.MetaTensor and torch.equal(y.as_tensor(), x.as_tensor())
        assert y.meta["filename_or_obj"] == "case_00001.nii.gz" and y.meta["spacing"] == (1.0, 0.8, 0.8)
        assert torch.equal(y.affine, x.affine) and y.is_batch is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.bool])
def test_dtypes_travel_bit_exact_including_those_numpy_lacks(dtype):
    x = (torch.randn(3, 5) * 100).to(dtype)
    for out in _round_trips({"x": x, "scalar": torch.tensor(1.5, dtype=dtype)}):
        assert out["x"].dtype == dtype and out["scalar"].dtype == dtype and out["scalar"].shape == ()
        if x.element_size() == 1:  # torch.equal has no kernel for float8; compare the bits
            assert torch.equal(out["x"].view(torch.uint8), x.view(torch.uint8))
        else:
            assert torch.equal(out["x"], x)


def test_non_contiguous_conjugated_and_grad_tensors_travel_as_their_values():
    sample = [
        torch.arange(12.0).reshape(3, 4).t(),
        torch.tensor([1 + 2j, 3 - 1j]).conj(),
        torch.ones(3, requires_grad=True),
        np.arange(10)[::-2],
        np.array(["2024-01-02"], dtype="datetime64[D]"),
    ]
    for out in _round_trips(sample):
        assert torch.equal(out[0], sample[0]) and torch.equal(out[1], sample[1].resolve_conj())
        assert torch.equal(out[2], torch.ones(3)) and not out[2].requires_grad
        np.testing.assert_array_equal(out[3], sample[3])
        assert out[4].dtype == sample[4].dtype and out[4][0] == sample[4][0]


def test_dense_arrays_in_another_memory_order_come_back_with_their_strides():
    # As the DataLoader's workers share a sample's tensors (batch_size=None delivers them as
    # they are): a channels-last image, a transposed tensor, a Fortran-ordered array. Before,
    # each came back C-contiguous. A strided slice (gaps) still travels C-contiguous.
    sample = {
        "cl": torch.arange(60.0).reshape(1, 3, 4, 5).to(memory_format=torch.channels_last)[0],
        "t": torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
        "f": np.asfortranarray(np.arange(12).reshape(3, 4)),
        "gaps": torch.arange(20.0).reshape(4, 5)[:, ::2],
        "c": torch.zeros(2, 3),
    }
    for out in _round_trips(sample):
        for k in ("cl", "t", "f"):
            if k == "f":
                assert out[k].strides == sample[k].strides and out[k].flags.f_contiguous
                np.testing.assert_array_equal(out[k], sample[k])
            else:
                assert out[k].stride() == sample[k].stride(), k
                assert torch.equal(out[k], sample[k])
        assert torch.equal(out["gaps"], sample["gaps"]) and out["gaps"].is_contiguous()
        assert out["c"].is_contiguous()


def test_small_samples_are_sent_inline_and_large_ones_through_a_slot():
    from autominato.pipeline.shm import INLINE_MAX_BYTES, use_slot

    assert not use_slot(packed_nbytes(torch.zeros(4, dtype=torch.int64)))
    assert not use_slot(INLINE_MAX_BYTES - 1) and use_slot(INLINE_MAX_BYTES)
    assert use_slot(packed_nbytes(np.zeros(INLINE_MAX_BYTES, np.uint8)))


def test_samples_of_arrays_and_scalars_come_back_in_order_with_their_container_types():
    image, label = torch.rand(2, 3).bfloat16(), np.arange(4)
    for sample in ((image, 7), [None, label, "a", 2.5], {"image": image, "case": "c1", "label": label}, (3, "x")):
        for out in _round_trips(sample):
            assert type(out) is type(sample) and len(out) == len(sample)
            pairs = zip(out.values(), sample.values(), strict=True) if isinstance(sample, dict) else zip(out, sample, strict=True)
            for got, want in pairs:
                if isinstance(want, (np.ndarray, torch.Tensor)):
                    assert type(got) is type(want) and (got == want).all()
                else:
                    assert got == want and type(got) is type(want)
            if isinstance(sample, dict):
                assert list(out) == list(sample)


def _allocated(slot) -> int:
    """Bytes the slot's segment has allocated now: its own pages, not /dev/shm's use, which
    other processes move (a test beside this one: a CI run read 8.8 of 32 MiB there)."""
    from autominato.pipeline.shm import SHM_DIR

    return os.stat(os.path.join(SHM_DIR, slot.name)).st_blocks * 512


def test_a_decay_pass_with_keep_gives_back_idle_batch_buffers_beyond_the_most_recently_freed():
    """``decay(keep=k)`` (the scheduler's pass while the training loop is the bottleneck):
    however recently freed, idle batch buffers beyond the ``k`` freed last give their pages
    back; one a batch still views keeps them, and so does a slot that was not a batch buffer
    (a sample's own: taken again on the scheduler thread); without ``keep`` only age counts."""
    import time

    size = 8 << 20
    pool = SlotPool(max_slots=8, budget_bytes=1 << 30)
    try:
        a, b, c, lent = (pool.acquire(size, batch=True) for _ in range(4))
        own = pool.acquire(size)
        view = np.frombuffer(lent.mmap, np.uint8)  # a batch the training loop still holds
        lent.lent = True
        for s in (a, b, lent, c, own):  # c the batch buffer freed last; lent still viewed
            pool.release(s)
            time.sleep(0.01)
        assert pool.decay() == 0  # all freed well within DECAY_S
        assert all(_allocated(x) >= size * 0.9 for x in (a, b, c, lent, own))
        assert pool.resident_bytes() == 5 * size
        assert pool.decay(keep=1) == 2  # a and b: given back however recent
        assert c.warm and lent.warm and own.warm and not a.warm and not b.warm
        assert all(_allocated(x) <= size * 0.1 for x in (a, b))
        assert all(_allocated(x) >= size * 0.9 for x in (c, lent, own))
        assert pool.decay(keep=1) == 0  # the one kept stays kept
        del view
        assert pool.decay(keep=1) == 1  # no view left: lent is idle, and c was freed after it
        assert c.warm and not lent.warm
        assert pool.decay(keep=0) == 1 and not c.warm and own.warm
        assert pool.resident_bytes() == size  # own's
        again = pool.acquire(size, batch=True)  # the warm one first, as a batch buffer now
        assert again is own and again.batch
        cold = pool.acquire(size)  # a cold one is reserved again when handed out
        assert cold.warm and not cold.batch and pool.resident_bytes() == 2 * size
    finally:
        pool.close()


def test_a_free_slot_unused_for_the_decay_time_gives_its_memory_back_and_is_reserved_again(
        monkeypatch):
    import mmap
    import time

    from autominato.pipeline import shm

    monkeypatch.setattr(shm, "DECAY_S", 0.2)
    size = 32 << 20
    pool = SlotPool(max_slots=4, budget_bytes=1 << 30)
    try:
        hot, cold = pool.acquire(size), pool.acquire(size)
        # A worker's own mapping of the cold slot, as a worker's SlotCache holds it.
        fd = os.open(os.path.join(shm.SHM_DIR, cold.name), os.O_RDWR)
        theirs = mmap.mmap(fd, size)
        os.close(fd)
        theirs[:4] = b"abcd"
        pool.release(cold)
        time.sleep(0.3)
        pool.release(hot)

        assert _allocated(cold) >= size * 0.9 and _allocated(hot) >= size * 0.9
        assert pool.resident_bytes() == 2 * size
        assert pool.decay() == 1  # the scheduler's tick: only the slot free for 0.3 s
        assert pool.resident_bytes() == size
        assert _allocated(cold) <= size * 0.1  # the cold slot's 32 MiB went back, not hot's
        assert _allocated(hot) >= size * 0.9
        assert not cold.warm and hot.warm
        assert theirs[:4] == b"\0\0\0\0"  # the worker's mapping stays valid, now zeros
        # The warm slot is handed out first; the cold one is reserved again when taken.
        assert pool.acquire(size) is hot
        again = pool.acquire(size)
        assert again is cold and cold.warm and _allocated(cold) >= size * 0.9
        theirs[:4] = b"wxyz"
        assert bytes(cold.mmap[:4]) == b"wxyz"  # one segment still, seen from both mappings
        theirs.close()
    finally:
        pool.close()


def test_closing_the_pool_under_an_array_made_on_a_slot_keeps_its_memory_mapped():
    """``unpack`` makes a sample's arrays with ``np.ndarray(buffer=slot.mmap)``, which holds a
    reference to the mapping but no buffer export; a pool closed (``keep_referenced``: a
    thread may still be at work) while the batch thread still collates such a sample must
    not unmap the memory under it (review 99: SIGSEGV). Run in a child process: an unmapped
    read kills it."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from autominato.pipeline.shm import SlotPool\n"
        "p = SlotPool(4, 1 << 22)\n"
        "s = p.acquire(1 << 20)\n"
        "a = np.ndarray((1 << 18,), np.float32, buffer=s.mmap)\n"
        "a[:] = 7.0\n"
        "p.close(keep_referenced=True)\n"
        "print(float(a.sum()), flush=True)\n"
        "m = s.mmap\n"
        "del a, s\n"  # the last array gone: the pool's close left the rest to it
        "import sys\n"
        "print(sys.getrefcount(m) == 2 and not m.closed, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    total, only_ref = out.stdout.split()
    assert float(total) == 7.0 * (1 << 18)
    assert only_ref == "True"


def test_closing_the_pool_unmaps_a_slot_that_no_view_exports():
    """Without ``keep_referenced`` (no thread at work) a mapping is unmapped also under a
    reference, so that no process forked later inherits a closed pool's memory."""
    pool = SlotPool(max_slots=2, budget_bytes=1 << 22)
    slot = pool.acquire(1 << 20)
    other = pool.acquire(1 << 20)
    held = np.ndarray((16,), np.uint8, buffer=other.mmap)
    pool.close()
    assert slot.mmap.closed and other.mmap.closed
    del held


def test_a_containers_attributes_that_mirror_its_items_travel_once_and_stay_its_items():
    """Review 112: an EasyDict-like sample's attributes held its arrays too, so the copy that
    crossed the processes pickled each array into the descriptor beside the slot's copy."""
    import mmap

    from tests.test_parity import Mirrored

    sample = Mirrored(image=np.ones((512, 1024), np.float32), label=3)  # 2 MiB
    buf = mmap.mmap(-1, 4 << 20)
    desc, need = pack(sample, buf)
    assert need >= sample["image"].nbytes and len(desc) < 4096  # the array went to the slot
    out = unpack(desc, buf)
    assert type(out) is Mirrored and out.image is out["image"] and out.label == 3
    assert np.shares_memory(out.image, np.frombuffer(buf, np.uint8))
    assert np.array_equal(out.image, sample["image"])
    del out


class Encoding(collections.UserDict):
    def __init__(self, data=None, tag=None):
        super().__init__(data)
        self.tag = tag


def test_a_userdict_samples_arrays_go_to_the_slot_and_it_comes_back_as_its_type():
    """A ``UserDict`` (transformers' ``BatchEncoding`` is one) was left whole in the
    descriptor, its arrays pickled into it rather than written to the slot."""
    import mmap

    sample = Encoding({"ids": np.arange(1 << 18), "mask": torch.ones(1 << 18)}, tag="t")
    buf = mmap.mmap(-1, 4 << 20)
    desc, need = pack(sample, buf)
    assert need == packed_nbytes(sample) >= 3 << 20 and len(desc) < 4096
    out = unpack(desc, buf)
    assert type(out) is Encoding and out.tag == "t" and list(out) == ["ids", "mask"]
    assert np.array_equal(out["ids"], sample["ids"]) and torch.equal(out["mask"], sample["mask"])
    assert sample.data is not out.data  # the sample given is left as it was
    del out


class AdoptsState(dict):
    """Its ``__setstate__`` adopts the state dict: a copy shares the original's ``__dict__``."""

    def __setstate__(self, state):
        self.__dict__ = state


class Validated(dict):
    """Pickles through a constructor that needs its items (review 113: the emptied copy
    pickled, then failed to unpickle in the training process)."""

    def __init__(self, d):
        if "image" not in d:
            raise KeyError("image required")
        super().__init__(d)

    def __reduce__(self):
        return type(self), (dict(self),)


class Counted(dict):
    """Its pickled state is read from its items (review 113: it read an emptied copy's)."""

    def __getstate__(self):
        return {"n": len(self)}

    def __setstate__(self, state):
        self.n = state["n"]


class SlottedPair(list):
    __slots__ = ("first",)


class Wrapping(dict):
    """As easydict's EasyDict: items are attributes, and a list is stored anew (wrapped), so
    a copy's attribute is not the original's item (review 113)."""

    def __setattr__(self, name, value):
        if isinstance(value, list):
            value = list(value)
        super().__setattr__(name, value)
        super().__setitem__(name, value)

    __setitem__ = __setattr__


def test_subclasses_with_their_own_state_cross_intact_and_the_sample_is_left_as_it_was():
    import mmap

    from autominato.pipeline.collate import to_device

    buf = mmap.mmap(-1, 8 << 20)
    big = np.ones((256, 1024), np.float32)  # 1 MiB
    a = AdoptsState(x=big.copy(), y=1)
    a.x = a["x"]
    out = unpack(pack(a, buf)[0], buf)
    assert type(out) is AdoptsState and out.x is out["x"] and a.x is a["x"]  # a untouched
    b = AdoptsState(x=torch.ones(2))
    b.x = b["x"]
    moved = to_device(b, "meta")
    assert moved.x.device.type == "meta" and b.x.device.type == "cpu"
    out = unpack(pack(Validated({"image": big.copy(), "label": 1}), buf)[0], buf)
    assert type(out) is Validated and np.array_equal(out["image"], big) and out["label"] == 1
    c = Counted(image=big.copy(), label=2)
    c.n = 2
    out = unpack(pack(c, buf)[0], buf)
    assert type(out) is Counted and out.n == 2 and len(out) == 2
    s = SlottedPair([big.copy(), 1])
    s.first = s[0]
    desc, need = pack(s, buf)
    assert len(desc) < 4096 and need >= big.nbytes  # the array went to the slot, once
    out = unpack(desc, buf)
    assert type(out) is SlottedPair and out.first is out[0] and np.array_equal(out[0], big)
    w = Wrapping()
    w["boxes"] = [big.copy()]
    desc, _ = pack(w, buf)
    assert len(desc) < 4096  # the wrapped list's array is not pickled in the attribute
    out = unpack(desc, buf)
    assert type(out) is Wrapping and out.boxes is out["boxes"] and np.array_equal(out.boxes[0], big)
    del out


def test_samples_without_arrays_cross_as_they_are_or_as_plain_containers():
    import collections

    od = collections.OrderedDict([("b", "s"), ("a", [1, 2])])
    out = unpack(pack(od, None)[0], None)
    assert type(out) is collections.OrderedDict and list(out.items()) == list(od.items())
    local = collections.defaultdict(lambda: 0, x=1)  # (a factory that does not pickle)
    out = unpack(pack([local, collections.Counter(a=2)], None)[0], None)
    assert type(out[0]) is dict and out[0] == {"x": 1} and out[1] == collections.Counter(a=2)


class Refusing(dict):
    """Pickles its own way and refuses anything but arrays as items (review 114: it crossed
    filled with the placeholders, failed, and came as a plain dict without its attribute)."""

    def __setitem__(self, k, v):
        if not isinstance(v, (np.ndarray, torch.Tensor)):
            raise TypeError("arrays only")
        super().__setitem__(k, v)

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)


class _CountsItems:
    def __getstate__(self):
        return {"n": len(self)}

    def __setstate__(self, state):
        self.n = state["n"]


class MixedIn(dict, _CountsItems):
    """Its pickling comes from a mixin after dict in its bases (review 114)."""


def test_classes_that_pickle_their_own_way_keep_their_state():
    import mmap

    buf = mmap.mmap(-1, 1 << 20)
    r = Refusing()
    r["a"] = np.zeros(2)
    r.meta = "m"
    out = unpack(pack({"s": r, "x": np.ones(1)}, buf)[0], buf)["s"]
    assert type(out) is Refusing and out.meta == "m" and np.array_equal(out["a"], np.zeros(2))
    m = MixedIn(a=np.ones(2), b=1)
    out = unpack(pack(m, buf)[0], buf)
    assert type(out) is MixedIn and out.n == 2 and len(out) == 2
    del out


def test_a_pool_being_made_is_never_reaped_and_its_lock_is_not_held_by_fork_children(
        monkeypatch):
    """Review 194: a reaper (another process's new pool, a fork server on its way out)
    that ran between the creation of a pool's lock file and its flock took the lock and
    unlinked the file, so the pool's segments were never reaped once its owner died. And a
    child forked from the owner held a copy of the lock (trial 193)."""
    import fcntl

    from autominato.pipeline import shm

    real = fcntl.flock
    ran = []

    def flock_after_a_reaper(fd, op):
        if op == fcntl.LOCK_EX and not ran:  # (the pool's own, blocking)
            ran.append(True)
            pid = os.fork()
            if pid == 0:  # a reaper in another process, in the window
                shm.reap_stale_segments()
                os._exit(0)
            os.waitpid(pid, 0)
        return real(fd, op)

    monkeypatch.setattr(shm.fcntl, "flock", flock_after_a_reaper)
    pool = SlotPool(max_slots=2, budget_bytes=1 << 20)
    monkeypatch.setattr(shm.fcntl, "flock", real)
    try:
        assert ran and os.path.exists(pool._lockfile)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a child of the owner: it holds no copy of the lock
            os.close(r)
            fds = [f for f in os.listdir("/proc/self/fd")
                   if os.path.realpath(f"/proc/self/fd/{f}") == os.path.realpath(pool._lockfile)]
            os.write(w, str(len(fds)).encode())
            os._exit(0)
        os.close(w)
        held = int(os.read(r, 16))
        os.close(r)
        os.waitpid(pid, 0)
        assert held == 0
        # the owner's own lock is held: no reaper takes it
        fd = os.open(pool._lockfile, os.O_RDWR)
        try:
            with pytest.raises(OSError):
                real(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        pool.close()
