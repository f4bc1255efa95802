"""The checkpointer: every checkpoint the package saves or loads goes through one of this module's functions.

=======================  ==========================================================================================
:func:`save_full`        one file, written by rank 0: the Trainer's checkpoint dict, or ``fabric.save``'s state
                         (with a :class:`FabricLayout`), under either FSDP or sharded DDP
:func:`save_sharded`     the sharded format: a directory of one shard per rank, gathering nothing
:func:`load`             a checkpoint of either format into a sharded model's shards, reading only this rank's
                         slices (a Fabric file into the Trainer's layout, Lightning 1.x's optimizer states adopted)
:func:`read_full`        a full file read whole (the Trainer's strategies when no model is sharded)
:func:`read_fabric`      ``fabric.load`` of a full file: the state restored, the model's and optimizers' returned
:func:`consolidate`      a sharded directory to one full file, offline (``lightning-fairscale-consolidate``)
:func:`export`           any checkpoint to safetensors (``lightning-fairscale-consolidate --format safetensors``)
:func:`convert_1x`       a Lightning 1.x FSDP file without its incomplete optimizer state
                         (``lightning-fairscale-convert-1x``)
=======================  ==========================================================================================

Its arguments are plain values, nothing that calls back into a strategy: the sharded model
(:class:`~lightning_fairscale.fsdp.state.saving.ShardedModel`, which ``WrappedModel.settled()`` gives once the units
are settled), states and paths, and :class:`Files`: this rank, the sharded storage, the full files (the
CheckpointIO plugin, as :class:`FullFiles`) and the background writer. Every write is atomic (with
:class:`~lightning_fairscale.ShardedCheckpointIO`: :mod:`lightning_fairscale.checkpoint.files`); before every save the
background writes that failed so far, and before every load all of them, are settled on every rank together
(:func:`~lightning_fairscale.checkpoint.background.settle`).

No Lightning import: the adapters of both Lightning packages and the command-line tools call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale.checkpoint.background import BackgroundWriter, settle
from lightning_fairscale.checkpoint.checks import (
    RELAX_FABRIC,
    RELAX_TRAINER,
    resumable_optimizer_states,
    restores_optimizer_states,
)
from lightning_fairscale.checkpoint.fabric import (
    Restored,
    Roles,
    convert,
    is_trainer_layout,
    model_state_of,
    optimizer_positions,
    restore,
    to_trainer_layout,
)
from lightning_fairscale.checkpoint.files import ShardedStorage, read_file, write_atomically
from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy, convert_checkpoint
from lightning_fairscale.fsdp.state import export as _export, sharded_checkpoint
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
)
from lightning_fairscale.fsdp.state import saving
from lightning_fairscale.fsdp.state.sharded_checkpoint import CURRENT_MODEL_STATE, FORMAT_KEY
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrapped

__all__ = [
    "FabricLayout", "Files", "FullFiles", "Layout", "TrainerLayout", "consolidate", "convert_1x", "export", "load",
    "read_fabric", "read_full", "save_full", "save_sharded",
]  # fmt: skip


class FullFiles(Protocol):
    """How full checkpoint files are written and read: the strategy's CheckpointIO plugin, as
    :func:`~lightning_fairscale.plugins.checkpoint_io.checkpoint_files` wraps it."""

    def write(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any]) -> None:
        """Rank 0: write ``checkpoint`` to the file ``path`` (atomically; in the background where the plugin saves
        there)."""

    def read(self, path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
        """Read the file ``path`` (memory-mapped), or the meta dict of a sharded directory."""


@dataclass(frozen=True)
class Files:
    """Where a checkpoint's files are: this rank among the strategy's, the sharded storage, the full files, and the
    CheckpointIO plugin's background writer (``None``: it writes as it is called), on which rank 0 waits for the
    other ranks' shards at most ``timeout`` seconds (the strategy's collective timeout)."""

    ranks: Ranks
    storage: ShardedStorage
    full: Optional[FullFiles] = None
    writer: Optional[BackgroundWriter] = None
    timeout: float = 1800.0


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


def _settle(files: Files, wait: bool) -> None:
    """Before a save (``wait=False``: the background writes failed so far) or a load (``wait=True``: all of them
    done), every rank together: the plugin's background writes succeeded everywhere. Nothing, and no collective, for a
    plugin that writes as it is called."""
    if files.writer is not None:
        settle(files.writer, files.ranks.agree, wait=wait)


# ----------------------------------------------------------------------------------------------------------------
# Saving


def save_full(
    files: Files, path: Any, content: dict[str, Any], storage_options: Optional[Any] = None,
    fabric: Optional[tuple[FabricLayout, dict[str, dict[str, Any]]]] = None,
) -> None:
    """Write a full checkpoint file (a call of every rank: rank 0 writes, after the failed background writes are
    agreed everywhere).

    Args:
        files: where; ``files.full`` writes the file.
        path: the file.
        content: the Trainer's checkpoint dict; with ``fabric``, ``fabric.save``'s state.
        storage_options: passed to the plugin.
        fabric: Fabric's layout and the full states of the state's model and optimizers (by key; what the strategy
            gathered, collectively), which replace them in the file
            (:func:`~lightning_fairscale.checkpoint.fabric.convert`).
    """
    _settle(files, wait=False)
    if fabric is not None:
        layout, states = fabric
        content = convert(content, layout.roles, states, layout.filter)
    if files.ranks.is_global_zero:
        assert files.full is not None
        files.full.write(content, path, storage_options)


def save_sharded(
    model: ShardedModel, files: Files, path: Any, content: dict[str, Any], layout: Layout,
    optimizers: Sequence[Optimizer] = (),
) -> None:
    """Write the sharded checkpoint directory ``path`` (a collective call; atomic: a failure anywhere leaves the
    previous checkpoint as it was; see :func:`~lightning_fairscale.fsdp.state.saving.save_sharded`).

    Args:
        model: the sharded model.
        files: where, and whether in the background (``files.writer``).
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
    background = None if files.writer is None else InBackground(files.writer, files.timeout)
    saving.save_sharded(files.ranks, files.storage, content, path, model, optimizers, record, background)


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


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load(
    model: ShardedModel, files: Files, path: Any, layout: Layout, strict: bool, weights_only: Optional[bool],
    state: Optional[dict[str, Any]] = None, optimizers: Sequence[Optimizer] = (),
) -> dict[str, Any]:
    """Load a checkpoint into ``model``'s shards, reading only this rank's slices, gathering nothing; returns what
    the strategy restores itself (a collective call, after every background write is done everywhere).

    Args:
        model: the sharded model.
        files: where the files are.
        path: the checkpoint (a sharded directory saved by any number of processes; in the Trainer's layout a full
            file too, read with ``files.full``).
        layout: the strategy's file layout.
        strict: whether missing and unexpected keys are errors (``LightningModule.strict_loading``, ``fabric.load``'s
            ``strict``).
        weights_only: passed to ``torch.load``.
        state: in Fabric's layout, ``fabric.load``'s state: restored in place; the rest of the checkpoint returned.
        optimizers: in the Trainer's layout, the optimizers to restore (none outside ``fit``); the rest of the
            checkpoint (loops, callbacks, LR schedulers) returned for Lightning to restore.
    """
    _settle(files, wait=True)
    if isinstance(layout, FabricLayout):
        assert state is not None
        return _load_fabric(model, files, path, layout.roles, state, strict, weights_only)
    return _load_trainer(model, files, path, layout, optimizers, strict, weights_only)


