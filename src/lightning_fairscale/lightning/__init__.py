"""lightning-fairscale for the unified ``lightning`` package (``import lightning as L``).

``L.Trainer`` accepts only strategies and plugins built on ``lightning.pytorch``; ``pytorch_lightning.Trainer`` only
those built on ``pytorch_lightning``. This subpackage has the same classes as the top-level package, built on
``lightning.pytorch``, from the same source (see :mod:`lightning_fairscale.lightning._loader`)::

    import lightning as L
    from lightning_fairscale.lightning import DDPFullyShardedStrategy

    trainer = L.Trainer(strategy=DDPFullyShardedStrategy(), accelerator="cpu", devices=2)

:mod:`lightning_fairscale.lightning.fabric` has the Fabric strategies for ``lightning.fabric.Fabric``
(:mod:`lightning_fairscale.fabric` for ``lightning_fabric.Fabric``)::

    from lightning.fabric import Fabric
    from lightning_fairscale.lightning.fabric import DDPFullyShardedStrategy

    fabric = Fabric(strategy=DDPFullyShardedStrategy(), accelerator="cpu", devices=2)

The registry names need no import from here: ``import lightning_fairscale`` registers them with both packages'
registries when both are installed, so ``L.Trainer(strategy="fsdp_fairscale")`` works after it. Modules without
Lightning classes (:mod:`lightning_fairscale.fsdp.units`, :mod:`lightning_fairscale.fsdp.policies`, the checkpoint
format, consolidation...) are shared: import them from the top-level package. Checkpoints are the same files either
way.

Lightning 1.x's names ``ShardedNativeMixedPrecisionPlugin`` and ``FullyShardedNativeMixedPrecisionPlugin`` are
deprecated aliases here too, as in the top-level package and in the modules of the original extension's layout
(``lightning_fairscale.lightning.precision.sharded_amp``...), which this subpackage has as well.

Needs the ``lightning`` package: ``pip install "lightning-fairscale[lightning]"``.
"""

from typing import Any

from lightning_fairscale._deprecated import deprecated_alias
from lightning_fairscale.lightning import _loader

try:
    import lightning.pytorch  # noqa: F401
except ModuleNotFoundError as error:
    if error.name is None or error.name.partition(".")[0] != "lightning":
        raise
    raise ModuleNotFoundError(
        "`lightning_fairscale.lightning` is for the `lightning` package, which is not installed. Install it with"
        ' `pip install "lightning-fairscale[lightning]"`, or use the top-level `lightning_fairscale` classes with'
        " `pytorch_lightning`.",
        name="lightning",
    ) from error

_loader.install()

from lightning_fairscale.lightning.plugins import ShardedCheckpointIO  # noqa: E402
from lightning_fairscale.lightning.precision import (  # noqa: E402
    FullyShardedHalfPrecisionPlugin,
    FullyShardedMixedPrecisionPlugin,
    FullyShardedPrecisionPlugin,
    ShardedHalfPrecisionPlugin,
    ShardedMixedPrecisionPlugin,
    ShardedPrecisionPlugin,
)
from lightning_fairscale.lightning.precision import _RENAMED as _RENAMED_PRECISION  # noqa: E402
from lightning_fairscale.lightning.strategies import (  # noqa: E402
    DDPFullyShardedStrategy,
    DDPShardedStrategy,
    DDPSpawnShardedStrategy,
)
from lightning_fairscale.lightning import fabric  # noqa: E402  (registers the names with lightning.fabric's registry)

__all__ = [
    "fabric",
    "DDPFullyShardedStrategy",
    "DDPShardedStrategy",
    "DDPSpawnShardedStrategy",
    "FullyShardedHalfPrecisionPlugin",
    "FullyShardedMixedPrecisionPlugin",
    "FullyShardedPrecisionPlugin",
    "ShardedCheckpointIO",
    "ShardedHalfPrecisionPlugin",
    "ShardedMixedPrecisionPlugin",
    "ShardedPrecisionPlugin",
]


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, globals(), _RENAMED_PRECISION)
