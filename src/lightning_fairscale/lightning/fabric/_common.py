# Generated from lightning_fairscale/fabric/_common.py by `make lightning`: do not edit.
"""What the Fabric strategies share, as values they hold and functions they call (no base class of theirs): the
models and optimizers they set up (:class:`SetUp`), ``fabric.save``/``fabric.load`` of Fabric's checkpoints and the
Trainer's (:class:`FabricCheckpoints`), skipping the gradient synchronization, the check of the clipped norm, and
the precision plugins they accept."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar, Union

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_fairscale.lightning._compat import _BackwardSyncControl
from lightning_fairscale.lightning._compat import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.checkpoint.fabric import Roles, convert, model_state_of, restore
from lightning_fairscale.fsdp.state.saving import is_sharded_checkpoint
from lightning_fairscale.mixed_precision.settings import unsupported
from lightning_fairscale.lightning.plugins.checkpoint_io import save_full, sharded_storage

__all__ = [
    "FabricCheckpoints",
    "NoBackwardSync",
    "SetUp",
    "ShardedFormat",
    "checked_norm",
    "fabric_precision",
]

#: What a strategy records of each optimizer it set up.
Record = TypeVar("Record")


class SetUp(Generic[Record]):
    """The models and optimizers a Fabric strategy set up, held weakly (the user's references keep them alive), and
    what the strategy records of each optimizer.

    Not pickled: Fabric's ``start_method="spawn"`` pickles the strategy before anything is set up, and weak
    references do not pickle, so each process starts with an empty one.
    """

    def __init__(self) -> None:
        self.models: weakref.WeakSet[Module] = weakref.WeakSet()
        self.optimizers: weakref.WeakKeyDictionary[Optimizer, Record] = weakref.WeakKeyDictionary()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(self), ()


@dataclass(frozen=True)
class ShardedFormat:
    """A strategy's sharded checkpoint format (a directory of one shard per rank), for :class:`FabricCheckpoints`."""

    #: Whether ``fabric.save`` writes this model (one the strategy set up) in the sharded format.
    saves: Callable[[Module], bool]
    #: ``save(checkpoint, roles, path, model, optimizers)``: write the converted state (each rank its shard).
    save: Callable[[dict[str, Any], Roles, _PATH, Module, list[Any]], None]
    #: ``load(path, state, roles, strict, weights_only)``: restore ``state``; returns what it did not ask for.
    load: Callable[[_PATH, dict[str, Any], Roles, bool, Optional[bool]], dict[str, Any]]
    #: ``filtered(model, keep)``: this rank's shards of what ``keep(key, value)`` keeps of the model, and the keys
    #: kept (the same on every rank); ``None``: the format cannot filter.
    filtered: Optional[Callable[[Module, Callable[[str, Any], bool]], tuple[dict[str, Any], list[str]]]] = None
    #: Whether a decision holds on every rank (a collective call), so that a filter decides alike everywhere.
    agree: Callable[[bool], bool] = lambda decision: decision


@dataclass(frozen=True)
class FabricCheckpoints:
    """``fabric.save`` and ``fabric.load`` for a strategy, from how it reads and writes the states of what it set up
    (a strategy builds one from its methods when it saves or loads; see :mod:`lightning_fairscale.checkpoint.fabric`
    for the layout).
    """

    #: The strategy's CheckpointIO plugin, and whether this process is rank 0 (it writes a full checkpoint).
    io: Any
    is_global_zero: bool
    #: Whether a module is a model the strategy set up.
    is_ours: Callable[[Module], bool]
    #: ``model_state(module, sharded)``, ``optimizer_state(optimizer, sharded)``: full (on rank 0) or this rank's
    #: shard; collective calls.
    model_state: Callable[[Module, bool], dict[str, Any]]
    optimizer_state: Callable[[Optimizer, bool], dict[str, Any]]
    #: The keys of the state dict of a module (unwrapped), known without gathering anything.
    model_keys: Callable[[Module], list[str]]
    #: ``load_model(module, state_dict, strict)`` and ``load_optimizer(optimizer, state)``: full states.
    load_model: Callable[[Module, dict[str, Any], bool], None]
    load_optimizer: Callable[[Optimizer, dict[str, Any]], None]
    #: The sharded format, for a strategy that has one.
    sharded: Optional[ShardedFormat] = None

    def save(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """``strategy.save_checkpoint``: the state's keys, each module and optimizer replaced by its full state
        dict, in one file written by rank 0; or in the sharded format, gathering nothing."""
        roles = Roles.of(state, self.is_ours)
        model = state[roles.model] if roles.model else None
        sharded = self.sharded if model is not None and self.sharded is not None and self.sharded.saves(model) else None
        if sharded is not None and filter:
            self._save_filtered(sharded, path, state, roles, filter)
            return
        converted = convert(
            state,
            roles,
            lambda module: self.model_state(module, sharded is not None),
            lambda optimizer: self.optimizer_state(optimizer, sharded is not None),
            filter,
        )
        if sharded is not None:
            assert model is not None
            sharded.save(converted, roles, path, model, [state[key] for key in roles.optimizers])
        elif self.is_global_zero:
            save_full(self.io, converted, path, storage_options)  # in the background where the plugin saves there

    def _save_filtered(
        self, sharded: ShardedFormat, path: _PATH, state: dict[str, Any], roles: Roles,
        filter: dict[str, Callable[[str, Any], bool]],
    ) -> None:
        """A sharded save with ``filter``, as Lightning's FSDPStrategy filters: the model's keys (by the unwrapped
        module's names, recorded with the checkpoint), and the top-level keys of every other entry. An optimizer's
        sharded state is kept whole or left out: its state is laid out over the views of every parameter."""
        if sharded.filtered is None:
            raise ValueError("`fabric.save(..., filter=...)` cannot filter this strategy's sharded checkpoints.")
        assert roles.model is not None
        model = state[roles.model]
        keep_model = filter.get(roles.model)
        model_state: Optional[dict[str, Any]] = None
        if keep_model is not None:
            model_state, roles.kept = sharded.filtered(model, keep_model)
        others = {key: keep for key, keep in filter.items() if key != roles.model}
        converted = convert(
            state,
            roles,
            lambda module: model_state if model_state is not None else self.model_state(module, True),
            lambda optimizer: self.optimizer_state(optimizer, True),
            others,
        )
        for key in [key for key in roles.optimizers if key in filter]:
            # Decided on every rank alike (a filter may look at this rank's values): a rank alone must not raise.
            kept = sorted(converted.get(key, {}))
            whole = kept == sorted(self.optimizer_state(state[key], True))
            if sharded.agree(not kept):  # the filter kept none of it anywhere: left out, as Fabric leaves it out
                roles.optimizers.remove(key)
            elif not sharded.agree(whole):
                raise ValueError(
                    f"`fabric.save(..., filter=...)` keeps part of the optimizer state {key!r} (here {kept}), but a"
                    " sharded optimizer state is kept whole or not at all, and alike on every rank. Keep all of it or"
                    " none, or save a full checkpoint."
                )
        sharded.save(converted, roles, path, model, [state[key] for key in roles.optimizers])

    def load(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``strategy.load_checkpoint``: restore ``state`` from a checkpoint (Fabric's or the Trainer's, full or
        sharded); returns what the state did not ask for."""
        io = self.io
        if is_sharded_checkpoint(sharded_storage(io, saving=False), path):
            return self._load_sharded(path, state, strict, weights_only)
        if not state:
            return io.load_checkpoint(path, weights_only=weights_only)
        if isinstance(state, Module):  # `fabric.load_raw`: a module's state dict
            file = io.load_checkpoint(path, weights_only=weights_only)
            self.load_model(state, dict(model_state_of(file, self.model_keys(state))), strict)
            return {}
        if isinstance(state, Optimizer):  # `fabric.load_raw`: a plain optimizer's state
            self.load_optimizer(state, io.load_checkpoint(path, weights_only=weights_only))
            return {}
        checkpoint = io.load_checkpoint(path, weights_only=weights_only)

        def load_model(module: Module, state_dict: dict[str, Any]) -> None:
            self.load_model(module, state_dict, strict)

        return restore(checkpoint, state, Roles.of(state, self.is_ours), strict, load_model, self.load_optimizer)

    def _load_sharded(
        self, path: _PATH, state: Optional[Union[Module, Optimizer, dict[str, Any]]], strict: bool,
        weights_only: Optional[bool],
    ) -> dict[str, Any]:
        if self.sharded is None:
            raise ValueError(
                f"{path} is a sharded checkpoint (of `DDPFullyShardedStrategy`): consolidate it into one file first"
                " (`lightning-fairscale-consolidate`) to load it with this strategy."
            )
        if isinstance(state, Module) and self.is_ours(state):  # `fabric.load_raw`: the model's part
            self.sharded.load(path, {"model": state}, Roles(model="model"), strict, weights_only)
            return {}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"{path} is a sharded checkpoint: it loads into a model set up with this strategy, as"
                " `fabric.load(path, {'model': model, ...})` or `fabric.load_raw(path, model)`. To read it whole,"
                " consolidate it first: `lightning-fairscale-consolidate`."
            )
        return self.sharded.load(path, state, Roles.of(state, self.is_ours), strict, weights_only)


def checked_norm(norm: Tensor, norm_type: Union[float, int], error_if_nonfinite: bool) -> Tensor:
    """``norm``, the total norm of the gradients that ``fabric.clip_gradients`` clipped by; with
    ``error_if_nonfinite``, a ``RuntimeError`` when it is inf or NaN (as ``torch.nn.utils.clip_grad_norm_``)."""
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} of the gradients is non-finite ({norm.item()}). Pass"
            " `error_if_nonfinite=False` to `fabric.clip_gradients` to clip anyway."
        )
    return norm


class NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: FairScale's ``no_sync`` of the root FSDP unit or ``ShardedDataParallel``.

    Inside it, backward keeps this rank's gradients (whole, for FSDP) and reduces nothing; the first backward outside
    it reduces what was accumulated, so the result equals one backward over all the micro-batches.

    Under ``sync_each_batch=True`` (the strategy's ``config``, read at each call) it skips nothing, as for
    ``enabled=False``: every micro-batch reduces, and a rank holds only its gradient shard between them. The loop is
    the same in both modes (``enabled=`` on the accumulating micro-batches), as the Trainer's is.

    Args:
        strategy: the strategy whose ``config.sync_each_batch`` decides.
    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled or self._strategy.config.sync_each_batch:
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


def refuse_groups_by_shard_shapes(problem: Optional[str], optimizer: Optimizer) -> None:
    """Refuse an optimizer whose param groups show they were made from the sharded model's 1-D parameters or from
    FairScale's flat parameters (``problem``, from the engine's ``WrappedModel.param_group_problem``): it would train
    something else than unsharded, silently.

    Raises:
        ValueError: with ``problem``, and how to make the optimizer (after ``setup_module``, inside the strategy's
            ``unsharded_shapes``).
    """
    if problem is None:
        return
    raise ValueError(
        f"The {type(optimizer).__name__} cannot train what it would unsharded: {problem}. Make the optimizer over the"
        " set-up model's parameters inside `with fabric.strategy.unsharded_shapes(model):`, where they show their"
        " unsharded shapes, and set it up after the model: `model = fabric.setup_module(model)`, then `with"
        " fabric.strategy.unsharded_shapes(model): optimizer = ...`, then `optimizer = fabric.setup_optimizers("
        "optimizer)`. (A param group left empty on purpose: leave it out.)"
    )
