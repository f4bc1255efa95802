"""The state of optimizers over FSDP-managed parameters, in the layout of a plain optimizer and in shards.

* :func:`consolidate_state` gathers the sharded optimizer state on rank 0 into the state dict a plain optimizer over
  the unwrapped module would have (one entry per original parameter, in the user's order), and
  :func:`load_plain_state` loads such a state dict into this rank's views, for any number of ranks.
* :func:`load_view_states` loads state from any other source of slices (a sharded checkpoint of any world size).
* :func:`describe_layout` and :func:`managed_positions`: how a sharded checkpoint records where each entry lives.

The optimizers were re-pointed to the views by :func:`lightning_fairscale.fsdp.state.optim.repoint_optimizer`; the
:class:`~lightning_fairscale.fsdp.state.optim.ParameterLayout` says where each original parameter went.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_fairscale.distributed import collectives
from lightning_fairscale.fsdp.state.optim import GroupOrder, ParameterLayout, Piece, managed_params
from lightning_fairscale.fsdp.unit.param_views import ParamView
from lightning_fairscale.fsdp.state.resharding import release_pages
from lightning_fairscale.fsdp.unit.units import fsdp_instances

__all__ = [
    "PIECES_KEY",
    "consolidate_state",
    "describe_layout",
    "load_plain_state",
    "load_view_states",
    "managed_positions",
    "plain_state_dict",
    "saved_states_by_piece",
]

#: In a managed parameter's consolidated state: the pieces that have state, when not all of them do (frozen ones).
PIECES_KEY = "lightning_fairscale_pieces"


def _hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """The param groups as ``state_dict()`` saves them, without their ``params``."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.state_dict()["param_groups"]]


def _is_elementwise(value: Any, like: Tensor) -> bool:
    return isinstance(value, Tensor) and value.shape == like.shape and value.dim() > 0


def _gather_full(shard: Tensor, numel: int, group: ProcessGroup | None) -> Tensor | None:
    """Concatenate every rank's shard on rank 0 and drop the padding; ``None`` on the other ranks.

    The shards may be in CPU memory (``cpu_offload``) where the backend takes CUDA tensors only (NCCL):
    :func:`~lightning_fairscale.distributed.collectives.gather` moves them for the transfer.
    """
    # The group's first rank: global rank 0, or under hybrid sharding the first rank of another replica.
    first = dist.get_global_rank(group, 0) if group is not None else 0
    gathered = collectives.gather(shard, dst=first, group=group)
    if gathered is None:
        return None
    return torch.cat([t.reshape(-1).cpu() for t in gathered])[:numel]


