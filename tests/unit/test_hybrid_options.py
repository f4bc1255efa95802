"""The hybrid sharding options of ``DDPFullyShardedStrategy``: names, meshes, and their errors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import ShardingStrategy

from lightning_fairscale.fsdp.patches.hybrid import mesh_request, resolve_mesh, sharding_name
from lightning_fairscale.strategies import DDPFullyShardedStrategy


@pytest.mark.parametrize(
    ("given", "name", "reshard"),
    [
        ("FULL_SHARD", "FULL_SHARD", True),
        ("shard_grad_op", "SHARD_GRAD_OP", False),
        (ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", True),
        ("_HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2", False),
    ],
)
def test_sharding_strategy_names(given: object, name: str, reshard: bool) -> None:
    strategy = DDPFullyShardedStrategy(sharding_strategy=given, parallel_devices=[torch.device("cpu")])
    assert strategy.sharding_strategy == name
    assert strategy.reshard_after_forward is True  # the user's value (the default), kept
    assert strategy.fsdp_kwargs()["reshard_after_forward"] is reshard  # what FSDP gets


def test_no_shard_points_to_ddp() -> None:
    with pytest.raises(ValueError, match='use `strategy="ddp"`'):
        sharding_name(ShardingStrategy.NO_SHARD)
    with pytest.raises(ValueError, match="must be one of"):
        DDPFullyShardedStrategy(sharding_strategy="HALF_SHARD")


def test_device_mesh_needs_hybrid_sharding_and_two_sizes() -> None:
    with pytest.raises(ValueError, match='pass `sharding_strategy="HYBRID_SHARD"` with it'):
        DDPFullyShardedStrategy(device_mesh=(2, 2))
    with pytest.raises(ValueError, match=r"must be `\(replicas, shard_size\)`"):
        mesh_request("HYBRID_SHARD", (2, 2, 2))
    assert mesh_request("HYBRID_SHARD", None) == "node"


def test_mesh_must_hold_every_process() -> None:
    assert resolve_mesh("node", 8, 2) == (2, 4)
    assert resolve_mesh((4, 1), 4, 1) == (4, 1)
    with pytest.raises(ValueError, match="make `replicas \\* shard_size` equal 4"):
        resolve_mesh((2, 4), 4, 1)
