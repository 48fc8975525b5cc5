"""Results without a fitting slot travel in an anonymous memory file (memfd) passed beside the
worker's reply: the bytes arrive intact, the file is mapped once and closed, nothing leaks."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from autominato import Loader
from autominato.pipeline import executor as executor_mod
from autominato.pipeline.shm import (
    HAVE_MEMFD,
    MEMFD_MIN_BYTES,
    FdDesc,
    map_memfd,
    pack_memfd,
    packed_nbytes,
    unpack,
)

pytestmark = pytest.mark.skipif(not HAVE_MEMFD, reason="no memfd_create on this system")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_sample_packed_into_a_memory_file_unpacks_equal_after_the_fd_is_closed():
    sample = {"image": np.arange(40_000, dtype=np.float32).reshape(200, 200),
              "label": torch.arange(30_000, dtype=torch.int16), "case": "c7"}
    need = packed_nbytes(sample)
    d = pack_memfd(sample, need)
    assert isinstance(d, FdDesc) and d.fd >= 0
    sent = pickle.loads(pickle.dumps(d))  # what the loader receives: the descriptor alone
    assert type(sent) is FdDesc and sent.fd == -1 and sent.buf is None
    map_memfd(sent, d.fd, need)  # closes the descriptor
    with pytest.raises(OSError):
        os.fstat(d.fd)
    out = unpack(sent.desc, sent.buf)
    assert np.array_equal(out["image"], sample["image"]) and out["case"] == "c7"
    assert torch.equal(out["label"], sample["label"]) and out["label"].dtype == torch.int16


def test_small_results_are_not_worth_a_memory_file():
    small = np.zeros(MEMFD_MIN_BYTES // 8 - 64, dtype=np.float64)
    assert pack_memfd(small, packed_nbytes(small)) is None


class Growing:
    """Sample ``i`` is ``i + 1`` rows of 128 KiB, value ``i``: every sample outgrows the
    slot sized after the ones before it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((i + 1, 32_768), i, dtype=np.float32)


def _one(batch):
    return batch  # batch_size=None keeps each sample as the worker made it


def test_first_and_outgrown_results_come_in_memory_files_intact_and_none_leak(monkeypatch):
    mapped = []
    real = executor_mod.map_memfd
    monkeypatch.setattr(executor_mod, "map_memfd",
                        lambda d, fd, n: (mapped.append(n), real(d, fd, n))[1])
    before = _open_fds()
    with Loader(Growing(), batch_size=None, num_workers=2, autotune=False,
                prefetch_next_epoch=False) as loader:
        for _ in range(2):
            got = {int(x[0, 0]): x for x in loader}
            assert sorted(got) == list(range(12))
            for i, x in got.items():
                assert x.shape == (i + 1, 32_768) and bool((x == i).all())
    # the first sample of each worker has no slot yet; a larger sample outgrows its slot
    assert len(mapped) >= 2 and max(mapped) >= 12 * 32_768 * 4
    assert _open_fds() - before == set()  # each file's descriptor was closed once mapped


def _default_timeout_in_worker(worker_id: int) -> None:
    import socket

    socket.setdefaulttimeout(30)  # as a download helper in a dataset's set-up might


def test_a_default_socket_timeout_keeps_the_workers_connections_blocking():
    """``socket.socket`` makes a socket non-blocking under ``socket.setdefaulttimeout``, and a
    socket on a duplicate descriptor shares that flag with the worker's connection: a worker
    ended at its next ``recv`` (BlockingIOError), the loader's reads could fail the same way."""
    import socket

    socket.setdefaulttimeout(30)
    try:
        with Loader(Growing(), batch_size=None, num_workers=2, autotune=False, timeout=60,
                    prefetch_next_epoch=False, worker_init_fn=_default_timeout_in_worker) as loader:
            for _ in range(2):
                got = {int(x[0, 0]): x for x in loader}
                assert sorted(got) == list(range(12))
                for i, x in got.items():
                    assert x.shape == (i + 1, 32_768) and bool((x == i).all())
            procs = loader._pipeline.procs
            assert procs.restarts == 0  # no worker ended
            conns = [w.conn for w in procs.pool.workers.values()]
            assert conns and all(os.get_blocking(c.fileno()) for c in conns)
    finally:
        socket.setdefaulttimeout(None)