def _local_views(
    optimizer: Optimizer, layout: ParameterLayout
) -> dict[int, list[tuple[ParamView, dict[str, Any]]]]:
    """For each managed parameter (by id), this rank's views that ``optimizer`` holds, with their state."""
    found: dict[int, list[tuple[ParamView, dict[str, Any]]]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            managed, view = layout.view_of(param)
            found[id(managed)].append((view, optimizer.state.get(param, {})))
    return found


def _state_template(views: list[tuple[ParamView, dict[str, Any]]]) -> dict[str, Any]:
    """What every rank must know of a managed parameter's state to consolidate it: the pieces that have state, the
    element-wise keys with their dtypes, and the per-parameter values (``step``...)."""
    pieces: set[int] = set()
    elementwise: dict[str, torch.dtype] = {}
    values: dict[int, dict[str, Any]] = {}
    for view, state in views:
        if not state or view.start == view.stop:  # an empty view's state (if any) is no part of the whole
            continue
        pieces.add(view.piece)
        for key, value in state.items():
            if _is_elementwise(value, view.param):
                elementwise[key] = value.dtype
            else:
                # Per piece: the original parameters of one unit need not share them (Adam's `step` of a layer
                # frozen for a while lags behind the others').
                values.setdefault(view.piece, {}).setdefault(key, value)
    return {"pieces": pieces, "elementwise": elementwise, "values": values}


def _merge_templates(templates: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"pieces": set(), "elementwise": {}, "values": {}}
    for template in templates:
        merged["pieces"] |= template["pieces"]
        merged["elementwise"].update(template["elementwise"])
        for piece, values in template["values"].items():
            for key, value in values.items():
                merged["values"].setdefault(piece, {}).setdefault(key, value)
    return merged


def consolidate_state(optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder) -> dict[str, Any]:
    """The optimizer state of all ranks as one standard state dict on rank 0 (``{}`` elsewhere). A collective call.

    The result is what ``optimizer.state_dict()`` of a plain optimizer over the unwrapped module returns: entry ``i``
    belongs to the ``i``-th original parameter as the user listed them in ``configure_optimizers``, and parameters
    without state (frozen ones) have no entry. Each rank holds one managed parameter's state shard at a time.
    """
    params = managed_params(orders)
    if not params:
        return {"state": {}, "param_groups": _hyperparameters(optimizer)}
    unit = layout.managed[params[0]].unit  # every unit of the strategy shares one process group
    rank, group = unit.rank, unit.process_group
    local = _local_views(optimizer, layout)
    every_rank = collectives.all_gather_object([_state_template(local.get(id(p), [])) for p in params], group=group)
    full_states: list[dict[str, Any]] = []
    elementwise: list[set[str]] = []
    stateful: list[set[int]] = []
    piece_values: list[dict[int, dict[str, Any]]] = []
    for m, managed in enumerate(params):
        template = _merge_templates([templates[m] for templates in every_rank])
        numel = layout.managed[managed].numel
        full: dict[str, Any] = {}
        for key, dtype in sorted(template["elementwise"].items()):
            shard = torch.zeros(managed.data.numel(), dtype=dtype, device=managed.data.device)
            for view, state in local.get(id(managed), []):
                if key in state:
                    shard[view.start : view.stop].copy_(state[key])
            full[key] = _gather_full(shard, numel, group)
            del shard
        values = template["values"]
        if template["pieces"]:  # the first piece's, for the keys every state has (each piece's own below)
            full.update(values[min(values)] if values else {})
        full_states.append(full)
        piece_values.append(values)
        elementwise.append(set(template["elementwise"]))
        stateful.append(template["pieces"])
    if rank != 0:
        return {}
    position = {id(param): m for m, param in enumerate(params)}
    return plain_state_dict(
        full_states,
        [layout.managed[param].pieces for param in params],
        [[(position[id(managed)], k) for managed, k in order] for order in orders],
        _hyperparameters(optimizer),
        elementwise,
        stateful,
        piece_values,
    )


def describe_layout(optimizer: Optimizer, orders: GroupOrder, root: nn.Module, layout: ParameterLayout) -> dict:
    """Where the entries of this rank's ``optimizer.state_dict()`` live, in the terms of FairScale's
    ``local_metadata_dict``.

    Saved with each shard of a sharded checkpoint, so that the offline consolidation and resharding can rebuild any
    layout without the model: ``params[m] = (u, i)`` says that the ``m``-th managed parameter (:func:`managed_params`)
    is the ``i``-th parameter of the ``u``-th FSDP unit (in ``root.modules()`` order, as in FairScale's metadata);
    ``orders`` lists, for each param group, the ``(m, piece)`` of every original parameter in the user's order (both
    the same on every rank); ``views[j] = (m, piece, start, stop)`` says that entry ``j`` of this rank's state dict
    holds elements ``[start, stop)`` of this rank's shard of managed parameter ``m``.
    """
    params = managed_params(orders)
    position = {id(param): m for m, param in enumerate(params)}
    views = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            managed, view = layout.view_of(param)
            views.append((position[id(managed)], view.piece, view.start, view.stop))
    return {
        "params": managed_positions(params, root),
        "orders": [[(position[id(managed)], k) for managed, k in order] for order in orders],
        "views": views,
    }


def managed_positions(params: Sequence[nn.Parameter], root: nn.Module) -> list[tuple[int, int]]:
    """``(u, i)`` for each of ``params``: the ``i``-th parameter of the ``u``-th FSDP unit of ``root``
    (``root.modules()`` order). The same for the same model and wrapping on any number of processes, so that a
    sharded checkpoint's optimizer state can be matched to this run's."""
    in_unit = {id(param): (u, i) for u, unit in enumerate(fsdp_instances(root)) for i, param in enumerate(unit.params)}
    return [in_unit[id(param)] for param in params]


def plain_state_dict(
    full_states: Sequence[dict[str, Any]],
    pieces: Sequence[Sequence[Piece]],
    orders: Sequence[Sequence[tuple[int, int]]],
    groups: Sequence[dict[str, Any]],
    elementwise: Sequence[set[str]],
    stateful: Optional[Sequence[set[int]]] = None,
    piece_values: Optional[Sequence[dict[int, dict[str, Any]]]] = None,
) -> dict[str, Any]:
    """The state dict of a plain optimizer over the unwrapped module, from the unsharded state of each FSDP-managed
    parameter. Serves the online consolidation above and the offline one of sharded checkpoints.

    Args:
        full_states: for each managed parameter, in the optimizer's order, its state with the element-wise entries
            (``exp_avg``, ``momentum_buffer`` ...) as one flat tensor over the whole parameter, padding removed.
        pieces: for each managed parameter, the original parameters it holds.
        orders: for each param group, the ``(managed parameter index, piece index)`` of every original parameter, in
            the order the user listed them.
        groups: the optimizer's param groups as ``state_dict()`` saves them (their hyperparameters are kept).
        elementwise: for each managed parameter, the keys of its element-wise entries (the others are copied).
        stateful: for each managed parameter, the pieces that have state (default: all, when it has state); a
            :data:`PIECES_KEY` entry of its state says the same.
        piece_values: for each managed parameter, each piece's own per-parameter values (``step``...), which
            replace the state's (default: the state's, for every piece).
    """
    out_state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for group_saved, order in zip(groups, orders):
        indices = []
        for m, k in order:
            piece, state = pieces[m][k], full_states[m]
            with_state = stateful[m] if stateful is not None else state.get(PIECES_KEY, range(len(pieces[m])))
            if state and k in with_state:
                # Views into the gathered tensor, not copies: a copy per piece, made while every gathered tensor is
                # still alive, doubled rank 0's optimizer memory during a full save (20Ψ instead of 12Ψ with Adam).
                # torch.save writes a storage shared by several views once.
                out_state[index] = {
                    key: (
                        value[piece.offset : piece.offset + piece.numel].view(piece.shape)
                        if key in elementwise[m]
                        else copy.deepcopy(value)
                    )
                    for key, value in state.items()
                    if key != PIECES_KEY
                }
                if piece_values is not None:
                    own = piece_values[m].get(k, {})
                    out_state[index].update({key: copy.deepcopy(v) for key, v in own.items()})
            indices.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in group_saved.items() if k != "params"}, "params": indices})
    return {"state": out_state, "param_groups": out_groups}


