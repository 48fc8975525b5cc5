"""`autominato prepare kits19`: MLPerf preprocessing of real KiTS19 masks and of made cases."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nibabel
import numpy as np
import pytest

from autominato.cli import main as cli_main
from autominato.data import KiTS19Dataset
from autominato.data.prepare import (
    MIN_SHAPE,
    TARGET_SPACING,
    find_cases,
    pad_to_min_shape,
    prepare_kits19,
    preprocess_case,
    resample,
)

SHARED_LABELS = Path(__file__).resolve().parents[2] / "shared" / "kits19" / "labels"
#: The two smallest real masks (32 and 34 slices of 5 mm, 512 x 512): fast, and their slice
#: axis (100 and 106 voxels at 1.6 mm) needs padding to 128.
REAL_CASES = ("case_00038", "case_00110")
LOW, HIGH = (-79 - 101) / 76.9, (304 - 101) / 76.9


def save_nifti(path: Path, array: np.ndarray, zooms) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nibabel.save(nibabel.Nifti1Image(array, np.diag([*zooms, 1.0])), path)
    return path


@pytest.mark.skipif(not SHARED_LABELS.is_dir(), reason="../shared/kits19 (real masks) not present")
def test_prepare_two_real_kits19_masks_with_synthetic_ct(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in REAL_CASES:  # link, never copy, the real masks
        os.symlink(SHARED_LABELS / f"{name}.nii.gz", raw / f"{name}.nii.gz")
    out = tmp_path / "out"
    logs: list[str] = []
    result = prepare_kits19(raw, out, synthesize_ct=True, progress=False, log=logs.append)
    assert result["done"] == list(REAL_CASES) and not result["failed"]
    assert any("SYNTHETIC" in m for m in logs)
    manifest = json.loads((out / "prepare.json").read_text())
    assert manifest["synthetic_ct"] is True and manifest["target_spacing"] == [1.6, 1.2, 1.2]
    for name in REAL_CASES:
        src = nibabel.load(SHARED_LABELS / f"{name}.nii.gz")
        mask = np.asarray(src.dataobj)
        spacing = np.array(src.header.get_zooms()[:3], float)
        x = np.load(out / f"{name}_x.npy")
        y = np.load(out / f"{name}_y.npy")
        resampled = (spacing / np.array(TARGET_SPACING) * mask.shape).astype(int)
        expected = tuple(int(max(r, m)) for r, m in zip(resampled, MIN_SHAPE, strict=True))
        assert x.shape == y.shape == (1, *expected)
        assert min(x.shape[1:]) >= 128
        assert x.dtype == np.float32 and y.dtype == np.uint8
        assert LOW - 1e-5 <= float(x.min()) and float(x.max()) <= HIGH + 1e-5
        assert float(x.min()) < -2.3, "air and fat are clipped to the window's floor"
        assert set(np.unique(y).tolist()) == set(np.unique(mask).tolist()) == {0, 1, 2}
        # foreground volume in mm^3 survives resampling to within 10 %
        for c in (1, 2):
            before = (mask == c).sum() * np.prod(spacing)
            after = (y == c).sum() * np.prod(TARGET_SPACING)
            assert abs(after - before) / before < 0.10
        # the slice axis was padded evenly with edge values
        pad = expected[0] - resampled[0]
        assert pad > 0
        np.testing.assert_array_equal(x[0, 0], x[0, pad // 2])
        np.testing.assert_array_equal(x[0, -1], x[0, -1 - (pad - pad // 2)])
        assert manifest["cases"][name]["shape"] == list(expected)
    # the prepared folder is a dataset, and a second run skips what is done
    assert KiTS19Dataset(out).synthetic
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    again = prepare_kits19(raw, out, synthesize_ct=True, progress=False, log=logs.append)
    assert again["done"] == [] and again["skipped"] == list(REAL_CASES)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")} == mtimes


def test_prepare_kits19_layout_with_images_resamples_clips_and_normalises(tmp_path):
    shape, spacing = (20, 30, 24), (3.2, 0.6, 0.6)
    hu = np.full(shape, 101, np.int16)  # normalises to exactly 0
    hu[:, :5] = -1000  # below the window: clipped to -79
    hu[:, -5:] = 2000  # above: clipped to 304
    mask = np.zeros(shape, np.uint8)
    mask[5:15, 10:20, 8:16] = 1
    mask[8:12, 12:16, 10:14] = 2
    save_nifti(tmp_path / "raw" / "case_00004" / "imaging.nii.gz", hu, spacing)
    save_nifti(tmp_path / "raw" / "case_00004" / "segmentation.nii.gz", mask, spacing)
    save_nifti(tmp_path / "raw" / "case_00005" / "imaging.nii.gz", hu, spacing)  # no label
    out = tmp_path / "out"
    result = prepare_kits19(tmp_path / "raw", out, scale=0.25, progress=False, log=lambda m: None)
    assert result["done"] == ["case_00004"] and result["synthetic_ct"] is False
    x, y = KiTS19Dataset(out)[0]
    # target spacing / 0.25 = (6.4, 4.8, 4.8): (10, 3, 3) voxels, padded to 32 each
    assert x.shape == (1, 32, 32, 32)
    assert np.isclose(x.min(), LOW) and np.isclose(x.max(), HIGH)
    assert np.any(np.isclose(x, 0.0, atol=1e-6))
    assert set(np.unique(y).tolist()) <= {0, 1, 2} and (y == 1).any()


def test_resample_uses_the_reference_output_shape_and_keeps_label_values():
    image = np.linspace(0, 1, 10 * 20 * 30, dtype=np.float32).reshape(10, 20, 30)
    label = (np.arange(10 * 20 * 30).reshape(10, 20, 30) % 3).astype(np.uint8)
    img, lab = resample(image, label, (2.5, 0.7, 0.7), TARGET_SPACING)
    assert img.shape == lab.shape == (15, 11, 17)  # floor(shape * spacing / target)
    assert set(np.unique(lab).tolist()) <= {0, 1, 2}
    assert np.isclose(img[0, 0, 0], 0.0) and np.isclose(img[-1, -1, -1], 1.0)  # corners kept
    same = resample(image, label, TARGET_SPACING, TARGET_SPACING)
    assert same[0] is image and same[1] is label


def test_pad_to_min_shape_splits_edge_padding_as_the_reference():
    image = np.arange(5, dtype=np.float32).reshape(1, 5, 1, 1) * np.ones((1, 5, 8, 9), np.float32)
    label = np.ones((1, 5, 8, 9), np.uint8)
    img, lab = pad_to_min_shape(image, label, (8, 8, 8))
    assert img.shape == lab.shape == (1, 8, 8, 9)
    assert img[0, :, 0, 0].tolist() == [0, 0, 1, 2, 3, 4, 4, 4]  # 3 = 1 before + 2 after
    assert lab.all()


def test_preprocess_case_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="differs"):
        preprocess_case(np.zeros((4, 4, 4)), np.zeros((4, 4, 5), np.uint8), (1, 1, 1))


def test_mask_only_cases_need_synthesize_ct_and_settings_must_match(tmp_path):
    mask = np.zeros((8, 40, 40), np.uint8)
    mask[2:6, 10:30, 10:30] = 1
    save_nifti(tmp_path / "raw" / "case_00001.nii.gz", mask, (5.0, 0.8, 0.8))
    with pytest.raises(ValueError, match="--synthesize-ct"):
        prepare_kits19(tmp_path / "raw", tmp_path / "out", progress=False, log=lambda m: None)
    quiet = {"progress": False, "log": lambda m: None, "synthesize_ct": True}
    prepare_kits19(tmp_path / "raw", tmp_path / "out", scale=0.25, **quiet)
    with pytest.raises(ValueError, match="other settings"):
        prepare_kits19(tmp_path / "raw", tmp_path / "out", scale=0.5, **quiet)
    forced = prepare_kits19(tmp_path / "raw", tmp_path / "out", scale=0.5, force=True, **quiet)
    assert forced["done"] == ["case_00001"]
    assert np.load(tmp_path / "out" / "case_00001_x.npy").shape[1:] == (64, 64, 64)
    with pytest.raises(FileNotFoundError, match="case_00002"):
        prepare_kits19(tmp_path / "raw", tmp_path / "o2", cases=[2], **quiet)
    assert [c.name for c in find_cases(tmp_path / "raw")] == ["case_00001"]


def test_cli_reports_synthetic_images_and_fails_naming_a_corrupt_mask(tmp_path, capsys):
    mask = np.zeros((8, 40, 40), np.uint8)
    mask[2:6, 10:30, 10:30] = 1
    save_nifti(tmp_path / "raw" / "case_00001.nii.gz", mask, (5.0, 0.8, 0.8))
    bad = save_nifti(tmp_path / "raw" / "case_00002.nii.gz", mask, (5.0, 0.8, 0.8))
    bad.write_bytes(bad.read_bytes()[:-20])
    argv = ["prepare", "kits19", str(tmp_path / "raw"), str(tmp_path / "out"),
            "--synthesize-ct", "--scale", "0.25", "--no-progress"]
    assert cli_main(argv) == 1
    out = capsys.readouterr().out
    assert "SYNTHETIC" in out
    assert "FAILED case_00002" in out and str(bad) in out
    assert KiTS19Dataset(tmp_path / "out").cases == ["case_00001"]
    assert cli_main(["prepare", "kits19", str(tmp_path / "nowhere"), str(tmp_path / "o")]) == 2
