"""Shared-memory slots: reuse, growth within the count limit, packing round trips."""

from __future__ import annotations

import os

import numpy as np
import torch

from autominato.pipeline.shm import SlotPool, leftover_segments, pack, packed_nbytes, unpack


def test_slot_pool_grows_by_replacing_a_free_slot_and_never_hands_out_a_dropped_one():
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
    assert leftover_segments(os.getpid()) == []


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
