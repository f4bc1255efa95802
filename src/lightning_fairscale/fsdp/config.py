"""The configuration of ``DDPFullyShardedStrategy``, for the Trainer's strategy and for Fabric's: each option declared
once, and the options' checks.

:class:`FullyShardedConfig` holds what the user chose: the arguments of Lightning 1.x's ``DDPFullyShardedStrategy``
(plus ours), each declared once as a field (its type, default, accepted type, check and documentation; see
:mod:`lightning_fairscale.option_fields`), checked once, when it is built, and frozen; the functions below are those
checks (the extra keyword arguments are checked against FairScale's in
:mod:`lightning_fairscale.fsdp.fairscale_kwargs`). Both strategies build one in their constructor and hold it as
``strategy.config``; what a run derives from it once it knows its device, its precision and its process groups (the
arguments every FairScale FSDP unit is built with, the wrap policy, the checks against the device) is in
:mod:`lightning_fairscale.fsdp.run`. Nothing here imports Lightning, so it is built and tested without it.

Example:
    >>> config = FullyShardedConfig(min_num_params=1e6, fairscale_kwargs={"verbose": True})
    >>> config.min_num_params, config.fairscale_kwargs
    (1000000, {'verbose': True})
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Any, Literal, Optional

import torch
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module

from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy, validate_policy
from lightning_fairscale.fsdp.wrapping.activation_checkpointing import (
    checkpointing_layer_classes,
    validate_layer_classes,
)
from lightning_fairscale.fsdp.fairscale_kwargs import check_fairscale_kwargs
from lightning_fairscale.fsdp.patches.hybrid import mesh_request, sharding_name
from lightning_fairscale.fsdp.unit.materialize import ParamInitFn, validate_param_init_fn
from lightning_fairscale.fsdp.wrapping.policies import AutoWrapPolicy, validate_auto_wrap_policy
from lightning_fairscale.fsdp.patches.prefetch import BACKWARD_MODES
from lightning_fairscale.fsdp.state.optimizer_paths import PATHS
from lightning_fairscale.option_fields import check_options, documented, option

__all__ = [
    "FullyShardedConfig",
    "backward_prefetch_name",
    "check_sync_each_batch",
    "offload_params",
    "validate_arguments",
]

@documented
@dataclass(frozen=True)
class FullyShardedConfig:
    """The options of ``DDPFullyShardedStrategy``, checked when built; frozen (``dataclasses.replace`` makes a
    changed copy, checked again).

    Each option is declared here once, as a field made by :func:`~lightning_fairscale.option_fields.option`; the
    strategies' constructors, their ``Args:`` and their typed attributes are written from these fields
    (``make options``). Lightning's own arguments (accelerator, devices, precision, timeout...) are not options; the
    strategy's extra keyword arguments are :attr:`fairscale_kwargs`. Values are kept in one form (``cpu_offload`` a
    bool, the layer classes tuples, ``sharding_strategy`` its upper-case name, ``device_mesh`` its shape,
    ``activation_checkpointing_policy`` merged into ``activation_checkpointing``). No option is written over by
    another: what one implies for another (the ZeRO-2 sharding strategies do not reshard after forward) is computed
    where it is used (:func:`~lightning_fairscale.fsdp.run.fsdp_kwargs`), so that a changed copy starts from the
    user's values.

    Raises:
        ValueError, TypeError: an argument is not accepted; the message says what is.
    """

    cpu_offload: bool = option(
        False,
        accepts="Union[bool, CPUOffload]",
        check=lambda value, config: offload_params(value),
        summary="keep the FP32 parameter shards on the CPU (CUDA only), a bool or torch's ``CPUOffload``.",
        doc="""keep the FP32 parameter shards on the CPU (CUDA only; ignored with a warning on CPU runs). A
            bool, or torch's ``CPUOffload(offload_params=...)`` as Lightning's ``FSDPStrategy`` takes it.""",
    )
    flatten_parameters: bool = option(
        True, summary="flatten each unit's parameters into one contiguous tensor (faster)."
    )
    reshard_after_forward: bool = option(
        True,
        summary="free full parameters after the forward pass, gathering them again for backward.",
        doc="""free full parameters after the forward pass, gathering them again for backward. Under
            ``sharding_strategy="SHARD_GRAD_OP"`` or ``"_HYBRID_SHARD_ZERO2"`` FSDP does not reshard, whatever this
            says (the strategy keeps the value given, for another ``sharding_strategy``).""",
    )
    move_grads_to_cpu: Optional[bool] = option(
        None,
        summary="move gradient shards to the CPU after reduction (default: as ``cpu_offload``).",
        doc="move gradient shards to the CPU after reduction (defaults to ``cpu_offload``).",
    )
    fp32_reduce_scatter: Optional[bool] = option(
        None,
        summary="reduce-scatter gradients in FP32 under mixed precision.",
        doc="""reduce-scatter gradients in FP32 under mixed precision (an error under true half precision, whose
            gradients are fp16 or bf16).""",
    )
    compute_dtype: Optional[torch.dtype] = option(
        None,
        check=lambda value, config: _check_compute_dtype(value),
        summary="the dtype of the full parameters in computation (default: from the precision).",
        doc="""dtype of the full parameters used in computation (defaults from ``precision``); under true half
            precision (``"bf16-true"``, ``"16-true"``) only that dtype is accepted.""",
    )
    bucket_cap_mb: int = option(
        25,
        check=lambda value, config: _check_bucket_cap_mb(value),
        summary="the size of the reduce-scatter buckets in MB; ``<= 0`` disables bucketing.",
        doc="""size of the reduce-scatter buckets in MB; ``<= 0`` disables bucketing. On CPU (gloo) also what
            the units the forward gathers ahead may hold together (at least the next unit is gathered).""",
    )
    min_num_params: int = option(
        int(1e8),  # Lightning 1.x's default
        check=lambda value, config: _check_min_num_params(value),
        summary="auto wrap by size: a module with this many unwrapped parameters becomes its own unit.",
        doc="a module with at least this many unwrapped parameters becomes its own unit (auto wrap).",
    )
    state_dict_to_cpu: bool = option(
        True, summary="return full state dicts on the CPU instead of the compute device."
    )
    auto_wrap_policy: Optional[AutoWrapPolicy] = option(
        None,
        check=lambda value, config: _check_auto_wrap_policy(value),
        summary="which submodules become units: layer classes, FairScale's or torch's policy.",
        doc="""which submodules become units when the model wraps nothing itself: a set of layer classes
            (each instance its own unit), a callable with FairScale's policy signature
            ``(module, recurse, unwrapped_params, module_is_root) -> bool``, or what Lightning's ``FSDPStrategy``
            takes: a callable with torch's signature ``(module, recurse, nonwrapped_numel) -> bool`` (such as
            ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``) or torch's
            ``ModuleWrapPolicy``/``CustomPolicy``, making the units torch's FSDP would. Default: by size
            (``min_num_params``).""",
    )
    exclude_wrap_modules: Optional[tuple[type[Module], ...]] = option(
        None,
        accepts="Optional[Iterable[type[Module]]]",
        check=lambda value, config: _optional_classes(value, "exclude_wrap_modules"),
        summary="layer classes that never become units themselves under auto wrap.",
        doc="""layer classes that never become units themselves under auto wrap (their children still can).
            Default: FairScale's (``nn.ModuleList``, ``nn.ModuleDict``) for the size policy, none else.""",
    )
    force_leaf_modules: Optional[tuple[type[Module], ...]] = option(
        None,
        accepts="Optional[Iterable[type[Module]]]",
        check=lambda value, config: _optional_classes(value, "force_leaf_modules"),
        summary="layer classes auto wrap does not descend into.",
        doc="""layer classes auto wrap does not descend into: neither they nor their children become units,
            their parameters belong to the enclosing unit. Default: FairScale's (``nn.MultiheadAttention``) for the
            size policy, none else.""",
    )
    activation_checkpointing: tuple[type[Module], ...] = option(
        None,  # kept as ``()`` (see `__post_init__`)
        accepts="Optional[Union[type[Module], list[type[Module]]]]",
        summary="a layer class, or a list, whose activations are recomputed in backward.",
        doc="""a layer class, or a list of them, whose instances recompute their activations in the backward
            pass instead of keeping them (FairScale's ``checkpoint_wrapper``, inside the FSDP unit).""",
    )
    activation_checkpointing_offload: bool = option(
        False, summary="keep the checkpointed layers' inputs in CPU memory until backward."
    )
    state_dict_type: Literal["full", "sharded"] = option(
        "full",
        check=lambda value, config: _check_state_dict_type(value),
        changeable=True,
        summary='``"full"`` (one checkpoint file, gathered on rank 0) or ``"sharded"`` (a file per rank).',
        doc="""``"full"`` (default): checkpoints are one file with the full model and optimizer state, gathered
            on rank 0, loadable anywhere. ``"sharded"``: every rank writes its own shard into a checkpoint
            directory, in parallel, and no rank gathers the full model; it resumes on the same number of processes,
            and ``lightning-fairscale-consolidate`` turns it into a full checkpoint. Loading accepts either kind.""",
    )
    lightning_1x_optimizer_state: OptimizerStatePolicy = option(
        "error",
        check=lambda value, config: validate_policy(value, config.owner),
        changeable=True,
        summary='resuming a Lightning 1.x checkpoint\'s optimizer state: ``"error"``/``"reset"``.',
        doc="""resuming a checkpoint of Lightning 1.x's FairScale FSDP strategy, whose optimizer state is rank
            0's shard only: ``"error"`` (default) fails before training when the optimizer has per-parameter state
            (Adam...); ``"reset"`` starts that state afresh, with the checkpoint's hyperparameters. Stateless
            optimizers (SGD without momentum) resume exactly either way.""",
    )
    #: Lightning ``FSDPStrategy``'s name for ``activation_checkpointing`` (not kept: it becomes that).
    activation_checkpointing_policy: InitVar[Optional[Any]] = option(
        None,
        accepts="Optional[Union[AutoWrapPolicy, type[Module]]]",
        summary="Lightning ``FSDPStrategy``'s name for ``activation_checkpointing``.",
        doc="""Lightning ``FSDPStrategy``'s name for ``activation_checkpointing``: a set of layer classes,
            ``ModuleWrapPolicy({Block})`` or ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
            Pass one of the two arguments.""",
    )
    param_init_fn: Optional[ParamInitFn] = option(
        None,
        check=lambda value, config: validate_param_init_fn(value),
        summary="initialises the modules of a model built on the ``meta`` device, unit by unit.",
        doc="""for a model built on the ``meta`` device (``trainer.init_module(empty_init=True)``,
            ``fabric.init_module(empty_init=True)``, or ``torch.device("meta")``): called with each module that
            holds meta tensors, once they are on the device (uninitialised), to initialise them in place, just before
            its FSDP unit is sharded (torch FSDP's argument). Default: each such module's ``reset_parameters()``.""",
    )
    #: Kept as ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"`` or ``"_HYBRID_SHARD_ZERO2"``.
    sharding_strategy: str = option(
        "FULL_SHARD",
        accepts="Any",
        check=lambda value, config: sharding_name(value),
        summary='``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"``... or torch\'s enum.',
        doc="""``"FULL_SHARD"`` (default: over all ranks), ``"SHARD_GRAD_OP"`` (as
            ``reshard_after_forward=False``), ``"HYBRID_SHARD"`` (shard over the ranks of each node, replicate
            across nodes: the gradient shards are all-reduced over the replicas) or ``"_HYBRID_SHARD_ZERO2"``
            (hybrid, without resharding after forward); a string or torch's ``ShardingStrategy``.""",
    )
    #: Kept as ``(replicas, shard_size)`` under hybrid sharding; ``None``: one replica per node.
    device_mesh: Optional[tuple[int, int]] = option(
        None,
        accepts='Optional[Union[tuple[int, int], "DeviceMesh"]]',  # Lightning's FSDPStrategy's annotation
        check=lambda value, config: _mesh_shape(config.sharding_strategy, value),
        summary="under hybrid sharding, ``(replicas, shard_size)`` or torch's 2-D ``DeviceMesh``.",
        doc="""under hybrid sharding, ``(replicas, shard_size)`` to shard over other groups than the nodes
            (consecutive ranks form a replica); torch's 2-D ``DeviceMesh`` is taken for its shape (which
            ``strategy.device_mesh`` then is).""",
    )
    #: Kept as ``"BACKWARD_POST"``, ``"BACKWARD_PRE"`` or ``None``.
    backward_prefetch: Optional[str] = option(
        "BACKWARD_POST",
        accepts="Any",
        check=lambda value, config: backward_prefetch_name(value),
        summary="when the backward on CPU gathers the next unit (torch's ``BackwardPrefetch`` or its name).",
        doc="""when the backward of a run on CPU (gloo) gathers the next unit's parameters, torch's
            ``BackwardPrefetch`` or its name: ``BACKWARD_POST`` (default) once the current unit's gradient is done,
            alongside its reduce-scatter (the peak memory of the synchronous backward); ``BACKWARD_PRE`` before the
            current unit's backward, which it overlaps (faster, about a unit's parameters and gradient more);
            ``None``: no prefetch in the backward. The forward on CPU always gathers ahead (the next units that fit
            in ``bucket_cap_mb``, at least one). On CUDA, FairScale's streams overlap the collectives and this is not
            used.""",
    )
    sync_each_batch: bool = option(
        False,
        check=lambda value, config: check_sync_each_batch(value),
        summary="reduce-scatter after every micro-batch when accumulating, instead of ``no_sync``.",
        doc="""how gradients accumulate over micro-batches (the Trainer's ``accumulate_grad_batches``, Fabric's
            ``no_backward_sync``). ``False`` (default): FairScale's ``no_sync``, each rank keeps the full,
            unsharded gradient of every unit until the last micro-batch, which reduce-scatters it once (least
            traffic, but the memory of a full gradient per rank). ``True``: every micro-batch reduce-scatters, and
            between micro-batches a rank holds only its gradient shard (what Lightning's own ``FSDPStrategy`` does
            in the Trainer; Accelerate's ``GradientAccumulationPlugin(sync_each_batch=True)``); Fabric's
            ``no_backward_sync`` then skips nothing. Same result either way. On CUDA not with ``cpu_offload`` or
            ``move_grads_to_cpu`` (FairScale cannot accumulate into gradient shards in CPU memory).""",
    )
    optimizer_path: Literal["auto", "elementwise", "whole"] = option(
        "auto",
        check=lambda value, config: _check_optimizer_path(value),
        summary='``"auto"``/``"elementwise"``/``"whole"``: how optimizers step (Adafactor, Muon: whole).',
        doc="""how the optimizers step the sharded parameters. ``"auto"`` (default): element-wise optimizers
            (SGD, Adam, AdamW...) step this rank's 1-D slices, with no more communication than FSDP's; those that read
            a parameter as a tensor (Adafactor, Muon, a LARS or LAMB of the user's) step each parameter whole on one
            owner rank, which receives its gradient and data slices and sends the updated slices back; an optimizer
            the table does not know is checked by a throwaway step of a small matrix whole against its slices.
            ``"elementwise"`` or ``"whole"`` force a path (see the guide, "Reading parameters outside the forward").""",
    )
    #: Keyword arguments passed to FairScale's ``FullyShardedDataParallel`` as they are (the strategies'
    #: ``**kwargs``).
    fairscale_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The strategy's class name, which the error messages name.
    owner: str = "DDPFullyShardedStrategy"

    def __post_init__(self, activation_checkpointing_policy: Optional[Any]) -> None:
        check_options(self)  # each option's own check, in their order
        # What concerns several options, or no declared one.
        classes = _checkpointing_classes(self.activation_checkpointing, activation_checkpointing_policy)
        object.__setattr__(self, "activation_checkpointing", classes)
        if self.cpu_offload and self.move_grads_to_cpu is False:
            raise ValueError(
                "`cpu_offload=True` keeps the parameter shards in CPU memory, where the optimizer updates them, so"
                " their gradients must be moved there too: leave `move_grads_to_cpu` unset (it follows `cpu_offload`)"
                " or set it to True."
            )
        object.__setattr__(self, "fairscale_kwargs", check_fairscale_kwargs(self.fairscale_kwargs))

    @property
    def mesh_request(self) -> Any:
        """What the strategy shards over: ``None`` (every rank), ``"node"`` (hybrid, over the ranks of each node) or
        ``(replicas, shard_size)`` (see :func:`~lightning_fairscale.fsdp.patches.hybrid.mesh_request`)."""
        return mesh_request(self.sharding_strategy, self.device_mesh)


