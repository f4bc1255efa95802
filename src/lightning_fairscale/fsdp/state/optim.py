"""Optimizers over FSDP-managed parameters: where each original parameter went, and re-pointing them.

FSDP replaces a unit's parameters by one flat, sharded parameter per unit (or shards each parameter in place with
``flatten_parameters=False``). This module keeps the user's optimizer faithful to the original parameters:

* :class:`ParameterLayout` records which slice of which FSDP-managed parameter holds each original parameter, and
  makes this rank's view of each (:mod:`lightning_fairscale.fsdp.unit.param_views`).
* :func:`repoint_optimizer` changes an optimizer created over the original parameters (``self.parameters()``) to
  hold their views instead, in place, so its class, param groups (which may split units), per-parameter
  ``requires_grad``, hyperparameters and LR schedulers stay as the user made them.

Their state in a standard layout, gathered and loaded, is :mod:`lightning_fairscale.fsdp.state.optim_state`'s.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_fairscale.fsdp.unit import param_views, unit_state
from lightning_fairscale.fsdp.unit.units import named_fsdp_instances
from lightning_fairscale.fsdp.unit.param_views import ParamView
from lightning_fairscale.fsdp.unit.frozen_params import frozen_pieces
from lightning_fairscale.fsdp.state.resharding import flat_numel, local_range, owned_range
from lightning_fairscale.fsdp.unit import shard_layout, sharded_reads
from lightning_fairscale.fsdp.unit.state_names import clean_path

__all__ = [
    "GroupOrder",
    "ParameterLayout",
    "Piece",
    "managed_params",
    "norm_group",
    "repoint_optimizer",
]

@dataclass(frozen=True)
class Piece:
    """One original parameter inside an FSDP-managed parameter: ``managed.full[offset:offset+numel].view(shape)``."""

    name: str
    offset: int
    numel: int
    shape: torch.Size
    #: The original parameter's ``requires_grad``.
    trainable: bool = True


@dataclass
class _Managed:
    """A managed parameter's unit (weakly: the root unit keeps the layout) and the original parameters it holds."""

    _unit: Callable[[], Optional[_FairScaleFSDP]]
    pieces: list[Piece]

    @property
    def unit(self) -> _FairScaleFSDP:
        unit = self._unit()
        assert unit is not None, "the FSDP unit of this parameter is gone"
        return unit

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
    #: The root unit the layout describes, weakly (the root keeps its layout: see ``fsdp.engine.wrapped_model``).
    _root: Optional[Callable[[], Optional[nn.Module]]] = None
    #: Position of each parameter in ``module.parameters()`` before wrapping, by id (until :meth:`after_wrapping`).
    _positions: dict[int, int] = field(default_factory=dict)
    #: ``(id(managed), piece)`` -> where the unwrapped module lists that original parameter (:meth:`in_module_order`).
    _module_order: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    #: ``(id(managed), piece)`` -> this rank's view of that original parameter (empty: outside this rank's shard).
    _views: dict[tuple[int, int], ParamView] = field(default_factory=dict)
    #: ``id(module)`` -> the names of its parameters in the order it registered them (before wrapping).
    parameter_names: dict[int, list[str]] = field(default_factory=dict)
    #: ``id(view parameter)`` -> ``(managed, piece)``.
    _viewed: dict[int, tuple[nn.Parameter, int]] = field(default_factory=dict)

    @classmethod
    def before_wrapping(cls, module: nn.Module) -> ParameterLayout:
        layout = cls()
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None and not hasattr(param, "_is_sharded"):
                    layout._owners[(id(owner), name)] = id(param)
            layout.parameter_names[id(owner)] = list(owner._parameters)
        layout._positions = {id(param): i for i, param in enumerate(module.parameters())}
        return layout

    def after_wrapping(self, root: nn.Module) -> ParameterLayout:
        self._root = weakref.ref(root)
        model_owner = self._owner()  # the records of the units wrapped by hand are its
        for path, unit in named_fsdp_instances(root):
            for param in unit.params:  # the views of an earlier layout of this model (an earlier stage)
                param_views.forget(unit_state.peek_flat(unit, param, model_owner))
            prefix = clean_path(path + ".") if path else ""
            flat_count = unit._num_flatten_params
            for managed in unit.params[:flat_count]:
                pieces, offset = [], 0
                recorded = frozen_pieces(unit_state.peek_flat(unit, managed, model_owner))
                frozen = recorded or [not managed.requires_grad] * len(managed._param_infos)
                for (module_name, owner, name), numel, shape, is_frozen in zip(
                    managed._param_infos, managed._param_numels, managed._param_shapes, frozen
                ):
                    key = clean_path(f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}")
                    pieces.append(Piece(key, offset, numel, torch.Size(shape), trainable=not is_frozen))
                    original = self._owners.get((id(owner), name))
                    if original is not None:
                        self._original[original] = (managed, len(pieces) - 1)
                    self._note_position(managed, len(pieces) - 1, original)
                    offset += numel
                self.managed[managed] = _Managed(weakref.ref(unit), pieces)
            for managed, names in zip(unit.params[flat_count:], unit._param_name_groups[flat_count:]):
                shape = torch.Size(managed._orig_size)
                piece = Piece(prefix + clean_path(names[0]), 0, shape.numel(), shape, trainable=managed.requires_grad)
                self.managed[managed] = _Managed(weakref.ref(unit), [piece])
                # Sharded in place: the original itself, unless the unit replaced a meta one when materialising it.
                owner_path, _, name = names[0].rpartition(".")
                owner = unit.module.module.get_submodule(owner_path)
                original = self._owners.get((id(owner), name), id(managed))
                self._original[original] = (managed, 0)
                self._note_position(managed, 0, original)
        self._owners.clear()
        self._positions.clear()
        return self

    @property
    def root(self) -> Optional[nn.Module]:
        """The root unit the layout describes (``None`` before :meth:`after_wrapping`, or once it is gone)."""
        return self._root() if self._root is not None else None

    def _note_position(self, managed: nn.Parameter, piece: int, original: Optional[int]) -> None:
        if original in self._positions:  # wrapped now: where the module listed the original parameter
            self._module_order[(id(managed), piece)] = (self._positions[original], 0)
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
        """The (managed parameter, piece index) pairs that ``param`` stands for; empty when FSDP does not manage it.

        ``param`` is an original parameter, a managed one (all its pieces), or one of this rank's views."""
        if param in self.managed:
            return [(param, k) for k in range(len(self.managed[param].pieces))]
        # Views first: they live as long as the layout, whereas an original parameter's id may have been reused.
        found = self._viewed.get(id(param)) or self._original.get(id(param))
        return [found] if found is not None else []

    def _owner(self) -> Optional[unit_state.RootState]:
        """The owner of the model (it holds the records of its units wrapped by hand), ``None`` for a root of
        FairScale's own class."""
        root = self.root
        return unit_state.owner_of(root) if root is not None and unit_state.peek(root) is not None else None

    def view(self, managed: nn.Parameter, piece: int) -> ParamView:
        """This rank's view of original parameter ``piece`` of ``managed``, made on first use: the elements of this
        rank's shard that belong to it, none when it lies in other ranks' shards (as torch FSDP's original
        parameters with ``use_orig_params=True``: every rank holds one parameter per original parameter)."""
        key = (id(managed), piece)
        view = self._views.get(key)
        if view is None:
            info = self.managed[managed]
            start, stop, _ = local_range(managed, info.unit)
            p = info.pieces[piece]
            lo, hi = max(start, p.offset), min(stop, p.offset + p.numel)
            lo, hi = (lo, hi) if lo < hi else (max(min(lo, stop), start),) * 2
            record = unit_state.flat_record(info.unit, managed, self._owner())
            view = param_views.attach(
                managed, record, piece, lo - start, hi - start, p.trainable, _layout(managed, info, p)
            )
            self._views[key] = view
            self._viewed[id(view.param)] = (managed, piece)
        return view

    def originals(self) -> dict[tuple[int, str], nn.Parameter]:
        """``(id(owner module), name)`` -> this rank's view of that original parameter, for every original
        parameter of a flat parameter (what :func:`~lightning_fairscale.fsdp.unit.original_params.install` puts
        back)."""
        found: dict[tuple[int, str], nn.Parameter] = {}
        for managed in self.managed:
            for k, (_, owner, name) in enumerate(getattr(managed, "_param_infos", [])):
                found[(id(owner), name)] = self.view(managed, k).param
        return found

    def view_of(self, param: nn.Parameter) -> tuple[nn.Parameter, ParamView]:
        """The managed parameter and the :class:`ParamView` of ``param``, a view an optimizer holds."""
        managed, piece = self._viewed[id(param)]
        view = self._views[(id(managed), piece)]
        assert view.param is param
        return managed, view

    def global_range(self, managed: nn.Parameter, view: ParamView) -> tuple[int, int]:
        """The elements ``[start, stop)`` of the whole flat parameter that ``view`` holds."""
        start, _, _ = local_range(managed, self.managed[managed].unit)
        return start + view.start, start + view.stop



