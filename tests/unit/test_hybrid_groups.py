"""The lifecycle of the strategies' process groups (``fsdp.patches.hybrid``): made once per layout, reused while they
live, kept by a root unit that stays sharded, destroyed at teardown or when the root is dropped. On a real one-rank gloo
world: with one rank every layout is ``(1, 1)``, and the groups are real groups torch makes and destroys."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_fairscale.distributed import collectives
from lightning_fairscale.fsdp.patches.hybrid import drop_groups_of, release_groups, sharding_groups

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


@pytest.mark.usefixtures("process_group")
def test_a_kept_root_owns_its_groups_until_it_is_dropped() -> None:
    groups = sharding_groups((1, 1), 0, 1, TIMEOUT)
    collectives.all_reduce(torch.ones(2), group=groups.replica)
    root = SimpleNamespace(process_group=groups.all_gather)  # a root unit kept sharded for the next stage
    assert not release_groups(groups.sharding(), [root, torch.nn.Linear(1, 1)])  # the strategy's teardown keeps them
    assert not any(_destroyed(group) for group in groups.all())
    assert sharding_groups((1, 1), 0, 1, TIMEOUT) == groups  # the next stage reuses them
    drop_groups_of(root)  # unshard_module
    assert all(_destroyed(group) for group in groups.all())
    assert collectives.all_reduced_bytes(groups.replica) == 0  # forgotten: nothing refers to it any more
    again = sharding_groups((1, 1), 0, 1, TIMEOUT)
    assert not set(map(id, again.all())) & set(map(id, groups.all()))  # a later set-up makes new ones


@pytest.mark.usefixtures("process_group")
def test_teardown_destroys_the_groups_no_root_holds_and_only_those_made_here() -> None:
    groups = sharding_groups(None, 0, 1, TIMEOUT)
    assert release_groups(groups.sharding(), [SimpleNamespace(process_group=None)])
    assert all(_destroyed(group) for group in groups.sharding())
    assert not release_groups(groups.sharding(), [])  # twice: nothing left to destroy
    foreign = dist.new_group()
    assert not release_groups([foreign], []) and not _destroyed(foreign)
    drop_groups_of(SimpleNamespace(process_group=foreign))
    assert not _destroyed(foreign)
