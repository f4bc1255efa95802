"""Precision for ``DDPFullyShardedStrategy``: gradient clipping over all shards."""

from __future__ import annotations

from typing import Union

from pytorch_lightning.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale.fairscale_cpu import clip_grad_norm_


class FullyShardedPrecisionPlugin(Precision):
    """Full precision (``"32-true"``) for FSDP: clipping by norm uses the global norm of all ranks' shards.

    Lightning's own clipping computes the norm of this rank's shard only, which differs on every rank. Here the
    shards' norms are combined across ranks first, so the result equals :func:`torch.nn.utils.clip_grad_norm_`
    on the unsharded model.
    """

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float], norm_type: float = 2.0) -> None:
        parameters = [p for p in self.main_params(optimizer) if p.grad is not None]
        clip_grad_norm_(parameters, clip_val, norm_type)
