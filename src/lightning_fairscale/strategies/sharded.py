"""``DDPShardedStrategy``: FairScale's sharded optimizer state and gradients (OSS + ShardedDDP) under Lightning 2.x.

Each optimizer from ``configure_optimizers`` is rebuilt as a :class:`fairscale.optim.OSS` over the same param groups
and hyperparameters, so every rank keeps the optimizer state of its share of the parameters only (ZeRO stage 1),
and the module is wrapped in :class:`fairscale.nn.data_parallel.ShardedDataParallel`, which reduces each gradient
to the rank that owns its parameter (stage 2). Parameters stay whole on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Generator, Iterator, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Literal, Optional

import pytorch_lightning as pl
import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.strategies import _StrategyRegistry
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.core.optimizer import LightningOptimizer, _MockOptimizer
from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.checkpoint_io import ShardedCheckpointIO
from lightning_fairscale.precision.sharded import ShardedPrecisionPlugin, sharded_precision_plugin
from lightning_fairscale.legacy_checkpoint import OptimizerStatePolicy, validate_policy
from lightning_fairscale.strategies._checkpoint import resumable_optimizer_states
from lightning_fairscale.strategies._callbacks import check_sharded_ddp_callbacks
from lightning_fairscale.strategies._lost_ranks import report_collective_failure
from lightning_fairscale.strategies._process_exit import close_process_group_at_exit

__all__ = ["DDPShardedStrategy", "DDPSpawnShardedStrategy", "shard_optimizer"]

log = logging.getLogger(__name__)

#: Arguments of ``ShardedDataParallel`` that the strategy sets itself.
_MANAGED_SDP_ARGUMENTS = {
    "module": "the strategy wraps the LightningModule itself",
    "sharded_optimizer": "the strategy shards the optimizers that `configure_optimizers` returns",
    "process_group": "the strategy uses the Trainer's process group",
}
_SDP_ARGUMENTS = set(inspect.signature(ShardedDataParallel.__init__).parameters) - {"self"}
#: Gradient bucket size (elements) for multi-node runs, as in Lightning 1.x; single-node runs reduce unbucketed.
_MULTI_NODE_REDUCE_BUFFER_SIZE = 2**23


class DDPShardedStrategy(DDPStrategy):
    """Optimizer state and gradient sharding with FairScale (OSS + ShardedDDP), for Lightning 2.x.

    Lightning 1.x's ``DDPShardedStrategy``: the optimizers that ``configure_optimizers`` returns (any
    ``torch.optim`` optimizer, param groups kept) are rebuilt as ``fairscale.optim.OSS`` with the same
    hyperparameters, LR schedulers follow them, and the module is wrapped in FairScale's ``ShardedDataParallel``
    while fitting (validation, test and predict run on the plain module). Checkpoints hold the model's and a plain
    optimizer's state dicts, consolidated on rank 0, so they load without FairScale and resume on any number of
    processes. Runs on GPUs (NCCL) and on CPUs (gloo).

    Args:
        accelerator: the accelerator; the Trainer sets it.
        parallel_devices: the devices of this node; the Trainer sets them.
        cluster_environment: the cluster environment; the Trainer sets it.
        checkpoint_io: the checkpoint IO plugin (default: :class:`~lightning_fairscale.ShardedCheckpointIO`, which
            writes each checkpoint file atomically).
        precision_plugin: the precision plugin; the Trainer's ``precision`` flag chooses it.
        process_group_backend: ``"nccl"``, ``"gloo"``... (default: from the device).
        timeout: how long collectives wait for the other ranks before failing.
        start_method: ``"popen"`` (re-run the script for each rank, the default) or ``"spawn"``/``"fork"``.
        find_unused_parameters: only ``False``: ``ShardedDataParallel`` has no search for unused parameters. A
            parameter that no rank uses keeps no gradient and is not reduced; one used on some ranks only is not
            supported (use Lightning's ``"ddp_find_unused_parameters_true"``).
        lightning_1x_optimizer_state: resuming a checkpoint of Lightning 1.x's FairScale *FSDP* strategy (1.x's
            ``"ddp_sharded"`` checkpoints resume exactly): ``"error"`` (default) or ``"reset"``, as in
            :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`.
        **kwargs: passed to FairScale's ``ShardedDataParallel``, e.g. ``reduce_buffer_size`` (default: ``0`` on one
            node, ``2**23`` elements on several), ``broadcast_buffers``, ``auto_refresh_trainable``.

    Example:
        >>> from lightning_fairscale.strategies import DDPShardedStrategy
        >>> strategy = DDPShardedStrategy(reduce_buffer_size=2**20)
        >>> strategy.reduce_buffer_size
        1048576
    """

    strategy_name = "ddp_sharded"
    _registry_names: ClassVar[tuple[str, ...]] = ("ddp_sharded", "ddp_sharded_find_unused_parameters_false")

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        lightning_1x_optimizer_state: OptimizerStatePolicy = "error",
        **kwargs: Any,
    ) -> None:
        _validate_arguments(type(self).__name__, find_unused_parameters, kwargs)
        self.lightning_1x_optimizer_state = validate_policy(lightning_1x_optimizer_state, type(self).__name__)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,  # kept in `self._ddp_kwargs`, for ShardedDataParallel
        )

    # ------------------------------------------------------------------------------------------------------------
    # Configuration

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ShardedPrecisionPlugin()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else sharded_precision_plugin(plugin)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """:class:`~lightning_fairscale.ShardedCheckpointIO` unless the Trainer got another: checkpoint files are
        written beside their target and renamed into place, so a save killed midway keeps the previous one."""
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    @property
    def reduce_buffer_size(self) -> int:
        """Size of ``ShardedDataParallel``'s gradient buckets in elements: ``0`` (no buckets) on one node by default."""
        default = 0 if self.num_nodes == 1 else _MULTI_NODE_REDUCE_BUFFER_SIZE
        return int(self._ddp_kwargs.get("reduce_buffer_size", default))

    @property
    def broadcast_fp16(self) -> bool:
        """Whether OSS sends updated parameters in fp16: under fp16 mixed precision on several nodes."""
        return self.precision_plugin.precision == "16-mixed" and self.num_nodes > 1

    def sharded_ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``ShardedDataParallel`` is built with (besides the module and optimizers)."""
        return {**self._ddp_kwargs, "reduce_buffer_size": self.reduce_buffer_size}

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self.optimizers = [self._shard(optimizer) for optimizer in self.optimizers]
            if self._sharded_optimizers():
                self.model = self._setup_model(self.model)
        else:
            # Nothing to reduce outside `fit`: the plain module, with rank 0's weights on every rank.
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self._local_optimizers(), self.root_device)

    def _shard(self, optimizer: Optimizer) -> Optimizer:
        if isinstance(optimizer, (OSS, _MockOptimizer)):
            return optimizer
        sharded = shard_optimizer(optimizer, broadcast_fp16=self.broadcast_fp16)
        _repoint_schedulers(self.lr_scheduler_configs, optimizer, sharded)
        return sharded

    def _sharded_optimizers(self) -> list[OSS]:
        return [optimizer for optimizer in self.optimizers if isinstance(optimizer, OSS)]

    def _local_optimizers(self) -> list[Optimizer]:
        """Every optimizer object that holds state: the OSS wrappers and the optimizers of their shards."""
        return self.optimizers + [optimizer.optim for optimizer in self._sharded_optimizers()]

    @override
    def _setup_model(self, model: Module) -> ShardedDataParallel:
        kwargs = self.sharded_ddp_kwargs()
        log.debug(f"setting up ShardedDataParallel with kwargs: {kwargs}")
        return ShardedDataParallel(model, sharded_optimizer=self._sharded_optimizers(), **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before each backward pass: the gradient buckets must hold the gradients (see ``reduce_buffer_size``)."""
        super().pre_backward(closure_loss)
        if isinstance(self.model, ShardedDataParallel):
            _reattach_bucketed_gradients(self.model)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduction on accumulation steps (``ShardedDataParallel.no_sync``)."""
        wrapped = isinstance(self.model, ShardedDataParallel)
        with self.model.no_sync() if wrapped else contextlib.nullcontext():  # type: ignore[union-attr]
            yield

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full state of a plain optimizer of the same class, on rank 0 (``{}`` on the other ranks).

        A collective call: OSS gathers every rank's shard of the state on rank 0.
        """
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if not isinstance(optimizer, OSS):
            return optimizer.state_dict()
        optimizer.consolidate_state_dict(recipient_rank=0)
        return optimizer.state_dict() if self.is_global_zero else {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load full optimizer state dicts (saved with any number of processes); each rank keeps its shard."""
        # The user's optimizer (OSS builds it on each rank) names the class; OSS's param groups hold every parameter.
        users = [opt.optim if isinstance(opt, OSS) else opt for opt in self.optimizers]
        shapes = [[[p.shape for p in group["params"]] for group in opt.param_groups] for opt in self.optimizers]
        owner, policy = type(self).__name__, self.lightning_1x_optimizer_state
        states = resumable_optimizer_states(checkpoint, users, shapes, policy, owner, rank_zero_warn)
        for optimizer, state in zip(self.optimizers, states):
            if isinstance(optimizer, OSS):
                _load_full_state(optimizer, state)
            else:
                optimizer.load_state_dict(state)
        _optimizers_to_device(self._local_optimizers(), self.root_device)

    @override
    def setup_environment(self) -> None:
        module = self.lightning_module
        if module is not None and module._trainer is not None:  # before any process group: every rank refuses alike
            check_sharded_ddp_callbacks(module.trainer.callbacks, type(self).__name__)
        super().setup_environment()
        close_process_group_at_exit(self)

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_collective_failure(exception, self._timeout, getattr(self, "_launcher", None))
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Give the Trainer back the plain LightningModule.

        The optimizers stay the sharded ones, so ``trainer.save_checkpoint`` after ``fit`` (on all ranks) writes the
        same checkpoint as during training.
        """
        if isinstance(self.model, ShardedDataParallel):
            self.model = self.lightning_module
        super().teardown()
        _optimizers_to_device(self._local_optimizers(), torch.device("cpu"))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name in cls._registry_names:
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"FairScale's sharded optimizer and gradients ({cls.__name__})",
                    find_unused_parameters=False,
                )


class DDPSpawnShardedStrategy(DDPShardedStrategy):
    """:class:`DDPShardedStrategy` that starts its processes with ``torch.multiprocessing`` (``"spawn"``).

    Lightning 2 has no ``DDPSpawnStrategy`` class: this is ``DDPShardedStrategy(start_method="spawn")``. The script
    is not run again for each rank, so it also works inside other programs (e.g. a test runner); the model and the
    Trainer are pickled to the processes, so the model's class must be importable. Rank 0's trained weights are
    loaded into the model of the calling process afterwards.

    Example:
        >>> DDPSpawnShardedStrategy()._start_method
        'spawn'
    """

    strategy_name = "ddp_sharded_spawn"
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
        super().__init__(*args, start_method=start_method, **kwargs)


@torch.no_grad()
def _reattach_bucketed_gradients(module: ShardedDataParallel) -> None:
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
        _load_full_state(sharded, optimizer.state_dict())
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


def _load_full_state(optimizer: OSS, state: Mapping[str, Any]) -> None:
    """Load a plain optimizer's full state dict into OSS, which keeps this rank's shard.

    ``OSS.load_state_dict`` empties the entries of other ranks' parameters in the dict it gets, so it gets a copy;
    and it leaves a second copy of this rank's shard in the OSS wrapper's own ``state``, which nothing reads
    (``OSS.state_dict`` collects the shards' states), so that copy is dropped.
    """
    optimizer.load_state_dict({**state, "state": dict(state["state"])})
    optimizer.state.clear()


def _repoint_schedulers(configs: list[LRSchedulerConfig], old: Optimizer, new: Optimizer) -> None:
    """Make the LR schedulers of ``old`` adjust ``new``, and keep PyTorch's step-order check working."""
    repointed = False
    for config in configs:
        for scheduler in _scheduler_tree(config.scheduler):
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


def _validate_arguments(strategy: str, find_unused_parameters: Any, kwargs: dict[str, Any]) -> None:
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
