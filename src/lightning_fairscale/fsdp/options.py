"""The options of ``DDPFullyShardedStrategy``, for the Trainer's strategy and for Fabric's.

:class:`FullyShardedOptions` is the part of both strategies that holds what the user chose: it takes the arguments of
Lightning 1.x's ``DDPFullyShardedStrategy`` (plus ours), checks them before anything runs, and turns them into the
arguments every FairScale FSDP unit is built with. The Trainer's strategy
(:class:`lightning_fairscale.strategies.DDPFullyShardedStrategy`) and Fabric's
(:class:`lightning_fairscale.fabric.DDPFullyShardedStrategy`) are this class plus an adapter to their Lightning base
class each. Nothing here imports Lightning, so both Lightning packages share it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, ClassVar, Literal, Optional, Union

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module

from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy, validate_policy
from lightning_fairscale.distributed import process_exit
from lightning_fairscale.fsdp.activation_checkpointing import checkpointing_layer_classes, validate_layer_classes
from lightning_fairscale.fsdp.hybrid import hybrid_groups, mesh_request, resolve_mesh, sharding_name
from lightning_fairscale.fsdp.materialize import ParamInitFn, validate_param_init_fn
from lightning_fairscale.fsdp.policies import AutoWrapPolicy, auto_wrap_policy, validate_auto_wrap_policy
from lightning_fairscale.mixed_precision.settings import compute_dtype, half_dtype
from lightning_fairscale.strategy_arguments import lightning_arguments

__all__ = [
    "FullyShardedOptions",
    "offload_params",
    "validate_arguments",
]

#: Arguments of FairScale's FSDP that the strategy sets itself; users set them through the strategy's arguments.
_MANAGED_FSDP_ARGUMENTS = {
    "module": "the strategy wraps the model itself",
    "process_group": "the strategy makes its process groups (with `timeout`)",
    "compute_device": "the `accelerator`/`devices` of the Trainer or Fabric choose it",
    "mixed_precision": "the `precision` flag of the Trainer or Fabric sets it",
    "move_params_to_cpu": "use `cpu_offload`",
    "state_dict_device": "use `state_dict_to_cpu`",
}


_FSDP_ARGUMENTS = set(inspect.signature(_FairScaleFSDP.__init__).parameters) - {"self"}


#: Arguments of Lightning's ``FSDPStrategy`` (for torch's FSDP) that FairScale has no equivalent of, and what to do.
_TORCH_FSDP_ARGUMENTS = {
    "limit_all_gathers": "FairScale has no all-gather rate limiter: remove it",
    "forward_prefetch": "FairScale has no prefetch setting: remove it",
    "backward_prefetch": "FairScale has no prefetch setting: remove it",
    "sync_module_states": (
        "FairScale does not broadcast rank 0's weights: seed every rank alike (`seed_everything`) or load a"
        " checkpoint, as Lightning's FSDPStrategy needs without it"
    ),
    "ignored_modules": "under FairScale every parameter belongs to an FSDP unit",
    "ignored_states": "under FairScale every parameter belongs to an FSDP unit",
    "device_id": "the `devices` of the Trainer or Fabric choose it",
}


class FullyShardedOptions:
    """The options of ``DDPFullyShardedStrategy`` and what follows from them; a base class of both strategies.

    The arguments are documented on :class:`lightning_fairscale.strategies.DDPFullyShardedStrategy`. The Lightning
    base class (the Trainer's or Fabric's ``DDPStrategy``) follows this class in the strategy's bases; it gets the
    arguments it knows, the precision plugin under the name it uses (:attr:`_precision_name`).
    """

    #: The name under which the Lightning base strategy takes and holds its precision plugin.
    _precision_name: ClassVar[str]
    #: The CheckpointIO plugin used when none is given (the class built on the strategy's Lightning package).
    _checkpoint_io_class: ClassVar[type]

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
        min_num_params: int = int(1e8),
        state_dict_to_cpu: bool = True,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        auto_wrap_policy: Optional[AutoWrapPolicy] = None,
        exclude_wrap_modules: Optional[Iterable[type[Module]]] = None,
        force_leaf_modules: Optional[Iterable[type[Module]]] = None,
        activation_checkpointing: Optional[Union[type[Module], list[type[Module]]]] = None,
        activation_checkpointing_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "full",
        timeout: Optional[timedelta] = default_pg_timeout,  # Lightning's default too
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        precision: Optional[Any] = None,
        lightning_1x_optimizer_state: OptimizerStatePolicy = "error",
        activation_checkpointing_policy: Optional[Union[AutoWrapPolicy, type[Module]]] = None,
        param_init_fn: Optional[ParamInitFn] = None,
        sharding_strategy: Any = "FULL_SHARD",
        device_mesh: Optional[Any] = None,
        **kwargs: Any,
    ) -> None:
        name = sharding_name(sharding_strategy)
        if name in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"):  # ZeRO-2: full parameters kept from forward to backward
            reshard_after_forward = False
        #: The shape of the sharding: ``None`` (over every rank) or ``"node"`` or ``(replicas, shard_size)``.
        self.sharding_strategy = name
        self._mesh_request = mesh_request(name, device_mesh)
        self.lightning_1x_optimizer_state = validate_policy(lightning_1x_optimizer_state, type(self).__name__)
        self.param_init_fn = validate_param_init_fn(param_init_fn)
        validate_arguments(min_num_params, bucket_cap_mb, compute_dtype, auto_wrap_policy, kwargs)
        base = lightning_arguments(locals(), self._precision_name)
        self.activation_checkpointing = _checkpointing_classes(
            activation_checkpointing, activation_checkpointing_policy
        )
        self.activation_checkpointing_offload = activation_checkpointing_offload
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f'`state_dict_type` must be "full" (one file, loadable anywhere) or "sharded" (one file per rank),'
                f" got {state_dict_type!r}."
            )
        self.state_dict_type = state_dict_type
        cpu_offload = offload_params(cpu_offload)
        if cpu_offload and move_grads_to_cpu is False:
            raise ValueError(
                "`cpu_offload=True` keeps the parameter shards in CPU memory, where the optimizer updates them, so"
                " their gradients must be moved there too: leave `move_grads_to_cpu` unset (it follows `cpu_offload`)"
                " or set it to True."
            )
        self.exclude_wrap_modules = _optional_classes(exclude_wrap_modules, "exclude_wrap_modules")
        self.force_leaf_modules = _optional_classes(force_leaf_modules, "force_leaf_modules")
        super().__init__(**base)  # type: ignore[call-arg]  # the Lightning base strategy
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
        #: The two process groups of FSDP (all-gather, reduce-scatter), made in ``setup_environment``.
        self._process_groups: tuple[Any, ...] = ()
        #: Under hybrid sharding: the mesh, and this rank's group of replicas (same shard index on every node).
        self._mesh: Optional[tuple[int, int]] = None
        self._replica_group: Any = None
        self._init_adapter()

    def _init_adapter(self) -> None:
        """Set up the state of the strategy's adapter (its Lightning-specific part), at the end of ``__init__``."""

    def setup_environment(self) -> None:
        """The Lightning base's set-up (the default process group), then everything FSDP needs; all ranks together."""
        default_before = process_exit.default_group()
        super().setup_environment()  # type: ignore[misc]
        device: torch.device = self.root_device  # type: ignore[attr-defined]
        process_exit.close_process_group_at_exit(self, default_before)
        # FSDP uses two groups: one for all-gathers, one for reduce-scatters, so that they can overlap on GPUs.
        # All ranks create them here, together; they honour `timeout`, so a lost rank cannot stall the others.
        timeout = self._collective_timeout()  # type: ignore[attr-defined]  # _compat.StrategyInternals
        world_size: int = self.world_size  # type: ignore[attr-defined]
        if self._mesh_request is None:
            self._process_groups = tuple(torch.distributed.new_group(timeout=timeout) for _ in range(2))
        else:
            num_nodes: int = getattr(self, "num_nodes", 1)
            self._mesh = resolve_mesh(self._mesh_request, world_size, num_nodes)
            rank: int = self.global_rank  # type: ignore[attr-defined]
            *self._process_groups, self._replica_group = hybrid_groups(self._mesh, rank, timeout)
        process_exit.record_groups(*self._process_groups, self._replica_group)
        self._check_settings(device)
        if self.state_dict_type == "sharded":
            self._sharded_io()  # fail before training, not at the first save

    @property
    def checkpoint_io(self) -> Any:
        """The CheckpointIO plugin: a :class:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO` by default."""
        if self._checkpoint_io_slot() is None:  # type: ignore[attr-defined]  # _compat.StrategyInternals
            self._set_checkpoint_io_slot(self._checkpoint_io_class())  # type: ignore[attr-defined]
        return super().checkpoint_io  # type: ignore[misc]

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[Any]) -> None:
        self._set_checkpoint_io_slot(io)  # type: ignore[attr-defined]

    def _sharded_io(self) -> Any:
        """The CheckpointIO plugin, which must write sharded checkpoint directories."""
        io = self.checkpoint_io
        if not isinstance(io, self._checkpoint_io_class):
            raise TypeError(
                f'`DDPFullyShardedStrategy(state_dict_type="sharded")` writes its checkpoint directories with'
                f" `lightning_fairscale.ShardedCheckpointIO`, but the strategy was given {type(io).__name__}. Remove"
                " the CheckpointIO plugin, pass a `ShardedCheckpointIO` (or a subclass), or use"
                ' `state_dict_type="full"`.'
            )
        return io

    @property
    def _precision_setting(self) -> str:
        """The precision plugin's setting: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"`` or
        ``"bf16-true"``."""
        return getattr(self, self._precision_name).precision

    @property
    def _half_dtype(self) -> Optional[torch.dtype]:
        """Under true half precision, the dtype FSDP holds everything in (see workaround 13 of ``fsdp.units``)."""
        return half_dtype(self._precision_setting)

    @property
    def mixed_precision(self) -> bool:
        """Whether the precision plugin asks FairScale for mixed precision."""
        return self._precision_setting in ("16-mixed", "bf16-mixed")

    def fsdp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every FSDP unit of this strategy is built with."""
        device: torch.device = self.root_device  # type: ignore[attr-defined]  # the Lightning base strategy's
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
        if self.compute_dtype is not None:
            kwargs["compute_dtype"] = self.compute_dtype
        elif self.mixed_precision:
            plugin = getattr(self, self._precision_name)
            kwargs["compute_dtype"] = getattr(plugin, "compute_dtype", None) or compute_dtype(plugin.precision)
        elif self._half_dtype is not None:  # without mixed precision: the units hold their parameters in this dtype
            kwargs["compute_dtype"] = self._half_dtype
        if self._process_groups:
            kwargs["process_group_reduce_scatter"] = self._process_groups[1]
        if self.param_init_fn is not None:  # taken by our FSDP class (units built on the meta device)
            kwargs["param_init_fn"] = self.param_init_fn
        if self._replica_group is not None:  # taken by our FSDP class: gradient shards are all-reduced over it
            kwargs["replica_group"] = self._replica_group
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

    def _check_settings(self, device: torch.device) -> None:
        """Fail or warn, before training, about options that do not fit the device or the precision."""
        if self._half_dtype is not None:
            self._check_true_half_precision(self._half_dtype)
        elif self.compute_dtype not in (None, torch.float32) and not self.mixed_precision:
            flag = "16-mixed" if self.compute_dtype is torch.float16 else "bf16-mixed"
            raise ValueError(
                f"`DDPFullyShardedStrategy(compute_dtype={self.compute_dtype})` needs mixed precision, but the"
                f" precision is {self._precision_setting!r}. Pass `precision={flag!r}` to the Trainer or to Fabric"
                " (FSDP then keeps FP32 master shards and computes in the lower precision), or leave `compute_dtype`"
                " unset."
            )
        if device.type == "cuda":
            return
        for name in ("cpu_offload", "move_grads_to_cpu"):
            if getattr(self, name):
                rank_zero_warn(
                    f"`DDPFullyShardedStrategy({name}=True)` has no effect when training on the CPU: parameters and"
                    " gradients are in CPU memory already. It is ignored."
                )

    def _check_true_half_precision(self, dtype: torch.dtype) -> None:
        """Under true half precision the parameters are in ``dtype``: options asking for another dtype contradict it."""
        setting, mixed = self._precision_setting, self._precision_setting.replace("-true", "-mixed")
        if self.compute_dtype not in (None, dtype):
            raise ValueError(
                f"`DDPFullyShardedStrategy(compute_dtype={self.compute_dtype})` contradicts precision={setting!r},"
                f" which holds the parameters, gradients and optimizer state in {dtype} and computes in it. Leave"
                f" `compute_dtype` unset (it follows the precision), or use precision={mixed!r} to keep FP32"
                " parameters and compute in the lower precision."
            )
        if self.fp32_reduce_scatter:
            raise ValueError(
                f"`DDPFullyShardedStrategy(fp32_reduce_scatter=True)` needs mixed precision: under"
                f" precision={setting!r} the gradients are {dtype} and are reduced in {dtype}. Leave"
                f" `fp32_reduce_scatter` unset, or use precision={mixed!r} (FP32 parameters and gradients)."
            )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fsdp_fairscale"`` and ``"ddp_fully_sharded"`` with a Lightning registry (the Trainer's or
        Fabric's), where free: Lightning's own ``"fsdp"`` stays Lightning's."""
        for name in ("fsdp_fairscale", "ddp_fully_sharded"):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description="FairScale's Fully Sharded Data Parallel")


