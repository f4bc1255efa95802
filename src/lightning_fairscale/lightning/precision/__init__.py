# Generated from lightning_fairscale/precision/__init__.py by `make lightning`: do not edit.
"""Precision plugins for the FairScale strategies; the strategies pick them from the Trainer's ``precision`` flag.

Lightning 1.x's names, ``ShardedNativeMixedPrecisionPlugin`` and ``FullyShardedNativeMixedPrecisionPlugin``, are
deprecated aliases of :class:`ShardedMixedPrecisionPlugin` and :class:`FullyShardedMixedPrecisionPlugin`.
"""

from typing import Any

from lightning_fairscale._deprecated import deprecated_alias
from lightning_fairscale.lightning.precision.fully_sharded import (
    FullyShardedHalfPrecisionPlugin,
    FullyShardedMixedPrecisionPlugin,
    FullyShardedPrecisionPlugin,
)
from lightning_fairscale.lightning.precision.sharded import (
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

#: Lightning 1.x's names (``pytorch_lightning.plugins.precision``), and what they are called here.
_RENAMED = {
    "FullyShardedNativeMixedPrecisionPlugin": "FullyShardedMixedPrecisionPlugin",
    "ShardedNativeMixedPrecisionPlugin": "ShardedMixedPrecisionPlugin",
}


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, globals(), _RENAMED)
