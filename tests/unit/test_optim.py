"""optim.py on one rank: the parameter layout, re-pointing optimizers, and optimizer state in the plain layout.

References are plain optimizers over an unwrapped copy of the model, trained on the same batches: with one rank FSDP
keeps whole parameters, so states and parameters must agree to float rounding.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.state.optim import ParameterLayout, Piece
from lightning_fairscale.fsdp.state.optim_state import load_plain_state, plain_state_dict
from lightning_fairscale.fsdp.unit import unit_state
from lightning_fairscale.fsdp.unit.param_views import views_of
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .helpers import (
    OPTIMIZERS,
    Block,
    Net,
    Sharded,
    assert_optimizer_states_equal,
    assert_tensors_equal,
    batches,
    param_groups,
    parameters_of,
    shard,
    step,
    wrap,
)

pytestmark = pytest.mark.usefixtures("process_group")

#: For flattened parameters every Linear is a unit, so that the two param groups hold whole units.
POLICY = {True: {nn.Linear}, False: {Block}}


def trained_pair(optimizer: str, flatten: bool, steps: int = 2) -> tuple[Sharded, nn.Module, torch.optim.Optimizer]:
    """The same model and param groups trained ``steps`` steps wrapped (one rank) and plain."""
    model, reference = Net(), Net()
    plain = OPTIMIZERS[optimizer](param_groups(reference, flatten))
    sharded = shard(model, OPTIMIZERS[optimizer](param_groups(model, flatten)), policy=POLICY[flatten], flatten=flatten)
    for batch in batches(steps):
        step(sharded.root, sharded.optimizer, batch)
        step(reference, plain, batch)
    return sharded, reference, plain


@pytest.mark.parametrize("flatten", [True, False])
def test_layout_locates_every_original_parameter(flatten: bool) -> None:
    model = Net()
    originals = dict(model.named_parameters())
    values = parameters_of(model)
    layout = ParameterLayout.before_wrapping(model)
    root = wrap(model, policy={Block}, flatten=flatten)
    layout.after_wrapping(root)
    assert len(layout.managed) == (3 if flatten else len(originals))  # one flat parameter per unit
    for name, original in originals.items():
        [(managed, k)] = layout.locate(original)
        piece = layout.managed[managed].pieces[k]
        assert (piece.name, piece.shape) == (name, original.shape)
        data = managed.detach().reshape(-1)[piece.offset : piece.offset + piece.numel].view(piece.shape)
        assert torch.equal(data, values[name]), name  # one rank: the managed parameter holds the whole tensor
    layout.forget_originals()
    for managed, info in layout.managed.items():
        assert layout.locate(managed) == [(managed, k) for k in range(len(info.pieces))]
    if flatten:
        assert all(layout.locate(original) == [] for original in originals.values())
    assert layout.locate(nn.Parameter(torch.zeros(2))) == []


def test_layout_keeps_no_original_parameter_alive() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    originals = [weakref.ref(p) for p in model.parameters()]
    sharded = shard(model, optimizer, policy={Block})
    # No garbage collection: freed by reference counting, as soon as nothing holds them (a full collection of
    # this process's heap would take half a second).
    assert sum(ref() is not None for ref in originals) == 0, "the unsharded parameters are still referenced"
    assert sharded.layout.managed  # still usable: it knows the managed parameters


@pytest.mark.parametrize("flatten", [True, False])
def test_repoint_optimizer_keeps_groups_hyperparameters_and_the_users_order(flatten: bool) -> None:
    model = Net()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, flatten)
    listed = [[names[id(p)] for p in group["params"]] for group in groups]
    optimizer = OPTIMIZERS["sgd"](groups)
    hyperparameters = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    sharded = shard(model, optimizer, policy=POLICY[flatten], flatten=flatten)
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == hyperparameters
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(held) == len({id(p) for p in held}) == len(names)  # one rank: a view of every original parameter
    located = [sharded.layout.locate(p) for p in held]
    assert all(len(pair) == 1 and pair[0][0] in sharded.layout.managed for pair in located)
    pieces = [[sharded.layout.managed[m].pieces[k].name for m, k in order] for order in sharded.orders]
    assert pieces == listed


def test_repoint_optimizer_refuses_a_parameter_outside_the_module() -> None:
    model = Net()
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3, 4))], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(3, 4\) that is not part of the LightningModule.*self.parameters"):
        shard(model, optimizer)


def test_param_groups_may_split_units_and_name_any_subset() -> None:
    """Decay on weights, none on biases, one unit for the whole model, and one Linear left out: exact."""
    model, reference = Net(), Net()

    def groups(net: nn.Module) -> list[dict[str, Any]]:
        named = [(n, p) for n, p in net.named_parameters() if not n.startswith("out.")]
        return [
            {"params": [p for n, p in named if "weight" in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0, "lr": 0.02},
        ]

    sharded = shard(model, torch.optim.AdamW(groups(model), lr=0.05), policy=set(), flatten=True)
    plain = torch.optim.AdamW(groups(reference), lr=0.05)
    assert len(sharded.layout.managed) == 1  # every parameter in the root's one flat parameter
    for batch in batches(3):
        step(sharded.root, sharded.optimizer, batch)
        step(reference, plain, batch)
    assert_optimizer_states_equal(sharded.consolidate(), plain.state_dict())
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))


def test_frozen_parameters_share_a_unit_with_trainable_ones() -> None:
    """Frozen ``inp``: bit-equal after training, no optimizer state, left out of the gradient norm."""
    model, reference = Net(), Net()
    for net in (model, reference):
        net.inp.requires_grad_(False)
    initial = {n: v.clone() for n, v in parameters_of(model).items()}
    sharded = shard(model, torch.optim.Adam(model.parameters(), lr=0.05), policy=set(), flatten=True)
    plain = torch.optim.Adam(reference.parameters(), lr=0.05)
    for batch in batches(3):
        step(sharded.root, sharded.optimizer, batch)
        step(reference, plain, batch)
    frozen = [p for g in sharded.optimizer.param_groups for p in g["params"] if not p.requires_grad]
    assert len(frozen) == 2 and all(p.grad is None and p not in sharded.optimizer.state for p in frozen)
    consolidated = sharded.consolidate()
    assert sorted(consolidated["state"]) == sorted(plain.state_dict()["state"])  # no entries for inp.*
    assert_optimizer_states_equal(consolidated, plain.state_dict())
    # The norm of the trainable gradients only, as torch's of the unsharded model.
    x, y = batches(4)[3]
    nn.functional.mse_loss(sharded.root(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 1e9)
    torch.testing.assert_close(sharded.root.clip_grad_norm_(1e9), expected_norm, rtol=1e-6, atol=0)
    values = parameters_of(unwrap_module(sharded.root))
    assert torch.equal(values["inp.weight"], initial["inp.weight"])
    assert torch.equal(values["inp.bias"], initial["inp.bias"])
    assert_tensors_equal(values, parameters_of(reference))


def test_a_later_stage_takes_the_same_parameters_and_views() -> None:
    """A later stage (another Trainer, ``fit`` after ``validate``) makes its optimizer over the sharded model's own
    parameters: they are the views the first stage's optimizer held, and its optimizer holds the same ones."""
    model = Net()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=set())
    first = list(sharded.optimizer.param_groups[0]["params"])
    wrapped = fsdp_engine.wrapped_model(sharded.root)
    assert wrapped.layout is sharded.layout
    optimizer = torch.optim.SGD(sharded.root.parameters(), lr=0.1)
    wrapped.repoint(optimizer)
    [managed] = wrapped.layout.managed
    record = unit_state.peek_flat(wrapped.layout.managed[managed].unit, managed)
    assert [view.param for view in views_of(record)] == optimizer.param_groups[0]["params"] == first


