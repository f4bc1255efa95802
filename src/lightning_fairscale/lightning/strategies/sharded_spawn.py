# Generated from lightning_fairscale/strategies/sharded_spawn.py by `make lightning`: do not edit.
"""``DDPSpawnShardedStrategy`` under the module path of Lightning 1.x (``pytorch_lightning.strategies.sharded_spawn``)
and of the original extension (``lightning_fairscale.strategies.sharded_spawn``).

The class lives in :mod:`lightning_fairscale.strategies.sharded`, beside ``DDPShardedStrategy``, which it extends:
Lightning 2 has no ``DDPSpawnStrategy`` to build it on.
"""

from lightning_fairscale.lightning.strategies.sharded import DDPSpawnShardedStrategy

__all__ = ["DDPSpawnShardedStrategy"]
