"""Corrupt inputs fail in the dataset's read with an error naming the sample index and file."""

from __future__ import annotations

from pathlib import Path

import nibabel
import numpy as np
import pytest

from autominato.data import DatasetError, KiTS19Dataset, NiftiDataset
from autominato.pipeline.errors import SampleError


def write_pair(folder: Path, name: str, shape=(12, 16, 20), suffix=".nii.gz") -> tuple[Path, Path]:
    """A Decathlon-layout image/label pair with random content (incompressible enough that
    corrupting the middle of the file hits voxel data)."""
    rng = np.random.default_rng([ord(c) for c in name])
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(parents=True, exist_ok=True)
    image = folder / "imagesTr" / f"{name}{suffix}"
    label = folder / "labelsTr" / f"{name}{suffix}"
    nibabel.save(nibabel.Nifti1Image(rng.normal(size=shape).astype(np.float32), np.eye(4)), image)
    nibabel.save(nibabel.Nifti1Image(rng.integers(0, 3, shape).astype(np.uint8), np.eye(4)), label)
    return image, label


def assert_names_sample(err: pytest.ExceptionInfo, index: int, path: Path) -> None:
    e = err.value
    assert isinstance(e, DatasetError) and isinstance(e, SampleError)
    assert e.sample_index == index
    assert e.sample_path == str(path)
    assert f"sample {index}" in str(e) and str(path) in str(e)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("a", "b", "c"):
        write_pair(tmp_path, name)
    return tmp_path


def test_truncated_nii_gz_names_index_and_path(folder):
    path = folder / "imagesTr" / "b.nii.gz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    ds = NiftiDataset(folder)
    assert ds[0][0].shape == (1, 12, 16, 20)  # the intact neighbours still read
    with pytest.raises(DatasetError) as err:
        ds[1]
    assert_names_sample(err, 1, path)
    assert "EOFError" in str(err.value)


def test_byte_flipped_nii_gz_fails_its_crc_check(folder):
    # nibabel alone returns wrong voxels for this file (it never reads the gzip trailer).
    path = folder / "labelsTr" / "c.nii.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError) as err:
        NiftiDataset(folder)[2]
    assert_names_sample(err, 2, path)


def test_truncated_nii_names_index_and_path(tmp_path):
    image, label = write_pair(tmp_path, "a", suffix=".nii")
    data = image.read_bytes()
    image.write_bytes(data[: len(data) - 1000])
    with pytest.raises(DatasetError) as err:
        NiftiDataset(tmp_path)[0]
    assert_names_sample(err, 0, image)


def test_empty_file_names_index_and_path(folder):
    path = folder / "imagesTr" / "a.nii.gz"
    path.write_bytes(b"")
    with pytest.raises(DatasetError) as err:
        NiftiDataset(folder)[0]
    assert_names_sample(err, 0, path)


def test_npy_of_wrong_shape_names_index_and_path(tmp_path):
    for i in range(2):
        np.save(tmp_path / f"case_{i:05d}_x.npy", np.zeros((1, 4, 5, 6), np.float32))
        np.save(tmp_path / f"case_{i:05d}_y.npy", np.zeros((1, 4, 5, 6), np.uint8))
    bad = tmp_path / "case_00001_x.npy"
    np.save(bad, np.zeros((4, 5, 6), np.float32))  # no channel axis
    ds = KiTS19Dataset(tmp_path)
    assert ds[0][0].shape == (1, 4, 5, 6)
    with pytest.raises(DatasetError) as err:
        ds[1]
    assert_names_sample(err, 1, bad)
    assert "(1, D, H, W)" in str(err.value)


def test_truncated_npy_and_wrong_dtype_name_index_and_path(tmp_path):
    np.save(tmp_path / "case_00000_x.npy", np.zeros((1, 8, 8, 8), np.float32))
    np.save(tmp_path / "case_00000_y.npy", np.zeros((1, 8, 8, 8), np.int64))
    x = tmp_path / "case_00000_x.npy"
    x.write_bytes(x.read_bytes()[:-100])
    with pytest.raises(DatasetError) as err:
        KiTS19Dataset(tmp_path)[0]
    assert_names_sample(err, 0, x)
    np.save(x, np.zeros((1, 8, 8, 8), np.float32))
    with pytest.raises(DatasetError, match="expected dtype uint8, got int64") as err:
        KiTS19Dataset(tmp_path)[0]
    assert_names_sample(err, 0, tmp_path / "case_00000_y.npy")


