"""What user code reads outside a unit's forward (:mod:`lightning_fairscale.fsdp.unit.sharded_reads`): the whole
parameter and gradient, exact, on 2 forked ranks, against the unsharded model in this process.

Each rank trains ``Net`` wrapped with a unit per ``Block`` (shards padded, views empty on some ranks) and records
what the reads give; the tests compare them with the same reads of an unsharded copy trained on the same batches.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp.unit import param_views, shard_layout, sharded_reads, unit_state

from .helpers import Net, batches, run_ranks, shard
from models import Block

STEPS = 3
PENALTY = 0.05


def l2(params: Any) -> torch.Tensor:
    return PENALTY * sum(p.pow(2).sum() for p in params)


def orthogonality(weight: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(weight.shape[1])
    return ((weight.t() @ weight - eye) ** 2).sum()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> dict[str, Any]:
    """SGD steps whose loss adds an L2 penalty over ``model.parameters()`` and an orthogonality penalty on the
    second block's ``up`` matrix, computed outside the forward; clipping over ``model.parameters()``."""
    reads: dict[str, Any] = {}
    for x, y in batches(STEPS):
        x, y = x[rank::world], y[rank::world]
        loss = nn.functional.mse_loss(model(x), y)
        loss = loss + l2(model.parameters()) + 0.01 * orthogonality(model.blocks[1].up.weight)
        loss.backward()
        reads["total_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
        optimizer.step()
        optimizer.zero_grad()
    # EMA weights as user code keeps them: deep copies of the parameters, updated element-wise.
    ema = copy.deepcopy(list(model.parameters()))
    with torch.no_grad():
        for average, p in zip(ema, model.parameters()):
            average.mul_(0.5).add_(p, alpha=0.5)
        reads["ema"] = [(average - 1).norm().item() for average in ema]
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # gradients to read
    with torch.no_grad():
        for name, p in model.named_parameters():
            reads[name] = {
                "shape": tuple(p.shape), "numel": p.numel(), "dim": p.dim(), "norm": p.norm().item(),
                "sum": p.sum().item(), "mean": p.mean().item(), "vector_norm": torch.linalg.vector_norm(p).item(),
                "max": p.abs().max().item(), "pow_sum": p.pow(2).sum().item(), "first": p[0].clone(),
                "grad_norm": p.grad.norm().item(), "whole": sharded_reads.whole(p).clone(),
                # an operand of another layout (a whole tensor, EWC / L2-SP style): the whole parameter, gathered
                "from_ones": (p - torch.ones(tuple(p.shape))).pow(2).sum().item(),
                "zeros_like": (tuple(torch.zeros_like(p).shape), torch.zeros_like(p).sum().item()),
                "repr": repr(p.detach().clone()),
            }
        reads["foreach"] = [n.item() for n in torch._foreach_norm([p.grad for p in model.parameters()])]
    return reads


def ranked(rank: int, world: int) -> dict[str, Any]:
    cpu_streams.install()
    model = Net()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy={Block})
    reads = train(sharded.root, sharded.optimizer, rank, world)
    # An element-wise optimizer's step runs at torch's own speed: not one call into the sharded tensors' rules (each
    # would cost Python work per operation per parameter: 200 Adam steps took 2.4 times as long that way).
    adam = torch.optim.Adam(sharded.root.parameters(), lr=1e-3)
    shard_layout.local_steps(adam)
    real, calls = sharded_reads._dispatch, []
    sharded_reads._dispatch = lambda *args: (calls.append(args[0]), real(*args))[1]
    try:
        x, y = batches(1)[0]
        nn.functional.mse_loss(sharded.root(x[rank::world]), y[rank::world]).backward()
        before = len(calls)
        adam.step()
        reads["step_dispatches"] = len(calls) - before
    finally:
        sharded_reads._dispatch = real
    adam.zero_grad()
    # The optimizer's step sees its local slices; the closure it calls (Lightning's: training_step and the backward)
    # reads whole parameters again, passed by keyword or by position.
    shapes = []

    def closure() -> torch.Tensor:
        shapes.append(tuple(sharded.root.blocks[1].up.weight.shape))
        x, y = batches(1)[0]
        loss = nn.functional.mse_loss(sharded.root(x[rank::world]), y[rank::world])
        loss.backward()
        return loss

    sharded.optimizer.step(closure=closure)
    sharded.optimizer.step(closure)
    sharded.optimizer.zero_grad()
    reads["closure_shapes"] = shapes
    # A read on one rank only (a kind of read of that parameter not made on every rank before) ends in an error on
    # that rank, in seconds.
    shard_layout.AGREEMENT_TIMEOUT = 2.0
    started = time.monotonic()
    try:
        if rank == 0:
            sharded.root.blocks[0].down.weight.norm(p=1)
        reads["one_rank"] = None
    except RuntimeError as error:
        reads["one_rank"] = (str(error), time.monotonic() - started)
    # Writing a parameter in place from a whole tensor cannot be made exact on a slice: refused, naming it.
    try:
        with torch.no_grad():
            sharded.root.blocks[0].up.weight.copy_(torch.zeros(6, 5))
        reads["whole_write"] = None
    except RuntimeError as error:
        reads["whole_write"] = str(error)
    local = sharded_reads.local_slice(sharded.root.blocks[0].down.weight)
    reads["local_type"] = (type(local), local.dim())
    return reads


