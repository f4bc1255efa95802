# Generated from lightning_fairscale/strategies/__init__.py by `make lightning`: do not edit.
"""Lightning strategies backed by FairScale."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fairscale.lightning.strategies.fully_sharded import DDPFullyShardedStrategy
from lightning_fairscale.lightning.strategies.sharded import DDPShardedStrategy, DDPSpawnShardedStrategy

__all__ = ["DDPFullyShardedStrategy", "DDPShardedStrategy", "DDPSpawnShardedStrategy"]

DDPFullyShardedStrategy.register_strategies(StrategyRegistry)
DDPShardedStrategy.register_strategies(StrategyRegistry)
DDPSpawnShardedStrategy.register_strategies(StrategyRegistry)