def test_zero_grad_reaches_the_flat_gradient_and_accumulation_without_it_adds() -> None:
    model, reference = Net(), Net()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=set(), flatten=True)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    first, second = batches(2)
    for batch in (first, second):  # two backwards without zero_grad: the gradients add up, as unsharded
        nn.functional.mse_loss(sharded.root(batch[0]), batch[1]).backward()
        nn.functional.mse_loss(reference(batch[0]), batch[1]).backward()
    sharded.optimizer.step()
    plain.step()
    sharded.optimizer.zero_grad()
    plain.zero_grad()
    for opt, net in ((sharded.optimizer, sharded.root), (plain, reference)):
        nn.functional.mse_loss(net(first[0]), first[1]).backward()
        opt.step()
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_consolidated_state_equals_a_plain_optimizers(optimizer: str, flatten: bool) -> None:
    sharded, _, plain = trained_pair(optimizer, flatten)
    consolidated = sharded.consolidate()
    assert_optimizer_states_equal(consolidated, plain.state_dict())
    assert len(consolidated["param_groups"]) == 2 and consolidated["param_groups"][0]["lr"] == 0.05


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_consolidate_shard_consolidate_is_the_identity(optimizer: str, flatten: bool) -> None:
    sharded, _, _ = trained_pair(optimizer, flatten)
    first = sharded.consolidate()
    model = Net()
    fresh = shard(model, OPTIMIZERS[optimizer](param_groups(model, flatten)), policy=POLICY[flatten], flatten=flatten)
    fresh.load(first)
    assert_optimizer_states_equal(fresh.consolidate(), first, atol=0)


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_resumes_exactly_from_a_plain_optimizers_state(optimizer: str, flatten: bool) -> None:
    """A full checkpoint's state (a plain optimizer's) is sharded and training goes on as it would have."""
    _, reference, plain = trained_pair(optimizer, flatten)
    resumed = Net()
    resumed.load_state_dict(reference.state_dict())
    sharded = shard(resumed, OPTIMIZERS[optimizer](param_groups(resumed, flatten)), POLICY[flatten], flatten)
    sharded.load(plain.state_dict())
    for batch in batches(4)[2:]:
        step(sharded.root, sharded.optimizer, batch)
        step(reference, plain, batch)
    assert_optimizer_states_equal(sharded.consolidate(), plain.state_dict())
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))


