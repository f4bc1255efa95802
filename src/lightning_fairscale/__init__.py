"""FairScale's sharded training for PyTorch Lightning 2.x.

Importing the package registers these strategy names with Lightning's registry, so ``Trainer(strategy=...)``
accepts them: ``"fsdp_fairscale"`` and ``"ddp_fully_sharded"`` (:class:`DDPFullyShardedStrategy`),
``"ddp_sharded"`` and ``"ddp_sharded_find_unused_parameters_false"`` (:class:`DDPShardedStrategy`),
``"ddp_sharded_spawn"`` and ``"ddp_sharded_spawn_find_unused_parameters_false"`` (:class:`DDPSpawnShardedStrategy`).
Lightning's own ``"fsdp"`` stays Lightning's. The same names are registered with Fabric's registry, for the Fabric
strategies of :mod:`lightning_fairscale.fabric`: ``Fabric(strategy="fsdp_fairscale")``.

Lightning 1.x's names of the mixed-precision plugins, ``ShardedNativeMixedPrecisionPlugin`` and
``FullyShardedNativeMixedPrecisionPlugin``, are deprecated aliases of :class:`ShardedMixedPrecisionPlugin` and
:class:`FullyShardedMixedPrecisionPlugin` (see :mod:`lightning_fairscale.precision`).

The classes here are built on ``pytorch_lightning``; :mod:`lightning_fairscale.lightning` has the same classes built on
the unified ``lightning`` package, and importing it registers the names with ``lightning.pytorch``'s and
``lightning.fabric``'s registries. This import does that too when ``lightning`` has been imported already; it never
imports ``lightning`` itself (a ``pytorch_lightning`` user does not pay for a second Lightning).
"""

import importlib
import sys
from typing import Any

from lightning_fairscale._deprecated import deprecated_alias
from lightning_fairscale.plugins.checkpoint_io import ShardedCheckpointIO
from lightning_fairscale.precision import (
    FullyShardedHalfPrecisionPlugin,
    FullyShardedMixedPrecisionPlugin,
    FullyShardedPrecisionPlugin,
    ShardedHalfPrecisionPlugin,
    ShardedMixedPrecisionPlugin,
    ShardedPrecisionPlugin,
)
from lightning_fairscale.precision import _RENAMED as _RENAMED_PRECISION
from lightning_fairscale.strategies import DDPFullyShardedStrategy, DDPShardedStrategy, DDPSpawnShardedStrategy
from lightning_fairscale.fsdp.unit.sharded_reads import local_reads, local_slice, whole

# Fabric's registry gets the same names (Fabric's classes are in `lightning_fairscale.fabric`).
importlib.import_module("lightning_fairscale.fabric")

#: The package's version (what pyproject.toml reads).
__version__ = "0.1.0"

__all__ = [
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
    "__version__",
    "local_reads",
    "local_slice",
    "whole",
]


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, globals(), _RENAMED_PRECISION)


# ``import lightning as L; import lightning_fairscale`` (isort's order) then ``L.Trainer(strategy="fsdp_fairscale")``
# should work: importing our classes for ``lightning.pytorch`` registers them with its registries. Only when the user
# imported ``lightning``: a ``pytorch_lightning`` user must not get a second copy of Lightning in the process.
# (``sys.modules["lightning"]`` is None where it was blocked on purpose.)
if sys.modules.get("lightning") is not None:
    importlib.import_module("lightning_fairscale.lightning")
