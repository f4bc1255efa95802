# Generated from lightning_fairscale/fabric/_common.py by `make lightning`: do not edit.
"""What the Fabric strategies share: the Fabric side of their adapters (precision plugins, skipping the gradient
synchronization, clipping by norm, and ``fabric.save``/``fabric.load`` of Fabric's checkpoints and the Trainer's)."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, Union

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_fairscale.lightning._compat import fabric_precision_slot, set_fabric_precision_slot
from lightning_fairscale.lightning._compat import _BackwardSyncControl
from lightning_fairscale.lightning._compat import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.checkpoint.fabric import Roles, convert, model_state_of, restore
from lightning_fairscale.fsdp.engine import is_sharded_checkpoint
from lightning_fairscale.mixed_precision.settings import unsupported

__all__ = ["FabricAdapter", "NoBackwardSync", "fabric_precision"]


class FabricAdapter:
    """The part of the Fabric strategies that Fabric's API asks of both; a base class of each, before the options.

    The strategy provides the hooks: :meth:`_is_ours` (a model it set up), :meth:`_model_state` and
    :meth:`_optimizer_state` (collective calls, full or sharded), :meth:`_model_keys`, :meth:`_load_optimizer`,
    :meth:`_clip_by_norm`, and, for the sharded format, :meth:`_saves_sharded`, :meth:`_save_sharded` and
    :meth:`_load_sharded`.
    """

    # Attributes of the Lightning base strategy.
    _precision: Optional[Precision]
    checkpoint_io: Any
    is_global_zero: bool
    load_module_state_dict: Callable[..., None]
    #: Makes the strategy's fp16 loss scaler for a device (its inf/NaN checks agree across ranks).
    _grad_scaler: Callable[[str], Any]

    def _init_adapter(self) -> None:
        """Set up the adapter's state: at the end of ``__init__``, and again when unpickled."""
        self._backward_sync_control = NoBackwardSync()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for `start_method="spawn"`, before anything is set up: the registries of set-up models and
        # optimizers (weak references, which do not pickle) are made again in each process.
        weak = (weakref.WeakSet, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)
        return {name: value for name, value in self.__dict__.items() if not isinstance(value, weak)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_adapter()

    @property
    def precision(self) -> Precision:
        precision = fabric_precision_slot(self)
        return precision if precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        plugin = fabric_precision(precision, type(self).__name__, self._grad_scaler)
        set_fabric_precision_slot(self, plugin)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of all ranks' gradients together (the unsharded model's norm), after unscaling fp16
        gradients; returns that norm."""
        self.precision.unscale_gradients(optimizer)
        norm = self._clip_by_norm(optimizer, max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} of the gradients is non-finite ({norm.item()}). Pass"
                " `error_if_nonfinite=False` to `fabric.clip_gradients` to clip anyway."
            )
        return norm

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Save the state as Lightning's Fabric strategies do (see :mod:`lightning_fairscale.checkpoint.fabric`): the
        state's keys, each module and optimizer replaced by its full state dict, in one file written by rank 0; or,
        for a model sharded with ``state_dict_type="sharded"``, a directory of one shard per rank, gathering nothing,
        and a meta file with the state's other entries."""
        roles = Roles.of(state, self._is_ours)
        model = state[roles.model] if roles.model else None
        sharded = model is not None and self._saves_sharded(model)
        if sharded and filter:
            raise ValueError(
                '`fabric.save(..., filter=...)` cannot filter a sharded checkpoint (`state_dict_type="sharded"`): its'
                " shards must hold whole FSDP units. Save without `filter`, or use a full checkpoint."
            )
        converted = convert(
            state,
            roles,
            lambda module: self._model_state(module, sharded),
            lambda optimizer: self._optimizer_state(optimizer, sharded),
            filter,
        )
        if sharded:
            self._save_sharded(converted, roles, path, model, [state[key] for key in roles.optimizers])
        elif self.is_global_zero:
            self.checkpoint_io.save_checkpoint(converted, path, storage_options=storage_options)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint (Fabric's or the Trainer's, saved by any number of processes) into
        the shards of this rank, reading only those; returns what the state did not ask for.

        ``fabric.load_raw(path, model)`` reads a plain state dict file, the model's entry of a full checkpoint, or
        the model's part of a sharded checkpoint. With ``strict=False`` the model's entries that the checkpoint lacks
        keep their values and its other entries are ignored; the entries of ``state`` that the checkpoint lacks are
        left as they are."""
        io = self.checkpoint_io
        sharded = is_sharded_checkpoint(io, path)
        if sharded and isinstance(state, Module) and self._is_ours(state):  # `fabric.load_raw`: the model's part
            self._load_sharded(path, {"model": state}, Roles(model="model"), strict, weights_only)
            return {}
        if sharded and (not isinstance(state, dict) or not state):
            raise ValueError(
                f"{path} is a sharded checkpoint: it loads into a model set up with this strategy, as"
                " `fabric.load(path, {'model': model, ...})` or `fabric.load_raw(path, model)`. To read it whole,"
                " consolidate it first: `lightning-fairscale-consolidate`."
            )
        if not state:
            return io.load_checkpoint(path, weights_only=weights_only)
        if isinstance(state, Module):  # `fabric.load_raw`: a module's state dict
            file = io.load_checkpoint(path, weights_only=weights_only)
            self.load_module_state_dict(state, dict(model_state_of(file, self._model_keys(state))), strict=strict)
            return {}
        if isinstance(state, Optimizer):  # `fabric.load_raw`: a plain optimizer's state
            self._load_optimizer(state, io.load_checkpoint(path, weights_only=weights_only))
            return {}
        roles = Roles.of(state, self._is_ours)
        if sharded:
            return self._load_sharded(path, state, roles, strict, weights_only)
        checkpoint = io.load_checkpoint(path, weights_only=weights_only)

        def load_model(module: Module, state_dict: dict[str, Any]) -> None:
            self.load_module_state_dict(module, state_dict, strict=strict)

        return restore(checkpoint, state, roles, strict, load_model, self._load_optimizer)

    # Hooks

    def _is_ours(self, module: Module) -> bool:
        raise NotImplementedError

    def _model_state(self, module: Module, sharded: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _optimizer_state(self, optimizer: Optimizer, sharded: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _model_keys(self, module: Module) -> list[str]:
        """The keys of the state dict of ``module`` (unwrapped), without gathering anything."""
        raise NotImplementedError

    def _load_optimizer(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _clip_by_norm(self, optimizer: Optimizer, max_norm: Union[float, int], norm_type: Union[float, int]) -> Tensor:
        raise NotImplementedError

    def _saves_sharded(self, module: Module) -> bool:
        return False

    def _save_sharded(
        self, checkpoint: dict[str, Any], roles: Roles, path: _PATH, module: Module, optimizers: list[Any]
    ) -> None:
        raise NotImplementedError

    def _load_sharded(
        self, path: _PATH, state: dict[str, Any], roles: Roles, strict: bool, weights_only: Optional[bool]
    ) -> dict[str, Any]:
        raise NotImplementedError


class NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: FairScale's ``no_sync`` of the root FSDP unit or ``ShardedDataParallel``.

    Inside it, backward keeps this rank's gradients (whole, for FSDP) and reduces nothing; the first backward outside
    it reduces what was accumulated, so the result equals one backward over all the micro-batches.
    """

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, (FullyShardedDataParallel, ShardedDataParallel)):
            raise TypeError(
                "`fabric.no_backward_sync(model)` needs the model that `fabric.setup` returned (FairScale's"
                f" FullyShardedDataParallel or ShardedDataParallel inside), got {type(module).__name__}."
            )
        return module.no_sync()


