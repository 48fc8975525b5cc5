"""Models of the main job: the MLPerf 3D-UNet (reference and compact sizes), its loss, and the
training steps that ``autominato run``, ``tune`` and ``bench`` share (:mod:`.step`).

The names below are imported on first use, so that ``autominato.models.step``'s simulated
step does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autominato.models.losses import DiceCELoss
    from autominato.models.unet3d import UNet3D

__all__ = ["DiceCELoss", "UNet3D"]


def __getattr__(name: str) -> Any:
    if name == "DiceCELoss":
        from autominato.models.losses import DiceCELoss

        return DiceCELoss
    if name == "UNet3D":
        from autominato.models.unet3d import UNet3D

        return UNet3D
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
