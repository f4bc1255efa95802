"""What the Fabric strategies share, as values they hold and functions they call (no base class of theirs): the
models and optimizers they set up (:class:`SetUp`), refusing a sharded checkpoint where only full files load
(:func:`refuse_sharded`; checkpoints are saved and loaded by :mod:`lightning_fairscale.checkpointer`), skipping the
gradient synchronization, the check of the clipped norm, and the precision plugins they accept."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar, Union

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
from lightning_fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_fairscale._compat import _BackwardSyncControl
from lightning_fairscale._compat import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.mixed_precision.settings import unsupported
from lightning_fairscale.fsdp.state.saving import is_sharded_checkpoint
from lightning_fairscale.plugins.checkpoint_io import sharded_storage

__all__ = [
    "NoBackwardSync",
    "SetUp",
    "checked_norm",
    "fabric_precision",
    "refuse_sharded",
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


def refuse_sharded(io: Any, path: _PATH) -> None:
    """A strategy without the sharded format refuses a sharded checkpoint directory, naming the command that makes
    one file of it."""
    if is_sharded_checkpoint(sharded_storage(io, saving=False), path):
        raise ValueError(
            f"{path} is a sharded checkpoint (of `DDPFullyShardedStrategy`): consolidate it into one file first"
            " (`lightning-fairscale-consolidate`) to load it with this strategy."
        )


def checked_norm(norm: Tensor, norm_type: Union[float, int], error_if_nonfinite: bool) -> Tensor:
    """``norm``, the total norm of the gradients that ``fabric.clip_gradients`` clipped by; with
    ``error_if_nonfinite``, a ``RuntimeError`` when it is inf or NaN (as ``torch.nn.utils.clip_grad_norm_``)."""
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} of the gradients is non-finite ({norm.item()}). Pass"
            " `error_if_nonfinite=False` to `fabric.clip_gradients` to clip anyway."
        )
    return norm


class SyncOption(Protocol):
    """What :class:`NoBackwardSync` reads of a strategy: its option ``sync_each_batch``."""

    @property
    def sync_each_batch(self) -> bool: ...


class NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: FairScale's ``no_sync`` of the root FSDP unit or ``ShardedDataParallel``.

    Inside it, backward keeps this rank's gradients (whole, for FSDP) and reduces nothing; the first backward outside
    it reduces what was accumulated, so the result equals one backward over all the micro-batches.

    Under ``sync_each_batch=True`` (the strategy's option, read at each call) it skips nothing, as for
    ``enabled=False``: every micro-batch reduces, and a rank holds only its gradient shard between them. The loop is
    the same in both modes (``enabled=`` on the accumulating micro-batches), as the Trainer's is.

    Args:
        options: the strategy's options, whose ``sync_each_batch`` decides.
    """

    def __init__(self, options: SyncOption) -> None:
        self._options = options

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled or self._options.sync_each_batch:
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
