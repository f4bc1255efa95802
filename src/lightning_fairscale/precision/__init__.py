"""Precision plugins for the FairScale strategies."""

from lightning_fairscale.precision.fully_sharded import FullyShardedPrecisionPlugin

__all__ = ["FullyShardedPrecisionPlugin"]
