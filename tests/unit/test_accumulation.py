"""Gradient accumulation in both modes, on 2 forked ranks, against unsharded accumulation.

``no_sync`` (the default): each rank accumulates its full, unreduced gradient and the last micro-batch reduces it.
``sync_each_batch=True``: every micro-batch reduces; FSDP adds each reduced shard to the one held (FairScale's own
accumulation outside ``no_sync``), sharded DDP's owners set their reduced gradients aside during each backward
(``sharded_ddp.trainability.Trainability.begin_backward``/``end_backward``).
Both must train exactly as one unsharded model that sums
the micro-batches' gradients (each loss divided by their number, as Lightning does), and between micro-batches a rank
must hold the full gradient in the first mode and only its shard in the second.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.run import check_settings
from lightning_fairscale.fsdp.unit.units import fsdp_instances
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module
from lightning_fairscale.sharded_ddp import engine as sharded_engine
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig

from .helpers import Block, Net, batches, parameters_of, run_ranks, shard

MICRO_BATCHES = 4
STEPS = 2
#: Engine and accumulation mode of each case; sharded DDP without buckets (one node's default) and with them.
CASES = [
    ("fsdp", "no_sync"), ("fsdp", "each"),
    ("sharded", "no_sync"), ("sharded", "each"),
    ("sharded-buckets", "no_sync"), ("sharded-buckets", "each"),
]  # fmt: skip
NUMEL = sum(p.numel() for p in Net().parameters())  # 194


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # Momentum: the second step depends on the first step's gradient too.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _micro_batches(rank: int, world_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, the micro-batches (this rank's share of each global one; the whole one for ``world_size=1``)."""
    data = batches(STEPS * MICRO_BATCHES, seed=7)
    own = [tuple(t[rank::world_size] for t in batch) for batch in data]
    return [own[s * MICRO_BATCHES : (s + 1) * MICRO_BATCHES] for s in range(STEPS)]  # type: ignore[misc]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y) / MICRO_BATCHES


def _fsdp_held(root: nn.Module) -> int:
    """Elements of gradient FSDP holds for this rank's flat parameters (full ones under ``no_sync``)."""
    return sum(p.grad.numel() for unit in fsdp_instances(root) for p in unit.params if p.grad is not None)


def _train_fsdp(rank: int, world_size: int, each: bool) -> dict[str, Any]:
    model = Net()
    optimizer = _optimizer(model.parameters())
    sharded = shard(model, optimizer, policy={Block}, min_num_params=0)
    out: dict[str, Any] = {"held": []}
    for step in _micro_batches(rank, world_size):
        for index, batch in enumerate(step):
            last = index == MICRO_BATCHES - 1
            if each or last:
                _loss(sharded.root, batch).backward()
            else:
                with sharded.root.no_sync():
                    _loss(sharded.root, batch).backward()
            if not last:
                out["held"].append(_fsdp_held(sharded.root))
        optimizer.step()
        optimizer.zero_grad()
    out["parameters"] = parameters_of(unwrap_module(sharded.root))
    return out


def _train_sharded(rank: int, world_size: int, each: bool, buckets: bool) -> dict[str, Any]:
    model = Net()
    optimizer = sharded_engine.shard_optimizer(_optimizer(model.parameters()))
    config = ShardedDDPConfig(sync_each_batch=each, fairscale_kwargs={"reduce_buffer_size": 2**10 if buckets else 0})
    wrapped, trainability = sharded_engine.wrap_model(config, model, [optimizer], num_nodes=1)
    out: dict[str, Any] = {"held": []}
    for step in _micro_batches(rank, world_size):
        for index, batch in enumerate(step):
            last = index == MICRO_BATCHES - 1
            with wrapped.no_sync() if not (each or last) else _nothing():
                loss = _loss(wrapped, batch)
                trainability.begin_backward()
                loss.backward()
                trainability.end_backward()
            if not last:
                out["held"].append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))
        optimizer.step()
        optimizer.zero_grad()
    out["parameters"] = parameters_of(model)
    out["owned"] = sum(p.numel() for p in optimizer.partition_parameters()[rank][0]["params"])
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def rank_run(rank: int, world_size: int) -> dict[Any, Any]:
    cpu_streams.install()
    results: dict[Any, Any] = {}
    for engine, mode in CASES:
        each = mode == "each"
        if engine == "fsdp":
            results[engine, mode] = _train_fsdp(rank, world_size, each)
        else:
            results[engine, mode] = _train_sharded(rank, world_size, each, buckets=engine == "sharded-buckets")
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_ranks(rank_run, 2, tmp_path_factory.mktemp("accumulation"))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One unsharded model, each step summing its micro-batches' gradients (each loss divided by their number)."""
    model = Net()
    optimizer = _optimizer(model.parameters())
    for step in _micro_batches(0, 1):
        for batch in step:
            _loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    last_only = Net()  # what a wrong accumulation that kept the last micro-batch alone would train
    other = _optimizer(last_only.parameters())
    for step in _micro_batches(0, 1):
        _loss(last_only, step[-1]).backward()
        other.step()
        other.zero_grad()
    return {"parameters": parameters_of(model), "last_only": parameters_of(last_only)}


