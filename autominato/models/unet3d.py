"""The MLPerf 3D-UNet (KiTS19 segmentation) and a compact variant of the same topology.

Topology after mlcommons/training ``image_segmentation/pytorch/model/unet3d.py`` and
``model/layers.py`` (itself after Isensee et al., nnU-Net, 2019): an input block of two 3^3
convolutions, ``len(filters) - 1`` down-sampling blocks (a stride-2 3^3 convolution then a 3^3
convolution), a bottleneck down-sampling block at ``filters[-1]`` channels, mirrored up-sampling
blocks (a 2^3 stride-2 transposed convolution, concatenation with the skip, two 3^3
convolutions) and a 1^3 output convolution. Every 3^3 convolution is followed by instance
normalisation (affine) and LeakyReLU(0.01), and has no bias, as in the reference.

``UNet3D.mlperf()`` is the reference size (filters 32, 64, 128, 256, 320: five resolutions plus
the bottleneck, 31.2 M parameters). ``UNet3D.compact()`` keeps the topology with fewer
channels and levels and one change: a ``stem``, a non-overlapping 4^3 stride-4 convolution in
place of the first 3^3 convolution, with a matching 4^3 stride-4 transposed convolution as the
output layer, so that the network runs at 1/4 of the input resolution. On a CPU, 3D
convolutions at full 128^3 resolution cost several seconds per layer for a batch of two (a
single 8-channel 3^3 convolution measured 5 to 10 s forward and backward on the project's
2-core machine), so no width of the reference topology reaches the target of about one second
per training step; the stem does (see ``docs/data.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

#: Channel widths of the MLPerf reference (``unet3d.py``: ``filters = [32, 64, 128, 256, 320]``).
MLPERF_FILTERS = (32, 64, 128, 256, 320)
#: Channel widths of the compact model (three resolutions after its stride-4 stem, so a 128^3
#: patch reaches 4^3 at the bottleneck, as in the reference); chosen by measurement.
COMPACT_FILTERS = (16, 32, 64)
#: Input down-sampling factor of the compact model's stem.
COMPACT_STEM = 4


def _conv_block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    # No bias before instance norm: the norm's affine shift makes it redundant (reference).
    return nn.Sequential(
        nn.Conv3d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.InstanceNorm3d(cout, affine=True),
        nn.LeakyReLU(0.01, inplace=True),
    )


class _Down(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = _conv_block(cin, cout, stride=2)
        self.conv2 = _conv_block(cout, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x))


class _Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        # The reference's transposed convolution has a bias and no norm / activation.
        self.up = nn.ConvTranspose3d(cin, cout, kernel_size=2, stride=2)
        self.conv1 = _conv_block(2 * cout, cout)
        self.conv2 = _conv_block(cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = torch.cat((self.up(x), skip), dim=1)
        return self.conv2(self.conv1(x))


class UNet3D(nn.Module):
    """3D-UNet for volumetric segmentation.

    Args:
        in_channels: input channels (1 for CT).
        n_class: output classes (3 for KiTS19: background, kidney, tumour).
        filters: channel width per resolution, shallowest first; the bottleneck repeats
            ``filters[-1]``.
        stem: 1 for the reference's full-resolution input block; ``s > 1`` replaces its first
            convolution by an ``s^3`` stride-``s`` convolution and the output convolution by an
            ``s^3`` stride-``s`` transposed convolution. Every spatial size of the input must be
            divisible by :attr:`divisor` = ``stem * 2 ** len(filters)``.

    Input ``(B, in_channels, D, H, W)`` float32; output logits ``(B, n_class, D, H, W)``.

    Raises:
        ValueError: ``filters`` is empty, ``stem < 1``, or (in ``forward``) the input is not 5D or
            a spatial size is not divisible by :attr:`divisor`.
    """

    def __init__(self, in_channels: int = 1, n_class: int = 3,
                 filters: Sequence[int] = MLPERF_FILTERS, stem: int = 1) -> None:
        super().__init__()
        if not filters:
            raise ValueError("filters must name at least one channel width")
        if stem < 1:
            raise ValueError(f"stem must be >= 1, got {stem}")
        self.filters = tuple(int(f) for f in filters)
        self.stem = int(stem)
        f = self.filters
        if stem == 1:
            first = _conv_block(in_channels, f[0])
        else:
            first = nn.Sequential(
                nn.Conv3d(in_channels, f[0], kernel_size=stem, stride=stem, bias=False),
                nn.InstanceNorm3d(f[0], affine=True),
                nn.LeakyReLU(0.01, inplace=True),
            )
        self.input_block = nn.Sequential(first, _conv_block(f[0], f[0]))
        self.down = nn.ModuleList(_Down(i, o) for i, o in zip(f[:-1], f[1:], strict=True))
        self.bottleneck = _Down(f[-1], f[-1])
        ups = [_Up(f[-1], f[-1])]
        ups += [_Up(i, o) for i, o in zip(reversed(f[1:]), reversed(f[:-1]), strict=True)]
        self.up = nn.ModuleList(ups)
        if stem == 1:
            self.output: nn.Module = nn.Conv3d(f[0], n_class, kernel_size=1)
        else:
            self.output = nn.ConvTranspose3d(f[0], n_class, kernel_size=stem, stride=stem)

    @classmethod
    def mlperf(cls, in_channels: int = 1, n_class: int = 3) -> UNet3D:
        """The reference size (MLPerf Training v1+ image_segmentation)."""
        return cls(in_channels, n_class, MLPERF_FILTERS)

    @classmethod
    def compact(cls, in_channels: int = 1, n_class: int = 3) -> UNet3D:
        """:data:`COMPACT_FILTERS` behind a :data:`COMPACT_STEM` stem (about 1 s per CPU step)."""
        return cls(in_channels, n_class, COMPACT_FILTERS, COMPACT_STEM)

    @property
    def divisor(self) -> int:
        """Every spatial input size must be a multiple of this (one halving per level)."""
        return self.stem * 2 ** len(self.filters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bad = [s for s in x.shape[2:] if s % self.divisor]
        if x.dim() != 5 or bad:
            raise ValueError(
                f"UNet3D expects (B, C, D, H, W) with D, H, W divisible by {self.divisor}, "
                f"got {tuple(x.shape)}"
            )
        x = self.input_block(x)
        skips = [x]
        for block in self.down:
            x = block(x)
            skips.append(x)
        x = self.bottleneck(x)
        for block, skip in zip(self.up, reversed(skips), strict=True):
            x = block(x, skip)
        return self.output(x)
