"""Real training steps for ``autominato tune --model``: this project's 3D-UNet.

``--model module:factory`` takes any factory that returns ``step(batch)``; the factories here
build the model of ``autominato run`` (:mod:`autominato.train`) with the same loss, optimiser
and memory format, so that tuning measures the step the main job will run.
"""

from __future__ import annotations

from typing import Any

from autominato.tuning.measure import Step


def unet3d(full_size: bool = False, lr: float = 1e-3, device: str | None = None) -> Step:
    """One optimiser step of the 3D-UNet on a ``(image, label)`` batch.

    Batches: image ``(B, 1, D, H, W)`` float32, label ``(B, 1, D, H, W)`` integer classes
    (0, 1, 2), each spatial size a multiple of the model's ``divisor``. The model is
    ``UNet3D.compact()`` (``UNet3D.mlperf()`` with ``full_size``), the loss ``DiceCELoss``,
    the optimiser Adam at ``lr``, as in :func:`autominato.train.train`. The step returns after
    reading the loss back (``float(loss)``), so its time includes the device's work.

    Args:
        device: ``"cuda"``, ``"cpu"``...; default CUDA when available.

    Use as ``--model autominato.tuning.steps:unet3d`` (compact) or
    ``--model autominato.tuning.steps:unet3d_full``.
    """
    import torch

    from autominato.models import DiceCELoss, UNet3D

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = UNet3D.mlperf() if full_size else UNet3D.compact()
    # channels_last_3d as autominato.train (measured faster for 3D convolutions with oneDNN).
    model = model.to(dev, memory_format=torch.channels_last_3d)
    loss_fn = DiceCELoss()
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(batch: Any) -> float:
        image, label = batch[0], batch[1]
        image = image.to(dev, non_blocking=True).contiguous(memory_format=torch.channels_last_3d)
        label = label.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(image), label)
        loss.backward()
        opt.step()
        return float(loss.detach())  # waits for the device: the step's time is all of it

    return step


def unet3d_full() -> Step:
    """:func:`unet3d` at the MLPerf reference size."""
    return unet3d(full_size=True)