def unsharded() -> dict[str, Any]:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train(model, optimizer, 0, 1)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(ranked, 2, tmp_path_factory.mktemp("reads"))


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return unsharded()


def test_penalties_and_clipping_over_the_parameters_train_as_unsharded(ranks: Any, expected: Any) -> None:
    for reads in ranks:
        assert reads["total_norm"] == pytest.approx(expected["total_norm"], rel=1e-5)
        for name, got in reads.items():
            if isinstance(got, dict):
                torch.testing.assert_close(got["whole"], expected[name]["whole"], atol=1e-6, rtol=0)


def test_reads_outside_the_forward_are_the_whole_parameters(ranks: Any, expected: Any) -> None:
    names = [name for name, value in expected.items() if isinstance(value, dict)]
    assert names
    for reads in ranks:
        for name in names:
            got, want = reads[name], expected[name]
            for key in ("shape", "numel", "dim", "zeros_like", "repr"):
                assert got[key] == want[key], (name, key)
            for key in ("norm", "sum", "mean", "vector_norm", "max", "pow_sum", "grad_norm", "from_ones"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (name, key)
            torch.testing.assert_close(got["first"], want["first"], atol=1e-6, rtol=0)
        assert reads["foreach"] == pytest.approx(expected["foreach"], rel=1e-5)
        assert reads["ema"] == pytest.approx(expected["ema"], rel=1e-5)


def test_a_read_on_one_rank_only_fails_in_seconds_naming_the_parameter(ranks: Any) -> None:
    message, seconds = ranks[0]["one_rank"]
    assert "blocks.0.down.weight" in message and "local_slice" in message
    assert seconds < 10
    assert ranks[1]["one_rank"] is None


def test_the_closure_an_optimizer_step_calls_reads_whole_parameters(ranks: Any) -> None:
    for reads in ranks:
        assert reads["closure_shapes"] == [(6, 5), (6, 5)]


def test_an_optimizer_step_calls_no_rule_of_the_sharded_tensors(ranks: Any) -> None:
    for reads in ranks:
        assert reads["step_dispatches"] == 0


def test_an_in_place_write_from_a_whole_tensor_is_refused_naming_the_parameter(ranks: Any) -> None:
    for reads in ranks:
        assert "blocks.0.up.weight" in reads["whole_write"] and "local_reads" in reads["whole_write"]


def test_the_local_slice_is_a_plain_1d_tensor(ranks: Any) -> None:
    assert ranks[0]["local_type"] == (torch.Tensor, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_step_uses_the_foreach_kernels_torch_chooses_for_plain_tensors() -> None:
    layout = sharded_reads.ShardLayout("w", torch.Size([4]), ((0, 4),), 0)
    param = sharded_reads.ShardedParameter(torch.ones(4, device="cuda"), True, layout)
    param.grad = torch.ones(4, device="cuda")
    optimizer = torch.optim.Adam([param], lr=0.1)
    shard_layout.local_steps(optimizer)
    during = []
    optimizer.register_step_pre_hook(lambda opt, *_: during.append(opt.param_groups[0]["foreach"]))
    optimizer.step()
    assert during == [True] and optimizer.param_groups[0]["foreach"] is None


def test_a_step_leaves_the_param_groups_as_they_were() -> None:
    layout = sharded_reads.ShardLayout("w", torch.Size([4]), ((0, 4),), 0)
    param = sharded_reads.ShardedParameter(torch.ones(4), True, layout)
    param.grad = torch.ones(4)
    optimizer = torch.optim.Adam([param], lr=0.1)
    shard_layout.local_steps(optimizer)
    before = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    optimizer.step()
    assert {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} == before
    assert torch._C._is_torch_function_enabled()
    torch.testing.assert_close(param.data, torch.full((4,), 0.9))


def test_a_dropped_model_s_gradients_are_freed_while_its_views_hold_them() -> None:
    """A view's gradient holds the view's layout, and torch holds a parameter's gradient in C++, where the garbage
    collector does not look: nothing the layout holds may lead back to the view, or the cycle is never freed (a
    trial whose step raised kept its shards' gradients for good: ~17 MB a trial in test_lifetimes)."""
    managed = nn.Parameter(torch.zeros(8))
    layout = sharded_reads.ShardLayout("w", torch.Size([2, 4]), ((0, 4), (4, 8)), 0)
    record = unit_state.FlatState()  # its unit's record of it
    view = param_views.attach(managed, record, 0, 0, 4, True, layout)
    flat_grad = torch.ones(8)
    view.param.grad = sharded_reads.mark(flat_grad[:4], layout)  # as a synchronising backward gives it
    freed = weakref.ref(flat_grad)
    del managed, record, view, flat_grad, layout
    gc.collect()
    assert freed() is None


def accumulate(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int, sharded: bool) -> Any:
    """SGD steps over 2 micro-batches, the first without synchronising (``no_sync``), each adding the L2 penalty over
    ``model.parameters()`` (half of it: the loss is averaged over the micro-batches); the weights after."""
    data = batches(2 * STEPS)
    for step in range(STEPS):
        for micro in range(2):
            x, y = data[2 * step + micro]
            with model.no_sync() if sharded and micro == 0 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world]) + l2(model.parameters())
                (loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return {name: sharded_reads.whole(p).clone() for name, p in model.named_parameters()}


def accumulated(rank: int, world: int) -> Any:
    cpu_streams.install()
    model = Net()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy={Block})
    return accumulate(sharded.root, sharded.optimizer, rank, world, sharded=True)


