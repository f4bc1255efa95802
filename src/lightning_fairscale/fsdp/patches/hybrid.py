"""Hybrid sharding: shard within a group of ranks (a node), replicate across groups (workaround 14 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`). The names and shapes a user gives, the process groups, and the
all-reduce of each gradient shard over its replicas.

The process groups of every layout (full sharding too), from the first stage that shards that way to the moment
nothing shards over them any more:

* :func:`sharding_groups` makes a layout's groups at a strategy's set-up (a collective call) and gives the same ones
  to every later set-up of that layout (another stage, another Trainer), as long as they live: FairScale's caches
  keyed by group (its reduce-scatter buckets) stay valid, and a run of many stages makes no new groups. Its registry
  is keyed by layout and holds them weakly (torch's own registry holds a group until it is destroyed).
* A sharded model's owner (:attr:`~lightning_fairscale.fsdp.unit.unit_state.RootState.groups`, set when the engine
  wraps the model) holds the groups its root shards over (:func:`hold`), and each layout counts its holders: a root
  kept sharded after a stage (``fit`` then ``validate``) shards over them in the later stages, and another model of
  the same layout (another Trainer, a second ``fabric.setup_module``) over the same ones. :func:`release_groups`, at a
  strategy's teardown, destroys the strategy's groups only when no owner holds them, and :func:`drop_groups`, when a
  root is unsharded (``unshard_module``), when the last holder lets go.
* Whatever is left (the groups of a root the user dropped without unsharding it, which a later set-up of the same
  layout reuses) is closed with the default group when the process exits
  (:mod:`lightning_fairscale.distributed.process_exit`).

Groups are destroyed only at these points, which every rank reaches alike (a teardown, an unsharding, the exit), and
by counts that change only at points every rank reaches alike (a wrap, an unsharding), never by what the garbage
collector has freed (whether a dropped model is still alive): destroying a group is local, and if one rank destroyed
groups another kept, the next :func:`sharding_groups` (``new_group``, a collective) would make new groups on one rank
only and hang. Destroying being local, a failed stage may do it too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fairscale.distributed import collectives

__all__ = [
    "ProcessGroups",
    "drop_groups",
    "hold",
    "hybrid_groups",
    "mesh_request",
    "release_groups",
    "replicate_gradient",
    "resolve_mesh",
    "sharding_groups",
    "sharding_name",
]


_SHARDING_NAMES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def sharding_name(sharding_strategy: Any) -> str:
    """The name of a ``sharding_strategy`` given as a string (any case) or as torch's ``ShardingStrategy``.

    Example:
        >>> from torch.distributed.fsdp import ShardingStrategy
        >>> sharding_name("hybrid_shard"), sharding_name(ShardingStrategy.SHARD_GRAD_OP)
        ('HYBRID_SHARD', 'SHARD_GRAD_OP')
    """
    name = getattr(sharding_strategy, "name", sharding_strategy)
    name = name.upper() if isinstance(name, str) else name
    if name == "NO_SHARD":
        raise ValueError(
            '`sharding_strategy="NO_SHARD"` keeps a full replica on every rank: that is plain data parallel, use'
            ' `strategy="ddp"` instead of `DDPFullyShardedStrategy`.'
        )
    if name not in _SHARDING_NAMES:
        raise ValueError(
            f"`sharding_strategy` must be one of {', '.join(map(repr, _SHARDING_NAMES))} (or torch's"
            f" `ShardingStrategy` of that name), got {sharding_strategy!r}."
        )
    return name


def mesh_request(name: str, device_mesh: Any) -> Any:
    """What shape the strategy shards over: ``None`` (every rank), ``"node"`` (hybrid: the ranks of each node), or
    ``(replicas, shard_size)`` from ``device_mesh`` (a tuple, or torch's 2-D ``DeviceMesh``).

    Example:
        >>> mesh_request("FULL_SHARD", None), mesh_request("HYBRID_SHARD", None), mesh_request("HYBRID_SHARD", (2, 4))
        (None, 'node', (2, 4))
    """
    hybrid = name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    if device_mesh is None:
        return "node" if hybrid else None
    if not hybrid:
        raise ValueError(
            f'`device_mesh` shapes hybrid sharding, but `sharding_strategy` is {name!r}: pass'
            ' `sharding_strategy="HYBRID_SHARD"` with it, or remove `device_mesh` to shard over every rank.'
        )
    shape = tuple(getattr(device_mesh, "shape", device_mesh)) if not isinstance(device_mesh, tuple) else device_mesh
    if len(shape) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(
            "`device_mesh` must be `(replicas, shard_size)`: two positive ints, e.g. `(2, 4)` for 2 nodes of 4"
            f" processes (each shards over its node's 4 and replicates across the 2 nodes), got {device_mesh!r}."
        )
    return shape


def resolve_mesh(request: Any, world_size: int, num_nodes: int) -> tuple[int, int]:
    """``(replicas, shard_size)`` for a :func:`mesh_request` other than ``None``, checked against the world size.

    Example:
        >>> resolve_mesh("node", 8, 2), resolve_mesh((2, 2), 4, 1)
        ((2, 4), (2, 2))
    """
    if request == "node":
        if world_size % num_nodes:
            raise ValueError(f"{world_size} processes do not split into {num_nodes} equal nodes for HYBRID_SHARD.")
        return num_nodes, world_size // num_nodes
    replicas, shard_size = request
    if replicas * shard_size != world_size:
        raise ValueError(
            f"`device_mesh=({replicas}, {shard_size})` holds {replicas * shard_size} processes, but the run has"
            f" {world_size} (`num_nodes` x `devices`): make `replicas * shard_size` equal {world_size}."
        )
    return replicas, shard_size


def hybrid_groups(
    mesh: tuple[int, int], rank: int, timeout: Optional[timedelta]
) -> tuple[Optional[ProcessGroup], Optional[ProcessGroup], Optional[ProcessGroup]]:
    """This rank's groups under hybrid sharding: its shard group twice (FSDP's all-gather and reduce-scatter
    groups) and its replica group. Ranks ``r * shard_size ...`` form replica ``r`` (consecutive ranks: a node's,
    under torchrun and SLURM), so a shard group never crosses a node and a replica group joins one rank per node.

    Every rank creates every group, in the same order (``new_group`` is collective over the world).
    """
    replicas, shard_size = mesh
    shard_groups = [list(range(r * shard_size, (r + 1) * shard_size)) for r in range(replicas)]
    replica_groups = [list(range(s, replicas * shard_size, shard_size)) for s in range(shard_size)]
    mine: list[Optional[ProcessGroup]] = [None, None, None]
    for slot, layouts in ((0, shard_groups), (1, shard_groups), (2, replica_groups)):
        for ranks in layouts:
            group = torch.distributed.new_group(ranks=ranks, timeout=timeout)
            if rank in ranks:
                mine[slot] = group
    return mine[0], mine[1], mine[2]


@torch.no_grad()
def replicate_gradient(reduced_grad: Tensor, replica_group: ProcessGroup) -> None:
    """Average a gradient shard over the replicas, in place (workaround 14). A collective call on ``replica_group``.

    Before this, ``reduced_grad`` is the sum of the shard group's gradients (FairScale divides it by the shard group's
    size afterwards): summing over the replicas and dividing by their number makes the average over every rank.
    """
    collectives.all_reduce(reduced_grad, group=replica_group)
    reduced_grad.div_(dist.get_world_size(replica_group))


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups for one run of FSDP, made by :func:`sharding_groups` (none before: FairScale then
    uses the default group).

    FSDP uses two groups, one for all-gathers and one for reduce-scatters, so that they can overlap on GPUs; under
    hybrid sharding both are this rank's shard group, and ``replica`` is its group of replicas (the ranks with the
    same shard index on every node), over ``mesh`` (``(replicas, shard_size)``).
    """

    all_gather: Optional[ProcessGroup] = None
    reduce_scatter: Optional[ProcessGroup] = None
    replica: Optional[ProcessGroup] = None
    mesh: Optional[tuple[int, int]] = None

    def sharding(self) -> list[ProcessGroup]:
        """The groups FSDP shards over (all-gather, then reduce-scatter), none before they are made."""
        return [group for group in (self.all_gather, self.reduce_scatter) if group is not None]

    def all(self) -> tuple[Optional[ProcessGroup], Optional[ProcessGroup], Optional[ProcessGroup]]:
        """``(all_gather, reduce_scatter, replica)``."""
        return self.all_gather, self.reduce_scatter, self.replica


