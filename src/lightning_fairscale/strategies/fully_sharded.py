"""``DDPFullyShardedStrategy``: FairScale's Fully Sharded Data Parallel under Lightning 2.x's Trainer."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Generator, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import pytorch_lightning as pl
import torch
import torch.distributed.fsdp.wrap as torch_wrap
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from fairscale.nn.wrap import enable_wrap
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.strategies import _StrategyRegistry
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale import fairscale_cpu
from lightning_fairscale.checkpoint_io import ShardedCheckpointIO
from lightning_fairscale.fairscale_cpu import FullyShardedDataParallel
from lightning_fairscale.model_summary import use_for_model_summaries
from lightning_fairscale.precision.fully_sharded import (
    FullyShardedMixedPrecisionPlugin,
    FullyShardedPrecisionPlugin,
    fully_sharded_precision_plugin,
)
from lightning_fairscale.optim import (
    GroupOrder,
    ParameterLayout,
    consolidate_state,
    managed_positions,
    repoint_optimizer,
    shard_state,
)
from lightning_fairscale.legacy_checkpoint import OptimizerStatePolicy, validate_policy
from lightning_fairscale.resharding import SavedShards, load_full_state_dict
from lightning_fairscale.strategies._callbacks import check_callbacks
from lightning_fairscale.strategies._checkpoint import (
    check_state_dict_fits,
    optimizer_states,
    resumable_optimizer_states,
)
from lightning_fairscale.strategies._lost_ranks import report_collective_failure
from lightning_fairscale.strategies._process_exit import close_process_group_at_exit
from lightning_fairscale.sharded_checkpoint import (
    FORMAT_KEY,
    check_fits,
    check_wrapping,
    split_checkpoint,
)
from lightning_fairscale.summary import memory_figures, unit_summary
from lightning_fairscale.wrapping import (
    AutoWrapPolicy,
    add_aliases,
    apply_activation_checkpointing,
    apply_aliases,
    auto_wrap_policy,
    clean_path,
    forget_root,
    module_aliases,
    remember_root,
    remove_activation_checkpointing,
    root_parameters_visible,
    unwrap_module,
    validate_auto_wrap_policy,
    validate_layer_classes,
    wrap_module,
    wrapped_root,
)

log = logging.getLogger(__name__)

#: Arguments of FairScale's FSDP that the strategy sets itself; users set them through the strategy's arguments.
_MANAGED_FSDP_ARGUMENTS = {
    "module": "the strategy wraps the LightningModule itself",
    "process_group": "the strategy uses the Trainer's process group",
    "compute_device": "the Trainer's `accelerator`/`devices` choose it",
    "mixed_precision": "the Trainer's `precision` flag sets it",
    "move_params_to_cpu": "use `cpu_offload`",
    "state_dict_device": "use `state_dict_to_cpu`",
}
_FSDP_ARGUMENTS = set(inspect.signature(_FairScaleFSDP.__init__).parameters) - {"self"}


class DDPFullyShardedStrategy(DDPStrategy):
    """Fully Sharded Data Parallel training with FairScale, for Lightning 2.x.

    Shards parameters, gradients and optimizer state across processes (ZeRO stage 3). The arguments are those of
    Lightning 1.x's ``DDPFullyShardedStrategy``, plus ``auto_wrap_policy``; any other keyword goes to FairScale's
    ``FullyShardedDataParallel``. Runs on GPUs (NCCL) and on CPUs (gloo).

    Args:
        accelerator: the accelerator; the Trainer sets it.
        cpu_offload: keep the FP32 parameter shards on the CPU (CUDA only; ignored with a warning on CPU runs).
        flatten_parameters: flatten each unit's parameters into one contiguous tensor (faster).
        reshard_after_forward: free full parameters after the forward pass, gathering them again for backward.
        move_grads_to_cpu: move gradient shards to the CPU after reduction (defaults to ``cpu_offload``).
        fp32_reduce_scatter: reduce-scatter gradients in FP32 under mixed precision.
        compute_dtype: dtype of the full parameters used in computation (defaults from ``precision``).
        bucket_cap_mb: size of the reduce-scatter buckets in MB; ``<= 0`` disables bucketing.
        min_num_params: a module with at least this many unwrapped parameters becomes its own unit (auto wrap).
        state_dict_to_cpu: return full state dicts on the CPU instead of the compute device.
        parallel_devices: the devices of this node; the Trainer sets them.
        cluster_environment: the cluster environment; the Trainer sets it.
        checkpoint_io: the checkpoint IO plugin.
        precision_plugin: the precision plugin; the Trainer's ``precision`` flag chooses it.
        process_group_backend: ``"nccl"``, ``"gloo"``... (default: from the device).
        auto_wrap_policy: which submodules become units when the model wraps nothing itself: a set of layer classes
            (each instance its own unit), or a callable with FairScale's policy signature
            ``(module, recurse, unwrapped_params, module_is_root) -> bool``. Default: by size (``min_num_params``).
        exclude_wrap_modules: layer classes that never become units themselves under auto wrap (their children
            still can). Default: FairScale's (``nn.ModuleList``, ``nn.ModuleDict``) for the size policy, none else.
        force_leaf_modules: layer classes auto wrap does not descend into: neither they nor their children become
            units, their parameters belong to the enclosing unit. Default: FairScale's (``nn.MultiheadAttention``) for the size policy, none else.
        activation_checkpointing: a layer class, or a list of them, whose instances recompute their activations in
            the backward pass instead of keeping them (FairScale's ``checkpoint_wrapper``, inside the FSDP unit).
        activation_checkpointing_offload: keep the checkpointed layers' inputs in CPU memory until backward.
        state_dict_type: ``"full"`` (default): checkpoints are one file with the full model and optimizer state,
            gathered on rank 0, loadable anywhere. ``"sharded"``: every rank writes its own shard into a checkpoint
            directory, in parallel, and no rank gathers the full model; it resumes on the same number of processes,
            and ``lightning-fairscale-consolidate`` turns it into a full checkpoint. Loading accepts either kind.
        timeout: how long collectives wait for the other ranks before failing.
        start_method: ``"popen"`` (re-run the script for each rank, the default) or ``"spawn"``/``"fork"``.
        lightning_1x_optimizer_state: resuming a checkpoint of Lightning 1.x's FairScale FSDP strategy, whose
            optimizer state is rank 0's shard only: ``"error"`` (default) fails before training when the optimizer
            has per-parameter state (Adam...); ``"reset"`` starts that state afresh, with the checkpoint's
            hyperparameters. Stateless optimizers (SGD without momentum) resume exactly either way.
        **kwargs: passed to FairScale's ``FullyShardedDataParallel``.

    Example:
        >>> from lightning_fairscale.strategies import DDPFullyShardedStrategy
        >>> strategy = DDPFullyShardedStrategy(min_num_params=1_000_000, bucket_cap_mb=50)
        >>> strategy.min_num_params
        1000000
    """

    strategy_name = "fsdp_fairscale"

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        cpu_offload: bool = False,
        flatten_parameters: bool = True,
        reshard_after_forward: bool = True,
        move_grads_to_cpu: Optional[bool] = None,
        fp32_reduce_scatter: Optional[bool] = None,
        compute_dtype: Optional[torch.dtype] = None,
        bucket_cap_mb: int = 25,
        min_num_params: int = int(1e8),
        state_dict_to_cpu: bool = True,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        auto_wrap_policy: Optional[AutoWrapPolicy] = None,
        exclude_wrap_modules: Optional[Iterable[type[Module]]] = None,
        force_leaf_modules: Optional[Iterable[type[Module]]] = None,
        activation_checkpointing: Optional[Union[type[Module], list[type[Module]]]] = None,
        activation_checkpointing_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "full",
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        lightning_1x_optimizer_state: OptimizerStatePolicy = "error",
        **kwargs: Any,
    ) -> None:
        self.lightning_1x_optimizer_state = validate_policy(lightning_1x_optimizer_state, type(self).__name__)
        _validate_arguments(min_num_params, bucket_cap_mb, compute_dtype, auto_wrap_policy, kwargs)
        self.activation_checkpointing = validate_layer_classes(activation_checkpointing, "activation_checkpointing")
        self.activation_checkpointing_offload = activation_checkpointing_offload
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f'`state_dict_type` must be "full" (one file, loadable anywhere) or "sharded" (one file per rank),'
                f" got {state_dict_type!r}."
            )
        self.state_dict_type = state_dict_type
        if cpu_offload and move_grads_to_cpu is False:
            raise ValueError(
                "`cpu_offload=True` keeps the parameter shards in CPU memory, where the optimizer updates them, so"
                " their gradients must be moved there too: leave `move_grads_to_cpu` unset (it follows `cpu_offload`)"
                " or set it to True."
            )
        self.exclude_wrap_modules = _optional_classes(exclude_wrap_modules, "exclude_wrap_modules")
        self.force_leaf_modules = _optional_classes(force_leaf_modules, "force_leaf_modules")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.cpu_offload = cpu_offload
        self.move_grads_to_cpu = move_grads_to_cpu
        self.flatten_parameters = flatten_parameters
        self.reshard_after_forward = reshard_after_forward
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.compute_dtype = compute_dtype
        self.bucket_cap_mb = bucket_cap_mb
        self.min_num_params = int(min_num_params)
        self.state_dict_to_cpu = state_dict_to_cpu
        self.auto_wrap_policy = auto_wrap_policy
        self._fsdp_kwargs = kwargs
        self._layout: Optional[ParameterLayout] = None
        self._group_orders: list[GroupOrder] = []
        self._failed = False
        self._checkpointed: list[Module] = []
        self._process_groups: tuple[Any, ...] = ()

    # ------------------------------------------------------------------------------------------------------------
    # FSDP configuration

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else FullyShardedPrecisionPlugin()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else fully_sharded_precision_plugin(plugin)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    def _sharded_io(self) -> ShardedCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, ShardedCheckpointIO):
            raise TypeError(
                f'`DDPFullyShardedStrategy(state_dict_type="sharded")` writes its checkpoint directories with'
                f" `lightning_fairscale.ShardedCheckpointIO`, but the Trainer was given {type(io).__name__}. Remove"
                " the CheckpointIO plugin, pass a `ShardedCheckpointIO` (or a subclass), or use"
                ' `state_dict_type="full"`.'
            )
        return io

    @property
    def mixed_precision(self) -> bool:
        """Whether the precision plugin asks FairScale for mixed precision."""
        return self.precision_plugin.precision in ("16-mixed", "bf16-mixed")

    def fsdp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every FSDP unit of this strategy is built with."""
        device = self.root_device
        offload = self.cpu_offload and device.type == "cuda"
        kwargs: dict[str, Any] = {
            # Groups made with the strategy's `timeout`: FairScale's own (when given none) wait 30 minutes.
            "process_group": self._process_groups[0] if self._process_groups else None,
            "compute_device": device,
            "reshard_after_forward": self.reshard_after_forward,
            "flatten_parameters": self.flatten_parameters,
            "bucket_cap_mb": self.bucket_cap_mb,
            "mixed_precision": self.mixed_precision,
            "fp32_reduce_scatter": bool(self.fp32_reduce_scatter) and self.mixed_precision,
            "cpu_offload": offload,
            "move_grads_to_cpu": (self.move_grads_to_cpu if device.type == "cuda" else False),
            "state_dict_device": torch.device("cpu") if self.state_dict_to_cpu else device,
            "state_dict_on_rank_0_only": True,
        }
        plugin = self.precision_plugin
        if self.compute_dtype is not None:
            kwargs["compute_dtype"] = self.compute_dtype
        elif isinstance(plugin, FullyShardedMixedPrecisionPlugin):
            kwargs["compute_dtype"] = plugin.compute_dtype
        if self._process_groups:
            kwargs["process_group_reduce_scatter"] = self._process_groups[1]
        kwargs.update(self._fsdp_kwargs)
        return kwargs

    def _auto_wrap_policy(self, own_units: Iterable[Module] = (), root: Optional[Module] = None) -> Any:
        return auto_wrap_policy(
            self.auto_wrap_policy,
            self.min_num_params,
            own_units=own_units,
            root=root,
            exclude_wrap_modules=self.exclude_wrap_modules,
            force_leaf_modules=self.force_leaf_modules,
        )

    def _check_compute_dtype(self) -> None:
        if self.compute_dtype in (None, torch.float32) or self.mixed_precision:
            return
        flag = "16-mixed" if self.compute_dtype is torch.float16 else "bf16-mixed"
        raise ValueError(
            f"`DDPFullyShardedStrategy(compute_dtype={self.compute_dtype})` needs mixed precision, but the Trainer's"
            f" precision is {self.precision_plugin.precision!r}. Pass `Trainer(precision={flag!r})` (FSDP then keeps"
            " FP32 master shards and computes in the lower precision), or leave `compute_dtype` unset."
        )

    def _warn_about_cpu_only_settings(self) -> None:
        if self.root_device.type == "cuda":
            return
        for name in ("cpu_offload", "move_grads_to_cpu"):
            if getattr(self, name):
                rank_zero_warn(
                    f"`DDPFullyShardedStrategy({name}=True)` has no effect when training on the CPU: parameters and"
                    " gradients are in CPU memory already. It is ignored."
                )

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks

    @override
    def setup_environment(self) -> None:
        module = self.lightning_module
        if module is not None and module._trainer is not None:  # before any process group: every rank refuses alike
            check_callbacks(module.trainer.callbacks, type(self).__name__)
        super().setup_environment()
        close_process_group_at_exit(self)
        if self.root_device.type == "cpu":
            fairscale_cpu.install()
        # FSDP uses two groups: one for all-gathers, one for reduce-scatters, so that they can overlap on GPUs.
        # All ranks create them here, together; they honour `timeout`, so a lost rank cannot stall the others.
        self._process_groups = tuple(torch.distributed.new_group(timeout=self._timeout) for _ in range(2))
        self._warn_about_cpu_only_settings()
        self._check_compute_dtype()
        if self.state_dict_type == "sharded":
            self._sharded_io()  # fail before training, not at the first save

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Inside this context, ``fairscale.nn.wrap`` and ``torch.distributed.fsdp.wrap.wrap`` make FSDP units."""
        kwargs = self.fsdp_kwargs()
        policy = self._auto_wrap_policy()
        with (
            enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=policy, **kwargs),
            torch_wrap.enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs),
        ):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        root = wrapped_root(self.model)
        if root is not None:
            self._setup_sharded_again(trainer, root, fitting)
        else:
            self._setup_unwrapped(trainer, fitting)
        use_for_model_summaries(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.barrier()

    def _setup_unwrapped(self, trainer: pl.Trainer, fitting: bool) -> None:
        assert self.model is not None
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        if fitting:
            # Optimizers are created on the unwrapped module, so `self.parameters()` works in
            # `configure_optimizers`; they are re-pointed to the FSDP-managed parameters after wrapping.
            self.setup_optimizers(trainer)
        self.model_to_device()
        module = self.model
        self._layout = ParameterLayout.before_wrapping(module)
        self.model = self._setup_model(module)
        self._layout.after_wrapping(self.model)
        remember_root(module, self.model)
        if self.is_global_zero:  # where Lightning's own messages go (its logger configures a handler), once
            rank_zero_info(f"{type(self).__name__}: {unit_summary(self.model)}")
        self._group_orders = [repoint_optimizer(_unwrap(opt), self._layout) for opt in self.optimizers] if fitting else []
        # From here on nothing refers to the unsharded original parameters any more: they are freed.
        self._layout.forget_originals()

    def _setup_sharded_again(self, trainer: pl.Trainer, root: _FairScaleFSDP, fitting: bool) -> None:
        """A stage after another one (``validate`` after ``fit``...): the module is still sharded; keep it so."""
        if self._layout is None or self._layout.root is not root:  # another strategy wrapped it: learn the layout
            self._layout = ParameterLayout().after_wrapping(root)
            self._group_orders = []
        self.model = root
        if fitting:
            with root_parameters_visible(root):
                self.setup_optimizers(trainer)
            self._group_orders = [repoint_optimizer(_unwrap(opt), self._layout) for opt in self.optimizers]

    @override
    def _setup_model(self, model: Module) -> Module:
        self._checkpointed = apply_activation_checkpointing(
            model, self.activation_checkpointing, self.activation_checkpointing_offload
        )
        policy = self._auto_wrap_policy(own_units=self._checkpointed, root=model)
        with self.model_sharded_context():
            return wrap_module(model, policy, **self.fsdp_kwargs())

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Lightning's (tensors on the root device, in the precision's dtype), but on the CPU with ``cpu_offload``.

        ``configure_model`` runs in here, and the units it wraps (``wrap``) are sharded right away, where their
        parameters are. FairScale keeps offloaded shards in CPU memory and asserts, at the first forward, that they
        were created there; and creating the layers on the GPU first would need GPU memory for the whole unsharded
        model, which is what ``cpu_offload`` is for. So they are created on the CPU (the inner device wins).
        """
        with super().tensor_init_context(empty_init):
            with torch.device("cpu") if self.fsdp_kwargs()["cpu_offload"] else contextlib.nullcontext():
                yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        # With `cpu_offload` FairScale keeps the parameter shards in CPU memory (and asserts that they are there): a
        # module the user moved to the GPU goes back first. Buffers go to the GPU when FSDP first runs.
        self.model.to(torch.device("cpu") if self.fsdp_kwargs()["cpu_offload"] else self.root_device)

    def memory_figures(self) -> dict[str, float]:
        """This rank's bytes of parameters, gradients and optimizer state (and peak device memory on CUDA).

        Log them from the LightningModule, e.g. ``self.log_dict(self.trainer.strategy.memory_figures())``.
        """
        assert self.model is not None
        return memory_figures(self.model, [_unwrap(opt) for opt in self.optimizers])

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduce-scatter on accumulation steps (FSDP's ``no_sync``)."""
        if isinstance(self.model, _FairScaleFSDP):
            with self.model.no_sync():
                yield
        else:
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def _saves_sharded(self) -> bool:
        return self.state_dict_type == "sharded" and self._is_wrapped()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict with the unwrapped module's keys, gathered unit by unit and kept on rank 0 only;
        with ``state_dict_type="sharded"``, this rank's parameter shards (FairScale's ``local_state_dict``)."""
        assert self.model is not None
        if not isinstance(self.model, _FairScaleFSDP):
            return super().lightning_module_state_dict()
        if self._saves_sharded():
            return self.model.local_state_dict()
        state_dict = self.model.state_dict()  # a collective call: every rank gathers, rank 0 keeps
        return add_aliases(state_dict, self.model) if self.is_global_zero else state_dict

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full optimizer state in the layout of a plain optimizer, on rank 0 (``{}`` on the other ranks); with
        ``state_dict_type="sharded"``, this rank's state over its shards."""
        if self._layout is None:  # not wrapped (after a stage): a plain optimizer over the unwrapped module
            return super().optimizer_state(optimizer)
        optimizer = _unwrap(optimizer)
        if self._saves_sharded():
            return optimizer.state_dict()
        index = [_unwrap(opt) for opt in self.optimizers].index(optimizer)
        return consolidate_state(optimizer, self._layout, self._group_orders[index])

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Rank 0 writes a full checkpoint file; with ``state_dict_type="sharded"`` every rank writes its shard of a
        checkpoint directory (see :class:`~lightning_fairscale.checkpoint_io.ShardedCheckpointIO`)."""
        if not self._saves_sharded():
            if self.state_dict_type == "sharded" and self.lightning_module is not None:
                rank_zero_warn(
                    f"The model is not sharded (`unshard_module()` gave it its full parameters back), so {filepath} is"
                    " written as a full checkpoint file.",
                )
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        io = self._sharded_io()
        optimizers = [_unwrap(opt) for opt in self.optimizers]
        meta, shard = split_checkpoint(checkpoint, self.model, optimizers, self._group_orders, self.world_size)
        # Each step ends with an agreement, so that a failure on one rank (a full disk...) fails every rank with the
        # previous checkpoint untouched, instead of leaving the others waiting for it.
        self._together(lambda: io.begin_sharded(filepath) if self.is_global_zero else None, filepath, "prepare")
        self._together(lambda: io.save_shard(shard, filepath, self.global_rank, self.world_size), filepath, "write")
        self._together(
            lambda: io.commit_sharded(meta, filepath, self.world_size) if self.is_global_zero else None,
            filepath,
            "complete",
        )
        return None

    def _together(self, action: Callable[[], Any], filepath: _PATH, step: str) -> None:
        error: Optional[BaseException] = None
        try:
            action()
        except Exception as exception:  # reported to every rank below, then re-raised here
            error = exception
        if self.reduce_boolean_decision(error is None, all=True):
            return
        if self.is_global_zero:
            self._sharded_io().abort_sharded(filepath)
        if error is not None:
            raise error
        raise RuntimeError(
            f"Another process failed to {step} the sharded checkpoint {filepath} (its error is in its log). The"
            " previous checkpoint of that name, if any, is unchanged."
        )

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # `load_checkpoint` loads the optimizer states itself, into this rank's shards.
        return not self._is_wrapped()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the model's and the optimizers' states into this rank's shards, and return the rest of the checkpoint.

        Either kind of checkpoint loads without gathering anything: a full file is memory-mapped and each rank reads
        the slices of each parameter that it owns, unit by unit; a sharded directory saved by any number of
        processes is read the same way from the saved shards (see :mod:`lightning_fairscale.resharding`).
        """
        if not self._is_wrapped():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        io = self.checkpoint_io
        if isinstance(io, ShardedCheckpointIO) and io.is_sharded(io.recover(Path(str(checkpoint_path)))):
            return self._load_sharded(io, checkpoint_path, weights_only)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._load_full(checkpoint)
        return checkpoint

    def _load_full(self, checkpoint: dict[str, Any]) -> None:
        assert self.model is not None and self._layout is not None and self.lightning_module is not None
        state_dict = checkpoint.pop("state_dict")
        check_state_dict_fits(state_dict, self._expected_shapes(), self.lightning_module.strict_loading)
        layout = self._layout
        load_full_state_dict(self.model, lambda p: layout.managed[p].pieces, state_dict, _buffer_name)
        if self._restores_optimizers():
            # The pieces' shapes: what a plain optimizer over the unwrapped module holds (Lightning 1.x's differ).
            managed = layout.managed
            shapes = [[[managed[m].pieces[k].shape for m, k in g] for g in order] for order in self._group_orders]
            optimizers = [_unwrap(opt) for opt in self.optimizers]
            owner, policy = type(self).__name__, self.lightning_1x_optimizer_state
            states = resumable_optimizer_states(checkpoint, optimizers, shapes, policy, owner, rank_zero_warn)
            for optimizer, order, state in zip(self.optimizers, self._group_orders, states):
                optimizer = _unwrap(optimizer)
                optimizer.load_state_dict(shard_state(state, optimizer, layout, order))
        checkpoint.pop("optimizer_states", None)

    def _load_sharded(self, io: ShardedCheckpointIO, path: _PATH, weights_only: Optional[bool]) -> dict[str, Any]:
        meta = io.load_meta(path, weights_only=weights_only)
        saved_world_size = check_fits(meta, path)
        shards = SavedShards(lambda r: io.load_shard(path, r, saved_world_size, weights_only=weights_only), saved_world_size)

        def read() -> None:
            assert self.model is not None
            check_wrapping(shards.file(0), self.model, path)
            shards.load_into(self.model)
            if self._restores_optimizers():
                optimizer_states({"optimizer_states": shards.file(0).get("optimizer_states", [])}, self.optimizers)
                for index, optimizer in enumerate(self.optimizers):
                    optimizer = _unwrap(optimizer)
                    positions = managed_positions(optimizer, self.model)
                    optimizer.load_state_dict(shards.optimizer_state(index, positions, self.model))

        self._together(read, path, "read")
        meta.pop(FORMAT_KEY)
        return meta

    def _restores_optimizers(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return bool(self.optimizers) and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._is_wrapped():  # `load_checkpoint` has loaded the sharded model
            super().load_model_state_dict(checkpoint, strict=strict)

    def _expected_shapes(self) -> dict[str, Any]:
        """The keys and shapes of the unwrapped module's state dict, known without gathering anything."""
        assert self.model is not None and self._layout is not None
        shapes: dict[str, Any] = {p.name: p.shape for m in self._layout.managed.values() for p in m.pieces}
        shapes.update((_buffer_name(name), b.shape) for name, b in self.model.named_buffers())
        return apply_aliases(shapes, module_aliases(self.model))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._is_wrapped():  # `load_checkpoint` has loaded the optimizers' shards
            super().load_optimizer_state_dict(checkpoint)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Another rank may be gone: teardown must not start collectives that would wait for it.
        self._failed = True
        report_collective_failure(exception, self._timeout, getattr(self, "_launcher", None))
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """End a stage without gathering anything: the LightningModule stays sharded.

        The next stage (``validate``, ``test``, ``predict`` or another ``fit``, with this Trainer or another one)
        takes the sharded module as it is, and ``trainer.save_checkpoint`` after ``fit`` writes the same checkpoint
        as during training. Call :meth:`unshard_module` to get the full module back. As Lightning's own FSDP
        strategy does, the module and the optimizers stay on their device: FairScale keeps references to the
        parameter shards that moving them would break.
        """
        if not self._is_wrapped():
            super().teardown()
            return
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self._failed = False

    def unshard_module(self, rank_zero_only: bool = True) -> Module:
        """Give the LightningModule its full parameters back, as a plain module: an explicit, collective call.

        After ``fit`` the module stays sharded, so nothing is gathered at the end of a run. Call this on every rank
        when a full module is wanted in memory (to export it, or to use it outside the Trainer). FSDP units are
        gathered one at a time; with ``rank_zero_only`` (the default) only rank 0 keeps the full parameters (on the
        CPU), the other ranks' parameters are left on the ``meta`` device, so the memory of one full model is needed
        on one rank only. With ``rank_zero_only=False`` every rank gets the full module, which can then be wrapped
        again by a later stage.

        The optimizers' state lives in the shards this frees: the strategy's optimizers and LR schedulers are dropped
        (save a checkpoint first to keep them).

        Returns:
            The LightningModule, unwrapped.
        """
        module = self.lightning_module
        assert module is not None
        if not self._is_wrapped():
            return module
        keep = self.is_global_zero or not rank_zero_only
        unwrap_module(self.model, torch.device("cpu"), keep=keep)
        forget_root(module)
        remove_activation_checkpointing(self._checkpointed)
        self._checkpointed = []
        self.model = module
        self._layout = None
        self._group_orders = []
        self.optimizers = []
        self.lr_scheduler_configs = []
        return module

    def _is_wrapped(self) -> bool:
        return isinstance(self.model, _FairScaleFSDP)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name in ("fsdp_fairscale", "ddp_fully_sharded"):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description="FairScale's Fully Sharded Data Parallel")


def _buffer_name(name: str) -> str:
    """The unwrapped module's name of a buffer of the wrapped model."""
    return clean_path(name + ".").rstrip(".")


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _optional_classes(value: Any, argument: str) -> Optional[tuple[type[Module], ...]]:
    return None if value is None else validate_layer_classes(value, argument)


def _validate_arguments(
    min_num_params: Any, bucket_cap_mb: Any, compute_dtype: Any, policy: Any, kwargs: dict[str, Any]
) -> None:
    if isinstance(min_num_params, bool) or not isinstance(min_num_params, (int, float)) or min_num_params < 0:
        raise ValueError(f"`min_num_params` must be a number >= 0, got {min_num_params!r}.")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise ValueError(f"`bucket_cap_mb` must be a number of megabytes (<= 0 disables bucketing), got {bucket_cap_mb!r}.")
    if compute_dtype is not None and compute_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"`compute_dtype` must be torch.float32, torch.float16 or torch.bfloat16, got {compute_dtype!r}."
        )
    validate_auto_wrap_policy(policy)
    for name in kwargs:
        if name in _MANAGED_FSDP_ARGUMENTS:
            raise TypeError(f"`DDPFullyShardedStrategy` does not take `{name}`: {_MANAGED_FSDP_ARGUMENTS[name]}.")
        if name not in _FSDP_ARGUMENTS:
            raise TypeError(
                f"`DDPFullyShardedStrategy` got an unexpected argument `{name}`. Extra keyword arguments go to"
                f" FairScale's FullyShardedDataParallel, which takes: {', '.join(sorted(_FSDP_ARGUMENTS - set(_MANAGED_FSDP_ARGUMENTS)))}."
            )
