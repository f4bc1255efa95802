# Generated from lightning_fairscale/precision/sharded_amp.py by `make lightning`: do not edit.
"""The sharded DDP mixed-precision plugin under the module path of the original extension
(``lightning_fairscale.precision.sharded_amp``; Lightning 1.x's ``pytorch_lightning.plugins.precision.
sharded_native_amp``).

Lightning 1.x's class name, ``ShardedNativeMixedPrecisionPlugin``, is a deprecated alias of
:class:`~lightning_fairscale.precision.ShardedMixedPrecisionPlugin`. ``ShardedGradScaler`` is FairScale's, as in
both: the plugin's fp16 loss scaler on CUDA.
"""

from typing import Any

from fairscale.optim.grad_scaler import ShardedGradScaler

from lightning_fairscale._deprecated import deprecated_alias
from lightning_fairscale.lightning.precision.sharded import ShardedMixedPrecisionPlugin

__all__ = ["ShardedGradScaler", "ShardedMixedPrecisionPlugin"]

_RENAMED = {"ShardedNativeMixedPrecisionPlugin": "ShardedMixedPrecisionPlugin"}


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, globals(), _RENAMED)
