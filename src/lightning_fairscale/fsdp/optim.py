"""Optimizers over FSDP-managed parameters: re-pointing them, and their state in a standard layout.

FSDP replaces a unit's parameters by one flat, sharded parameter per unit (or shards each parameter in place with
``flatten_parameters=False``). This module keeps the user's optimizer faithful to that:

* :class:`ParameterLayout` records which slice of which FSDP-managed parameter holds each original parameter.
* :func:`repoint_optimizer` changes an optimizer created over the original parameters (``self.parameters()``) to
  hold the FSDP-managed ones instead, in place, so its class, hyperparameters, param groups and LR schedulers stay
  as the user made them.
* :func:`consolidate_state` gathers the sharded optimizer state on rank 0 into the state dict a plain optimizer over
  the unwrapped module would have (one entry per original parameter, in the user's order), and
  :func:`shard_state` turns such a state dict back into this rank's shard, for any number of ranks.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Optional

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fairscale import collectives
from lightning_fairscale.fsdp.fairscale_cpu import fsdp_instances, named_fsdp_instances
from lightning_fairscale.fsdp.resharding import copy_overlaps, local_range
from lightning_fairscale.fsdp.wrapping import clean_path

__all__ = [
    "ParameterLayout",
    "Piece",
    "consolidate_state",
    "describe_layout",
    "managed_positions",
    "plain_state_dict",
    "repoint_optimizer",
    "repoint_to_unwrapped",
    "shard_state",
]


@dataclass(frozen=True)
class Piece:
    """One original parameter inside an FSDP-managed parameter: ``managed.full[offset:offset+numel].view(shape)``."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class _Managed:
    unit: _FairScaleFSDP
    pieces: list[Piece]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


@dataclass
class ParameterLayout:
    """Where each original parameter lives after wrapping.

    Build it with :meth:`before_wrapping` on the unwrapped module, then :meth:`after_wrapping` on the root unit;
    :meth:`forget_originals` once the optimizers hold the managed parameters.

    The original parameters are known by ``id`` only: a reference would keep the whole unsharded model alive, next
    to its shards, for as long as the layout lives (the whole ``fit``). While the ids are looked up, the optimizers
    created on the unwrapped module still hold the originals, so the ids cannot have been reused.
    """

    _owners: dict[tuple[int, str], int] = field(default_factory=dict)
    managed: dict[nn.Parameter, _Managed] = field(default_factory=dict)
    _original: dict[int, tuple[nn.Parameter, int]] = field(default_factory=dict)
    #: The root unit the layout describes.
    root: Optional[nn.Module] = None
    #: Position of each parameter in ``module.parameters()`` before wrapping, by id (until :meth:`after_wrapping`).
    _positions: dict[int, int] = field(default_factory=dict)
    #: ``(id(managed), piece)`` -> where the unwrapped module lists that original parameter (:meth:`in_module_order`).
    _module_order: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def before_wrapping(cls, module: nn.Module) -> ParameterLayout:
        layout = cls()
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None and not hasattr(param, "_is_sharded"):
                    layout._owners[(id(owner), name)] = id(param)
        layout._positions = {id(param): i for i, param in enumerate(module.parameters())}
        return layout

    def after_wrapping(self, root: nn.Module) -> ParameterLayout:
        self.root = root
        for path, unit in named_fsdp_instances(root):
            prefix = clean_path(path + ".") if path else ""
            flat_count = unit._num_flatten_params
            for managed in unit.params[:flat_count]:
                pieces, offset = [], 0
                for (module_name, owner, name), numel, shape in zip(
                    managed._param_infos, managed._param_numels, managed._param_shapes
                ):
                    key = clean_path(f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}")
                    pieces.append(Piece(key, offset, numel, torch.Size(shape)))
                    original = self._owners.get((id(owner), name))
                    if original is not None:
                        self._original[original] = (managed, len(pieces) - 1)
                    self._note_position(managed, len(pieces) - 1, original)
                    offset += numel
                self.managed[managed] = _Managed(unit, pieces)
            for managed, names in zip(unit.params[flat_count:], unit._param_name_groups[flat_count:]):
                shape = torch.Size(managed._orig_size)
                self.managed[managed] = _Managed(unit, [Piece(prefix + clean_path(names[0]), 0, shape.numel(), shape)])
                # Sharded in place: the original itself, unless the unit replaced a meta one when materialising it.
                owner_path, _, name = names[0].rpartition(".")
                owner = unit.module.module.get_submodule(owner_path)
                original = self._owners.get((id(owner), name), id(managed))
                self._original[original] = (managed, 0)
                self._note_position(managed, 0, original)
        self._owners.clear()
        self._positions.clear()
        return self

    def _note_position(self, managed: nn.Parameter, piece: int, original: Optional[int]) -> None:
        if original in self._positions:  # wrapped now: where the module listed the original parameter
            self._module_order[(id(managed), piece)] = (self._positions[original], 0)  # type: ignore[index]
        elif id(managed) in self._positions:  # wrapped before (manual wrap): where the module listed the unit's
            self._module_order[(id(managed), piece)] = (self._positions[id(managed)], piece)

    def in_module_order(self, order: list[tuple[nn.Parameter, int]]) -> list[tuple[nn.Parameter, int]]:
        """``order`` (one param group's pieces) sorted as ``module.parameters()`` listed them before wrapping.

        For an optimizer created over the FSDP-managed parameters, which have no order of the original parameters of
        their own: with this order its state dict is that of a plain optimizer over ``module.parameters()``, as one
        created before wrapping would have. Pieces of unknown position (layouts not built with
        :meth:`before_wrapping`) keep their place relative to each other, after the known ones.
        """
        unknown = (len(self._module_order), 0)
        return sorted(order, key=lambda located: self._module_order.get((id(located[0]), located[1]), unknown))

    def forget_originals(self) -> None:
        """Stop answering for the original parameters (freed once no optimizer holds them, so their ids may be
        reused); :meth:`locate` then knows the managed parameters only."""
        self._original.clear()

    def locate(self, param: nn.Parameter) -> list[tuple[nn.Parameter, int]]:
        """The (managed parameter, piece index) pairs that ``param`` stands for; empty when FSDP does not manage it."""
        if param in self.managed:
            return [(param, k) for k in range(len(self.managed[param].pieces))]
        found = self._original.get(id(param))
        return [found] if found is not None else []


