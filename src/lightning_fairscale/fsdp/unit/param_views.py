"""The original parameters, as the optimizer sees them under flattening: views into this rank's flat shards.

FairScale's FSDP replaces the parameters of a unit by one flat parameter and keeps a shard of it on each rank. An
optimizer over the flat shards would give every parameter of a unit the same hyperparameters and the same
``requires_grad``. PyTorch's FSDP solves this with ``use_orig_params=True``; FairScale never did. We do it here.

Each rank's optimizer holds one *view parameter* per original parameter that overlaps this rank's shard: a 1-D
``nn.Parameter`` whose data is the overlapping slice of the flat shard, and whose ``.grad`` is the same slice of the
flat gradient shard. The optimizer updates the shard in place through it, with the hyperparameters of the original
parameter's param group. A frozen parameter's view never gets a gradient, so the optimizer keeps no state for it and
never changes it.

The flat parameter's gradient is FairScale's: its reduce-scatter sets it at the end of a synchronising backward
(:func:`share_gradients` then hands its slices to the views), and it accumulates into it when it is not ``None`` at
the next backward. What the user does to the views' gradients decides what happens to it
(:func:`take_back_gradients`): ``optimizer.zero_grad()`` (views' gradients ``None``) frees it, so that the next
backward starts afresh, exactly as for the original parameters of an unsharded model.

The functions here are called by :class:`lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel` at the
start and the end of each backward; the views are made by :class:`lightning_fairscale.fsdp.state.optim.ParameterLayout`.
"""

from __future__ import annotations

from collections.abc import Iterable
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_fairscale.fsdp.unit import sharded_reads, unit_state
from lightning_fairscale.fsdp.unit.unit_state import FlatState, ParamView

__all__ = [
    "ParamView",
    "attach",
    "forget",
    "gets_gradient",
    "has_views",
    "mark_has_views",
    "repoint_data",
    "share_gradients",
    "share_local_gradients",
    "take_back_gradients",
    "trainable_views",
    "views_of",
]

def _shard(managed: nn.Parameter) -> Tensor:
    """The 1-D shard of ``managed`` that the optimizer updates (FairScale's ``_fp32_shard`` once initialised)."""
    shard = getattr(managed, "_fp32_shard", None)
    return (shard if shard is not None else managed.data).view(-1)


def attach(
    managed: nn.Parameter, state: FlatState, piece: int, start: int, stop: int, trainable: bool,
    layout: Optional[sharded_reads.ShardLayout] = None,
) -> ParamView:
    """A view parameter over elements ``[start, stop)`` of ``managed``'s shard, registered in ``state`` (``managed``'s
    record); with
    ``layout`` (the original parameter's split over the ranks), one that knows it is sharded
    (:mod:`~lightning_fairscale.fsdp.unit.sharded_reads`), as are the gradients it is given."""
    data = _shard(managed)[start:stop]
    if layout is None:
        param = nn.Parameter(data, requires_grad=trainable)
    else:
        param = sharded_reads.ShardedParameter(data, trainable, layout)
    view = ParamView(param, piece, start, stop, trainable)
    state.views.append(view)
    if layout is not None:  # an empty view reads as having a gradient while the other ranks' views have theirs
        layout.empty_grad = _empty_grad(weakref.ref(view), weakref.ref(state))
    return view


def _empty_grad(view: weakref.ref[ParamView], state: weakref.ref[FlatState]) -> Callable[[], bool]:
    """Whether the (empty) view reads as having a gradient now, asked through the view's layout.

    Weakly: the layout is held by the view's gradients too, and a parameter holds its gradient in torch's C++, where
    the garbage collector cannot see it: a strong reference from the layout back to the view (or to the flat
    parameter's state, which lists the views) would close a cycle ``param -> grad -> layout -> param`` that the
    collector never frees, keeping a dropped model's gradients (and everything they hold) alive for good whenever
    they were not dropped before the model was (a step that raised, a run interrupted)."""

    def empty_grad() -> bool:
        viewed, flat = view(), state()
        # After a synchronising backward (shared) or one under `no_sync` (this rank's unreduced slices given): the
        # ranks holding elements of the view hold its gradient then, and a read of it is a collective on every rank.
        shared = flat is not None and (flat.grad_shared or flat.local_given)
        return viewed is not None and shared and gets_gradient(viewed)

    return empty_grad


