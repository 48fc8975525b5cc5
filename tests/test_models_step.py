"""The one simulated step and the one UNet step that `run`, `tune` and `bench` share."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch

import autominato
from autominato.models.step import SleepStep, UNetStep, image_label

PACKAGE = Path(autominato.__file__).parent


def _definitions() -> dict[str, list[str]]:
    """Where the package defines a step class or builds an optimiser or the training loss."""
    found: dict[str, list[str]] = {"SleepStep": [], "UNetStep": [], "optim": [], "DiceCELoss()": []}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in found:
                found[node.name].append(where)
            elif isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name.startswith("torch.optim."):
                    found["optim"].append(where)
                elif name == "DiceCELoss":
                    found["DiceCELoss()"].append(where)
    return found


def test_the_steps_are_defined_once_and_run_tune_and_bench_import_them():
    step = "models/step.py"
    assert _definitions() == {
        "SleepStep": [step],
        "UNetStep": [step],
        "optim": [step],
        "DiceCELoss()": [step],
    }
    from autominato import tuning
    from autominato.bench import step as bench_step
    from autominato.tuning import steps as tuning_steps

    assert tuning.SleepStep is SleepStep and bench_step.SleepStep is SleepStep
    assert bench_step.UNetStep is UNetStep and tuning_steps.UNetStep is UNetStep
    train_source = (PACKAGE / "train.py").read_text()
    assert "from autominato.models.step import UNetStep" in train_source


def test_the_simulated_step_takes_the_time_it_is_given():
    step = SleepStep(0.05)
    durations = []
    for _ in range(5):
        t = time.perf_counter()
        step(None)
        durations.append(time.perf_counter() - t)
    # time.sleep never returns early; a loaded machine may wake it late, hence the wide top.
    assert all(d >= 0.05 for d in durations)
    assert sum(durations) < 5 * 0.05 + 0.5
    t = time.perf_counter()
    SleepStep(0)(None)
    assert time.perf_counter() - t < 0.05
    assert repr(step) == "SleepStep(0.05 s)"
    with pytest.raises(ValueError, match=">= 0 seconds"):
        SleepStep(-1)


def test_the_unet_step_lowers_the_loss_on_a_tiny_batch():
    torch.manual_seed(0)
    step = UNetStep("compact", "cpu")
    assert not step.amp  # float32 on the CPU
    assert isinstance(step.opt, torch.optim.SGD) and step.opt.defaults["nesterov"]
    image = torch.randn(1, 1, 64, 64, 64)
    label = torch.zeros(1, 1, 64, 64, 64, dtype=torch.uint8)
    label[..., 16:48, 16:48, 16:48] = 1
    label[..., 24:40, 24:40, 24:40] = 2
    losses = [step((image, label)) for _ in range(6)]
    assert all(isinstance(v, float) for v in losses) and step.last_loss == losses[-1]
    # Measured 1.01 -> 0.86 over these six steps: the update follows the gradient.
    assert losses[-1] < losses[0] - 0.05
    assert losses == sorted(losses, reverse=True)
    assert step({"image": image, "label": label}) < losses[-1]  # the dict layout too


def test_the_unet_step_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown model"):
        UNetStep("huge", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            UNetStep("compact", "cuda")
    with pytest.raises(TypeError, match="expected a batch"):
        image_label(torch.zeros(2))
