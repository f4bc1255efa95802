"""The model's own parameters while it is sharded: torch FSDP's ``use_orig_params=True`` for FairScale's units.

FairScale flattens a unit's parameters into one flat parameter, deletes them from their modules and leaves plain
tensor views of the *full* flat parameter in their place, made at the unit's last forward: between steps
``layer.weight`` is a stale view whose storage FairScale has freed (reading it fails, or reads freed memory), not
the tensor the optimizer steps, of the wrong dtype under true half precision, and without a ``.grad``; and
``model.parameters()`` lists FairScale's flat parameters, which cannot be deep-copied.

Here each original parameter is an ``nn.Parameter`` attribute of its module again, under its own name, and is the
very parameter the optimizer holds (:mod:`lightning_fairscale.fsdp.unit.param_views`): between steps a 1-D view of the
elements of this rank's shard that belong to it (empty when the rank holds none), in the shard's dtype, with its
slice of the gradient shard as ``.grad`` after a synchronising backward. A parameter reachable under several names
(tied embeddings) is one parameter under all of them. While a unit computes (its forward; its backward, where
activation checkpointing recomputes it) its modules hold FairScale's views of the full parameters, as torch's FSDP
does. The flat parameters are out of ``model.parameters()``; FairScale's own state-dict and summon code sees them
again inside :func:`fairscale_layout` (torch's FSDP registers its flat parameter the same way, only while it needs
it).

:class:`~lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel` switches a unit at the start and end of its
forward and at its pre-backward; :func:`install` puts the originals in place once the optimizers' views exist.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Optional

from torch import nn

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.fsdp.unit import unit_state
from lightning_fairscale.fsdp.unit.instances import fsdp_instances
from lightning_fairscale.fsdp.unit.unit_state import OriginalSlots

__all__ = [
    "before_forward",
    "fairscale_layout",
    "forget",
    "install",
    "is_installed",
    "release_views",
    "show",
    "slots_of",
    "use_full_views",
]

def slots_of(unit: nn.Module, model: Optional[unit_state.RootState] = None) -> Optional[OriginalSlots]:
    """``unit``'s slots (kept in its :class:`~lightning_fairscale.fsdp.unit.unit_state.UnitState`; for a unit of
    FairScale's own class, held by ``model``, its model's owner), ``None`` when :func:`install` did not give it its
    original parameters (or ``unit`` is not a unit)."""
    state = unit_state.peek(unit, model)
    return state.originals if state is not None else None


def _installed_units(root: nn.Module) -> list[tuple[nn.Module, OriginalSlots]]:
    """The units of ``root`` (itself included) that :func:`install` gave their original parameters, with their
    slots."""
    model = unit_state.peek_owner(root)
    found = ((unit, slots_of(unit, model)) for unit in fsdp_instances(root))
    return [(unit, slots) for unit, slots in found if slots is not None]


def is_installed(root: nn.Module) -> bool:
    """Whether :func:`install` gave ``root``'s units their original parameters."""
    return bool(_installed_units(root))


def install(
    unit: _FairScaleFSDP, originals: dict[tuple[int, str], nn.Parameter], orders: dict[int, list[str]],
    model: Optional[unit_state.RootState] = None,
) -> None:
    """Make ``originals`` (``(id(owner), name) -> parameter``, for every original parameter of ``unit``'s flat
    parameters) the attributes of their modules, tied names included, in the order ``orders`` records for each
    owner (``id(owner) -> names``; an owner it lacks keeps FairScale's order), and hide the flat parameters.
    ``model``: the model's owner, which holds the record of a unit of FairScale's own class."""
    installed = slots_of(unit, model)
    if installed is not None:  # installed already (the unit belongs to a model wrapped before)
        show(unit, installed)
        return
    slots = OriginalSlots()
    names: dict[int, list[str]] = {}
    owners: dict[int, nn.Module] = {}
    for flat in unit.params[: unit._num_flatten_params]:
        for _, owner, name in flat._param_infos:
            slots.params[(id(owner), name)] = originals[(id(owner), name)]
            owners[id(owner)] = owner
            names.setdefault(id(owner), []).append(name)
        for _, _, owner, name, source, source_name in flat._shared_param_infos:
            slots.params[(id(owner), name)] = originals[(id(source), source_name)]
            owners[id(owner)] = owner
            names.setdefault(id(owner), []).append(name)
    for key, owner in owners.items():
        order = [n for n in orders.get(key, []) if n in names[key] or n in owner._parameters]
        order += [n for n in names[key] if n not in order]
        slots.owners.append((owner, order))
    wrapper = unit.module
    slots.flat = [(name, getattr(wrapper, name)) for name in wrapper.flat_param_names[: unit._num_flatten_params]]
    unit_state.of(unit, model).originals = slots
    unit_ref = weakref.ref(unit)
    slots.hook = unit.module.module.register_forward_pre_hook(lambda *_: expose(unit_ref()))
    show(unit, slots)


def expose(unit: Optional[nn.Module]) -> None:
    """Inside the root unit's forward (where Lightning runs ``training_step``), once FairScale has set its views of
    the full parameters: the original parameters are in their modules' ``_parameters`` again too, so that the
    user's ``self.parameters()`` there lists every parameter of the model (a penalty over them is the whole model's:
    :mod:`~lightning_fairscale.fsdp.unit.sharded_reads`), while the modules compute with FairScale's views (instance
    attributes, which attribute lookup finds first). Both reach the shards' gradient, each once: the forward's
    through FairScale's flat parameter, the penalty's through the view (``param_views._add_own_gradients``)."""
    slots = slots_of(unit) if unit is not None else None
    if slots is None or slots.shown or slots.depth or not getattr(unit, "_is_root", False):
        return
    for owner, order in slots.owners:
        attributes = owner.__dict__
        for name in order:
            if name in attributes and (id(owner), name) in slots.params:
                owner._parameters[name] = slots.params[(id(owner), name)]