def read_full(
    files: Files, path: Any, weights_only: Optional[bool], trainer: Optional[tuple[str, list[str]]] = None
) -> dict[str, Any]:
    """A full checkpoint file read whole (a collective call, after every background write is done everywhere);
    with ``trainer`` (the running Lightning's version and the LightningModule's state dict keys), a Fabric file is
    read in the Trainer's layout (:func:`~lightning_fairscale.checkpoint.fabric.to_trainer_layout`)."""
    _settle(files, wait=True)
    assert files.full is not None
    checkpoint = files.full.read(path, weights_only)
    if trainer is None or is_trainer_layout(checkpoint):
        return checkpoint
    return to_trainer_layout(checkpoint, trainer[0], trainer[1])


def read_fabric(
    files: Files, path: Any, state: Optional[Union[Module, Optimizer, dict[str, Any]]], roles: Optional[Roles],
    model_keys: Optional[list[str]], strict: bool, weights_only: Optional[bool],
) -> Restored:
    """``fabric.load`` of a full file (Fabric's or the Trainer's; a collective call, after every background write is
    done everywhere): the state's other entries restored in place; the model's and the optimizers' states returned
    with their objects, for the strategy to load (they may be objects it did not set up; see
    :func:`~lightning_fairscale.checkpoint.fabric.restore`).

    Args:
        files: where the files are.
        path: the file.
        state: ``fabric.load``'s state; ``None`` or empty: the whole file is returned. A module or an optimizer
            (``fabric.load_raw``): the file is its state (a module's: the model's entry of a checkpoint, in either
            layout, or the file itself).
        roles: the roles of a dict ``state`` (:meth:`~lightning_fairscale.checkpoint.fabric.Roles.of`).
        model_keys: the keys of a module ``state``'s state dict (unwrapped), known without gathering anything.
        strict: ``fabric.load``'s ``strict``.
        weights_only: passed to ``torch.load``.
    """
    file = read_full(files, path, weights_only)
    if not state:
        return Restored(file, [])
    if isinstance(state, Module):  # `fabric.load_raw`: a module's state dict
        assert model_keys is not None
        return Restored({}, [(state, dict(model_state_of(file, model_keys)))])
    if isinstance(state, Optimizer):  # `fabric.load_raw`: a plain optimizer's state
        return Restored({}, [(state, file)])
    assert roles is not None
    return restore(file, state, roles, strict)


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