def offload_params(cpu_offload: Any) -> bool:
    """Whether ``cpu_offload`` (a bool, or torch's ``CPUOffload`` as Lightning's ``FSDPStrategy`` takes it) offloads.

    Example:
        >>> offload_params(CPUOffload(offload_params=False)), offload_params(True)
        (False, True)
    """
    if isinstance(cpu_offload, CPUOffload):
        return cpu_offload.offload_params
    if cpu_offload is None or isinstance(cpu_offload, bool):  # None: the default of Lightning's FSDPStrategy
        return bool(cpu_offload)
    raise TypeError(
        "`cpu_offload` must be True or False, or torch's `torch.distributed.fsdp.CPUOffload(offload_params=...)`,"
        f" got {cpu_offload!r}."
    )


def _checkpointing_classes(classes: Any, policy: Any) -> tuple[type[Module], ...]:
    """The layer classes to checkpoint, from ``activation_checkpointing`` or Lightning's name for it."""
    if classes is not None and policy is not None:
        raise ValueError(
            "`activation_checkpointing` and `activation_checkpointing_policy` both choose the layers to checkpoint,"
            " and mean the same here: pass one. Keep `activation_checkpointing_policy` (the name Lightning's"
            " FSDPStrategy uses) and remove `activation_checkpointing`."
        )
    if policy is not None:
        return checkpointing_layer_classes(policy)
    return validate_layer_classes(classes, "activation_checkpointing")


