"""The lifecycle of the strategies' process groups (``fsdp.patches.hybrid``): made once per layout, reused while they
live, held by the owner of each model the engine wraps over them, kept at teardown while an owner holds them,
destroyed at teardown otherwise, when the last model holding them is unsharded, or at exit. On a real one-rank gloo
world (with one rank every layout is ``(1, 1)``, and the groups are real groups torch makes and destroys), and on two
forked ranks for what another model of the same layout does with them."""

from __future__ import annotations

import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel as FairScaleFSDP
from torch import nn

from lightning_fairscale.distributed import collectives, process_exit
from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.model import WrappedModel
from lightning_fairscale.fsdp.patches import cpu_streams, hybrid
from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups, sharding_groups
from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.unit import unit_state
from lightning_fairscale.fsdp.unit.instances import fsdp_instances
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel

from .helpers import Block, Net, fsdp_kwargs, run_ranks

TIMEOUT = timedelta(seconds=30)


def _destroyed(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_backend(group)
    except ValueError:
        return True
    return False


@pytest.mark.usefixtures("process_group")
def test_each_layout_makes_its_groups_once_and_every_later_set_up_reuses_them() -> None:
    full, hybrid = sharding_groups(None, 0, 1, TIMEOUT), sharding_groups((1, 1), 0, 1, TIMEOUT)
    assert full.replica is None and hybrid.replica is not None
    assert len({id(group) for group in [*full.sharding(), *hybrid.all()]}) == 5  # every group its own
    assert sharding_groups(None, 0, 1, TIMEOUT) == full and sharding_groups((1, 1), 0, 1, TIMEOUT) == hybrid
    assert sharding_groups(None, 0, 1, timedelta(seconds=31)) != full  # another timeout: other groups
    tensor = torch.ones(3)
    collectives.all_reduce(tensor, group=hybrid.replica)  # usable
    assert tensor.tolist() == [1.0, 1.0, 1.0]


def _wrap(config: FullyShardedConfig, model: nn.Module) -> tuple[ProcessGroups, WrappedModel]:
    """``model`` wrapped as a strategy's set-up wraps it, over the groups of the strategy's set-up."""
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=TIMEOUT)
    return groups, fsdp_engine.wrap_model(config, model, torch.device("cpu"), groups, "32-true", None, [], None)


