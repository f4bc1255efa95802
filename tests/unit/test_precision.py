"""Precision plugins: which one each strategy makes of Lightning's, and clipping by the norm of all shards."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from fairscale.optim import OSS
from fairscale.optim.grad_scaler import ShardedGradScaler as FairScaleShardedGradScaler
from lightning_fabric.wrappers import _unwrap_objects
from pytorch_lightning import Trainer
from pytorch_lightning.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_fairscale import DDPFullyShardedStrategy, DDPShardedStrategy
from lightning_fairscale.fabric import DDPFullyShardedStrategy as FabricFullyShardedStrategy
from lightning_fairscale.mixed_precision.grad_scaler import ShardedGradScaler
from lightning_fairscale.precision import (
    FullyShardedHalfPrecisionPlugin,
    FullyShardedMixedPrecisionPlugin,
    FullyShardedPrecisionPlugin,
    ShardedHalfPrecisionPlugin,
    ShardedMixedPrecisionPlugin,
    ShardedPrecisionPlugin,
)
from lightning_fairscale.precision.fully_sharded import fully_sharded_precision_plugin
from lightning_fairscale.precision.sharded import sharded_precision_plugin

from .helpers import Block, Net, assert_tensors_equal, batches, fabric_on_one_process, mixed_precision_reference, shard

SELECT: dict[str, Callable[[Precision], Precision]] = {
    "fsdp": fully_sharded_precision_plugin,
    "sharded": sharded_precision_plugin,
}
PLAIN = {"fsdp": FullyShardedPrecisionPlugin, "sharded": ShardedPrecisionPlugin}
MIXED = {"fsdp": FullyShardedMixedPrecisionPlugin, "sharded": ShardedMixedPrecisionPlugin}
HALF = {"fsdp": FullyShardedHalfPrecisionPlugin, "sharded": ShardedHalfPrecisionPlugin}


@pytest.mark.parametrize("strategy", ["fsdp", "sharded"])
def test_full_precision_becomes_the_strategys_plugin(strategy: str) -> None:
    plugin = SELECT[strategy](Precision())
    assert type(plugin) is PLAIN[strategy] and plugin.precision == "32-true"


@pytest.mark.parametrize("strategy", ["fsdp", "sharded"])
@pytest.mark.parametrize(("precision", "scaler"), [("16-mixed", ShardedGradScaler), ("bf16-mixed", type(None))])
@pytest.mark.workaround(5)
def test_mixed_precision_gets_a_sharded_scaler_for_fp16_only(strategy: str, precision: str, scaler: type) -> None:
    lightnings = MixedPrecision(precision, "cpu")  # type: ignore[arg-type]
    plugin = SELECT[strategy](lightnings)
    assert type(plugin) is MIXED[strategy]
    assert (plugin.precision, plugin.device) == (precision, "cpu")
    assert type(plugin.scaler) is scaler  # Lightning's plain GradScaler would let the ranks' inf checks disagree
    if strategy == "fsdp":
        assert plugin.compute_dtype == (torch.float16 if precision == "16-mixed" else torch.bfloat16)


@pytest.mark.parametrize("strategy", ["fsdp", "sharded"])
@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_half_precision_becomes_the_strategys_half_plugin(
    strategy: str, precision: str, dtype: torch.dtype
) -> None:
    plugin = SELECT[strategy](HalfPrecision(precision))  # type: ignore[arg-type]
    assert type(plugin) is HALF[strategy] and plugin.precision == precision
    # Lightning's conventions: the module, the tensors made at init and the batches in the dtype.
    assert plugin.convert_module(nn.Linear(2, 2)).weight.dtype == dtype
    with plugin.tensor_init_context():
        assert torch.empty(1).dtype == dtype
    assert plugin.convert_input((torch.zeros(1), torch.zeros(1, dtype=torch.long)))[0].dtype == dtype
    if strategy == "fsdp":
        assert plugin.compute_dtype == dtype


@pytest.mark.parametrize("strategy", ["fsdp", "sharded"])
def test_the_strategys_own_plugins_are_kept(strategy: str) -> None:
    for plugin in (PLAIN[strategy](), MIXED[strategy]("bf16-mixed", "cpu"), HALF[strategy]("bf16-true")):
        assert SELECT[strategy](plugin) is plugin


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_fp16_on_cuda_uses_fairscales_scaler_under_sharded_ddp() -> None:
    # FSDP uses ours on every device (see test_gpu_paths): FairScale's drops the all-reduced inf flags of CPU shards.
    assert type(MIXED["sharded"]("16-mixed", "cuda").scaler) is FairScaleShardedGradScaler


@pytest.mark.parametrize("strategy", ["fsdp", "sharded"])
def test_other_precisions_are_refused_naming_the_supported_ones(strategy: str) -> None:
    with pytest.raises(ValueError, match="does not support precision='64-true'.*"
                                         "'32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true'"):
        SELECT[strategy](DoublePrecision())


@pytest.mark.filterwarnings("ignore:.*AMP with fp16 is not supported on CPU")
@pytest.mark.parametrize("strategy", ["fsdp_fairscale", "ddp_sharded"])
@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("32-true", "32-true"), (32, "32-true"), ("bf16-mixed", "bf16-mixed"), ("16-mixed", "bf16-mixed"),
        ("bf16-true", "bf16-true"), ("16-true", "16-true"),
    ],
)
def test_trainer_flags_reach_the_strategys_plugin(strategy: str, flag: Any, expected: str) -> None:
    """Lightning turns "16-mixed" into bf16 on CPU; the strategy's setter turns its plugin into ours."""
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=flag, logger=False)
    plugin = trainer.strategy.precision_plugin
    kind = "fsdp" if strategy == "fsdp_fairscale" else "sharded"
    kinds = {"32-true": PLAIN, "bf16-true": HALF, "16-true": HALF}
    assert type(plugin) is kinds.get(expected, MIXED)[kind]
    assert plugin.precision == expected


