"""Units whose forward does not run in a step (workaround 29, ``fsdp/unit/not_run.py``), in process: trained as
unsharded (no gradient, no update, no optimizer state for a unit that never ran; its state kept while it does not
run), also across an accumulation whose synchronising pass skips a unit the accumulating one ran.

Before workaround 29 each of these failed at its first backward with an ``AttributeError`` (``'FlatParameter' object
has no attribute '_fp32_shard'`` on two ranks); without the reduction of an accumulated gradient, the last one ends
off unsharded training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import Block
from torch import Tensor, nn

from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .helpers import (
    Net,
    assert_optimizer_states_equal,
    assert_tensors_equal,
    batches,
    parameters_of,
    run_ranks,
    shard,
)


class Skipping(Net):
    """``Net`` whose second Block runs only when asked."""

    def forward(self, x: Tensor, second: bool = True) -> Tensor:  # type: ignore[override]
        h = self.blocks[0](self.inp(x))
        return self.out(self.blocks[1](h) if second else h)


def adamw(params: Any) -> torch.optim.Optimizer:
    # Weight decay: a parameter given a zero gradient instead of none would move.
    return torch.optim.AdamW(params, lr=0.05, eps=1e-3, weight_decay=0.1)


def train_both(schedule: list[bool], clip: bool = False) -> Any:
    """AdamW on the sharded ``Skipping`` (each Block a unit) and on the plain one; the second Block runs in step ``i``
    when ``schedule[i]``."""
    model, reference = Skipping(), Skipping()
    sharded = shard(model, adamw(model.parameters()), policy={Block})
    plain = adamw(reference.parameters())
    for second, (x, y) in zip(schedule, batches(len(schedule))):
        for net, optimizer in ((sharded.root, sharded.optimizer), (reference, plain)):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x, second), y).backward()
        if clip:
            sharded_norm = sharded.root.clip_grad_norm_(0.05)
            plain_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.05)
            torch.testing.assert_close(sharded_norm, plain_norm, rtol=1e-6, atol=0)
        sharded.optimizer.step()
        plain.step()
    return sharded, reference, plain


@pytest.mark.usefixtures("process_group")
@pytest.mark.workaround(29)
def test_a_unit_that_never_runs_gets_no_gradient_no_update_and_no_state() -> None:
    sharded, reference, plain = train_both([False, False, False])
    for name, param in sharded.root.named_parameters():
        unused = name.startswith("blocks.1")
        assert (param.grad is None) == unused, name
        assert (param in sharded.optimizer.state) != unused, name
    assert_optimizer_states_equal(sharded.consolidate(), plain.state_dict())
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("clip", [False, True])
def test_a_unit_used_in_every_other_step_trains_as_unsharded(clip: bool) -> None:
    sharded, reference, plain = train_both([True, False, True, False, False], clip=clip)
    consolidated = sharded.consolidate()
    assert_optimizer_states_equal(consolidated, plain.state_dict())
    steps = {float(state["step"]) for state in consolidated["state"].values()}
    assert steps == {2.0, 5.0}, steps  # the second Block's state stood still while it did not run
    assert_tensors_equal(parameters_of(unwrap_module(sharded.root)), parameters_of(reference))


def _accumulate(rank: int, world_size: int) -> dict[str, Tensor]:
    """Two passes per step, the second Block in the first (accumulating, ``no_sync``) only; this rank's half of each
    batch; the parameters after the steps (unsharded)."""
    cpu_streams.install()  # FairScale on CPU (workarounds 1, 2)
    model = Skipping()
    sharded = shard(model, adamw(model.parameters()), policy={Block})
    data = batches(4)
    for step in range(2):
        for micro, second in enumerate((True, False)):
            x, y = data[2 * step + micro]
            xs, ys = x[rank::world_size], y[rank::world_size]
            context: Any = sharded.root.no_sync() if micro == 0 else torch.enable_grad()
            with context:
                (nn.functional.mse_loss(sharded.root(xs, second), ys) / 2).backward()
        sharded.optimizer.step()
        sharded.optimizer.zero_grad()
    return {k: v.clone() for k, v in parameters_of(unwrap_module(sharded.root)).items()}


@pytest.mark.workaround(29)
def test_a_unit_only_the_accumulating_pass_ran_has_its_gradient_reduced(tmp_path: Path) -> None:
    reference = Skipping()
    plain = adamw(reference.parameters())
    data = batches(4)
    for step in range(2):
        for micro, second in enumerate((True, False)):
            x, y = data[2 * step + micro]
            (nn.functional.mse_loss(reference(x, second), y) / 2).backward()
        plain.step()
        plain.zero_grad()
    for result in run_ranks(_accumulate, 2, tmp_path):
        assert_tensors_equal(result, parameters_of(reference), atol=1e-6)
