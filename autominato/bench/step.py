"""The consumer step: a simulated accelerator (a sleep) or, with CUDA, a real 3D-UNet step.

Both are callables ``step(batch)`` that return when the accelerator is free again, so the time
the training loop spends in ``next()`` is accelerator idle time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


class SleepStep:
    """A simulated accelerator step: ``time.sleep(step_s)``, which uses no CPU.

    Sleeping is what an accelerator-bound training loop looks like to the host: the Python
    thread waits on the device while the loader's workers use the cores.
    """

    def __init__(self, step_s: float) -> None:
        if step_s < 0:
            raise ValueError(f"step time must be >= 0 seconds, got {step_s}")
        self.step_s = float(step_s)

    def __call__(self, batch: Any) -> None:
        if self.step_s > 0:
            time.sleep(self.step_s)


def image_label(samples: Any) -> tuple[Any, Any]:
    """The image ``(B, C, D, H, W)`` and label tensors of a collated KiTS19 batch.

    Accepts the two layouts the data path produces: ``[image, label]`` or
    ``{"image": ..., "label": ...}``.

    Raises:
        TypeError: neither layout.
    """
    if isinstance(samples, dict) and "image" in samples and "label" in samples:
        return samples["image"], samples["label"]
    if isinstance(samples, (list, tuple)) and len(samples) >= 2:
        return samples[0], samples[1]
    raise TypeError(
        "expected a batch of (image, label) or {'image', 'label'}; got " + type(samples).__name__
    )


class UNetStep:
    """One 3D-UNet training step on CUDA: copy, forward, Dice+CE loss, backward, SGD update.

    The model is ``autominato.models.unet3d.UNet3D.mlperf()`` (the MLPerf reference size) or
    ``.compact()``; bfloat16 autocast as MLPerf submissions run it. The step ends with
    ``torch.cuda.synchronize()`` so that its time is the device's, not the launch's.
    ``device="cpu"`` runs the same step on the host (for tests of the step itself).

    Raises:
        RuntimeError: ``device`` is CUDA and CUDA is not available.
    """

    def __init__(self, model: str = "mlperf", device: str = "cuda", amp: bool = True) -> None:
        import torch

        from autominato.models.losses import DiceCELoss
        from autominato.models.unet3d import UNet3D

        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the UNet step needs CUDA; use the simulated step (--step)")
        # No cuDNN autotuning: it costs seconds per process and per shape, which every
        # fresh run process would pay, and the GPU script has 8 minutes in all.
        torch.backends.cudnn.benchmark = False
        self.torch = torch
        net = UNet3D.mlperf() if model == "mlperf" else UNet3D.compact()
        self.model = net.to(self.device)
        self.loss = DiceCELoss()
        # SGD with momentum as in the MLPerf reference (its default optimizer).
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.amp = amp

    def __call__(self, batch: Any) -> None:
        torch = self.torch
        image, label = image_label(batch[1])
        image = image.to(self.device, non_blocking=True).float()
        label = label.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = self.loss(self.model(image), label)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def calibrate(self, image_shape: tuple[int, ...], warmup: int = 3, steps: int = 5) -> float:
        """Median seconds of one step on random data of ``image_shape`` ``(B, C, D, H, W)``.

        The first ``warmup`` steps (cuDNN autotuning, allocator growth) are not timed.
        """
        torch = self.torch
        image = torch.randn(image_shape, pin_memory=self.device.type == "cuda")
        label = torch.randint(0, 3, (image_shape[0], 1, *image_shape[2:]), dtype=torch.uint8)
        batch = [torch.arange(image_shape[0]), [image, label]]
        for _ in range(warmup):
            self(batch)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            self(batch)
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def make_step(spec: dict[str, Any]) -> SleepStep | UNetStep:
    """Build the step of ``spec``: ``{"kind": "sleep", "step_s": s}`` or ``{"kind": "unet", ...}``.

    Raises:
        ValueError: unknown kind.
    """
    if spec["kind"] == "sleep":
        return SleepStep(spec["step_s"])
    if spec["kind"] == "unet":
        step = UNetStep(spec.get("model", "mlperf"))
        if spec.get("image_shape"):
            step.calibrate(tuple(spec["image_shape"]), steps=1)  # warm cuDNN before timing
        return step
    raise ValueError(f"unknown step kind {spec['kind']!r} (expected 'sleep' or 'unet')")