@pytest.mark.usefixtures("process_group")
def test_the_owner_holds_the_groups_its_root_shards_over() -> None:
    groups, wrapped = _wrap(FullyShardedConfig(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD"), Net())
    owner = unit_state.owner_of(wrapped.root)
    assert owner.groups == groups and groups.replica is not None
    units = list(fsdp_instances(wrapped.root))
    assert len(units) == 3 and all(unit_state.peek_owner(unit) is owner for unit in units)
    # What FairScale's units were given (read here only to check that the owner tells the truth).
    assert all(unit.process_group is groups.all_gather for unit in units)
    assert all(unit.process_group_reduce_scatter is groups.reduce_scatter for unit in units)


@pytest.mark.usefixtures("process_group")
def test_teardown_keeps_the_groups_a_kept_roots_owner_holds_until_it_is_unsharded() -> None:
    config = FullyShardedConfig(auto_wrap_policy={Block})
    groups, wrapped = _wrap(config, Net())
    collectives.all_reduce(torch.ones(2), group=groups.all_gather)
    assert not hybrid.release_groups(groups)  # the strategy's teardown: its root is kept for the next stage
    assert not any(_destroyed(group) for group in groups.sharding())
    assert fsdp_engine.make_process_groups(config, 0, 1, 1, TIMEOUT) == groups  # the next stage reuses them
    assert not hybrid.release_groups(groups)  # and its teardown keeps them again
    wrapped.unshard(keep=True)  # `unshard_module`: the owner lets go, the last one: the groups go
    assert all(_destroyed(group) for group in groups.sharding())
    assert unit_state.owner_of(wrapped.root).groups is None
    assert collectives.all_reduced_bytes(groups.all_gather) == 0  # forgotten: nothing refers to it any more
    again = fsdp_engine.make_process_groups(config, 0, 1, 1, TIMEOUT)
    assert not set(map(id, again.sharding())) & set(map(id, groups.sharding()))  # a later set-up makes new ones
    assert hybrid.release_groups(again)  # the unsharded root holds none


@pytest.mark.usefixtures("process_group")
def test_only_the_owners_of_models_the_engine_wrapped_over_the_groups_keep_them() -> None:
    """A root the engine never set up (wrapped by hand, in FairScale's class or ours) holds none, though its units were
    built over the strategy's groups; nor does a root of ours wrapped by hand over other groups and given to
    ``wrap_model`` (it keeps its own)."""
    config = FullyShardedConfig()
    groups, other = _wrap(config, Net())
    layout = fsdp_engine.make_process_groups(config, 0, 1, 1, timedelta(seconds=31))  # another layout
    kwargs = fsdp_kwargs(process_group=layout.all_gather, process_group_reduce_scatter=layout.reduce_scatter)
    by_hand = FairScaleFSDP(Net(), **kwargs)
    ours_by_hand = FullyShardedDataParallel(Net(), **kwargs)  # never set up: no owner
    fsdp_engine.finish_wrapping(ours_by_hand, ParameterLayout().after_wrapping(ours_by_hand))  # an owner, no groups
    assert unit_state.owner_of(ours_by_hand).groups is None
    over_default = FullyShardedDataParallel(Net(), **fsdp_kwargs())  # built over the default group, then set up
    kept = fsdp_engine.wrap_model(config, over_default, torch.device("cpu"), layout, "32-true", None, [], None)
    assert kept.root is over_default and unit_state.owner_of(over_default).groups is None
    assert hybrid.release_groups(layout)
    assert all(_destroyed(group) for group in layout.sharding())
    assert not any(_destroyed(group) for group in groups.sharding())  # the set-up root's, kept
    assert by_hand is not None and other.root is not None


@pytest.mark.usefixtures("process_group")
def test_only_the_groups_made_here_are_destroyed_and_only_once() -> None:
    groups = sharding_groups(None, 0, 1, TIMEOUT)
    assert hybrid.release_groups(groups)
    assert all(_destroyed(group) for group in groups.sharding())
    assert not hybrid.release_groups(groups)  # twice: nothing left to destroy
    hybrid.drop_groups(groups)
    hybrid.drop_groups(None)
    assert not hybrid.release_groups(ProcessGroups())  # none made (FairScale's default group): nothing to do
    foreign = ProcessGroups(dist.new_group(), dist.new_group())
    hybrid.hold(foreign)
    assert not hybrid.release_groups(foreign) and not any(map(_destroyed, foreign.sharding()))
    hybrid.drop_groups(foreign)
    assert not any(map(_destroyed, foreign.sharding()))


def _two_models(rank: int, world_size: int) -> list[str]:
    """Two models of one layout (two Trainers, or two ``fabric.setup_module``), over the same groups: a strategy's
    teardown with no model of its own, then the first model unsharded; the second trains after each."""
    cpu_streams.install()
    config = FullyShardedConfig(auto_wrap_policy={Block})
    models = []
    for _ in range(2):
        groups = fsdp_engine.make_process_groups(config, rank, world_size, 1, TIMEOUT)
        models.append(fsdp_engine.wrap_model(config, Net(), torch.device("cpu"), groups, "32-true", None, [], None))
    first, second = models
    assert unit_state.owner_of(first.root).groups == unit_state.owner_of(second.root).groups
    results = []
    for event in ("teardown", "unshard"):
        if event == "teardown":  # a third set-up whose run failed before wrapping (or whose model was dropped)
            third = fsdp_engine.make_process_groups(config, rank, world_size, 1, TIMEOUT)
            results.append(f"destroyed: {hybrid.release_groups(third)}")
        else:
            first.unshard(keep=True)  # `unshard_module(first)`, on every rank
        try:
            second.root(torch.randn(3, 3)).sum().backward()
            results.append("trains")
        except Exception as error:  # noqa: BLE001 (what a broken group raises, on both ranks)
            results.append(repr(error)[:200])
    groups = unit_state.owner_of(second.root).groups
    second.unshard(keep=True)  # the last holder: now they go
    results.append(f"destroyed at last: {groups is not None and all(_destroyed(g) for g in groups.sharding())}")
    return results


def test_another_models_teardown_or_unsharding_leaves_a_model_over_the_same_groups_working(tmp_path: Path) -> None:
    expected = ["destroyed: False", "trains", "trains", "destroyed at last: True"]
    assert run_ranks(_two_models, 2, tmp_path, timeout=60) == [expected, expected]


def test_exit_drops_the_owners_reference_to_its_groups(
    process_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At exit the owner, like the units, lets go of its groups: a model the user keeps to the end (a module-level
    variable) must not keep gloo's threads alive into the interpreter's finalization (see ``process_exit``)."""
    for name, value in (("_strategies", weakref.WeakSet()), ("_holders", weakref.WeakSet()), ("_groups", [])):
        monkeypatch.setattr(process_exit, name, value)  # only this test's records (the handler runs again at exit)
    monkeypatch.setattr(process_exit, "_default", None)
    groups, wrapped = _wrap(FullyShardedConfig(), Net())
    owner = unit_state.owner_of(wrapped.root)
    assert owner.groups == groups
    process_exit._close_process_groups()
    assert owner.groups is None and all(_destroyed(group) for group in groups.sharding())
    assert dist.is_initialized()  # the default group was there before: it stays
