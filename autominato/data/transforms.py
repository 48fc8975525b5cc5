"""MLPerf 3D-UNet training transforms, each drawing its randomness from a given generator.

After mlcommons/training ``image_segmentation/pytorch/data_loading/pytorch_loader.py``
(``RandBalancedCrop``, ``RandFlip``, ``Cast``, ``RandomBrightnessAugmentation``,
``GaussianNoise`` and their order in ``PytTrain``), with one change: the reference draws from
the global ``random`` / ``np.random`` state, these draw from the ``numpy.random.Generator`` the
loader passes (seeded by seed, epoch and sample index), so an augmentation does not depend on
which worker ran it.

A sample is ``(image, label)``: image ``(C, D, H, W)`` (float32 after :class:`Cast`), label
``(1, D, H, W)`` (uint8 after :class:`Cast`). Every transform is ``t(sample, rng) -> sample``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.ndimage

Sample = tuple[np.ndarray, np.ndarray]


def _patch3(patch: int | Sequence[int]) -> tuple[int, int, int]:
    p = (patch,) * 3 if isinstance(patch, int) else tuple(int(x) for x in patch)
    if len(p) != 3 or min(p) < 1:
        raise ValueError(f"patch must be a positive int or three positive ints, got {patch!r}")
    return p  # type: ignore[return-value]


def _randrange(rng: np.random.Generator, n: int) -> int:
    # The reference's randrange: 0 when the range is empty, else uniform in [0, n).
    return 0 if n <= 0 else int(rng.integers(n))


class RandBalancedCrop:
    """Crop a ``patch`` from the volume: with probability ``oversampling`` around foreground.

    Reference: ``pytorch_loader.py`` ``RandBalancedCrop`` (MLPerf: patch 128^3, oversampling
    0.4). The foreground crop picks a class present in the label uniformly, labels the
    connected components of that class (``scipy.ndimage.label``, face connectivity), keeps the
    two with the largest bounding boxes, picks one of them uniformly, and moves or shrinks its
    box to the patch size with a random offset, clamped inside the volume. Otherwise (or when
    the label has no foreground) the crop is uniform over the volume.

    The connected-component search runs on every call and scans the whole label, so its cost
    grows with the volume: that per-sample unevenness is the workload's, kept on purpose.

    Raises:
        ValueError: image and label spatial shapes differ, the arrays are not 4D, or a spatial
            size is smaller than the patch (prepare pads to >= 128).
    """

    def __init__(self, patch: int | Sequence[int] = 128, oversampling: float = 0.4) -> None:
        if not 0.0 <= oversampling <= 1.0:
            raise ValueError(f"oversampling must be in [0, 1], got {oversampling}")
        self.patch = _patch3(patch)
        self.oversampling = float(oversampling)

    def __call__(self, sample: Sample, rng: np.random.Generator) -> Sample:
        image, label = sample
        if image.ndim != 4 or label.ndim != 4 or image.shape[1:] != label.shape[1:]:
            raise ValueError(
                f"RandBalancedCrop: expected image (C, D, H, W) and label (1, D, H, W) with the "
                f"same spatial shape, got {image.shape} and {label.shape}"
            )
        if any(s < p for s, p in zip(image.shape[1:], self.patch, strict=True)):
            raise ValueError(
                f"RandBalancedCrop: volume {image.shape[1:]} is smaller than the patch "
                f"{self.patch} (pad it first, as `autominato prepare` does)"
            )
        box = None
        if rng.random() < self.oversampling:
            box = self.foreground_box(label[0], rng)
        if box is None:
            box = self.random_box(label.shape[1:], rng)
        sl = (slice(None), *(slice(lo, hi) for lo, hi in box))
        return image[sl], label[sl]

    def random_box(self, shape: Sequence[int], rng: np.random.Generator) -> list[tuple[int, int]]:
        """Uniform crop: ``[(low, high)]`` per spatial axis."""
        box = []
        for s, p in zip(shape, self.patch, strict=True):
            lo = _randrange(rng, s - p)
            box.append((lo, lo + p))
        return box

    def foreground_box(self, label: np.ndarray,
                       rng: np.random.Generator) -> list[tuple[int, int]] | None:
        """A patch around a foreground component of ``label`` (3D), or None without foreground."""
        classes = np.unique(label[label > 0])
        if classes.size == 0:
            return None
        cl = classes[int(rng.integers(classes.size))]
        mask = label == cl
        try:
            # 2 bytes per voxel instead of scipy's default int32: the component map is the
            # largest array of the transform (a 425x348x348 case: 196 -> 98 MB at its peak,
            # measured with tracemalloc; same components, less CPU)
            components, _ = scipy.ndimage.label(mask, output=np.uint16)
        except RuntimeError:  # more than 65535 components: "insufficient bit-depth"
            components, _ = scipy.ndimage.label(mask)
        del mask
        boxes = [b for b in scipy.ndimage.find_objects(components) if b is not None]
        volumes = [np.prod([s.stop - s.start for s in b]) for b in boxes]
        largest = [boxes[i] for i in np.argsort(volumes, kind="stable")[-2:]]
        chosen = largest[int(rng.integers(len(largest)))]
        return [self._fit(chosen[ax], label.shape[ax], self.patch[ax], rng) for ax in range(3)]

    @staticmethod
    def _fit(sl: slice, size: int, patch: int, rng: np.random.Generator) -> tuple[int, int]:
        # The reference's adjust(): grow (or shrink) the component's extent to the patch with a
        # random split of the difference between the two sides, then slide it inside the volume.
        diff = patch - (sl.stop - sl.start)
        sign = -1 if diff < 0 else 1
        diff = abs(diff)
        ladj = _randrange(rng, diff)
        hadj = diff - ladj
        low = max(0, sl.start - sign * ladj)
        high = min(size, sl.stop + sign * hadj)
        short = patch - (high - low)
        if short > 0 and low == 0:
            high += short
        elif short > 0:
            low -= short
        return low, high


class RandFlip:
    """Flip image and label together along each spatial axis with probability ``prob``.

    Reference: ``pytorch_loader.py`` ``RandFlip`` (axes 1, 2, 3, each with p = 1/3).
    """

    def __init__(self, prob: float = 1 / 3) -> None:
        self.prob = float(prob)

    def __call__(self, sample: Sample, rng: np.random.Generator) -> Sample:
        image, label = sample
        for axis in (1, 2, 3):
            if rng.random() < self.prob:
                image, label = np.flip(image, axis), np.flip(label, axis)
        return image, label


class Cast:
    """Cast image and label to ``dtypes`` (reference ``Cast``: float32, uint8); always copies.

    The copy makes the output C-contiguous after the crop and flips, which only made views.
    """

    def __init__(self, dtypes: tuple[type, type] = (np.float32, np.uint8)) -> None:
        self.dtypes = dtypes

    def __call__(self, sample: Sample, rng: np.random.Generator | None = None) -> Sample:
        image, label = sample
        return (
            np.array(image, dtype=self.dtypes[0], order="C"),
            np.array(label, dtype=self.dtypes[1], order="C"),
        )


class RandomBrightnessAugmentation:
    """With probability ``prob``, scale the image by ``1 + f``, ``f ~ U(1 - factor, 1 + factor)``.

    Reference: ``pytorch_loader.py`` ``RandomBrightnessAugmentation`` (factor 0.3, prob 0.1),
    kept exactly, including its ``1 + f``: the applied scale lies in [1.7, 2.3], not around 1.
    The label is untouched.
    """

    def __init__(self, factor: float = 0.3, prob: float = 0.1) -> None:
        self.factor = float(factor)
        self.prob = float(prob)

    def __call__(self, sample: Sample, rng: np.random.Generator) -> Sample:
        image, label = sample
        if rng.random() < self.prob:
            f = rng.uniform(1.0 - self.factor, 1.0 + self.factor)
            image = (image * (1.0 + f)).astype(image.dtype, copy=False)
        return image, label


class GaussianNoise:
    """With probability ``prob``, add N(``mean``, s^2) noise, ``s ~ U(0, std)``, to the image.

    Reference: ``pytorch_loader.py`` ``GaussianNoise`` (mean 0, std 0.1, prob 0.1).
    """

    def __init__(self, mean: float = 0.0, std: float = 0.1, prob: float = 0.1) -> None:
        self.mean = float(mean)
        self.std = float(std)
        self.prob = float(prob)

    def __call__(self, sample: Sample, rng: np.random.Generator) -> Sample:
        image, label = sample
        if rng.random() < self.prob:
            scale = rng.uniform(0.0, self.std)
            noise = rng.normal(self.mean, scale, size=image.shape).astype(image.dtype, copy=False)
            image = image + noise
        return image, label


class Compose:
    """Apply ``transforms`` in order, passing each the same generator."""

    def __init__(self, transforms: Sequence) -> None:
        self.transforms = list(transforms)

    def __call__(self, sample: Sample, rng: np.random.Generator) -> Sample:
        for t in self.transforms:
            sample = t(sample, rng)
        return sample

    def __repr__(self) -> str:
        return f"Compose({', '.join(type(t).__name__ for t in self.transforms)})"


def mlperf_train_transform(patch: int | Sequence[int] = 128, oversampling: float = 0.4) -> Compose:
    """The MLPerf 3D-UNet training augmentation as one ``transform(sample, rng)``.

    Order as ``PytTrain.__getitem__``: balanced crop, then flip, cast, brightness, noise.
    Defaults are MLPerf's (patch 128^3, oversampling 0.4).

    Returns:
        a picklable :class:`Compose`; output image ``(C, *patch)`` float32, label
        ``(1, *patch)`` uint8.
    """
    return Compose([
        RandBalancedCrop(patch, oversampling),
        RandFlip(),
        Cast(),
        RandomBrightnessAugmentation(factor=0.3, prob=0.1),
        GaussianNoise(mean=0.0, std=0.1, prob=0.1),
    ])
