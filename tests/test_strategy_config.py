"""Registry names and argument validation (no processes needed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning_fabric.strategies.registry import _StrategyRegistry
from pytorch_lightning import Trainer
from pytorch_lightning.strategies import FSDPStrategy, StrategyRegistry

import lightning_fairscale
from lightning_fairscale.strategies import DDPFullyShardedStrategy


@pytest.mark.parametrize("name", ["fsdp_fairscale", "ddp_fully_sharded"])
def test_registry_names_select_the_strategy(name: str) -> None:
    # Not `name in StrategyRegistry`: the Trainer below refuses an unregistered name by itself, and membership says
    # nothing about what the name selects. `register_strategies` must register our class on any registry, and again
    # without the registry's "already present" error (the lightning flavour and re-imports call it again).
    fresh = _StrategyRegistry()
    for _ in range(2):
        DDPFullyShardedStrategy.register_strategies(fresh)
    assert sorted(fresh) == ["ddp_fully_sharded", "fsdp_fairscale"]
    assert fresh[name]["strategy"] is DDPFullyShardedStrategy and fresh[name]["init_params"] == {}
    assert StrategyRegistry[name]["strategy"] is DDPFullyShardedStrategy  # done by `import lightning_fairscale`
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is DDPFullyShardedStrategy


def test_lightnings_fsdp_stays_lightnings() -> None:
    assert lightning_fairscale.DDPFullyShardedStrategy is DDPFullyShardedStrategy
    assert StrategyRegistry["fsdp"]["strategy"] is FSDPStrategy


def test_lightning_1x_arguments_are_accepted() -> None:
    strategy = DDPFullyShardedStrategy(
        cpu_offload=True,
        flatten_parameters=False,
        reshard_after_forward=False,
        move_grads_to_cpu=True,
        fp32_reduce_scatter=True,
        compute_dtype=torch.float16,
        bucket_cap_mb=10,
        min_num_params=1e6,
        state_dict_to_cpu=False,
        process_group_backend="gloo",
        verbose=True,  # passed through to FairScale
    )
    assert strategy.min_num_params == 1_000_000
    assert strategy.process_group_backend == "gloo"
    assert strategy.config.fairscale_kwargs == {"verbose": True}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_num_params": -1}, ValueError, "min_num_params"),
        ({"min_num_params": "big"}, ValueError, "min_num_params"),
        ({"bucket_cap_mb": "25"}, ValueError, "bucket_cap_mb"),
        ({"compute_dtype": torch.int8}, ValueError, "compute_dtype"),
        ({"auto_wrap_policy": {int}}, TypeError, "nn.Module"),
        ({"auto_wrap_policy": set()}, TypeError, "auto_wrap_policy"),
        ({"compute_device": torch.device("cpu")}, TypeError, "accelerator"),
        ({"mixed_precision": True}, TypeError, "precision"),
        ({"not_an_argument": 1}, TypeError, "unexpected argument `not_an_argument`"),
        ({"exclude_wrap_modules": "ModuleList"}, TypeError, "exclude_wrap_modules"),
        ({"force_leaf_modules": [torch.nn.MultiheadAttention, 3]}, TypeError, "force_leaf_modules"),
        ({"activation_checkpointing": "Block"}, TypeError, "activation_checkpointing"),
        ({"state_dict_type": "local"}, ValueError, "state_dict_type"),
        ({"cpu_offload": True, "move_grads_to_cpu": False}, ValueError, "move_grads_to_cpu"),
    ],
)
def test_bad_arguments_fail_early_with_a_hint(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DDPFullyShardedStrategy(**kwargs)


@pytest.mark.parametrize(
    ("precision", "strategy_kwargs", "expected"),
    [
        ("32-true", {}, {"mixed_precision": False, "fp32_reduce_scatter": False}),
        ("bf16-mixed", {}, {"mixed_precision": True, "compute_dtype": torch.bfloat16}),
        ("16-mixed", {"fp32_reduce_scatter": True}, {"mixed_precision": True, "fp32_reduce_scatter": True}),
        ("bf16-mixed", {"compute_dtype": torch.float32}, {"mixed_precision": True, "compute_dtype": torch.float32}),
        ("32-true", {"fp32_reduce_scatter": True}, {"fp32_reduce_scatter": False}),  # only meaningful when mixed
        # True half precision: no mixed precision, the units hold their parameters in the compute dtype.
        ("bf16-true", {}, {"mixed_precision": False, "compute_dtype": torch.bfloat16, "fp32_reduce_scatter": False}),
        ("16-true", {"compute_dtype": torch.float16}, {"mixed_precision": False, "compute_dtype": torch.float16}),
    ],
)
def test_fsdp_settings_follow_the_precision_flag(
    precision: str, strategy_kwargs: dict[str, Any], expected: dict[str, Any]
) -> None:
    strategy = DDPFullyShardedStrategy(**strategy_kwargs)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=precision, logger=False)
    kwargs = trainer.strategy.fsdp_kwargs()
    assert {k: kwargs[k] for k in expected} == expected
    assert kwargs["compute_device"] == torch.device("cpu")
    assert kwargs["cpu_offload"] is False  # offloading to the CPU from the CPU is turned off
