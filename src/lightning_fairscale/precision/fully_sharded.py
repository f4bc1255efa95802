"""Precision plugins for ``DDPFullyShardedStrategy``: gradient clipping over all shards, and mixed precision."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.fairscale_cpu import ShardedGradScaler, clip_grad_norm_

__all__ = ["FullyShardedMixedPrecisionPlugin", "FullyShardedPrecisionPlugin", "fully_sharded_precision_plugin"]


class _GlobalNormClipping:
    """Clipping by norm over all ranks' shards: equals ``clip_grad_norm_`` on the unsharded model.

    Lightning's own clipping would take the norm of this rank's shard only, which differs from rank to rank.
    """

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float], norm_type: float = 2.0) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        clip_grad_norm_(parameters, clip_val, norm_type)


class FullyShardedPrecisionPlugin(_GlobalNormClipping, Precision):
    """Full precision (``"32-true"``) for FSDP, with clipping by the global norm of all shards."""


class FullyShardedMixedPrecisionPlugin(_GlobalNormClipping, MixedPrecision):
    """Mixed precision (``"16-mixed"`` or ``"bf16-mixed"``) for FairScale FSDP.

    FSDP keeps FP32 parameter shards and computes in ``compute_dtype`` (fp16 or bf16, following ``precision``),
    under ``torch.autocast``. For fp16 the loss is scaled with a sharded grad scaler
    (:class:`~lightning_fairscale.fairscale_cpu.ShardedGradScaler`, on every device), whose inf/NaN checks agree across
    ranks wherever the gradients are (in CPU memory with ``cpu_offload``); gradients are unscaled before clipping.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: ``"cuda"`` or ``"cpu"``.
        scaler: a grad scaler for fp16 (default: a sharded one); must be ``None`` for bf16.

    Example:
        >>> plugin = FullyShardedMixedPrecisionPlugin("bf16-mixed", "cpu")
        >>> plugin.compute_dtype
        torch.bfloat16
    """

    def __init__(
        self, precision: Literal["16-mixed", "bf16-mixed"], device: str, scaler: Optional[Any] = None
    ) -> None:
        if scaler is None and precision == "16-mixed":
            scaler = _sharded_grad_scaler(device)
        super().__init__(precision=precision, device=device, scaler=scaler)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype FSDP gathers full parameters in for computation."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16


def _sharded_grad_scaler(device: str) -> Any:
    # Ours on CUDA too, not FairScale's: with `cpu_offload` the gradients, and so the inf/NaN flags, are in CPU
    # memory; FairScale's scaler all-reduces a CUDA copy of such a flag and drops the result (`v_on_cuda.cpu()`), so
    # a rank that found an inf skips its step while the others step theirs. Ours reduces the flags in place.
    return ShardedGradScaler(device=device)


SUPPORTED_PRECISION = ("32-true", "16-mixed", "bf16-mixed")


def fully_sharded_precision_plugin(plugin: Precision) -> Precision:
    """The FSDP plugin for a plugin the Trainer made from its ``precision`` flag.

    Raises:
        ValueError: the precision is not one FSDP supports; the message names those that are.
    """
    if isinstance(plugin, (FullyShardedPrecisionPlugin, FullyShardedMixedPrecisionPlugin)):
        return plugin
    if type(plugin) is Precision:
        return FullyShardedPrecisionPlugin()
    if type(plugin) is MixedPrecision:
        return FullyShardedMixedPrecisionPlugin(plugin.precision, plugin.device, scaler=None)  # type: ignore[arg-type]
    raise ValueError(
        f"`DDPFullyShardedStrategy` does not support precision={getattr(plugin, 'precision', type(plugin).__name__)!r}."
        f" Use one of {', '.join(repr(p) for p in SUPPORTED_PRECISION)}: FairScale FSDP keeps FP32 parameter shards"
        " and computes in fp16 or bf16 under mixed precision."
    )
