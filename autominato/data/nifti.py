"""Image/label pairs of NIfTI volumes (``.nii`` / ``.nii.gz``) read with nibabel.

Layouts found in a folder:

* KiTS19: ``case_XXXXX/imaging.nii.gz`` with ``case_XXXXX/segmentation.nii.gz``;
* Medical Segmentation Decathlon / nnU-Net: ``imagesTr/NAME.nii.gz`` with
  ``labelsTr/NAME.nii.gz`` (an nnU-Net channel suffix ``_0000`` on the image is ignored).

or an explicit list of ``(image_path, label_path)`` pairs.

nibabel's ``load`` reads only the header; a truncated file fails only when the voxels are read,
and a ``.nii.gz`` with a flipped byte is not caught at all (nibabel stops reading before the
gzip trailer, so the CRC-32 is never checked, and returns wrong voxels). :func:`load_nifti`
therefore decompresses a ``.gz`` whole with :mod:`gzip` (which checks the CRC and the length)
and ``__getitem__`` reads the voxels (``np.asarray(img.dataobj)``), so a bad file fails there,
in the loader's read stage, with its index and path.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autominato.data.errors import DatasetError

NIFTI_SUFFIXES = (".nii.gz", ".nii")
#: MLPerf KiTS19 intensity window and normalisation (preprocess_dataset.py): clip to
#: [MIN, MAX] Hounsfield units, then (x - MEAN) / STD.
CT_CLIP = (-79.0, 304.0)
CT_MEAN, CT_STD = 101.0, 76.9
NORMALIZE = ("ct", "zscore")


def _stem(path: Path) -> str:
    for suffix in NIFTI_SUFFIXES:
        if path.name.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.name


def _niftis(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(NIFTI_SUFFIXES))


def find_pairs(root: str | Path) -> list[tuple[Path, Path]]:
    """``(image, label)`` paths of a KiTS19-style or Decathlon-style folder, sorted by name.

    Raises:
        FileNotFoundError: the folder does not exist or holds no complete pair; the message
            names the layouts looked for.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: " + ("not a folder" if root.exists() else "no such folder"))
    pairs: list[tuple[Path, Path]] = []
    for case in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("case_")):
        image, label = case / "imaging.nii.gz", case / "segmentation.nii.gz"
        if image.exists() and label.exists():
            pairs.append((image, label))
    images, labels = root / "imagesTr", root / "labelsTr"
    if images.is_dir() and labels.is_dir():
        by_name = {_stem(p): p for p in _niftis(labels)}
        for image in _niftis(images):
            name = re.sub(r"_0000$", "", _stem(image))
            if name in by_name:
                pairs.append((image, by_name[name]))
    if not pairs:
        from autominato.data.prepare import find_cases  # prepare imports this module

        try:
            masks = len(find_cases(root))
        except FileNotFoundError:
            masks = 0
        hint = (
            f"; it holds {masks} KiTS19 label masks without images: make training cases of "
            f"them with `autominato prepare kits19 --synthesize-ct {root} OUT`, then read OUT "
            "with KiTS19Dataset(OUT) or `autominato run --data OUT`"
            if masks else ""
        )
        raise FileNotFoundError(
            f"{root}: no image/label pairs (looked for case_*/imaging.nii.gz + "
            "segmentation.nii.gz and imagesTr/*.nii[.gz] + labelsTr/*.nii[.gz])" + hint
        )
    return pairs


