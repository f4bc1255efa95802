"""Recognising and converting Lightning 1.x FairScale checkpoints, on the genuine 1.9.5 fixtures (in one process).

The fixtures (``tests/fixtures/lightning_1x``) were written by pytorch-lightning 1.9.5's own Trainer, see their
``make_fixtures.py``. The 2-process resumes are in ``tests/test_lightning_1x.py``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.utilities.migration import migrate_checkpoint
from scenarios.common import RegressionModelWrapper, build_network

from lightning_fairscale.convert_1x import main
from lightning_fairscale.checkpoint.legacy import (
    CONVERTED_KEY,
    CurrentOptimizer,
    Lightning1xOptimizerStateError,
    adopt_optimizer_states,
    convert_checkpoint,
    is_flat_optimizer_state,
)
from lightning_fairscale.strategies import DDPFullyShardedStrategy, DDPShardedStrategy

FIXTURES = Path(__file__).parents[1] / "fixtures" / "lightning_1x"
FSDP_FIXTURES = ["fsdp_sgd", "fsdp_adam", "fsdp_units_sgd"]


def load(name: str) -> dict[str, Any]:
    return torch.load(FIXTURES / f"{name}.ckpt", weights_only=True)


def plain_model() -> torch.nn.Module:
    """The unwrapped model the fixtures were trained with (``RegressionModel(depth=1).net`` under ``net``)."""
    return RegressionModelWrapper(build_network(depth=1))


def current(name: str = "Adam", groups: int = 1) -> list[CurrentOptimizer]:
    """The optimizer a LightningModule over ``plain_model()`` has now: its parameters' shapes, in one group."""
    shapes = [tuple(p.shape) for p in plain_model().parameters()]
    return [CurrentOptimizer(name, [shapes] if groups == 1 else [shapes[:2], shapes[2:]])]


def test_fixtures_have_the_documented_format() -> None:
    """What the module's docstring says of 1.9.5's files: full unwrapped weights, rank 0's flat optimizer shard."""
    assert torch.load(FIXTURES / "reference.pt", weights_only=True)["versions"]["pytorch_lightning"] == "1.9.5"
    total = sum(p.numel() for p in plain_model().parameters())
    for name in [*FSDP_FIXTURES, "sharded_adam"]:
        checkpoint = load(name)
        assert checkpoint["pytorch-lightning_version"] == "1.9.5" and checkpoint["global_step"] == 3
        assert {k: v.shape for k, v in checkpoint["state_dict"].items()} == {
            k: v.shape for k, v in plain_model().state_dict().items()
        }
    (adam,) = load("fsdp_adam")["optimizer_states"]
    assert adam["param_groups"][0]["params"] == [0]  # the whole module: one FSDP unit, one flat parameter
    assert adam["state"][0]["exp_avg"].shape == (math.ceil(total / 2),)  # rank 0's half of it, nothing more
    assert load("fsdp_units_sgd")["optimizer_states"][0]["param_groups"][0]["params"] == [0, 1]  # two units
    assert load("fsdp_sgd")["optimizer_states"][0]["state"] == {}  # SGD without momentum: no per-parameter state


@pytest.mark.parametrize("name", FSDP_FIXTURES)
def test_fsdp_checkpoints_are_recognised(name: str) -> None:
    checkpoint = load(name)
    assert is_flat_optimizer_state(checkpoint, checkpoint["optimizer_states"][0], current()[0])
    # The strategies see the checkpoint after Lightning upgraded it (version 2.x, the original one kept aside).
    upgraded, _ = migrate_checkpoint(copy.deepcopy(checkpoint))
    assert upgraded["pytorch-lightning_version"] != "1.9.5"
    assert is_flat_optimizer_state(upgraded, upgraded["optimizer_states"][0], current()[0])


def test_plain_checkpoints_are_not_recognised() -> None:
    sharded = load("sharded_adam")  # 1.9.5's ddp_sharded consolidated the full state, parameter by parameter
    assert not is_flat_optimizer_state(sharded, sharded["optimizer_states"][0], current()[0])
    states, note = adopt_optimizer_states(sharded, current())
    assert states[0] is sharded["optimizer_states"][0] and note is None
    adam = load("fsdp_adam")
    later = {**adam, "pytorch-lightning_version": "2.1.0"}  # no later Lightning wrote flat states
    assert not is_flat_optimizer_state(later, adam["optimizer_states"][0], current()[0])
    # Another optimizer configuration (two param groups) is not taken for a 1.x checkpoint: the usual error follows.
    assert not is_flat_optimizer_state(adam, adam["optimizer_states"][0], current(groups=2)[0])
    # Nor a plain 1.x state over fewer parameters (an optimizer over some layers only): its tensors are not flat.
    (plain,) = sharded["optimizer_states"]
    group = {**plain["param_groups"][0], "params": [0, 1]}
    fewer = {"state": {i: plain["state"][i] for i in (0, 1)}, "param_groups": [group]}
    assert not is_flat_optimizer_state(sharded, fewer, current()[0])


