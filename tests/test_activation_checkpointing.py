"""Activation checkpointing composed with auto and manual wrap, on 2 CPU processes (all trainings in one launch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scenarios.common import assert_adam_close, reference_training
from scenarios.config import Scenario

from conftest import Jobs, run_jobs
from lightning_fairscale.strategies import DDPFullyShardedStrategy

STEPS = 3
CHECKPOINTED = Scenario(checkpointing=True, steps=STEPS)
CASES = {  # name -> (scenario, the FSDP units expected)
    # size policy: each checkpointed Block becomes one unit, nothing inside it
    "size": (CHECKPOINTED, ["", "net.1", "net.2"]),
    "offload": (CHECKPOINTED.replace(checkpointing_offload=True), ["", "net.1", "net.2"]),
    # too small: still a unit per block
    "default-size": (CHECKPOINTED.replace(min_num_params=100000000), ["", "net.1", "net.2"]),
    # other Linears wrapped as asked
    "callable": (CHECKPOINTED.replace(policy="callable"), ["", "net.0", "net.1", "net.2", "net.3"]),
    "blocks": (CHECKPOINTED.replace(policy="blocks"), ["", "net.1", "net.2"]),
    # The user's own units, checkpointed inside.
    "manual": (CHECKPOINTED.replace(model="manual"), ["", "net.1", "net.2"]),
}
JOBS = {**{name: scenario for name, (scenario, _) in CASES.items()}, "without": Scenario(policy="blocks", steps=STEPS)}


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return reference_training(STEPS, "adam")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return run_jobs(tmp_path_factory.mktemp("activation_checkpointing"), JOBS)


@pytest.mark.parametrize("name", CASES)
def test_checkpointed_blocks_recompute_and_stay_exact(runs: Jobs, expected: dict[str, torch.Tensor], name: str) -> None:
    result, units = runs[name], CASES[name][1]
    # A Linear inside a checkpointed block runs twice per step: forward, and again in backward.
    assert result["block_linear_calls"] == 2 * STEPS
    paths = [
        u["path"].replace("_fsdp_wrapped_module._fpw_module.", "").replace("_fpw_module.", "") for u in result["units"]
    ]
    assert paths == units
    assert all("checkpoint" not in key and "_fsdp" not in key for key in result["state_dict"])
    assert_adam_close(result["state_dict"], expected)


def test_without_checkpointing_nothing_is_recomputed(runs: Jobs, expected: dict[str, torch.Tensor]) -> None:
    result = runs["without"]
    assert result["block_linear_calls"] == STEPS
    assert_adam_close(result["state_dict"], expected)


@pytest.mark.parametrize("value", ["Block", [torch.nn.Linear, "x"], 3, [torch.Tensor]])
def test_activation_checkpointing_needs_module_classes(value: Any) -> None:
    with pytest.raises(TypeError, match="must be an `nn.Module` subclass or a list of them"):
        DDPFullyShardedStrategy(activation_checkpointing=value)


def test_single_class_and_list_are_accepted() -> None:
    assert DDPFullyShardedStrategy(activation_checkpointing=torch.nn.Linear).activation_checkpointing == (
        torch.nn.Linear,
    )
    both = DDPFullyShardedStrategy(activation_checkpointing=[torch.nn.Linear, torch.nn.GRU])
    assert both.activation_checkpointing == (torch.nn.Linear, torch.nn.GRU)
