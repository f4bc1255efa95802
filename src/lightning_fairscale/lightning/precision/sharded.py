# Generated from lightning_fairscale/precision/sharded.py by `make lightning`: do not edit.
"""Precision plugins for ``DDPShardedStrategy``: clipping by the global norm through OSS, mixed precision and true
half precision."""

from __future__ import annotations

from typing import Literal, Optional, Union

from fairscale.optim import OSS
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_fairscale.mixed_precision.grad_scaler import is_sharded_grad_scaler, sharded_grad_scaler
from lightning_fairscale.sharded_ddp.trainability import clip_grad_norm
from lightning_fairscale.mixed_precision.settings import SUPPORTED_PRECISION, mixed_precision_name, unsupported

__all__ = [
    "SUPPORTED_PRECISION",
    "ShardedHalfPrecisionPlugin",
    "ShardedMixedPrecisionPlugin",
    "ShardedPrecisionPlugin",
    "sharded_precision_plugin",
]


class _OSSNormClipping:
    """Clipping by norm with ``OSS.clip_grad_norm``: the norm of all ranks' gradients together.

    After ``ShardedDataParallel``'s backward, each rank holds the reduced gradients of the parameters its OSS shard
    owns only, so Lightning's ``clip_grad_norm_`` over the local gradients would use a different norm on every rank.
    ``OSS.clip_grad_norm`` combines the owned gradients' norms across ranks (gloo and NCCL alike), which equals
    :func:`torch.nn.utils.clip_grad_norm_` on the unsharded model. Clipping by value needs no change: each rank clips
    the gradients it owns.

    OSS lists the gradients it owns at its first clipping call and keeps the list; :func:`clip_grad_norm` has it
    list them again at every call (FairScale workaround 25), so parameters frozen or unused then count later.
    """

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float], norm_type: float = 2.0) -> None:
        if isinstance(optimizer, OSS):
            clip_grad_norm(optimizer, clip_val, norm_type=norm_type)
        else:  # an optimizer the strategy did not shard (no parameters): its gradients are complete on every rank
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]


class ShardedPrecisionPlugin(_OSSNormClipping, Precision):
    """Full precision (``"32-true"``) for ``DDPShardedStrategy``, with clipping by the global gradient norm."""


class ShardedMixedPrecisionPlugin(_OSSNormClipping, MixedPrecision):
    """Mixed precision (``"16-mixed"`` or ``"bf16-mixed"``) for ``DDPShardedStrategy``.

    Parameters, gradients and optimizer state stay in FP32; the forward pass runs under ``torch.autocast``. For fp16
    the loss is scaled by a sharded grad scaler (FairScale's ``ShardedGradScaler`` on CUDA, the device-generic one
    of :mod:`lightning_fairscale.fsdp.patches.workarounds` elsewhere): its inf/NaN checks are combined across ranks, so
    all ranks skip the same steps, which a plain ``GradScaler`` would not do with sharded gradients. bf16 needs no
    scaler.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"`` (Lightning 1.x's ``16``, ``"16"`` and ``"bf16"`` work too, with
            a deprecation warning).
        device: the device type autocast runs on: ``"cuda"`` or ``"cpu"``.
        scaler: a sharded grad scaler for fp16 (default: one for ``device``); must be ``None`` for bf16.

    Raises:
        TypeError: ``scaler`` is not a sharded grad scaler.

    Example:
        >>> plugin = ShardedMixedPrecisionPlugin("bf16-mixed", "cpu")
        >>> plugin.scaler is None
        True
    """

    def __init__(
        self, precision: Literal["16-mixed", "bf16-mixed"], device: str, scaler: Optional[torch.amp.GradScaler] = None
    ) -> None:
        precision = mixed_precision_name(precision, type(self).__name__)
        if scaler is None and precision == "16-mixed":
            scaler = sharded_grad_scaler(device)
        if scaler is not None and not is_sharded_grad_scaler(scaler):
            raise TypeError(
                f"`ShardedMixedPrecisionPlugin` needs a sharded grad scaler, got {type(scaler).__name__}: with sharded"
                " gradients a plain `GradScaler` finds infs on some ranks only and the ranks' models drift apart."
                " Pass `fairscale.optim.grad_scaler.ShardedGradScaler()` (CUDA) or leave `scaler=None`."
            )
        super().__init__(precision=precision, device=device, scaler=scaler)


class ShardedHalfPrecisionPlugin(_OSSNormClipping, HalfPrecision):
    """True half precision (``"bf16-true"`` or ``"16-true"``) for ``DDPShardedStrategy``, as Lightning's
    ``HalfPrecision``.

    The module is converted to the dtype before it is wrapped: parameters (whole on every rank), gradients (reduced
    in that dtype) and OSS's optimizer state shard are bf16 or fp16, with no FP32 copy. OSS computes the norm for
    clipping in FP32 and rounds it to the gradients' dtype.

    Example:
        >>> ShardedHalfPrecisionPlugin("bf16-true").precision
        'bf16-true'
    """


_PLUGINS = (ShardedPrecisionPlugin, ShardedMixedPrecisionPlugin, ShardedHalfPrecisionPlugin)


def sharded_precision_plugin(plugin: Precision) -> Precision:
    """The ``DDPShardedStrategy`` plugin for a plugin the Trainer made from its ``precision`` flag.

    Lightning's ``Precision`` (``"32-true"``), ``MixedPrecision`` and ``HalfPrecision`` become their sharded
    counterparts; the sharded plugins are kept as they are.

    Raises:
        ValueError: the precision is not one the strategy supports (the message names those that are), or the plugin
            is another class for a supported one (e.g. a subclass of Lightning's ``Precision``).

    Example:
        >>> type(sharded_precision_plugin(Precision())).__name__
        'ShardedPrecisionPlugin'
    """
    if isinstance(plugin, _PLUGINS):
        return plugin
    if type(plugin) is Precision:
        return ShardedPrecisionPlugin()
    if type(plugin) is MixedPrecision:
        return ShardedMixedPrecisionPlugin(plugin.precision, plugin.device)  # type: ignore[arg-type]
    if type(plugin) is HalfPrecision:
        return ShardedHalfPrecisionPlugin(plugin.precision)
    raise unsupported(
        "DDPShardedStrategy",
        plugin,
        "`Trainer(precision=...)`",
        own="`ShardedPrecisionPlugin` (32-true), `ShardedMixedPrecisionPlugin` (16-mixed, bf16-mixed) or"
        " `ShardedHalfPrecisionPlugin` (16-true, bf16-true)",
    )