def test_load_plain_state_refuses_a_state_of_other_groups_or_parameters() -> None:
    sharded, _, plain = trained_pair("sgd", flatten=True, steps=1)
    state = plain.state_dict()
    one_group = {"state": state["state"], "param_groups": state["param_groups"][:1]}
    with pytest.raises(ValueError, match="has 1 param groups but the optimizer has 2"):
        load_plain_state(one_group, sharded.optimizer, sharded.layout, sharded.orders)
    shorter = {**state, "param_groups": [state["param_groups"][0], {**state["param_groups"][1], "params": [0, 1]}]}
    with pytest.raises(ValueError, match="holds 2 parameters, the optimizer's holds 12"):
        load_plain_state(shorter, sharded.optimizer, sharded.layout, sharded.orders)


def test_plain_state_dict_slices_each_piece_in_the_users_order() -> None:
    pieces = [
        [Piece("a", 0, 4, torch.Size([2, 2])), Piece("b", 4, 3, torch.Size([3]))],
        [Piece("c", 0, 2, torch.Size([2]))],
    ]
    full_states: list[dict[str, Any]] = [
        {"momentum_buffer": torch.arange(7.0), "step": torch.tensor(3.0)},
        {"momentum_buffer": torch.tensor([10.0, 11.0]), "step": torch.tensor(3.0)},
    ]
    orders = [[(0, 1), (1, 0)], [(0, 0)]]
    groups = [{"lr": 0.1, "params": [7, 8]}, {"lr": 0.2, "params": [9]}]
    result = plain_state_dict(full_states, pieces, orders, groups, [{"momentum_buffer"}, {"momentum_buffer"}])
    assert result["param_groups"] == [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]
    assert torch.equal(result["state"][0]["momentum_buffer"], torch.tensor([4.0, 5.0, 6.0]))  # b
    assert torch.equal(result["state"][1]["momentum_buffer"], torch.tensor([10.0, 11.0]))  # c
    assert torch.equal(result["state"][2]["momentum_buffer"], torch.tensor([[0.0, 1.0], [2.0, 3.0]]))  # a
    assert all(torch.equal(result["state"][i]["step"], torch.tensor(3.0)) for i in range(3))
    # The pieces are views into the gathered tensors, not copies: copies doubled rank 0's optimizer memory on a full
    # save (the gathered tensors are fresh ones, which nothing else writes to).
    gathered = full_states[0]["momentum_buffer"].untyped_storage().data_ptr()
    assert result["state"][0]["momentum_buffer"].untyped_storage().data_ptr() == gathered
    assert result["state"][2]["momentum_buffer"].untyped_storage().data_ptr() == gathered


class ScaledLinear(nn.Module):
    """A 0-dimensional parameter first in its module, as a learned temperature or residual gate."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.linear(x)


def test_a_scalar_parameter_first_in_a_flat_unit_resumes_from_a_plain_state() -> None:
    model, reference = ScaledLinear(), ScaledLinear()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3)
    step(reference, plain, (x, torch.zeros(4, 2)))
    model.load_state_dict(reference.state_dict())
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    sharded.load(plain.state_dict())
    step(sharded.root, sharded.optimizer, (x, torch.zeros(4, 2)))
    step(reference, plain, (x, torch.zeros(4, 2)))
    assert_optimizer_states_equal(sharded.consolidate(), plain.state_dict())


def _resident_file_kib() -> int:
    """The part of this process's resident set that files back (memory-mapped checkpoints among them)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are handed back on Linux only")
def test_a_memory_mapped_plain_state_loads_without_keeping_the_files_pages(tmp_path: Path) -> None:
    """Loading a full checkpoint's optimizer state reads each slice from the memory-mapped file and gives its pages
    back: kept, they doubled the rank's optimizer state in memory until loading ended (a resume's peak)."""
    model, reference = nn.Linear(1024, 1024), nn.Linear(1024, 1024)
    model.load_state_dict(reference.state_dict())
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    step(reference, plain, (torch.randn(4, 1024), torch.randn(4, 1024)))
    torch.save(plain.state_dict(), tmp_path / "optimizer.pt")
    sharded = shard(model, torch.optim.Adam(model.parameters(), lr=0.01))
    sharded.load(torch.load(tmp_path / "optimizer.pt", mmap=True))  # once first: whatever it imports lazily is mapped
    saved = torch.load(tmp_path / "optimizer.pt", mmap=True)
    before = _resident_file_kib()
    sharded.load(saved)
    # Adam's two moments of 1,049,600 elements are 8.2 MB in the file: less than a tenth of them is still resident.
    assert _resident_file_kib() - before < 800
    assert_optimizer_states_equal(sharded.consolidate(), plain.state_dict(), atol=0)