def test_a_penalty_in_every_micro_batch_of_an_accumulation_trains_as_unsharded(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The penalty's gradient in a backward under ``no_sync`` is each rank's slice of it, already whole: kept apart
    from FairScale's unreduced gradient (which the synchronising backward averages over the ranks) and added to the
    reduced shard (before: refused; added to the unreduced gradient, it was averaged too: 1/world of it)."""
    got = run_ranks(accumulated, 2, tmp_path_factory.mktemp("accumulate"))
    model = Net()
    want = accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, 1, sharded=False)
    for weights in got:
        assert weights.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(weights[name], want[name], atol=1e-6, rtol=0, msg=name)


def test_a_step_that_raises_outside_its_closure_leaves_torch_functions_on(process_group: Any) -> None:
    """A step that raises (not in its closure) never runs its post-hook: the front ends' handling of a failed step
    (``WrappedModel.abort_steps``: Lightning's ``on_exception``, Fabric's ``optimizer_step``) ends its plain context
    (before: ``__torch_function__`` stayed off on the thread until the next step)."""
    from .test_whole_path import sharded_with

    layout = sharded_reads.ShardLayout("w", torch.Size([4]), ((0, 4),), 0)
    param = sharded_reads.ShardedParameter(torch.ones(4), True, layout)
    param.grad = torch.ones(4)

    class Exploding(torch.optim.SGD):
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            raise ValueError("not finite")

    optimizer = Exploding([param], lr=0.1)
    shard_layout.local_steps(optimizer)
    module = Net()
    model = sharded_with(module, torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not finite"):
        optimizer.step()
    model.abort_steps()
    assert torch._C._is_torch_function_enabled()
