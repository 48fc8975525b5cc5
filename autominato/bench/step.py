"""The consumer step of a benchmark run: the shared simulated or UNet step
(:mod:`autominato.models.step`) on a benchmark batch.

Benchmark batches are collated from ``(index, sample)`` pairs, so a batch is
``[indices, samples]`` (:func:`autominato.bench.measure.batch_indices`); the step sees the
samples.
"""

from __future__ import annotations

from typing import Any

from autominato.models.step import SleepStep, Step, UNetStep


class OnSamples:
    """Runs ``step`` on the samples of a benchmark batch ``[indices, samples]``."""

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self, batch: Any) -> object:
        return self.step(batch[1])


def unet_step(model: str = "mlperf", device: str = "cuda") -> UNetStep:
    """The benchmark's UNet step: :class:`UNetStep` on CUDA without cuDNN autotuning.

    cuDNN's autotuning costs seconds per process and per shape, which every fresh run process
    would pay inside its measured span.

    Raises:
        RuntimeError: CUDA is not available (use the simulated step, ``--step``).
    """
    import torch

    torch.backends.cudnn.benchmark = False
    return UNetStep(model, device)


def make_step(spec: dict[str, Any]) -> SleepStep | OnSamples:
    """Build the step of ``spec``: ``{"kind": "sleep", "step_s": s}`` or ``{"kind": "unet",
    "model": ..., "image_shape": ..., "device": ...}`` (device default ``"cuda"``).

    Raises:
        ValueError: unknown kind.
    """
    if spec["kind"] == "sleep":
        return SleepStep(spec["step_s"])
    if spec["kind"] == "unet":
        step = unet_step(spec.get("model", "mlperf"), spec.get("device", "cuda"))
        if spec.get("image_shape"):
            step.calibrate(tuple(spec["image_shape"]), steps=1)  # warm cuDNN before timing
        return OnSamples(step)
    raise ValueError(f"unknown step kind {spec['kind']!r} (expected 'sleep' or 'unet')")