def _layout(managed: nn.Parameter, info: _Managed, piece: Piece) -> Optional[sharded_reads.ShardLayout]:
    """How ``piece`` is split over the ranks of its unit's group (``None``: it is not, one rank holds it whole)."""
    unit = info.unit
    if not getattr(managed, "_is_sharded", False) or unit.world_size == 1:
        return None
    numel = flat_numel(managed)
    ranges: list[tuple[int, int]] = []
    for rank in range(unit.world_size):
        start, stop, _ = owned_range(numel, rank, unit.world_size)
        ranges.append((min(max(start - piece.offset, 0), piece.numel), min(max(stop - piece.offset, 0), piece.numel)))
    return sharded_reads.ShardLayout(piece.name, piece.shape, tuple(ranges), unit.rank, unit.process_group)


#: For each param group, the pieces in the order the user listed the original parameters.
GroupOrder = list[list[tuple[nn.Parameter, int]]]


def repoint_optimizer(optimizer: Optimizer, layout: ParameterLayout) -> GroupOrder:
    """Make ``optimizer`` hold this rank's views of its original parameters instead of them, in place.

    Each param group keeps its hyperparameters and gets the views of its own parameters, so groups may split FSDP
    units and name any subset of the parameters; a parameter none of whose elements this rank holds has no view
    here. Returns the rank-independent :data:`GroupOrder` that the optimizer's state is saved in.

    Raises:
        ValueError: the optimizer holds a parameter FSDP does not manage.
    """
    orders: GroupOrder = []
    for group in optimizer.param_groups:
        order: list[tuple[nn.Parameter, int]] = []
        views: dict[int, nn.Parameter] = {}
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
                order.append((managed, piece))
                view = layout.view(managed, piece)
                views.setdefault(id(view.param), view.param)
        group["params"] = list(views.values())
        orders.append(order)
    optimizer.state = defaultdict(dict)
    if layout.root is not None:  # its gradient holders are views now, on every rank alike
        param_views.mark_has_views(layout.root)
    if any(sharded_reads.layout_of(p) is not None for group in optimizer.param_groups for p in group["params"]):
        shard_layout.local_steps(optimizer)  # the step on plain local tensors, at torch's own speed
    return orders


def norm_group(orders: GroupOrder, layout: ParameterLayout) -> Optional[ProcessGroup]:
    """The process group over which the norm of the gradients of an optimizer re-pointed to ``orders`` is taken: the
    group its units shard over, one replica's under hybrid sharding (every unit of a model shards over one group),
    the same on every rank, also one that holds no view (``None``, the default group, for an empty optimizer)."""
    managed = next((m for order in orders for m, _ in order), None)
    return layout.managed[managed].unit.process_group if managed is not None else None


def managed_params(orders: GroupOrder) -> list[nn.Parameter]:
    """The managed parameters an optimizer's original parameters live in, in the order of their first piece in
    ``orders``: the same on every rank, so it numbers them in checkpoints."""
    seen: dict[int, nn.Parameter] = {}
    for order in orders:
        for managed, _ in order:
            seen.setdefault(id(managed), managed)
    return list(seen.values())