@pytest.mark.parametrize(
    ("strategy", "plugin"),
    [(DDPFullyShardedStrategy, FullyShardedPrecisionPlugin), (DDPShardedStrategy, ShardedPrecisionPlugin)],
)
def test_a_strategy_without_a_plugin_has_the_full_precision_one(strategy: type, plugin: type) -> None:
    assert type(strategy().precision_plugin) is plugin


@pytest.mark.parametrize(
    ("scaler", "why"),
    [
        (lambda: torch.amp.GradScaler("cpu"), "torch.amp.grad_scaler.GradScaler: each rank would check only its own"),
        (FairScaleShardedGradScaler, "ShardedGradScaler: FairScale's drops the combined inf/NaN checks"),
    ],
    ids=["torch", "fairscale"],
)
@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
def test_fsdp_mixed_precision_refuses_a_plain_grad_scaler(scaler: Callable[[], Any], why: str) -> None:
    with pytest.raises(TypeError, match=f"sharded grad scaler, got .*{why}.*Leave `scaler=None`"):
        FullyShardedMixedPrecisionPlugin("16-mixed", "cpu", scaler=scaler())
    ours = ShardedGradScaler(device="cpu", init_scale=8.0)
    assert FullyShardedMixedPrecisionPlugin("16-mixed", "cpu", scaler=ours).scaler is ours


class OwnPrecision(Precision):
    """A user's plugin for a precision the strategies support."""


@pytest.mark.parametrize("strategy", ["fsdp", "sharded"])
@pytest.mark.parametrize(
    "plugin", [OwnPrecision(), type("OwnMixed", (MixedPrecision,), {})("bf16-mixed", "cpu")], ids=["32", "bf16"]
)
def test_another_plugin_for_a_supported_precision_is_refused_saying_what_to_pass(
    strategy: str, plugin: Precision
) -> None:
    with pytest.raises(ValueError, match="Strategy` cannot use the precision plugin Own") as refusal:
        SELECT[strategy](plugin)
    message = str(refusal.value)
    assert f"precision={plugin.precision!r}" in message and "does not support" not in message
    assert f"a subclass of `{PLAIN[strategy].__name__}` (32-true), `{MIXED[strategy].__name__}`" in message


def plain_gradients() -> nn.Module:
    model = Net()
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    return model


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize(
    "plugin", [FullyShardedPrecisionPlugin(), FullyShardedMixedPrecisionPlugin("bf16-mixed", "cpu")], ids=["32", "bf16"]
)
@pytest.mark.workaround(4)
def test_fsdp_plugins_clip_by_the_norm_of_all_shards(plugin: Precision) -> None:
    model, reference = Net(), plain_gradients()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy={Block})
    x, y = batches(1)[0]
    nn.functional.mse_loss(sharded.root(x), y).backward()
    plugin.clip_grad_by_norm(sharded.optimizer, 0.05)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    expected = dict(reference.named_parameters())
    for managed, info in sharded.layout.managed.items():
        for piece in info.pieces:  # one rank: each flat gradient holds the whole gradients of its pieces
            got = managed.grad[piece.offset : piece.offset + piece.numel].view(piece.shape)
            torch.testing.assert_close(got, expected[piece.name].grad, rtol=1e-5, atol=1e-8, msg=piece.name)
    assert sum(len(info.pieces) for info in sharded.layout.managed.values()) == len(expected)


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("plugin", [ShardedPrecisionPlugin(), ShardedMixedPrecisionPlugin("bf16-mixed", "cpu")])
def test_sharded_plugins_clip_through_oss_and_plain_optimizers(plugin: Precision) -> None:
    for optimizer_class in (OSS, None):
        model, reference = plain_gradients(), plain_gradients()
        if optimizer_class is OSS:
            optimizer: torch.optim.Optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        plugin.clip_grad_by_norm(optimizer, 0.05)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        assert any(not torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain_gradients().parameters()))


@pytest.mark.workaround(21)
def test_fabric_on_one_process_trains_in_bf16_mixed_precision() -> None:
    """``Fabric(devices=1, precision="bf16-mixed")`` with the FSDP strategy (workaround 21: it failed at the first
    backward): the steps equal a bf16 copy's gradients applied to the fp32 parameters."""
    strategy = FabricFullyShardedStrategy(auto_wrap_policy={Block})
    with fabric_on_one_process(strategy, precision="bf16-mixed") as fabric:
        model = Net()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in batches(3):
            fabric.backward(nn.functional.mse_loss(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
        weights = fabric.strategy.get_module_state_dict(_unwrap_objects(model))  # the full state dict
        assert_tensors_equal(weights, mixed_precision_reference(torch.bfloat16, 3), atol=0)
