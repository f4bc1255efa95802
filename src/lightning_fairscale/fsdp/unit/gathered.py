"""Full parameters left gathered by an evaluation forward: workaround 27 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`.

FairScale does not reshard the root unit after its forward (it keeps the full parameters for the backward), and
frees them at the end of the backward. After a forward with no backward (validation) the root still holds them, and
its next forward uses them as they are: a write into the shards in between is not seen. Weight averaging writes the
average into the shards for validation and the module's own weights back after it, so the next training step
computed with the average (0.009 off ``"ddp"`` after 6 steps with validation every 2). :func:`drop_full_params`
frees what a unit still holds, so that its next forward gathers the shards again.
"""

from __future__ import annotations

from torch import nn

from lightning_fairscale.fsdp.unit.units import fsdp_instances

__all__ = ["drop_full_params"]


def drop_full_params(root: nn.Module) -> None:
    """Free the full parameters that any unit of ``root`` still holds outside a training pass (between steps), so
    that its next forward gathers them from the shards again."""
    for unit in fsdp_instances(root):
        if unit.has_full_params:
            unit._free_full_params()
            unit._use_fp32_param_shard()
