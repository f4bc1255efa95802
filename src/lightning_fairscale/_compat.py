"""The private names of Lightning that lightning-fairscale imports, and the private attributes of Lightning's objects
that it reads or writes through functions here (:data:`PRIVATE_ATTRIBUTES`), in one place.

Lightning may rename or remove a private name in any release; reaching them here means an upgrade breaks this one
module, with an error that names what moved, instead of any file of the package. No other module of the package
imports a private Lightning name, and none uses an attribute of :data:`PRIVATE_ATTRIBUTES`
(``tests/unit/test_import_graph.py`` checks both). That list is fixed: a private attribute of a Lightning object
outside it is not caught. Those used elsewhere, by design: :mod:`lightning_fairscale.callbacks.model_summary`, whose
summary subclasses Lightning's ``ModelSummary`` and overrides its private hooks; the strategies' overrides of
Lightning's private methods (``_setup_model``, ``_configure_launcher``) and Fabric's ``_backward_sync_control``.
torch's private names are in :mod:`lightning_fairscale.distributed.torch_private`.

Checked against pytorch-lightning / lightning-fabric / lightning 2.6.0 and 2.6.6, and torch 2.13. This module is
bound to Lightning (see :mod:`lightning_fairscale.lightning`): ``make lightning`` (``tools/generate_lightning.py``)
writes its copy for ``import lightning as L``, ``lightning_fairscale/lightning/_compat.py``, with ``lightning.pytorch``
/ ``lightning.fabric`` in place of the standalone packages in its imports.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Callable, Optional, Union

from lightning_fabric import Fabric
from lightning_fabric.plugins import CheckpointIO
from lightning_fabric.strategies import DDPStrategy as FabricDDPStrategy, Strategy as FabricStrategy
from lightning_fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.core.optimizer import LightningOptimizer, _MockOptimizer
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelPruning
from pytorch_lightning.plugins.layer_sync import LayerSync
from pytorch_lightning.strategies import DDPStrategy as TrainerDDPStrategy, ParallelStrategy
from pytorch_lightning.strategies import Strategy as TrainerStrategy
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.utilities.compile import to_uncompiled
from pytorch_lightning.utilities.model_helpers import _ModuleMode
from lightning_fabric.wrappers import _FabricModule
from torch.nn import Module

__all__ = [
    "AnyDDPStrategy",
    "AnyStrategy",
    "PRIVATE_ATTRIBUTES",
    "attached_trainer",
    "fabric_compile_options",
    "take_trainer_compile",
    "checkpoint_io_slot",
    "collective_timeout",
    "layer_sync_plugin",
    "lottery_ticket_reset",
    "plain_optimizer",
    "precision_plugin_property",
    "set_checkpoint_io_slot",
    "set_weight_averaging_model",
    "weight_averaging_model",
    "fabric_precision_property",
    "forward_module",
    "use_multiprocessing_launcher",
    "_PATH",
    "_BackwardSyncControl",
    "_MockOptimizer",
    "_ModuleMode",
    "_MultiProcessingLauncher",
    "_Sharded",
    "_optimizers_to_device",
]


#: The private attributes of Lightning objects that the package uses through this module (no other module uses them).
PRIVATE_ATTRIBUTES = (
    "_timeout", "_checkpoint_io", "_layer_sync", "_precision_plugin", "_precision", "_trainer",
    "_launcher", "_start_method", "_optimizer", "_compiler_ctx", "_average_model", "_forward_module",
    "_use_lottery_ticket_hypothesis",
)  # fmt: skip


# The private attributes of Lightning's strategy classes (the Trainer's and Fabric's ``Strategy`` and ``DDPStrategy``)
# that our strategies read or write, behind functions of ours: a renamed attribute breaks this module only.

#: A strategy of the Trainer's or of Fabric's (our strategies are one or the other).
AnyStrategy = Union[TrainerStrategy, FabricStrategy]
#: A ``DDPStrategy`` of the Trainer's or of Fabric's (our strategies extend one or the other).
AnyDDPStrategy = Union[TrainerDDPStrategy, FabricDDPStrategy]


def collective_timeout(strategy: AnyDDPStrategy) -> Optional[timedelta]:
    """``DDPStrategy._timeout``: the timeout the strategy's collectives were given (``timeout=``)."""
    return strategy._timeout


def checkpoint_io_slot(strategy: AnyStrategy) -> Optional[CheckpointIO]:
    """``Strategy._checkpoint_io``: the CheckpointIO plugin given to the strategy, ``None`` when none was."""
    return strategy._checkpoint_io


def set_checkpoint_io_slot(strategy: AnyStrategy, io: Optional[CheckpointIO]) -> None:
    strategy._checkpoint_io = io


def forward_module(module: Module) -> Module:
    """``_FabricModule._forward_module``: inside what ``fabric.setup`` returned, the module the strategy's
    ``setup_module`` returned (compiled by Fabric: the compiled one); another module as it is."""
    return module._forward_module if isinstance(module, _FabricModule) else module


