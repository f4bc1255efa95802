"""Workaround 11 of :mod:`lightning_fairscale.fsdp.patches.workarounds`: frozen and trainable parameters in one unit.

FairScale flattens a unit's parameters into one flat parameter, with one ``requires_grad``, and asserts that they
all agree. A unit that owns frozen and trainable parameters is built with all of them trainable
(:func:`unfreeze_own_parameters`), and which pieces were frozen is noted for each flat parameter
(:func:`record_frozen`, in its :class:`~lightning_fairscale.fsdp.unit.unit_state.FlatState`): the optimizer's views
of those pieces keep ``requires_grad=False`` (:mod:`lightning_fairscale.fsdp.unit.param_views`), so nothing updates
them.
"""

from __future__ import annotations

from typing import Optional

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP

from lightning_fairscale.fsdp.unit import param_views, unit_state

__all__ = ["frozen_pieces", "record_frozen", "reshard_frozen", "trainable_pieces", "unfreeze_own_parameters"]


def unfreeze_own_parameters(module: torch.nn.Module) -> dict[tuple[int, str], torch.nn.Parameter]:
    """Make the frozen parameters that this unit will own (not those of units inside it) trainable; returns them,
    by ``(id(owner module), name)``, so that they can be frozen again."""
    frozen: dict[tuple[int, str], torch.nn.Parameter] = {}
    inner = {id(p) for unit in module.modules() if isinstance(unit, _FairScaleFSDP) for p in unit.params}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and not param.requires_grad and id(param) not in inner:
                frozen[(id(owner), name)] = param
    own = {id(p) for p in module.parameters()} - inner
    if {id(p) for p in frozen.values()} == own:
        return {}  # all frozen: FairScale handles a frozen unit as it is
    for param in frozen.values():
        param.requires_grad_(True)
    return frozen


def record_frozen(unit: _FairScaleFSDP, frozen: dict[tuple[int, str], torch.nn.Parameter]) -> None:
    """Note which pieces of each flat parameter of ``unit`` were frozen (its ``FlatState.frozen``), and
    freeze a parameter whose pieces all were (a unit's unflattened parameters keep their own flag)."""
    if not frozen:
        return
    flat_count = unit._num_flatten_params
    for flat in unit.params[:flat_count]:
        pieces = [(id(owner), name) in frozen for _, owner, name in flat._param_infos]
        unit_state.flat_record(unit, flat).frozen = pieces
        if all(pieces):
            flat.requires_grad_(False)
    for param in unit.params[flat_count:]:
        if any(param is p for p in frozen.values()):
            param.requires_grad_(False)


def reshard_frozen(root: _FairScaleFSDP) -> None:
    """Free a root unit's gathered frozen parameters after a backward, as FairScale's post-backward hook frees a
    trainable parameter's and under the same condition (workaround 15 of
    :mod:`lightning_fairscale.fsdp.patches.workarounds`)."""
    frozen = [param for param in root.params if not param.requires_grad]
    if not frozen or not (root._require_backward_grad_sync or root.reshard_after_forward):
        return
    root._free_full_params(frozen)
    if root.mixed_precision:
        root._free_fp16_param_shard(frozen)
    root._use_fp32_param_shard(frozen)


def frozen_pieces(state: Optional[unit_state.FlatState]) -> Optional[list[bool]]:
    """Which original parameters of a flat parameter (``state``: its record) were frozen when its unit was built
    (:func:`record_frozen`), ``None`` when none was recorded (a unit whose parameters all agreed)."""
    return state.frozen if state is not None else None


def trainable_pieces(flat: torch.nn.Parameter, state: Optional[unit_state.FlatState]) -> list[bool]:
    """Whether each original parameter of ``flat`` (a flat parameter; ``state``: its record) trains: as its view says
    now (the model's parameter, which the loop may have frozen or unfrozen since set-up: workaround 28), else as it
    did at set-up."""
    infos = flat._param_infos  # type: ignore[attr-defined]
    views = {view.piece: view for view in param_views.views_of(state)}
    if len(views) == len(infos):
        return [views[k].param.requires_grad for k in range(len(infos))]
    frozen = frozen_pieces(state) or [False] * len(infos)
    return [flat.requires_grad and not is_frozen for is_frozen in frozen]