@dataclass(eq=False)
class _Layout:
    """One layout's groups while they live, weakly (torch's own registry of groups holds them until they are
    destroyed), and how many sharded models' owners hold them (:func:`hold`, :func:`drop_groups`)."""

    refs: tuple[Optional[weakref.ref[ProcessGroup]], ...]
    holders: int = 0


#: Each layout's groups, by (world size, mesh, timeout).
_layouts: dict[tuple[int, Optional[tuple[int, int]], Optional[timedelta]], _Layout] = {}


def sharding_groups(
    mesh: Optional[tuple[int, int]], rank: int, world_size: int, timeout: Optional[timedelta]
) -> ProcessGroups:
    """This rank's groups for ``mesh`` (``None``: every rank in one group) in a world of ``world_size`` ranks (the
    strategy's: it knows it before, and without asking, the default group): the groups made for the same layout
    before, while they live, else new ones (:func:`hybrid_groups`, or two groups of every rank).

    A collective call when it makes groups: every rank calls it at the same point (a strategy's set-up), and all
    find the layout's groups alive or none does, since they are made and destroyed at the same points.
    """
    key = (world_size, mesh, timeout)
    layout = _layouts.get(key)
    groups = _alive(layout.refs, mesh) if layout is not None else None
    if groups is None:
        if mesh is None:  # two, so that all-gathers and reduce-scatters can overlap on GPUs
            groups = ProcessGroups(*(dist.new_group(timeout=timeout) for _ in range(2)))
        else:
            groups = ProcessGroups(*hybrid_groups(mesh, rank, timeout), mesh=mesh)
        _layouts[key] = _Layout(tuple(None if group is None else weakref.ref(group) for group in groups.all()))
    return groups