def _set_aside_under_no_sync(
    view: weakref.ref[ParamView], state: weakref.ref[FlatState]
) -> Callable[[Tensor], Optional[Tensor]]:
    """The hook of a view's parameter, called with each gradient the backward computes for the view itself (a term on
    the parameters outside the forward) before autograd adds it to the view's ``.grad``.

    While the view holds its slice of this rank's unreduced gradient (between backwards under ``no_sync``), autograd
    would add it there in place, and the synchronising backward would average it over the ranks with FairScale's:
    each rank's slice of such a term's gradient is whole already (every rank computed the same term), so it is set
    aside and added to the reduced shard instead (:func:`_add_own_gradients`). Weakly, as :func:`_empty_grad`."""

    @torch.utils.hooks.unserializable_hook  # a pickled view (no layout: one rank) goes without it, silently
    def hook(grad: Tensor) -> Optional[Tensor]:
        viewed, flat = view(), state()
        if viewed is None or flat is None or not flat.local_given or not _holds_given(viewed, flat.given):
            return None  # as computed
        _set_aside(flat, viewed, grad)
        return torch.zeros_like(grad)

    return hook


def _set_aside(state: FlatState, view: ParamView, grad: Tensor) -> None:
    key = id(view.param)
    grad = sharded_reads.local_slice(grad).detach()
    kept = state.pending.get(key)
    state.pending[key] = grad.clone() if kept is None else kept.add_(grad)


def forget(state: Optional[FlatState]) -> None:
    """Unregister every view of a flat parameter (``state``: its record; a new layout of the same model makes its
    own: the optimizers of an earlier stage, which hold the old ones, are gone or no longer stepped)."""
    if state is not None:
        state.views, state.grad_shared, state.given, state.local_given, state.pending = [], False, {}, False, {}


def views_of(state: Optional[FlatState]) -> list[ParamView]:
    """The views registered on this rank with a flat parameter (``state``: its record, ``None``: it has none)."""
    return state.views if state is not None else []


def gets_gradient(view: ParamView) -> bool:
    """Whether ``view`` is given its slice of the flat gradient: it trained when its unit last computed
    (``trainable``, kept up to date by :mod:`~lightning_fairscale.fsdp.unit.step_state`) and it still does, as an
    unsharded parameter gets a gradient only if it required one in the forward and still does in the backward."""
    return view.trainable and view.param.requires_grad


def trainable_views(states: Iterable[Optional[FlatState]]) -> list[nn.Parameter]:
    """The view parameters of trainable original parameters among the views of flat parameters (``states``: their
    records)."""
    return [view.param for state in states for view in views_of(state) if gets_gradient(view)]


@torch.no_grad()
def take_back_gradients(managed: nn.Parameter, state: Optional[FlatState]) -> None:
    """Before a backward: make ``managed.grad`` reflect what was done to its views' gradients since they got them.

    All dropped (``zero_grad()``): the flat gradient is dropped, the backward starts afresh. Some dropped (an
    optimizer over part of the unit zeroed its own): their slices are zeroed. Otherwise (accumulating over
    synchronising backwards, or ``zero_grad(set_to_none=False)``, which zeroes the shared slices in place) the flat
    gradient is kept, and FairScale accumulates into it. A view's gradient is dropped when it is no longer the one
    it was given: ``None``, or one the backward has begun computing for the view itself (a term on the model's
    parameters outside its forward, whose gradient reaches the view before this unit's backward starts). A view
    frozen since (``requires_grad=False``) keeps the gradient it holds, as a frozen parameter of an unsharded model
    does, but apart from the flat gradient: nothing accumulates into it (workaround 28). ``state``: ``managed``'s
    record.
    """
    if state is None or not state.grad_shared:
        return
    state.grad_shared = False
    if managed.grad is None:
        return
    given = state.given
    views = [view for view in state.views if view.start < view.stop]
    kept = []
    for view in views:
        if not _holds_given(view, given):
            continue
        if view.param.requires_grad:
            kept.append(view)
        else:
            view.param.grad = view.param.grad.clone()  # type: ignore[union-attr]
    if not kept:
        managed.grad = None
        return
    flat = managed.grad.view(-1)
    for view in views:
        if view not in kept:
            flat[view.start : view.stop].zero_()


def _holds_given(view: ParamView, given: dict[int, Any]) -> bool:
    ref = given.get(id(view.param))
    return view.param.grad is not None and ref is not None and view.param.grad is ref()


def mark_has_views(root: nn.Module) -> None:
    """Record that the optimizers of ``root``'s model hold views (so its gradient holders are views, on every rank)."""
    unit_state.owner_of(root).has_views = True


def has_views(root: nn.Module) -> bool:
    """Whether :func:`mark_has_views` was called for ``root``."""
    state = unit_state.peek_owner(root)
    return state is not None and state.has_views


@torch.no_grad()
def repoint_data(managed: nn.Parameter, state: Optional[FlatState]) -> None:
    """Point every view of ``managed`` (``state``: its record) at its current shard (FairScale replaces it with a
    pinned copy at its lazy initialisation when shards live in CPU memory)."""
    shard = _shard(managed)
    for view in views_of(state):
        view.param.data = shard[view.start : view.stop]


