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
from scenarios.common import assert_adam_close, max_difference, reference_training
from scenarios.config import Scenario

from conftest import Jobs, run_jobs
from lightning_fairscale.convert_1x import main as convert

FIXTURES = Path(__file__).parent / "fixtures" / "lightning_1x"
RESUME = Scenario(depth=1, samples=8, steps=6, scheduler=True)
GAMMA = 0.7  # the StepLR of scenarios.common


def fixture(name: str) -> dict[str, Any]:
    return torch.load(FIXTURES / f"{name}.ckpt", weights_only=True)


def straight_1x(name: str) -> dict[str, torch.Tensor]:
    """The weights 1.9.5 itself reached after 6 steps, going on from the checkpoint."""
    return torch.load(FIXTURES / "reference.pt", weights_only=True)["runs"][name]["straight"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """Every resume of this module, one after another in one 2-process launch of ``train.py``."""
    folder = tmp_path_factory.mktemp("lightning_1x")
    converted = folder / "converted.ckpt"
    assert convert([str(FIXTURES / "fsdp_adam.ckpt"), str(converted)]) == 0
    jobs = {
        "fsdp-sgd": RESUME.replace(optimizer="plain_sgd", ckpt_path=str(FIXTURES / "fsdp_sgd.ckpt")),
        "fsdp-adam": RESUME.replace(optimizer="adam", ckpt_path=str(FIXTURES / "fsdp_adam.ckpt")),
        "fsdp-adam-reset": RESUME.replace(optimizer="adam", lightning_1x_optimizer_state="reset",
                                          ckpt_path=str(FIXTURES / "fsdp_adam.ckpt")),
        "converted-ddp-sharded": RESUME.replace(optimizer="adam", strategy_name="ddp_sharded",
                                                ckpt_path=str(converted)),
        "ddp-sharded": RESUME.replace(optimizer="adam", strategy_name="ddp_sharded",
                                      ckpt_path=str(FIXTURES / "sharded_adam.ckpt")),
    }  # fmt: skip
    return run_jobs(folder, jobs, failing=["fsdp-adam"])


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


def test_fsdp_checkpoint_of_a_stateless_optimizer_resumes_exactly(runs: Jobs) -> None:
    checkpoint = fixture("fsdp_sgd")
    result, output = runs["fsdp-sgd"], runs.output("fsdp-sgd")
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "resumes exactly" in output
    # As 1.9.5 went on itself, and as unsharded training from the checkpoint's weights (SGD has nothing else).
    assert max_difference(result["state_dict"], straight_1x("fsdp_sgd")) < 1e-6
    assert max_difference(result["state_dict"], fresh_optimizer_reference(checkpoint, "plain_sgd")) < 1e-6


def test_fsdp_checkpoint_of_adam_fails_before_training(runs: Jobs) -> None:
    for error in runs.errors("fsdp-adam"):  # every rank
        assert error["type"] == "Lightning1xOptimizerStateError"
        message = error["message"]
        assert "only rank 0's shard" in message and 'lightning_1x_optimizer_state="reset"' in message
        assert "lightning-fairscale-convert-1x" in message
        assert error["trained_batches"] == 0
    assert "Restored all states" not in runs.output("fsdp-adam")  # failed while restoring, before any step


def test_fsdp_checkpoint_of_adam_resumes_with_a_fresh_state_when_asked(runs: Jobs) -> None:
    checkpoint = fixture("fsdp_adam")
    result, output = runs["fsdp-adam-reset"], runs.output("fsdp-adam-reset")
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "dropped exp_avg, exp_avg_sq, step" in output
    # A fresh Adam's steps: the update relative to its size (scenarios.common.ADAM_RTOL), from the checkpoint's weights.
    assert_adam_close(result["state_dict"], fresh_optimizer_reference(checkpoint, "adam"), checkpoint["state_dict"])


def test_converted_fsdp_checkpoint_resumes_with_ddp_sharded(runs: Jobs) -> None:
    """``lightning-fairscale-convert-1x`` output resumes with a fresh state, without any option, in either strategy."""
    checkpoint = fixture("fsdp_adam")
    result, output = runs["converted-ddp-sharded"], runs.output("converted-ddp-sharded")
    assert result["strategy"] == "DDPShardedStrategy"
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "converted from Lightning 1.9.5" in output
    # A fresh Adam's steps: the update relative to its size (scenarios.common.ADAM_RTOL), from the checkpoint's weights.
    assert_adam_close(result["state_dict"], fresh_optimizer_reference(checkpoint, "adam"), checkpoint["state_dict"])


def test_ddp_sharded_checkpoint_resumes_exactly(runs: Jobs) -> None:
    """1.9.5's ``"ddp_sharded"`` consolidated the full optimizer state: Adam goes on exactly as under 1.9.5."""
    checkpoint = fixture("sharded_adam")
    result, output = runs["ddp-sharded"], runs.output("ddp-sharded")
    assert_went_on_from_the_checkpoint(result, checkpoint)
    assert "FairScale checkpoint" not in output  # nothing adopted: the plain layout loads as it is
    # 1.9.5's own run was recorded on another machine: Adam's update relative to its size (scenarios.common.ADAM_RTOL).
    assert_adam_close(result["state_dict"], straight_1x("sharded_adam"), checkpoint["state_dict"])