def test_a_reply_with_more_memory_files_than_one_message_carries_arrives_whole(monkeypatch):
    """Linux passes at most 253 descriptors in one SCM_RIGHTS message (more: EINVAL, and the
    worker ended): a chunk of many fast large results flushed at once has more."""
    import multiprocessing as mp
    import threading

    from autominato.pipeline import worker as worker_mod
    from autominato.pipeline.shm import fd_socket

    monkeypatch.setattr(worker_mod, "_fd_sock", None)
    n = 300
    before = _open_fds()
    a, b = mp.Pipe()
    sample = np.zeros(MEMFD_MIN_BYTES // 4, np.float32)
    need = packed_nbytes(sample)
    part = [("ok", k, pack_memfd(sample + k, need), need, 0.0, 0.0, 0.0) for k in range(n)]
    failed: list[BaseException] = []

    def send() -> None:
        try:
            worker_mod._send_with_fds(a, ("many", part), part)
        except BaseException as e:  # noqa: BLE001
            failed.append(e)

    t = threading.Thread(target=send)
    t.start()
    reply = b.recv()
    t.join(10)
    if failed:
        a.close()  # the worker ends on a failed send: its end of the connection closes
    assert failed == []
    assert all(r[2].fd == -1 for r in part)  # the sender closed its descriptors
    sock = fd_socket(b.fileno())
    executor_mod._receive_fds(sock, reply[1])
    for r in reply[1]:
        assert bool((unpack(r[2].desc, r[2].buf) == r[1]).all())
    del reply, r  # the mappings
    sock.close()
    worker_mod._fd_sock[1].close()
    a.close()
    b.close()
    assert _open_fds() - before == set()


def test_a_memory_file_that_cannot_be_made_is_pickled_instead(monkeypatch):
    """A worker out of descriptors (EMFILE), a sandbox that refuses memfd_create (EPERM) or a
    kernel without it (ENOSYS): the result is pickled (pack_memfd gives None), the sample
    does not fail; a refusal is not asked again for every sample."""
    import errno

    from autominato.pipeline import shm

    monkeypatch.setattr(shm, "_memfd_usable", True, raising=False)
    sample = np.zeros(MEMFD_MIN_BYTES, np.uint8)
    calls = []

    def refuse(*args, code=errno.EMFILE):
        calls.append(code)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(shm.os, "memfd_create", refuse)
    assert pack_memfd(sample, packed_nbytes(sample)) is None
    assert pack_memfd(sample, packed_nbytes(sample)) is None
    assert len(calls) == 2  # short of descriptors now: tried again
    monkeypatch.setattr(shm.os, "memfd_create", lambda *a: refuse(code=errno.EPERM))
    assert pack_memfd(sample, packed_nbytes(sample)) is None
    assert pack_memfd(sample, packed_nbytes(sample)) is None
    assert calls == [errno.EMFILE, errno.EMFILE, errno.EPERM]  # refused: not asked again


def test_a_mapped_result_holds_no_descriptor():
    """An ``mmap.mmap`` keeps a duplicate of its file's descriptor while it lives: one open
    file per sample in flight in the training process (with a full slot pool, every
    sample), up to the limit on open files (often 1024)."""
    sample = np.arange(1 << 16, dtype=np.float32)
    need = packed_nbytes(sample)
    d = pack_memfd(sample, need)
    sent = pickle.loads(pickle.dumps(d))
    before = _open_fds()
    map_memfd(sent, d.fd, need)
    # its descriptor closed, none held instead (each listing holds one of its own)
    assert len(_open_fds()) == len(before) - 1
    out = unpack(sent.desc, sent.buf)
    del sent
    assert np.array_equal(out, sample)  # the views keep the mapping
    out[0] = 7.0  # writable, as a slot's views are


def test_a_default_socket_timeout_does_not_stall_the_line_to_the_zygote():
    """The zygote's control socket took the default timeout: every look for its messages
    (meant not to block) waited it out, then took the zygote for dead and killed it."""
    import socket
    import time

    socket.setdefaulttimeout(30)
    try:
        t0 = time.monotonic()
        with Loader(Growing(), batch_size=None, num_workers=2, autotune=False, timeout=60,
                    prefetch_next_epoch=False) as loader:
            assert sorted(int(x[0, 0]) for x in loader) == list(range(12))
            assert not loader._pipeline.procs.pool._zygote.gone
        assert time.monotonic() - t0 < 20
    finally:
        socket.setdefaulttimeout(None)


class Same:
    """24 samples of 256 KiB (value ``i``), each transformed in ~10 ms."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> np.ndarray:
        import time

        time.sleep(0.01)
        return np.full((65_536,), i, dtype=np.float32)


@pytest.mark.parametrize("kw", [dict(collate_fn=default_collate), dict(in_order=True), dict()],
                         ids=["collate_fn", "in_order", "completion"])
def test_a_task_waiting_for_a_worker_holds_no_output_slot_and_only_the_first_comes_in_a_memory_file(
        monkeypatch, kw):
    """With a read stage ahead of the workers (``fuse_read=False``), transform tasks wait in
    a queue for a free worker. Each took its output slot when it was queued: the queued ones
    held slots (memory) the worker was not writing, and those queued before the first result
    (its size unknown) all came in memory files. Taken as a task leaves for its worker: one
    memory file (the first sample), and output slots only for the samples in the worker and
    those waiting for their batch (besides the read stage's input slots); with a user's
    ``collate_fn`` (slots). With the default collate a finished sample claims a batch row
    instead (rows.py), in order too: no memory file at all."""
    mapped = []
    real = executor_mod.map_memfd
    monkeypatch.setattr(executor_mod, "map_memfd",
                        lambda d, fd, n: (mapped.append(n), real(d, fd, n))[1])
    rows = "collate_fn" not in kw
    with Loader(Same(), batch_size=2, num_workers=1, pool_size=8, read_threads=2,
                fuse_read=False, autotune=False, prefetch_next_epoch=False, **kw) as loader:
        for _ in range(2):
            got = sorted(int(v) for b in loader for v in b[:, 0])
            assert got == list(range(24))
        assert (loader._pipeline.rows.claims > 0) is rows
    assert len(mapped) == (0 if rows else 1), mapped