def hold(groups: ProcessGroups) -> None:
    """A sharded model's owner takes ``groups`` (when the engine wraps the model, on every rank): they outlive every
    strategy's teardown until each owner that took them lets go (:func:`drop_groups`). Groups this module did not
    make are not counted."""
    found = _layout_of(groups)
    if found is not None:
        found[1].holders += 1


def release_groups(groups: ProcessGroups) -> bool:
    """At a strategy's teardown: destroy ``groups`` (the strategy's) unless a sharded model's owner holds them (a
    root kept sharded for a later stage, this strategy's or another's: the same layout's set-ups share them). Returns
    whether they were destroyed. Groups this module did not make are left alone."""
    found = _layout_of(groups)
    if found is None or found[1].holders > 0:
        return False
    return _destroy(found[0])


def drop_groups(groups: Optional[ProcessGroups]) -> None:
    """An owner lets go of ``groups`` (its root is unsharded): destroyed once no owner holds them, if this module made
    them. Call it on every rank, when nothing of that model will run a collective on them any more."""
    found = _layout_of(groups)
    if found is not None:
        found[1].holders -= 1
        if found[1].holders <= 0:
            _destroy(found[0])


def _layout_of(
    groups: Optional[ProcessGroups],
) -> Optional[tuple[tuple[int, Optional[tuple[int, int]], Optional[timedelta]], _Layout]]:
    """The key and record of the layout whose groups ``groups`` are, ``None`` for groups this module did not make
    (or destroyed)."""
    if groups is None or groups.all_gather is None:
        return None
    for key, layout in _layouts.items():
        first = layout.refs[0] if layout.refs else None
        if first is not None and first() is groups.all_gather:
            return key, layout
    return None


def _destroy(key: tuple[int, Optional[tuple[int, int]], Optional[timedelta]]) -> bool:
    """Destroy the groups of the layout ``key``; whether they were still alive."""
    groups = _alive(_layouts.pop(key).refs, key[1])
    if groups is None:
        return False
    for group in groups.all():
        if group is not None:
            collectives.forget_group(group)
            dist.destroy_process_group(group)
    return True


def _alive(
    refs: tuple[Optional[weakref.ref[ProcessGroup]], ...], mesh: Optional[tuple[int, int]]
) -> Optional[ProcessGroups]:
    """The groups behind ``refs`` when they all still exist and none was destroyed, else ``None``."""
    groups = [None if ref is None else ref() for ref in refs]
    if not groups or any(ref is not None and group is None for ref, group in zip(refs, groups)):
        return None
    try:
        for group in groups:
            if group is not None:
                dist.get_backend(group)  # raises for a group torch no longer knows (destroyed, or its world)
    except (ValueError, RuntimeError):
        return None
    all_gather, reduce_scatter, replica = groups
    return ProcessGroups(all_gather, reduce_scatter, replica, mesh)
