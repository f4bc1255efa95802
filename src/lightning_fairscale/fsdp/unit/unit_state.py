"""What this package knows about a sharded model, its units and its flat parameters, in objects of its own.

FairScale's units, their flat parameters and the user's modules and optimizers are not ours: nothing of ours is written
into them. One sharded model has one owner, its :class:`RootState`, made when the model is set up (:func:`owner_of` its
root unit) and held by the root unit's :class:`UnitState`: what is known about the model as a whole (the front end's
record of it, whether its optimizers hold views, its failed step, its hold on FairScale's CPU workarounds, the hook that
lets the user's module find its root, the process groups it shards over), and the records of its units of FairScale's
own class (wrapped by hand: not ours, so their records are held here, by the owner). Dropped with the root unit.

What we know about a unit of ours is its :class:`UnitState`, made when the unit is built and held by the unit
(:class:`~lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel` is our class: an ordinary attribute of it),
with a reference to the owner once the model is set up. What we know about a flat parameter is its
:class:`FlatState`, held by its unit's :class:`UnitState` (by the owner for a unit of FairScale's class): found from
the unit and the parameter (:func:`flat_record`, :func:`peek_flat`, :func:`flat_states`), never from the parameter
alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups

__all__ = [
    "Failure",
    "FlatState",
    "ModelRecord",
    "OriginalSlots",
    "ParamView",
    "RootState",
    "UnitState",
    "adopt",
    "flat_record",
    "flat_states",
    "forget_flat",
    "of",
    "owner_of",
    "peek",
    "peek_flat",
    "peek_owner",
]


@dataclass(eq=False)
class ParamView:
    """The part of original parameter ``piece`` of ``managed`` (a flat parameter) that this rank holds: the
    optimizer's view of it (:mod:`~lightning_fairscale.fsdp.unit.param_views`), listed in ``managed``'s
    :class:`FlatState`.

    ``param`` is ``managed``'s shard elements ``[start, stop)``, which are the original parameter's flattened
    elements ``[start - offset_in_piece ...]``; ``trainable`` is the original parameter's ``requires_grad`` when its
    unit last computed (at set-up, then before each forward of the unit:
    :mod:`~lightning_fairscale.fsdp.unit.step_state`).
    """

    param: nn.Parameter
    piece: int
    start: int
    stop: int
    trainable: bool
    #: The handle of the hook on ``param`` that sets aside its own gradients under ``no_sync``
    #: (:func:`~lightning_fairscale.fsdp.unit.param_views.share_local_gradients`), registered the first time it holds
    #: an unreduced slice.
    hook: Optional[RemovableHandle] = None


@dataclass(eq=False)
class FlatState:
    """What we know about one flat (or sharded) parameter of a unit on this rank."""

    #: The optimizer's views of its original parameters on this rank.
    views: list[ParamView] = field(default_factory=list)
    #: Whether its gradient is the one shared with its views (after a synchronising backward, until taken back).
    grad_shared: bool = False
    #: The gradient tensor given to each of its views (by ``id`` of the view's parameter, weakly), to tell them from
    #: gradients the backward computed for the views themselves.
    given: dict[int, weakref.ref[Tensor]] = field(default_factory=dict)
    #: Whether its views hold slices of this rank's unreduced gradient (after a backward under ``no_sync``, until
    #: the synchronising one).
    local_given: bool = False
    #: What the backwards under ``no_sync`` gave each view itself (a term on the parameters outside the forward), by
    #: ``id`` of the view's parameter: added to the reduced shard by the synchronising backward.
    pending: dict[int, Tensor] = field(default_factory=dict)
    #: Which of its original parameters were frozen when its unit was built (workaround 11); ``None``: none was.
    frozen: Optional[list[bool]] = None
    #: Its gradient accumulator (weakly: its hooks' dictionary) and the ``id`` of each unit whose post-backward hook
    #: is on it (workaround 20).
    hooked: Optional[tuple[weakref.ref[Any], set[int]]] = None
    #: For a parameter sharded in place (the module's own, not flattened): its ``requires_grad`` at its unit's last
    #: forward (workaround 28, :mod:`~lightning_fairscale.fsdp.unit.step_state`), ``None`` before the first.
    trained: Optional[bool] = None


@dataclass(eq=False)
class OriginalSlots:
    """Where one unit's original parameters live: each ``(owner module, name) -> parameter`` (tied names included),
    the order of each owner's parameters as the user's module registered them, and the unit's flat parameters (by
    their names in FairScale's wrapper). Kept in the unit's
    :class:`UnitState` (see :mod:`~lightning_fairscale.fsdp.unit.original_params`)."""

    params: dict[tuple[int, str], nn.Parameter] = field(default_factory=dict)
    owners: list[tuple[nn.Module, list[str]]] = field(default_factory=list)
    flat: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    #: Whether the originals are the modules' attributes now (else FairScale's views are).
    shown: bool = False
    #: How many :func:`fairscale_layout` contexts hold the unit in FairScale's layout (they nest).
    depth: int = 0
    #: Whether :func:`~lightning_fairscale.fsdp.unit.original_params.forget` put the unit back in FairScale's layout for
    #: good (a :func:`fairscale_layout` it ran inside must not show the originals again at its end).
    forgotten: bool = False
    #: FairScale's views of the full parameters from the unit's last forward, ``(id(owner), name) -> view``, until its
    #: backward ends (:func:`release_views`).
    views: dict[tuple[int, str], Tensor] = field(default_factory=dict)
    #: The same views once their backward ended, weakly: a graph kept for another backward may still hold them.
    spent: dict[tuple[int, str], weakref.ref[Tensor]] = field(default_factory=dict)
    #: The forward pre-hook on the wrapped module that calls :func:`expose` (removed by :func:`forget`).
    hook: Optional[RemovableHandle] = None


class ModelRecord:
    """What the front ends' object of a sharded model (:class:`~lightning_fairscale.fsdp.model.WrappedModel`) keeps
    of it: the base of its record, held by the model's :class:`RootState`."""