@pytest.mark.parametrize(("engine", "mode"), CASES)
def test_accumulation_equals_unsharded_accumulation(
    ranks: list[dict[Any, Any]], reference: dict[str, Any], engine: str, mode: str
) -> None:
    for rank in ranks:
        trained = rank[engine, mode]["parameters"]
        assert sorted(trained) == sorted(reference["parameters"])
        for name, value in reference["parameters"].items():
            torch.testing.assert_close(trained[name], value, atol=2e-6, rtol=0, msg=f"{engine} {mode} {name}")
    gap = max((reference["parameters"][n] - reference["last_only"][n]).abs().max() for n in reference["parameters"])
    assert gap > 1e-3  # the micro-batches before the last matter


def test_fsdp_holds_the_full_gradient_under_no_sync_and_its_shard_when_syncing_each_batch(
    ranks: list[dict[Any, Any]],
) -> None:
    for rank in ranks:
        # no_sync: every unit's whole flat gradient (the model's 194 elements), on every rank.
        assert rank["fsdp", "no_sync"]["held"] == [NUMEL] * (STEPS * (MICRO_BATCHES - 1))
        # Each micro-batch reduce-scattered: the shards (half of each flat parameter, padded).
        held = rank["fsdp", "each"]["held"]
        assert set(held) == {held[0]} and NUMEL / 2 <= held[0] <= NUMEL / 2 + 3  # 3 units: at most 1 padding each


def test_sharded_ddp_holds_every_gradient_under_no_sync_and_its_own_when_syncing_each_batch(
    ranks: list[dict[Any, Any]],
) -> None:
    for rank in ranks:
        assert rank["sharded", "no_sync"]["held"] == [NUMEL] * (STEPS * (MICRO_BATCHES - 1))
        owned = rank["sharded", "each"]["owned"]
        assert 0 < owned < NUMEL
        assert rank["sharded", "each"]["held"] == [owned] * (STEPS * (MICRO_BATCHES - 1))
    # With buckets too, a rank holds the gradients of its own parameters only: the bucket slots of the others' stay
    # allocated (FairScale reduces each bucket whole) but are no gradient (their content is not the reduced one).
    for rank in ranks:
        owned = rank["sharded-buckets", "each"]["owned"]
        assert rank["sharded-buckets", "each"]["held"] == [owned] * (STEPS * (MICRO_BATCHES - 1))


def test_sync_each_batch_is_a_bool_and_refused_with_gradients_offloaded_on_cuda() -> None:
    with pytest.raises(TypeError, match="`sync_each_batch` must be True"):
        FullyShardedConfig(sync_each_batch="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`sync_each_batch` must be True"):
        ShardedDDPConfig(sync_each_batch=1)  # type: ignore[arg-type]
    for offload in ({"cpu_offload": True}, {"move_grads_to_cpu": True}):
        config = FullyShardedConfig(sync_each_batch=True, **offload)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="cannot be combined with `cpu_offload` or `move_grads_to_cpu`"):
            check_settings(config, torch.device("cuda"), "32-true")
        check_settings(dataclasses.replace(config, sync_each_batch=False), torch.device("cuda"), "32-true")
