# Generated from lightning_fairscale/precision/fully_sharded_amp.py by `make lightning`: do not edit.
"""The FSDP mixed-precision plugin under the module path of the original extension
(``lightning_fairscale.precision.fully_sharded_amp``; Lightning 1.x's ``pytorch_lightning.plugins.precision.
fully_sharded_native_amp``).

Lightning 1.x's class name, ``FullyShardedNativeMixedPrecisionPlugin``, is a deprecated alias of
:class:`~lightning_fairscale.precision.FullyShardedMixedPrecisionPlugin`.
"""

from typing import Any

from lightning_fairscale._deprecated import deprecated_alias
from lightning_fairscale.lightning.precision.fully_sharded import FullyShardedMixedPrecisionPlugin

__all__ = ["FullyShardedMixedPrecisionPlugin"]

_RENAMED = {"FullyShardedNativeMixedPrecisionPlugin": "FullyShardedMixedPrecisionPlugin"}


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, globals(), _RENAMED)
