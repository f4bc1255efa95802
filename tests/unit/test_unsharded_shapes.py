"""The sharded model's parameters with their unsharded shapes (:mod:`lightning_fairscale.fsdp.state.unsharded_shapes`),
in process: what they show inside the context, the error a use of their values raises, their data restored after (an
error inside included), an optimizer made inside that trains as the unsharded one, and the marks of param groups
made outside it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fairscale.fsdp.engine import finish_wrapping
from lightning_fairscale.fsdp.model import WrappedModel
from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.unit.state_names import clean_path
from lightning_fairscale.fsdp.state.unsharded_shapes import ValuesUnavailableError
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel

from .helpers import Net, batches, fabric_on_one_process, fsdp_kwargs, small_block, step, wrap

BLOCK = type(small_block())


def _sharded(net: nn.Module, flatten: bool = True) -> WrappedModel:
    layout = ParameterLayout.before_wrapping(net)
    root = wrap(net, policy={BLOCK}, flatten=flatten)
    layout.after_wrapping(root)
    return finish_wrapping(root, layout)


def _looks(model: nn.Module) -> dict[str, Any]:
    return {
        clean_path(name): (p.shape, p.ndim, p.numel(), p.dim(), p.dtype, p.device, p.requires_grad)
        for name, p in model.named_parameters()
    }


def _by_ndim(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("flatten", [True, False])
def test_inside_the_parameters_look_unsharded_and_after_they_are_the_shards_again(
    process_group: dist.ProcessGroup, flatten: bool
) -> None:
    net = Net()
    net.blocks[0].norm.weight.requires_grad_(False)
    unsharded = _looks(copy.deepcopy(net))
    model = _sharded(net, flatten)
    before = [(p, p.data, p.data.data_ptr(), p.data.clone()) for p in net.parameters()]
    if flatten:  # what the context is for (sharded in place, a parameter keeps its shape on one rank)
        assert all(p.ndim == 1 for p in net.parameters())
    with model.unsharded_shapes("inside the test", "do something else."):
        assert _looks(net) == unsharded
        assert sorted(p.ndim for p in model.root.parameters()) == sorted(p[1] for p in unsharded.values())
    for param, data, pointer, values in before:  # the same parameters, over the same shard memory, unchanged
        assert param.shape == data.shape and param.data.data_ptr() == pointer and torch.equal(param.data, values)


def test_a_use_of_the_values_inside_raises_what_to_do_and_the_data_comes_back(process_group: dist.ProcessGroup) -> None:
    net = Net()
    model = _sharded(net)
    weight = net.blocks[1].up.weight
    uses = [
        lambda: weight.sum(), lambda: weight.data, lambda: weight.detach(), lambda: weight + 1, lambda: repr(weight),
        lambda: nn.init.zeros_(weight), lambda: torch.nn.utils.parameters_to_vector(net.parameters()),
    ]
    for use in uses:
        with pytest.raises(ValuesUnavailableError) as raised:
            with model.unsharded_shapes("inside `configure_optimizers`", "read values in `on_fit_start`."):
                use()
        message = str(raised.value)
        assert "inside `configure_optimizers`" in message and "on_fit_start" in message
        assert "`blocks.1.up.weight`" in message or "parameter `" in message
        assert weight.ndim == 1  # restored after the error
    with pytest.raises(ValuesUnavailableError, match="`blocks.1.up.weight`.*30 of its 30 elements"):
        with model.unsharded_shapes("here", "elsewhere."):
            weight.mul_(2)


def test_an_optimizer_made_inside_trains_as_the_unsharded_one(process_group: dist.ProcessGroup) -> None:
    reference = Net()
    expected = torch.optim.AdamW(_by_ndim(list(reference.parameters())), lr=0.05)
    net = copy.deepcopy(reference)
    model = _sharded(net)
    with model.unsharded_shapes("here", "elsewhere."):
        optimizer = torch.optim.AdamW(_by_ndim(list(net.parameters())), lr=0.05)
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(g["params"]) for g in expected.param_groups]
    assert model.param_group_problem(optimizer) is None
    model.repoint(optimizer)
    for batch in batches(3):
        step(reference, expected, batch)
        step(model.root, optimizer, batch)
    full = model.state_dict(sharded=False, is_global_zero=True)
    for name, param in reference.state_dict().items():
        torch.testing.assert_close(full[name], param, rtol=0, atol=1e-6)


def test_groups_made_outside_show_their_marks(process_group: dist.ProcessGroup) -> None:
    net = Net()
    model = _sharded(net)
    outside = torch.optim.AdamW(_by_ndim(list(net.parameters())), lr=0.05)  # every parameter is 1-D here
    assert [len(g["params"]) for g in outside.param_groups] == [0, 16]
    assert "param group 0 holds none" in (model.param_group_problem(outside) or "")
    one_group = torch.optim.AdamW(net.parameters(), lr=0.05)
    assert model.param_group_problem(one_group) is None


def test_groups_over_the_flat_parameters_of_units_wrapped_by_hand_show_their_mark(
    process_group: dist.ProcessGroup,
) -> None:
    net = Net()
    net.blocks[0] = FullyShardedDataParallel(net.blocks[0], **fsdp_kwargs())  # wrapped by hand, before set-up
    groups = _by_ndim(list(net.parameters()))  # the unit's flat parameter is 1-D: no decay for its matrices
    optimizer = torch.optim.AdamW(groups, lr=0.05)
    model = _sharded(net)
    assert "flat parameters" in (model.param_group_problem(optimizer) or "")


def test_fabric_refuses_groups_made_from_the_shards_and_keeps_those_made_inside_unsharded_shapes() -> None:
    """Fabric, after ``fabric.setup_module``: an optimizer made over the 1-D shards by ``ndim`` is refused with what
    to do; made inside ``fabric.strategy.unsharded_shapes(model)``, it gets the unsharded groups."""
    from lightning_fairscale.fabric import DDPFullyShardedStrategy

    with fabric_on_one_process(DDPFullyShardedStrategy(auto_wrap_policy={BLOCK})) as fabric:
        model = fabric.setup_module(Net())
        outside = torch.optim.AdamW(_by_ndim(list(model.parameters())), lr=0.05)
        with pytest.raises(ValueError, match=r"param group 0 holds none.*fabric\.strategy\.unsharded_shapes\(model\)"):
            fabric.setup_optimizers(outside)
        with fabric.strategy.unsharded_shapes(model):
            inside = torch.optim.AdamW(_by_ndim(list(model.parameters())), lr=0.05)
        optimizer = fabric.setup_optimizers(inside)
        assert [len(g["params"]) for g in optimizer.param_groups] == [6, 10]
        assert all(p.ndim == 1 for p in model.parameters())
