"""FairScale's sharded DDP (OSS + ShardedDataParallel), for the Trainer's strategy and for Fabric's.

``DDPShardedStrategy`` rebuilds each optimizer as a :class:`fairscale.optim.OSS` over the same param groups and
hyperparameters (:func:`shard_optimizer`), so every rank keeps the optimizer state of its share of the parameters
only (ZeRO stage 1), and wraps the module in :class:`fairscale.nn.data_parallel.ShardedDataParallel`, which reduces
each gradient to the rank that owns its parameter (stage 2). Parameters stay whole on every rank.

:class:`ShardedDDPOptions` holds the strategy's arguments and what follows from them; the Trainer's strategy
(:mod:`lightning_fairscale.strategies.sharded`) and Fabric's (:mod:`lightning_fairscale.fabric.sharded`) are it plus an
adapter each, and call the functions here. Nothing here imports Lightning.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Literal, Optional

import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale.distributed import collectives
from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy, validate_policy
from lightning_fairscale.distributed import process_exit
from lightning_fairscale.strategy_arguments import lightning_arguments

__all__ = [
    "ShardedDDPOptions",
    "SpawnOnly",
    "full_state",
    "load_full_state",
    "reattach_bucketed_gradients",
    "repoint_schedulers",
    "shard_optimizer",
    "sync_module_states",
    "validate_arguments",
]

#: Arguments of ``ShardedDataParallel`` that the strategy sets itself.
_MANAGED_SDP_ARGUMENTS = {
    "module": "the strategy wraps the model itself",
    "sharded_optimizer": "the strategy shards the optimizers of `configure_optimizers` (or of `fabric.setup`)",
    "process_group": "the strategy uses the default process group",
}
_SDP_ARGUMENTS = set(inspect.signature(ShardedDataParallel.__init__).parameters) - {"self"}
#: Gradient bucket size (elements) for multi-node runs, as in Lightning 1.x; single-node runs reduce unbucketed.
_MULTI_NODE_REDUCE_BUFFER_SIZE = 2**23


class ShardedDDPOptions:
    """The arguments of ``DDPShardedStrategy`` and what follows from them; a base class of both strategies.

    The arguments are documented on :class:`lightning_fairscale.strategies.DDPShardedStrategy`. The Lightning base
    class (the Trainer's or Fabric's ``DDPStrategy``) follows this class in the strategy's bases; it gets the
    arguments it knows, the precision plugin under the name it uses (:attr:`_precision_name`).
    """

    #: The name under which the Lightning base strategy takes and holds its precision plugin.
    _precision_name: ClassVar[str]
    #: The names the strategy registers (see :meth:`register_strategies`).
    _registry_names: ClassVar[tuple[str, ...]] = ("ddp_sharded", "ddp_sharded_find_unused_parameters_false")

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,  # Lightning's default too
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        precision: Optional[Any] = None,
        lightning_1x_optimizer_state: OptimizerStatePolicy = "error",
        **kwargs: Any,
    ) -> None:
        self.lightning_1x_optimizer_state = validate_policy(lightning_1x_optimizer_state, type(self).__name__)
        validate_arguments(type(self).__name__, find_unused_parameters, kwargs)
        base = lightning_arguments(locals(), self._precision_name)
        super().__init__(**base, **kwargs)  # type: ignore[call-arg]  # `kwargs` go to Lightning's DDP kwargs, for SDP
        self._init_adapter()

    def _init_adapter(self) -> None:
        """Set up the state of the strategy's adapter (its Lightning-specific part), at the end of ``__init__``."""

    def setup_environment(self) -> None:
        """The Lightning base's set-up (the default process group), and its clean-up at exit."""
        default_before = process_exit.default_group()
        super().setup_environment()  # type: ignore[misc]
        process_exit.close_process_group_at_exit(self, default_before)

    @property
    def reduce_buffer_size(self) -> int:
        """Size of ``ShardedDataParallel``'s gradient buckets in elements: ``0`` (no buckets) on one node by default."""
        default = 0 if self.num_nodes == 1 else _MULTI_NODE_REDUCE_BUFFER_SIZE  # type: ignore[attr-defined]
        kwargs = self._ddp_keyword_arguments()  # type: ignore[attr-defined]  # _compat.StrategyInternals
        return int(kwargs.get("reduce_buffer_size", default))

    @property
    def broadcast_fp16(self) -> bool:
        """Whether OSS sends updated parameters in fp16: under fp16 mixed precision on several nodes."""
        precision = getattr(self, self._precision_name).precision
        return precision == "16-mixed" and self.num_nodes > 1  # type: ignore[attr-defined]

    def sharded_ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``ShardedDataParallel`` is built with (besides the module and optimizers)."""
        kwargs = self._ddp_keyword_arguments()  # type: ignore[attr-defined]  # _compat.StrategyInternals
        return {**kwargs, "reduce_buffer_size": self.reduce_buffer_size}

    def _wrap(self, module: Module, optimizers: list[OSS]) -> ShardedDataParallel:
        wrapped = ShardedDataParallel(module, sharded_optimizer=optimizers, **self.sharded_ddp_kwargs())
        process_exit.release_at_exit(wrapped, *optimizers)
        return wrapped

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register :attr:`_registry_names` with a Lightning registry (the Trainer's or Fabric's), where free."""
        for name in cls._registry_names:
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"FairScale's sharded optimizer and gradients ({cls.__name__})",
                    find_unused_parameters=False,
                )


