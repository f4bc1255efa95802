"""Lightning strategies backed by FairScale."""

from pytorch_lightning.strategies import StrategyRegistry

from lightning_fairscale.strategies.fully_sharded import DDPFullyShardedStrategy
from lightning_fairscale.strategies.sharded import DDPShardedStrategy, DDPSpawnShardedStrategy

__all__ = ["DDPFullyShardedStrategy", "DDPShardedStrategy", "DDPSpawnShardedStrategy"]

DDPFullyShardedStrategy.register_strategies(StrategyRegistry)
DDPShardedStrategy.register_strategies(StrategyRegistry)
DDPSpawnShardedStrategy.register_strategies(StrategyRegistry)
