"""``DDPFullyShardedStrategy`` for Fabric: FairScale's FSDP in loops you write yourself.

The same engine as the Trainer's strategy (:mod:`lightning_fairscale.fsdp.engine`), behind Fabric's strategy API:
``fabric.setup`` wraps the model and re-points its optimizers, ``fabric.save``/``fabric.load`` write Fabric's
checkpoints, in the Trainer strategy's two formats, and read them and the Trainer's
(:mod:`lightning_fairscale.checkpoint.fabric`).
"""

# No postponed annotations: jsonargparse (LightningCLI) reads the constructor's from `inspect.signature` (a type
# imported for type checkers only is quoted inside, as Lightning does).
import functools

from collections.abc import Iterable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from lightning_fabric.plugins.precision import Precision
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.rank_zero import rank_zero_info
from lightning_fairscale._compat import _PATH, _Sharded, collective_timeout, fabric_compile_options, forward_module
from lightning_fairscale._compat import fabric_precision_property
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale._adapters import config_arguments, lightning_arguments, register_strategies
from lightning_fairscale._adapters.options import FullyShardedOptions
from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy
from lightning_fairscale.distributed import process_exit
from lightning_fairscale.fsdp import engine as fsdp_engine, run as fsdp_run
from lightning_fairscale.fsdp.wrapping.compile import compiler_from_options, unwrap_compiled
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups, release_groups
from lightning_fairscale.fsdp.wrapping.policies import AutoWrapPolicy
from lightning_fairscale.plugins.checkpoint_io import default_checkpoint_io, finish_background
from lightning_fairscale.plugins.checkpoint_io import sharded_storage
from lightning_fairscale.fabric._common import NoBackwardSync, checked_norm, fabric_precision
from lightning_fairscale.fabric._fsdp_set_up import FsdpSetUp, sharded_model, unsharded_shapes
from lightning_fairscale.mixed_precision.grad_scaler import fsdp_grad_scaler
from lightning_fairscale.fsdp.patches.grad_norm import clip_grad_norm_
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.unit.materialize import ParamInitFn, to_device_keeping_meta
from lightning_fairscale.fsdp.wrapping.summary import memory_figures
from lightning_fairscale.fsdp.state.averaging import ShardAveragedModel
from lightning_fairscale.fabric import _fsdp_parts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_fairscale.distributed.torch_private import TorchLRScheduler

__all__ = ["DDPFullyShardedStrategy"]

