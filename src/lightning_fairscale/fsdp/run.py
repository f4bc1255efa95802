"""What a run makes of its :class:`~lightning_fairscale.fsdp.config.FullyShardedConfig`, once it knows its device,
its precision and its process groups.

The config holds what the user chose, checked against itself when it is built. A run adds what only it knows, and
this module derives from the two together: the keyword arguments every FairScale FSDP unit is built with
(:func:`fsdp_kwargs`, where one option's consequence for another is computed, so that the config keeps the user's
values), FairScale's auto-wrap policy (:func:`wrap_policy`), whether the shards live in CPU memory
(:func:`offloads_to_cpu`), and the checks of the options against the device and the precision that only a run can
make (:func:`check_settings`, before training). A module of its own: the config is built (and its errors raised) in
a strategy's constructor, before there is a device, a precision plugin or a process group; all of this comes later,
at set-up. Nothing here imports Lightning.

Example:
    >>> from lightning_fairscale.fsdp.config import FullyShardedConfig
    >>> config = FullyShardedConfig(min_num_params=1e6, fairscale_kwargs={"verbose": True})
    >>> kwargs = fsdp_kwargs(config, torch.device("cpu"), ProcessGroups(), "bf16-mixed")
    >>> kwargs["mixed_precision"], kwargs["compute_dtype"], kwargs["verbose"]
    (True, torch.bfloat16, True)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups
from lightning_fairscale.fsdp.wrapping.policies import auto_wrap_policy
from lightning_fairscale.mixed_precision.settings import compute_dtype, half_dtype

__all__ = ["check_settings", "fsdp_kwargs", "offloads_to_cpu", "wrap_policy"]

#: The ZeRO-2 sharding strategies: full parameters kept from forward to backward.
_ZERO2 = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")


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
