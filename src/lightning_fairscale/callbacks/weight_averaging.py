"""Lightning's ``WeightAveraging`` (and ``EMAWeightAveraging``) under ``DDPFullyShardedStrategy``: on the shards.

The callback makes its ``AveragedModel`` in ``setup``, before the strategy shards the module: a deep copy with the
full shapes, which ``update_parameters`` cannot pair with the sharded module's parameters (this rank's slices of
the flat shards). Once the module is sharded, the strategy gives each such callback an average over this rank's
shards instead (:class:`~lightning_fairscale.fsdp.state.averaging.ShardAveragedModel`, with the same ``avg_fn``,
``multi_avg_fn``, ``use_buffers`` and device), and the full copy is freed. Everything else is the callback's own
code, unchanged: it updates the average after each step, swaps it in for validation and back, copies it into the
module at the end of ``fit``, and saves it in checkpoints as under ``"ddp"`` (the averaged weights under
``state_dict``, the module's own under ``current_model_state``, ``n_averaged`` under ``averaging_state``): the
averaged model's state dict is the strategy's, full or sharded, taken with the average swapped in.

A checkpoint is loaded by the strategy before the callback's ``on_load_checkpoint`` runs (into the shards, without
gathering): the checkpoint the callback then gets holds both states as this rank's slices by the unwrapped module's
names, which it loads as it would under ``"ddp"``.

The average stays the callback's while the module stays sharded (``validate`` or ``save_checkpoint`` after ``fit``
swap and save through it, as under ``"ddp"``); :func:`release` ends it when the strategy gives the
module its full parameters back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

from pytorch_lightning.callbacks import Callback
from pytorch_lightning.callbacks.weight_averaging import WeightAveraging
from pytorch_lightning.strategies import Strategy
from torch import nn

from lightning_fairscale._compat import set_weight_averaging_model, weight_averaging_model
from lightning_fairscale.fsdp.state.averaging import ShardAveragedModel
from lightning_fairscale.fsdp.unit.gathered import drop_full_params

__all__ = ["drop_stale_full_params", "release", "shard"]


def shard(
    callbacks: Iterable[Callback], strategy: Strategy, model_state: Callable[[], dict[str, Any]]
) -> list[WeightAveraging]:
    """Give each ``WeightAveraging`` callback that made an average for this ``fit`` an average over this rank's
    shards of the strategy's LightningModule (sharded already); ``model_state`` is the strategy's state dict of it,
    as it saves it. Returns the callbacks changed."""
    module, root = strategy.lightning_module, strategy.model
    assert module is not None and root is not None  # the strategy has set up the module
    changed = []
    for callback in callbacks:
        if not isinstance(callback, WeightAveraging):
            continue
        full = weight_averaging_model(callback)
        if full is None or isinstance(full, ShardAveragedModel):
            continue
        sharded = ShardAveragedModel(
            module, model_state, device=full.n_averaged.device, avg_fn=full.avg_fn, multi_avg_fn=full.multi_avg_fn,
            use_buffers=full.use_buffers, root=root,
        )  # fmt: skip
        set_weight_averaging_model(callback, sharded)
        changed.append(callback)
    return changed


def release(callbacks: Iterable[WeightAveraging]) -> list[WeightAveraging]:
    """The module has its full parameters again: the averages over its shards have nothing left to pair with. The
    callbacks are left as after a stage other than ``fit`` (no average: validation and checkpoints then use the
    module's weights, which ``fit`` ended with the averaged ones). Returns no callbacks (none is changed now)."""
    for callback in callbacks:
        if isinstance(weight_averaging_model(callback), ShardAveragedModel):
            set_weight_averaging_model(callback, None)
    return []


def drop_stale_full_params(callbacks: list[WeightAveraging], root: Optional[nn.Module]) -> None:
    """At the end of validation, after ``WeightAveraging`` swapped the module's own weights back into the shards: no
    unit of ``root`` may keep the average it gathered for validation (workaround 27, see
    :func:`~lightning_fairscale.fsdp.unit.gathered.drop_full_params`). Training frees every unit's full parameters in
    its backward, so validation starts gathering from the shards."""
    if callbacks and root is not None:
        drop_full_params(root)
