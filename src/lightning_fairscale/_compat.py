"""Every private name of Lightning and torch that lightning-fairscale uses, in one place.

Lightning and torch may rename or remove a private name in any release; importing them all here means an upgrade
breaks this one module, with an error that names what moved, instead of any file of the package. No other module
of the package imports a private Lightning name (``tests/unit/test_import_graph.py`` checks it).

Checked against pytorch-lightning / lightning-fabric / lightning 2.6.0 and 2.6.6, and torch 2.13. This module is
bound to Lightning (see :mod:`lightning_fairscale.lightning`): for ``import lightning as L`` it is compiled again with
``lightning.pytorch`` / ``lightning.fabric`` in place of the standalone packages.
"""

from __future__ import annotations

from lightning_fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning_fabric.utilities.init import _EmptyInit
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.core.optimizer import _MockOptimizer
from pytorch_lightning.utilities.model_helpers import _ModuleMode
from torch.optim.lr_scheduler import _LRScheduler

__all__ = [
    "_PATH",
    "_BackwardSyncControl",
    "_EmptyInit",
    "_LRScheduler",
    "_MockOptimizer",
    "_ModuleMode",
    "_Sharded",
    "_optimizers_to_device",
]
