"""What the loop changes between steps (FairScale workaround 28, ``lightning_fairscale.fsdp.unit.step_state``), in one
process against the same training of the plain module: ``requires_grad`` flipped after set-up (a unit frozen whole,
in part, at set-up and unfrozen later), gradients that accumulate across a freeze, a backward that reaches only some
units, and backward passes inside the root's forward (the Trainer's manual optimization)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState
from models import Block
from torch import Tensor, nn

from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.state.sharded_checkpoint import consolidate
from lightning_fairscale.fsdp.unit.units import fsdp_instances
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .helpers import (
    Net,
    assert_optimizer_states_equal,
    assert_tensors_equal,
    batches,
    parameters_of,
    shard,
    split_by_hand,
    wrap,
)

pytestmark = pytest.mark.usefixtures("process_group")

#: For each step, what is frozen (every other parameter trains): ``inp`` (part of the root unit) and a whole Block
#: unit, then part of the other Block unit, then nothing.
SCHEDULE = [("inp.weight", "blocks.0"), ("blocks.1.up",), ()]


def apply(net: nn.Module, frozen: tuple[str, ...]) -> None:
    for param in net.parameters():
        param.requires_grad_(True)
    for name in frozen:
        target = net.get_submodule(name) if not name.endswith(("weight", "bias")) else net.get_parameter(name)
        target.requires_grad_(False)


def train_both(schedule: list[tuple[str, ...]], frozen_at_setup: tuple[str, ...] = (), clip: bool = False) -> Any:
    """Adam on the sharded ``Net`` (each Block a unit) and on the plain one, freezing as ``schedule`` says before
    each step (on the model's own parameters: after set-up, the views)."""
    model, reference = Net(), Net()
    apply(model, frozen_at_setup)
    sharded = shard(model, torch.optim.Adam(model.parameters(), lr=0.05), policy={Block})
    plain = torch.optim.Adam(reference.parameters(), lr=0.05)
    norms = []
    for frozen, (x, y) in zip(schedule, batches(len(schedule))):
        for net, optimizer in ((sharded.root, sharded.optimizer), (reference, plain)):
            apply(net, frozen)
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
        if clip:
            norms.append((
                sharded.root.clip_grad_norm_(0.05),
                torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.05),
            ))
        sharded.optimizer.step()
        plain.step()
    return sharded, reference, plain, norms


def test_freezing_and_unfreezing_after_set_up_trains_as_unsharded() -> None:
    sharded, reference, plain, norms = train_both(SCHEDULE, clip=True)
    # Each original parameter keeps its own Adam state, `step` included (a Block frozen for a step lags behind).
    consolidated = sharded.consolidate()
    assert_optimizer_states_equal(consolidated, plain.state_dict())
    steps = {float(state["step"]) for state in consolidated["state"].values()}
    assert steps == {2.0, 3.0}, steps
    for sharded_norm, plain_norm in norms:  # frozen parameters left out of the norm
        torch.testing.assert_close(sharded_norm, plain_norm, rtol=1e-6, atol=0)
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))


def test_a_frozen_parameter_gets_no_gradient_and_no_update() -> None:
    model = Net()
    sharded = shard(model, torch.optim.Adam(model.parameters(), lr=0.05), policy={Block})
    apply(sharded.root, SCHEDULE[0])
    before = {name: p.detach().clone() for name, p in sharded.root.named_parameters()}
    x, y = batches(1)[0]
    nn.functional.mse_loss(sharded.root(x), y).backward()
    sharded.optimizer.step()
    for name, param in sharded.root.named_parameters():
        frozen = name.startswith("blocks.0") or name == "inp.weight"
        assert (param.grad is None) == frozen, name
        assert torch.equal(param.detach(), before[name]) == frozen, name
        assert (param in sharded.optimizer.state) != frozen, name
    # The Block frozen whole computed no gradient at all.
    unit = next(u for u in fsdp_instances(sharded.root) if u is not sharded.root and not u.params[0].requires_grad)
    assert unit.params[0].grad is None


