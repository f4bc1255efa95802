"""Precision plugins for the FairScale strategies; the strategies pick them from the Trainer's ``precision`` flag."""

from lightning_fairscale.precision.fully_sharded import (
    FullyShardedHalfPrecisionPlugin,
    FullyShardedMixedPrecisionPlugin,
    FullyShardedPrecisionPlugin,
)
from lightning_fairscale.precision.sharded import (
    ShardedHalfPrecisionPlugin,
    ShardedMixedPrecisionPlugin,
    ShardedPrecisionPlugin,
)

__all__ = [
    "FullyShardedHalfPrecisionPlugin",
    "FullyShardedMixedPrecisionPlugin",
    "FullyShardedPrecisionPlugin",
    "ShardedHalfPrecisionPlugin",
    "ShardedMixedPrecisionPlugin",
    "ShardedPrecisionPlugin",
]
