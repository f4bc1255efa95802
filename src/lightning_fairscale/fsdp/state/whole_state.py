"""Checkpoints of an optimizer on the whole path: its state is whole-shaped, on each parameter's owner rank.

On the whole path (:mod:`~lightning_fairscale.fsdp.state.whole_step`) the owner of each original parameter keeps its
optimizer state whole (Adafactor's row and column factors, Muon's momentum matrix), the other ranks none. So:

* **full** checkpoints (:func:`consolidate`): the state a plain optimizer over the unwrapped module has is exactly
  the owners' states: rank 0 receives them one managed (flat) parameter at a time, nothing is cut or concatenated;
  loading one (:func:`load_plain`) gives each owner its parameters' entries whole. The layout is that of any plain
  optimizer, so a full checkpoint moves between the paths (an element-wise optimizer forced to the whole path reads
  and writes the same file) and between world sizes;
* **sharded** checkpoints: each rank writes its own ``optimizer.state_dict()`` (its owned parameters' whole states),
  and the layout beside it (:func:`~lightning_fairscale.fsdp.state.optim_state.describe_layout`) records the path and
  what it owns; loading (:func:`saved_source`), on any number of processes, each new owner takes a parameter's state
  from the saving rank that owned it (or, from a checkpoint of the element-wise path, its slices joined);
  the offline consolidation of such a directory is :func:`consolidate_saved`.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fairscale.distributed import collectives
from lightning_fairscale.fsdp.state.optim import GroupOrder, ParameterLayout, managed_params
from lightning_fairscale.fsdp.state.optim_state import load_plain_state, load_view_states, saved_states_by_piece
from lightning_fairscale.fsdp.state.whole_owners import WholePlan

__all__ = ["check_saved_path", "consolidate", "consolidate_saved", "load_plain", "saved_source"]


def _hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.state_dict()["param_groups"]]


def _on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in state.items()}


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a saved state entry: the optimizer must not share a tensor with the checkpoint (memory-mapped)."""
    return {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in state.items()}


def consolidate(optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder, plan: WholePlan) -> dict[str, Any]:
    """The state dict of a plain optimizer over the unwrapped module, on rank 0 (``{}`` elsewhere): each owner's
    whole-shaped states, sent to rank 0 one managed parameter at a time. A collective call of the shard group."""
    params = managed_params(orders)
    position = {id(param): m for m, param in enumerate(params)}
    owned: dict[int, dict[int, Any]] = defaultdict(dict)
    for piece in plan.owned():
        state = optimizer.state.get(piece.view.param)
        if state:
            owned[piece.m][piece.piece] = piece
    first = torch.distributed.get_global_rank(plan.group, 0) if plan.group is not None else 0
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for m in range(len(params)):
        mine = {k: _on_cpu(optimizer.state[p.view.param]) for k, p in owned.get(m, {}).items()}
        if plan.world == 1:
            everyone: Optional[list[Any]] = [mine]
        else:
            everyone = collectives.gather_object(mine, dst=first, group=plan.group)
        for states in everyone or []:
            for k, state in states.items():
                found[(m, k)] = state
        del mine
    if plan.rank != 0:
        return {}
    out_state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for saved, order in zip(_hyperparameters(optimizer), orders):
        indices = []
        for managed, k in order:
            state = found.get((position[id(managed)], k))
            if state:
                out_state[index] = state
            indices.append(index)
            index += 1
        out_groups.append({**saved, "params": indices})
    return {"state": out_state, "param_groups": out_groups}


def load_plain(
    full: dict[str, Any], optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder,
    plan: Optional[WholePlan],
) -> None:
    """Load a plain optimizer's state dict: on the element-wise path (``plan`` ``None``) each view reads its slice
    (:func:`~lightning_fairscale.fsdp.state.optim_state.load_plain_state`); on the whole path each owner reads its
    parameters' entries whole, the other ranks nothing.

    Raises:
        ValueError: ``full`` was saved for other parameters or param groups.
    """
    if plan is None:
        load_plain_state(full, optimizer, layout, orders)
        return
    by_piece = saved_states_by_piece(full, optimizer, orders)
    owned = _owned_keys(plan, orders)

    def source(managed: nn.Parameter, k: int, *_: Any) -> Optional[dict[str, Any]]:
        state = by_piece.get((id(managed), k))
        if not state or (id(managed), k) not in owned:
            return None
        shape = layout.managed[managed].pieces[k].shape
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == shape.numel() \
                    and value.shape != shape:
                raise ValueError(f"The checkpoint's optimizer state '{key}' of a parameter of shape {tuple(shape)}"
                                 f" has the shape {tuple(value.shape)}: it was saved for another model.")
        return _copied(state)

    load_view_states(optimizer, layout, full.get("param_groups", []), source)


