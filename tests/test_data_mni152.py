"""The MNI152 NIfTI folder: real MRI from nilearn's bundled templates with tissue labels."""

from __future__ import annotations

import numpy as np
import pytest

from autominato.data import NiftiDataset
from autominato.data.mni152 import main, tissue_labels


def test_tissue_labels_take_the_likelier_tissue_above_the_threshold():
    gm = np.array([0.9, 0.6, 0.3, 0.5, 0.1])
    wm = np.array([0.1, 0.4, 0.3, 0.5, 0.7])
    assert tissue_labels(gm, wm).tolist() == [1, 1, 0, 1, 2]


def test_mni152_folder_reads_as_a_labelled_mri_volume(tmp_path, capsys):
    pytest.importorskip("nilearn")
    assert main([str(tmp_path)]) == 0
    assert "real MRI" in capsys.readouterr().out
    image, label = NiftiDataset(tmp_path, normalize="zscore")[0]
    assert image.shape == label.shape == (1, 197, 233, 189)
    counts = np.bincount(label.ravel(), minlength=3)
    assert counts[1] > 100_000 and counts[2] > 100_000  # grey and white matter both present
    brain = image[label > 0]
    assert float(brain.mean()) > float(image[label == 0].mean())  # T1: tissue brighter than air
