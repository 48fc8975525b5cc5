"""`autominato run`: a few training steps through the real Loader on tiny prepared sets."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import nibabel
import numpy as np
import pytest
import torch

from autominato.cli import main as cli_main
from autominato.data import KiTS19Dataset
from autominato.data.prepare import prepare_kits19
from autominato.models import DiceCELoss, UNet3D
from autominato.train import open_dataset, prepare_demo, train


def made_masks(raw: Path, n: int) -> None:
    """``n`` small kidney/tumour masks of different sizes (flat KiTS19-style folder)."""
    for i in range(n):
        d = 10 + 3 * i
        m = np.zeros((d, 60, 60), np.uint8)
        m[2 : d - 2, 15:35, 10:30] = 1
        m[4:8, 20:26, 14:20] = 2
        img = nibabel.Nifti1Image(m, np.diag([5.0, 0.8, 0.8, 1.0]))
        raw.mkdir(parents=True, exist_ok=True)
        nibabel.save(img, raw / f"case_{i:05d}.nii.gz")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Three prepared cases at scale 0.5 (padded to 64^3), synthetic CT."""
    root = tmp_path_factory.mktemp("tiny")
    made_masks(root / "raw", 3)
    prepare_kits19(root / "raw", root / "out", synthesize_ct=True, scale=0.5, progress=False,
                   log=lambda m: None)
    return root / "out"


