"""MLPerf 3D-UNet training transforms against the reference's properties (pytorch_loader.py)."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from autominato.data.transforms import (
    Cast,
    Compose,
    GaussianNoise,
    RandBalancedCrop,
    RandFlip,
    RandomBrightnessAugmentation,
    mlperf_train_transform,
)


def binomial_bounds(p: float, n: int, sigmas: float = 4.0) -> tuple[float, float]:
    """Bounds on an observed fraction of n Bernoulli(p) draws: p +- sigmas standard errors."""
    half = sigmas * math.sqrt(p * (1 - p) / n)
    return p - half, p + half


def volume(shape=(1, 48, 40, 56), blobs=((10, 10, 10, 4, 1),), seed=0):
    """image (1, D, H, W) float32 noise, label with cubic blobs (z, y, x, half-size, class)."""
    rng = np.random.default_rng(seed)
    image = rng.normal(size=shape).astype(np.float32)
    label = np.zeros(shape, np.uint8)
    for z, y, x, r, c in blobs:
        label[0, z - r : z + r, y - r : y + r, x - r : x + r] = c
    return image, label


@pytest.mark.parametrize("oversampling", [0.0, 1.0])
@pytest.mark.parametrize("patch", [(16, 16, 16), (8, 24, 40), (48, 40, 56)])
def test_balanced_crop_returns_the_patch_shape_in_both_branches(oversampling, patch):
    image, label = volume()
    crop = RandBalancedCrop(patch, oversampling)
    for seed in range(20):
        img, lab = crop((image, label), np.random.default_rng(seed))
        assert img.shape == (1, *patch)
        assert lab.shape == (1, *patch)


def test_balanced_crop_keeps_image_and_label_aligned():
    image, label = volume()
    image = label.astype(np.float32) * 7 + 1  # image encodes the label voxel by voxel
    crop = RandBalancedCrop(16, 0.5)
    for seed in range(50):
        img, lab = crop((image, label), np.random.default_rng(seed))
        np.testing.assert_array_equal(img, lab.astype(np.float32) * 7 + 1)


def test_foreground_fraction_of_balanced_crops_is_at_least_the_oversampling_rate():
    # One small blob in a large volume: a uniform crop rarely contains it.
    image, label = volume(shape=(1, 96, 96, 96), blobs=((80, 12, 70, 3, 1),))
    n, p = 400, 0.4
    crop = RandBalancedCrop(16, p)
    hits = sum(
        bool(crop((image, label), np.random.default_rng(s))[1].any()) for s in range(n)
    )
    low, _ = binomial_bounds(p, n)
    assert hits / n >= low
    # and the check discriminates: without oversampling the blob is almost never in the crop
    uniform = RandBalancedCrop(16, 0.0)
    misses = sum(
        bool(uniform((image, label), np.random.default_rng(s))[1].any()) for s in range(n)
    )
    assert misses / n < low / 2


def test_foreground_crop_always_contains_the_chosen_class():
    image, label = volume(blobs=((10, 10, 10, 3, 1), (36, 28, 44, 3, 2)))
    crop = RandBalancedCrop(16, 1.0)
    seen = set()
    for seed in range(60):
        _, lab = crop((image, label), np.random.default_rng(seed))
        present = set(np.unique(lab[lab > 0]).tolist())
        assert present, "an oversampled crop must contain foreground"
        seen |= present
    assert seen == {1, 2}, "each present class is chosen sometimes"


def test_foreground_crop_chooses_among_the_two_largest_components_only():
    # Three class-1 components far apart: sizes 8^3, 6^3, 2^3 (the smallest is never chosen).
    blobs = ((8, 8, 8, 4, 1), (8, 8, 70, 3, 1), (70, 70, 40, 1, 1))
    image, label = volume(shape=(1, 80, 80, 80), blobs=blobs)
    crop = RandBalancedCrop(12, 1.0)
    near = {0: 0, 1: 0, 2: 0}
    for seed in range(80):
        _, lab = crop((image, label), np.random.default_rng(seed))
        counts = int(lab.sum())
        # the crop holds exactly one component, recognisable by its voxel count
        assert counts in (8**3, 6**3), counts
        near[0 if counts == 8**3 else 1] += 1
    assert near[0] > 10 and near[1] > 10


def test_a_class_of_more_components_than_uint16_holds_still_crops_around_the_largest_two():
    # 3 x 300 x 300 isolated voxels (67500 components, past uint16's 65535) and one 4^3 cube
    # and one 3^3 cube: the component map falls back to int32 and the crop holds a cube.
    image, label = volume(shape=(1, 8, 600, 600), blobs=((4, 20, 20, 2, 1),))
    label[0, 1, 41::2, 41::2] = 1
    label[0, 4:7, 500:503, 500:503] = 1
    crop = RandBalancedCrop((8, 8, 8), 1.0)
    for seed in range(6):
        _, lab = crop((image, label), np.random.default_rng(seed))
        assert int(lab.sum()) >= 27, int(lab.sum())  # a cube, not an isolated voxel's box


def test_the_foreground_search_holds_at_most_three_bytes_per_voxel():
    # The class mask (1 byte) and a uint16 component map (2); scipy's default int32 map made
    # it 5 bytes per voxel: on a large KiTS19 case, 98 MB more at a worker's peak.
    import tracemalloc

    _, label = volume(shape=(1, 64, 256, 256), blobs=((20, 60, 60, 8, 1), (40, 200, 200, 5, 2)))
    crop = RandBalancedCrop(16, 1.0)
    tracemalloc.start()
    try:
        assert crop.foreground_box(label[0], np.random.default_rng(0)) is not None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 3.2 * label.size, peak / label.size


def test_foreground_component_larger_than_the_patch_is_cropped_inside_its_box():
    image, label = volume(shape=(1, 64, 64, 64), blobs=((32, 32, 32, 20, 1),))
    crop = RandBalancedCrop(16, 1.0)
    for seed in range(20):
        _, lab = crop((image, label), np.random.default_rng(seed))
        assert lab.all(), "a 40^3 component fills any 16^3 crop taken inside its box"


def test_balanced_crop_without_foreground_falls_back_to_a_uniform_crop():
    image, label = volume(blobs=())
    img, lab = RandBalancedCrop(16, 1.0)((image, label), np.random.default_rng(0))
    assert img.shape == (1, 16, 16, 16) and not lab.any()


def test_balanced_crop_rejects_small_volumes_and_mismatched_shapes():
    image, label = volume(shape=(1, 10, 40, 40))
    with pytest.raises(ValueError, match="smaller than the patch"):
        RandBalancedCrop(16)((image, label), np.random.default_rng(0))
    image, label = volume()
    with pytest.raises(ValueError, match="same spatial shape"):
        RandBalancedCrop(16)((image, label[:, :-1]), np.random.default_rng(0))
    with pytest.raises(ValueError, match="oversampling"):
        RandBalancedCrop(16, 1.5)


def test_flip_moves_image_and_label_together_each_axis_with_probability_one_third():
    shape = (1, 5, 6, 7)
    label = np.arange(np.prod(shape), dtype=np.int64).reshape(shape)  # every voxel distinct
    image = label.astype(np.float32) * 2
    n = 600
    flipped = np.zeros(3)
    flip = RandFlip()
    for s in range(n):
        img, lab = flip((image, label), np.random.default_rng(s))
        np.testing.assert_array_equal(img, lab.astype(np.float32) * 2)
        # the corner voxel's original (z, y, x) is not 0 exactly along the flipped axes
        z, y, x = np.unravel_index(int(lab[0, 0, 0, 0]), shape[1:])
        flipped += (z != 0, y != 0, x != 0)
    low, high = binomial_bounds(1 / 3, n)
    assert all(low <= f / n <= high for f in flipped), flipped / n


def test_cast_gives_float32_image_and_uint8_label_as_contiguous_copies():
    image = np.flip(np.ones((1, 4, 4, 4), np.float64), 2)
    label = np.flip(np.ones((1, 4, 4, 4), np.int64), 3)
    img, lab = Cast()((image, label))
    assert img.dtype == np.float32 and lab.dtype == np.uint8
    assert img.flags.c_contiguous and lab.flags.c_contiguous
    same = np.ones((1, 2, 2, 2), np.float32)
    out, _ = Cast()((same, label))
    assert out is not same and not np.shares_memory(out, same)


def test_brightness_applies_with_probability_0_1_and_scales_by_1_plus_f():
    n = 2000
    image = np.ones((1, 2, 2, 2), np.float32)
    label = np.zeros((1, 2, 2, 2), np.uint8)
    t = RandomBrightnessAugmentation(factor=0.3, prob=0.1)
    scales = []
    for s in range(n):
        img, lab = t((image, label), np.random.default_rng(s))
        assert lab is label and img.dtype == np.float32
        if not np.array_equal(img, image):
            assert np.all(img == img.flat[0]), "one factor for the whole image"
            scales.append(float(img.flat[0]))
    low, high = binomial_bounds(0.1, n)
    assert low <= len(scales) / n <= high
    # the reference multiplies by (1 + f), f ~ U(0.7, 1.3)
    assert 1.7 - 1e-6 <= min(scales) and max(scales) <= 2.3 + 1e-6
    assert max(scales) - min(scales) > 0.3


def test_gaussian_noise_applies_with_probability_0_1_and_std_below_0_1():
    n = 2000
    image = np.zeros((1, 8, 8, 8), np.float32)
    label = np.zeros((1, 8, 8, 8), np.uint8)
    t = GaussianNoise(mean=0.0, std=0.1, prob=0.1)
    stds = []
    for s in range(n):
        img, _ = t((image, label), np.random.default_rng(s))
        assert img.dtype == np.float32
        if img.any():
            stds.append(float(img.std()))
    low, high = binomial_bounds(0.1, n)
    assert low <= len(stds) / n <= high
    # s ~ U(0, 0.1): sample stds of 512 voxels stay below 0.1 plus sampling error
    assert max(stds) < 0.1 * 1.15
    assert 0.03 < float(np.mean(stds)) < 0.07


def test_mlperf_train_transform_is_deterministic_per_generator_and_picklable():
    image, label = volume(shape=(1, 40, 40, 40), blobs=((20, 20, 20, 5, 1), (8, 30, 8, 2, 2)))
    t = mlperf_train_transform(patch=32, oversampling=0.4)
    assert isinstance(t, Compose)
    t2 = pickle.loads(pickle.dumps(t))
    for seed in range(10):
        a = t((image, label), np.random.default_rng(seed))
        b = t2((image, label), np.random.default_rng(seed))
        assert a[0].shape == (1, 32, 32, 32) and a[1].shape == (1, 32, 32, 32)
        assert a[0].dtype == np.float32 and a[1].dtype == np.uint8
        assert a[0].flags.c_contiguous and a[1].flags.c_contiguous
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    outs = {t((image, label), np.random.default_rng(s))[0].tobytes() for s in range(10)}
    assert len(outs) > 5, "different generators give different augmentations"