def _add_own_gradients(state: FlatState, views: list[ParamView], flat: Tensor) -> None:
    """Add into ``flat`` (the flat gradient shard) what the backward gave the views themselves: a term computed on
    the model's parameters outside its forward (``sum(p.pow(2).sum() for p in model.parameters())``) reaches the
    views, not FairScale's flat parameter; and what the backwards under ``no_sync`` before it gave them (set aside).
    A gradient this module gave a view (its slice of FairScale's reduced gradient, to which autograd adds in place
    when accumulating over synchronising backwards) is FairScale's already. Each rank holds its slice of such a
    term's gradient whole: no reduction, as for an unsharded model's parameter."""
    pending, state.pending, state.local_given = state.pending, {}, False
    for view in views:
        if not gets_gradient(view) or view.start == view.stop:
            continue
        own = view.param.grad
        if own is not None and not _holds_given(view, state.given):
            flat[view.start : view.stop].add_(own.reshape(-1).to(flat.dtype))
        kept = pending.get(id(view.param))
        if kept is not None:
            flat[view.start : view.stop].add_(kept.to(flat.dtype))


def _give(state: FlatState, view: ParamView, grad: Tensor) -> None:
    layout = sharded_reads.layout_of(view.param)
    if layout is not None:  # a gradient that knows it is sharded, as its parameter
        grad = sharded_reads.mark(grad, layout)
    view.param.grad = grad
    # Weakly: the gradient is freed with the view's reference to it (`zero_grad()`), as FairScale's is.
    state.given[id(view.param)] = weakref.ref(grad)


@torch.no_grad()
def share_local_gradients(managed: nn.Parameter, state: FlatState, rank: int) -> None:
    """After a backward that did not synchronise (``no_sync``, accumulating): give each trainable view its slice of
    this rank's own gradient, not reduced yet (FairScale holds it unsharded until the synchronising backward), as
    DDP's parameters hold theirs in ``no_sync``. Its dtype must be the view's (under mixed precision it is the compute
    dtype: the views then get none until the synchronising backward). Changing them changes nothing: the
    synchronising backward reduces FairScale's gradient and gives the views its shard. ``state``: ``managed``'s
    record."""
    grad = managed.grad
    shard = _shard(managed)
    if grad is None or grad.dtype != shard.dtype:
        return
    flat = grad.view(-1)  # the whole parameter's (one rank alone: its shard is the whole parameter)
    offset = min(rank * shard.numel(), flat.numel()) if getattr(managed, "_is_sharded", False) else 0
    for view in state.views:
        if gets_gradient(view) and view.start < view.stop:
            own = view.param.grad
            if own is None:  # dropped since (`zero_grad()`): what was set aside for it goes too
                state.pending.pop(id(view.param), None)
            elif not _holds_given(view, state.given):
                # A term on the parameter outside the forward, in the first backward since the gradients were
                # dropped: whole already, set aside for the synchronising backward (the later ones' go through the
                # view's hook, `_set_aside_under_no_sync`).
                _set_aside(state, view, own)
            if view.hook is None:  # it requires a gradient now (`gets_gradient`)
                view.hook = view.param.register_hook(_set_aside_under_no_sync(weakref.ref(view), weakref.ref(state)))
            _give(state, view, flat[offset + view.start : offset + view.stop])
    state.local_given = True


@torch.no_grad()
def share_gradients(managed: nn.Parameter, state: Optional[FlatState]) -> None:
    """After a synchronising backward: point every view at the current shard, and give the trainable ones their
    slice of the flat gradient shard (a view: clipping or unscaling them changes the flat gradient too). ``state``:
    ``managed``'s record."""
    views = views_of(state)
    if state is None or not views:
        return
    repoint_data(managed, state)
    if state.grad_shared:
        # Given already, and not taken back since: this backward did not reach the unit (its gradient is the last
        # one's, which the views may have dropped since: not given again).
        return
    shard = _shard(managed)
    grad = managed.grad
    shares = grad is not None and grad.numel() == shard.numel()  # a shard, not an unsharded accumulation
    if shares:
        _add_own_gradients(state, views, grad.view(-1))  # type: ignore[union-attr]
    for view in views:
        # A view of no element of this shard gets no gradient (as torch FSDP's original parameters outside the
        # shard): an optimizer then keeps no state for it.
        if gets_gradient(view) and shares and view.start < view.stop:
            _give(state, view, grad.view(-1)[view.start : view.stop])  # type: ignore[union-attr]
    if shares:
        state.grad_shared = True
