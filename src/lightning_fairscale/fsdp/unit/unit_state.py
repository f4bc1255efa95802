"""What this package knows about a unit and its flat parameters, in objects of its own.

FairScale's units, their flat parameters and the user's modules and optimizers are not ours: nothing of ours is
written into them. What we know about a unit is its :class:`UnitState`, made when the unit is built and held by the
unit (:class:`~lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel` is our class: an ordinary attribute of
it); a unit of FairScale's own class (wrapped by hand) gets one from a map keyed weakly by the unit. What we know
about a flat parameter is its :class:`FlatState`, in a map keyed weakly by the parameter (by identity: a tensor's
``==`` compares values), held here: it is found from the parameter alone, as the optimizer's views and the model
summary find it, and from its unit (:func:`flat_states`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["FlatState", "UnitState", "flat_state", "flat_states", "forget_flat", "of", "peek", "peek_flat"]


@dataclass(eq=False)
class FlatState:
    """What we know about one flat (or sharded) parameter of a unit on this rank."""

    #: The optimizer's views of its original parameters on this rank
    #: (:class:`~lightning_fairscale.fsdp.unit.param_views.ParamView`).
    views: list[Any] = field(default_factory=list)
    #: Whether its gradient is the one shared with its views (after a synchronising backward, until taken back).
    grad_shared: bool = False
    #: The gradient tensor given to each of its views (by ``id`` of the view's parameter, weakly), to tell them from
    #: gradients the backward computed for the views themselves.
    given: dict[int, weakref.ref[Any]] = field(default_factory=dict)
    #: Whether its views hold slices of this rank's unreduced gradient (after a backward under ``no_sync``, until
    #: the synchronising one).
    local_given: bool = False
    #: What the backwards under ``no_sync`` gave each view itself (a term on the parameters outside the forward), by
    #: ``id`` of the view's parameter: added to the reduced shard by the synchronising backward.
    pending: dict[int, Any] = field(default_factory=dict)
    #: Which of its original parameters were frozen when its unit was built (workaround 11); ``None``: none was.
    frozen: Optional[list[bool]] = None
    #: Its gradient accumulator (weakly: its hooks' dictionary) and the ``id`` of each unit whose post-backward hook
    #: is on it (workaround 20).
    hooked: Optional[tuple[weakref.ref[Any], set[int]]] = None


@dataclass(eq=False)
class UnitState:
    """What we know about one unit."""

    #: The parameters the unit flattened, ``id -> (weak reference, name)``, to find ties split between units.
    flattened: dict[int, tuple[weakref.ref[nn.Parameter], str]] = field(default_factory=dict)
    #: Where its original parameters live once installed
    #: (:class:`~lightning_fairscale.fsdp.unit.original_params.OriginalSlots`), else ``None``.
    originals: Any = None
    #: On a root unit: whether the optimizers of its model hold views (on every rank alike, even one holding none).
    has_views: bool = False
    #: On a root unit set up by the engine: what its ``WrappedModel`` knows, else ``None``.
    wrapped: Any = None
    #: The gradient accumulators its running forward hooked (workaround 20), held until the forward's graph holds
    #: them, and not after: held longer, each keeps the model alive through its hook.
    accumulators: list[Any] = field(default_factory=list)
    #: On a root unit: its step that an exception ended (:mod:`~lightning_fairscale.fsdp.unit.recovery`), else
    #: ``None``.
    failure: Any = None
    #: On a root unit set up by the engine: its number among the roots this process wrapped
    #: (:func:`~lightning_fairscale.fsdp.unit.recovery.number_root`), the same on every rank (wrapping is collective).
    serial: int = -1
    #: On a root unit: how many of its steps an exception ended so far (the ranks that fail alike count alike).
    failures: int = 0


#: The name of the attribute of our unit class that holds its :class:`UnitState`.
ATTRIBUTE = "unit_state"

#: Units of FairScale's own class (not ours) -> their state.
_FOREIGN: weakref.WeakKeyDictionary[nn.Module, UnitState] = weakref.WeakKeyDictionary()
#: Flat parameters -> their state (weakly, by identity).
_FLATS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def peek(unit: nn.Module) -> Optional[UnitState]:
    """``unit``'s state, ``None`` for a module that has none (not a unit, or a unit of FairScale's class that
    nothing was recorded for)."""
    state = vars(unit).get(ATTRIBUTE)
    if isinstance(state, UnitState):
        return state
    return _FOREIGN.get(unit)


def of(unit: nn.Module) -> UnitState:
    """``unit``'s state (made for a unit of FairScale's own class that had none)."""
    state = peek(unit)
    if state is None:
        state = _FOREIGN[unit] = UnitState()
    return state


def peek_flat(flat: nn.Parameter) -> Optional[FlatState]:
    """``flat``'s state, ``None`` when nothing was recorded for it."""
    return _FLATS.get(flat)


def flat_state(flat: nn.Parameter) -> FlatState:
    """``flat``'s state (made when it had none)."""
    state = _FLATS.get(flat)
    if state is None:
        state = _FLATS[flat] = FlatState()
    return state


def forget_flat(flat: nn.Parameter) -> None:
    """Drop everything recorded for ``flat`` (its unit is unwrapped: the gradient accumulator in its record holds
    the unit's hook, which refers back to the unit)."""
    _FLATS.pop(flat, None)


def flat_states(unit: nn.Module) -> list[Optional[FlatState]]:
    """The state of each of ``unit``'s own parameters (FairScale's ``unit.params``: flat ones first), ``None`` for one
    that has none: what we know about a unit's flat parameters, from the unit."""
    return [_FLATS.get(param) for param in getattr(unit, "params", [])]
