"""The CUDA paths: batches on the device, pinned host memory, the host-to-device copy on a
side stream and its figures. Skipped where torch sees no CUDA device (CI never has one): run
on a GPU machine with ``python -m pytest tests/test_cuda.py`` (``scripts/device_check.sh``
does, before the GPU bench).

What a defect would look like here: a batch whose values differ from the DataLoader's (a
copy read before it finished, or a pooled pinned buffer refilled while its copy still ran),
a sample delivered twice or never, a copy counted wrongly in ``h2d_bytes_total``, or workers
that break when the training process initialised CUDA before building the loader (they are
forked from it, as the DataLoader's are).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from autominato import Loader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class Volumes:
    """Sample i: a (side, side, side) float32 volume equal to i plus a fixed pattern, and its
    index; large enough (side 64: 1 MiB) that a copy takes long enough to race with."""

    def __init__(self, n: int, side: int = 64) -> None:
        self.n, self.side = n, side
        self.pattern = np.random.default_rng(0).random((side, side, side), np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.pattern + np.float32(i), i


def _expected(ds: Volumes, idx: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.from_numpy(ds[int(i)][0]) for i in idx])


@pytest.mark.parametrize("workers", [0, 2])
def test_device_batches_equal_the_dataloaders_moved_to_the_device(workers):
    ds = Volumes(24)
    want = [(x.cuda(), i.cuda()) for x, i in DataLoader(ds, batch_size=4, num_workers=workers)]
    with Loader(ds, batch_size=4, num_workers=workers, in_order=True, device="cuda",
                autotune=False) as L:
        for epoch in range(2):
            got = list(L)
            assert len(got) == len(want), epoch
            for (x, i), (wx, wi) in zip(got, want, strict=True):
                assert x.is_cuda and i.is_cuda and x.device == torch.device("cuda", 0)
                assert x.dtype == torch.float32 and x.shape == (4, 64, 64, 64)
                assert torch.equal(i, wi) and torch.equal(x, wx)


def test_completion_order_on_the_device_delivers_each_sample_once_per_epoch():
    ds = Volumes(30)
    with Loader(ds, batch_size=4, shuffle=True, seed=3, num_workers=2, device="cuda") as L:
        for epoch in range(3):
            seen = []
            for x, i in L:
                # used at once on the training loop's stream: it must see the copied values
                assert torch.equal(x, _expected(ds, i.cpu()).cuda()), epoch
                seen += i.tolist()
            assert sorted(seen) == list(range(30)), epoch


def test_batches_kept_across_an_epoch_are_not_overwritten_by_later_copies():
    # The pinned host buffers are pooled: one refilled while its copy still ran, or a device
    # batch freed to the caching allocator while in use, would show as changed values here.
    ds = Volumes(40)
    with Loader(ds, batch_size=2, num_workers=2, device="cuda", autotune=False) as L:
        kept = [(x, i) for x, i in L]
        torch.cuda.synchronize()
        for x, i in kept:
            assert torch.equal(x.cpu(), _expected(ds, i.cpu()))


def test_the_loop_waits_for_a_copy_still_running_on_the_side_stream(monkeypatch):
    # ~0.1 s of GPU work queued on the side stream before each copy: the batch reaches the
    # loop long before its copy ends, so a loop stream that did not wait on the copy's event
    # would read the new allocation (zeros, or a former batch's values: each sample is
    # checked against its own index, and each index comes once).
    from autominato.pipeline import scheduler as S

    real = S.Pipeline._transfer

    def delayed(self, key, job):
        stream = getattr(self, "_stream", None)
        if stream is None:
            stream = self._stream = torch.cuda.Stream(device=self.cfg.device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)
        return real(self, key, job)

    monkeypatch.setattr(S.Pipeline, "_transfer", delayed)
    ds = Volumes(12)
    pattern = torch.from_numpy(ds.pattern).cuda()
    with Loader(ds, batch_size=2, num_workers=2, device="cuda", autotune=False) as L:
        for epoch in range(2):
            seen = []
            for x, i in L:
                offsets = x - pattern  # on the loop's stream, at once
                lo, hi = offsets.amin(dim=(1, 2, 3)), offsets.amax(dim=(1, 2, 3))
                assert torch.allclose(lo, hi, atol=1e-5) and torch.allclose(
                    lo, i.to(torch.float32), atol=1e-5), epoch
                seen += i.tolist()
            assert sorted(seen) == list(range(12)), epoch


def test_pin_memory_gives_pinned_host_batches_with_a_custom_collate_fn_too():
    ds = Volumes(12, side=16)
    with Loader(ds, batch_size=4, num_workers=2, pin_memory=True, autotune=False) as L:
        for x, i in L:
            assert x.is_pinned() and i.is_pinned() and not x.is_cuda

    def as_dict(samples):
        return {"x": torch.stack([torch.from_numpy(s[0]) for s in samples]),
                "i": torch.tensor([s[1] for s in samples])}

    with Loader(ds, batch_size=4, num_workers=2, pin_memory=True, collate_fn=as_dict,
                autotune=False) as L:
        for b in L:
            assert b["x"].is_pinned() and b["i"].is_pinned()
            assert torch.equal(b["x"], _expected(ds, b["i"]))


def test_h2d_bytes_total_is_the_bytes_of_the_batches_copied():
    ds = Volumes(20, side=32)
    with Loader(ds, batch_size=4, num_workers=2, device="cuda", autotune=False) as L:
        nbytes = 0
        for x, i in L:
            nbytes += x.numel() * x.element_size() + i.numel() * i.element_size()
        torch.cuda.synchronize()
        snap = L.snapshot()
    assert snap.h2d_bytes_total == nbytes
    assert snap.h2d_seconds_total > 0
    # the copies' own time (CUDA events): a bandwidth above any PCIe or NVLink-C2C link
    # (1 TB/s) would mean the seconds are not the copies'
    assert nbytes / snap.h2d_seconds_total < 1e12


def test_workers_start_after_the_training_process_initialised_cuda():
    torch.cuda.init()
    model = torch.nn.Linear(8, 8).cuda()  # the usual order: the model first, then the loader
    ds = Volumes(12, side=8)
    with Loader(ds, batch_size=3, num_workers=2, device="cuda", autotune=False) as L:
        seen = sorted(int(j) for _, i in L for j in i)
    assert seen == list(range(12))
    assert model.weight.is_cuda
