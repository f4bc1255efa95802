"""What the strategies change of torch, FairScale and Lightning, and how it is undone, in-process: the CPU workarounds
held by the wrapped models that need them, the process groups and FairScale objects recorded for the exit handling,
the model summary hooks, and the checkpoint wrappers.

(The same seen from a training run, after ``fit`` and teardown, is ``tests/test_process_exit.py``.)
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelSummary
from torch import nn

from lightning_fairscale.callbacks.model_summary import restore_model_summaries, use_for_model_summaries
from lightning_fairscale.distributed import process_exit
from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp.wrapping.activation_checkpointing import (
    CheckpointedForward,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

from .helpers import Block, Net

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU workarounds are not installed where CUDA is")


def record_stream_on_cpu() -> bool:
    """Whether CPU tensors have a ``record_stream`` kernel (PyTorch has none)."""
    try:
        torch.ones(1).record_stream(torch.Stream(device="cpu"))
    except NotImplementedError:
        return False
    return True


class Wrapped(nn.Module):
    """Stands for a wrapped model: what the hold looks at is where it computes."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.compute_device = torch.device(device)


@pytest.fixture
def unheld(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``cpu_streams`` as in a process that never held the workarounds; as it was again afterwards (other tests pin
    them with ``install()``)."""
    installed = cpu_streams.is_installed()
    if installed:
        cpu_streams._set_installed(False)
    monkeypatch.setattr(cpu_streams, "_holds", 0)
    monkeypatch.setattr(cpu_streams, "_pinned", False)
    yield
    if cpu_streams.is_installed() != installed:
        cpu_streams._set_installed(installed)


@no_cuda
@pytest.mark.usefixtures("unheld")
def test_the_cpu_workarounds_last_as_long_as_a_model_that_needs_them() -> None:
    assert fsdp_module.torch is torch and not record_stream_on_cpu()
    first, second = Wrapped("cpu"), Wrapped("cpu")
    hold = cpu_streams.hold_while_alive(first)  # one per model: its owner keeps it
    cpu_streams.hold_while_alive(second)
    assert cpu_streams.is_installed() and record_stream_on_cpu()
    cpu_streams.release(hold)
    assert cpu_streams.is_installed()  # the second model still needs them
    del second
    gc.collect()
    assert fsdp_module.torch is torch and not record_stream_on_cpu()  # as if never installed
    cpu_streams.release(hold)  # released already: nothing happens
    assert cpu_streams._holds == 0


@no_cuda
@pytest.mark.usefixtures("unheld")
def test_installed_again_after_being_undone_and_pinned_by_install() -> None:
    model = Wrapped("cpu")
    cpu_streams.release(cpu_streams.hold_while_alive(model))
    assert cpu_streams.hold_while_alive(Wrapped("meta")) is None  # computes elsewhere: nothing to hold
    assert not cpu_streams.is_installed()
    cpu_streams.install()
    cpu_streams.install()
    cpu_streams.release(cpu_streams.hold_while_alive(model))
    assert cpu_streams.is_installed() and record_stream_on_cpu() and cpu_streams._holds == 1  # install()'s, for good


class Holder:
    """A FairScale-like object that keeps process groups as attributes."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.groups = (group, group)
        self.buckets = {(torch.float32, group): "bucket"}
        self.rank = 0


@pytest.fixture
def fresh_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """``process_exit`` with nothing recorded (the handler is called by the tests, and again at exit)."""
    monkeypatch.setattr(process_exit, "_strategies", weakref.WeakSet())
    monkeypatch.setattr(process_exit, "_holders", weakref.WeakSet())
    monkeypatch.setattr(process_exit, "_groups", [])
    monkeypatch.setattr(process_exit, "_default", None)


def all_reduce_works(group: Any = None) -> bool:
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=group)
    return tensor.item() == 1.0


@pytest.mark.usefixtures("fresh_records")
def test_exit_closes_only_what_was_recorded_and_leaves_the_users_default_group(
    process_group: dist.ProcessGroup,
) -> None:
    """The default group exists before the strategy's set-up: it is the user's. The strategy's own group goes, and
    the references its objects hold; an object the strategy did not make is left alone (nothing is searched for)."""
    strategy, ours, users = Holder(None), Holder(None), Holder(process_group)
    before = process_exit.default_group()
    assert before is process_group
    process_exit.close_process_group_at_exit(strategy, before)  # the set-up found the group there
    group = dist.new_group()
    strategy.group = group
    ours.group, ours.groups, ours.buckets = group, (group,), {(torch.float32, group): "bucket"}
    process_exit.record_groups(group, None)
    process_exit.release_at_exit(ours)
    process_exit._close_process_groups()
    assert dist.is_initialized() and all_reduce_works()  # the user's default group still works
    with pytest.raises(ValueError, match="Invalid process group"):
        dist.destroy_process_group(group)  # destroyed already
    assert strategy.group is None and ours.group is None and ours.groups == () and ours.buckets == {}
    assert ours.rank == 0
    assert users.group is process_group and users.groups == (process_group,) * 2 and users.buckets


@pytest.mark.usefixtures("fresh_records")
def test_exit_destroys_the_default_group_that_a_strategy_created() -> None:
    assert not dist.is_initialized()
    strategy = Holder(None)
    before = process_exit.default_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # as Lightning's set-up does
    try:
        process_exit.close_process_group_at_exit(strategy, before)
        strategy.group = process_exit.default_group()
        process_exit._close_process_groups()
        assert not dist.is_initialized() and strategy.group is None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DeeperSummary(ModelSummary):
    """A summary callback of the user's (as ``RichModelSummary`` is one of Lightning's)."""


def test_model_summary_hooks_are_restored_and_a_foreign_hook_stays() -> None:
    mine = ModelSummary()
    trainer = Trainer(callbacks=[DeeperSummary(max_depth=2), mine], logger=False, enable_checkpointing=False)
    callbacks = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert len(callbacks) == 2
    use_for_model_summaries(trainer)
    assert all("_summary" in vars(callback) for callback in callbacks)
    restore_model_summaries(trainer)
    assert not any("_summary" in vars(callback) for callback in callbacks)
    assert mine._summary.__func__ is ModelSummary._summary  # Lightning's own method again

    def users_hook(*args: Any) -> None:
        return None

    mine._summary = users_hook  # type: ignore[method-assign]
    use_for_model_summaries(trainer)
    restore_model_summaries(trainer)
    restore_model_summaries(None)  # the stage failed before the module was attached
    assert vars(mine)["_summary"] is users_hook


def test_checkpoint_wrappers_are_removed_by_their_mark_and_a_users_forward_stays() -> None:
    model = Net()
    own_forward = model.blocks[1].forward
    model.blocks[1].forward = own_forward  # type: ignore[method-assign]  # a forward of the user's own
    assert apply_activation_checkpointing(model, (Block,)) == [model.blocks[0]]
    remove_activation_checkpointing(model)  # finds them itself: any strategy (or Trainer) can unwrap
    assert "forward" not in vars(model.blocks[0]) and vars(model.blocks[1])["forward"] == own_forward
    assert not any(isinstance(vars(m).get("forward"), CheckpointedForward) for m in model.modules())