class SpawnOnly:
    """Makes a sharded DDP strategy start its processes with ``torch.multiprocessing`` (``"spawn"``) by default."""

    _registry_names: ClassVar[tuple[str, ...]] = (
        "ddp_sharded_spawn",
        "ddp_sharded_spawn_find_unused_parameters_false",
    )

    def __init__(
        self, *args: Any, start_method: Literal["spawn", "fork", "forkserver"] = "spawn", **kwargs: Any
    ) -> None:
        if start_method == "popen":
            raise ValueError(
                "`DDPSpawnShardedStrategy` starts its processes with multiprocessing; for `start_method='popen'` use"
                " `DDPShardedStrategy` (`strategy='ddp_sharded'`)."
            )
        super().__init__(*args, start_method=start_method, **kwargs)  # type: ignore[call-arg]


def full_state(optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
    """The full state of a plain optimizer of the same class, on rank 0 (``{}`` on the other ranks).

    A collective call for OSS, which gathers every rank's shard of the state on rank 0.
    """
    if not isinstance(optimizer, OSS):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(recipient_rank=0)
    return optimizer.state_dict() if is_global_zero else {}


@torch.no_grad()
def sync_module_states(module: Module) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP does when it wraps a module). A collective call.

    One broadcast per tensor, once per set-up: torch's bucketed version is private (``_sync_module_states``).
    """
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name not in ignored:
            collectives.broadcast(tensor.data, src=0)


@torch.no_grad()
def reattach_bucketed_gradients(module: ShardedDataParallel) -> None:
    """Put the gradients of bucketed parameters back into their bucket slots (zero where they are ``None``).

    With ``reduce_buffer_size > 0`` FairScale makes the gradients of small parameters views into one bucket per
    destination rank, and reduces the bucket as a whole. PyTorch 2's ``Optimizer.zero_grad()`` sets gradients to
    ``None`` by default (Lightning calls it after the forward pass), after which backward allocates new gradients
    outside the bucket and FairScale would reduce the stale bucket instead: wrong gradients, silently.
    """
    if not module._use_buckets:
        return
    for bucket in module._bucket_list:
        offset = 0
        for param in bucket._params:
            slot = bucket.buffer[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            if param.grad is None:
                slot.zero_()
                param.grad = slot
            elif param.grad.data_ptr() != slot.data_ptr():
                slot.copy_(param.grad)
                param.grad = slot


def shard_optimizer(optimizer: Optimizer, broadcast_fp16: bool = False) -> OSS:
    """``optimizer`` rebuilt as ``fairscale.optim.OSS``: same class, param groups and hyperparameters, sharded.

    Needs an initialized process group. Any state ``optimizer`` already has is carried over (sharded).

    Args:
        optimizer: a ``torch.optim`` optimizer (or one built the same way: ``cls(param_groups, **defaults)``).
        broadcast_fp16: send the updated parameters to the other ranks in fp16 (see ``OSS``).

    Raises:
        TypeError: the optimizer's class cannot be built again from its param groups and ``defaults``.
    """
    optim_class = type(optimizer)
    defaults = _constructor_defaults(optimizer)
    param_groups = [dict(group) for group in optimizer.param_groups]
    try:
        inspect.signature(optim_class).bind(param_groups, **defaults)
    except TypeError as error:
        raise TypeError(
            f"`DDPShardedStrategy` cannot shard {optim_class.__name__}: OSS builds each rank's optimizer as"
            f" `{optim_class.__name__}(param_groups, **defaults)` ({error}). Give the class a constructor that takes"
            " its `defaults` as keyword arguments, or return a `fairscale.optim.OSS` from `configure_optimizers`."
        ) from None
    sharded = OSS(params=param_groups, optim=optim_class, broadcast_fp16=broadcast_fp16, **defaults)
    if optimizer.state:
        load_full_state(sharded, optimizer.state_dict())
    return sharded


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` less the entries its constructor does not take.

    Some classes record settings they fix themselves, e.g. ``AdamW``'s ``decoupled_weight_decay=True``; the param
    groups keep those entries, so nothing is lost.
    """
    parameters = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {name: value for name, value in optimizer.defaults.items() if name in parameters}


