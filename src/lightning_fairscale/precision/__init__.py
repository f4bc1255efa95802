"""Precision plugins for the FairScale strategies."""

from lightning_fairscale.precision.fully_sharded import FullyShardedMixedPrecisionPlugin, FullyShardedPrecisionPlugin

__all__ = ["FullyShardedMixedPrecisionPlugin", "FullyShardedPrecisionPlugin"]