@dataclass(eq=False)
class Failure:
    """A root's step that an exception ended (:func:`~lightning_fairscale.fsdp.unit.recovery.restore`): which
    exception (by ``id``, and its ``repr``: the exception itself is not kept, its traceback holds the step's frames,
    their tensors, and through autograd's C++ objects the model, which the record must not keep alive), and which
    failure it is: the root's number and its count of failures, the same on every rank that fails alike, whatever
    order a front end restores its models in. Kept by the model's owner."""

    error_id: Optional[int]
    error_repr: str
    key: str
    together: Optional[bool] = None


@dataclass(eq=False)
class RootState:
    """The owner of what this package knows about one sharded model (see the module's docstring): held by its root
    unit, released with it. Nothing here refers back to the root (a sharded model nobody uses any more is freed at
    once, not by the garbage collector)."""

    #: Whether the engine set the model up (:func:`adopt`): what the loop changes between steps is followed
    #: (workaround 28, :mod:`~lightning_fairscale.fsdp.unit.step_state`).
    adopted: bool = False
    #: The records of the model's units of FairScale's own class (wrapped by hand), which are not ours.
    foreign: dict[nn.Module, UnitState] = field(default_factory=dict)
    #: Whether the optimizers of the model hold views (on every rank alike, even one holding none).
    has_views: bool = False
    #: What the model's :class:`~lightning_fairscale.fsdp.model.WrappedModel` knows, once the engine set it up.
    wrapped: Optional[ModelRecord] = None
    #: The model's step that an exception ended (:mod:`~lightning_fairscale.fsdp.unit.recovery`), else ``None``.
    failure: Optional[Failure] = None
    #: Its number among the roots this process wrapped (:func:`~lightning_fairscale.fsdp.unit.recovery.number_root`),
    #: the same on every rank (wrapping is collective).
    serial: int = -1
    #: How many of its steps an exception ended so far (the ranks that fail alike count alike).
    failures: int = 0
    #: Its hold on FairScale's CPU workarounds (:func:`~lightning_fairscale.fsdp.patches.cpu_streams.hold_while_alive`):
    #: the finalizer that ends it, ``None`` when it holds none.
    cpu_hold: Optional[weakref.finalize] = None
    #: The hook on the user's module by which it finds its root while kept sharded
    #: (:func:`~lightning_fairscale.fsdp.wrapping.unwrapping.remember_root`), ``None`` when none is registered.
    keeper: Optional[RemovableHandle] = None
    #: The process groups its root shards over (:func:`~lightning_fairscale.fsdp.engine.wrap_model`'s), until it is
    #: unsharded (:mod:`~lightning_fairscale.fsdp.patches.hybrid`: when they are destroyed); ``None`` for a model the
    #: engine did not wrap.
    groups: Optional[ProcessGroups] = None


