"""``sharded_ddp.trainability``: what ``ShardedDataParallel`` derives from the trainable parameters, kept up to date
(FairScale workarounds 24 and 25), on one gloo rank in this process. The 2-process trainings against unsharded
training are in ``tests/test_sharded_changes.py``.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import pytest
import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from torch import nn

from lightning_fairscale.distributed.torch_private import total_norm_implementation
from lightning_fairscale.sharded_ddp import engine
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig
from lightning_fairscale.sharded_ddp.trainability import Trainability, TrainabilityChangeError, clip_grad_norm

from .helpers import run_ranks


def _wrapped(**kwargs: Any) -> tuple[ShardedDataParallel, Trainability, OSS]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapper, trainability = engine.wrap_model(ShardedDDPConfig(fairscale_kwargs=kwargs), model, [optimizer], 1)
    return wrapper, trainability, optimizer


def _backward(wrapper: ShardedDataParallel, trainability: Trainability, seed: int = 0) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    loss = wrapper(x).square().mean()
    trainability.begin_backward()
    loss.backward()
    trainability.end_backward()


@pytest.mark.workaround(24)
def test_a_model_left_in_training_mode_under_an_eval_wrapper_is_reduced(process_group: Any) -> None:
    """Workaround 24: Lightning's validation sets the wrapper to eval and restores the LightningModule only."""
    wrapper, trainability, _ = _wrapped()
    _backward(wrapper, trainability)
    wrapper.eval()
    wrapper.module.train()
    _backward(wrapper, trainability)
    assert len(wrapper._grad_hooks) == 4  # FairScale would have removed them, and reduced nothing
    assert wrapper.training is False  # the wrapper's own flag is the user's again after the forward pass


def test_eval_mode_training_keeps_the_hooks(process_group: Any) -> None:
    wrapper, trainability, _ = _wrapped()
    wrapper.eval()
    _backward(wrapper, trainability)
    assert len(wrapper._grad_hooks) == 4
    assert all(p.grad is not None for p in wrapper.parameters())


def test_freezing_is_followed_in_the_next_forward_with_a_graph_only(process_group: Any) -> None:
    wrapper, trainability, optimizer = _wrapped()
    _backward(wrapper, trainability)
    buffers = {id(bucket.buffer) for bucket in optimizer.buckets[torch.device("cpu")].values()}
    wrapper.module[0].requires_grad_(False)
    with torch.no_grad():  # validation: nothing to derive (under inference mode it must not re-derive either)
        wrapper(torch.randn(3, 4))
    assert len(wrapper._grad_hooks) == 4
    assert {id(bucket.buffer) for bucket in optimizer.buckets[torch.device("cpu")].values()} == buffers
    optimizer.zero_grad()
    _backward(wrapper, trainability)
    assert len(wrapper._grad_hooks) == 2 and wrapper.module[0].weight.grad is None


@pytest.mark.workaround(24)
def test_a_second_backward_after_one_forward_reduces_too(process_group: Any) -> None:
    """Workaround 24: FairScale arms its end-of-backward flush in the forward pass only."""
    wrapper, trainability, _ = _wrapped()
    output = wrapper(torch.randn(3, 4))
    for _ in range(2):
        trainability.begin_backward()
        assert wrapper._bucket_flush_callback_set is False and all(wrapper._grad_to_be_reduced)
        output.square().mean().backward(retain_graph=True)
        trainability.end_backward()
        assert not wrapper._work_handles  # every reduction finished within its backward pass


def test_a_change_between_micro_batches_is_refused(process_group: Any) -> None:
    wrapper, trainability, optimizer = _wrapped()
    with wrapper.no_sync():
        _backward(wrapper, trainability)
    wrapper.module[2].requires_grad_(False)
    with pytest.raises(TrainabilityChangeError, match="between optimizer steps.*sync_each_batch=True"):
        _backward(wrapper, trainability)
    optimizer.zero_grad()  # after the step's end, the same change is followed
    _backward(wrapper, trainability)
    assert len(wrapper._grad_hooks) == 2


def test_close_removes_the_hooks(process_group: Any) -> None:
    wrapper, trainability, _ = _wrapped()
    trainability.close()
    assert not wrapper._forward_pre_hooks and not wrapper._forward_hooks


@pytest.mark.workaround(25)
def test_clip_grad_norm_counts_parameters_frozen_at_the_first_call(process_group: Any) -> None:
    """Workaround 25: OSS keeps the list of gradients of its first ``clip_grad_norm`` call."""
    wrapper, trainability, optimizer = _wrapped()
    wrapper.module[0].requires_grad_(False)
    _backward(wrapper, trainability)
    clip_grad_norm(optimizer, 1e9)
    optimizer.zero_grad()
    wrapper.module[0].requires_grad_(True)
    _backward(wrapper, trainability, seed=1)
    expected = torch.nn.utils.get_total_norm([p.grad for p in wrapper.parameters()])
    stale = optimizer.clip_grad_norm(1e9)  # FairScale's own call: the frozen layer's gradients left out
    assert not torch.allclose(stale, expected)
    torch.testing.assert_close(clip_grad_norm(optimizer, 1e9), expected)


