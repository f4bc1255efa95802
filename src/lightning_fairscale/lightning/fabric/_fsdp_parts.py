# Generated from lightning_fairscale/fabric/_fsdp_parts.py by `make lightning`: do not edit.
"""Parts of Fabric's FSDP strategy (:class:`lightning_fairscale.fabric.DDPFullyShardedStrategy`) that are plain
functions over it: ``fabric.save`` and ``fabric.load`` (both formats through the checkpointer,
:mod:`lightning_fairscale.checkpointer`, in Fabric's file layout, with the strategy's CheckpointIO plugin), the
average over the shards, the unsharded shapes for an optimizer made after set-up, and the units' recovery after an
exception in a backward. Kept apart so that the strategy's class holds its hooks and settings (`make lightning`
copies this module for the unified package too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Optional, Union

from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale import checkpointer
from lightning_fairscale.lightning._compat import collective_timeout
from lightning_fairscale.checkpoint.fabric import Roles
from lightning_fairscale.checkpointer import FabricLayout, Files
from lightning_fairscale.fsdp import engine as fsdp_engine, model as fsdp_model
from lightning_fairscale.fsdp.state.averaging import ShardAveragedModel
from lightning_fairscale.fsdp.wrapping.compile import unwrap_compiled
from lightning_fairscale.fsdp.state.saving import is_sharded_checkpoint
from lightning_fairscale.lightning.plugins.checkpoint_io import checkpoint_files

__all__ = ["averaged_model", "load", "recover", "save", "unsharded_shapes"]


def _model(module: Any) -> Optional[fsdp_model.WrappedModel]:
    """The sharded model ``module`` is the root unit of, when it was set up."""
    return fsdp_engine.wrapped_model(module) if fsdp_engine.is_set_up(module) else None


def save(
    strategy: Any, path: Any, state: dict[str, Any], storage_options: Optional[Any],
    filter: Optional[dict[str, Callable[[str, Any], bool]]],
) -> None:
    """``fabric.save``: with ``state_dict_type="sharded"``, every rank writes its shard of the checkpoint directory
    ``path`` (in the background with such a plugin), gathering nothing; else the full states, gathered on rank 0, in
    one file (also where ``state_dict_type="sharded"`` has no set-up model to shard)."""
    roles = Roles.of(state, strategy._is_ours)
    model = _model(state[roles.model]) if roles.model else None
    sharded = model is not None and strategy.config.state_dict_type == "sharded"
    files = checkpoint_files(strategy.checkpoint_io, strategy.global_rank, collective_timeout(strategy), sharded)
    if model is not None and sharded:
        return checkpointer.save_sharded(model.settled(), files, path, state, FabricLayout(roles, filter))
    states = {  # collective calls, in the state's order on every rank
        key: strategy._model_state(value, False) if key == roles.model else strategy._optimizer_state(value, False)
        for key, value in state.items()
        if key == roles.model or key in roles.optimizers
    }
    return checkpointer.save_full(files, path, state, storage_options, (FabricLayout(roles, filter), states))


def load(
    strategy: Any, path: Any, state: Optional[Union[Module, Optimizer, dict[str, Any]]], strict: bool,
    weights_only: Optional[bool],
) -> dict[str, Any]:
    """``fabric.load``: restore ``state`` from a checkpoint (Fabric's or the Trainer's, full or sharded); returns what
    the state did not ask for."""
    files = checkpoint_files(strategy.checkpoint_io, strategy.global_rank)
    if is_sharded_checkpoint(files.storage, path):
        return _load_sharded(strategy, files, path, state, strict, weights_only)
    roles = Roles.of(state, strategy._is_ours) if isinstance(state, dict) and state else None
    keys = strategy._model_keys(state) if isinstance(state, Module) else None
    restored = checkpointer.read_fabric(files, path, state, roles, keys, strict, weights_only)
    for obj, value in restored.loads:
        if isinstance(obj, Optimizer):
            strategy._load_optimizer(obj, value)
        else:
            strategy.load_module_state_dict(obj, value, strict)
    return restored.rest


def _load_sharded(
    strategy: Any, files: Files, path: Any, state: Optional[Union[Module, Optimizer, dict[str, Any]]], strict: bool,
    weights_only: Optional[bool],
) -> dict[str, Any]:
    """A sharded checkpoint directory into the set-up model (and optimizers) of ``state``; the rest returned."""
    if isinstance(state, Module) and strategy._is_ours(state):  # `fabric.load_raw`: the model's part
        model = _model(state)
        assert model is not None
        layout = FabricLayout(Roles(model="model"))
        checkpointer.load(model.settled(), files, path, layout, strict, weights_only, state={"model": state})
        return {}
    if not isinstance(state, dict) or not state:
        raise ValueError(
            f"{path} is a sharded checkpoint: it loads into a model set up with this strategy, as"
            " `fabric.load(path, {'model': model, ...})` or `fabric.load_raw(path, model)`. To read it whole,"
            " consolidate it first: `lightning-fairscale-consolidate`."
        )
    roles = Roles.of(state, strategy._is_ours)
    model = _model(state[roles.model]) if roles.model else None
    if model is None:
        raise ValueError(
            f"{path} is a sharded checkpoint: the state to load needs the model set up with this strategy, as"
            " `fabric.load(path, {'model': model, ...})`."
        )
    return checkpointer.load(model.settled(), files, path, FabricLayout(roles), strict, weights_only, state=state)


def averaged_model(strategy: Any, module: Module, **kwargs: Any) -> ShardAveragedModel:
    """``AveragedModel(module, **kwargs)`` over this rank's shards of a model the strategy set up."""
    root = next((m for m in module.modules() if m in strategy._set_up.models), None)
    if root is None:
        raise ValueError("Pass the model that `fabric.setup` returned: this one is not set up with this strategy.")
    return ShardAveragedModel(
        root, functools.partial(strategy.get_module_state_dict, root), root=root,
        load_full=functools.partial(strategy.load_module_state_dict, root), **kwargs,
    )  # fmt: skip


def unsharded_shapes(strategy: Any, module: Module) -> AbstractContextManager[None]:
    """The context of :meth:`~lightning_fairscale.fsdp.model.WrappedModel.unsharded_shapes` for a set-up model."""
    root = getattr(module, "_forward_module", module)  # what `fabric.setup_module` returned, or the unit itself
    model = _model(unwrap_compiled(root)[0])  # compiled by Fabric: the unit inside
    if model is None:
        raise ValueError("`unsharded_shapes` takes a model set up with this strategy (`fabric.setup_module`).")
    instead = "read or set values outside it (each parameter then holds this rank's shard of it)."
    return model.unsharded_shapes("inside `fabric.strategy.unsharded_shapes(model)`", instead)


def recover(strategy: Any) -> None:
    """Every model the strategy set up as its last completed step left it (after an exception in a backward)."""
    for root in list(strategy._set_up.models):
        model = _model(root)
        if model is not None:
            model.recover()