#: For each param group, the pieces in the order the user listed the original parameters.
GroupOrder = list[list[tuple[nn.Parameter, int]]]


def repoint_optimizer(optimizer: Optimizer, layout: ParameterLayout) -> GroupOrder:
    """Make ``optimizer`` hold the FSDP-managed parameters instead of the original ones, in place.

    Raises:
        ValueError: the optimizer holds a parameter FSDP does not manage, or splits one flat parameter between param
            groups or leaves part of it out (its slices cannot get different hyperparameters).
    """
    orders: GroupOrder = []
    group_of: dict[nn.Parameter, int] = {}
    covered: dict[nn.Parameter, set[int]] = defaultdict(set)
    for index, group in enumerate(optimizer.param_groups):
        order: list[tuple[nn.Parameter, int]] = []
        new_params: list[nn.Parameter] = []
        for param in group["params"]:
            located = layout.locate(param)
            if not located:
                raise ValueError(
                    f"The optimizer {type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} that is"
                    " not part of the LightningModule, so FSDP does not shard or update it. Create the optimizer in"
                    " `configure_optimizers` from `self.parameters()` (or `self.trainer.model.parameters()`), and keep"
                    " every trained module an attribute of the LightningModule."
                )
            for managed, piece in located:
                if group_of.setdefault(managed, index) != index:
                    raise ValueError(_split_message(layout, managed, "is split between param groups"))
                if not any(managed is p for p in new_params):
                    new_params.append(managed)
                covered[managed].add(piece)
                order.append((managed, piece))
        group["params"] = new_params
        orders.append(order)
    for managed, pieces in covered.items():
        if len(pieces) != len(layout.managed[managed].pieces):
            raise ValueError(_split_message(layout, managed, "is only partly in the optimizer"))
    optimizer.state = defaultdict(dict)
    return orders


def repoint_to_unwrapped(
    optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder, parameters: dict[str, nn.Parameter]
) -> None:
    """Undo :func:`repoint_optimizer` after unwrapping: each group holds the module's parameters again, in the
    order the user listed them. ``parameters`` maps the unwrapped module's parameter names to parameters."""
    for group, order in zip(optimizer.param_groups, orders):
        group["params"] = [parameters[layout.managed[managed].pieces[k].name] for managed, k in order]
    optimizer.state = defaultdict(dict)


