"""What Fabric's FSDP strategy set up, and the engine's calls over it: the sharded models (the engine's
:class:`~lightning_fairscale.fsdp.model.WrappedModel`, held by their root units) and the sharded model each optimizer
was re-pointed to.

The strategy (:class:`lightning_fairscale.fabric.DDPFullyShardedStrategy`) translates each of Fabric's calls into
one call here or on a ``WrappedModel``: ``setup_optimizer`` is :meth:`FsdpSetUp.repoint`, a failed backward
:meth:`FsdpSetUp.recover`, ``averaged_model`` :meth:`FsdpSetUp.averaged_model`... It holds one :class:`FsdpSetUp`;
``fabric.save`` and ``fabric.load`` (:mod:`~lightning_fairscale.fabric._fsdp_parts`) take it too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional

from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale._compat import forward_module
from lightning_fairscale.fabric._common import SetUp, refuse_groups_by_shard_shapes
from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.model import WrappedModel
from lightning_fairscale.fsdp.state.averaging import ShardAveragedModel
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.wrapping.compile import unwrap_compiled

__all__ = ["FsdpSetUp", "sharded_model", "unsharded_shapes"]


def sharded_model(module: Module) -> Optional[WrappedModel]:
    """The sharded model ``module`` is the root unit of, when it was set up (by this strategy or another)."""
    return fsdp_engine.wrapped_model(module) if fsdp_engine.is_set_up(module) else None


def unsharded_shapes(module: Module) -> AbstractContextManager[None]:
    """The context of :meth:`~lightning_fairscale.fsdp.model.WrappedModel.unsharded_shapes` for a set-up model:
    what ``fabric.setup_module`` returned, or the root unit itself (compiled by Fabric: the unit inside)."""
    model = sharded_model(unwrap_compiled(forward_module(module))[0])
    if model is None:
        raise ValueError("`unsharded_shapes` takes a model set up with this strategy (`fabric.setup_module`).")
    instead = "read or set values outside it (each parameter then holds this rank's shard of it)."
    return model.unsharded_shapes("inside `fabric.strategy.unsharded_shapes(model)`", instead)


class FsdpSetUp:
    """The sharded models a Fabric FSDP strategy set up (their root units, held weakly: the user's references keep
    them alive) and the sharded model of each optimizer it re-pointed; empty again in a process it is pickled to
    (see :class:`~lightning_fairscale.fabric._common.SetUp`)."""

    def __init__(self) -> None:
        self._held: SetUp[WrappedModel] = SetUp()

    @property
    def roots(self) -> list[Module]:
        """The root units of the models set up and still alive."""
        return list(self._held.models)

    def add(self, model: WrappedModel) -> FullyShardedDataParallel:
        """Hold the sharded model ``model``; returns its root unit (what ``fabric.setup_module`` returns)."""
        self._held.models.add(model.root)
        return model.root

    def repoint(self, optimizer: Optimizer, config: FullyShardedConfig) -> None:
        """Re-point ``optimizer`` to the shards of the model whose parameters it holds, on the path ``config``
        chooses (refused when its param groups were made from the shards' shapes); one re-pointed already stays as
        it is, with its state.

        Raises:
            ValueError: the optimizer holds a parameter of no model set up here.
        """
        params = [param for group in optimizer.param_groups for param in group["params"]]
        held = self._held.optimizers.get(optimizer)
        if held is not None and all(held.knows(param) for param in params):
            return  # set up again (`fabric.setup_optimizers` of the same optimizer): it steps on the shards already,
            # and re-pointing it again would drop its state (its parameters' views are made anew)
        for root in self._held.models:
            model = fsdp_engine.wrapped_model(root)
            if params and all(model.knows(param) for param in params):
                refuse_groups_by_shard_shapes(model.param_group_problem(optimizer), optimizer)
                model.repoint(optimizer, path=config.optimizer_path, owner=config.owner)
                self._held.optimizers[optimizer] = model
                return
        raise ValueError(
            "The optimizer holds parameters that are not those of a model set up with this strategy. Create it over"
            " `model.parameters()`, before `fabric.setup(model, optimizer)` (or over the parameters of the model that"
            " `fabric.setup_module` returned), and keep every trained module inside that model."
        )

    def holds(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` was re-pointed here."""
        return optimizer in self._held.optimizers

    def model_of(self, optimizer: Optimizer) -> WrappedModel:
        """The sharded model ``optimizer`` was re-pointed to.

        Raises:
            ValueError: it was not set up here.
        """
        if optimizer not in self._held.optimizers:
            raise ValueError(
                f"The {type(optimizer).__name__} was not set up with this strategy: pass it to `fabric.setup` or"
                " `fabric.setup_optimizers` before saving or loading it."
            )
        return self._held.optimizers[optimizer]

    def abort_steps(self, optimizer: Optimizer) -> None:
        """After a step of ``optimizer`` (plain or Fabric's wrapper) raised: see :meth:`WrappedModel.abort_steps`."""
        model = self._held.optimizers.get(getattr(optimizer, "optimizer", optimizer))
        if model is not None:
            model.abort_steps()

    def recover(self) -> None:
        """Every model set up here as its last completed step left it (after an exception in a backward)."""
        for root in self.roots:
            model = sharded_model(root)
            if model is not None:
                model.recover()

    def averaged_model(self, module: Module, is_global_zero: bool, **kwargs: Any) -> ShardAveragedModel:
        """``AveragedModel(module, **kwargs)`` over this rank's shards of a model set up here (``module`` or the
        model that holds it): its ``state_dict()`` is the model's full state dict (on rank 0, ``is_global_zero``)."""
        root = next((m for m in module.modules() if m in self._held.models), None)
        model = sharded_model(root) if root is not None else None
        if root is None or model is None:
            raise ValueError("Pass the model that `fabric.setup` returned: this one is not set up with this strategy.")

        def model_state() -> dict[str, Any]:
            return model.state_dict(sharded=False, is_global_zero=is_global_zero)

        def load_full(state_dict: dict[str, Any]) -> None:
            model.load_full(state_dict, strict=True)

        return ShardAveragedModel(root, model_state, root=root, load_full=load_full, **kwargs)

    # Checkpoints (for ``fabric.save``/``fabric.load`` and the strategy's state dict methods)

    @staticmethod
    def is_ours(module: Module) -> bool:
        """Whether ``module`` is the root unit of a sharded model set up (by this strategy or another)."""
        return fsdp_engine.is_set_up(module)

    @staticmethod
    def model_state(module: Module, sharded: bool, is_global_zero: bool) -> dict[str, Any]:
        """A set-up model's state dict, full on rank 0 or this rank's shards (a collective call); another module's."""
        model = sharded_model(module)
        return module.state_dict() if model is None else model.state_dict(sharded, is_global_zero)

    @staticmethod
    def model_keys(module: Module) -> list[str]:
        """The keys of ``module``'s state dict (a set-up model's: the unwrapped module's), gathering nothing."""
        model = sharded_model(module)
        return model.state_dict_keys() if model is not None else list(module.state_dict())

    def optimizer_state(self, optimizer: Optimizer, sharded: bool) -> dict[str, Any]:
        """The state of an optimizer re-pointed here: a plain optimizer's over the unwrapped module on rank 0, or
        this rank's over its shards (a collective call)."""
        return self.model_of(optimizer).optimizer_state(optimizer, sharded)

    def load_optimizer(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """Load a plain optimizer's full state into ``optimizer`` (this rank's shards, where it was re-pointed)."""
        if optimizer not in self._held.optimizers:
            optimizer.load_state_dict(state)
            return
        self._held.optimizers[optimizer].load_optimizer_state(optimizer, state)
