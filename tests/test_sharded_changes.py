"""``DDPShardedStrategy`` while the loop changes the model's state between steps (issue 47, items 1-3), Trainer and
Fabric, against the same training unsharded (one process, the full global batch, no strategy).

All the 2-process cases run in one launch of ``scenarios/sharded_changes.py``; each reference runs in this process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scenarios import sharded_changes
from scenarios.common import RegressionModelWrapper, assert_adam_close, build_network

from conftest import TESTS, run_script

#: The optimizers' states (Adam's moments are sums of gradients and of their squares: a rounding stays a rounding).
#: The weights after Adam's steps: relative to the update (``start``; scenarios.common.ADAM_RTOL).
ATOL = 1e-5
SCRIPT = TESTS / "scenarios" / "sharded_changes.py"
CASES = list(sharded_changes.CASES)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("sharded-changes")
    out = workdir / "results.pt"
    args = ["--out", str(out), "--cases", ",".join(CASES), "--workdir", str(workdir)]
    run_script([str(SCRIPT), *args], workdir, ranks=2)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each case in this process on one device, without a strategy of ours."""
    workdir = tmp_path_factory.mktemp("unsharded-changes")
    return {name: sharded_changes.run(name, "auto", 1, workdir) for name in CASES}


def optimizer_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference between two optimizer state dicts' per-parameter states (the same entries)."""
    assert sorted(a["state"]) == sorted(b["state"]), (sorted(a["state"]), sorted(b["state"]))
    worst = 0.0
    for index, state in a["state"].items():
        assert sorted(state) == sorted(b["state"][index]), index
        for key, value in state.items():
            other = torch.as_tensor(b["state"][index][key])
            worst = max(worst, float((torch.as_tensor(value).float() - other).abs().max()))
    return worst


def start(weights: str) -> dict[str, torch.Tensor]:
    """The weights a case's module ``weights`` (a key of its result) starts from: ``build_network()``'s."""
    if weights in ("generator", "discriminator"):  # Fabric's modules of the GAN case, their own state dicts
        return dict(zip(("generator", "discriminator"), sharded_changes.gan_networks()))[weights].state_dict()
    full = RegressionModelWrapper(build_network()).state_dict()  # net.*: Trainer's RegressionModel, Fabric's model
    generator, discriminator = sharded_changes.gan_networks()  # the Trainer's GAN module
    full.update({f"generator.{k}": v for k, v in generator.state_dict().items()})
    full.update({f"discriminator.{k}": v for k, v in discriminator.state_dict().items()})
    return full


def assert_same_training(
    result: dict[str, Any], reference: dict[str, Any], weights: str, optimizers: list[str]
) -> None:
    assert "error" not in result, result["error"]
    assert_adam_close(result[weights], reference[weights], start(weights), what="against unsharded training")
    for key in optimizers:
        for index, (state, expected) in enumerate(zip(result[key], reference[key])):
            difference = optimizer_difference(state, expected)
            assert difference < ATOL, f"{key}[{index}]: {difference:.3g} off unsharded training"


@pytest.mark.parametrize(
    "name", ["validate", "freeze", "freeze-resume", "freeze-buckets", "gan", "gan-resume", "gan-buckets"]
)
def test_trainer_equals_unsharded_training(sharded: dict[str, Any], unsharded: dict[str, Any], name: str) -> None:
    result, reference = sharded[name], unsharded[name]
    assert_same_training(result, reference, "state_dict", ["optimizer_states"])
    assert result["global_step"] == reference["global_step"]


def test_trainer_validated_while_training(sharded: dict[str, Any]) -> None:
    assert sharded["validate"]["validation_batches"] == 4 * 2  # 2 batches after steps 2, 4, 6, 8


def test_frozen_layers_kept_their_weights_and_optimizer_state(unsharded: dict[str, Any]) -> None:
    """The schedule bites: in the reference, the first layer (frozen in epoch 0) and the last (frozen in epoch 2)
    have Adam states of 4 steps, the others of 6; the sharded runs equal it (above)."""
    (state,) = unsharded["freeze"]["optimizer_states"]
    steps = {index: float(entry["step"]) for index, entry in state["state"].items()}
    assert steps[0] == 4.0 and steps[len(steps) - 1] == 4.0 and steps[4] == 6.0  # net.0.weight: frozen in epoch 1


@pytest.mark.parametrize("name", ["fabric-validate", "fabric-eval-mode", "fabric-freeze", "fabric-gan"])
def test_fabric_equals_unsharded_training(sharded: dict[str, Any], unsharded: dict[str, Any], name: str) -> None:
    result, reference = sharded[name], unsharded[name]
    modules = [key for key in ("model", "generator", "discriminator") if key in reference]
    optimizers = [key for key in reference if key.endswith("optimizer")]
    assert "error" not in result, result.get("error")
    for module in modules:
        assert_same_training(result, reference, module, [])
    for key in optimizers:
        assert optimizer_difference(result[key], reference[key]) < ATOL, key
    if name == "fabric-freeze":
        assert_adam_close(result["resumed"]["model"], reference["model"], start("model"))
        assert optimizer_difference(result["resumed"]["optimizer"], reference["optimizer"]) < ATOL
