# Generated from lightning_fairscale/strategies/sharded.py by `make lightning`: do not edit.
"""``DDPShardedStrategy``: FairScale's sharded optimizer state and gradients (OSS + ShardedDDP) under Lightning 2.x.

Each optimizer from ``configure_optimizers`` is rebuilt as a :class:`fairscale.optim.OSS` over the same param groups
and hyperparameters, so every rank keeps the optimizer state of its share of the parameters only (ZeRO stage 1),
and the module is wrapped in :class:`fairscale.nn.data_parallel.ShardedDataParallel`, which reduces each gradient
to the rank that owns its parameter (stage 2). Parameters stay whole on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from lightning.fabric.plugins import CheckpointIO
from lightning_fairscale.lightning._compat import (
    collective_timeout,
    layer_sync_plugin,
    plain_optimizer,
    precision_plugin_property,
    use_multiprocessing_launcher,
)
from lightning_fairscale.lightning._compat import _PATH, _optimizers_to_device
from lightning_fairscale.lightning._compat import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale._adapters import (
    check_spawn_start_method,
    config_arguments,
    lightning_arguments,
    register_strategies,
)
from lightning_fairscale._adapters.options import ShardedDDPOptions
from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy
from lightning_fairscale.distributed import process_exit
from lightning_fairscale.sharded_ddp import config as sharded_config
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig
from lightning_fairscale.sharded_ddp.trainability import Trainability
from lightning_fairscale.sharded_ddp.engine import (
    check_optimizers,
    full_state,
    load_full_state,
    repoint_schedulers,
    shard_optimizer,
    sync_module_states,
    wrap_model,
)
from lightning_fairscale.lightning.precision.sharded import ShardedPrecisionPlugin, sharded_precision_plugin
from lightning_fairscale import checkpointer
from lightning_fairscale.lightning.plugins.checkpoint_io import checkpoint_files, default_checkpoint_io, finish_background
from lightning_fairscale.lightning.strategies._callbacks import check_sharded_ddp_callbacks, trainer_callbacks
from lightning_fairscale.checkpoint.checks import resumable_optimizer_states
from lightning_fairscale.strategies._lost_ranks import report_collective_failure
from lightning_fairscale.lightning.strategies._spawned_fit import SpawnLauncher, end_of_fit_state

__all__ = ["DDPShardedStrategy", "DDPSpawnShardedStrategy", "shard_optimizer"]


class DDPShardedStrategy(DDPStrategy, ShardedDDPOptions):
    """Optimizer state and gradient sharding with FairScale (OSS + ShardedDDP), for Lightning 2.x.

    Lightning 1.x's ``DDPShardedStrategy``: the optimizers that ``configure_optimizers`` returns (any
    ``torch.optim`` optimizer, param groups kept) are rebuilt as ``fairscale.optim.OSS`` with the same
    hyperparameters, LR schedulers follow them, and the module is wrapped in FairScale's ``ShardedDataParallel``
    while fitting (validation, test and predict run on the plain module). Checkpoints hold the model's and a plain
    optimizer's state dicts, consolidated on rank 0, so they load without FairScale and resume on any number of
    processes. Runs on GPUs (NCCL) and on CPUs (gloo). The options are kept in :attr:`config` and are typed attributes
    (:class:`~lightning_fairscale._adapters.options.ShardedDDPOptions`), fixed at setup but
    ``lightning_1x_optimizer_state``; each is declared once, by
    :class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig` (``make options``).

    Args:
        accelerator: the accelerator; the Trainer sets it.
        parallel_devices: the devices of this node; the Trainer sets them.
        cluster_environment: the cluster environment; the Trainer sets it.
        checkpoint_io: the checkpoint IO plugin (default: :class:`~lightning_fairscale.ShardedCheckpointIO`).
        precision_plugin: the precision plugin; the Trainer's ``precision`` flag chooses it.
        process_group_backend: ``"nccl"``, ``"gloo"``... (default: from the device).
        timeout: how long collectives wait for the other ranks before failing.
        start_method: ``"popen"`` (re-run the script for each rank, the default) or ``"spawn"``/``"fork"``.
        find_unused_parameters: only ``False``: ``ShardedDataParallel`` has no search for unused parameters.
        precision: another name for ``precision_plugin`` (Fabric's).
        lightning_1x_optimizer_state: resuming a Lightning 1.x FSDP checkpoint's optimizer state: ``"error"`` (default)
            or ``"reset"``, as in ``DDPFullyShardedStrategy``.
        sync_each_batch: reduce after every micro-batch when accumulating, instead of ``ShardedDataParallel.no_sync``.
        **kwargs: passed to FairScale's ``ShardedDataParallel``, e.g. ``reduce_buffer_size`` (default: ``0`` on one
            node, ``2**23`` elements on several), ``broadcast_buffers``, ``reduce_fp16``. The strategy follows
            parameters frozen or unfrozen and eval/train switches itself (see
            :mod:`lightning_fairscale.sharded_ddp.trainability`): ``auto_refresh_trainable`` and
            ``warn_on_trainable_params_changed`` are accepted and have no effect.

    Example:
        >>> from lightning_fairscale.strategies import DDPShardedStrategy
        >>> strategy = DDPShardedStrategy(reduce_buffer_size=2**20)
        >>> strategy.reduce_buffer_size
        1048576
    """

    strategy_name = "ddp_sharded"
    #: The names :meth:`register_strategies` registers.
    _registry_names: tuple[str, ...] = ("ddp_sharded", "ddp_sharded_find_unused_parameters_false")

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,  # Lightning's default too
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        precision: Optional[Precision] = None,
        lightning_1x_optimizer_state: OptimizerStatePolicy = "error",
        sync_each_batch: bool = False,
        **kwargs: Any,
    ) -> None:
        config = ShardedDDPConfig(**config_arguments(ShardedDDPConfig, locals()), owner=type(self).__name__)
        super().__init__(**lightning_arguments(locals(), "precision_plugin"))
        self.config = config  # the options (see `ShardedDDPOptions`)
        #: What the wrapped model derived from its trainable parameters, kept up to date (while fitting).
        self._trainability: Optional[Trainability] = None

    # ------------------------------------------------------------------------------------------------------------
    # Configuration (the options' attributes come with `ShardedDDPOptions`)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register :attr:`_registry_names` with the Trainer's registry, where free."""
        description = f"FairScale's sharded optimizer and gradients ({cls.__name__})"
        register_strategies(strategy_registry, cls, cls._registry_names, description, find_unused_parameters=False)

    @property
    def reduce_buffer_size(self) -> int:
        """Size of ``ShardedDataParallel``'s gradient buckets in elements: ``0`` (no buckets) on one node by default."""
        return sharded_config.reduce_buffer_size(self.config, self.num_nodes)

    @property
    def broadcast_fp16(self) -> bool:
        """Whether OSS sends updated parameters in fp16: under fp16 mixed precision on several nodes."""
        return sharded_config.broadcast_fp16(self.precision_plugin.precision, self.num_nodes)

    def sharded_ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``ShardedDataParallel`` is built with (besides the module and optimizers)."""
        return sharded_config.sharded_ddp_kwargs(self.config, self.num_nodes)

    precision_plugin = precision_plugin_property(ShardedPrecisionPlugin, sharded_precision_plugin)

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = layer_sync_plugin(self)
        if fitting and layer_sync:
            self.model = layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers)  # before the first is sharded: refused on every rank alike
            self.optimizers = [self._shard(optimizer) for optimizer in self.optimizers]
            if self._sharded_optimizers():
                self.model = self._setup_model(self.model)
        else:
            # Nothing to reduce outside `fit`: the plain module, with rank 0's weights on every rank.
            sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self._local_optimizers(), self.root_device)

    def _shard(self, optimizer: Optimizer) -> Optimizer:
        if isinstance(optimizer, (OSS, _MockOptimizer)):
            return optimizer
        sharded = shard_optimizer(optimizer, broadcast_fp16=self.broadcast_fp16)
        repoint_schedulers([config.scheduler for config in self.lr_scheduler_configs], optimizer, sharded)
        return sharded

    def _sharded_optimizers(self) -> list[OSS]:
        return [optimizer for optimizer in self.optimizers if isinstance(optimizer, OSS)]

    def _local_optimizers(self) -> list[Optimizer]:
        """Every optimizer object that holds state: the OSS wrappers and the optimizers of their shards."""
        return self.optimizers + [optimizer.optim for optimizer in self._sharded_optimizers()]

    @override
    def _setup_model(self, model: Module) -> ShardedDataParallel:
        wrapped, self._trainability = wrap_model(self.config, model, self._sharded_optimizers(), self.num_nodes)
        return wrapped

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before each backward pass: parameters frozen or unfrozen since the forward pass are followed (e.g. by
        ``toggle_optimizer``), the gradient buckets must hold the gradients (see ``reduce_buffer_size``), and
        reduced gradients of earlier micro-batches are set aside (see ``Trainability.begin_backward``)."""
        super().pre_backward(closure_loss)
        if self._trainability is not None:
            self._trainability.begin_backward()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's ``Strategy.backward``, with the reduced gradients that ``pre_backward`` set aside added back
        right after the backward pass, before ``on_after_backward`` sees the gradients."""
        self.pre_backward(closure_loss)
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        try:
            self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        except BaseException:
            if self._trainability is not None:  # as the last completed step left it; the error goes on
                self._trainability.recover()
            raise
        finally:
            if self._trainability is not None:
                self._trainability.end_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduction on accumulation steps (``ShardedDataParallel.no_sync``); with
        ``sync_each_batch`` skip nothing: every micro-batch reduces (see ``sharded_ddp.engine.begin_backward``)."""
        model = self.model
        if isinstance(model, ShardedDataParallel) and not self.config.sync_each_batch:
            with model.no_sync():
                yield
        else:
            yield

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full state of a plain optimizer of the same class, on rank 0 (``{}`` on the other ranks).

        A collective call: OSS gathers every rank's shard of the state on rank 0.
        """
        return full_state(plain_optimizer(optimizer), self.is_global_zero)

    checkpoint_io = default_checkpoint_io(DDPStrategy)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        use_multiprocessing_launcher(self, SpawnLauncher)  # start_method "spawn", "fork" or "forkserver"

    @override
    def on_train_end(self) -> None:
        """At the end of a spawned ``fit``, keep rank 0's training state for the launching process (see
        :class:`DDPSpawnShardedStrategy`)."""
        super().on_train_end()
        if isinstance(self.launcher, SpawnLauncher):
            assert self.lightning_module is not None
            self.launcher.end_of_fit = end_of_fit_state(self, self.lightning_module.trainer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Write the checkpoint (rank 0); in the process that launched a spawned ``fit``, with the training state
        rank 0 had at its end (see :class:`DDPSpawnShardedStrategy`)."""
        end_of_fit = self.launcher.end_of_fit if isinstance(self.launcher, SpawnLauncher) else None
        if end_of_fit is not None:
            checkpoint = end_of_fit.complete(checkpoint, type(self).__name__)
        # Rank 0 writes (in the background where the plugin saves there), after the failed background writes are
        # agreed on every rank.
        checkpointer.save_full(checkpoint_files(self.checkpoint_io, self.global_rank), filepath, checkpoint,
                               storage_options)

    @override
    def setup_environment(self) -> None:
        """Lightning's set-up (the default process group), and its clean-up at exit."""
        check_sharded_ddp_callbacks(trainer_callbacks(self), type(self).__name__)  # before any process group
        with process_exit.closing_at_exit(self):
            super().setup_environment()
        self._fix_options()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The checkpoint, a Fabric checkpoint (``fabric.save``) read in the Trainer's layout (see
        :func:`~lightning_fairscale.checkpoint.fabric.to_trainer_layout`); the file is not changed. A checkpoint
        still being written in the background is written first."""
        assert self.lightning_module is not None
        keys = list(self.lightning_module.state_dict())  # a Fabric file's model entry: these keys
        files = checkpoint_files(self.checkpoint_io, self.global_rank)
        return checkpointer.read_full(files, checkpoint_path, weights_only, (pl.__version__, keys))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load full optimizer state dicts (saved with any number of processes); each rank keeps its shard."""
        # The user's optimizer (OSS builds it on each rank) names the class; OSS's param groups hold every parameter.
        users = [opt.optim if isinstance(opt, OSS) else opt for opt in self.optimizers]
        shapes = [[[p.shape for p in group["params"]] for group in opt.param_groups] for opt in self.optimizers]
        owner, policy = type(self).__name__, self.config.lightning_1x_optimizer_state
        states = resumable_optimizer_states(checkpoint, users, shapes, policy, owner, rank_zero_warn)
        for optimizer, state in zip(self.optimizers, states):
            if isinstance(optimizer, OSS):
                load_full_state(optimizer, state)
            else:
                optimizer.load_state_dict(state)
        _optimizers_to_device(self._local_optimizers(), self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_collective_failure(exception, collective_timeout(self), self.launcher)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Give the Trainer back the plain LightningModule.

        The optimizers stay the sharded ones, so ``trainer.save_checkpoint`` after ``fit`` (on all ranks) writes the
        same checkpoint as during training.
        """
        if isinstance(self.model, ShardedDataParallel):
            self.model = self.lightning_module
        if self._trainability is not None:
            self._trainability.close()
            self._trainability = None
        super().teardown()
        finish_background(self.checkpoint_io)  # the checkpoints written in the background are in place
        _optimizers_to_device(self._local_optimizers(), torch.device("cpu"))


class DDPSpawnShardedStrategy(DDPShardedStrategy):
    """:class:`DDPShardedStrategy` that starts its processes with ``torch.multiprocessing`` (``"spawn"``).

    Lightning 2 has no ``DDPSpawnStrategy`` class: this is ``DDPShardedStrategy(start_method="spawn")``. The script
    is not run again for each rank, so it also works inside other programs (e.g. a test runner); the model and the
    Trainer are pickled to the processes, so the model's class must be importable. Rank 0's trained weights are
    loaded into the model of the calling process afterwards.

    Rank 0's training state at the end of ``fit`` comes back too (Lightning's launcher brings the weights and the
    callback metrics only), so ``trainer.save_checkpoint`` in the calling process writes a checkpoint that resumes
    exactly: the loops' progress, the callbacks', precision plugin's and datamodule's states and, when the run writes
    checkpoints with optimizer state (a ``ModelCheckpoint`` without ``save_weights_only``: Lightning's default), the
    optimizer and LR scheduler states, gathered on rank 0 at the end of ``fit`` as each of those checkpoints gathers
    them. Otherwise nothing is gathered, and that checkpoint holds no optimizer state (saving it warns; resuming it
    continues with a fresh optimizer state and a warning). The same holds for ``DDPShardedStrategy`` with
    ``start_method="spawn"`` or ``"fork"``.

    Args:
        *args: the arguments of :class:`DDPShardedStrategy`, in its order.
        start_method: ``"spawn"`` (the default), ``"fork"`` or ``"forkserver"``; not ``"popen"``.
        **kwargs: the arguments of :class:`DDPShardedStrategy`.

    Example:
        >>> DDPSpawnShardedStrategy()._start_method
        'spawn'
    """

    strategy_name = "ddp_sharded_spawn"
    _registry_names: tuple[str, ...] = ("ddp_sharded_spawn", "ddp_sharded_spawn_find_unused_parameters_false")

    def __init__(
        self, *args: Any, start_method: Literal["spawn", "fork", "forkserver"] = "spawn", **kwargs: Any
    ) -> None:
        check_spawn_start_method(start_method)
        super().__init__(*args, start_method=start_method, **kwargs)  # type: ignore[misc]  # keyword-only here
