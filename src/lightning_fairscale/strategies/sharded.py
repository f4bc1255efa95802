"""``DDPShardedStrategy``: FairScale's sharded optimizer state and gradients (OSS + ShardedDDP) under Lightning 2.x.

Each optimizer from ``configure_optimizers`` is rebuilt as a :class:`fairscale.optim.OSS` over the same param groups
and hyperparameters, so every rank keeps the optimizer state of its share of the parameters only (ZeRO stage 1),
and the module is wrapped in :class:`fairscale.nn.data_parallel.ShardedDataParallel`, which reduces each gradient
to the rank that owns its parameter (stage 2). Parameters stay whole on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from lightning_fabric.plugins import CheckpointIO
from lightning_fairscale._compat import _optimizers_to_device
from pytorch_lightning.core.optimizer import LightningOptimizer
from lightning_fairscale._compat import _PATH, _MockOptimizer, StrategyInternals
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.oss import (
    ShardedDDPOptions,
    SpawnOnly,
    full_state,
    load_full_state,
    reattach_bucketed_gradients,
    repoint_schedulers,
    shard_optimizer,
    sync_module_states,
)
from lightning_fairscale.precision.sharded import ShardedPrecisionPlugin, sharded_precision_plugin
from lightning_fairscale.checkpoint_io import ShardedCheckpointIO
from lightning_fairscale.strategies._callbacks import check_sharded_ddp_callbacks, trainer_callbacks
from lightning_fairscale.checkpoint.checks import resumable_optimizer_states
from lightning_fairscale.checkpoint.fabric import is_trainer_layout, to_trainer_layout
from lightning_fairscale.strategies._lost_ranks import report_collective_failure

__all__ = ["DDPShardedStrategy", "DDPSpawnShardedStrategy", "shard_optimizer"]


class DDPShardedStrategy(ShardedDDPOptions, StrategyInternals, DDPStrategy):
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
        precision: another name for ``precision_plugin`` (Fabric's).
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
    _precision_name = "precision_plugin"

    # ------------------------------------------------------------------------------------------------------------
    # Configuration

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin_slot()
        return plugin if plugin is not None else ShardedPrecisionPlugin()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._set_precision_plugin_slot(None if plugin is None else sharded_precision_plugin(plugin))

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = self._layer_sync_plugin()
        if fitting and layer_sync:
            self.model = layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
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
        return self._wrap(model, self._sharded_optimizers())

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before each backward pass: the gradient buckets must hold the gradients (see ``reduce_buffer_size``)."""
        super().pre_backward(closure_loss)
        if isinstance(self.model, ShardedDataParallel):
            reattach_bucketed_gradients(self.model)

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
        return full_state(optimizer, self.is_global_zero)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """:class:`~lightning_fairscale.ShardedCheckpointIO` unless the Trainer got another: checkpoint files are
        written beside their target and renamed into place, so a save killed midway keeps the previous one."""
        if self._checkpoint_io_slot() is None:
            self._set_checkpoint_io_slot(ShardedCheckpointIO())
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._set_checkpoint_io_slot(io)

    @override
    def setup_environment(self) -> None:
        check_sharded_ddp_callbacks(trainer_callbacks(self), type(self).__name__)  # before any process group
        super().setup_environment()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The checkpoint, a Fabric checkpoint (``fabric.save``) read in the Trainer's layout (see
        :func:`~lightning_fairscale.checkpoint.fabric.to_trainer_layout`); the file is not changed."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if is_trainer_layout(checkpoint):
            return checkpoint
        assert self.lightning_module is not None
        return to_trainer_layout(checkpoint, pl.__version__, list(self.lightning_module.state_dict()))

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
                load_full_state(optimizer, state)
            else:
                optimizer.load_state_dict(state)
        _optimizers_to_device(self._local_optimizers(), self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_collective_failure(exception, self._collective_timeout(), self.launcher)
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


class DDPSpawnShardedStrategy(SpawnOnly, DDPShardedStrategy):
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


