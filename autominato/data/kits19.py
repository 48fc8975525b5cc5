"""MLPerf-preprocessed KiTS19 cases: ``case_XXXXX_x.npy`` images and ``case_XXXXX_y.npy`` labels.

The layout and dtypes are those of mlcommons/training ``image_segmentation/pytorch/
preprocess_dataset.py`` (and of ``autominato prepare kits19``): per case an image of shape
``(1, D, H, W)`` float32 (clipped, normalised Hounsfield units) and a label of the same shape,
uint8 (0 background, 1 kidney, 2 tumour), every spatial size >= 128.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autominato.data.errors import DatasetError

#: The file ``autominato prepare`` writes beside the cases: settings and provenance.
MANIFEST = "prepare.json"
_CASE = re.compile(r"^(case_\d+)_x\.npy$")


def image_file(root: str | Path, case: str) -> Path:
    return Path(root) / f"{case}_x.npy"


def label_file(root: str | Path, case: str) -> Path:
    return Path(root) / f"{case}_y.npy"


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The ``prepare.json`` of a prepared folder, or ``{}`` when there is none."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable manifest of a prepared folder: {e}") from e


class KiTS19Dataset:
    """Map-style dataset of a folder of MLPerf-preprocessed KiTS19 cases.

    ``dataset[i]`` is ``(image, label)``: image ``(1, D, H, W)`` float32, label ``(1, D, H, W)``
    uint8, both C-contiguous arrays read from the files (``readinto``, one copy), so the
    file I/O happens inside ``__getitem__`` (the loader's read stage) and no file handle stays
    open between samples.

    Args:
        root: the folder (cases are found by ``case_*_x.npy`` with a matching ``_y.npy``).
        cases: case names (``"case_00001"``) or indices into the sorted list to keep; all when
            ``None``.

    Attributes:
        cases: the case names, sorted.
        synthetic: True when ``prepare.json`` says the images were synthesised from masks.

    Raises:
        FileNotFoundError: ``root`` does not exist or holds no complete case.
        DatasetError: from ``__getitem__``: a file is missing, truncated, not a ``.npy``, or has
            the wrong shape or dtype; the message names the index and the file.
    """

    def __init__(self, root: str | Path, cases: Sequence[str | int] | None = None) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no such folder")
        found = sorted(
            m.group(1)
            for p in self.root.iterdir()
            if (m := _CASE.match(p.name)) and label_file(self.root, m.group(1)).exists()
        )
        if cases is not None:
            names = set(found)
            picked = []
            for c in cases:
                name = found[c] if isinstance(c, int) else c
                if name not in names:
                    raise FileNotFoundError(f"{self.root}: no case {c!r} (images {name}_x.npy)")
                picked.append(name)
            found = picked
        if not found:
            raise FileNotFoundError(
                f"{self.root}: no case_XXXXX_x.npy / case_XXXXX_y.npy pairs "
                "(prepare a KiTS19 folder with `autominato prepare kits19 RAW OUT`)"
            )
        self.cases = found
        manifest = read_manifest(self.root)
        self.synthetic = bool(manifest.get("synthetic_ct", False))

    def __len__(self) -> int:
        return len(self.cases)

    def sample_path(self, index: int) -> str:
        """The image file of sample ``index`` (loader error messages name it)."""
        return str(image_file(self.root, self.cases[index]))

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        case = self.cases[index]
        image = self._load(index, image_file(self.root, case), np.float32)
        label = self._load(index, label_file(self.root, case), np.uint8)
        if image.shape != label.shape:
            raise DatasetError(
                index, str(label_file(self.root, case)),
                f"label shape {label.shape} differs from image shape {image.shape} "
                f"({image_file(self.root, case).name})",
            )
        return image, label

    @staticmethod
    def _load(index: int, path: Path, dtype: type) -> np.ndarray:
        try:
            f = open(path, "rb")  # noqa: SIM115 -- closed below, errors told apart
        except OSError as e:
            raise DatasetError(
                index, str(path), f"cannot read .npy: {type(e).__name__}: {e}"
            ) from e
        with f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran_order, found = read_header(f)
            except Exception as e:  # empty, not a .npy, a bad header: all input faults
                raise DatasetError(
                    index, str(path), f"cannot read .npy: {type(e).__name__}: {e}"
                ) from e
            if len(shape) != 4 or shape[0] != 1:
                raise DatasetError(index, str(path), f"expected shape (1, D, H, W), got {shape}")
            if found != dtype:
                swapped = found.newbyteorder("=") == np.dtype(dtype) and found.byteorder != "|"
                hint = (f" (big-endian; rewrite it as little-endian: "
                        f"np.save(path, a.astype('{np.dtype(dtype).newbyteorder('<').str}')))"
                        if swapped else "")
                raise DatasetError(
                    index, str(path), f"expected dtype {np.dtype(dtype)}, got {found}{hint}"
                )
            # The read itself: the file's bytes are copied once, by the kernel, into the
            # array. Not np.load(mmap_mode="r") and a copy: the mapped file pages count in
            # the worker's memory while it copies (~200 MB of a large case's PSS on top of the
            # copy, measured) and each 4 KiB page costs a fault.
            need = math.prod(shape) * np.dtype(found).itemsize  # (Python ints: no overflow)
            try:
                have = os.fstat(f.fileno()).st_size - f.tell()
            except OSError as e:
                raise DatasetError(index, str(path), f"read failed: {e}") from e
            if have < need:  # before allocating: a corrupt header may claim terabytes
                raise DatasetError(
                    index, str(path),
                    f"cannot read .npy: truncated: {have} of {need} data bytes (shape {shape})",
                )
            out = np.empty(shape[::-1] if fortran_order else shape, found)
            if need:
                try:
                    got = f.readinto(memoryview(out.reshape(-1)).cast("B"))
                except OSError as e:
                    raise DatasetError(index, str(path), f"read failed: {e}") from e
                if got != need:
                    raise DatasetError(
                        index, str(path),
                        f"cannot read .npy: truncated: {got} of {need} data bytes",
                    )
        return np.ascontiguousarray(out.T) if fortran_order else out
