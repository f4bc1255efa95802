"""Clipping by norm over sharded gradients, on the gradients' own device (workaround 4 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`): the norm over every rank's shards (or one replica's, under hybrid
sharding)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fairscale.distributed import collectives

__all__ = [
    "clip_grad_norm_",
    "global_grad_norm",
]


@torch.no_grad()
def global_grad_norm(
    params: list[torch.nn.Parameter], norm_type: float, group: Optional[ProcessGroup] = None
) -> Tensor:
    """The norm of all ranks' gradient shards together, as if they were one vector. A collective call.

    Shards are disjoint (padding gradients are zero), so the p-norm of the whole is the p-th root of the sum of
    the shards' p-th powers, and the infinity norm is the maximum of the shards' maxima. Under hybrid sharding every
    replica holds the same shards: the callers pass one replica's ``group`` (the ``process_group`` the optimizer's
    units shard over: :meth:`lightning_fairscale.fsdp.model.WrappedModel.norm_group`), which every
    replica computes alike.
    """
    grads = [p.grad.detach() for p in params if p.grad is not None]
    # Where the zero of a rank without gradients lives: its parameters' device (the collective's backend needs it).
    device = params[0].device if params else torch.device("cpu")
    if norm_type == math.inf:
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        collectives.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    if grads:
        local = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
        local = (local**norm_type).sum()
    else:
        local = torch.zeros((), device=device)
    collectives.all_reduce(local, group=group)
    return local ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    params: list[torch.nn.Parameter], max_norm: float, norm_type: float, group: Optional[ProcessGroup] = None
) -> Tensor:
    """Scale every shard's gradients by ``max_norm / global_norm`` when the global norm exceeds ``max_norm``.

    Uses the same coefficient as :func:`torch.nn.utils.clip_grad_norm_`: ``max_norm / (norm + 1e-6)``, clamped to 1.
    """
    norm_type = float(norm_type)
    total_norm = global_grad_norm(params, norm_type, group)
    clip_coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(clip_coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total_norm