def _split_message(layout: ParameterLayout, managed: nn.Parameter, problem: str) -> str:
    names = ", ".join(p.name for p in layout.managed[managed].pieces)
    return (
        f"The flattened FSDP parameter holding [{names}] {problem}. With `flatten_parameters=True` all parameters"
        " of one FSDP unit are a single tensor and must share one param group. Put them in the same group, make"
        " the layers that need other hyperparameters their own units (`auto_wrap_policy`), or pass"
        " `DDPFullyShardedStrategy(flatten_parameters=False)`."
    )


def _is_elementwise(value: Any, like: Tensor) -> bool:
    return isinstance(value, Tensor) and value.shape == like.shape and value.dim() > 0


def _gather_full(shard: Tensor, numel: int, group: Any) -> Tensor | None:
    """Concatenate every rank's shard on rank 0 and drop the padding; ``None`` on the other ranks.

    The shards may be in CPU memory (``cpu_offload``) where the backend takes CUDA tensors only (NCCL):
    :func:`~lightning_fairscale.collectives.gather` moves them for the transfer.
    """
    gathered = collectives.gather(shard, dst=0, group=group)
    if gathered is None:
        return None
    return torch.cat([t.reshape(-1).cpu() for t in gathered])[:numel]


def consolidate_state(optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder) -> dict[str, Any]:
    """The optimizer state of all ranks as one standard state dict on rank 0 (``{}`` elsewhere). A collective call.

    The result is what ``optimizer.state_dict()`` of a plain optimizer over the unwrapped module returns: entry ``i``
    belongs to the ``i``-th original parameter as the user listed them in ``configure_optimizers``.
    """
    saved = optimizer.state_dict()
    managed_params = [p for group in optimizer.param_groups for p in group["params"]]
    unit = layout.managed[managed_params[0]].unit  # every unit of the strategy shares one process group
    rank, group = unit.rank, unit.process_group
    _check_same_state_keys(optimizer, managed_params, group)

    full_states: list[dict[str, Any]] = []
    elementwise: list[set[str]] = []
    for param in managed_params:
        state = optimizer.state.get(param, {})
        keys = {key for key, value in state.items() if _is_elementwise(value, param)}
        full_states.append(
            {
                key: _gather_full(value, layout.managed[param].numel, group) if key in keys else value
                for key, value in sorted(state.items())
            }
        )
        elementwise.append(keys)
    if rank != 0:
        return {}
    position = {param: m for m, param in enumerate(managed_params)}
    return plain_state_dict(
        full_states,
        [layout.managed[param].pieces for param in managed_params],
        [[(position[managed], k) for managed, k in order] for order in orders],
        saved["param_groups"],
        elementwise,
    )


def describe_layout(optimizer: Optimizer, orders: GroupOrder, root: nn.Module) -> dict[str, Any]:
    """Where the entries of ``optimizer.state_dict()`` live, in the terms of FairScale's ``local_metadata_dict``.

    Saved with each shard of a sharded checkpoint, so that the offline consolidation can rebuild the plain layout
    without the model: ``params[m] = (u, i)`` says that the optimizer's ``m``-th parameter is the ``i``-th parameter
    of the ``u``-th FSDP unit (in ``root.modules()`` order, as in FairScale's metadata), and ``orders`` lists, for
    each param group, the ``(m, piece)`` of every original parameter in the user's order.
    """
    managed_params = [p for group in optimizer.param_groups for p in group["params"]]
    position = {id(param): m for m, param in enumerate(managed_params)}
    return {
        "params": managed_positions(optimizer, root),
        "orders": [[(position[id(managed)], k) for managed, k in order] for order in orders],
    }


def managed_positions(optimizer: Optimizer, root: nn.Module) -> list[tuple[int, int]]:
    """``(u, i)`` for each parameter ``optimizer`` holds, in its order: the ``i``-th parameter of the ``u``-th FSDP
    unit of ``root`` (``root.modules()`` order). The same for the same model, wrapping and optimizer on any number of
    processes, so that a sharded checkpoint's optimizer state can be matched to this run's."""
    in_unit = {id(param): (u, i) for u, unit in enumerate(fsdp_instances(root)) for i, param in enumerate(unit.params)}
    return [in_unit[id(param)] for group in optimizer.param_groups for param in group["params"]]


