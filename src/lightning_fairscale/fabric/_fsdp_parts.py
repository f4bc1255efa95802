"""``fabric.save`` and ``fabric.load`` of Fabric's FSDP strategy
(:class:`lightning_fairscale.fabric.DDPFullyShardedStrategy`): both formats through the checkpointer
(:mod:`lightning_fairscale.checkpointer`), in Fabric's file layout, with the strategy's CheckpointIO plugin.
Functions over the models the strategy set up (:class:`~lightning_fairscale.fabric._fsdp_set_up.FsdpSetUp`), its
options, and Lightning's public members of the strategy (its plugin, rank, and state dict methods). Kept apart so
that the strategy's class holds its hooks and settings (`make lightning` copies this module for the unified package
too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

from lightning_fabric.strategies import DDPStrategy
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale import checkpointer
from lightning_fairscale._compat import collective_timeout
from lightning_fairscale.checkpoint.fabric import Roles
from lightning_fairscale.checkpointer import FabricLayout, Files
from lightning_fairscale.fabric._fsdp_set_up import FsdpSetUp, sharded_model
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.state.saving import is_sharded_checkpoint
from lightning_fairscale.plugins.checkpoint_io import checkpoint_files

__all__ = ["load", "save"]


def save(
    strategy: DDPStrategy, set_up: FsdpSetUp, config: FullyShardedConfig, path: Any, state: dict[str, Any],
    storage_options: Optional[Any], filter: Optional[dict[str, Callable[[str, Any], bool]]],
) -> None:
    """``fabric.save``: with ``state_dict_type="sharded"``, every rank writes its shard of the checkpoint directory
    ``path`` (in the background with such a plugin), gathering nothing; else the full states (the strategy's
    ``get_module_state_dict`` and ``get_optimizer_state``), gathered on rank 0, in one file (also where
    ``state_dict_type="sharded"`` has no set-up model to shard)."""
    roles = Roles.of(state, set_up.is_ours)
    model = sharded_model(state[roles.model]) if roles.model else None
    sharded = model is not None and config.state_dict_type == "sharded"
    files = checkpoint_files(strategy.checkpoint_io, strategy.global_rank, collective_timeout(strategy), sharded)
    if model is not None and sharded:
        return checkpointer.save_sharded(model.settled(), files, path, state, FabricLayout(roles, filter))
    states = {  # collective calls, in the state's order on every rank
        key: strategy.get_module_state_dict(value) if key == roles.model else strategy.get_optimizer_state(value)
        for key, value in state.items()
        if key == roles.model or key in roles.optimizers
    }
    return checkpointer.save_full(files, path, state, storage_options, (FabricLayout(roles, filter), states))


def load(
    strategy: DDPStrategy, set_up: FsdpSetUp, path: Any, state: Optional[Union[Module, Optimizer, dict[str, Any]]],
    strict: bool, weights_only: Optional[bool],
) -> dict[str, Any]:
    """``fabric.load``: restore ``state`` from a checkpoint (Fabric's or the Trainer's, full or sharded); returns what
    the state did not ask for."""
    files = checkpoint_files(strategy.checkpoint_io, strategy.global_rank)
    if is_sharded_checkpoint(files.storage, path):
        return _load_sharded(set_up, files, path, state, strict, weights_only)
    roles = Roles.of(state, set_up.is_ours) if isinstance(state, dict) and state else None
    keys = set_up.model_keys(state) if isinstance(state, Module) else None
    restored = checkpointer.read_fabric(files, path, state, roles, keys, strict, weights_only)
    for obj, value in restored.loads:
        if isinstance(obj, Optimizer):
            set_up.load_optimizer(obj, value)
        else:
            strategy.load_module_state_dict(obj, value, strict)
    return restored.rest


def _load_sharded(
    set_up: FsdpSetUp, files: Files, path: Any, state: Optional[Union[Module, Optimizer, dict[str, Any]]],
    strict: bool, weights_only: Optional[bool],
) -> dict[str, Any]:
    """A sharded checkpoint directory into the set-up model (and optimizers) of ``state``; the rest returned."""
    if isinstance(state, Module) and set_up.is_ours(state):  # `fabric.load_raw`: the model's part
        model = sharded_model(state)
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
    roles = Roles.of(state, set_up.is_ours)
    model = sharded_model(state[roles.model]) if roles.model else None
    if model is None:
        raise ValueError(
            f"{path} is a sharded checkpoint: the state to load needs the model set up with this strategy, as"
            " `fabric.load(path, {'model': model, ...})`."
        )
    return checkpointer.load(model.settled(), files, path, FabricLayout(roles), strict, weights_only, state=state)