def _load_trainer(
    model: ShardedModel, files: Files, path: Any, layout: TrainerLayout, optimizers: Sequence[Optimizer], strict: bool,
    weights_only: Optional[bool],
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
    assert files.full is not None
    checkpoint = files.full.read(path, weights_only)
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


# ----------------------------------------------------------------------------------------------------------------
# Offline: one process, no process group


def consolidate(source: Any, output: Path, progress: Optional[Callable[[str], None]] = None) -> None:
    """Write the full checkpoint equivalent to the sharded checkpoint directory ``source`` to the file ``output``,
    atomically (see :func:`~lightning_fairscale.fsdp.state.sharded_checkpoint.consolidate`)."""
    checkpoint = sharded_checkpoint.consolidate(source, progress=progress)
    if progress is not None:
        progress(f"writing {output}")
    write_atomically(checkpoint, Path(output))


def export(source: Union[str, Path], output: Union[str, Path], **options: Any) -> _export.ExportReport:
    """Write the model of the checkpoint ``source`` into the folder ``output`` as safetensors (see
    :func:`~lightning_fairscale.fsdp.state.export.export_safetensors`, which takes ``options``)."""
    return _export.export_safetensors(source, output, **options)


def convert_1x(source: Path, output: Path) -> tuple[dict[str, Any], list[str]]:
    """Write a copy of the Lightning 1.x checkpoint file ``source`` without its incomplete optimizer state to
    ``output``, atomically (see :func:`~lightning_fairscale.checkpoint.legacy.convert_checkpoint`); returns the
    source checkpoint and what was dropped. The file is unpickled in full (1.x files hold pickled paths)."""
    checkpoint = read_file(source, weights_only=False)
    converted, report = convert_checkpoint(checkpoint)
    write_atomically(converted, output)
    return checkpoint, report