# ----------------------------------------------------------------------------------------------------------------
# Torch's total norm while the gradients are partitioned (sharded_ddp.grad_norms; 2-process trainings in
# tests/test_sharded_reads.py)


def test_torchs_total_norm_is_replaced_exactly_while_the_gradients_are_partitioned(process_group: Any) -> None:
    gc.collect()  # the models of the tests above, dropped without `close`: torch's own is back
    torchs = torch.nn.utils.clip_grad._get_total_norm.__wrapped__
    assert total_norm_implementation() is torchs
    wrapper, trainability, _ = _wrapped()
    _backward(wrapper, trainability)
    assert total_norm_implementation() is not torchs  # a reducing backward pass: partitioned
    with pytest.raises(ValueError, match="order 0.*positive order"):
        torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 1.0, norm_type=0)
    with wrapper.no_sync():  # accumulating: every rank holds its own gradients, torch's norms are local
        _backward(wrapper, trainability, seed=1)
    assert total_norm_implementation() is torchs
    _backward(wrapper, trainability, seed=2)
    trainability.close()  # the strategy ends: torch's own again
    assert total_norm_implementation() is torchs
    _backward(wrapper, trainability, seed=3)
    del wrapper, trainability
    gc.collect()  # a model dropped without `close` (a Fabric loop's): torch's own again
    assert total_norm_implementation() is torchs


def _partitioned_norms(rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank`` of 2: one reducing backward of a small model with small buckets, then torch's norms."""
    wrapper, trainability, optimizer = _wrapped(reduce_buffer_size=20)
    _backward(wrapper, trainability, seed=rank)  # each rank its own batch: the reduced gradient is their mean
    held = [p.grad is not None for p in wrapper.parameters()]
    whole = torch.full((3,), 2.0)  # a tensor every rank holds whole: counted once
    grads = [p.grad for p in wrapper.parameters() if p.grad is not None]
    result = {
        "held": held,
        "two": float(torch.nn.utils.get_total_norm([*grads, whole])),
        "inf": float(torch.nn.utils.get_total_norm(grads, norm_type="inf")),
        "owned": sum(p.numel() for p in optimizer.partition_parameters()[rank][0]["params"]),
    }
    trainability.close()
    return result


def test_the_norm_of_partitioned_gradients_is_the_whole_models_on_every_rank(tmp_path: Any) -> None:
    ranks = run_ranks(_partitioned_norms, 2, tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    for seed in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        (model(x).square().mean() / 2).backward()  # the mean of the two ranks' gradients
    grads = [p.grad for p in model.parameters()]
    two = float(torch.linalg.vector_norm(torch.cat([*(g.flatten() for g in grads), torch.full((3,), 2.0)])))
    inf = float(max(g.abs().max() for g in grads))
    for rank in ranks:
        assert rank["two"] == pytest.approx(two, rel=1e-6) and rank["inf"] == pytest.approx(inf, rel=1e-6)
    # Each gradient on its owner only, the bucketed ones too (not their bucket slots on the other rank).
    assert [a != b for a, b in zip(ranks[0]["held"], ranks[1]["held"])] == [True] * 4


def _norm_of_another_model_while_one_rank_holds_partitions(rank: int, world_size: int) -> float:
    """Rank 0 still holds a sharded model with partitioned gradients (its garbage not yet collected); rank 1 dropped
    its own. Both clip another model's gradients (Lightning's "ddp" trained after ours)."""
    wrapper, trainability, _ = _wrapped()
    _backward(wrapper, trainability, seed=rank)
    if rank == 1:
        del wrapper, trainability
        gc.collect()
    other = nn.Linear(4, 2)
    other(torch.ones(1, 4)).sum().backward()
    return float(torch.nn.utils.clip_grad_norm_(other.parameters(), 0.05))


def test_a_norm_of_no_partitioned_gradient_is_local(tmp_path: Any) -> None:
    # The feature matrix hung here: rank 0's torch norm, still replaced while its dropped model awaited collection,
    # all-reduced the norm of the "ddp" reference's gradients, which rank 1 computed alone.
    norms = run_ranks(_norm_of_another_model_while_one_rank_holds_partitions, 2, tmp_path, timeout=60)
    assert norms[0] == norms[1] == pytest.approx(math.sqrt(4 + 1 + 4 + 1))