def load_full_state(optimizer: OSS, state: Mapping[str, Any]) -> None:
    """Load a plain optimizer's full state dict into OSS, which keeps this rank's shard.

    ``OSS.load_state_dict`` empties the entries of other ranks' parameters in the dict it gets, so it gets a copy;
    and it leaves a second copy of this rank's shard in the OSS wrapper's own ``state``, which nothing reads
    (``OSS.state_dict`` collects the shards' states), so that copy is dropped.
    """
    optimizer.load_state_dict({**state, "state": dict(state["state"])})
    optimizer.state.clear()


def repoint_schedulers(schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> None:
    """Make the LR schedulers of ``old`` adjust ``new``, and keep PyTorch's step-order check working."""
    repointed = False
    for top in schedulers:
        for scheduler in _scheduler_tree(top):
            if getattr(scheduler, "optimizer", None) is old:
                scheduler.optimizer = new  # type: ignore[union-attr]
                repointed = True
    if repointed:
        _flag_steps_for_schedulers(new)


def _scheduler_tree(scheduler: Any) -> Iterator[Any]:
    """A scheduler and those it drives (``SequentialLR``, ``ChainedScheduler``), recursively."""
    yield scheduler
    for inner in getattr(scheduler, "_schedulers", None) or ():
        yield from _scheduler_tree(inner)


def _flag_steps_for_schedulers(optimizer: Optimizer) -> None:
    """Set ``optimizer._opt_called`` on every step, as PyTorch's LR schedulers do to the optimizer they are given.

    A scheduler checks, on its first step, that its optimizer's ``step`` carries the ``_wrapped_by_lr_sched`` mark
    (else it warns that ``optimizer.step()`` was overridden) and that ``_opt_called`` is set (else it warns that the
    scheduler stepped first). The schedulers were created with the user's optimizer; OSS needs the same.
    """
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    optimizer_ref = weakref.ref(optimizer)
    unbound_step = step.__func__  # type: ignore[attr-defined]

    @functools.wraps(unbound_step)
    def flagged_step(*args: Any, **kwargs: Any) -> Any:
        owner = optimizer_ref()
        owner._opt_called = True  # type: ignore[union-attr]
        return unbound_step(owner, *args, **kwargs)

    flagged_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = flagged_step  # type: ignore[method-assign]


def validate_arguments(strategy: str, find_unused_parameters: Any, kwargs: dict[str, Any]) -> None:
    if find_unused_parameters:
        raise ValueError(
            f"`{strategy}` does not support `find_unused_parameters=True`: FairScale's ShardedDataParallel reduces"
            " each gradient when backward produces it and cannot wait for parameters that some ranks leave unused."
            " Use `strategy='ddp_find_unused_parameters_true'` for such models."
        )
    size = kwargs.get("reduce_buffer_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"`reduce_buffer_size` must be a number of elements >= 0 (0: no buckets), got {size!r}.")
    for name in kwargs:
        if name in _MANAGED_SDP_ARGUMENTS:
            raise TypeError(f"`{strategy}` does not take `{name}`: {_MANAGED_SDP_ARGUMENTS[name]}.")
        if name not in _SDP_ARGUMENTS:
            raise TypeError(
                f"`{strategy}` got an unexpected argument `{name}`. Extra keyword arguments go to FairScale's"
                f" ShardedDataParallel, which takes: {', '.join(sorted(_SDP_ARGUMENTS - set(_MANAGED_SDP_ARGUMENTS)))}."
            )
