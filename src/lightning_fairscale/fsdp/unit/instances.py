"""The one scan for the FSDP units of a module: FairScale's class (ours is a subclass), so that any module of the
unit layer can find units without importing the unit class (which imports them)."""

from __future__ import annotations

from collections.abc import Iterator

from fairscale.nn.data_parallel.fully_sharded_data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from torch import nn

__all__ = ["fsdp_instances", "named_fsdp_instances"]


def fsdp_instances(module: nn.Module) -> Iterator[_FairScaleFSDP]:
    """Every FairScale FSDP instance in ``module`` (itself included), outermost first: the one scan for the FSDP
    units of a module that the package uses."""
    return (unit for _, unit in named_fsdp_instances(module))


def named_fsdp_instances(module: nn.Module) -> Iterator[tuple[str, _FairScaleFSDP]]:
    """:func:`fsdp_instances` with each unit's path in ``module`` (``""`` for ``module`` itself, wrapper names
    included: ``lightning_fairscale.fsdp.unit.state_names.clean_path`` removes them)."""
    return ((path, m) for path, m in module.named_modules() if isinstance(m, _FairScaleFSDP))
