"""`autominato bench` on the KiTS19 workload: prepared cases, MLPerf transforms, every sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autominato.bench.arms import Context
from autominato.bench.kits19 import CycledDataset, kits19_workload, patch_for
from autominato.bench.runner import Options, run_workload
from autominato.bench.workload import SampleFn

SHARED = Path(__file__).resolve().parents[2] / "shared" / "kits19"


def write_cases(root: Path, shapes: list[tuple[int, int, int]]) -> Path:
    """MLPerf-layout cases: a float32 image and a uint8 label with a foreground block each."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, shape in enumerate(shapes):
        image = rng.standard_normal((1, *shape)).astype(np.float32)
        label = np.zeros((1, *shape), np.uint8)
        label[0, 4:12, 4:12, 4:12] = 1
        label[0, 6:9, 6:9, 6:9] = 2
        np.save(root / f"case_{i:05d}_x.npy", image)
        np.save(root / f"case_{i:05d}_y.npy", label)
    return root


def test_patch_follows_the_scale_and_the_unet_divisor():
    assert patch_for(1.0) == 128
    assert patch_for(0.5) == 64
    assert patch_for(0.3) == 32  # 38.4 rounds to two multiples of 16
    assert patch_for(0.3, multiple=32) == 32
    assert patch_for(0.05) == 16  # never below one multiple
    with pytest.raises(ValueError, match="scale must be > 0"):
        patch_for(0)


def test_cycled_dataset_visits_cases_in_turn_and_names_their_files(tmp_path):
    from autominato.data.kits19 import KiTS19Dataset

    ds = KiTS19Dataset(write_cases(tmp_path, [(32, 32, 32)] * 3))
    cyc = CycledDataset(ds, 7)
    assert len(cyc) == 7
    assert [Path(cyc.sample_path(i)).name for i in (0, 4, 6)] == [
        "case_00000_x.npy",
        "case_00001_x.npy",
        "case_00000_x.npy",
    ]
    assert np.array_equal(cyc[5][0], ds[2][0])
    with pytest.raises(IndexError, match="sample index 7 out of range"):
        cyc[7]


def test_kits19_workload_crops_the_scaled_patch_from_every_case(tmp_path):
    data = write_cases(tmp_path / "prepared", [(40, 36, 36), (34, 48, 40)])
    wl = kits19_workload(data=data, samples=6, scale=0.25, step_s=0.005)
    assert len(wl) == 6 and wl.batch_size == 2 and wl.n_batches == 3
    assert wl.step_basis == "floor"  # a step not given is calibrated to the floor
    fn = SampleFn(wl)
    for i in range(6):
        index, (image, label) = fn(i)
        assert index == i
        assert image.shape == (1, 32, 32, 32) and image.dtype == np.float32
        assert label.shape == (1, 32, 32, 32) and label.dtype == np.uint8
    # The same (seed, epoch, index) gives the same crop, whichever worker runs it.
    assert np.array_equal(fn(3)[1][0], SampleFn(wl)(3)[1][0])


@pytest.mark.parametrize("arm", ["dataloader", "autominato"])
def test_kits19_epoch_delivers_every_sample_once(tmp_path, arm):
    data = write_cases(tmp_path / "prepared", [(36, 36, 36), (40, 40, 40), (36, 44, 36)])
    wl = kits19_workload(data=data, samples=6, scale=0.25, step_s=0.01)
    res = run_workload(
        wl, Options(arms=[arm], repeats=1, isolate=False, ctx=Context(cores=2), log=lambda m: None)
    )
    (rec,) = res.records
    assert rec.status == "ok", rec.status
    assert rec.samples == rec.unique_samples == 6 and rec.batches == 3
    assert res.limit_s <= rec.wall_s and 0 <= rec.idle_ratio <= 1


def test_missing_labels_are_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="KiTS19 labels not found at"):
        kits19_workload(labels=tmp_path / "nowhere", cache=tmp_path / "cache")


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "labels").is_dir(), reason="../shared/kits19 is absent")
def test_kits19_workload_from_a_real_mask_prepares_once_and_runs(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    # The smallest real mask (36 slices): the preparation stays quick at scale 0.25.
    (raw / "case_00148.nii.gz").symlink_to(SHARED / "labels" / "case_00148.nii.gz")
    kw = dict(labels=raw, cases=1, samples=4, scale=0.25, step_s=0.0, cache=tmp_path / "cache")
    logged: list[str] = []
    wl = kits19_workload(**kw, log=logged.append)
    assert "synthetic CT" in wl.description and len(wl) == 4
    assert any("SYNTHETIC" in m for m in logged)
    index, (image, label) = SampleFn(wl)(3)
    assert image.shape == label.shape == (1, 32, 32, 32)
    assert set(np.unique(label)) <= {0, 1, 2}
    logged.clear()
    kits19_workload(**kw, log=logged.append)  # the second time the cases are reused
    assert any("1 case(s) already in" in m for m in logged)
    res = run_workload(
        wl,
        Options(
            arms=["dataloader"], repeats=1, isolate=False, ctx=Context(cores=2), log=lambda m: None
        ),
    )
    assert res.records[0].status == "ok" and res.records[0].samples == 4
