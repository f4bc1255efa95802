"""The checkpoint service of a sharded model: the one place where the Trainer's and Fabric's strategies save and load
it, each naming its file layout.

A strategy passes plain values, nothing that calls back into it:

* the model, as a :class:`~lightning_fairscale.fsdp.state.saving.ShardedModel` (the engine's
  :class:`~lightning_fairscale.fsdp.model.WrappedModel` calls in with its own, after settling the units);
* where the files go, as :class:`Files`: this rank (:class:`~lightning_fairscale.fsdp.state.saving.Ranks`), the
  storage of the CheckpointIO plugin, and the background writer of a plugin that saves in the background;
* its file layout: :class:`TrainerLayout` (Lightning's checkpoint dict, ``"state_dict"`` and ``"optimizer_states"``;
  a Fabric checkpoint read into it, a Lightning 1.x one's optimizer states adopted as its policy says) or
  :class:`FabricLayout` (the keys of ``fabric.save``'s state, :mod:`lightning_fairscale.checkpoint.fabric`).

:func:`save` writes the sharded format (a directory of one shard per rank, gathering nothing: see
:func:`~lightning_fairscale.fsdp.state.saving.save_sharded`); :func:`load` reads either format into this rank's
shards, the Trainer's full file too (Fabric's full files are read by its strategy, which loads the model and the
optimizers through the engine: they may be modules it did not set up). Every write is atomic, and stays on the
writer's thread in the background where the plugin saves there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_fairscale.checkpoint.checks import (
    RELAX_FABRIC,
    RELAX_TRAINER,
    resumable_optimizer_states,
    restores_optimizer_states,
)
from lightning_fairscale.checkpoint.fabric import (
    Roles,
    convert,
    is_trainer_layout,
    optimizer_positions,
    restore,
    to_trainer_layout,
)
from lightning_fairscale.checkpoint.files import ShardedStorage
from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy
from lightning_fairscale.fsdp.state.averaging import shard_state
from lightning_fairscale.fsdp.state.saving import (
    InBackground,
    Ranks,
    ShardedModel,
    expected_shapes,
    filtered_local_state,
    is_sharded_checkpoint,
    load_full,
    load_sharded,
    module_state_dict,
    save_sharded,
)
from lightning_fairscale.fsdp.state.sharded_checkpoint import CURRENT_MODEL_STATE, FORMAT_KEY
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrapped

__all__ = ["FabricLayout", "Files", "Layout", "TrainerLayout", "load", "save"]


@dataclass(frozen=True)
class Files:
    """Where a checkpoint's files are: this rank among the strategy's, the storage (the CheckpointIO plugin's: see
    :func:`~lightning_fairscale.plugins.checkpoint_io.sharded_storage`), and for a save in the background its writer's
    thread (``None``: written before :func:`save` returns)."""

    ranks: Ranks
    storage: ShardedStorage
    background: Optional[InBackground] = None


@dataclass(frozen=True)
class TrainerLayout:
    """The Trainer's checkpoint dict (``"state_dict"``, ``"optimizer_states"``, loops, callbacks...).

    Loading, a Fabric checkpoint is read into it (``version``: the running Lightning's, recorded in it; see
    :func:`~lightning_fairscale.checkpoint.fabric.to_trainer_layout`) and Lightning 1.x's optimizer states are adopted
    as ``lightning_1x`` says (:mod:`lightning_fairscale.checkpoint.legacy`; ``owner`` names the strategy in its
    messages). With ``averaging`` (Lightning's ``WeightAveraging`` averages this rank's shards), what :func:`load`
    returns holds both weights as this rank's slices (see :func:`_load_trainer`).
    """

    version: str
    owner: str
    lightning_1x: OptimizerStatePolicy = "error"
    averaging: bool = False


@dataclass(frozen=True)
class FabricLayout:
    """``fabric.save``'s state: which of its keys hold the model, the optimizers and the LR schedulers (``roles``),
    and ``fabric.save``'s ``filter`` (see :mod:`lightning_fairscale.checkpoint.fabric`)."""

    roles: Roles
    filter: Optional[Mapping[str, Callable[[str, Any], bool]]] = None


#: A strategy's file layout.
Layout = Union[TrainerLayout, FabricLayout]


