# Generated from lightning_fairscale/fabric/__init__.py by `make lightning`: do not edit.
"""FairScale's sharded training for Fabric: the strategies of :mod:`lightning_fairscale.strategies`, for loops you
write yourself.

``import lightning_fairscale`` registers the names with Fabric's registry too (where Fabric has none of that name),
so ``Fabric(strategy="fsdp_fairscale")`` works after it::

    import lightning_fairscale
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp_fairscale")

The classes here are built on ``lightning_fabric``; those for the unified package (``lightning.fabric.Fabric``) are in
:mod:`lightning_fairscale.lightning.fabric`. ``fabric.save`` writes Fabric's checkpoints (the state's keys, see
:mod:`lightning_fairscale.checkpoint.fabric`), which the Trainer resumes from too.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_fairscale.lightning.fabric.fully_sharded import DDPFullyShardedStrategy
from lightning_fairscale.lightning.fabric.sharded import DDPShardedStrategy, DDPSpawnShardedStrategy

__all__ = ["DDPFullyShardedStrategy", "DDPShardedStrategy", "DDPSpawnShardedStrategy"]

DDPFullyShardedStrategy.register_strategies(STRATEGY_REGISTRY)
DDPShardedStrategy.register_strategies(STRATEGY_REGISTRY)
DDPSpawnShardedStrategy.register_strategies(STRATEGY_REGISTRY)