class DDPFullyShardedStrategy(DDPStrategy, _Sharded, FullyShardedOptions):
    """Fully Sharded Data Parallel training with FairScale, for Fabric (``Fabric(strategy=...)``).

    Shards parameters, gradients and optimizer state across processes (ZeRO stage 3), on GPUs (NCCL) and CPUs (gloo).
    The arguments are those of the Trainer's :class:`lightning_fairscale.strategies.DDPFullyShardedStrategy`; Fabric
    passes its precision plugin as ``precision``. Registered as ``"fsdp_fairscale"`` and ``"ddp_fully_sharded"``. The
    options are typed attributes (:class:`~lightning_fairscale._adapters.options.FullyShardedOptions`), fixed at launch;
    each is declared once, by :class:`~lightning_fairscale.fsdp.config.FullyShardedConfig` (``make options``).

    * ``fabric.setup(model, optimizer)``: the optimizer is made over ``model.parameters()`` before (as for any
      strategy) and re-pointed to the shards. ``fabric.setup_module(model)`` then ``fabric.setup_optimizers(optimizer)``
      works with an optimizer made before or after ``setup_module`` (over the returned model's parameters).
    * ``fabric.init_module()``: ``fairscale.nn.wrap`` and ``torch.distributed.fsdp.wrap.wrap`` in the model's
      constructor make FSDP units (manual wrap; auto wrap is then off); ``empty_init=True`` builds the model on the
      ``meta`` device, and each unit materialises its part when it is sharded (``reset_parameters()`` or
      ``param_init_fn``), so that no rank ever holds the whole model.
    * ``fabric.clip_gradients``: by norm, the global norm of all shards (after unscaling fp16 gradients); by value.
    * ``fabric.no_backward_sync(model)``: gradient accumulation without reduce-scatters (each rank holds its full
      gradient until the last micro-batch); with ``sync_each_batch=True`` it skips nothing: every micro-batch
      reduce-scatters and a rank holds only its gradient shard.
    * ``fabric.save``/``fabric.load``: Fabric's checkpoints (``torch.load(path)["model"]`` is the model's full state
      dict; see :mod:`lightning_fairscale.checkpoint.fabric`), which the Trainer resumes from too, and the Trainer's:
      ``state_dict_type="full"`` one file gathered on rank 0, ``"sharded"`` one file per rank, gathering nothing.

    Args:
        accelerator: the accelerator; Fabric sets it.
        cpu_offload: keep the FP32 parameter shards on the CPU (CUDA only), a bool or torch's ``CPUOffload``.
        flatten_parameters: flatten each unit's parameters into one contiguous tensor (faster).
        reshard_after_forward: free full parameters after the forward pass, gathering them again for backward.
        move_grads_to_cpu: move gradient shards to the CPU after reduction (default: as ``cpu_offload``).
        fp32_reduce_scatter: reduce-scatter gradients in FP32 under mixed precision.
        compute_dtype: the dtype of the full parameters in computation (default: from the precision).
        bucket_cap_mb: the size of the reduce-scatter buckets in MB; ``<= 0`` disables bucketing.
        min_num_params: auto wrap by size: a module with this many unwrapped parameters becomes its own unit.
        state_dict_to_cpu: return full state dicts on the CPU instead of the compute device.
        parallel_devices: the devices of this node; Fabric sets them.
        cluster_environment: the cluster environment; Fabric sets it.
        checkpoint_io: the checkpoint IO plugin (default: :class:`~lightning_fairscale.ShardedCheckpointIO`).
        precision_plugin: another name for ``precision`` (the Trainer's).
        process_group_backend: ``"nccl"``, ``"gloo"``... (default: from the device).
        auto_wrap_policy: which submodules become units: layer classes, FairScale's or torch's policy.
        exclude_wrap_modules: layer classes that never become units themselves under auto wrap.
        force_leaf_modules: layer classes auto wrap does not descend into.
        activation_checkpointing: a layer class, or a list, whose activations are recomputed in backward.
        activation_checkpointing_offload: keep the checkpointed layers' inputs in CPU memory until backward.
        state_dict_type: ``"full"`` (one checkpoint file, gathered on rank 0) or ``"sharded"`` (a file per rank).
        timeout: how long collectives wait for the other ranks before failing.
        start_method: ``"popen"`` (re-run the script for each rank, the default) or ``"spawn"``/``"fork"``.
        precision: the precision plugin; Fabric's ``precision`` flag chooses it.
        lightning_1x_optimizer_state: resuming a Lightning 1.x checkpoint's optimizer state: ``"error"``/``"reset"``.
        activation_checkpointing_policy: Lightning ``FSDPStrategy``'s name for ``activation_checkpointing``.
        param_init_fn: initialises the modules of a model built on the ``meta`` device, unit by unit.
        sharding_strategy: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"``... or torch's enum.
        device_mesh: under hybrid sharding, ``(replicas, shard_size)`` or torch's 2-D ``DeviceMesh``.
        backward_prefetch: when the backward on CPU gathers the next unit (torch's ``BackwardPrefetch`` or its name).
        sync_each_batch: reduce-scatter after every micro-batch when accumulating, instead of ``no_sync``.
        optimizer_path: ``"auto"``/``"elementwise"``/``"whole"``: how optimizers step (Adafactor, Muon: whole).
        **kwargs: passed to FairScale's ``FullyShardedDataParallel``.

    Example:
        >>> from lightning_fairscale.fabric import DDPFullyShardedStrategy
        >>> DDPFullyShardedStrategy(min_num_params=1_000, state_dict_type="sharded").state_dict_type
        'sharded'
    """

    strategy_name = "fsdp_fairscale"

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        cpu_offload: Union[bool, CPUOffload] = False,
        flatten_parameters: bool = True,
        reshard_after_forward: bool = True,
        move_grads_to_cpu: Optional[bool] = None,
        fp32_reduce_scatter: Optional[bool] = None,
        compute_dtype: Optional[torch.dtype] = None,
        bucket_cap_mb: int = 25,
        min_num_params: int = 100_000_000,
        state_dict_to_cpu: bool = True,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        auto_wrap_policy: Optional[AutoWrapPolicy] = None,
        exclude_wrap_modules: Optional[Iterable[type[Module]]] = None,
        force_leaf_modules: Optional[Iterable[type[Module]]] = None,
        activation_checkpointing: Optional[Union[type[Module], list[type[Module]]]] = None,
        activation_checkpointing_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "full",
        timeout: Optional[timedelta] = default_pg_timeout,  # Lightning's default too
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        precision: Optional[Precision] = None,
        lightning_1x_optimizer_state: OptimizerStatePolicy = "error",
        activation_checkpointing_policy: Optional[Union[AutoWrapPolicy, type[Module]]] = None,
        param_init_fn: Optional[ParamInitFn] = None,
        sharding_strategy: Any = "FULL_SHARD",
        device_mesh: Optional[Union[tuple[int, int], "DeviceMesh"]] = None,
        backward_prefetch: Any = "BACKWARD_POST",
        sync_each_batch: bool = False,
        optimizer_path: Literal["auto", "elementwise", "whole"] = "auto",
        **kwargs: Any,
    ) -> None:
        config = FullyShardedConfig(**config_arguments(FullyShardedConfig, locals()), owner=type(self).__name__)
        super().__init__(**lightning_arguments(locals(), "precision"))
        self.config = config  # the options (see `FullyShardedOptions`)
        #: FSDP's process groups, made in ``setup_environment``.
        self._groups = ProcessGroups()
        #: The sharded models set up, and the sharded model each optimizer was re-pointed to.
        self._set_up = FsdpSetUp()
        self._backward_sync_control = NoBackwardSync(self)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fsdp_fairscale"`` and ``"ddp_fully_sharded"`` with Fabric's registry, where free: Lightning's
        own ``"fsdp"`` stays Lightning's."""
        names = ("fsdp_fairscale", "ddp_fully_sharded")
        register_strategies(strategy_registry, cls, names, "FairScale's Fully Sharded Data Parallel")

    #: Fabric's precision plugin, with a sharded grad scaler for fp16 mixed precision (see
    #: :func:`~lightning_fairscale.fabric._common.fabric_precision`).
    precision = fabric_precision_property(DDPStrategy, functools.partial(fabric_precision, scaler=fsdp_grad_scaler))

    checkpoint_io = default_checkpoint_io(DDPStrategy)

    def fsdp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every FSDP unit of this strategy is built with."""
        return fsdp_run.fsdp_kwargs(self.config, self.root_device, self._groups, self.precision.precision)

    @override
    def setup_environment(self) -> None:
        """Lightning's set-up (the default process group), then everything FSDP needs; all ranks together."""
        with process_exit.closing_at_exit(self):
            super().setup_environment()
        self._groups = fsdp_engine.set_up_run(
            self.config, self.root_device, self.precision.precision, self.global_rank, self.world_size,
            self.num_nodes, collective_timeout(self),
        )
        self._fix_options()
        if self.config.state_dict_type == "sharded":
            sharded_storage(self.checkpoint_io)  # fail before training, not at the first save

    @override
    def teardown(self) -> None:
        """Lightning's teardown; the process groups are destroyed too, unless a sharded model's owner holds them (a
        model set up and not unsharded: see :mod:`lightning_fairscale.fsdp.patches.hybrid`)."""
        if release_groups(self._groups):
            self._groups = ProcessGroups()
        super().teardown()
        finish_background(self.checkpoint_io)  # the checkpoints written in the background are in place

    # ------------------------------------------------------------------------------------------------------------
    # Models and optimizers

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        """Inside this context, ``fairscale.nn.wrap`` and ``torch.distributed.fsdp.wrap.wrap`` make FSDP units."""
        return fsdp_engine.wrapping_context(self.config, self.root_device, self._groups, self.precision.precision)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Tensors on the root device (the CPU with ``cpu_offload``: offloaded shards start there), or with
        ``empty_init=True`` on the ``meta`` device: each FSDP unit then materialises its part just before sharding
        it (see :mod:`lightning_fairscale.fsdp.unit.materialize`); ``wrap`` makes FSDP units."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        elif not fsdp_run.offloads_to_cpu(self.config, self.root_device):
            stack.enter_context(self.root_device)
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(self.module_sharded_context())
        return stack

    @override
    def module_to_device(self, module: Module) -> None:
        if not fsdp_run.offloads_to_cpu(self.config, self.root_device):
            to_device_keeping_meta(module, self.root_device)  # meta tensors are materialised by their unit

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional["TorchLRScheduler"] = None
    ) -> tuple[Module, list[Optimizer], Optional["TorchLRScheduler"]]:
        """Wrap the model and re-point its optimizers (made over its parameters) to the shards; LR schedulers work
        as they are."""
        root = self.setup_module(module)
        return root, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: Module) -> FullyShardedDataParallel:
        """Wrap the model: auto wrap (or the units made in ``fabric.init_module()``), then the root unit.

        A model given to ``fabric.setup`` compiled (``torch.compile(model)``) has its layers compiled with the same
        options, each unit's gather and reshard around them (workaround 18); Fabric then compiles the root unit
        with them too, which runs the units as they are (dynamo does not trace a unit)."""
        module, compiler = unwrap_compiled(module)  # compiled, and Fabric told not to take it off
        options = fabric_compile_options()
        if compiler is None and options is not None:
            compiler = compiler_from_options(options)
        if fsdp_engine.is_set_up(module):
            raise ValueError("The model is set up already: pass the model you created to `fabric.setup` once.")
        wrapped = fsdp_engine.wrap_model(
            self.config, module, self.root_device, self._groups, self.precision.precision, rank_zero_info, None,
            compiler,
        )
        return self._set_up.add(wrapped)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Re-point the optimizer to the shards of the model whose parameters it holds (refused when its param
        groups were made from the shards' shapes: see :func:`~._common.refuse_groups_by_shard_shapes`)."""
        self._set_up.repoint(optimizer, self.config)
        return optimizer

    def averaged_model(self, module: Module, **kwargs: Any) -> ShardAveragedModel:
        """``torch.optim.swa_utils.AveragedModel(module, **kwargs)`` (EMA with ``avg_fn=get_ema_avg_fn(...)``, SWA by
        default) over this rank's shards of a set-up model: ``update_parameters(module)`` after a step, ``with
        averaged.swapped_in(): ...`` to evaluate or save the average; ``state_dict()`` is its full state dict (rank 0;
        a collective call), which ``load_state_dict`` takes back (see
        :mod:`lightning_fairscale.fsdp.state.averaging`)."""
        return self._set_up.averaged_model(module, self.is_global_zero, **kwargs)

    def unsharded_shapes(self, module: Module) -> AbstractContextManager[None]:
        """A context in which the parameters of ``module`` (set up) show their unsharded ``shape``, ``ndim``,
        ``numel()``, names, dtype, device and ``requires_grad`` (1-D shards outside it), and no values, for an
        optimizer's param groups: ``with fabric.strategy.unsharded_shapes(model): optimizer = AdamW([{"params":
        [p for p in model.parameters() if p.ndim >= 2], ...}, ...])``, then ``fabric.setup_optimizers(optimizer)``."""
        return unsharded_shapes(module)

    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """Fabric's backward; an exception raised in it (a hook of the user's) leaves every model set up here as its
        last completed step left it (see :mod:`~lightning_fairscale.fsdp.unit.recovery`), and goes on unchanged."""
        try:
            super().backward(tensor, module, *args, **kwargs)
        except BaseException:
            self._set_up.recover()
            raise

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's optimizer step; one of an optimizer on the whole path that raises leaves no parameter whole and
        the other ranks told (``fsdp.state.whole_step``), so that they raise too instead of waiting."""
        try:
            return super().optimizer_step(optimizer, **kwargs)
        except BaseException:
            self._set_up.abort_steps(optimizer)
            raise

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
        # The global norm of all shards: `torch.nn.utils.clip_grad_norm_` of the unsharded model.
        params = [param for group in optimizer.param_groups for param in group["params"] if param.grad is not None]
        # Over the group the optimizer's units shard over (one replica's under hybrid sharding), on every rank alike.
        group = self._set_up.model_of(optimizer).norm_group(optimizer) if self._set_up.holds(optimizer) else None
        norm = clip_grad_norm_(params, max_norm, norm_type, group=group)
        return checked_norm(norm, norm_type, error_if_nonfinite)

    def memory_figures(self, module: Module, optimizers: Optional[list[Optimizer]] = None) -> dict[str, float]:
        """This rank's bytes of parameters, gradients and optimizer state of ``module`` (set up), and peak device
        memory on CUDA; e.g. ``fabric.log_dict(fabric.strategy.memory_figures(model, [optimizer]))``."""
        return memory_figures(forward_module(module), [getattr(opt, "optimizer", opt) for opt in optimizers or []])

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
        state's keys, each module and optimizer replaced by its full state dict, in one file written by rank 0; or,
        for a model sharded with ``state_dict_type="sharded"``, a directory of one shard per rank, gathering nothing,
        and a meta file with the state's other entries.

        With a plugin that saves in the background (``ShardedCheckpointIO(async_save=True)``), the files are written
        on its thread: every rank first checks that no earlier background write failed (a sharded save waits until
        the previous one is complete), then copies what it writes and returns."""
        _fsdp_parts.save(self, self._set_up, self.config, path, state, storage_options, filter)

    @override
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
        left as they are. Checkpoints still being written in the background are written first, on every rank."""
        return _fsdp_parts.load(self, self._set_up, path, state, strict, weights_only)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The full state dict with the unwrapped module's keys, on rank 0 (a collective call)."""
        model = sharded_model(module)
        if model is None:
            return super().get_module_state_dict(module)
        return model.state_dict(sharded=False, is_global_zero=self.is_global_zero)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a full state dict (the unwrapped module's keys) into this rank's shards, reading only their slices.

        With ``strict=False``, the model's parameters and buffers that the state dict lacks keep their values and its
        other entries are ignored (a warning names them); shapes must still match."""
        model = sharded_model(module)
        if model is None:
            return super().load_module_state_dict(module, state_dict, strict=strict)
        model.load_full(state_dict, strict)
        return None

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The state of a plain optimizer over the unwrapped module, on rank 0 (a collective call)."""
        if not self._set_up.holds(optimizer):
            return super().get_optimizer_state(optimizer)
        return self._set_up.optimizer_state(optimizer, sharded=False)
