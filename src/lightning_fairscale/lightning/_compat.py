# Generated from lightning_fairscale/_compat.py by `make lightning`: do not edit.
"""Every private name of Lightning and torch that lightning-fairscale uses, in one place.

Lightning and torch may rename or remove a private name in any release; importing them all here means an upgrade
breaks this one module, with an error that names what moved, instead of any file of the package. No other module
of the package imports a private Lightning name, and no other module reads or writes a private attribute of a
Lightning object: :class:`StrategyInternals` and :func:`attached_trainer` do (``tests/unit/test_import_graph.py``
checks both). The one exception by design is :mod:`lightning_fairscale.callbacks.model_summary`, whose summary subclasses
Lightning's ``ModelSummary`` and overrides its private hooks.

Checked against pytorch-lightning / lightning-fabric / lightning 2.6.0 and 2.6.6, and torch 2.13. This module is
bound to Lightning (see :mod:`lightning_fairscale.lightning`): for ``import lightning as L`` it is compiled again with
``lightning.pytorch`` / ``lightning.fabric`` in place of the standalone packages.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities.model_helpers import _ModuleMode
from torch.optim.lr_scheduler import _LRScheduler

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "StrategyInternals",
    "attached_trainer",
    "_PATH",
    "_BackwardSyncControl",
    "_LRScheduler",
    "_MockOptimizer",
    "_ModuleMode",
    "_MultiProcessingLauncher",
    "_Sharded",
    "_optimizers_to_device",
]


#: The private attributes of Lightning objects that the package uses (all through this module).
PRIVATE_ATTRIBUTES = (
    "_timeout", "_checkpoint_io", "_ddp_kwargs", "_layer_sync", "_precision_plugin", "_precision", "_trainer",
    "_launcher", "_start_method",
)  # fmt: skip


class StrategyInternals:
    """The private attributes of Lightning's strategy classes (the Trainer's and Fabric's ``Strategy`` and
    ``DDPStrategy``) that our strategies read or write, behind methods of ours.

    Every strategy of ours has this class among its bases; the engine's option classes
    (:class:`~lightning_fairscale.fsdp.options.FullyShardedOptions`, :class:`~lightning_fairscale.sharded_ddp.engine.ShardedDDPOptions`)
    call these methods, so that they need no Lightning import and a renamed attribute breaks this module only.
    """

    def _collective_timeout(self) -> Optional[timedelta]:
        """``DDPStrategy._timeout``: the timeout the strategy's collectives were given (``timeout=``)."""
        return self._timeout  # type: ignore[attr-defined]

    def _checkpoint_io_slot(self) -> Optional[Any]:
        """``Strategy._checkpoint_io``: the CheckpointIO plugin given to the strategy, ``None`` when none was."""
        return self._checkpoint_io  # type: ignore[attr-defined,has-type]

    def _set_checkpoint_io_slot(self, io: Optional[Any]) -> None:
        self._checkpoint_io = io

    def _ddp_keyword_arguments(self) -> dict[str, Any]:
        """``DDPStrategy._ddp_kwargs``: the keyword arguments the strategy passes on to its DDP wrapper."""
        return self._ddp_kwargs  # type: ignore[attr-defined,no-any-return]

    def _layer_sync_plugin(self) -> Optional[Any]:
        """The Trainer's ``DDPStrategy._layer_sync``: ``SyncBatchNorm`` conversion when ``sync_batchnorm=True``."""
        return self._layer_sync  # type: ignore[attr-defined]

    def _precision_plugin_slot(self) -> Optional[Any]:
        """The Trainer's ``Strategy._precision_plugin``: the precision plugin given, ``None`` when none was."""
        return self._precision_plugin  # type: ignore[attr-defined,has-type]

    def _set_precision_plugin_slot(self, plugin: Optional[Any]) -> None:
        self._precision_plugin = plugin

    def _use_multiprocessing_launcher(self, launcher_class: type) -> None:
        """``Strategy._launcher``: where Lightning chose its multiprocessing launcher (``start_method`` ``"spawn"``,
        ``"fork"`` or ``"forkserver"``), put ``launcher_class`` (a subclass of it) in its place, built the same way
        (``DDPStrategy._start_method``). Call it after Lightning's ``_configure_launcher``."""
        if isinstance(self._launcher, _MultiProcessingLauncher):  # type: ignore[has-type]
            self._launcher = launcher_class(self, start_method=self._start_method)  # type: ignore[attr-defined]

    def _fabric_precision_slot(self) -> Optional[Any]:
        """Fabric's ``Strategy._precision``: the precision plugin given, ``None`` when none was."""
        return self._precision  # type: ignore[attr-defined,has-type]

    def _set_fabric_precision_slot(self, precision: Optional[Any]) -> None:
        self._precision = precision


def attached_trainer(module: Any) -> Optional[Any]:
    """``LightningModule._trainer``: the Trainer the module is attached to, ``None`` when none (the public
    ``module.trainer`` raises then)."""
    return module._trainer
