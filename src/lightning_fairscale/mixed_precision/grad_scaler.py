"""Loss scaling for sharded gradients, whose inf/NaN checks agree across ranks, for both engines.

Each rank sees only its own gradient shards, so an inf or NaN one rank finds must make every rank skip the step and
back off the scale (workaround 5 of :mod:`lightning_fairscale.fsdp.patches.workarounds`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed import ProcessGroup

from lightning_fairscale.distributed import collectives

__all__ = ["ShardedGradScaler", "fsdp_grad_scaler", "is_sharded_grad_scaler", "sharded_grad_scaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """Loss scaling for sharded gradients on any device (workaround 5).

    Each rank only sees its own gradient shards, so an inf/NaN found on one rank must make every rank skip the step
    and back off the scale: the per-device "found inf" flags are summed over the process group after unscaling.
    """

    def __init__(self, device: str = "cpu", process_group: Optional[ProcessGroup] = None, **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradient shards, then agree with the other ranks on whether any was inf/NaN."""
        super().unscale_(optimizer)
        if not self._enabled:
            return
        for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            collectives.all_reduce(found_inf, group=self.process_group)  # in place, on the flag's device


def fsdp_grad_scaler(device: str) -> ShardedGradScaler:
    """FSDP's loss scaler for fp16: ours on every device, CUDA included.

    Not FairScale's: with ``cpu_offload`` the gradients, and so the inf/NaN flags, are in CPU memory; FairScale's scaler
    all-reduces a CUDA copy of such a flag and drops the result (``v_on_cuda.cpu()``), so a rank that found an inf
    skips its step while the others step theirs. Ours reduces the flags in place.
    """
    return ShardedGradScaler(device=device)


def sharded_grad_scaler(device: str) -> torch.amp.GradScaler:
    """Sharded DDP's loss scaler for fp16, whose inf/NaN checks are combined across ranks: FairScale's
    ``ShardedGradScaler`` on CUDA (OSS keeps gradients on the GPU), the device-generic one of
    :mod:`lightning_fairscale.fsdp.patches.workarounds` elsewhere."""
    if device == "cuda":
        from fairscale.optim.grad_scaler import ShardedGradScaler as FairScaleShardedGradScaler

        return FairScaleShardedGradScaler()
    return ShardedGradScaler(device=device)


def is_sharded_grad_scaler(scaler: Any) -> bool:
    """Whether ``scaler`` combines its inf/NaN checks across ranks (one of the two scalers above)."""
    from fairscale.optim.grad_scaler import ShardedGradScaler as FairScaleShardedGradScaler

    return isinstance(scaler, (FairScaleShardedGradScaler, ShardedGradScaler))
