"""Models of the main job: the MLPerf 3D-UNet (reference and compact sizes) and its loss."""

from __future__ import annotations

from autominato.models.losses import DiceCELoss
from autominato.models.unet3d import UNet3D

__all__ = ["DiceCELoss", "UNet3D"]
