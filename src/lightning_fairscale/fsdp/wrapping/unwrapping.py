"""Taking the units off again: full parameters come back unit by unit as ordinary ``nn.Parameter`` objects on the
original submodules, so the same LightningModule instance can be evaluated, saved or trained again; and the root
unit a LightningModule keeps between stages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from torch import nn

from lightning_fairscale.fsdp.unit import original_params, unit_state
from lightning_fairscale.fsdp.unit.frozen_params import trainable_pieces
from lightning_fairscale.fsdp.unit.units import fsdp_instances

__all__ = [
    "forget_root",
    "remember_root",
    "unwrap_module",
    "unwrapped",
    "wrapped_root",
]


def _full_parameters(unit: _FairScaleFSDP, device: torch.device, keep: bool) -> list[torch.Tensor]:
    """Clones of ``unit``'s own parameters, unsharded, in the order of ``unit.params`` (with ``keep=False``, empty
    tensors of their shapes on the ``meta`` device). A collective call."""
    with unit.summon_full_params(recurse=False, volatile=True):
        if not keep:
            return [torch.empty_like(p, device="meta") for p in unit.params]
        return [p.detach().to(device=device, copy=True) for p in unit.params]


def unwrap_module(root: nn.Module, device: torch.device = torch.device("cpu"), keep: bool = True) -> nn.Module:
    """Take every FSDP unit out of ``root`` and give the original submodules their full parameters back.

    Every rank gathers one unit at a time (peak memory: the largest unit, plus the result on ``device``), so all
    ranks must call this together. With ``keep=False`` this rank keeps nothing: its parameters end up on the
    ``meta`` device (so that one rank alone can hold the full model). Returns the unwrapped root (``root`` itself when
    it is not an FSDP unit).
    """
    units = list(fsdp_instances(root))
    if not units:
        return root
    original_params.forget(root)  # FairScale's own layout, which its unflattening expects
    model_owner = unit_state.peek_owner(root)  # the records of the units wrapped by hand are its
    full = {}
    for unit in units:  # one unit at a time: each unit's gathered parameters are freed before the next is gathered
        full[id(unit)] = _full_parameters(unit, device, keep)
    for unit in units:
        if unit.mixed_precision:
            unit._cast_buffers(dtype=torch.float32)
        tensors = full[id(unit)]
        flat_count = unit._num_flatten_params
        flat_params, flat_data = unit.params[:flat_count], tensors[:flat_count]
        if flat_params:
            unit.module._unflatten_params(external_data=flat_data)
            for _, (_, module, name), trainable in _flat_pieces(unit, flat_params, model_owner):
                getattr(module, name).requires_grad_(trainable)
            for flat in flat_params:
                # The flat parameter's gradient hook refers back to its unit through autograd, a cycle that Python's
                # garbage collector cannot see: without this, every unwrapped unit (and its shards) would live on.
                _forget_fsdp_attributes(flat)
                # What we knew of it: workaround 20's record of the accumulator holds the unit's hook.
                unit_state.forget_flat(unit, flat, model_owner)
        plain = unit.params[flat_count:]
        owners = _owners(unit.module, plain) if plain and not keep else {}
        for param, data in zip(plain, tensors[flat_count:]):
            param.grad = None
            _forget_fsdp_attributes(param)
            unit_state.forget_flat(unit, param, model_owner)
            if keep:
                param.data = data
                continue
            # torch refuses `param.data = <meta tensor>` for a CPU or CUDA parameter: replace the parameter.
            replacement = nn.Parameter(data, requires_grad=param.requires_grad)
            for owner, name in owners[id(param)]:
                owner._parameters[name] = replacement
    return _replace_units(root)


def _owners(module: nn.Module, params: list[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    """For each of ``params`` (by ``id``), the modules that hold it and under which name (shared ones: several)."""
    wanted = {id(p) for p in params}
    owners: dict[int, list[tuple[nn.Module, str]]] = {id(p): [] for p in params}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and id(param) in wanted:
                owners[id(param)].append((owner, name))
    return owners


class _RootKeeper:
    """What makes a LightningModule kept sharded between stages hold its root unit: a state-dict pre-hook of the
    module's that does nothing when called. The module's parameters live in the root's flat parameters, so the root
    must live as long as the module and no longer: held by a map of ours, module and root (which holds the module)
    would live for the rest of the process; held by the module (torch's public hook registry, not an attribute of
    ours), the pair is freed with the module, by the garbage collector. Removed by :func:`forget_root`."""

    def __init__(self, root: _FairScaleFSDP) -> None:
        self.root = root

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        return None


def remember_root(module: nn.Module, root: _FairScaleFSDP) -> None:
    """Record that ``module`` is wrapped by ``root``, so that a later stage (``validate`` after ``fit``...) reuses
    the sharded model instead of gathering and wrapping it again. Not a submodule: ``root`` contains ``module``. The
    keeper is found again among ``module``'s hooks (:func:`wrapped_root`); its handle is kept by the model's owner."""
    forget_root(module)
    unit_state.owner_of(root).keeper = module.register_state_dict_pre_hook(_RootKeeper(root))


def _keepers(module: nn.Module) -> list[_RootKeeper]:
    """The :class:`_RootKeeper` hooks registered on ``module`` (by :func:`remember_root`)."""
    return [hook for hook in module._state_dict_pre_hooks.values() if isinstance(hook, _RootKeeper)]


def wrapped_root(module: nn.Module) -> Optional[_FairScaleFSDP]:
    """The root unit that wraps ``module`` (see :func:`remember_root`), or ``None`` when it is not wrapped."""
    for keeper in _keepers(module):
        if unwrapped(keeper.root) is module:
            return keeper.root
    return None


def forget_root(module: nn.Module) -> None:
    """Undo :func:`remember_root` (after unwrapping)."""
    for keeper in _keepers(module):
        owner = unit_state.peek_owner(keeper.root)
        if owner is not None and owner.keeper is not None:
            owner.keeper.remove()
            owner.keeper = None


def _flat_pieces(
    unit: nn.Module, flat_params: Iterable[nn.Parameter], owner: Optional[unit_state.RootState],
) -> Iterable[tuple[nn.Parameter, tuple[str, nn.Module, str], bool]]:
    """Each original parameter of ``flat_params`` (``unit``'s; ``owner``: its model's owner): its flat parameter,
    FairScale's ``(module name, owner, name)``, and whether it trains (as the loop left it:
    :func:`~lightning_fairscale.fsdp.unit.frozen_params.trainable_pieces`)."""
    for flat in flat_params:
        infos = flat._param_infos  # type: ignore[attr-defined]
        trains = trainable_pieces(flat, unit_state.peek_flat(unit, flat, owner))
        yield from ((flat, info, trainable) for info, trainable in zip(infos, trains))


_FSDP_PARAM_ATTRIBUTES = (
    "_is_sharded",
    "_orig_size",
    "_fp32_shard",
    "_fp16_shard",
    "_full_param_padded",
    "_cpu_grad",
    "_shard_bwd_hook",
    "_saved_grad_shard",
)


def _forget_fsdp_attributes(param: nn.Parameter) -> None:
    for name in _FSDP_PARAM_ATTRIBUTES:
        if hasattr(param, name):
            delattr(param, name)


def unwrapped(unit: _FairScaleFSDP) -> nn.Module:
    """The module ``unit`` wraps (FSDP -> FairScale's ``FlattenParamsWrapper`` -> the user's module)."""
    return unit.module.module


def _replace_units(module: nn.Module) -> nn.Module:
    """Replace every unit in the tree by the module it wraps; innermost units are handled by the recursion."""
    if isinstance(module, _FairScaleFSDP):
        return _replace_units(unwrapped(module))
    for name, child in list(module.named_children()):
        replacement = _replace_units(child)
        if replacement is not child:
            setattr(module, name, replacement)
    return module
