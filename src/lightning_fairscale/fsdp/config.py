"""The configuration of ``DDPFullyShardedStrategy``, for the Trainer's strategy and for Fabric's.

:class:`FullyShardedConfig` holds what the user chose: the arguments of Lightning 1.x's ``DDPFullyShardedStrategy``
(plus ours), checked once, when it is built, and frozen. Both strategies build one in their constructor and hold it as
``strategy.config``; the engine's functions take it, with what a run adds (the device, the precision, the process
groups), and turn it into the arguments every FairScale FSDP unit is built with (:func:`fsdp_kwargs`). Nothing here
imports Lightning, so it is built and tested without it.

Example:
    >>> import torch
    >>> config = FullyShardedConfig(min_num_params=1e6, fairscale_kwargs={"verbose": True})
    >>> config.min_num_params, config.fairscale_kwargs
    (1000000, {'verbose': True})
    >>> kwargs = fsdp_kwargs(config, torch.device("cpu"), ProcessGroups(), "bf16-mixed")
    >>> kwargs["mixed_precision"], kwargs["compute_dtype"], kwargs["verbose"]
    (True, torch.bfloat16, True)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal, Optional

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module

from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy, validate_policy
from lightning_fairscale.fsdp.wrapping.activation_checkpointing import (
    checkpointing_layer_classes,
    validate_layer_classes,
)
from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups, mesh_request, sharding_name
from lightning_fairscale.fsdp.unit.materialize import ParamInitFn, validate_param_init_fn
from lightning_fairscale.fsdp.wrapping.policies import AutoWrapPolicy, auto_wrap_policy, validate_auto_wrap_policy
from lightning_fairscale.fsdp.patches.prefetch import BACKWARD_MODES
from lightning_fairscale.mixed_precision.settings import compute_dtype, half_dtype

__all__ = [
    "FullyShardedConfig",
    "backward_prefetch_name",
    "check_settings",
    "check_sync_each_batch",
    "fsdp_kwargs",
    "offload_params",
    "offloads_to_cpu",
    "validate_arguments",
    "wrap_policy",
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
    "limit_all_gathers": (
        "FairScale has no all-gather rate limiter (on CPU our forward gathers ahead what fits in `bucket_cap_mb`,"
        " and at least the next unit): remove it"
    ),
    "forward_prefetch": (
        "on CPU the forward gathers the next units ahead, and on CUDA FairScale's streams overlap the all-gathers:"
        " remove it (`backward_prefetch` chooses the backward's)"
    ),
    "sync_module_states": (
        "FairScale does not broadcast rank 0's weights: seed every rank alike (`seed_everything`) or load a"
        " checkpoint, as Lightning's FSDPStrategy needs without it"
    ),
    "ignored_modules": "under FairScale every parameter belongs to an FSDP unit",
    "ignored_states": "under FairScale every parameter belongs to an FSDP unit",
    "device_id": "the `devices` of the Trainer or Fabric choose it",
}

#: The ZeRO-2 sharding strategies: full parameters kept from forward to backward.
_ZERO2 = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")


@dataclass(frozen=True)
class FullyShardedConfig:
    """The options of ``DDPFullyShardedStrategy``, checked when built; frozen (``dataclasses.replace`` makes a
    changed copy, checked again).

    The arguments are those of the strategies (the Trainer's and Fabric's, whose ``Args:`` are these), less
    Lightning's own (accelerator, devices, precision plugin, timeout...); the strategy's extra keyword arguments are
    :attr:`fairscale_kwargs`. Values are
    kept in one form: ``cpu_offload`` a bool, the layer classes tuples, ``sharding_strategy`` its upper-case name,
    ``device_mesh`` ``(replicas, shard_size)`` or ``None``, ``activation_checkpointing_policy`` merged into
    ``activation_checkpointing``. No option is written over by another: what one implies for another (the ZeRO-2
    sharding strategies do not reshard after forward, whatever ``reshard_after_forward`` says) is computed where it
    is used (:func:`fsdp_kwargs`), so that a changed copy (``dataclasses.replace``) starts from the user's values.

    Args:
        cpu_offload: keep the FP32 parameter shards on the CPU (CUDA only; ignored with a warning on CPU runs). A
            bool, or torch's ``CPUOffload(offload_params=...)`` as Lightning's ``FSDPStrategy`` takes it.
        flatten_parameters: flatten each unit's parameters into one contiguous tensor (faster).
        reshard_after_forward: free full parameters after the forward pass, gathering them again for backward.
            Under ``sharding_strategy="SHARD_GRAD_OP"`` or ``"_HYBRID_SHARD_ZERO2"`` FSDP does not reshard, whatever
            this says (the strategy keeps the value given, for another ``sharding_strategy``).
        move_grads_to_cpu: move gradient shards to the CPU after reduction (defaults to ``cpu_offload``).
        fp32_reduce_scatter: reduce-scatter gradients in FP32 under mixed precision (an error under true half
            precision, whose gradients are fp16 or bf16).
        compute_dtype: dtype of the full parameters used in computation (defaults from ``precision``); under true
            half precision (``"bf16-true"``, ``"16-true"``) only that dtype is accepted.
        bucket_cap_mb: size of the reduce-scatter buckets in MB; ``<= 0`` disables bucketing. On CPU (gloo) also
            what the units the forward gathers ahead may hold together (at least the next unit is gathered).
        min_num_params: a module with at least this many unwrapped parameters becomes its own unit (auto wrap).
        state_dict_to_cpu: return full state dicts on the CPU instead of the compute device.
        auto_wrap_policy: which submodules become units when the model wraps nothing itself: a set of layer classes
            (each instance its own unit), a callable with FairScale's policy signature
            ``(module, recurse, unwrapped_params, module_is_root) -> bool``, or what Lightning's ``FSDPStrategy``
            takes: a callable with torch's signature ``(module, recurse, nonwrapped_numel) -> bool`` (such as
            ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``) or torch's
            ``ModuleWrapPolicy``/``CustomPolicy``, making the units torch's FSDP would. Default: by size
            (``min_num_params``).
        exclude_wrap_modules: layer classes that never become units themselves under auto wrap (their children
            still can). Default: FairScale's (``nn.ModuleList``, ``nn.ModuleDict``) for the size policy, none else.
        force_leaf_modules: layer classes auto wrap does not descend into: neither they nor their children become
            units, their parameters belong to the enclosing unit. Default: FairScale's (``nn.MultiheadAttention``)
            for the size policy, none else.
        activation_checkpointing: a layer class, or a list of them, whose instances recompute their activations in
            the backward pass instead of keeping them (FairScale's ``checkpoint_wrapper``, inside the FSDP unit).
        activation_checkpointing_offload: keep the checkpointed layers' inputs in CPU memory until backward.
        activation_checkpointing_policy: Lightning ``FSDPStrategy``'s name for ``activation_checkpointing``: a set of
            layer classes, ``ModuleWrapPolicy({Block})`` or ``partial(transformer_auto_wrap_policy,
            transformer_layer_cls={Block})``. Pass one of the two arguments.
        state_dict_type: ``"full"`` (default): checkpoints are one file with the full model and optimizer state,
            gathered on rank 0, loadable anywhere. ``"sharded"``: every rank writes its own shard into a checkpoint
            directory, in parallel, and no rank gathers the full model; it resumes on the same number of processes,
            and ``lightning-fairscale-consolidate`` turns it into a full checkpoint. Loading accepts either kind.
        lightning_1x_optimizer_state: resuming a checkpoint of Lightning 1.x's FairScale FSDP strategy, whose
            optimizer state is rank 0's shard only: ``"error"`` (default) fails before training when the optimizer
            has per-parameter state (Adam...); ``"reset"`` starts that state afresh, with the checkpoint's
            hyperparameters. Stateless optimizers (SGD without momentum) resume exactly either way.
        param_init_fn: for a model built on the ``meta`` device (``trainer.init_module(empty_init=True)``,
            ``fabric.init_module(empty_init=True)``, or ``torch.device("meta")``): called with each module that
            holds meta tensors, once they are on the device (uninitialised), to initialise them in place, just before
            its FSDP unit is sharded (torch FSDP's argument). Default: each such module's ``reset_parameters()``.
        sharding_strategy: ``"FULL_SHARD"`` (default: over all ranks), ``"SHARD_GRAD_OP"``
            (as ``reshard_after_forward=False``), ``"HYBRID_SHARD"`` (shard over the ranks of each node, replicate
            across nodes: the gradient shards are all-reduced over the replicas) or ``"_HYBRID_SHARD_ZERO2"``
            (hybrid, without resharding after forward); a string or torch's ``ShardingStrategy``.
        device_mesh: under hybrid sharding, ``(replicas, shard_size)`` to shard over other groups than the nodes
            (consecutive ranks form a replica); torch's 2-D ``DeviceMesh`` is taken for its shape (which
            ``strategy.device_mesh`` then is).
        backward_prefetch: when the backward of a run on CPU (gloo) gathers the next unit's parameters, torch's
            ``BackwardPrefetch`` or its name: ``BACKWARD_POST`` (default) once the current unit's gradient is done,
            alongside its reduce-scatter (the peak memory of the synchronous backward); ``BACKWARD_PRE`` before the
            current unit's backward, which it overlaps (faster, about a unit's parameters and gradient more);
            ``None``: no prefetch in the backward. The forward on CPU always gathers ahead (the next units that fit
            in ``bucket_cap_mb``, at least one). On CUDA, FairScale's streams overlap the collectives and this is not
            used.
        sync_each_batch: how gradients accumulate over micro-batches (the Trainer's ``accumulate_grad_batches``,
            Fabric's ``no_backward_sync``). ``False`` (default): FairScale's ``no_sync``, each rank keeps the full,
            unsharded gradient of every unit until the last micro-batch, which reduce-scatters it once (least
            traffic, but the memory of a full gradient per rank). ``True``: every micro-batch reduce-scatters, and
            between micro-batches a rank holds only its gradient shard (what Lightning's own ``FSDPStrategy`` does
            in the Trainer; Accelerate's ``GradientAccumulationPlugin(sync_each_batch=True)``); Fabric's
            ``no_backward_sync`` then skips nothing. Same result either way. On CUDA not with ``cpu_offload`` or
            ``move_grads_to_cpu`` (FairScale cannot accumulate into gradient shards in CPU memory).
        fairscale_kwargs: keyword arguments passed to FairScale's ``FullyShardedDataParallel`` as they are (the
            strategies' ``**kwargs``).
        owner: the strategy's class name, which the error messages name.

    Raises:
        ValueError, TypeError: an argument is not accepted; the message says what is.
    """

    cpu_offload: bool = False
    flatten_parameters: bool = True
    #: As given: FSDP gets False under the ZeRO-2 sharding strategies, whatever it says (see :func:`fsdp_kwargs`).
    reshard_after_forward: bool = True
    move_grads_to_cpu: Optional[bool] = None
    fp32_reduce_scatter: Optional[bool] = None
    compute_dtype: Optional[torch.dtype] = None
    bucket_cap_mb: int = 25
    min_num_params: int = int(1e8)
    state_dict_to_cpu: bool = True
    auto_wrap_policy: Optional[AutoWrapPolicy] = None
    exclude_wrap_modules: Optional[tuple[type[Module], ...]] = None
    force_leaf_modules: Optional[tuple[type[Module], ...]] = None
    activation_checkpointing: tuple[type[Module], ...] = ()
    activation_checkpointing_offload: bool = False
    state_dict_type: Literal["full", "sharded"] = "full"
    lightning_1x_optimizer_state: OptimizerStatePolicy = "error"
    param_init_fn: Optional[ParamInitFn] = None
    #: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"`` or ``"_HYBRID_SHARD_ZERO2"``.
    sharding_strategy: str = "FULL_SHARD"
    #: Under hybrid sharding, ``(replicas, shard_size)``; ``None``: one replica per node.
    device_mesh: Optional[tuple[int, int]] = None
    #: When the backward on CPU gathers the next unit: ``"BACKWARD_POST"``, ``"BACKWARD_PRE"`` or ``None``.
    backward_prefetch: Optional[str] = "BACKWARD_POST"
    #: Reduce-scatter after every micro-batch when accumulating, instead of FairScale's ``no_sync``.
    sync_each_batch: bool = False
    #: Keyword arguments passed to FairScale's ``FullyShardedDataParallel`` as they are.
    fairscale_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The strategy's class name, which the error messages name.
    owner: str = "DDPFullyShardedStrategy"
    #: Lightning ``FSDPStrategy``'s name for ``activation_checkpointing`` (not kept: it becomes that).
    activation_checkpointing_policy: InitVar[Optional[Any]] = None

    def __post_init__(self, activation_checkpointing_policy: Optional[Any]) -> None:
        name = sharding_name(self.sharding_strategy)
        self._set("sharding_strategy", name)
        request = mesh_request(name, self.device_mesh)
        self._set("device_mesh", request if isinstance(request, tuple) else None)
        self._set("lightning_1x_optimizer_state", validate_policy(self.lightning_1x_optimizer_state, self.owner))
        self._set("backward_prefetch", backward_prefetch_name(self.backward_prefetch))
        self._set("param_init_fn", validate_param_init_fn(self.param_init_fn))
        self._set("fairscale_kwargs", _without_use_orig_params(self.fairscale_kwargs))
        validate_arguments(
            self.min_num_params, self.bucket_cap_mb, self.compute_dtype, self.auto_wrap_policy, self.fairscale_kwargs
        )
        classes = _checkpointing_classes(self.activation_checkpointing, activation_checkpointing_policy)
        self._set("activation_checkpointing", classes)
        if self.state_dict_type not in ("full", "sharded"):
            raise ValueError(
                f'`state_dict_type` must be "full" (one file, loadable anywhere) or "sharded" (one file per rank),'
                f" got {self.state_dict_type!r}."
            )
        self._set("cpu_offload", offload_params(self.cpu_offload))
        if self.cpu_offload and self.move_grads_to_cpu is False:
            raise ValueError(
                "`cpu_offload=True` keeps the parameter shards in CPU memory, where the optimizer updates them, so"
                " their gradients must be moved there too: leave `move_grads_to_cpu` unset (it follows `cpu_offload`)"
                " or set it to True."
            )
        self._set("exclude_wrap_modules", _optional_classes(self.exclude_wrap_modules, "exclude_wrap_modules"))
        self._set("force_leaf_modules", _optional_classes(self.force_leaf_modules, "force_leaf_modules"))
        self._set("min_num_params", int(self.min_num_params))
        self._set("sync_each_batch", check_sync_each_batch(self.sync_each_batch))
        self._set("fairscale_kwargs", dict(self.fairscale_kwargs))

    def _set(self, name: str, value: Any) -> None:
        """Keep ``value`` (the checked form of an argument): only while the frozen instance is being built."""
        object.__setattr__(self, name, value)

    @property
    def mesh_request(self) -> Any:
        """What the strategy shards over: ``None`` (every rank), ``"node"`` (hybrid, over the ranks of each node) or
        ``(replicas, shard_size)`` (see :func:`~lightning_fairscale.fsdp.patches.hybrid.mesh_request`)."""
        return mesh_request(self.sharding_strategy, self.device_mesh)


def fsdp_kwargs(
    config: FullyShardedConfig, device: torch.device, groups: ProcessGroups, precision: str
) -> dict[str, Any]:
    """The keyword arguments every FSDP unit is built with, on ``device`` under ``precision`` (the precision plugin's
    setting: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"`` or ``"bf16-true"``)."""
    mixed = precision in ("16-mixed", "bf16-mixed")
    kwargs: dict[str, Any] = {
        # Groups made with the strategy's `timeout`: FairScale's own (when given none) wait 30 minutes.
        "process_group": groups.all_gather,
        "compute_device": device,
        # The ZeRO-2 strategies keep the full parameters from forward to backward, whatever the user's value says.
        "reshard_after_forward": config.reshard_after_forward and config.sharding_strategy not in _ZERO2,
        "flatten_parameters": config.flatten_parameters,
        "bucket_cap_mb": config.bucket_cap_mb,
        "mixed_precision": mixed,
        "fp32_reduce_scatter": bool(config.fp32_reduce_scatter) and mixed,
        "cpu_offload": offloads_to_cpu(config, device),
        "move_grads_to_cpu": (config.move_grads_to_cpu if device.type == "cuda" else False),
        "state_dict_device": torch.device("cpu") if config.state_dict_to_cpu else device,
        "state_dict_on_rank_0_only": True,
    }
    # Mixed precision computes in its dtype; true half precision holds the units' parameters in its dtype.
    dtype = config.compute_dtype or compute_dtype(precision) or half_dtype(precision)
    if dtype is not None:
        kwargs["compute_dtype"] = dtype
    if groups.reduce_scatter is not None:
        kwargs["process_group_reduce_scatter"] = groups.reduce_scatter
    if config.param_init_fn is not None:  # taken by our FSDP class (units built on the meta device)
        kwargs["param_init_fn"] = config.param_init_fn
    if groups.replica is not None:  # taken by our FSDP class: gradient shards are all-reduced over it
        kwargs["replica_group"] = groups.replica
    # Taken by our FSDP class: when a root on CPU gathers ahead in the backward (workaround 16).
    kwargs["backward_prefetch"] = config.backward_prefetch
    kwargs.update(config.fairscale_kwargs)
    return kwargs


def backward_prefetch_name(value: Any) -> Optional[str]:
    """The upper-case name of a ``backward_prefetch`` value: torch's ``BackwardPrefetch``, its name as a string (any
    case), or ``None``.

    Example:
        >>> from torch.distributed.fsdp import BackwardPrefetch
        >>> backward_prefetch_name(BackwardPrefetch.BACKWARD_PRE), backward_prefetch_name("backward_post")
        ('BACKWARD_PRE', 'BACKWARD_POST')
    """
    name = getattr(value, "name", value)
    if name is None or (isinstance(name, str) and name.upper() in BACKWARD_MODES):
        return None if name is None else name.upper()
    raise ValueError(
        f"`backward_prefetch` must be torch's BackwardPrefetch.BACKWARD_POST (the default: the peak memory of the"
        f" synchronous backward), BackwardPrefetch.BACKWARD_PRE (faster, one unit's memory more), their names, or"
        f" None (no prefetch in the backward), got {value!r}."
    )


def check_sync_each_batch(value: Any) -> bool:
    """``sync_each_batch`` as a bool; anything else is an error (a string such as ``"false"`` would be true).

    Example:
        >>> check_sync_each_batch(True)
        True
    """
    if not isinstance(value, bool):
        raise TypeError(
            "`sync_each_batch` must be True (reduce the gradients after every micro-batch: each rank holds only its"
            f" gradient shard while accumulating) or False (accumulate unreduced, the default), got {value!r}."
        )
    return value


def offloads_to_cpu(config: FullyShardedConfig, device: torch.device) -> bool:
    """Whether FairScale keeps the parameter shards in CPU memory: ``cpu_offload`` on a CUDA device (on the CPU they
    are there anyway)."""
    return config.cpu_offload and device.type == "cuda"


def wrap_policy(config: FullyShardedConfig, own_units: Iterable[Module] = (), root: Optional[Module] = None) -> Any:
    """FairScale's auto-wrap policy for the config's ``auto_wrap_policy`` (see
    :func:`~lightning_fairscale.fsdp.wrapping.policies.auto_wrap_policy`)."""
    return auto_wrap_policy(
        config.auto_wrap_policy,
        config.min_num_params,
        own_units=own_units,
        root=root,
        exclude_wrap_modules=config.exclude_wrap_modules,
        force_leaf_modules=config.force_leaf_modules,
    )


def check_settings(config: FullyShardedConfig, device: torch.device, precision: str) -> None:
    """Fail or warn, before training, about options that do not fit the device or the precision (the precision
    plugin's setting)."""
    dtype = half_dtype(precision)
    if dtype is not None:
        _check_true_half_precision(config, precision, dtype)
    elif config.compute_dtype not in (None, torch.float32) and precision not in ("16-mixed", "bf16-mixed"):
        flag = "16-mixed" if config.compute_dtype is torch.float16 else "bf16-mixed"
        raise ValueError(
            f"`DDPFullyShardedStrategy(compute_dtype={config.compute_dtype})` needs mixed precision, but the"
            f" precision is {precision!r}. Pass `precision={flag!r}` to the Trainer or to Fabric"
            " (FSDP then keeps FP32 master shards and computes in the lower precision), or leave `compute_dtype`"
            " unset."
        )
    if device.type == "cuda":
        if config.sync_each_batch and (config.cpu_offload or config.move_grads_to_cpu):
            raise ValueError(
                "`DDPFullyShardedStrategy(sync_each_batch=True)` cannot be combined with `cpu_offload` or"
                " `move_grads_to_cpu` on CUDA: FairScale 0.4.13 accumulates a micro-batch's reduced gradient shard"
                " into the previous one on the GPU, and the shards kept in CPU memory would be lost or fail. Use the"
                " default `sync_each_batch=False` (no_sync accumulation) with offloading."
            )
        if config.backward_prefetch != FullyShardedConfig.backward_prefetch:
            rank_zero_warn(
                f"`DDPFullyShardedStrategy(backward_prefetch={config.backward_prefetch})` has no effect on CUDA:"
                " FairScale's streams overlap the all-gathers with the computation there. It is ignored."
            )
        return
    for name in ("cpu_offload", "move_grads_to_cpu"):
        if getattr(config, name):
            rank_zero_warn(
                f"`DDPFullyShardedStrategy({name}=True)` has no effect when training on the CPU: parameters and"
                " gradients are in CPU memory already. It is ignored."
            )


def _check_true_half_precision(config: FullyShardedConfig, setting: str, dtype: torch.dtype) -> None:
    """Under true half precision the parameters are in ``dtype``: options asking for another dtype contradict it."""
    mixed = setting.replace("-true", "-mixed")
    if config.compute_dtype not in (None, dtype):
        raise ValueError(
            f"`DDPFullyShardedStrategy(compute_dtype={config.compute_dtype})` contradicts precision={setting!r},"
            f" which holds the parameters, gradients and optimizer state in {dtype} and computes in it. Leave"
            f" `compute_dtype` unset (it follows the precision), or use precision={mixed!r} to keep FP32"
            " parameters and compute in the lower precision."
        )
    if config.fp32_reduce_scatter:
        raise ValueError(
            f"`DDPFullyShardedStrategy(fp32_reduce_scatter=True)` needs mixed precision: under"
            f" precision={setting!r} the gradients are {dtype} and are reduced in {dtype}. Leave"
            f" `fp32_reduce_scatter` unset, or use precision={mixed!r} (FP32 parameters and gradients)."
        )


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
    if classes not in (None, ()) and policy is not None:
        raise ValueError(
            "`activation_checkpointing` and `activation_checkpointing_policy` both choose the layers to checkpoint,"
            " and mean the same here: pass one. Keep `activation_checkpointing_policy` (the name Lightning's"
            " FSDPStrategy uses) and remove `activation_checkpointing`."
        )
    if policy is not None:
        return checkpointing_layer_classes(policy)
    return validate_layer_classes(classes, "activation_checkpointing")


def _without_use_orig_params(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without torch FSDP's ``use_orig_params``, which is what the strategy does anyway (the model's
    attributes are the parameters the optimizer steps, see ``fsdp.unit.original_params``): ``True`` is accepted,
    ``False`` refused with the reason."""
    kwargs = dict(kwargs)
    if kwargs.pop("use_orig_params", True) is not True:
        raise ValueError(
            "`DDPFullyShardedStrategy(use_orig_params=False)` is not supported, and not needed: the strategy always"
            " keeps the original parameters (torch FSDP's `use_orig_params=True`), so param groups may split FSDP"
            " units, frozen and trainable parameters may share one, and `model.parameters()` after setup are the"
            " parameters the optimizer steps. Remove `use_orig_params`."
        )
    return kwargs


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