def _mesh_shape(sharding_strategy: str, device_mesh: Any) -> Optional[tuple[int, int]]:
    """``device_mesh`` as ``(replicas, shard_size)``, or ``None`` (one replica per node, or no hybrid sharding)."""
    request = mesh_request(sharding_strategy, device_mesh)
    return request if isinstance(request, tuple) else None


def _check_auto_wrap_policy(value: Any) -> Any:
    validate_auto_wrap_policy(value)
    return value


def _check_state_dict_type(value: Any) -> Any:
    if value not in ("full", "sharded"):
        raise ValueError(
            f'`state_dict_type` must be "full" (one file, loadable anywhere) or "sharded" (one file per rank),'
            f" got {value!r}."
        )
    return value


def _check_optimizer_path(value: Any) -> Any:
    if value not in PATHS:
        raise ValueError(
            f'`optimizer_path` must be "auto" (each optimizer\'s own path), "elementwise" (every optimizer steps'
            f' this rank\'s slices) or "whole" (each parameter stepped whole by one rank), got {value!r}.'
        )
    return value


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


def _optional_classes(value: Any, argument: str) -> Optional[tuple[type[Module], ...]]:
    return None if value is None else validate_layer_classes(value, argument)


def validate_arguments(
    min_num_params: Any, bucket_cap_mb: Any, compute_dtype: Any, policy: Any, kwargs: dict[str, Any]
) -> None:
    """Raise an error that says what is accepted when an argument of ``DDPFullyShardedStrategy`` is not (the
    checks of these options, which the configuration runs, in one call)."""
    _check_min_num_params(min_num_params)
    _check_bucket_cap_mb(bucket_cap_mb)
    _check_compute_dtype(compute_dtype)
    validate_auto_wrap_policy(policy)
    check_fairscale_kwargs(kwargs)


def _check_min_num_params(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"`min_num_params` must be a number >= 0, got {value!r}.")
    return int(value)


def _check_bucket_cap_mb(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`bucket_cap_mb` must be a number of megabytes (<= 0 disables bucketing), got {value!r}.")
    return value


def _check_compute_dtype(value: Any) -> Any:
    if value is not None and value not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"`compute_dtype` must be torch.float32, torch.float16 or torch.bfloat16, got {value!r}.")
    return value
