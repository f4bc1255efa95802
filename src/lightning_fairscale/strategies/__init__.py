"""Lightning strategies backed by FairScale."""

from pytorch_lightning.strategies import StrategyRegistry

from lightning_fairscale.strategies.fully_sharded import DDPFullyShardedStrategy

__all__ = ["DDPFullyShardedStrategy"]

DDPFullyShardedStrategy.register_strategies(StrategyRegistry)