def _owned_keys(plan: WholePlan, orders: GroupOrder) -> set[tuple[int, int]]:
    """``(id(managed), piece)`` of the parameters this rank owns."""
    params = managed_params(orders)
    return {(id(params[p.m]), p.piece) for p in plan.owned()}


def check_saved_path(saved_layout: dict[str, Any], plan: Optional[WholePlan], index: int) -> None:
    """A sharded checkpoint of the whole path holds whole-shaped states that the element-wise path cannot cut into
    slices of any meaning (Adafactor's factors): refused, saying what to do."""
    if saved_layout.get("path") == "whole" and plan is None:
        raise ValueError(
            f"The checkpoint's optimizer {index} was saved on the whole path (each parameter's state whole, on one"
            " rank), but this run's optimizer steps on the element-wise path (`optimizer_path=\"elementwise\"`)."
            " Resume with `optimizer_path=\"auto\"` (or \"whole\"), or consolidate the checkpoint into a full one"
            " (`lightning-fairscale-consolidate`), which loads on either path when the optimizer is element-wise."
        )


#: Given ``(m, piece, start, stop)`` of the whole flat parameter, a saved view's state (element-wise entries 1-D).
SliceSource = Callable[[int, int, int, int], Optional[dict[str, Any]]]


def saved_source(
    files: Callable[[int], dict[str, Any]], world_size: int, index: int, slices: SliceSource,
    pieces: Callable[[int, int], Any],
) -> Callable[[int, int], Optional[dict[str, Any]]]:
    """Where a whole-path optimizer finds the whole state of ``(m, piece)`` in a sharded checkpoint saved by
    ``world_size`` processes (``files(rank)``: a saving rank's shard dict), for its ``index``-th optimizer: the
    saving rank that owned it (any world size), or, from a checkpoint of the element-wise path, its slices
    (``slices``) joined and shaped as the parameter (``pieces(m, piece)``: its
    :class:`~lightning_fairscale.fsdp.state.optim.Piece`)."""
    if files(0)["optimizer_layouts"][index].get("path") != "whole":

        def joined(m: int, k: int) -> Optional[dict[str, Any]]:
            piece = pieces(m, k)
            state = slices(m, k, piece.offset, piece.offset + piece.numel)
            if not state:
                return None
            return {
                key: value.view(piece.shape)
                if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == piece.numel and key != "step"
                else value
                for key, value in state.items()
            }

        return joined
    found: dict[tuple[int, int], tuple[int, int]] = {}
    for rank in range(world_size):
        layout = files(rank)["optimizer_layouts"][index]
        owned = {tuple(key) for key in layout.get("owned", [])}
        for j, (m, k, _, _) in enumerate(layout["views"]):
            if (m, k) in owned:
                found[(m, k)] = (rank, j)

    def owned_state(m: int, k: int) -> Optional[dict[str, Any]]:
        if (m, k) not in found:
            return None
        rank, j = found[(m, k)]
        state = files(rank)["optimizer_states"][index]["state"].get(j)
        return _copied(state) if state else None

    return owned_state


def consolidate_saved(states: Sequence[dict[str, Any]], layouts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One whole-path optimizer's plain state dict from every saving rank's state and layout (the offline
    consolidation of a sharded checkpoint)."""
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for state, layout in zip(states, layouts):
        owned = {tuple(key) for key in layout.get("owned", [])}
        for j, (m, k, _, _) in enumerate(layout["views"]):
            entry = state["state"].get(j)
            if (m, k) in owned and entry:
                found[(m, k)] = entry
    out_state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for saved, order in zip(states[0]["param_groups"], layouts[0]["orders"]):
        indices = []
        for m, k in order:
            entry = found.get((int(m), int(k)))
            if entry:
                out_state[index] = entry
            indices.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": indices})
    return {"state": out_state, "param_groups": out_groups}