class NiftiDataset:
    """Map-style dataset of NIfTI image/label pairs.

    ``dataset[i]`` is ``(image, label)``: image ``(1, D, H, W)`` float32 (the stored values
    after the header's scaling, then ``normalize``), label ``(1, D, H, W)`` uint8 class indices,
    in the files' voxel order (no reorientation or resampling: use ``autominato prepare`` for
    that).

    Args:
        source: a folder (see :func:`find_pairs`) or a sequence of ``(image, label)`` paths.
        normalize: ``None`` (values as stored), ``"ct"`` (MLPerf KiTS19: clip to
            :data:`CT_CLIP` HU, then ``(x - 101) / 76.9``) or ``"zscore"`` (per volume,
            ``(x - mean) / std``, the nnU-Net scheme for MRI).

    Raises:
        FileNotFoundError: no pairs in the folder.
        ValueError: unknown ``normalize``.
        DatasetError: from ``__getitem__``: a file is missing, empty, truncated, fails its gzip
            CRC, is not 3D, has non-integer or out-of-range labels, or the image and label
            shapes differ; the message names the index and the file.
    """

    def __init__(
        self,
        source: str | Path | Sequence[tuple[str | Path, str | Path]],
        normalize: str | None = None,
    ) -> None:
        if normalize is not None and normalize not in NORMALIZE:
            raise ValueError(f"normalize must be None, 'ct' or 'zscore', got {normalize!r}")
        if isinstance(source, (str, Path)):
            self.pairs = find_pairs(source)
        else:
            self.pairs = [(Path(i), Path(lab)) for i, lab in source]
            if not self.pairs:
                raise FileNotFoundError("NiftiDataset: empty list of (image, label) pairs")
        self.normalize = normalize

    def __len__(self) -> int:
        return len(self.pairs)

    def sample_path(self, index: int) -> str:
        """The image file of sample ``index`` (loader error messages name it)."""
        return str(self.pairs[index][0])

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        image_path, label_path = self.pairs[index]
        image = read_volume(index, image_path).astype(np.float32, copy=False)
        raw = read_volume(index, label_path)
        if raw.shape != image.shape:
            raise DatasetError(
                index, str(label_path),
                f"label shape {raw.shape} differs from image shape {image.shape} ({image_path})",
            )
        label = _as_label(index, label_path, raw)
        if self.normalize == "ct":
            image = (np.clip(image, *CT_CLIP) - CT_MEAN) / CT_STD
        elif self.normalize == "zscore":
            std = float(image.std())
            image = (image - float(image.mean())) / (std if std > 0 else 1.0)
        return image[None].astype(np.float32, copy=False), label[None]


def load_nifti(path: str | Path) -> Any:
    """Open a NIfTI-1 or NIfTI-2 file; a ``.gz`` is decompressed in full and CRC-checked.

    Returns:
        a nibabel image whose data are in memory (``.gz``) or memory-mapped (``.nii``).

    Raises:
        EOFError, gzip.BadGzipFile, OSError, ValueError, nibabel's ImageFileError: the file is
            truncated, corrupt, unreadable or not NIfTI.
    """
    import nibabel

    path = Path(path)
    if not path.name.endswith(".gz"):
        return nibabel.load(str(path))
    raw = gzip.decompress(path.read_bytes())  # verifies the CRC-32 and length trailer
    size = int.from_bytes(raw[:4], "little") if len(raw) >= 4 else 0
    size_be = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else 0
    if 348 in (size, size_be):  # sizeof_hdr: 348 for NIfTI-1, 540 for NIfTI-2
        return nibabel.Nifti1Image.from_bytes(raw)
    if 540 in (size, size_be):
        return nibabel.Nifti2Image.from_bytes(raw)
    raise ValueError(f"not a NIfTI-1/2 file (header size field {size})")


def read_volume(index: int, path: Path) -> np.ndarray:
    """All voxels of a 3D NIfTI file (a trailing axis of size 1 is dropped).

    Raises:
        DatasetError: the file cannot be opened or decoded, or is not 3D.
    """
    try:
        img = load_nifti(path)
        # Reading the voxels is what fails on a truncated or corrupt file (load reads only
        # the header), so it happens here, inside the dataset's read.
        data = np.asarray(img.dataobj)
    except MemoryError:
        raise
    except Exception as e:  # empty, truncated, CRC, not NIfTI, unreadable: all input faults
        raise DatasetError(index, str(path), f"cannot read NIfTI: {type(e).__name__}: {e}") from e
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DatasetError(index, str(path), f"expected a 3D volume, got shape {data.shape}")
    return data


def _as_label(index: int, path: Path, raw: np.ndarray) -> np.ndarray:
    if raw.dtype == np.uint8:
        return np.ascontiguousarray(raw)
    rounded = np.rint(raw)
    if not np.array_equal(rounded, raw):
        raise DatasetError(index, str(path), "label volume holds non-integer values")
    lo, hi = float(rounded.min()), float(rounded.max())
    if lo < 0 or hi > 255:
        raise DatasetError(index, str(path), f"label values must lie in [0, 255], got [{lo}, {hi}]")
    return rounded.astype(np.uint8)
