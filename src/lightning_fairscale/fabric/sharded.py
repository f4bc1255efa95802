"""``DDPShardedStrategy`` for Fabric: FairScale's sharded optimizer state and gradients in loops you write yourself.

The same pieces as the Trainer's strategy (:mod:`lightning_fairscale.oss`) behind Fabric's strategy API: the
optimizers given to ``fabric.setup`` become ``fairscale.optim.OSS`` (same class, param groups and hyperparameters),
the model a ``ShardedDataParallel``; ``fabric.save``/``fabric.load`` write and read the Trainer's checkpoint files.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from lightning_fabric import __version__ as lightning_version
from lightning_fabric.plugins.precision import Precision
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.fabric._common import NoBackwardSync, fabric_precision
from lightning_fairscale.fabric_checkpoint import Roles, convert, restore, to_checkpoint
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
from lightning_fairscale.strategies._process_exit import close_process_group_at_exit

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import _LRScheduler

__all__ = ["DDPShardedStrategy", "DDPSpawnShardedStrategy"]


class DDPShardedStrategy(ShardedDDPOptions, DDPStrategy):
    """Optimizer state and gradient sharding with FairScale (OSS + ShardedDDP), for Fabric (``Fabric(strategy=...)``).

    The arguments are those of the Trainer's :class:`lightning_fairscale.strategies.DDPShardedStrategy`; Fabric
    passes its precision plugin as ``precision``. Registered as ``"ddp_sharded"``.

    * ``fabric.setup(model, optimizer, scheduler=...)`` (together: ``ShardedDataParallel`` needs the optimizers):
      each optimizer is rebuilt as ``fairscale.optim.OSS`` and returned in its place, and the LR scheduler given is
      re-pointed to it. ``fabric.setup(model)`` alone gives the plain model, with rank 0's weights, for evaluation.
    * ``fabric.clip_gradients``: by norm, the norm of all ranks' gradients (``OSS.clip_grad_norm``); by value.
    * ``fabric.no_backward_sync(model)``: gradient accumulation without reductions.
    * ``fabric.save``/``fabric.load``: one file written by rank 0, the Trainer's format (a plain optimizer's state,
      consolidated from the shards): it resumes on any number of processes, with the Trainer too.

    Example:
        >>> from lightning_fairscale.fabric import DDPShardedStrategy
        >>> DDPShardedStrategy(reduce_buffer_size=2**20).reduce_buffer_size
        1048576
    """

    strategy_name = "ddp_sharded"
    _precision_name = "precision"

    @override
    def _init_adapter(self) -> None:
        self._backward_sync_control = NoBackwardSync()
        #: The models set up, wrapped (``ShardedDataParallel``) or plain (set up without optimizers).
        self._models: weakref.WeakSet[Module] = weakref.WeakSet()

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = fabric_precision(precision, type(self).__name__)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        close_process_group_at_exit(self)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[_LRScheduler] = None
    ) -> tuple[Module, list[Optimizer], Optional[_LRScheduler]]:
        """Rebuild the optimizers as OSS (the scheduler follows its optimizer) and wrap the model in
        ``ShardedDataParallel``."""
        sharded = []
        for optimizer in optimizers:
            new = optimizer if isinstance(optimizer, OSS) else shard_optimizer(optimizer, self.broadcast_fp16)
            if scheduler is not None:
                repoint_schedulers([scheduler], optimizer, new)
            sharded.append(new)
        wrapped = self._wrap(module, sharded)
        self._models.add(wrapped)
        return wrapped, sharded, scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        """The plain model, with rank 0's weights on every rank: for evaluation (training needs the optimizers)."""
        sync_module_states(module)
        self._models.add(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise RuntimeError(
            f"`{type(self).__name__}` shards the optimizers and the gradients together: set up the model and its"
            " optimizers in one call, `model, optimizer = fabric.setup(model, optimizer)`."
        )

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        # Before each backward pass the gradient buckets must hold the gradients (see `reduce_buffer_size`).
        for model in list(self._models):
            if isinstance(model, ShardedDataParallel):
                reattach_bucketed_gradients(model)
        super().backward(tensor, module, *args, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of all ranks' gradients together (``OSS.clip_grad_norm``); returns that norm."""
        if not isinstance(optimizer, OSS):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        return optimizer.clip_grad_norm(max_norm, norm_type=norm_type)

    # ------------------------------------------------------------------------------------------------------------
    # State dicts and checkpoints

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return super().get_module_state_dict(_unwrap(module))

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(_unwrap(module), state_dict, strict=strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The state of a plain optimizer of the same class, on rank 0 (a collective call for OSS)."""
        return full_state(optimizer, self.is_global_zero)

    def _load_optimizer(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        if isinstance(optimizer, OSS):
            load_full_state(optimizer, state)  # each rank keeps its shard
            _optimizers_to_device([optimizer, optimizer.optim], self.root_device)
        else:
            optimizer.load_state_dict(state)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Rank 0 writes the Trainer's checkpoint file: the model's state dict and plain optimizer states."""
        roles = Roles.of(state, lambda module: module in self._models)
        converted = convert(state, roles, self.get_module_state_dict, self.get_optimizer_state, filter)
        checkpoint = to_checkpoint(converted, roles, lightning_version)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint file (saved by any number of processes, by Fabric or the Trainer)."""
        if isinstance(state, Optimizer):  # `fabric.load_raw(path, optimizer)`: a plain optimizer's state
            self._load_optimizer(state, self.checkpoint_io.load_checkpoint(path, weights_only=weights_only))
            return {}
        if not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        roles = Roles.of(state, lambda module: module in self._models)
        load_model = lambda module, state_dict: self.load_module_state_dict(module, state_dict, strict)  # noqa: E731
        return restore(checkpoint, state, roles, strict, load_model, self._load_optimizer)


class DDPSpawnShardedStrategy(SpawnOnly, DDPShardedStrategy):
    """:class:`DDPShardedStrategy` that starts its processes with ``torch.multiprocessing`` (``"spawn"``):
    ``fabric.launch(function)`` runs ``function`` in each. Registered as ``"ddp_sharded_spawn"``.

    Example:
        >>> DDPSpawnShardedStrategy()._start_method
        'spawn'
    """

    strategy_name = "ddp_sharded_spawn"


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, ShardedDataParallel) else module
