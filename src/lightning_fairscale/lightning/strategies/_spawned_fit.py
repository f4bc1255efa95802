# Generated from lightning_fairscale/strategies/_spawned_fit.py by `make lightning`: do not edit.
"""The end of a spawned ``fit`` (``DDPSpawnShardedStrategy``, or ``DDPShardedStrategy`` with ``start_method="spawn"``
or ``"fork"``): rank 0's training state, brought back to the launching process for ``trainer.save_checkpoint`` there.

Lightning's launcher brings the weights and the callback metrics back to the launching process, whose Trainer never
trained; :class:`SpawnLauncher` also brings :class:`EndOfFit`, what :func:`end_of_fit_state` gathers on rank 0 at the
end of ``fit``: every entry of a checkpoint but the module's own. Kept apart so that the strategy's class holds its
hooks (`make lightning` copies this module for the unified package too).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning_fairscale.lightning._compat import _MultiProcessingLauncher
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

__all__ = ["EndOfFit", "SpawnLauncher", "end_of_fit_state", "writes_optimizer_states"]

#: Lightning's loops, whose states a checkpoint holds under ``"loops"``.
_LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")
#: The entries that say how far training got: every checkpoint has them, ``weights_only`` ones too.
_PROGRESS = ("epoch", "global_step", "loops")
#: The launcher's extra result that names the folder of the end-of-fit state, and the file in it.
_END_OF_FIT, _END_OF_FIT_FILE = "lightning_fairscale_end_of_fit", "end-of-fit.pt"


def writes_optimizer_states(trainer: pl.Trainer) -> bool:
    """Whether the run writes checkpoints with the optimizer state: it has a checkpoint callback without
    ``save_weights_only`` (Lightning's default ``ModelCheckpoint`` is one)."""
    return any(not getattr(callback, "save_weights_only", False) for callback in trainer.checkpoint_callbacks)


def end_of_fit_state(strategy: Strategy, trainer: pl.Trainer) -> Optional[EndOfFit]:
    """Rank 0's training state (``None`` on the other ranks): every entry of a checkpoint but the module's own.

    The optimizer and LR scheduler states only when the run writes checkpoints that hold them: gathering the
    sharded optimizer state on rank 0 (a collective call, the ``strategy``'s ``optimizer_state``) is what each of those
    checkpoints does anyway.
    """
    gather = writes_optimizer_states(trainer)
    optimizer_states = [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers] if gather else []
    if not strategy.is_global_zero:
        return None
    # Set on the Trainer by Lightning's connectors, not declared on its class.
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    datamodule: Optional[pl.LightningDataModule] = trainer.datamodule  # type: ignore[attr-defined]
    entries: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "loops": {name: getattr(trainer, name).state_dict() for name in _LOOPS},
        "callbacks": {cb.state_key: state for cb in callbacks if (state := cb.state_dict())},
        "optimizer_states": optimizer_states,
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs if gather],
    }
    for owner in (trainer.precision_plugin, datamodule):  # Lightning keys their states by class name
        owner_state = owner.state_dict() if owner is not None else None
        if owner_state:
            entries[type(owner).__qualname__] = owner_state
    return EndOfFit(entries, optimizer_state_left_out=bool(trainer.optimizers) and not gather)


@dataclass
class EndOfFit:
    """Rank 0's training state at the end of a spawned ``fit``, for the checkpoints of the launching process."""

    #: Checkpoint entries, as ``trainer.save_checkpoint`` on rank 0 would have written them then, but the module's.
    entries: dict[str, Any]
    #: Whether the run had optimizers whose state was not gathered (it wrote no checkpoints that hold it).
    optimizer_state_left_out: bool

    def complete(self, checkpoint: dict[str, Any], strategy: str) -> dict[str, Any]:
        """``checkpoint``, of the launching process, with this training state; the module's own entries (weights,
        hyperparameters, what its ``on_save_checkpoint`` added) stay the launching process's."""
        if "optimizer_states" not in checkpoint:  # `weights_only=True`
            return {**checkpoint, **{key: self.entries[key] for key in _PROGRESS}}
        if self.optimizer_state_left_out:
            rank_zero_warn(
                f"This checkpoint, saved in the process that launched `fit` with `{strategy}`, holds the weights and"
                " the training progress but no optimizer state: the run wrote no checkpoints with optimizer state (no"
                " `ModelCheckpoint`, or `save_weights_only=True`), so its ranks did not gather their shards of it at"
                " the end of `fit`. Resuming from this checkpoint continues with a fresh optimizer state and fresh LR"
                " schedulers. For a complete checkpoint here, keep Lightning's checkpointing on"
                " (`enable_checkpointing=True`, the default), or resume from a checkpoint written during the run."
            )
        callbacks = {**checkpoint.get("callbacks", {}), **self.entries["callbacks"]}
        return {**checkpoint, **self.entries, "callbacks": callbacks}


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for processes started by ``torch.multiprocessing``, which also brings rank 0's training
    state at the end of ``fit`` (:class:`EndOfFit`) back to the launching process."""

    def __init__(
        self, strategy: ParallelStrategy, start_method: Literal["spawn", "fork", "forkserver"] = "spawn"
    ) -> None:
        super().__init__(strategy, start_method=start_method)
        #: Rank 0's state at the end of ``fit``: set there by the strategy, then here in the launching process.
        self.end_of_fit: Optional[EndOfFit] = None

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's extra results (on rank 0), and the folder of a file with the end-of-fit state."""
        extra = super().get_extra_results(trainer)
        if self.end_of_fit is not None:
            # Through a file, as Lightning sends the weights: no pickled copy of the optimizer state in memory.
            folder = tempfile.mkdtemp()
            torch.save(self.end_of_fit, os.path.join(folder, _END_OF_FIT_FILE))
            extra[_END_OF_FIT] = folder
        return extra

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """Lightning's (the callback metrics), and the end-of-fit state (in the launching process)."""
        super().update_main_process_results(trainer, extra)
        folder = extra.get(_END_OF_FIT)
        if folder is not None:
            try:
                path = os.path.join(folder, _END_OF_FIT_FILE)
                self.end_of_fit = torch.load(path, map_location="cpu", weights_only=False)  # written by rank 0 above
            finally:
                shutil.rmtree(folder, ignore_errors=True)

    @override
    def __getstate__(self) -> dict[str, Any]:
        # The processes started later (`validate` or `test` after `fit`) neither need it nor may write it.
        return {**super().__getstate__(), "end_of_fit": None}
