"""Parts of Fabric's FSDP strategy (:class:`lightning_fairscale.fabric.DDPFullyShardedStrategy`) that are plain
functions over it: the sharded checkpoint's save and load (the ``ShardedFormat`` of its ``FabricCheckpoints``), a
filtered sharded save, the average over the shards, the unsharded shapes for an optimizer made after set-up, and the
units' recovery after an exception in a backward. Kept apart so that the strategy's class holds its hooks and
settings (`make lightning` copies this module for the unified package too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Optional

from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale._compat import collective_timeout
from lightning_fairscale.checkpoint.fabric import Roles, optimizer_positions, restore
from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.state.averaging import ShardAveragedModel
from lightning_fairscale.fsdp.state.saving import Ranks
from lightning_fairscale.plugins.checkpoint_io import in_background, sharded_storage

__all__ = ["averaged_model", "filtered_state", "load_sharded", "recover", "save_sharded", "unsharded_shapes"]


def _model(module: Any) -> Optional[fsdp_engine.WrappedModel]:
    """The sharded model ``module`` is the root unit of, when it was set up."""
    return fsdp_engine.wrapped_model(module) if fsdp_engine.is_set_up(module) else None


def filtered_state(strategy: Any, module: Module, keep: Callable[[str, Any], bool]) -> tuple[dict[str, Any], list[str]]:
    """This rank's sharded state of ``module`` with the keys ``keep`` keeps (``fabric.save(..., filter=...)``)."""
    model = _model(module)
    assert model is not None
    return model.filtered_local_state(keep)


def save_sharded(
    strategy: Any, checkpoint: dict[str, Any], roles: Roles, path: Any, module: Module, optimizers: list[Any]
) -> None:
    """Every rank writes its shard of the checkpoint directory ``path`` (in the background with such a plugin)."""
    model = _model(module)
    assert model is not None
    io = strategy.checkpoint_io
    background = in_background(io, collective_timeout(strategy))
    ranks, storage = Ranks(strategy.global_rank), sharded_storage(io)
    model.save_sharded(ranks, storage, checkpoint, path, optimizers, roles.record(), background)


def load_sharded(
    strategy: Any, path: Any, state: dict[str, Any], roles: Roles, strict: bool, weights_only: Optional[bool]
) -> dict[str, Any]:
    """Load a sharded checkpoint directory into the set-up model (and optimizers) of ``state``; the rest returned."""
    model = _model(state[roles.model]) if roles.model else None
    if model is None:
        raise ValueError(
            f"{path} is a sharded checkpoint: the state to load needs the model set up with this strategy, as"
            " `fabric.load(path, {'model': model, ...})`."
        )

    def restored(meta: dict[str, Any], saved: int) -> list[tuple[int, Optimizer]]:
        positions = optimizer_positions(meta, roles, saved, strict)
        return [(position, state[key]) for position, key in positions]

    storage = sharded_storage(strategy.checkpoint_io, saving=False)
    meta, _ = model.load_sharded(Ranks(strategy.global_rank), storage, path, restored, weights_only, strict)
    return restore(meta, state, roles, strict, load_model=None, load_optimizer=None)


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
    """The context of :meth:`~lightning_fairscale.fsdp.engine.WrappedModel.unsharded_shapes` for a set-up model."""
    root = getattr(module, "_forward_module", module)  # what `fabric.setup_module` returned, or the unit itself
    model = _model(getattr(root, "_orig_mod", root))  # compiled by Fabric: the unit inside
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