def show(unit: nn.Module, slots: Optional[OriginalSlots]) -> None:
    """The original parameters become ``unit``'s modules' attributes (FairScale's views of the full parameters, if
    any, are dropped: autograd keeps what it needs of them); its flat parameters leave ``parameters()``. ``slots``:
    ``unit``'s (:func:`slots_of`; ``None``: nothing to do)."""
    if slots is None or slots.shown or slots.depth or slots.forgotten:
        return
    wrapper: Any = unit.module
    for name, _ in slots.flat:
        wrapper._parameters.pop(name, None)
    for owner, order in slots.owners:
        current = owner._parameters
        attributes = owner.__dict__
        for name in order:
            view = attributes.pop(name, None)  # FairScale's plain view, kept for the backward
            if view is not None:
                slots.views[(id(owner), name)] = view
                slots.spent.pop((id(owner), name), None)
        if not current:  # the usual case: every parameter of the module is an original one (fast path)
            current.update((name, slots.params[(id(owner), name)]) for name in order)
            continue
        rebuilt: dict[str, Optional[nn.Parameter]] = {}
        for name in order:
            if (id(owner), name) in slots.params:
                rebuilt[name] = slots.params[(id(owner), name)]
            elif name in current:
                rebuilt[name] = current[name]
        rebuilt.update((n, p) for n, p in current.items() if n not in rebuilt)
        current.clear()
        current.update(rebuilt)
    slots.shown = True


def _hide(unit: nn.Module, register_flat: bool, slots: Optional[OriginalSlots]) -> None:
    """Take the original parameters out of ``unit``'s modules (FairScale sets its views there); with
    ``register_flat``, register the flat parameters with FairScale's wrapper again. ``slots``: ``unit``'s."""
    if slots is None:
        return
    # Also when not shown: the root's forward exposes them (:func:`expose`).
    for owner, order in slots.owners:
        for name in order:
            if (id(owner), name) in slots.params:
                owner._parameters.pop(name, None)
    slots.shown = False
    if register_flat:
        wrapper: Any = unit.module
        for name, flat in slots.flat:
            wrapper._parameters[name] = flat


def before_forward(unit: nn.Module, slots: Optional[OriginalSlots]) -> None:
    """Before ``unit``'s forward: FairScale's wrapper sets its views of the full parameters. ``slots``: ``unit``'s."""
    _hide(unit, register_flat=False, slots=slots)


def use_full_views(unit: _FairScaleFSDP, slots: Optional[OriginalSlots]) -> None:
    """In ``unit``'s backward (its full parameters gathered again): its modules hold FairScale's views of them from
    its forward, so that a layer that recomputes its forward (activation checkpointing) computes with the full
    parameters. Those views, not new ones: FairScale's gradient hook is on the gradient accumulator the forward's
    views lead to, which torch replaces when the flat parameter's dtype changes (under mixed precision, at every
    switch between the fp32 shard and the fp16 full parameter). ``slots``: ``unit``'s."""
    if slots is None:
        return
    _hide(unit, register_flat=False, slots=slots)
    for owner, order in slots.owners:
        for name in order:
            view = slots.views.get((id(owner), name))
            if view is None and (id(owner), name) in slots.spent:  # a second backward through a kept graph
                view = slots.spent[(id(owner), name)]()
            if view is not None:
                owner.__dict__[name] = view


def release_views(unit: nn.Module, model: Optional[unit_state.RootState] = None) -> None:
    """Once the backward of ``unit``'s last forward ended (or the step was abandoned): its views of the full parameters
    are no longer held (weakly: a graph kept for another backward may still hold them), nor FairScale's list of them on
    the module it wraps (read by FairScale's own checkpointing inside the forward only). Each leads through its graph
    to a flat parameter's gradient accumulator, which holds the flat parameter, whose records hold the modules that
    own its parameters: held by the unit, they kept a model whose modules lead back to it (a LightningModule's
    Trainer, a root's module) alive through autograd's C++ objects, which the garbage collector cannot see.
    ``model``: the model's owner, which holds the record of a unit of FairScale's own class."""
    wrapper = getattr(unit, "_fsdp_wrapped_module", None)
    inner = getattr(wrapper, "_fpw_module", None)
    if inner is not None:
        inner.__dict__.pop("_unflattened_param_views", None)
    slots = slots_of(unit, model)
    if slots is None or not slots.views:
        return
    slots.spent.update((key, weakref.ref(view)) for key, view in slots.views.items())
    slots.views.clear()


@contextlib.contextmanager
def fairscale_layout(root: nn.Module) -> Iterator[None]:
    """Inside this context ``root``'s units are as FairScale made them (flat parameters registered, no original
    parameters on the modules), for FairScale's state dicts, loading and ``summon_full_params``; the originals come
    back at the end."""
    units = _installed_units(root)
    for unit, slots in units:
        slots.depth += 1
        if slots.depth == 1:
            _hide(unit, register_flat=True, slots=slots)
    try:
        yield
    finally:
        for unit, slots in units:
            slots.depth -= 1
            show(unit, slots)


def forget(root: nn.Module) -> None:
    """Put ``root``'s units back in FairScale's layout for good (before unwrapping them)."""
    model = unit_state.peek_owner(root)
    for unit, slots in _installed_units(root):
        _hide(unit, register_flat=True, slots=slots)
        if slots.hook is not None:
            slots.hook.remove()
        slots.forgotten = True
        unit_state.of(unit, model).originals = None
