"""Optimizers that read whole tensors (``fsdp/state/optimizer_paths.py``, ``whole_owners.py``, ``whole_step.py``,
``whole_state.py``), in this process: the declared table, the throwaway check of an optimizer nobody declared, the
refusal of those no rank can step, the owners' plan, and the whole step around a real optimizer on a one-rank group
(the exchanges between ranks are the 2-process scenarios': ``tests/test_whole_optimizers.py``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.engine import finish_wrapping
from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.state.optimizer_paths import (
    ELEMENTWISE,
    REFUSED,
    WHOLE,
    choose_path,
    refusal,
    steps_elementwise,
)
from lightning_fairscale.fsdp.state.whole_owners import Span, assign_owners, spans_of

from .helpers import Net, batches, wrap


class LARS(torch.optim.Optimizer):
    """A user's LARS: a trust ratio per tensor (not element-wise)."""

    def __init__(self, params: Any, lr: float = 0.1, eta: float = 0.02) -> None:
        super().__init__(params, {"lr": lr, "eta": eta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = group["eta"] * p.norm() / p.grad.norm().clamp(min=1e-12)
                    p.add_(p.grad, alpha=-float(group["lr"] * trust))


class ScaledSGD(torch.optim.SGD):
    """A user's subclass of an element-wise class that stays element-wise."""

    def __init__(self, params: Any, lr: float = 0.1, scale: float = 2.0) -> None:
        super().__init__(params, lr=lr * scale)


class NeedsArgument(torch.optim.Optimizer):
    """A constructor the check cannot call from the param groups (a required argument of another name)."""

    def __init__(self, params: Any, schedule: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:  # element-wise, but not known to be
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-0.1)


def params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]


# ----------------------------------------------------------------------------------------------------------------
# The table and the check


def test_the_table_declares_torch_optimizers() -> None:
    names = {cls.__name__ for cls in ELEMENTWISE}
    assert {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "Rprop", "ASGD", "NAdam", "RAdam"} <= names
    assert {cls.__name__ for cls in WHOLE} == {"Adafactor", "Muon"}
    assert torch.optim.LBFGS in REFUSED
    assert not ELEMENTWISE & WHOLE and not (ELEMENTWISE | WHOLE) & set(REFUSED)


@pytest.mark.parametrize("cls", sorted(ELEMENTWISE, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_declared_elementwise_class_passes_the_throwaway_check(cls: type) -> None:
    """The table is checked against the check itself: each class, with its defaults, steps a matrix as its slices."""
    assert steps_elementwise(cls(params()))


@pytest.mark.parametrize("cls", sorted(WHOLE, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_declared_whole_class_fails_the_throwaway_check(cls: type) -> None:
    assert not steps_elementwise(cls([nn.Parameter(torch.randn(4, 3))]))


def test_an_unknown_optimizer_is_checked_not_assumed() -> None:
    assert choose_path(LARS(params())) == "whole"  # a trust ratio per tensor: different on slices
    assert choose_path(ScaledSGD(params())) == "elementwise"  # a subclass is checked, not taken for its base
    assert choose_path(NeedsArgument(params(), schedule=None)) == "whole"  # the check cannot run: the exact path
    assert choose_path(torch.optim.AdamW(params())) == "elementwise"
    assert choose_path(torch.optim.Adafactor(params())) == "whole"


def test_the_check_uses_each_param_groups_hyperparameters() -> None:
    """SGD's weight decay is element-wise; a group's own hyperparameters reach the throwaway step (a check with the
    defaults only would miss a group whose hyperparameters make the class per tensor)."""

    class DecayNorm(torch.optim.SGD):  # per tensor only when weight_decay is set
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        scale = 1 + group["weight_decay"] * p.norm()
                        p.add_(p.grad * scale, alpha=-group["lr"])

    a, b = params()
    assert choose_path(DecayNorm([{"params": [a]}], lr=0.1)) == "elementwise"
    assert choose_path(DecayNorm([{"params": [a]}, {"params": [b], "weight_decay": 0.1}], lr=0.1)) == "whole"


def test_the_option_forces_a_path() -> None:
    assert choose_path(torch.optim.Adam(params()), "whole") == "whole"
    assert choose_path(torch.optim.Adafactor(params()), "elementwise") == "elementwise"
    assert FullyShardedConfig(optimizer_path="whole").optimizer_path == "whole"
    with pytest.raises(ValueError, match="`optimizer_path` must be"):
        FullyShardedConfig(optimizer_path="slices")  # type: ignore[arg-type]


def test_optimizers_that_read_the_whole_vector_are_refused_with_what_to_do() -> None:
    message = refusal(torch.optim.LBFGS(params()))
    assert message is not None
    assert "LBFGS" in message and "whole parameter vector" in message and 'strategy="ddp"' in message

    class OwnList(torch.optim.SGD):  # keeps the parameters it was given, as LBFGS does
        def __init__(self, params: Any) -> None:
            super().__init__(params, lr=0.1)
            self.mine = list(self.param_groups[0]["params"])

    message = refusal(OwnList(params()))
    assert message is not None and "OwnList" in message and "`mine`" in message

    class LineSearch(torch.optim.SGD):
        def step(self, closure: Any) -> Any:  # type: ignore[override]
            return super().step(closure)

    assert "closure" in (refusal(LineSearch(params(), lr=0.1)) or "")
    assert refusal(torch.optim.Adafactor(params())) is None and refusal(LARS(params())) is None


# ----------------------------------------------------------------------------------------------------------------
# Owners


def test_owners_are_balanced_by_size_and_the_same_for_the_same_input() -> None:
    sizes = [(10, [0, 1]), (6, [0]), (5, [1]), (4, [0, 1]), (0, [])]
    assert assign_owners(sizes) == [0, 0, 1, 1, 0]
    assert assign_owners(sizes) == assign_owners(list(sizes))
    # A frozen parameter adds nothing to the balance.
    assert assign_owners([(10, [0, 1]), (8, [0, 1]), (3, [0, 1])], [False, True, True]) == [1, 0, 1]


def test_spans_follow_fairscale_shards() -> None:
    # 10 elements on 2 ranks: [0, 5) and [5, 10); a parameter at [3, 9).
    assert spans_of(3, 6, 10, 2, True, 0) == (Span(0, 0, 2), Span(1, 2, 6))
    assert spans_of(0, 3, 10, 2, True, 1) == (Span(0, 0, 3),)  # inside rank 0's shard: it moves nothing
    assert spans_of(0, 10, 10, 1, False, 0) == (Span(0, 0, 10),)  # not sharded: this rank holds it


# ----------------------------------------------------------------------------------------------------------------
# The whole step on one rank (hooks, views swapped and restored, state whole-shaped, checkpoints)


def sharded_with(module: nn.Module, optimizer: torch.optim.Optimizer, path: str = "auto") -> Any:
    layout = ParameterLayout.before_wrapping(module)
    root = wrap(module, policy={nn.Linear})
    layout.after_wrapping(root)
    model = finish_wrapping(root, layout)
    model.repoint(optimizer, path=path)  # type: ignore[arg-type]
    model.forget_originals()
    return model


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for x, y in batches(steps):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_adafactor_steps_whole_tensors_and_keeps_whole_state(process_group: Any) -> None:
    torch.manual_seed(0)
    plain = Net()
    expected_optimizer = torch.optim.Adafactor(plain.parameters(), lr=0.05)
    module = copy.deepcopy(plain)
    optimizer = torch.optim.Adafactor(module.parameters(), lr=0.05)
    model = sharded_with(module, optimizer)
    assert model.path(optimizer) == "whole"
    train(plain, expected_optimizer, 3)
    train(model.root, optimizer, 3)
    views = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.dim() == 1 for p in views) and all(p.grad is None for p in views)  # slices again, after the step
    # Whole-shaped state: Adafactor's row and column factors of each matrix.
    shapes = {tuple(v.shape) for state in optimizer.state.values() for v in state.values() if v.dim() > 0}
    assert {(5, 1), (1, 3)} <= shapes  # `inp`'s 5x3 weight: its row and column factors
    full = model.optimizer_state(optimizer, sharded=False)
    expected = expected_optimizer.state_dict()
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert torch.allclose(full["state"][index][key], value, atol=1e-6), (index, key)
    trained = model.state_dict(sharded=False, is_global_zero=True)
    for name, value in plain.state_dict().items():
        assert torch.allclose(trained[name], value, atol=1e-6), name
    # The full state loads back (each owner its parameters' entries whole).
    for state in optimizer.state.values():
        state.clear()
    model.load_optimizer_state(optimizer, full)
    again = model.optimizer_state(optimizer, sharded=False)
    assert all(torch.equal(again["state"][i][k], full["state"][i][k]) for i in full["state"] for k in full["state"][i]
               if isinstance(full["state"][i][k], torch.Tensor))


def test_a_step_that_raises_leaves_no_whole_tensor(process_group: Any) -> None:
    """A user's step that raises (after reading the whole tensors): the views are slices again after it, with the
    gradients FSDP gave them."""

    class Exploding(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            shapes = [p.shape for g in self.param_groups for p in g["params"] if p.grad is not None]
            assert any(len(shape) == 2 for shape in shapes)  # it saw whole matrices
            raise RuntimeError("not finite")

    module = Net()
    optimizer = Exploding(module.parameters(), lr=0.1)
    model = sharded_with(module, optimizer, path="whole")
    x, y = batches(1)[0]
    nn.functional.mse_loss(model.root(x), y).backward()
    views = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in views]
    with pytest.raises(RuntimeError, match="not finite"):
        optimizer.step()
    model.abort_steps()
    assert all(p.dim() == 1 for p in views)
    assert all(p.grad is g for p, g in zip(views, grads))


def test_unsharding_removes_the_hooks(process_group: Any) -> None:
    module = Net()
    optimizer = torch.optim.Adafactor(module.parameters())
    model = sharded_with(module, optimizer)
    assert optimizer._optimizer_step_pre_hooks and optimizer._optimizer_step_post_hooks
    model.unshard(keep=True)
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_an_elementwise_optimizer_gets_no_hook(process_group: Any) -> None:
    module = Net()
    optimizer = torch.optim.AdamW(module.parameters())
    model = sharded_with(module, optimizer)
    assert model.path(optimizer) == "elementwise"
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_lbfgs_is_refused_at_set_up_before_anything_changes(process_group: Any) -> None:
    module = Net()
    optimizer = torch.optim.LBFGS(module.parameters())
    before = list(optimizer.param_groups[0]["params"])
    with pytest.raises(ValueError, match="LBFGS cannot train a model sharded by DDPFullyShardedStrategy"):
        sharded_with(module, optimizer)
    assert optimizer.param_groups[0]["params"] == before  # not re-pointed


def test_a_subclass_calling_its_parents_step_is_one_step(process_group: Any) -> None:
    """torch wraps every class's ``step`` with the hooks: ``super().step()`` in a subclass of a class that has an
    instance too runs the hooks twice, nested; only the outermost call gathers and scatters."""

    class Parent(torch.optim.SGD):
        pass

    class Child(Parent):
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            self.seen = [tuple(p.shape) for g in self.param_groups for p in g["params"] if p.grad is not None]
            return super().step(closure)

    Parent([nn.Parameter(torch.zeros(1))], lr=0.1)  # the parent class's step is hooked too now
    torch.manual_seed(0)
    plain = Net()
    expected = torch.optim.SGD(plain.parameters(), lr=0.1)
    module = copy.deepcopy(plain)
    optimizer = Child(module.parameters(), lr=0.1)
    model = sharded_with(module, optimizer, path="whole")
    train(plain, expected, 2)
    train(model.root, optimizer, 2)
    assert any(len(shape) == 2 for shape in optimizer.seen)  # whole matrices inside the step
    trained = model.state_dict(sharded=False, is_global_zero=True)
    for name, value in plain.state_dict().items():
        assert torch.allclose(trained[name], value, atol=1e-6), name