def plain_state_dict(
    full_states: Sequence[dict[str, Any]],
    pieces: Sequence[Sequence[Piece]],
    orders: Sequence[Sequence[tuple[int, int]]],
    groups: Sequence[dict[str, Any]],
    elementwise: Sequence[set[str]],
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
    """
    out_state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for group_saved, order in zip(groups, orders):
        indices = []
        for m, k in order:
            piece, state = pieces[m][k], full_states[m]
            if state:
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
                }
            indices.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in group_saved.items() if k != "params"}, "params": indices})
    return {"state": out_state, "param_groups": out_groups}


def _check_same_state_keys(optimizer: Optimizer, params: list[nn.Parameter], group: Any) -> None:
    signature = [sorted(optimizer.state.get(p, {})) for p in params]
    everyone = collectives.all_gather_object(signature, group=group)
    if any(other != signature for other in everyone):
        raise RuntimeError(
            "The ranks hold different optimizer state entries, so the state cannot be consolidated. This happens when"
            " ranks step different parameters; make every rank run the same optimizer steps."
        )


def shard_state(full: dict[str, Any], optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder) -> dict:
    """This rank's part of a standard optimizer state dict, ready for ``optimizer.load_state_dict``.

    ``full`` may come from :func:`consolidate_state` on any number of ranks, or from a plain optimizer over the
    unwrapped module built the same way.

    Raises:
        ValueError: ``full`` was saved for other parameters or param groups.
    """
    saved_groups = full.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer state has {len(saved_groups)} param groups but the optimizer has"
            f" {len(optimizer.param_groups)}. Resume with the optimizer configuration the checkpoint was saved with."
        )
    saved_state = full.get("state", {})
    out_state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for group, saved_group, order in zip(optimizer.param_groups, saved_groups, orders):
        if len(saved_group["params"]) != len(order):
            raise ValueError(
                f"A param group of the checkpoint's optimizer state holds {len(saved_group['params'])} parameters,"
                f" the optimizer's holds {len(order)}. The checkpoint was saved for a different model or optimizer."
            )
        by_piece = {located: saved_state.get(i) for located, i in zip(order, saved_group["params"])}
        first = index
        for managed in group["params"]:
            info = layout.managed[managed]
            states = [by_piece.get((managed, k)) for k in range(len(info.pieces))]
            if any(s for s in states):
                out_state[index] = _merge_pieces(managed, info, states)
            index += 1
        out_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": list(range(first, index))})
    return {"state": out_state, "param_groups": out_groups}


def _is_elementwise_over(key: str, states: list[dict[str, Any]], pieces: Sequence[Piece]) -> bool:
    """Whether ``key`` holds one value per element of each piece (``exp_avg``...) rather than one per parameter
    (``step``): its values have the pieces' shapes, all of them. Judged over every piece, since one piece alone can
    be a scalar parameter whose ``exp_avg`` looks like a ``step``. In a unit of scalar parameters only, shapes cannot
    tell: there every entry but ``step`` (torch's only per-parameter scalar state) is element-wise."""
    values = [state.get(key) for state in states]
    if not all(isinstance(v, Tensor) and v.shape == p.shape for v, p in zip(values, pieces)):
        if any(isinstance(v, Tensor) and v.dim() > 0 for v in values):
            raise ValueError(f"The checkpoint's optimizer state '{key}' does not match the parameter shapes.")
        return False
    return any(p.shape != torch.Size() for p in pieces) or key != "step"


def _merge_pieces(managed: nn.Parameter, info: _Managed, states: list[dict[str, Any] | None]) -> dict[str, Any]:
    """This rank's shard of a managed parameter's state, from the plain state of the pieces it holds: only the
    slices this rank owns are read (see :mod:`lightning_fairscale.fsdp.resharding`)."""
    present = [s for s in states if s]
    if len(present) != len(states):
        missing = [p.name for p, s in zip(info.pieces, states) if not s]
        raise ValueError(f"The checkpoint's optimizer state has no entry for {missing}, but has for their FSDP unit.")
    merged: dict[str, Any] = {}
    start, _, _ = local_range(managed, info.unit)
    for key, value in present[0].items():
        if _is_elementwise_over(key, present, info.pieces):
            segments = [(piece.offset, s[key].reshape(-1)) for piece, s in zip(info.pieces, present)]
            merged[key] = copy_overlaps(value.new_empty(managed.numel()), start, segments).view(managed.shape)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