# ----------------------------------------------------------------------------------------------------------------
# Loading state into this rank's views

#: Given a view's managed parameter, piece and the elements ``[start, stop)`` of the whole flat parameter it holds,
#: its state (element-wise entries as 1-D tensors of ``stop - start`` elements), or ``None`` when it has none.
ViewStateSource = Callable[[nn.Parameter, int, int, int], Optional[dict[str, Any]]]


def load_view_states(
    optimizer: Optimizer, layout: ParameterLayout, groups: Sequence[dict[str, Any]], source: ViewStateSource
) -> None:
    """Load each of this rank's views' state from ``source``, and the hyperparameters of ``groups`` (as
    ``state_dict()`` saves them), through ``optimizer.load_state_dict`` (which casts to each view's dtype/device).

    Raises:
        ValueError: ``groups`` has another number of param groups than the optimizer.
    """
    _check_group_count(groups, optimizer)
    out_state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for group, saved in zip(optimizer.param_groups, groups):
        first = index
        for param in group["params"]:
            managed, view = layout.view_of(param)
            empty = view.start == view.stop  # holds no element: no state, as a fresh one gets none
            state = None if empty else source(managed, view.piece, *layout.global_range(managed, view))
            if state:
                out_state[index] = state
            index += 1
        out_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(first, index))})
    optimizer.load_state_dict({"state": out_state, "param_groups": out_groups})