@pytest.mark.workaround(28)
def test_a_unit_frozen_at_set_up_trains_once_unfrozen() -> None:
    schedule = [("blocks.0",), (), ()]
    sharded, reference, plain, _ = train_both(schedule, frozen_at_setup=("blocks.0",))
    assert_optimizer_states_equal(sharded.consolidate(), plain.state_dict())
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))


def test_a_parameter_frozen_while_gradients_accumulate_keeps_its_own() -> None:
    """No ``zero_grad`` between two backwards, a parameter frozen between them: it keeps the first gradient (as a
    frozen parameter of a plain module does), the others add both."""
    model, reference = Net(), Net()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy={Block})
    first, second = batches(2)
    for net in (sharded.root, reference):
        nn.functional.mse_loss(net(first[0]), first[1]).backward()
        net.get_submodule("blocks.1.up").requires_grad_(False)
        nn.functional.mse_loss(net(second[0]), second[1]).backward()
    grads = {n: p.grad for n, p in sharded.root.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].view(-1), param.grad.view(-1), rtol=1e-6, atol=1e-7)


class TwoUnits(nn.Module):
    """A generator and a discriminator (each a ``Block`` unit) and the step that uses them: the root's forward runs
    ``step`` (as Lightning runs ``training_step`` inside the root unit's forward)."""

    def __init__(self, root_parameter: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.generator, self.discriminator = Block(5, hidden=6), Block(5, hidden=6)
        if root_parameter:
            self.scale = nn.Parameter(torch.ones(5))

    def forward(self, step: Callable[[], Any]) -> Any:
        return step()


def gan_step(model: nn.Module, g_opt: Any, d_opt: Any, x: Tensor, z: Tensor, backward: Callable[[Tensor], None],
             detach: bool) -> None:
    """The discriminator's step, then the generator's, over one forward of the generator; each step's other module
    frozen (``toggle_optimizer``)."""
    g, d = model.generator, model.discriminator
    fake = g(z)
    d.requires_grad_(True)
    g.requires_grad_(False)
    d_loss = d(x).pow(2).mean() + (d(fake.detach() if detach else fake) - 1).pow(2).mean()
    backward(d_loss, retain_graph=not detach)
    d_opt.step()
    d_opt.zero_grad()
    g.requires_grad_(True)
    d.requires_grad_(False)
    backward(d(fake).pow(2).mean())
    g_opt.step()
    g_opt.zero_grad()
    d.requires_grad_(True)


@pytest.mark.parametrize("detach", [True, False])
@pytest.mark.workaround(28)
def test_backward_passes_inside_the_roots_forward_train_as_unsharded(detach: bool) -> None:
    model, reference = TwoUnits(), TwoUnits()
    g_opt = torch.optim.Adam(model.generator.parameters(), lr=0.05)
    d_opt = torch.optim.Adam(model.discriminator.parameters(), lr=0.05)
    layout = ParameterLayout.before_wrapping(model)
    root = wrap(model, policy={Block})
    wrapped = fsdp_engine.finish_wrapping(root, layout.after_wrapping(root))
    wrapped.repoint(g_opt, d_opt)
    wrapped.forget_originals()
    plain_g = torch.optim.Adam(reference.generator.parameters(), lr=0.05)
    plain_d = torch.optim.Adam(reference.discriminator.parameters(), lr=0.05)

    def backward(loss: Tensor, **kwargs: Any) -> None:
        with wrapped.backward():
            loss.backward(**kwargs)

    torch.manual_seed(11)
    for _ in range(3):
        x, z = torch.randn(6, 5), torch.randn(6, 5)
        root(lambda: gan_step(root, g_opt, d_opt, x, z, backward, detach))
        gan_step(reference, plain_g, plain_d, x, z, lambda loss, **kw: loss.backward(**kw), detach)
        states = {unit.training_state for unit in fsdp_instances(root)}
        assert states == {TrainingState.IDLE}, states
    assert_tensors_equal(parameters_of(unwrap_module(root)), parameters_of(reference))


def test_a_backward_inside_the_forward_of_a_root_with_parameters_is_refused() -> None:
    model = TwoUnits(root_parameter=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = shard(model, optimizer, policy={Block})
    wrapped = fsdp_engine.wrapped_model(sharded.root)

    def step() -> None:
        loss = model.discriminator(model.generator(torch.randn(2, 5)) * model.scale).sum()
        with wrapped.backward():
            loss.backward()

    with pytest.raises(RuntimeError, match="root unit holds 5 elements of its own.*auto_wrap_policy"):
        sharded.root(step)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_sharded_checkpoint_after_a_freeze_consolidates_each_parameters_own_step(
    tmp_path: Path, world_size: int
) -> None:
    """Offline consolidation of a sharded checkpoint keeps each original parameter's Adam ``step`` (part of a unit
    frozen for a step lags behind the rest of it), as the online full save does."""
    from unit.test_sharded_checkpoint_format import TRAINER_STATE, split, write

    sharded, _, plain, _ = train_both(SCHEDULE)
    meta, one = split(sharded)
    shards = split_by_hand(one, world_size) if world_size > 1 else [one]
    full = consolidate(write(tmp_path / "frozen.ckpt", meta, shards))
    assert {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")} == TRAINER_STATE
    assert_optimizer_states_equal(full["optimizer_states"][0], plain.state_dict())


def test_the_unsharded_module_keeps_the_flags_the_loop_left() -> None:
    """``unshard_module()`` after freezes between steps: each parameter's ``requires_grad`` is as the loop left it,
    not as it was at set-up (a Block frozen at set-up and unfrozen since, part of a unit frozen since)."""
    sharded, _, _, _ = train_both([("blocks.0",), ("blocks.1.up",)], frozen_at_setup=("blocks.0",))
    module = unwrap_module(sharded.root)
    flags = {name: param.requires_grad for name, param in module.named_parameters()}
    assert flags == {name: not name.startswith("blocks.1.up.") for name in flags}, flags


def test_a_second_backward_through_weights_an_optimizer_changed_is_refused_as_unsharded() -> None:
    """``retain_graph=True``, ``optimizer.step()``, then a backward through the same graph: unsharded torch refuses
    it (the weights it differentiates were changed in place); so does the sharded model, instead of differentiating
    the new weights."""
    model, reference = Net(), Net()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy={Block})
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = batches(1)[0]
    for net, optimizer, message in ((reference, plain, "inplace"), (sharded.root, sharded.optimizer, "retain_graph")):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward(retain_graph=True)
        optimizer.step()
        with pytest.raises(RuntimeError, match=message):
            loss.backward()


def test_a_second_backward_through_a_kept_graph_adds_the_same_gradients_as_unsharded() -> None:
    """``retain_graph=True`` and a second backward through the same graph (nothing stepped between): every unit,
    the root included (which keeps its full parameters after its forward), is gathered again."""
    model, reference = Net(), Net()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy={Block})
    x, y = batches(1)[0]
    for net in (sharded.root, reference):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    grads = {n: p.grad for n, p in sharded.root.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].view(-1), param.grad.view(-1), rtol=1e-6, atol=1e-7)


def test_without_flattening_a_parameter_frozen_at_set_up_trains_once_unfrozen_on_the_module() -> None:
    """``flatten_parameters=False``: the module's parameters are the sharded ones, the optimizer holds views of them;
    unfreezing the module's parameter (``BaseFinetuning.make_trainable``) makes its view train too."""
    model, reference = Net(), Net()
    for net in (model, reference):
        net.blocks[0].requires_grad_(False)
    sharded = shard(model, torch.optim.Adam(model.parameters(), lr=0.05), policy={Block}, flatten=False)
    plain = torch.optim.Adam(reference.parameters(), lr=0.05)
    for index, (x, y) in enumerate(batches(3)):
        for net, optimizer in ((sharded.root, sharded.optimizer), (reference, plain)):
            if index == 1:
                net.get_submodule("blocks.0").requires_grad_(True)
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    assert_optimizer_states_equal(sharded.consolidate(), plain.state_dict())
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))