def test_run_trains_a_few_steps_and_prints_the_summary(tiny, capsys):
    rc = cli_main(["run", "--data", str(tiny), "--steps", "3", "--patch", "64",
                   "--batch-size", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "SYNTHETIC" in out
    # 3 samples in batches of 2: epoch 0 gives 2 + 1, epoch 1 starts with 2
    assert re.search(r"steps\s+3 \(batch 2, 5 samples, 2 epoch", out), out
    for field in ("samples/s", "data wait", "% of wall time", "stragglers", "deferred"):
        assert field in out
    start, end = map(float, re.search(r"loss\s+start (\S+) -> end (\S+)", out).groups())
    assert math.isfinite(start) and math.isfinite(end) and start > 0
    assert "memory_aware=True" in out


def test_run_with_a_tuned_configuration_says_its_memory_aware_dispatch(tiny, tmp_path, capsys):
    """A file `autominato tune` wrote with memory_aware off: the run's summary says so
    (trial 207: it said only the knobs)."""
    from autominato.config import load_config, save_config
    from autominato.train import _say_other_pipeline

    study = {"pipeline": {"dataset": "mydata:make_dataset", "transform": "mydata:augment"}}
    path = save_config(load_config({"loader": {"memory_aware": False, "batch_size": 2},
                                    "knobs": {"depth": 3}, "study": study}),
                       tmp_path / "loader.yaml")
    rc = cli_main(["run", "--data", str(tiny), "--steps", "2", "--patch", "64",
                   "--config", str(path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "memory_aware=False" in out and "'depth': 3" in out
    assert f"configuration   {path} (worker_kind=process, in_order=False)" in out
    # trial 209: a file tuned on another pipeline was applied without a word
    assert (f"{path} was tuned for dataset mydata:make_dataset and transform mydata:augment; "
            "this run trains autominato.data.kits19:KiTS19Dataset") in " ".join(out.split())
    # one tuned by the kits19 recipe is this run's pipeline: nothing said
    study["pipeline"] = {"recipe": "kits19", "dataset": "autominato.data.kits19:KiTS19Dataset",
                         "transform": "autominato.data.transforms:mlperf_train_transform"}
    same = save_config(load_config({"study": study}), tmp_path / "same.yaml")
    said = io.StringIO()
    _say_other_pipeline(same, load_config(same), KiTS19Dataset(tiny), said)
    # the same class by another import path (review 210), and free-form provenance
    study["pipeline"]["dataset"] = "autominato.data:KiTS19Dataset"
    alias = save_config(load_config({"study": study}), tmp_path / "alias.yaml")
    _say_other_pipeline(alias, load_config(alias), KiTS19Dataset(tiny), said)
    free = save_config(load_config({"study": {"pipeline": "my own loader"}}),
                       tmp_path / "free.yaml")
    _say_other_pipeline(free, load_config(free), KiTS19Dataset(tiny), said)
    assert said.getvalue() == ""


def test_train_counts_steps_samples_epochs_and_waits(tiny):
    res = train(KiTS19Dataset(tiny), epochs=2, batch_size=2, patch=(64, 64, 64), progress=False)
    # 3 samples, batch 2, no drop_last: 2 batches (2 + 1 samples) per epoch
    assert res.steps == 4 and res.samples == 6 and res.epochs_started == 2
    assert len(res.losses) == 4 and all(math.isfinite(v) and v > 0 for v in res.losses)
    assert 0 < res.first_wait_s <= res.data_wait_s < res.wall_s
    assert 0 < res.compute_s < res.wall_s
    assert res.samples_per_s == pytest.approx(6 / res.wall_s)
    assert res.stragglers >= 0 and set(res.knobs) == {"depth", "read_threads", "workers",
                                                      "pool_size"}


def test_run_on_a_nifti_folder_z_scores_and_trains(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for i in range(2):
        (tmp_path / "imagesTr").mkdir(exist_ok=True)
        (tmp_path / "labelsTr").mkdir(exist_ok=True)
        t1 = rng.uniform(0, 255, (70, 66, 64)).astype(np.uint8)
        lab = np.zeros((70, 66, 64), np.uint8)
        lab[5:20, 5:20, 5:20] = 1 + i
        nibabel.save(nibabel.Nifti1Image(t1, np.eye(4)), tmp_path / "imagesTr" / f"s{i}.nii.gz")
        nibabel.save(nibabel.Nifti1Image(lab, np.eye(4)), tmp_path / "labelsTr" / f"s{i}.nii.gz")
    ds = open_dataset(tmp_path)
    x, _ = ds[0]
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3
    rc = cli_main(["run", "--data", str(tmp_path), "--epochs", "1", "--patch", "64",
                   "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "NiftiDataset" in out and re.search(r"steps\s+1 \(batch 2", out)


def test_run_names_the_file_of_a_corrupt_sample(tiny, tmp_path, capsys):
    for p in tiny.glob("case_*.npy"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    bad = tmp_path / "case_00001_y.npy"
    np.save(bad, np.zeros((3, 3), np.uint8))
    rc = cli_main(["run", "--data", str(tmp_path), "--steps", "2", "--patch", "64",
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert str(bad) in err and "sample 1" in err


def test_run_names_the_sample_whose_volume_is_smaller_than_the_patch(tiny, tmp_path, capsys):
    for p in tiny.glob("case_*.npy"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    small = tmp_path / "case_00002_x.npy"
    np.save(small, np.zeros((1, 40, 64, 64), np.float32))
    np.save(tmp_path / "case_00002_y.npy", np.zeros((1, 40, 64, 64), np.uint8))
    rc = cli_main(["run", "--data", str(tmp_path), "--epochs", "1", "--patch", "64",
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "smaller than the patch" in err and str(small) in err and "index 2" in err


def test_demo_set_is_generated_once_and_marked_synthetic(tmp_path):
    out = prepare_demo(tmp_path, cases=2, seed=3)
    ds = KiTS19Dataset(out)
    assert len(ds) == 2 and ds.synthetic
    x, y = ds[0]
    assert min(x.shape[1:]) >= 128 and set(np.unique(y).tolist()) == {0, 1, 2}
    mtime = (out / "case_00000_x.npy").stat().st_mtime_ns
    prepare_demo(tmp_path, cases=2, seed=3)
    assert (out / "case_00000_x.npy").stat().st_mtime_ns == mtime


def test_models_segment_a_patch_and_check_their_input():
    loss = DiceCELoss()
    for model in (UNet3D.compact(), UNet3D.mlperf()):
        assert model.divisor == 32
        with torch.no_grad():  # forward only: the full-size backward is too slow for a test
            logits = model(torch.randn(1, 1, 64, 64, 64))
        assert logits.shape == (1, 3, 64, 64, 64)
        value = loss(logits, torch.zeros(1, 1, 64, 64, 64, dtype=torch.uint8))
        assert value.ndim == 0 and math.isfinite(float(value))
        with pytest.raises(ValueError, match="divisible by 32"):
            model(torch.randn(1, 1, 64, 64, 48))
    assert sum(p.numel() for p in UNet3D.mlperf().parameters()) > 30 * sum(
        p.numel() for p in UNet3D.compact().parameters())
    for bad in ((48, 64, 64), (32, 64, 64)):
        with pytest.raises(ValueError, match="multiple of 32 and at least 64"):
            train(None, steps=1, patch=bad, progress=False)


def test_dice_ce_loss_is_lower_for_the_right_answer():
    target = torch.zeros(1, 1, 8, 8, 8, dtype=torch.uint8)
    target[0, 0, 2:6, 2:6, 2:6] = 1
    target[0, 0, 3:5, 3:5, 3:5] = 2
    onehot = torch.nn.functional.one_hot(target[:, 0].long(), 3).movedim(-1, 1).float()
    right, wrong = DiceCELoss()(onehot * 20, target), DiceCELoss()(onehot.flip(1) * 20, target)
    assert float(right) < 0.01 < 0.9 < float(wrong)


def test_run_fits_its_default_patch_to_cases_prepared_smaller(tiny, capsys):
    """Cases prepared with --scale 0.5 are padded to 64^3: without --patch, run crops 64^3
    (MLPerf's 128^3 fails on every sample); a --patch larger than that is named at once."""
    from autominato.train import patch_for_data

    assert patch_for_data(tiny, None) == (64, 64, 64)
    assert patch_for_data(tiny, (64, 64, 64)) == (64, 64, 64)
    with pytest.raises(ValueError, match=r"--patch 128x128x128 is larger than the smallest case "
                       r".*\(64x64x64\)"):
        patch_for_data(tiny, (128, 128, 128))
    with pytest.raises(ValueError, match="--patch 65x65x65: every size must be a multiple of 32"):
        patch_for_data(tiny, (65, 65, 65))
    rc = cli_main(["run", "--data", str(tiny), "--steps", "1", "--batch-size", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "patch 64x64x64: MLPerf's 128^3 shrunk to fit the smallest case" in out


def test_run_fits_the_patch_to_the_smallest_case_not_to_the_padding(tmp_path):
    """prepare.json's min_shape is only the padding floor: the cases may be larger."""
    from autominato.train import patch_for_data

    cases = {"case_00000": {"shape": [81, 170, 200]}, "case_00001": {"shape": [94, 200, 170]}}
    (tmp_path / "prepare.json").write_text(json.dumps({"min_shape": [64, 64, 64], "cases": cases}))
    assert patch_for_data(tmp_path, None) == (64, 128, 128)
    assert patch_for_data(tmp_path, (64, 160, 160)) == (64, 160, 160)
    with pytest.raises(ValueError, match=r"larger than the smallest case .*\(81x170x170\)"):
        patch_for_data(tmp_path, (96, 160, 160))
    cases = {"case_00000": {"shape": [40, 40, 40]}}
    (tmp_path / "prepare.json").write_text(json.dumps({"min_shape": [32, 32, 32], "cases": cases}))
    with pytest.raises(ValueError, match=r"smallest case .* is 40x40x40, .* larger --scale"):
        patch_for_data(tmp_path, None)


@pytest.mark.parametrize("args, says", [
    (["--batch-size", "0"], "argument --batch-size: expected an integer >= 1"),
    (["--monitor-interval", "-1"], "argument --monitor-interval"),
    (["--device", "tpu"], "--device tpu: "),
    (["--metrics-port", "0", "--metrics-host", "999.1.1.1"], "--metrics-host 999.1.1.1: "),
])
def test_run_names_a_bad_argument_without_a_traceback(tiny, capsys, args, says):
    with pytest.raises(SystemExit) if args[0] in ("--batch-size", "--monitor-interval") else \
            contextlib.nullcontext():
        rc = cli_main(["run", "--data", str(tiny), "--steps", "1", "--no-progress", *args])
        assert rc == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_run_data_that_is_a_file_is_not_a_folder(tmp_path, capsys):
    f = tmp_path / "README.md"
    f.write_text("x")
    assert cli_main(["run", "--data", str(f), "--steps", "1"]) == 2
    assert f"{f}: not a folder" in capsys.readouterr().err


def test_an_empty_metrics_host_means_every_interface_as_in_the_loader():
    # Review 86: the loader and the exporter take "" (socketserver's every interface), but the
    # CLI refused it: getaddrinfo("") fails.
    from autominato.train import _check_host

    _check_host("")
    _check_host("0.0.0.0")
    with pytest.raises(ValueError, match="--metrics-host 999.1.1.1"):
        _check_host("999.1.1.1")
