# Generated from lightning_fairscale/plugins/__init__.py by `make lightning`: do not edit.
"""The Trainer's and Fabric's CheckpointIO plugin:
:class:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO` writes full files and sharded directories
atomically."""

from lightning_fairscale.lightning.plugins.checkpoint_io import ShardedCheckpointIO

__all__ = ["ShardedCheckpointIO"]