def test_a_stateless_optimizer_state_resumes_exactly() -> None:
    checkpoint = load("fsdp_sgd")
    (state,), note = adopt_optimizer_states(checkpoint, current("SGD"))
    assert note is not None and "resumes exactly" in note
    model = plain_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer.load_state_dict(state)
    saved_group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert optimizer.param_groups[0]["lr"] == saved_group["lr"] == pytest.approx(0.05 * 0.7**3)
    assert optimizer.param_groups[0]["initial_lr"] == 0.05  # what the restored StepLR goes on from
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_a_stateful_optimizer_state_fails_with_what_to_do() -> None:
    with pytest.raises(Lightning1xOptimizerStateError) as error:
        adopt_optimizer_states(load("fsdp_adam"), current("Adam"))
    message = str(error.value)
    total = sum(p.numel() for p in plain_model().parameters())
    for part in (
        "Lightning 1.9.5's FairScale strategy",
        "only rank 0's shard",
        f"{math.ceil(total / 2):,} of the {total:,} values",
        'DDPFullyShardedStrategy(lightning_1x_optimizer_state="reset")',
        "lightning-fairscale-convert-1x SRC DST",
    ):
        assert part in message, part
    with pytest.raises(Lightning1xOptimizerStateError, match=r"DDPShardedStrategy\(lightning_1x_optimizer_state"):
        adopt_optimizer_states(load("fsdp_adam"), current("Adam"), owner="DDPShardedStrategy")


def test_reset_drops_the_state_and_keeps_the_hyperparameters() -> None:
    checkpoint = load("fsdp_adam")
    (state,), note = adopt_optimizer_states(checkpoint, current("Adam"), policy="reset")
    assert note is not None and "dropped exp_avg, exp_avg_sq, step of 1 flat parameter(s)" in note
    optimizer = torch.optim.Adam(plain_model().parameters(), lr=1e-2)
    optimizer.load_state_dict(state)
    assert not optimizer.state
    saved = {k: v for k, v in checkpoint["optimizer_states"][0]["param_groups"][0].items() if k != "params"}
    assert {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} == saved


def test_the_strategies_refuse_an_unknown_policy() -> None:
    for strategy in (DDPFullyShardedStrategy, DDPShardedStrategy):
        with pytest.raises(ValueError, match='must be "error" .* or "reset"'):
            strategy(lightning_1x_optimizer_state="keep")  # type: ignore[arg-type]
        assert strategy(lightning_1x_optimizer_state="reset").lightning_1x_optimizer_state == "reset"


def test_conversion_drops_only_the_incomplete_state() -> None:
    checkpoint = load("fsdp_adam")
    converted, report = convert_checkpoint(checkpoint)
    assert report == ["optimizer 0: dropped exp_avg, exp_avg_sq, step of 1 flat parameter(s) (rank 0's shard only);"
                      " param group hyperparameters kept"]
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert converted["optimizer_states"] == [{"state": {}, "param_groups": groups}]
    assert converted[CONVERTED_KEY]["source_version"] == "1.9.5"
    kept = ("state_dict", "loops", "lr_schedulers", "callbacks", "global_step", "epoch", "pytorch-lightning_version")
    for key in kept:
        assert converted[key] is checkpoint[key], key
    # Resumed (by the strategies, after Lightning's upgrade): a fresh state with the hyperparameters, and a note.
    (state,), note = adopt_optimizer_states(migrate_checkpoint(converted)[0], current("Adam"))
    assert state["state"] == {} and state["param_groups"][0]["params"] == list(range(10))
    assert note is not None and "converted from Lightning 1.9.5" in note and "dropped exp_avg" in note


@pytest.mark.parametrize(
    ("name", "change", "problem"),
    [
        ("sharded_adam", {}, "complete"),
        ("fsdp_adam", {"pytorch-lightning_version": "2.6.0"}, "nothing to convert"),
        ("fsdp_adam", {CONVERTED_KEY: {}}, "converted already"),
    ],
)
def test_conversion_refuses_other_checkpoints(name: str, change: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        convert_checkpoint({**load(name), **change})


def test_command_writes_a_converted_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "converted.ckpt"
    assert main([str(FIXTURES / "fsdp_adam.ckpt"), str(output)]) == 0
    assert "dropped exp_avg" in capsys.readouterr().out
    converted = torch.load(output, weights_only=True)  # nothing but plain data
    assert converted["optimizer_states"][0]["state"] == {} and CONVERTED_KEY in converted
    assert [p.name for p in tmp_path.iterdir()] == ["converted.ckpt"]  # written atomically: no leftovers

    assert main([str(FIXTURES / "sharded_adam.ckpt"), str(tmp_path / "no.ckpt")]) == 1
    assert "needs no conversion" in capsys.readouterr().err
    assert main([str(output), str(output)]) == 2
    assert not (tmp_path / "no.ckpt").exists()
