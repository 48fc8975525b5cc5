"""The MLPerf 3D-UNet training loss: mean of soft Dice loss and cross-entropy.

After mlcommons/training ``image_segmentation/pytorch/model/losses.py`` (``DiceCELoss`` with
``to_onehot_y=True, use_softmax=True, include_background=False``; smoothing 1e-6 in numerator
and denominator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DiceCELoss(nn.Module):
    """``(mean(1 - Dice) + CrossEntropy) / 2`` over the foreground classes.

    Args:
        n_class: number of classes (3 for KiTS19); labels outside ``[0, n_class)`` raise.
        include_background: also average the Dice of class 0 (the reference does not).

    ``forward(logits, target)``: logits ``(B, C, D, H, W)`` float, target ``(B, 1, D, H, W)`` or
    ``(B, D, H, W)`` integer class indices; returns a scalar tensor.
    """

    smooth = 1e-6

    def __init__(self, n_class: int = 3, include_background: bool = False) -> None:
        super().__init__()
        self.n_class = n_class
        self.include_background = include_background

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.dim() == logits.dim():
            target = target.squeeze(1)
        target = target.long()
        ce = F.cross_entropy(logits, target)
        prob = torch.softmax(logits, dim=1)
        onehot = F.one_hot(target, self.n_class).movedim(-1, 1).to(prob.dtype)
        if not self.include_background:
            prob, onehot = prob[:, 1:], onehot[:, 1:]
        dims = tuple(range(2, logits.dim()))
        inter = (prob * onehot).sum(dims)
        denom = prob.sum(dims) + onehot.sum(dims)
        dice = (2 * inter + self.smooth) / (denom + self.smooth)
        return (torch.mean(1.0 - dice) + ce) / 2
