"""The training steps: one simulated, one real, shared by ``autominato run``, ``tune`` and ``bench``.

A step is a callable ``step(batch)`` that returns when the accelerator is free again, so the
time the training loop spends in ``next()`` is accelerator-idle time.

* :class:`SleepStep`: a simulated accelerator that sleeps a given time per batch.
* :class:`UNetStep`: one optimiser step of this project's 3D-UNet on an ``(image, label)``
  batch.

What :class:`UNetStep` runs, and why:

* Optimiser: SGD with Nesterov momentum 0.9 and no weight decay, the MLPerf 3D-UNet reference
  (mlcommons/training ``image_segmentation/pytorch``: ``runtime/training.py``
  ``get_optimizer`` and the defaults of ``runtime/arguments.py``). Learning rate
  :data:`LEARNING_RATE`: the reference's default of 1.0 goes with its learning-rate warm-up
  and large global batches; for runs of tens of steps at batch 1 or 2 without warm-up, 0.1
  was measured to lower the loss steadily on the compact model (1e-3 barely moves it, 0.5
  stalls after a few steps).
* Precision: bfloat16 autocast on CUDA, as MLPerf submissions on current GPUs run (bfloat16
  has float32's exponent range, so the reference's float16 loss scaling is not needed);
  float32 on the CPU, where bfloat16 autocast measured twice as slow (0.36 s against 0.18 s
  per compact step at batch 2 on 64^3 on the project's machine, whose CPU has AMX-BF16).
* Memory format: ``channels_last_3d`` (NDHWC, the reference's ``--layout NDHWC``), measured
  faster for the compact model's 3D convolutions on the CPU (oneDNN).
* Loss: :class:`~autominato.models.losses.DiceCELoss`, the reference's.
* The step returns the loss as a Python float, which waits for the device: the step's time
  is the device's work, not the launch's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

#: ``step(batch)`` runs one training step on a batch and returns when it is done.
Step = Callable[[Any], object]

#: SGD learning rate of :class:`UNetStep` (see the module docstring for the choice).
LEARNING_RATE = 0.1
#: SGD (Nesterov) momentum of :class:`UNetStep`, the MLPerf reference's.
MOMENTUM = 0.9
#: Model sizes :class:`UNetStep` builds: ``UNet3D.compact()`` and ``UNet3D.mlperf()``.
MODELS = ("compact", "mlperf")


class SleepStep:
    """A simulated training step: sleeps ``seconds`` per batch and uses no CPU.

    Sleeping, not spinning, because an accelerator-bound training loop leaves the host's
    cores to the loader's workers while it waits on the device; spinning would take a core
    that the real run would not lose. ``time.sleep`` never returns early (Python >= 3.5), so
    a step takes at least ``seconds``.

    Raises:
        ValueError: ``seconds`` is negative.
    """

    def __init__(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"step time must be >= 0 seconds, got {seconds}")
        self.seconds = float(seconds)

    def __call__(self, batch: Any) -> None:
        if self.seconds > 0:
            time.sleep(self.seconds)

    def __repr__(self) -> str:
        return f"SleepStep({self.seconds:g} s)"


def image_label(batch: Any) -> tuple[Any, Any]:
    """The image ``(B, C, D, H, W)`` and label ``(B, 1, D, H, W)`` of a collated batch.

    Accepts the two layouts the data path produces: ``(image, label)`` (or a list) and
    ``{"image": ..., "label": ...}``.

    Raises:
        TypeError: neither layout.
    """
    if isinstance(batch, dict) and "image" in batch and "label" in batch:
        return batch["image"], batch["label"]
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return batch[0], batch[1]
    raise TypeError(
        "expected a batch of (image, label) or {'image', 'label'}; got " + type(batch).__name__
    )


class UNetStep:
    """One 3D-UNet training step: copy, forward, Dice + cross-entropy loss, backward, SGD update.

    See the module docstring for the optimiser, precision and memory format and why.

    Args:
        model: ``"compact"`` (``UNet3D.compact()``) or ``"mlperf"`` (the reference size).
        device: ``"cuda"``, ``"cpu"``, a ``torch.device``...; default CUDA when available.
        lr / momentum: SGD's learning rate and Nesterov momentum.
        amp: bfloat16 autocast; default on CUDA only.

    Calling it with a batch (:func:`image_label` layouts; image float, label integer
    classes 0, 1, 2, every spatial size a multiple of ``model.divisor``) runs one step and
    returns the loss before the update. ``last_loss`` keeps it.

    Raises:
        ValueError: an unknown ``model``.
        RuntimeError: ``device`` is CUDA and CUDA is not available.
    """

    def __init__(
        self,
        model: str = "compact",
        device: Any = None,
        *,
        lr: float = LEARNING_RATE,
        momentum: float = MOMENTUM,
        amp: bool | None = None,
    ) -> None:
        import torch

        from autominato.models.losses import DiceCELoss
        from autominato.models.unet3d import UNet3D

        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"the UNet step on {dev}: CUDA is not available")
        self.torch = torch
        self.device = dev
        net = UNet3D.mlperf() if model == "mlperf" else UNet3D.compact()
        self.model = net.to(dev, memory_format=torch.channels_last_3d)
        self.loss_fn = DiceCELoss()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum, nesterov=True)
        self.amp = dev.type == "cuda" if amp is None else amp
        self.last_loss = float("nan")

    def __call__(self, batch: Any) -> float:
        torch = self.torch
        image, label = image_label(batch)
        image = image.to(self.device, non_blocking=True).float()
        image = image.contiguous(memory_format=torch.channels_last_3d)
        label = label.to(self.device, non_blocking=True)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = self.loss_fn(self.model(image), label)
        loss.backward()
        self.opt.step()
        self.last_loss = float(loss.detach())  # waits for the device
        return self.last_loss

    def calibrate(self, image_shape: tuple[int, ...], warmup: int = 3, steps: int = 5) -> float:
        """Median seconds of one step on random data of ``image_shape`` ``(B, C, D, H, W)``.

        The first ``warmup`` steps (cuDNN algorithm choice, allocator growth) are not timed.
        """
        torch = self.torch
        image = torch.randn(image_shape, pin_memory=self.device.type == "cuda")
        label = torch.randint(0, 3, (image_shape[0], 1, *image_shape[2:]), dtype=torch.uint8)
        for _ in range(warmup):
            self((image, label))
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            self((image, label))
            times.append(time.perf_counter() - t)
        return statistics.median(times)
