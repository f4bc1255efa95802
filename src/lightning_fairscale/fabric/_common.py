"""What the Fabric strategies share: skipping the gradient synchronization, and Fabric's precision plugins."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Optional

from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
from lightning_fabric.plugins.precision import MixedPrecision, Precision
from lightning_fabric.strategies.strategy import _BackwardSyncControl
from torch.nn import Module
from typing_extensions import override

from lightning_fairscale.mixed_precision import is_sharded_grad_scaler, sharded_grad_scaler, unsupported

__all__ = ["NoBackwardSync", "fabric_precision"]


class NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: FairScale's ``no_sync`` of the root FSDP unit or ``ShardedDataParallel``.

    Inside it, backward keeps this rank's gradients (whole, for FSDP) and reduces nothing; the first backward outside
    it reduces what was accumulated, so the result equals one backward over all the micro-batches.
    """

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, (FullyShardedDataParallel, ShardedDataParallel)):
            raise TypeError(
                "`fabric.no_backward_sync(model)` needs the model that `fabric.setup` returned (FairScale's"
                f" FullyShardedDataParallel or ShardedDataParallel inside), got {type(module).__name__}."
            )
        return module.no_sync()


def fabric_precision(plugin: Optional[Precision], strategy: str) -> Optional[Precision]:
    """The precision plugin ``strategy`` trains with, for one Fabric made from its ``precision`` flag.

    Full precision and mixed precision (``"16-mixed"``, ``"bf16-mixed"``) are Fabric's own plugins; fp16 gets a
    sharded grad scaler instead of Fabric's, whose inf/NaN checks agree across ranks (each rank checks its own
    gradient shards: with a plain scaler, ranks would skip different steps and their models drift apart).

    Raises:
        ValueError: another precision (``"16-true"``, ``"bf16-true"``, ``"64-true"``...); the message names those
            that work.
    """
    if plugin is None or type(plugin) is Precision:
        return plugin
    if isinstance(plugin, MixedPrecision):
        if plugin.scaler is not None and not is_sharded_grad_scaler(plugin.scaler):
            plugin.scaler = sharded_grad_scaler(plugin.device)
        return plugin
    raise unsupported(strategy, plugin, "`Fabric(precision=...)`")
