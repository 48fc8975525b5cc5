"""Synthetic CT on a mask's grid, and the generated demo masks."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage

from autominato.data.synthetic import (
    AIR_HU,
    KIDNEY_HU,
    NOISE_HU,
    SOFT_TISSUE_HU,
    TUMOUR_HU,
    demo_case,
    synthesize_ct,
)


@pytest.fixture(scope="module")
def mask() -> np.ndarray:
    m = np.zeros((24, 96, 96), np.uint8)
    m[6:18, 30:60, 15:40] = 1
    m[6:18, 30:60, 56:81] = 1
    m[9:14, 40:50, 20:30] = 2
    return m


def test_synthetic_ct_puts_each_label_in_its_hounsfield_range(mask):
    ct = synthesize_ct(mask, (2.0, 0.8, 0.8), np.random.default_rng(0))
    assert ct.shape == mask.shape and ct.dtype == np.float32
    margin = 4 * NOISE_HU
    kidney = float(np.median(ct[mask == 1]))
    tumour = float(np.median(ct[mask == 2]))
    assert KIDNEY_HU[0] - margin < kidney < KIDNEY_HU[1] + margin
    assert TUMOUR_HU[0] - margin < tumour < TUMOUR_HU[1] + margin
    assert kidney > tumour + 20, "the tumour enhances less than the kidney"
    corner = ct[:, :3, :3]  # outside the elliptical body
    assert abs(float(corner.mean()) - AIR_HU) < 10
    centre = ct[:, 44:52, 44:52][mask[:, 44:52, 44:52] == 0]  # soft tissue between the kidneys
    assert SOFT_TISSUE_HU[0] - margin < float(np.median(centre)) < SOFT_TISSUE_HU[1] + margin


def test_synthetic_ct_has_noise_and_smooth_texture(mask):
    ct = synthesize_ct(mask, (2.0, 0.8, 0.8), np.random.default_rng(1))
    kidney = ct[mask == 1]
    assert NOISE_HU * 0.8 < float(kidney.std()) < NOISE_HU * 3
    # smoothing removes the white noise and leaves texture that varies across the organ
    smooth = scipy.ndimage.uniform_filter(ct, 5)
    inner = scipy.ndimage.binary_erosion(mask == 1, iterations=3)
    assert float(smooth[inner].std()) > 2.0


def test_synthetic_ct_is_reproducible_per_generator_and_checks_its_input(mask):
    a = synthesize_ct(mask, (2.0, 0.8, 0.8), np.random.default_rng(5))
    b = synthesize_ct(mask, (2.0, 0.8, 0.8), np.random.default_rng(5))
    c = synthesize_ct(mask, (2.0, 0.8, 0.8), np.random.default_rng(6))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    with pytest.raises(ValueError, match="0 \\(background\\), 1 \\(kidney\\), 2 \\(tumour\\)"):
        synthesize_ct(mask * 2, (1, 1, 1), np.random.default_rng(0))
    with pytest.raises(ValueError, match="3D"):
        synthesize_ct(mask[0], (1, 1), np.random.default_rng(0))


def test_body_grows_to_contain_foreground_near_the_border():
    m = np.zeros((4, 64, 64), np.uint8)
    m[:, 1:6, 30:34] = 1  # a kidney at the top edge of the field of view
    ct = synthesize_ct(m, (3.0, 1.0, 1.0), np.random.default_rng(0))
    ring = scipy.ndimage.binary_dilation(m == 1, iterations=2) & (m == 0)
    assert float(np.median(ct[ring])) > -500, "tissue, not air, surrounds the kidney"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_demo_case_has_two_kidneys_and_a_tumour_on_a_varied_grid(seed):
    m, spacing = demo_case(np.random.default_rng(seed))
    assert m.dtype == np.uint8 and m.ndim == 3
    assert set(np.unique(m).tolist()) == {0, 1, 2}
    _, kidneys = scipy.ndimage.label(m == 1)
    assert kidneys >= 2
    assert 48 <= m.shape[0] <= 96 and 160 <= m.shape[1] == m.shape[2] <= 240
    assert 2.5 <= spacing[0] <= 4.0 and 0.75 <= spacing[1] == spacing[2] <= 0.95
    other, _ = demo_case(np.random.default_rng(seed + 10))
    assert other.shape != m.shape or not np.array_equal(other, m)
