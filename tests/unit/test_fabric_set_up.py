"""What Fabric's FSDP strategy set up (``fabric._fsdp_set_up.FsdpSetUp``): the models and optimizers it holds, the
engine's calls over them, and the errors that name what to do, on one process of a gloo group in this process."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from lightning_fabric import Fabric
from torch import nn

from lightning_fairscale._compat import forward_module
from lightning_fairscale.fabric import DDPFullyShardedStrategy
from lightning_fairscale.fabric._fsdp_set_up import FsdpSetUp, sharded_model, unsharded_shapes

from .helpers import Block, Net, batches, fabric_on_one_process


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with fabric_on_one_process(DDPFullyShardedStrategy(auto_wrap_policy={Block})) as fabric:
        yield fabric


def test_it_holds_the_models_and_optimizers_set_up_and_their_calls(fabric: Fabric) -> None:
    """``fabric.setup`` goes through it: the root unit held (weakly), the optimizer re-pointed to that model, whose
    full optimizer state it gives; a model dropped is no longer held."""
    set_up = FsdpSetUp()
    assert set_up.roots == []
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = batches(1)[0]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    root = forward_module(model)  # what the strategy's setup_module returned: the root unit
    wrapped = sharded_model(root)
    assert wrapped is not None and set_up.is_ours(root) and not set_up.is_ours(nn.Linear(2, 2))
    # A holder of its own, given the same sharded model: the calls go to the engine's WrappedModel.
    assert set_up.add(wrapped) is root and set_up.roots == [root]
    with unsharded_shapes(model):  # an optimizer made after set-up, re-pointed by this holder
        second = torch.optim.Adam(root.parameters(), lr=0.02)
    set_up.repoint(second, fabric.strategy.config)
    assert set_up.holds(second) and not set_up.holds(optimizer.optimizer) and set_up.model_of(second).root is root
    assert set_up.optimizer_state(second, sharded=False)["param_groups"][0]["lr"] == 0.02
    assert sorted(set_up.model_keys(root)) == sorted(Net().state_dict())
    assert set(set_up.model_state(root, sharded=False, is_global_zero=True)) == set(Net().state_dict())
    set_up.recover()  # nothing failed: nothing to do
    set_up.abort_steps(second)
    del model, optimizer, second, root, wrapped
    gc.collect()
    assert set_up.roots == []


def test_what_was_not_set_up_is_refused_naming_what_to_do(fabric: Fabric) -> None:
    """An optimizer over another model's parameters, a model not set up, an optimizer not re-pointed: each raises
    with what to pass instead."""
    model = fabric.setup_module(Net())
    other = Net(seed=1)
    with pytest.raises(ValueError, match="not those of a model set up with this strategy"):
        fabric.setup_optimizers(torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="Pass the model that `fabric.setup` returned"):
        fabric.strategy.averaged_model(other)
    with pytest.raises(ValueError, match="takes a model set up with this strategy"):
        unsharded_shapes(other)
    with pytest.raises(ValueError, match="was not set up with this strategy"):
        FsdpSetUp().model_of(torch.optim.SGD(other.parameters(), lr=0.1))
    with unsharded_shapes(model):  # what `fabric.setup_module` returned
        shapes = {name.removeprefix("_forward_module."): tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {name: tuple(param.shape) for name, param in other.named_parameters()}
    averaged = fabric.strategy.averaged_model(model)
    assert set(averaged.state_dict()) >= {f"module.{name}" for name in Net().state_dict()}


def test_an_optimizer_set_up_again_keeps_its_state(fabric: Fabric) -> None:
    """``fabric.setup_optimizers`` of an optimizer set up already leaves it as it is, as unsharded (Lightning's
    ``"ddp"``): its state stays (re-pointing it again made its parameters' views anew and dropped its state, 16
    entries to 0, silently), and the next step goes on from it."""
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, wrapped = fabric.setup(model, optimizer)
    x, y = batches(1)[0]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    wrapped.step()
    state = {key: {name: value.clone() for name, value in entry.items()} for key, entry in optimizer.state.items()}
    again = fabric.setup_optimizers(optimizer)
    assert len(optimizer.state_dict()["state"]) == len(state) == 16
    for param, entry in optimizer.state.items():
        assert all(torch.equal(value, state[param][name]) for name, value in entry.items())
    fabric.backward(nn.functional.mse_loss(model(x), y))
    again.step()
    assert all(int(entry["step"]) == 2 for entry in optimizer.state.values())