def lottery_ticket_reset(callback: ModelPruning) -> bool:
    """``ModelPruning._use_lottery_ticket_hypothesis``: whether the callback resets the weights to their first values
    (``use_lottery_ticket_hypothesis``, on by default)."""
    return bool(callback._use_lottery_ticket_hypothesis)


def layer_sync_plugin(strategy: ParallelStrategy) -> Optional[LayerSync]:
    """The Trainer's ``DDPStrategy._layer_sync``: ``SyncBatchNorm`` conversion when ``sync_batchnorm=True``."""
    return strategy._layer_sync


def precision_plugin_property(default: Callable[[], Any], convert: Callable[[Any], Any]) -> Any:
    """The ``precision_plugin`` property of the Trainer's strategies (``Strategy._precision_plugin``): the plugin
    the strategy was given, as ``convert`` makes it (its own plugin class for Lightning's), else ``default()``."""

    def get(strategy: TrainerStrategy) -> Any:
        plugin = strategy._precision_plugin
        return plugin if plugin is not None else default()

    def set_(strategy: TrainerStrategy, plugin: Optional[Any]) -> None:
        strategy._precision_plugin = None if plugin is None else convert(plugin)

    return property(get, set_, doc="The precision plugin (the Trainer's ``precision`` flag chooses it).")


def use_multiprocessing_launcher(strategy: TrainerDDPStrategy, launcher_class: type) -> None:
    """``Strategy._launcher``: where Lightning chose its multiprocessing launcher (``start_method`` ``"spawn"``,
    ``"fork"`` or ``"forkserver"``), put ``launcher_class`` (a subclass of it) in its place, built the same way
    (``DDPStrategy._start_method``). Call it after Lightning's ``_configure_launcher``."""
    if isinstance(strategy._launcher, _MultiProcessingLauncher):
        strategy._launcher = launcher_class(strategy, start_method=strategy._start_method)


def fabric_precision_property(base: Any, convert: Callable[[Optional[Any], str], Optional[Any]]) -> Any:
    """The ``precision`` property of Fabric's strategies whose Lightning class is ``base``: Lightning's getter, and
    ``Strategy._precision`` set to the plugin given as ``convert(plugin, strategy class name)`` makes it (``None``:
    Fabric's default)."""
    inherited = base.precision  # Lightning's property

    def set_(strategy: FabricStrategy, precision: Optional[Any]) -> None:
        strategy._precision = convert(precision, type(strategy).__name__)

    return property(inherited.fget, set_, doc="The precision plugin (Fabric's ``precision`` flag chooses it).")


def plain_optimizer(optimizer: Any) -> Any:
    """``LightningOptimizer._optimizer``: the user's optimizer inside the Trainer's wrapper (itself otherwise)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def attached_trainer(module: pl.LightningModule) -> Optional[pl.Trainer]:
    """``LightningModule._trainer``: the Trainer the module is attached to, ``None`` when none (the public
    ``module.trainer`` raises then)."""
    return module._trainer


def weight_averaging_model(callback: Any) -> Optional[Any]:
    """``WeightAveraging._average_model``: the ``AveragedModel`` the callback made in its ``setup`` for ``fit``
    (``None`` before, and outside ``fit``)."""
    return callback._average_model


def set_weight_averaging_model(callback: Any, model: Optional[Any]) -> None:
    callback._average_model = model


def take_trainer_compile(module: Optional[pl.LightningModule]) -> Optional[Callable[..., Any]]:
    """``LightningModule._compiler_ctx``: the compiler (dynamo context, with the user's options) of a
    ``trainer.fit(torch.compile(model))``, which Lightning's ``from_compiled`` applied to the module's ``forward``
    and step methods; taken off here (Lightning's ``to_uncompiled``: the module's own methods again). ``None`` when
    the module was not given compiled."""
    context = getattr(module, "_compiler_ctx", None) if module is not None else None
    if module is None or context is None:
        return None
    to_uncompiled(module)
    return context["dynamo_ctx"]


#: The methods of Fabric that take a ``torch.compile`` off a model and compile what the strategy returns again.
_FABRIC_SETUPS = (Fabric.setup.__code__, Fabric.setup_module.__code__)


def fabric_compile_options() -> Optional[dict[str, Any]]:
    """The options of the ``torch.compile`` that ``fabric.setup`` / ``fabric.setup_module`` (the caller of the
    strategy's ``setup_module``) took off the model: its local ``compile_kwargs``, ``None`` when the model was not
    compiled or Fabric was told not to re-apply it (``_reapply_compile=False``). Fabric compiles the module the
    strategy returns with them afterwards, and passes them nowhere else; read-only."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _FABRIC_SETUPS:
            options = frame.f_locals.get("compile_kwargs")
            return dict(options) if isinstance(options, dict) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None