def _optional_classes(value: Any, argument: str) -> Optional[tuple[type[Module], ...]]:
    return None if value is None else validate_layer_classes(value, argument)


def validate_arguments(
    min_num_params: Any, bucket_cap_mb: Any, compute_dtype: Any, policy: Any, kwargs: dict[str, Any]
) -> None:
    """Raise an error that says what is accepted when an argument of ``DDPFullyShardedStrategy`` is not."""
    if isinstance(min_num_params, bool) or not isinstance(min_num_params, (int, float)) or min_num_params < 0:
        raise ValueError(f"`min_num_params` must be a number >= 0, got {min_num_params!r}.")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise ValueError(
            f"`bucket_cap_mb` must be a number of megabytes (<= 0 disables bucketing), got {bucket_cap_mb!r}."
        )
    if compute_dtype is not None and compute_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"`compute_dtype` must be torch.float32, torch.float16 or torch.bfloat16, got {compute_dtype!r}."
        )
    validate_auto_wrap_policy(policy)
    for name in kwargs:
        if name in _MANAGED_FSDP_ARGUMENTS:
            raise TypeError(f"`DDPFullyShardedStrategy` does not take `{name}`: {_MANAGED_FSDP_ARGUMENTS[name]}.")
        if name in _TORCH_FSDP_ARGUMENTS:
            raise TypeError(
                f"`DDPFullyShardedStrategy` does not take `{name}`, an argument of torch's FSDP (Lightning's"
                f" FSDPStrategy): {_TORCH_FSDP_ARGUMENTS[name]}."
            )
        if name not in _FSDP_ARGUMENTS:
            accepted = ", ".join(sorted(_FSDP_ARGUMENTS - set(_MANAGED_FSDP_ARGUMENTS)))
            raise TypeError(
                f"`DDPFullyShardedStrategy` got an unexpected argument `{name}`. Extra keyword arguments go to"
                f" FairScale's FullyShardedDataParallel, which takes: {accepted}."
            )
