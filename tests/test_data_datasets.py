"""KiTS19 npy and NIfTI datasets: layouts, shapes, dtypes, normalisation, use in the Loader."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel
import numpy as np
import pytest

from autominato.data import KiTS19Dataset, NiftiDataset, mlperf_train_transform
from autominato.data.nifti import CT_MEAN, CT_STD, find_pairs


def save_nifti(path: Path, array: np.ndarray, zooms=(1.0, 1.0, 1.0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = nibabel.Nifti1Image(array, np.diag([*zooms, 1.0]))
    nibabel.save(img, path)
    return path


def save_case(root: Path, name: str, shape=(1, 40, 36, 44), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    y = np.zeros(shape, np.uint8)
    y[0, 10:20, 10:20, 10:20] = 1
    y[0, 12:15, 12:15, 12:15] = 2
    np.save(root / f"{name}_x.npy", x)
    np.save(root / f"{name}_y.npy", y)
    return x, y


def test_kits19_dataset_reads_sorted_complete_pairs_as_copies(tmp_path):
    x1, y1 = save_case(tmp_path, "case_00007", seed=7)
    x0, y0 = save_case(tmp_path, "case_00003", seed=3)
    np.save(tmp_path / "case_00009_x.npy", x0)  # no label: not a case
    ds = KiTS19Dataset(tmp_path)
    assert ds.cases == ["case_00003", "case_00007"] and len(ds) == 2
    image, label = ds[1]
    np.testing.assert_array_equal(image, x1)
    np.testing.assert_array_equal(label, y1)
    assert image.dtype == np.float32 and label.dtype == np.uint8
    assert not isinstance(image, np.memmap) and image.flags.c_contiguous and image.flags.writeable
    assert ds.sample_path(0) == str(tmp_path / "case_00003_x.npy")
    assert not ds.synthetic


def test_kits19_dataset_selects_cases_and_reads_the_synthetic_flag(tmp_path):
    for i in range(3):
        save_case(tmp_path, f"case_{i:05d}")
    (tmp_path / "prepare.json").write_text(json.dumps({"synthetic_ct": True}))
    ds = KiTS19Dataset(tmp_path, cases=["case_00002", 0])
    assert ds.cases == ["case_00002", "case_00000"] and ds.synthetic
    with pytest.raises(FileNotFoundError, match="case_00005"):
        KiTS19Dataset(tmp_path, cases=["case_00005"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="autominato prepare"):
        KiTS19Dataset(empty)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        KiTS19Dataset(tmp_path / "missing")


def test_find_pairs_reads_kits19_and_decathlon_layouts(tmp_path):
    vol = np.zeros((4, 5, 6), np.float32)
    save_nifti(tmp_path / "case_00001" / "imaging.nii.gz", vol)
    save_nifti(tmp_path / "case_00001" / "segmentation.nii.gz", vol.astype(np.uint8))
    save_nifti(tmp_path / "case_00002" / "imaging.nii.gz", vol)  # test case: no label
    save_nifti(tmp_path / "imagesTr" / "brain_001_0000.nii.gz", vol)  # nnU-Net channel suffix
    save_nifti(tmp_path / "labelsTr" / "brain_001.nii.gz", vol.astype(np.uint8))
    save_nifti(tmp_path / "imagesTr" / "brain_002.nii", vol)
    save_nifti(tmp_path / "labelsTr" / "brain_002.nii", vol.astype(np.uint8))
    pairs = [(p.relative_to(tmp_path).as_posix(), q.name) for p, q in find_pairs(tmp_path)]
    assert pairs == [
        ("case_00001/imaging.nii.gz", "segmentation.nii.gz"),
        ("imagesTr/brain_001_0000.nii.gz", "brain_001.nii.gz"),
        ("imagesTr/brain_002.nii", "brain_002.nii"),
    ]
    with pytest.raises(FileNotFoundError, match="imagesTr"):
        find_pairs(tmp_path / "case_00002")
    only_image = tmp_path / "test-cases"  # a KiTS19 test case: an image, no mask
    save_nifti(only_image / "case_00002" / "imaging.nii.gz", vol)
    with pytest.raises(FileNotFoundError, match="imagesTr") as info:
        find_pairs(only_image)
    assert "prepare" not in str(info.value)  # no masks to prepare


@pytest.mark.parametrize("layout", ["case_00003.nii.gz", "case_00003/segmentation.nii.gz"])
def test_a_folder_of_masks_only_points_to_prepare(tmp_path, layout):
    save_nifti(tmp_path / layout, np.zeros((4, 5, 6), np.uint8))
    with pytest.raises(FileNotFoundError, match=r"1 KiTS19 label masks without images.*"
                       r"autominato prepare kits19 --synthesize-ct.*KiTS19Dataset\(OUT\)"):
        find_pairs(tmp_path)


def test_a_folder_of_other_niftis_gets_no_prepare_hint(tmp_path):
    save_nifti(tmp_path / "case_00000_0000.nii.gz", np.zeros((4, 5, 6), np.float32))
    with pytest.raises(FileNotFoundError, match="imagesTr") as info:
        find_pairs(tmp_path)
    assert "prepare" not in str(info.value)  # prepare would refuse this folder too


def test_nifti_dataset_returns_channel_first_float32_and_uint8(tmp_path):
    rng = np.random.default_rng(0)
    hu = rng.uniform(-500, 500, size=(6, 7, 8)).astype(np.int16)
    lab = rng.integers(0, 3, size=(6, 7, 8)).astype(np.float64)  # float-typed integer labels
    image = save_nifti(tmp_path / "img.nii.gz", hu)
    label = save_nifti(tmp_path / "lab.nii.gz", lab)
    x, y = NiftiDataset([(image, label)])[0]
    assert x.shape == y.shape == (1, 6, 7, 8)
    assert x.dtype == np.float32 and y.dtype == np.uint8
    np.testing.assert_array_equal(x[0], hu.astype(np.float32))
    np.testing.assert_array_equal(y[0], lab.astype(np.uint8))
    ct, _ = NiftiDataset([(image, label)], normalize="ct")[0]
    expected = (np.clip(hu.astype(np.float32), -79, 304) - CT_MEAN) / CT_STD
    np.testing.assert_allclose(ct[0], expected, rtol=1e-6)
    z, _ = NiftiDataset([(image, label)], normalize="zscore")[0]
    assert abs(float(z.mean())) < 1e-5 and abs(float(z.std()) - 1) < 1e-4
    with pytest.raises(ValueError, match="normalize"):
        NiftiDataset([(image, label)], normalize="minmax")


def test_kits19_dataset_feeds_the_loader_every_case_once_per_epoch(tmp_path):
    from autominato import Loader

    for i in range(5):
        save_case(tmp_path, f"case_{i:05d}", seed=i)
    ds = KiTS19Dataset(tmp_path)
    with Loader(ds, 2, shuffle=True, transform=mlperf_train_transform(32), seed=1,
                worker_kind="thread", workers=1, autotune=False) as loader:
        for image, label in loader:
            assert image.dtype.is_floating_point and tuple(image.shape[1:]) == (1, 32, 32, 32)
            assert str(label.dtype) == "torch.uint8" and tuple(label.shape[1:]) == (1, 32, 32, 32)
            assert set(np.unique(label.numpy())) <= {0, 1, 2}
        snap = loader.snapshot()
    assert snap.samples_total == 5 and snap.batches_total == 3
