"""Real training steps for ``autominato tune --model``: the shared 3D-UNet step.

``--model module:factory`` takes any factory that returns ``step(batch)``; the factories here
build :class:`autominato.models.step.UNetStep`, the step ``autominato run`` trains with, so
that tuning measures the step the main job will run.
"""

from __future__ import annotations

from autominato.models.step import LEARNING_RATE, UNetStep


def unet3d(
    full_size: bool = False, lr: float = LEARNING_RATE, device: str | None = None
) -> UNetStep:
    """The compact 3D-UNet step (``UNet3D.mlperf()`` with ``full_size``) at SGD learning rate
    ``lr`` on ``device`` (default CUDA when available); batches ``(image, label)`` as
    :class:`UNetStep` takes.

    Use as ``--model autominato.tuning.steps:unet3d`` (compact) or
    ``--model autominato.tuning.steps:unet3d_full``.
    """
    return UNetStep("mlperf" if full_size else "compact", device, lr=lr)


def unet3d_full() -> UNetStep:
    """:func:`unet3d` at the MLPerf reference size."""
    return unet3d(full_size=True)