def saved_states_by_piece(
    full: dict[str, Any], optimizer: Optimizer, orders: GroupOrder
) -> dict[tuple[int, int], Any]:
    """The saved state of each original parameter of a full optimizer state dict ``full`` (the plain layout), by
    ``(id(managed), piece)``, in ``orders`` (each param group's original parameters, in the optimizer's order).

    Raises:
        ValueError: ``full`` was saved for other parameters or param groups.
    """
    saved_groups = full.get("param_groups", [])
    _check_group_count(saved_groups, optimizer)
    saved_state = full.get("state", {})
    by_piece: dict[tuple[int, int], Any] = {}
    for saved_group, order in zip(saved_groups, orders):
        if len(saved_group["params"]) != len(order):
            raise ValueError(
                f"A param group of the checkpoint's optimizer state holds {len(saved_group['params'])} parameters,"
                f" the optimizer's holds {len(order)}. The checkpoint was saved for a different model or optimizer."
            )
        by_piece.update(((id(managed), k), saved_state.get(i)) for (managed, k), i in zip(order, saved_group["params"]))
    return by_piece


def _check_group_count(groups: Sequence[Any], optimizer: Optimizer) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer state has {len(groups)} param groups but the optimizer has"
            f" {len(optimizer.param_groups)}. Resume with the optimizer configuration the checkpoint was saved with."
        )


def load_plain_state(full: dict[str, Any], optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder) -> None:
    """Load a standard optimizer state dict into this rank's views: each view reads only its slice.

    ``full`` may come from :func:`consolidate_state` on any number of ranks, or from a plain optimizer over the
    unwrapped module built the same way.

    Raises:
        ValueError: ``full`` was saved for other parameters or param groups.
    """
    by_piece = saved_states_by_piece(full, optimizer, orders)

    def source(managed: nn.Parameter, k: int, start: int, stop: int) -> Optional[dict[str, Any]]:
        state = by_piece.get((id(managed), k))
        if not state:
            return None
        piece = layout.managed[managed].pieces[k]
        start, stop = start - piece.offset, stop - piece.offset
        return {key: _slice_of_piece(key, value, piece, start, stop) for key, value in state.items()}

    load_view_states(optimizer, layout, full.get("param_groups", []), source)


def _slice_of_piece(key: str, value: Any, piece: Piece, start: int, stop: int) -> Any:
    """Elements ``[start, stop)`` of a plain state entry of ``piece`` when it is element-wise (its shape is the
    piece's: for a scalar piece, every entry but ``step``, torch's only per-parameter scalar); else a copy.

    A memory-mapped entry's pages are given back once the slice is copied, as the parameters' are: the file's pages
    stay resident for as long as the checkpoint lives, so keeping them held this rank's part of the whole saved
    optimizer state twice (copy and file) until loading ended."""
    if isinstance(value, Tensor) and value.shape == piece.shape and (piece.shape != torch.Size() or key != "step"):
        flat = value.reshape(-1)
        sliced = flat[start:stop].clone()
        release_pages(flat)
        return sliced
    if isinstance(value, Tensor) and value.dim() > 0:
        raise ValueError(f"The checkpoint's optimizer state '{key}' of {piece.name} does not match its shape.")
    return copy.deepcopy(value)
