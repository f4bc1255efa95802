"""The Lightning package a scenario runs with: ``pytorch_lightning`` (default) or the unified ``lightning``.

The tests choose it with the environment variable ``TEST_LIGHTNING_PACKAGE`` (see ``conftest.run_script``), which
the ranks that Lightning's launcher starts inherit. Scenarios import Lightning's classes and ours from here, so one
scenario runs against either package. Ours are imported on first use: some scripts run where lightning_fairscale
must not be importable.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

PACKAGE = os.environ.get("TEST_LIGHTNING_PACKAGE", "pytorch_lightning")
if PACKAGE not in ("pytorch_lightning", "lightning"):
    raise ValueError(f"TEST_LIGHTNING_PACKAGE must be 'pytorch_lightning' or 'lightning', got {PACKAGE!r}")

pl = importlib.import_module("lightning.pytorch" if PACKAGE == "lightning" else "pytorch_lightning")
Fabric = importlib.import_module("lightning.fabric" if PACKAGE == "lightning" else "lightning_fabric").Fabric
Callback = pl.Callback
LightningModule = pl.LightningModule
Trainer = pl.Trainer
seed_everything = pl.seed_everything
ModelCheckpoint = pl.callbacks.ModelCheckpoint
OnExceptionCheckpoint = pl.callbacks.OnExceptionCheckpoint
ModelSummary = pl.callbacks.ModelSummary
ModelPruning = pl.callbacks.ModelPruning
StochasticWeightAveraging = pl.callbacks.StochasticWeightAveraging
ThroughputMonitor = pl.callbacks.ThroughputMonitor
DeviceStatsMonitor = pl.callbacks.DeviceStatsMonitor
AsyncCheckpointIO = pl.plugins.AsyncCheckpointIO
Logger = pl.loggers.Logger

#: Where our classes for ``PACKAGE`` are (the Trainer's; Fabric's are in its ``fabric`` submodule).
OURS = "lightning_fairscale.lightning" if PACKAGE == "lightning" else "lightning_fairscale"
_OUR_CLASSES = {
    "DDPFullyShardedStrategy",
    "DDPShardedStrategy",
    "DDPSpawnShardedStrategy",
    "FullyShardedMixedPrecisionPlugin",
    "ShardedMixedPrecisionPlugin",
    "ShardedCheckpointIO",
}


def register_strategy_names() -> None:
    """Register our strategy names with ``PACKAGE``'s registries (its Trainer's and Fabric's) as its users do:
    ``import lightning_fairscale`` for ``pytorch_lightning``, ``import lightning_fairscale.lightning`` for ``lightning``
    (``import lightning_fairscale`` does not import ``lightning``)."""
    importlib.import_module(OURS)


def __getattr__(name: str) -> Any:
    if name in _OUR_CLASSES:
        return getattr(importlib.import_module(OURS), name)
    if name.startswith("Fabric") and name[len("Fabric") :] in _OUR_CLASSES:  # FabricDDPFullyShardedStrategy...
        return getattr(importlib.import_module(f"{OURS}.fabric"), name[len("Fabric") :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
