"""``DDPShardedStrategy`` for Fabric: FairScale's sharded optimizer state and gradients in loops you write yourself.

The same pieces as the Trainer's strategy (:mod:`lightning_fairscale.sharded_ddp.engine`) behind Fabric's strategy API:
the optimizers given to ``fabric.setup`` become ``fairscale.optim.OSS`` (same class, param groups and hyperparameters),
the model a ``ShardedDataParallel``; ``fabric.save``/``fabric.load`` write Fabric's checkpoints (the optimizers' states
consolidated) and read them and the Trainer's (:mod:`lightning_fairscale.checkpoint.fabric`).
"""

from __future__ import annotations

import functools
import weakref

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from lightning_fabric.plugins.precision import Precision
from lightning_fabric.strategies import DDPStrategy
from lightning_fairscale._compat import _PATH, _optimizers_to_device, fabric_compile_options, fabric_precision_property
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
from lightning_fairscale.sharded_ddp import engine as oss
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig
from lightning_fairscale.sharded_ddp.trainability import Trainability, clip_grad_norm
from lightning_fairscale import checkpointer
from lightning_fairscale.checkpoint.fabric import Roles
from lightning_fairscale.checkpointer import FabricLayout
from lightning_fairscale.fabric._common import (
    NoBackwardSync,
    SetUp,
    checked_norm,
    fabric_precision,
    refuse_sharded,
)
from lightning_fairscale.mixed_precision.grad_scaler import sharded_grad_scaler
from lightning_fairscale.fsdp.wrapping.compile import compiler_from_options
from lightning_fairscale.plugins.checkpoint_io import checkpoint_files, default_checkpoint_io

if TYPE_CHECKING:
    from lightning_fairscale.distributed.torch_private import TorchLRScheduler

__all__ = ["DDPShardedStrategy", "DDPSpawnShardedStrategy"]