def save(
    model: ShardedModel, files: Files, path: Any, content: dict[str, Any], layout: Layout,
    optimizers: Sequence[Optimizer] = (),
) -> None:
    """Write the sharded checkpoint directory ``path`` (a collective call; atomic: a failure anywhere leaves the
    previous checkpoint as it was).

    Args:
        model: the sharded model.
        files: where, and whether in the background.
        path: the checkpoint directory.
        content: in the Trainer's layout, Lightning's checkpoint dict, whose model and optimizer states are this
            rank's shards (the engine's ``state_dict(sharded=True)`` and ``optimizer_state(..., sharded=True)``); in
            Fabric's, ``fabric.save``'s state (its objects: their states are taken here).
        layout: the strategy's file layout.
        optimizers: in the Trainer's layout, the optimizers whose states ``content`` holds, in its order (Fabric's
            are the state's).
    """
    record = None
    if isinstance(layout, FabricLayout):
        state = content
        content, roles = _fabric_content(model, files.ranks, state, layout)
        optimizers, record = [state[key] for key in roles.optimizers], roles.record()
    save_sharded(files.ranks, files.storage, content, path, model, optimizers, record, files.background)


def load(
    model: ShardedModel, files: Files, path: Any, layout: Layout, strict: bool, weights_only: Optional[bool],
    state: Optional[dict[str, Any]] = None, optimizers: Sequence[Optimizer] = (),
    read_file: Optional[Callable[[], dict[str, Any]]] = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model``'s shards, reading only this rank's slices, gathering nothing; returns what
    the strategy restores itself (a collective call).

    Args:
        model: the sharded model.
        files: where the files are.
        path: the checkpoint (a sharded directory saved by any number of processes; in the Trainer's layout a full
            file too, which ``read_file`` reads with the strategy's CheckpointIO plugin).
        layout: the strategy's file layout.
        strict: whether missing and unexpected keys are errors (``LightningModule.strict_loading``, ``fabric.load``'s
            ``strict``).
        weights_only: passed to ``torch.load``.
        state: in Fabric's layout, ``fabric.load``'s state: restored in place; the rest of the checkpoint returned.
        optimizers: in the Trainer's layout, the optimizers to restore (none outside ``fit``); the rest of the
            checkpoint (loops, callbacks, LR schedulers) returned for Lightning to restore.
        read_file: in the Trainer's layout, reads the full file.
    """
    if isinstance(layout, FabricLayout):
        assert state is not None
        return _load_fabric(model, files, path, layout.roles, state, strict, weights_only)
    assert read_file is not None
    return _load_trainer(model, files, path, layout, read_file, optimizers, strict, weights_only)


# ----------------------------------------------------------------------------------------------------------------
# Fabric's layout


def _fabric_content(
    model: ShardedModel, ranks: Ranks, state: dict[str, Any], layout: FabricLayout
) -> tuple[dict[str, Any], Roles]:
    """What a sharded ``fabric.save`` writes of ``state``: this rank's shards of the model (what the filter keeps of
    it, by the unwrapped module's names, recorded with the checkpoint) and of each optimizer, every other entry as
    :func:`~lightning_fairscale.checkpoint.fabric.convert` makes it; and the roles as saved (an optimizer the filter
    keeps none of is left out). An optimizer's sharded state is laid out over the views of every parameter: kept
    whole or left out, alike on every rank."""
    roles = replace(layout.roles, optimizers=list(layout.roles.optimizers))
    filter = dict(layout.filter or {})
    states: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if key == roles.model:
            if key in filter:
                states[key], kept = filtered_local_state(model.root, list(expected_shapes(model)), filter[key])
                roles = replace(roles, kept=kept)
            else:
                states[key] = module_state_dict(model.root, sharded=True, is_global_zero=ranks.is_global_zero)
        elif key in roles.optimizers:
            model.order(value)  # set up with this model, or an error (on every rank alike)
            states[key] = value.state_dict()  # this rank's state over its views, as it is
    others = {key: keep for key, keep in filter.items() if key != roles.model}
    converted = convert(state, roles, states, others)
    for key in [key for key in roles.optimizers if key in filter]:
        # Decided on every rank alike (a filter may look at this rank's values): a rank alone must not raise.
        kept_items = sorted(converted.get(key, {}))
        whole = kept_items == sorted(states[key])
        if ranks.agree(not kept_items):  # the filter kept none of it anywhere: left out, as Fabric leaves it out
            roles.optimizers.remove(key)
        elif not ranks.agree(whole):
            raise ValueError(
                f"`fabric.save(..., filter=...)` keeps part of the optimizer state {key!r} (here {kept_items}), but a"
                " sharded optimizer state is kept whole or not at all, and alike on every rank. Keep all of it or"
                " none, or save a full checkpoint."
            )
    return converted, roles


def _load_fabric(
    model: ShardedModel, files: Files, path: Any, roles: Roles, state: dict[str, Any], strict: bool,
    weights_only: Optional[bool],
) -> dict[str, Any]:
    """``fabric.load`` of a sharded checkpoint (Fabric's or the Trainer's): the model and the optimizers of ``state``
    from the shards, its other entries from the meta dict; returns what ``state`` did not ask for."""

    def restored(meta: dict[str, Any], saved: int) -> list[tuple[int, Optimizer]]:
        positions = optimizer_positions(meta, roles, saved, strict)
        return [(position, state[key]) for position, key in positions]

    meta, _ = load_sharded(files.ranks, files.storage, path, model, restored, weights_only, strict, RELAX_FABRIC)
    return restore(meta, state, roles, strict, loaded=True).rest


# ----------------------------------------------------------------------------------------------------------------
# The Trainer's layout (and Lightning 1.x's files)


def _load_trainer(
    model: ShardedModel, files: Files, path: Any, layout: TrainerLayout, read_file: Callable[[], dict[str, Any]],
    optimizers: Sequence[Optimizer], strict: bool, weights_only: Optional[bool],
) -> dict[str, Any]:
    """The Trainer's ``load_checkpoint``: a checkpoint of either format loaded into the shards and ``optimizers``;
    returns the rest of it (loops, callbacks, LR schedulers) for Lightning to restore.

    With ``layout.averaging`` (Lightning's ``WeightAveraging`` averages this rank's shards: see
    :mod:`~lightning_fairscale.fsdp.state.averaging`), the model ends with the checkpoint's
    :data:`~lightning_fairscale.fsdp.state.sharded_checkpoint.CURRENT_MODEL_STATE` where it has one (its ``state_dict``
    is then the averaged weights), and the returned checkpoint holds both as this rank's slices
    (:func:`~lightning_fairscale.fsdp.state.averaging.shard_state`): the averaged (or only) weights under
    ``state_dict``, the model's own under ``CURRENT_MODEL_STATE``, for the callback to load as it does under unsharded
    training.
    """
    ranks, storage, averaging = files.ranks, files.storage, layout.averaging
    if is_sharded_checkpoint(storage, path):

        def restored(meta: dict[str, Any], saved: int) -> list[tuple[int, Optimizer]]:
            if not optimizers or not restores_optimizer_states(saved, len(optimizers), rank_zero_warn):
                return []
            return list(enumerate(optimizers))

        has_current = averaging and CURRENT_MODEL_STATE in storage.load_meta(path, weights_only=weights_only).get(
            FORMAT_KEY, {}
        ).get("model_states", ())
        meta, _ = load_sharded(ranks, storage, path, model, restored, weights_only, strict, RELAX_TRAINER)
        if averaging:
            meta["state_dict"] = shard_state(unwrapped(model.root))
        if has_current:
            load_sharded(ranks, storage, path, model, lambda *_: [], weights_only, strict, RELAX_TRAINER,
                         key=CURRENT_MODEL_STATE)
            meta[CURRENT_MODEL_STATE] = shard_state(unwrapped(model.root), persistent_only=True)
        return meta if is_trainer_layout(meta) else to_trainer_layout(meta, layout.version, model_keys=None)
    checkpoint = read_file()
    if not is_trainer_layout(checkpoint):
        checkpoint = to_trainer_layout(checkpoint, layout.version, list(expected_shapes(model)))
    states = _resumable_states(model, checkpoint, optimizers, layout)
    load_full(model, checkpoint.pop("state_dict"), strict, list(zip(optimizers, states)), RELAX_TRAINER)
    checkpoint.pop("optimizer_states", None)
    if averaging:
        current = checkpoint.pop(CURRENT_MODEL_STATE, None)
        checkpoint["state_dict"] = shard_state(unwrapped(model.root))
        if current is not None:
            load_full(model, current, strict, (), RELAX_TRAINER)
            checkpoint[CURRENT_MODEL_STATE] = shard_state(unwrapped(model.root), persistent_only=True)
    return checkpoint


def _resumable_states(
    model: ShardedModel, checkpoint: dict[str, Any], optimizers: Sequence[Optimizer], layout: TrainerLayout
) -> list[dict[str, Any]]:
    """The optimizer states of a full checkpoint (the Trainer's ``optimizer_states``) in the layout of plain
    optimizers over the unwrapped module; Lightning 1.x's are adopted as ``layout.lightning_1x`` says (see
    :mod:`lightning_fairscale.checkpoint.legacy`)."""
    if not optimizers:
        return []
    managed = model.layout.managed
    # The pieces' shapes: what a plain optimizer over the unwrapped module holds (Lightning 1.x's differ).
    shapes = [[[managed[m].pieces[k].shape for m, k in group] for group in model.order(opt)] for opt in optimizers]
    return resumable_optimizer_states(checkpoint, optimizers, shapes, layout.lightning_1x, layout.owner, rank_zero_warn)
