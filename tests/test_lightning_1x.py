"""Resuming checkpoints written by Lightning 1.9.5's own FairScale strategies, on 2 processes.

The fixtures (``tests/fixtures/lightning_1x``, made by ``make_fixtures.py`` with pytorch-lightning 1.9.5) hold the
checkpoint of step 3 of a 6-step run; ``reference.pt`` holds that run's weights after step 6. Every resume runs
``scenarios/train.py`` to step 6: 3 steps after the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from scenarios.common import max_difference, reference_training

from conftest import TRAIN_SCRIPT, run_script
from lightning_fairscale.convert_1x import main as convert

FIXTURES = Path(__file__).parent / "fixtures" / "lightning_1x"
RESUME = ["--depth", "1", "--samples", "8", "--steps", "6", "--scheduler"]
GAMMA = 0.7  # the StepLR of scenarios.common


def fixture(name: str) -> dict[str, Any]:
    return torch.load(FIXTURES / f"{name}.ckpt", weights_only=True)


def straight_1x(name: str) -> dict[str, torch.Tensor]:
    """The weights 1.9.5 itself reached after 6 steps, going on from the checkpoint."""
    return torch.load(FIXTURES / "reference.pt", weights_only=True)["runs"][name]["straight"]


def resume(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """Rank 0's result of ``train.py`` resumed with ``args``, and everything the run printed."""
    out = tmp_path / "result.pt"
    proc = run_script([str(TRAIN_SCRIPT), "--out", str(out), *RESUME, *args], cwd=tmp_path)
    return torch.load(out, weights_only=False), proc.stdout + proc.stderr


def assert_went_on_from_the_checkpoint(result: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    """Loops, LR scheduler and callbacks were restored: 3 more steps only, the schedule and the count go on."""
    assert result["global_step"] == 6
    assert len(result["losses"]) == 3  # steps 4 to 6: the loops' state came from the checkpoint
    assert result["batches_counted"] == 6  # CountTrainBatches saw 3 batches under 1.9.5, 3 here
    saved_lr = checkpoint["optimizer_states"][0]["param_groups"][0]["lr"]
    assert result["lr"] == [pytest.approx(saved_lr * GAMMA**3)]


def fresh_optimizer_reference(checkpoint: dict[str, Any], optimizer: str) -> dict[str, torch.Tensor]:
    """Unsharded training for 3 steps from the checkpoint's weights with a fresh optimizer at its learning rate."""
    lr = checkpoint["optimizer_states"][0]["param_groups"][0]["lr"]
    return reference_training(
        3, optimizer, depth=1, scheduler=True, num_samples=8, start=checkpoint["state_dict"], lr=lr
    )


def test_fsdp_checkpoint_of_a_stateless_optimizer_resumes_exactly(tmp_path: Path) -> None:
    checkpoint = fixture("fsdp_sgd")
    result, output = resume(tmp_path, "--optimizer", "plain_sgd", "--ckpt-path", str(FIXTURES / "fsdp_sgd.ckpt"))
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "resumes exactly" in output
    # As 1.9.5 went on itself, and as unsharded training from the checkpoint's weights (SGD has nothing else).
    assert max_difference(result["state_dict"], straight_1x("fsdp_sgd")) < 1e-6
    assert max_difference(result["state_dict"], fresh_optimizer_reference(checkpoint, "plain_sgd")) < 1e-6


def test_fsdp_checkpoint_of_adam_fails_before_training(tmp_path: Path) -> None:
    args = [*RESUME, "--optimizer", "adam", "--ckpt-path", str(FIXTURES / "fsdp_adam.ckpt")]
    proc = run_script([str(TRAIN_SCRIPT), "--out", str(tmp_path / "unused.pt"), *args], cwd=tmp_path, expect_ok=False)
    assert proc.returncode != 0
    assert "Lightning1xOptimizerStateError" in proc.stderr
    assert "only rank 0's shard" in proc.stderr and 'lightning_1x_optimizer_state="reset"' in proc.stderr
    assert "lightning-fairscale-convert-1x" in proc.stderr
    assert "Restored all states" not in proc.stdout + proc.stderr  # failed while restoring, before any step


def test_fsdp_checkpoint_of_adam_resumes_with_a_fresh_state_when_asked(tmp_path: Path) -> None:
    checkpoint = fixture("fsdp_adam")
    args = ["--optimizer", "adam", "--lightning-1x-optimizer-state", "reset"]
    result, output = resume(tmp_path, *args, "--ckpt-path", str(FIXTURES / "fsdp_adam.ckpt"))
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "dropped exp_avg, exp_avg_sq, step" in output
    assert max_difference(result["state_dict"], fresh_optimizer_reference(checkpoint, "adam")) < 1e-6


def test_converted_fsdp_checkpoint_resumes_with_ddp_sharded(tmp_path: Path) -> None:
    """``lightning-fairscale-convert-1x`` output resumes with a fresh state, without any option, in either strategy."""
    converted = tmp_path / "converted.ckpt"
    assert convert([str(FIXTURES / "fsdp_adam.ckpt"), str(converted)]) == 0
    checkpoint = fixture("fsdp_adam")
    args = ["--optimizer", "adam", "--strategy-name", "ddp_sharded", "--ckpt-path", str(converted)]
    result, output = resume(tmp_path, *args)
    assert result["strategy"] == "DDPShardedStrategy"
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "converted from Lightning 1.9.5" in output
    assert max_difference(result["state_dict"], fresh_optimizer_reference(checkpoint, "adam")) < 1e-6


def test_ddp_sharded_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    """1.9.5's ``"ddp_sharded"`` consolidated the full optimizer state: Adam goes on exactly as under 1.9.5."""
    checkpoint = fixture("sharded_adam")
    args = ["--optimizer", "adam", "--strategy-name", "ddp_sharded", "--ckpt-path", str(FIXTURES / "sharded_adam.ckpt")]
    result, output = resume(tmp_path, *args)
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "FairScale checkpoint" not in output  # nothing adopted: the plain layout loads as it is
    assert max_difference(result["state_dict"], straight_1x("sharded_adam")) < 1e-6
