"""Synthetic CT: intensity volumes made from segmentation masks, and generated demo masks.

The 168 real KiTS19 masks come without their CT volumes, and a fresh clone has no data at all.
:func:`synthesize_ct` paints a CT-like volume in Hounsfield units (HU) on a mask's grid so that
the MLPerf preprocessing and training transforms run on real label geometry;
:func:`demo_case` generates a kidney/tumour mask from ellipsoids for the demo set. Neither is
medical data: everything made here is labelled synthetic where it is written.

HU ranges (typical abdominal contrast-enhanced CT; e.g. Heller et al., KiTS19, and standard
radiology tables): air -1000, subcutaneous fat about -100, soft tissue / muscle 30 to 60,
renal parenchyma in the late arterial / nephrographic phase 130 to 220, renal tumours 40 to
110 (enhancing less than parenchyma).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.ndimage

AIR_HU = -1000.0
FAT_HU = (-120.0, -80.0)
SOFT_TISSUE_HU = (30.0, 60.0)
KIDNEY_HU = (130.0, 220.0)
TUMOUR_HU = (40.0, 110.0)
#: Amplitude (HU) and correlation length (mm) of the smooth tissue texture.
TEXTURE_HU, TEXTURE_MM = 12.0, 6.0
#: Standard deviation of the white acquisition noise (HU).
NOISE_HU = 15.0
#: Thickness (mm) of the subcutaneous fat ring under the body outline.
FAT_MM = 15.0


def _body_map(shape_hw: tuple[int, int], spacing_hw: Sequence[float], fg_hw: np.ndarray,
              fat: float, tissue: float) -> np.ndarray:
    """One axial slice (H, W) of HU: an elliptical body of soft tissue inside a fat ring."""
    h, w = shape_hw
    yy, xx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32),
                         indexing="ij")
    cy, cx = (h - 1) / 2, (w - 1) / 2
    ay, ax = 0.38 * h, 0.46 * w
    if fg_hw.any():  # grow the ellipse until it holds all foreground, plus a margin
        fy, fx = np.nonzero(fg_hw)
        r = np.sqrt(((fy - cy) / ay) ** 2 + ((fx - cx) / ax) ** 2).max()
        if r > 0.9:
            ay, ax = ay * r / 0.9, ax * r / 0.9
    rho = np.sqrt(((yy - cy) / ay) ** 2 + ((xx - cx) / ax) ** 2)
    # Fat ring: FAT_MM inside the outline, as a fraction of the semi-axis (in mm).
    ring = FAT_MM / min(ay * spacing_hw[0], ax * spacing_hw[1])
    out = np.full((h, w), AIR_HU, np.float32)
    out[rho <= 1.0] = fat
    out[rho <= 1.0 - ring] = tissue
    return out


def synthesize_ct(label: np.ndarray, spacing: Sequence[float],
                  rng: np.random.Generator) -> np.ndarray:
    """A CT-like volume in HU on ``label``'s grid.

    Axis 0 is the slice axis (the KiTS19 voxel order ``(slices, rows, columns)``). Every slice
    holds an elliptical body (a soft-tissue core in a fat ring, air outside) large enough to
    contain the foreground; kidney voxels (label 1) and tumour voxels (label 2) get their own
    HU level; a smooth random texture (correlation length :data:`TEXTURE_MM`) and white noise
    (:data:`NOISE_HU`) are added. Tissue levels are drawn per case from the ranges above.

    Args:
        label: ``(D, H, W)`` integer mask with values in {0, 1, 2}.
        spacing: voxel size in mm along the three axes.
        rng: the generator (one per case keeps cases reproducible in any order).

    Returns:
        ``(D, H, W)`` float32 HU.

    Raises:
        ValueError: ``label`` is not 3D or holds values other than 0, 1, 2.
    """
    if label.ndim != 3:
        raise ValueError(f"synthesize_ct: expected a 3D mask, got shape {label.shape}")
    top = int(label.max(initial=0))
    if top > 2 or int(label.min(initial=0)) < 0:
        raise ValueError(
            f"synthesize_ct: mask values must be 0 (background), 1 (kidney), 2 (tumour); "
            f"got values up to {top}"
        )
    fat, tissue = rng.uniform(*FAT_HU), rng.uniform(*SOFT_TISSUE_HU)
    levels = (np.float32(rng.uniform(*KIDNEY_HU)), np.float32(rng.uniform(*TUMOUR_HU)))
    lab = label.astype(np.uint8, copy=False)
    body = _body_map(lab.shape[1:], spacing[1:], lab.any(axis=0), fat, tissue)
    field, pos = _smooth_field(lab.shape, spacing, rng)
    noise = np.float32(NOISE_HU)
    ct = np.empty(lab.shape, np.float32)
    # Slice by slice: the largest KiTS19 masks have 150 M voxels, and whole-volume temporaries
    # (fancy indexing, products with masks) cost more time and memory than this loop.
    for z in range(lab.shape[0]):
        out = ct[z]
        out[...] = body
        out[lab[z] == 1] = levels[0]
        out[lab[z] == 2] = levels[1]
        i, w = int(pos[z]), np.float32(pos[z] - int(pos[z]))
        texture = field[i] * (1 - w) + field[i + 1] * w
        out += np.where(out > AIR_HU, texture, 0.0)  # air stays flat, as in CT
        out += rng.standard_normal(out.shape, dtype=np.float32) * noise
    return ct


def _smooth_field(shape: tuple[int, ...], spacing: Sequence[float],
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A zero-mean random field of std about TEXTURE_HU, correlated over TEXTURE_MM.

    Drawn on a grid of TEXTURE_MM / 2 cells, smoothed there, and interpolated linearly to the
    full in-plane grid; returns that ``(cells, H, W)`` field and, per slice, its fractional
    position along the cell axis (the caller interpolates the slice axis).
    """
    cell = TEXTURE_MM / 2
    coarse = [int(np.ceil(s * sp / cell)) + 2 for s, sp in zip(shape, spacing, strict=True)]
    field = scipy.ndimage.gaussian_filter(rng.standard_normal(coarse).astype(np.float32), 1.0)
    field *= np.float32(TEXTURE_HU / max(float(field.std()), 1e-6))
    positions = [
        np.arange(s, dtype=np.float64) * sp / cell for s, sp in zip(shape, spacing, strict=True)
    ]
    for axis in (1, 2):
        i = positions[axis].astype(np.int64)
        w = (positions[axis] - i).astype(np.float32)
        shape_w = [1, 1, 1]
        shape_w[axis] = -1
        w = w.reshape(shape_w)
        field = np.take(field, i, axis=axis) * (1 - w) + np.take(field, i + 1, axis=axis) * w
    return field, positions[0]


