"""Precision plugins for ``DDPFullyShardedStrategy``: gradient clipping over all shards, mixed precision and true
half precision."""

from __future__ import annotations

import weakref
from typing import Literal, Optional, Union

import torch
from fairscale.optim.grad_scaler import ShardedGradScaler as _FairScaleShardedGradScaler
from pytorch_lightning.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_fairscale.fsdp.model import WrappedModel
from lightning_fairscale.fsdp.patches.grad_norm import clip_grad_norm_
from lightning_fairscale.mixed_precision.grad_scaler import ShardedGradScaler, fsdp_grad_scaler
from lightning_fairscale.mixed_precision.settings import (
    SUPPORTED_PRECISION,
    compute_dtype,
    half_dtype,
    mixed_precision_name,
    unsupported,
)

__all__ = [
    "SUPPORTED_PRECISION",
    "FullyShardedHalfPrecisionPlugin",
    "FullyShardedMixedPrecisionPlugin",
    "FullyShardedPrecisionPlugin",
    "fully_sharded_precision_plugin",
]


class _GlobalNormClipping:
    """Clipping by norm over all ranks' shards: equals ``clip_grad_norm_`` on the unsharded model.

    Lightning's own clipping would take the norm of this rank's shard only, which differs from rank to rank.
    """

    #: The sharded model whose optimizers the plugin clips, handed over by the strategy when it sets the model up
    #: (:meth:`clip_for`), weakly: the plugin does not keep a model alive.
    _sharded_model: Optional[weakref.ref[WrappedModel]] = None

    def clip_for(self, model: Optional[WrappedModel]) -> None:
        """Clip the optimizers of ``model`` (``None``: of no sharded model, over the default group)."""
        self._sharded_model = weakref.ref(model) if model is not None else None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float], norm_type: float = 2.0) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # Over the group the optimizer's units shard over: one replica's under hybrid sharding, on every rank alike
        # (a rank holding no trainable element has no parameter to tell it).
        model = self._sharded_model() if self._sharded_model is not None else None
        group = model.norm_group(optimizer) if model is not None else None
        clip_grad_norm_(parameters, clip_val, norm_type, group=group)


class FullyShardedPrecisionPlugin(_GlobalNormClipping, Precision):
    """Full precision (``"32-true"``) for FSDP, with clipping by the global norm of all shards."""


class FullyShardedMixedPrecisionPlugin(_GlobalNormClipping, MixedPrecision):
    """Mixed precision (``"16-mixed"`` or ``"bf16-mixed"``) for FairScale FSDP.

    FSDP keeps FP32 parameter shards and computes in ``compute_dtype`` (fp16 or bf16, following ``precision``),
    under ``torch.autocast``. For fp16 the loss is scaled with a sharded grad scaler
    (:class:`~lightning_fairscale.mixed_precision.grad_scaler.ShardedGradScaler`, on every device), whose inf/NaN
    checks agree across ranks wherever the gradients are (in CPU memory with ``cpu_offload``); gradients are unscaled
    before clipping.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"`` (Lightning 1.x's ``16``, ``"16"`` and ``"bf16"`` work too, with
            a deprecation warning).
        device: ``"cuda"`` or ``"cpu"``.
        scaler: a :class:`~lightning_fairscale.mixed_precision.grad_scaler.ShardedGradScaler` for fp16 (default: one for
            ``device``); must be ``None`` for bf16.

    Raises:
        TypeError: ``scaler`` is another grad scaler, whose inf/NaN checks would not agree across ranks.

    Example:
        >>> plugin = FullyShardedMixedPrecisionPlugin("bf16-mixed", "cpu")
        >>> plugin.compute_dtype
        torch.bfloat16
    """

    def __init__(
        self, precision: Literal["16-mixed", "bf16-mixed"], device: str, scaler: Optional[torch.amp.GradScaler] = None
    ) -> None:
        precision = mixed_precision_name(precision, type(self).__name__)
        if scaler is None and precision == "16-mixed":
            scaler = fsdp_grad_scaler(device)
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            why = (
                "FairScale's drops the combined inf/NaN checks of gradients in CPU memory (`cpu_offload`)"
                if isinstance(scaler, _FairScaleShardedGradScaler)
                else "each rank would check only its own gradient shards for inf/NaN"
            )
            raise TypeError(
                f"`FullyShardedMixedPrecisionPlugin` needs a sharded grad scaler, got {type(scaler).__module__}."
                f"{type(scaler).__qualname__}: {why}, so the ranks would skip different steps and their models drift"
                " apart. Leave `scaler=None` (the default: a sharded one), or pass"
                f" `lightning_fairscale.mixed_precision.grad_scaler.ShardedGradScaler(device={device!r})`."
            )
        super().__init__(precision=precision, device=device, scaler=scaler)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype FSDP gathers full parameters in for computation."""
        dtype = compute_dtype(self.precision)
        assert dtype is not None
        return dtype


class FullyShardedHalfPrecisionPlugin(_GlobalNormClipping, HalfPrecision):
    """True half precision (``"bf16-true"`` or ``"16-true"``) for FairScale FSDP, as Lightning's ``HalfPrecision``.

    The module is converted to the dtype before it is sharded, so FSDP holds its parameter shards, their gradients
    and (through them) the optimizer state in bf16 or fp16, and gathers and reduces them in that dtype: half the
    memory of ``"32-true"``, with no FP32 master copy. Tensors made in ``configure_model`` or
    ``trainer.init_module()`` are made in the dtype, and the batches' floating point tensors are converted to it.
    Clipping by norm takes the norm of all shards together, accumulated in FP32.

    Args:
        precision: ``"bf16-true"`` or ``"16-true"``.

    Example:
        >>> FullyShardedHalfPrecisionPlugin("bf16-true").compute_dtype
        torch.bfloat16
    """

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype FSDP holds, gathers and computes the parameters in."""
        dtype = half_dtype(self.precision)
        assert dtype is not None
        return dtype


_PLUGINS = (FullyShardedPrecisionPlugin, FullyShardedMixedPrecisionPlugin, FullyShardedHalfPrecisionPlugin)


def fully_sharded_precision_plugin(plugin: Precision) -> Precision:
    """The FSDP plugin for a plugin the Trainer made from its ``precision`` flag.

    Raises:
        ValueError: the precision is not one FSDP supports (the message names those that are), or the plugin is
            another class for a supported one (e.g. a subclass of Lightning's ``Precision``).
    """
    if isinstance(plugin, _PLUGINS):
        return plugin
    if type(plugin) is Precision:
        return FullyShardedPrecisionPlugin()
    if type(plugin) is MixedPrecision:
        return FullyShardedMixedPrecisionPlugin(plugin.precision, plugin.device, scaler=None)  # type: ignore[arg-type]
    if type(plugin) is HalfPrecision:
        return FullyShardedHalfPrecisionPlugin(plugin.precision)
    raise unsupported(
        "DDPFullyShardedStrategy",
        plugin,
        "`Trainer(precision=...)`",
        own="`FullyShardedPrecisionPlugin` (32-true), `FullyShardedMixedPrecisionPlugin` (16-mixed, bf16-mixed) or"
        " `FullyShardedHalfPrecisionPlugin` (16-true, bf16-true)",
    )
