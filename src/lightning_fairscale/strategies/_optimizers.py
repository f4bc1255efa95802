"""The Trainer FSDP strategy's optimizers at each stage, as plain functions over Lightning's ``Strategy`` (its public
``setup_optimizers``, ``optimizers`` and ``lightning_module``) and the engine's sharded model.

``configure_optimizers`` runs on the unsharded module before wrapping where it can (auto wrap); where the module is
sharded already (layers wrapped by hand in ``configure_model``, a stage after another), it runs on the sharded
module while its parameters show their unsharded shapes (:mod:`lightning_fairscale.fsdp.state.unsharded_shapes`), and
the optimizers are re-pointed to the shards after. A stage that does not train keeps only the optimizers of its own
module: a new module after ``fit`` gets none of the fit's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch.optim import Optimizer

import pytorch_lightning as pl
from lightning_fairscale._compat import plain_optimizer
from pytorch_lightning.strategies import Strategy
from pytorch_lightning.trainer.states import TrainerFn

from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.model import WrappedModel

__all__ = ["abort_steps", "configure_on_sharded", "for_sharded_stage", "kept_of", "plain", "restored"]


def plain(optimizers: Iterable[Any]) -> list[Optimizer]:
    """The optimizers without Lightning's ``LightningOptimizer`` around them."""
    return [plain_optimizer(optimizer) for optimizer in optimizers]


def configure_on_sharded(
    strategy: Strategy, trainer: pl.Trainer, sharded: WrappedModel, config: FullyShardedConfig
) -> None:
    """``configure_optimizers`` on the sharded module, whose parameters show their unsharded shapes meanwhile
    (``p.ndim >= 2`` picks the matrices), then the strategy's optimizers re-pointed to the shards (on the path that
    ``config`` chooses)."""
    with sharded.unsharded_shapes():
        strategy.setup_optimizers(trainer)
    sharded.repoint(*plain(strategy.optimizers), path=config.optimizer_path, owner=config.owner)


def kept_of(optimizers: list[Any], owns: Callable[[torch.nn.Parameter], bool]) -> list[Any]:
    """The optimizers that hold a parameter of the stage's module (``owns``); the others, an earlier stage's for
    another module, are not the stage's to re-point, save or restore."""
    held = [(o, [p for g in plain_optimizer(o).param_groups for p in g["params"]]) for o in optimizers]
    return [optimizer for optimizer, params in held if any(owns(param) for param in params)]


def for_sharded_stage(
    strategy: Strategy, trainer: pl.Trainer, fitting: bool, sharded: WrappedModel, config: FullyShardedConfig
) -> None:
    """A stage after another one (``validate`` after ``fit``...) of the still sharded module: a ``fit`` makes its
    optimizers over the parameters (the original ones, views into the shards, showing their unsharded shapes
    meanwhile); another stage keeps the module's own optimizers, not another module's."""
    if fitting:
        configure_on_sharded(strategy, trainer, sharded, config)
    else:
        strategy.optimizers = kept_of(strategy.optimizers, sharded.knows)


def restored(strategy: Strategy) -> bool:
    """Whether a checkpoint loaded now restores the strategy's optimizers (a ``fit`` that has some)."""
    module = strategy.lightning_module
    trainer = module.trainer if module is not None else None
    return bool(strategy.optimizers) and trainer is not None and trainer.state.fn == TrainerFn.FITTING


def abort_steps(sharded: Optional[WrappedModel]) -> None:
    """After an exception: a whole-path optimizer step under way ends (the other ranks told, so that they raise
    instead of waiting), and no parameter stays whole (see :meth:`WrappedModel.abort_steps`)."""
    if sharded is not None:
        sharded.abort_steps()