@dataclass(eq=False)
class UnitState:
    """What we know about one unit."""

    #: The parameters the unit flattened, ``id -> (weak reference, name)``, to find ties split between units.
    flattened: dict[int, tuple[weakref.ref[nn.Parameter], str]] = field(default_factory=dict)
    #: Where its original parameters live once installed
    #: (:class:`OriginalSlots`), else ``None``.
    originals: Optional[OriginalSlots] = None
    #: The owner of the unit's model (:class:`RootState`): on a root unit from when it is set up, on the root's
    #: other units of our class from when the engine sets up the model (:func:`adopt`); ``None`` before.
    owner: Optional[RootState] = None
    #: The gradient accumulators its running forward hooked (workaround 20), held until the forward's graph holds
    #: them, and not after: held longer, each keeps the model alive through its hook.
    accumulators: list[Node] = field(default_factory=list)
    #: The version counters of its shards (and their views) when its last forward with gradients gathered them
    #: (workaround 28, :mod:`~lightning_fairscale.fsdp.unit.step_state`), ``None`` before.
    shard_versions: Optional[list[int]] = None
    #: Each of its flat (or sharded) parameters' record, once one was made (the dictionary hashes a tensor by
    #: identity; the unit holds these parameters anyway, in FairScale's ``params``).
    flats: dict[nn.Parameter, FlatState] = field(default_factory=dict)


#: The name of the attribute of our unit class that holds its :class:`UnitState`.
ATTRIBUTE = "unit_state"

def peek(unit: nn.Module, owner: Optional[RootState] = None) -> Optional[UnitState]:
    """``unit``'s state, ``None`` for a module that has none (not a unit, or a unit of FairScale's class that
    ``owner``, its model's owner, holds nothing for)."""
    state = vars(unit).get(ATTRIBUTE)
    if isinstance(state, UnitState):
        return state
    return owner.foreign.get(unit) if owner is not None else None


def of(unit: nn.Module, owner: Optional[RootState] = None) -> UnitState:
    """``unit``'s state (for a unit of FairScale's own class, held by ``owner``, its model's owner: made there when
    it had none)."""
    state = peek(unit, owner)
    if state is None:
        if owner is None:
            raise ValueError(f"A unit of FairScale's own class ({type(unit).__name__}) has no state outside its model.")
        state = owner.foreign[unit] = UnitState()
    return state


def owner_of(root: nn.Module) -> RootState:
    """The owner of the model whose root unit (of our class) is ``root``, made when it had none."""
    state = of(root)
    if state.owner is None:
        state.owner = RootState()
    return state.owner


def peek_owner(unit: nn.Module) -> Optional[RootState]:
    """The owner of ``unit``'s model, ``None`` for a unit of FairScale's class or one of no model set up yet."""
    state = peek(unit)
    return state.owner if state is not None else None


def adopt(root: nn.Module, units: list[nn.Module]) -> RootState:
    """The owner of ``root``'s model (:func:`owner_of`), known from now on by each of its ``units`` of our class."""
    owner = owner_of(root)
    owner.adopted = True
    for unit in units:
        state = peek(unit)
        if state is not None:
            state.owner = owner
    return owner


def peek_flat(unit: nn.Module, flat: nn.Parameter, owner: Optional[RootState] = None) -> Optional[FlatState]:
    """The record of ``flat``, a parameter of ``unit`` (``owner``: its model's owner, for a unit of FairScale's
    class), ``None`` when nothing was recorded for it."""
    state = peek(unit, owner)
    return state.flats.get(flat) if state is not None else None


def flat_record(unit: nn.Module, flat: nn.Parameter, owner: Optional[RootState] = None) -> FlatState:
    """The record of ``flat``, a parameter of ``unit`` (made when it had none; see :func:`of` for ``owner``)."""
    flats = of(unit, owner).flats
    record = flats.get(flat)
    if record is None:
        record = flats[flat] = FlatState()
    return record


def forget_flat(unit: nn.Module, flat: nn.Parameter, owner: Optional[RootState] = None) -> None:
    """Drop everything recorded for ``flat`` (its unit is unwrapped: the gradient accumulator in its record holds
    the unit's hook, which refers back to the unit)."""
    state = peek(unit, owner)
    if state is not None:
        state.flats.pop(flat, None)


def flat_states(unit: nn.Module, owner: Optional[RootState] = None) -> list[Optional[FlatState]]:
    """The record of each of ``unit``'s own parameters (FairScale's ``unit.params``: flat ones first), ``None`` for
    one that has none (see :func:`of` for ``owner``)."""
    state = peek(unit, owner)
    flats = state.flats if state is not None else {}
    return [flats.get(param) for param in getattr(unit, "params", [])]