def demo_case(rng: np.random.Generator) -> tuple[np.ndarray, tuple[float, float, float]]:
    """A generated KiTS19-like mask (not real anatomy) and its voxel spacing in mm.

    Two ellipsoid kidneys left and right of the midline (label 1) and one or two ellipsoid
    tumours (label 2) touching a kidney, on a ``(slices, rows, cols)`` grid whose size and
    spacing vary per case (slices 48 to 96 of 2.5 to 4 mm, rows and columns 160 to 240 of
    0.75 to 0.95 mm), so that the preprocessed volumes, and with them the cost of the balanced
    crop's foreground search, differ from case to case.

    Returns:
        ``(mask (D, H, W) uint8, (dz, dy, dx) mm)``.
    """
    d = int(rng.integers(48, 97))
    n = int(rng.integers(160, 241))
    spacing = (float(rng.uniform(2.5, 4.0)), *(float(rng.uniform(0.75, 0.95)),) * 2)
    grid = np.ogrid[:d, :n, :n]
    mm = [g.astype(np.float32) * s for g, s in zip(grid, spacing, strict=True)]
    extent = [d * spacing[0], n * spacing[1], n * spacing[2]]
    mask = np.zeros((d, n, n), np.uint8)

    def ellipsoid(center, radii):
        return sum(((m - c) / r) ** 2 for m, c, r in zip(mm, center, radii, strict=True)) <= 1.0

    kidneys = []
    for side in (-1, 1):
        radii = (rng.uniform(45, 60), rng.uniform(22, 30), rng.uniform(25, 35))  # mm
        center = (
            extent[0] / 2 + rng.uniform(-15, 15),
            extent[1] * 0.55 + rng.uniform(-10, 10),
            extent[2] / 2 + side * extent[2] * rng.uniform(0.22, 0.3),
        )
        mask[ellipsoid(center, radii)] = 1
        kidneys.append((center, radii))
    for _ in range(int(rng.integers(1, 3))):
        center, radii = kidneys[int(rng.integers(2))]
        direction = rng.normal(size=3)
        direction /= np.linalg.norm(direction)
        at = [c + 0.8 * r * u for c, r, u in zip(center, radii, direction, strict=True)]
        size = rng.uniform(8, 25)  # mm
        mask[ellipsoid(at, (size, size * rng.uniform(0.7, 1.3), size * rng.uniform(0.7, 1.3)))] = 2
    return mask, spacing
