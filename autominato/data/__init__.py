"""Datasets, MLPerf 3D-UNet transforms, KiTS19 preparation and synthetic CT.

* :class:`KiTS19Dataset`: MLPerf-preprocessed cases (``case_XXXXX_{x,y}.npy``).
* :class:`NiftiDataset`: NIfTI image/label pairs (KiTS19 or Decathlon layout, or a list).
* :func:`mlperf_train_transform` and its parts in :mod:`autominato.data.transforms`.
* :mod:`autominato.data.prepare`: ``autominato prepare kits19 RAW OUT``.
* :mod:`autominato.data.synthetic`: CT-like volumes from masks; generated demo masks.
* :class:`DatasetError`: what a dataset raises for a bad sample (names index and file).
"""

from __future__ import annotations

from autominato.data.errors import DatasetError
from autominato.data.kits19 import KiTS19Dataset
from autominato.data.nifti import NiftiDataset
from autominato.data.transforms import mlperf_train_transform

__all__ = ["DatasetError", "KiTS19Dataset", "NiftiDataset", "mlperf_train_transform"]