def fabric_precision(plugin: Optional[Precision], strategy: str, scaler: Callable[[str], Any]) -> Optional[Precision]:
    """The precision plugin ``strategy`` trains with, for one Fabric made from its ``precision`` flag.

    Full precision, mixed precision (``"16-mixed"``, ``"bf16-mixed"``) and true half precision (``"16-true"``,
    ``"bf16-true"``) are Fabric's own plugins; fp16 mixed precision gets a sharded grad scaler instead of Fabric's,
    whose inf/NaN checks agree across ranks (each rank checks its own gradient shards: with a plain scaler, ranks
    would skip different steps and their models drift apart). True half precision needs nothing of the strategy's
    own: the model is converted before it is wrapped, and the strategy clips by the norm of all shards itself.

    Raises:
        ValueError: another precision (``"64-true"``, ``"transformer-engine"``...); the message names those that
            work.
    """
    if plugin is None or type(plugin) is Precision or isinstance(plugin, HalfPrecision):
        return plugin
    if isinstance(plugin, MixedPrecision):
        if plugin.scaler is not None:
            wanted = scaler(plugin.device)
            if type(plugin.scaler) is not type(wanted):
                plugin.scaler = wanted
        return plugin
    raise unsupported(strategy, plugin, "`Fabric(precision=...)`")