def test_image_label_shape_mismatch_is_a_clear_error(tmp_path):
    image, label = write_pair(tmp_path, "a")
    nibabel.save(nibabel.Nifti1Image(np.zeros((12, 16, 19), np.uint8), np.eye(4)), label)
    with pytest.raises(DatasetError, match=r"label shape \(12, 16, 19\) differs from image "
                       r"shape \(12, 16, 20\)") as err:
        NiftiDataset(tmp_path)[0]
    assert_names_sample(err, 0, label)
    np.save(tmp_path / "case_00000_x.npy", np.zeros((1, 8, 8, 8), np.float32))
    np.save(tmp_path / "case_00000_y.npy", np.zeros((1, 8, 8, 9), np.uint8))
    with pytest.raises(DatasetError, match="differs from image shape"):
        KiTS19Dataset(tmp_path)[0]


def test_non_integer_labels_and_4d_volumes_are_rejected(tmp_path):
    image, label = write_pair(tmp_path, "a")
    nibabel.save(nibabel.Nifti1Image(np.full((12, 16, 20), 0.5, np.float32), np.eye(4)), label)
    with pytest.raises(DatasetError, match="non-integer"):
        NiftiDataset(tmp_path)[0]
    nibabel.save(nibabel.Nifti1Image(np.zeros((12, 16, 20, 2), np.float32), np.eye(4)), image)
    with pytest.raises(DatasetError, match="expected a 3D volume") as err:
        NiftiDataset(tmp_path)[0]
    assert_names_sample(err, 0, image)


def test_loader_raises_the_corrupt_sample_with_its_index_and_path(folder):
    from autominato import Loader

    path = folder / "imagesTr" / "b.nii.gz"
    path.write_bytes(path.read_bytes()[:100])
    with Loader(NiftiDataset(folder), 1, workers=0, autotune=False) as loader:
        with pytest.raises(SampleError) as err:
            list(loader)
    assert err.value.sample_index == 1
    assert err.value.sample_path == str(path)
    assert str(path) in str(err.value)


def _npy_with_header(path, shape, body: bytes = b"") -> None:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    path.write_bytes(buf.getvalue() + body)


def test_a_corrupt_header_claiming_a_huge_array_is_named_not_allocated(tmp_path):
    """The header's shape is checked against the file's size before the array is allocated:
    a raw MemoryError or 'array is too big' named no sample (review 42)."""
    np.save(tmp_path / "case_00000_y.npy", np.zeros((1, 4, 5, 6), np.uint8))
    x = tmp_path / "case_00000_x.npy"
    for shape in [(1, 3000000, 4000000, 5000000), (1, 2000, 2000, 2000)]:
        _npy_with_header(x, shape, b"\0" * 100)
        with pytest.raises(DatasetError, match="truncated") as err:
            KiTS19Dataset(tmp_path)[0]
        assert_names_sample(err, 0, x)


def test_a_volume_of_zero_voxels_reads_as_an_empty_array(tmp_path):
    _npy_with_header(tmp_path / "case_00000_x.npy", (1, 0, 4, 5))
    np.save(tmp_path / "case_00000_y.npy", np.zeros((1, 0, 4, 5), np.uint8))
    image, label = KiTS19Dataset(tmp_path)[0]
    assert image.shape == label.shape == (1, 0, 4, 5) and image.dtype == np.float32


def test_a_big_endian_volume_is_refused_with_how_to_rewrite_it(tmp_path):
    np.save(tmp_path / "case_00000_x.npy", np.zeros((1, 4, 5, 6), ">f4"))
    np.save(tmp_path / "case_00000_y.npy", np.zeros((1, 4, 5, 6), np.uint8))
    with pytest.raises(DatasetError, match=r"got >f4 \(big-endian; rewrite it as little-endian"
                       ) as err:
        KiTS19Dataset(tmp_path)[0]
    assert_names_sample(err, 0, tmp_path / "case_00000_x.npy")