class DDPShardedStrategy(DDPStrategy, ShardedDDPOptions):
    """Optimizer state and gradient sharding with FairScale (OSS + ShardedDDP), for Fabric (``Fabric(strategy=...)``).

    The arguments are those of the Trainer's :class:`lightning_fairscale.strategies.DDPShardedStrategy`; Fabric
    passes its precision plugin as ``precision``. Registered as ``"ddp_sharded"``. The options are typed attributes
    (:class:`~lightning_fairscale._adapters.options.ShardedDDPOptions`), fixed at launch but
    ``lightning_1x_optimizer_state``; each is declared once, by
    :class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig` (``make options``).

    * ``fabric.setup(model, optimizer, scheduler=...)`` (together: ``ShardedDataParallel`` needs the optimizers):
      each optimizer is rebuilt as ``fairscale.optim.OSS`` and returned in its place, and the LR scheduler given is
      re-pointed to it. ``fabric.setup(model)`` alone gives the plain model, with rank 0's weights, for evaluation.
    * ``fabric.clip_gradients``: by norm, the norm of all ranks' gradients (``OSS.clip_grad_norm``); by value.
    * ``fabric.no_backward_sync(model)``: gradient accumulation without reductions; with ``sync_each_batch=True``
      it skips nothing: every micro-batch reduces, and a rank holds only the gradients of the parameters it owns.
    * ``fabric.save``/``fabric.load``: one file written by rank 0, Fabric's layout (``torch.load(path)["model"]`` is
      the model's state dict; each optimizer's the state of a plain optimizer, consolidated from the shards): it
      resumes on any number of processes, with the Trainer too; the Trainer's files load as well. The file is
      written atomically by the default CheckpointIO plugin, :class:`~lightning_fairscale.ShardedCheckpointIO`: a
      save killed midway leaves the previous checkpoint of that path intact.

    Args:
        accelerator: the accelerator; Fabric sets it.
        parallel_devices: the devices of this node; Fabric sets them.
        cluster_environment: the cluster environment; Fabric sets it.
        checkpoint_io: the checkpoint IO plugin (default: :class:`~lightning_fairscale.ShardedCheckpointIO`).
        precision_plugin: another name for ``precision`` (the Trainer's).
        process_group_backend: ``"nccl"``, ``"gloo"``... (default: from the device).
        timeout: how long collectives wait for the other ranks before failing.
        start_method: ``"popen"`` (re-run the script for each rank, the default) or ``"spawn"``/``"fork"``.
        find_unused_parameters: only ``False``: ``ShardedDataParallel`` has no search for unused parameters.
        precision: the precision plugin; Fabric's ``precision`` flag chooses it.
        lightning_1x_optimizer_state: resuming a Lightning 1.x FSDP checkpoint's optimizer state: ``"error"`` (default)
            or ``"reset"``, as in ``DDPFullyShardedStrategy``.
        sync_each_batch: reduce after every micro-batch when accumulating, instead of ``ShardedDataParallel.no_sync``.
        **kwargs: passed to FairScale's ``ShardedDataParallel``, e.g. ``reduce_buffer_size`` (default: ``0`` on one
            node, ``2**23`` elements on several), ``broadcast_buffers``, ``reduce_fp16``. The strategy follows
            parameters frozen or unfrozen and eval/train switches itself (see
            :mod:`lightning_fairscale.sharded_ddp.trainability`): ``auto_refresh_trainable`` and
            ``warn_on_trainable_params_changed`` are accepted and have no effect.

    Example:
        >>> from lightning_fairscale.fabric import DDPShardedStrategy
        >>> DDPShardedStrategy(reduce_buffer_size=2**20).reduce_buffer_size
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
        checkpoint_io: Optional[Any] = None,
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
        super().__init__(**lightning_arguments(locals(), "precision"))
        self.config = config  # the options (see `ShardedDDPOptions`)
        #: The models set up, wrapped (``ShardedDataParallel``) or plain (set up without optimizers).
        self._set_up: SetUp[None] = SetUp()
        #: For each wrapped model, what it derived from its trainable parameters, kept up to date.
        self._trainability: _Trainabilities = _Trainabilities()
        self._backward_sync_control = NoBackwardSync(self)

    checkpoint_io = default_checkpoint_io(DDPStrategy)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register :attr:`_registry_names` with Fabric's registry, where free."""
        description = f"FairScale's sharded optimizer and gradients ({cls.__name__})"
        register_strategies(strategy_registry, cls, cls._registry_names, description, find_unused_parameters=False)

    #: Fabric's precision plugin, with a sharded grad scaler for fp16 mixed precision (see
    #: :func:`~lightning_fairscale.fabric._common.fabric_precision`).
    precision = fabric_precision_property(DDPStrategy, functools.partial(fabric_precision, scaler=sharded_grad_scaler))

    @property
    def reduce_buffer_size(self) -> int:
        """Size of ``ShardedDataParallel``'s gradient buckets in elements: ``0`` (no buckets) on one node by default."""
        return sharded_config.reduce_buffer_size(self.config, self.num_nodes)

    @property
    def broadcast_fp16(self) -> bool:
        """Whether OSS sends updated parameters in fp16: under fp16 mixed precision on several nodes."""
        return sharded_config.broadcast_fp16(self.precision.precision, self.num_nodes)

    def sharded_ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``ShardedDataParallel`` is built with (besides the module and optimizers)."""
        return sharded_config.sharded_ddp_kwargs(self.config, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """Lightning's set-up (the default process group), and its clean-up at exit."""
        with process_exit.closing_at_exit(self):
            super().setup_environment()
        self._fix_options()

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[TorchLRScheduler] = None
    ) -> tuple[Module, list[Optimizer], Optional[TorchLRScheduler]]:
        """Rebuild the optimizers as OSS (the scheduler follows its optimizer) and wrap the model in
        ``ShardedDataParallel``."""
        oss.check_optimizers(optimizers)  # before the first is sharded: refused on every rank alike
        sharded = []
        for optimizer in optimizers:
            new = optimizer if isinstance(optimizer, OSS) else oss.shard_optimizer(optimizer, self.broadcast_fp16)
            if scheduler is not None:
                oss.repoint_schedulers([scheduler], optimizer, new)
            sharded.append(new)
        options = fabric_compile_options()  # `fabric.setup(torch.compile(model))`: the model inside is compiled
        compiler = None if options is None else compiler_from_options(options)
        wrapped, self._trainability[wrapped] = oss.wrap_model(self.config, module, sharded, self.num_nodes, compiler)
        self._set_up.models.add(wrapped)
        return wrapped, sharded, scheduler

    @override
    def setup_module(self, module: Module) -> Module:  # type: ignore[override]  # the plain model, not a DDP wrapper
        """The plain model, with rank 0's weights on every rank: for evaluation (training needs the optimizers)."""
        oss.sync_module_states(module)
        self._set_up.models.add(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise RuntimeError(
            f"`{type(self).__name__}` shards the optimizers and the gradients together: set up the model and its"
            " optimizers in one call, `model, optimizer = fabric.setup(model, optimizer)`."
        )

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        # Before each backward pass: parameters frozen or unfrozen since the forward pass are followed, the gradient
        # buckets must hold the gradients (see `reduce_buffer_size`), and the reduced gradients of earlier
        # micro-batches are set aside, then added back (`sync_each_batch`): see `Trainability.begin_backward`.
        states = list(self._trainability.values())
        for state in states:
            state.begin_backward()
        try:
            super().backward(tensor, module, *args, **kwargs)
        except BaseException:
            for state in states:  # as the last completed step left them; the error goes on (issue 47, item 5)
                state.recover()
            raise
        finally:
            for state in states:
                state.end_backward()

    @override
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
        if isinstance(optimizer, OSS):  # the norm of all ranks' gradients, each rank holding those it owns
            norm = clip_grad_norm(optimizer, max_norm, norm_type=norm_type)
        else:
            params = [param for group in optimizer.param_groups for param in group["params"]]  # whole on every rank
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return checked_norm(norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------------------------------------------------
    # State dicts and checkpoints

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Save the state as Lightning's Fabric strategies do (see :mod:`lightning_fairscale.checkpoint.fabric`): the
        state's keys, each module and optimizer replaced by its full state dict (each OSS optimizer's consolidated,
        a collective call), in one file written by rank 0."""
        roles = Roles.of(state, self._is_ours)
        states = {  # collective calls (each OSS optimizer's), in the state's order on every rank
            key: self.get_module_state_dict(value) if key == roles.model else self.get_optimizer_state(value)
            for key, value in state.items()
            if key == roles.model or key in roles.optimizers
        }
        files = checkpoint_files(self.checkpoint_io, self.global_rank)
        checkpointer.save_full(files, path, state, storage_options, (FabricLayout(roles, filter), states))

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint (Fabric's or the Trainer's, saved by any number of processes), each
        OSS optimizer keeping its shard of the state; returns what the state did not ask for.

        ``fabric.load_raw(path, model)`` reads a plain state dict file or the model's entry of a checkpoint. With
        ``strict=False`` the entries of ``state`` that the checkpoint lacks are left as they are. A checkpoint still
        being written in the background is written first."""
        refuse_sharded(self.checkpoint_io, path)
        roles = Roles.of(state, self._is_ours) if isinstance(state, dict) and state else None
        keys = list(_unwrap(state).state_dict()) if isinstance(state, Module) else None
        files = checkpoint_files(self.checkpoint_io, self.global_rank)
        restored = checkpointer.read_fabric(files, path, state, roles, keys, strict, weights_only)
        for obj, value in restored.loads:
            if isinstance(obj, Optimizer):
                self._load_optimizer(obj, value)
            else:
                self.load_module_state_dict(obj, value, strict)
        return restored.rest

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return super().get_module_state_dict(_unwrap(module))

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(_unwrap(module), state_dict, strict=strict)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The state of a plain optimizer of the same class, on rank 0 (a collective call for OSS)."""
        return oss.full_state(optimizer, self.is_global_zero)

    def _is_ours(self, module: Module) -> bool:
        return module in self._set_up.models

    def _load_optimizer(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        if isinstance(optimizer, OSS):
            oss.load_full_state(optimizer, state)  # each rank keeps its shard
            _optimizers_to_device([optimizer, optimizer.optim], self.root_device)
        else:
            optimizer.load_state_dict(state)


class DDPSpawnShardedStrategy(DDPShardedStrategy):
    """:class:`DDPShardedStrategy` that starts its processes with ``torch.multiprocessing`` (``"spawn"``):
    ``fabric.launch(function)`` runs ``function`` in each. Registered as ``"ddp_sharded_spawn"``.

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


class _Trainabilities(weakref.WeakKeyDictionary[ShardedDataParallel, Trainability]):
    """Each wrapped model's :class:`Trainability`, held as long as the model lives; not pickled (Fabric's
    ``start_method="spawn"`` pickles the strategy before anything is set up)."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(self), ()


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, ShardedDataParallel) else module
