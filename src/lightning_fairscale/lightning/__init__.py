"""lightning-fairscale for the unified ``lightning`` package (``import lightning as L``).

``L.Trainer`` accepts only strategies and plugins built on ``lightning.pytorch``; ``pytorch_lightning.Trainer`` only
those built on ``pytorch_lightning``. This subpackage has the same classes as the top-level package, built on
``lightning.pytorch``, from the same source: its modules (``lightning_fairscale.lightning.strategies``...) are copies
of the top-level package's Lightning-bound modules with their imports renamed, written by ``make lightning``
(``tools/generate_lightning.py``)::

    import lightning as L
    from lightning_fairscale.lightning import DDPFullyShardedStrategy

    trainer = L.Trainer(strategy=DDPFullyShardedStrategy(), accelerator="cpu", devices=2)

:mod:`lightning_fairscale.lightning.fabric` has the Fabric strategies for ``lightning.fabric.Fabric``
(:mod:`lightning_fairscale.fabric` for ``lightning_fabric.Fabric``)::

    from lightning.fabric import Fabric
    from lightning_fairscale.lightning.fabric import DDPFullyShardedStrategy

    fabric = Fabric(strategy=DDPFullyShardedStrategy(), accelerator="cpu", devices=2)

Importing this subpackage registers the registry names (``"fsdp_fairscale"``, ``"ddp_sharded"``...) with
``lightning.pytorch``'s and ``lightning.fabric``'s registries, so ``L.Trainer(strategy="fsdp_fairscale")`` works after
it. ``import lightning_fairscale`` imports it too when ``lightning`` is already imported (``import lightning as L``
first, as isort orders them), and never imports ``lightning`` itself. Modules without Lightning classes
(:mod:`lightning_fairscale.fsdp.units`, :mod:`lightning_fairscale.fsdp.policies`, the checkpoint format,
consolidation...) are shared: import them from the top-level package. Checkpoints are the same files either way.

Lightning 1.x's names ``ShardedNativeMixedPrecisionPlugin`` and ``FullyShardedNativeMixedPrecisionPlugin`` are
deprecated aliases here too, as in the top-level package and in the modules of the original extension's layout
(``lightning_fairscale.lightning.precision.sharded_amp``...), which this subpackage has as well.

Needs the ``lightning`` package: ``pip install "lightning-fairscale[lightning]"``.
"""

from typing import Any

from lightning_fairscale._deprecated import deprecated_alias

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
