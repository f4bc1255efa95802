"""Saving and loading a sharded model, in both checkpoint formats, on every rank together.

A **full** checkpoint holds the unwrapped module's state dict, gathered unit by unit on rank 0
(:func:`module_state_dict`); it loads into this rank's shards reading only their slices (:func:`load_full`). A
**sharded** checkpoint is a directory of one shard per rank (:func:`save_sharded`), saved by any number of processes
and loaded by any other (:func:`load_sharded`), gathering nothing. Every phase of a sharded save or load ends with
an agreement of all ranks (:func:`together`): a failure on one rank fails every rank, and the previous checkpoint
stays as it was. The files themselves are a :class:`~lightning_fairscale.checkpoint.files.ShardedStorage`'s.

Everything here takes plain values: the sharded model as a :class:`ShardedModel` (its root unit, where its
parameters went, the order of each optimizer's state), this rank as :class:`Ranks`, the files as a
:class:`~lightning_fairscale.checkpoint.files.ShardedStorage`. The checkpointer
(:mod:`lightning_fairscale.checkpointer`) calls these for the Trainer's and Fabric's file layouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from torch.optim import Optimizer

from lightning_fairscale.checkpoint.checks import (
    RELAX_FABRIC,
    IncompatibleKeys,
    check_state_dict_fits,
    report_partial_load,
)
from lightning_fairscale.checkpoint.background import BackgroundWriter, settle, snapshot
from lightning_fairscale.checkpoint.files import ShardedStorage
from lightning_fairscale.distributed.collectives import all_agree, all_gather_object
from lightning_fairscale.fsdp.state.optim import GroupOrder, ParameterLayout, managed_params
from lightning_fairscale.fsdp.state.optim_state import load_view_states, managed_positions
from lightning_fairscale.fsdp.state.whole_owners import WholePlan
from lightning_fairscale.fsdp.state.whole_state import check_saved_path, load_plain, saved_source
from lightning_fairscale.fsdp.state.resharding import SavedShards, load_full_state_dict
from lightning_fairscale.fsdp.state.sharded_checkpoint import (
    FABRIC_RECORD,
    FORMAT_KEY,
    check_fits,
    check_wrapping,
    split_checkpoint,
    wrapped_alike,
)
from lightning_fairscale.fsdp.unit.state_names import add_aliases, apply_aliases, clean_path, state_aliases
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrapped

__all__ = [
    "InBackground",
    "Ranks",
    "ShardedModel",
    "buffer_name",
    "expected_shapes",
    "filtered_local_state",
    "is_sharded_checkpoint",
    "load_full",
    "load_sharded",
    "module_state_dict",
    "save_sharded",
    "shard_writer",
    "together",
]


@dataclass(frozen=True)
class ShardedModel:
    """What a save or a load needs of a sharded model: its root unit, where each original parameter went, and the
    order of each re-pointed optimizer's state in checkpoints: plain values, which the engine's
    :class:`~lightning_fairscale.fsdp.model.WrappedModel` gives (``for_checkpoints``)."""

    root: FullyShardedDataParallel
    layout: ParameterLayout
    #: The optimizers re-pointed to the shards, and the order of each one's state (held weakly by the engine).
    orders: Mapping[Optimizer, GroupOrder]
    #: The optimizers on the whole path, and the plan of each (its owners: whose state is whose).
    whole: Mapping[Optimizer, WholePlan] = field(default_factory=dict)

    def order(self, optimizer: Optimizer) -> GroupOrder:
        """The order of ``optimizer``'s state in checkpoints.

        Raises:
            ValueError: the optimizer was not re-pointed to this model's shards.
        """
        if optimizer not in self.orders:
            raise ValueError(
                f"The {type(optimizer).__name__} was not set up with the sharded model: pass it to the strategy"
                " (`configure_optimizers`, `fabric.setup` or `fabric.setup_optimizers`) before saving or loading it."
            )
        return self.orders[optimizer]


@dataclass(frozen=True)
class Ranks:
    """This process among the strategy's, as the sharded checkpoint needs it: its global rank, and how all ranks
    agree that a phase succeeded everywhere (by default :func:`~lightning_fairscale.distributed.collectives.all_agree`
    over the default process group, which Lightning made with the strategy's ``timeout``). The strategies build one
    from their ``global_rank``.

    Example:
        >>> Ranks(global_rank=0, agree=lambda ok: ok).is_global_zero
        True
    """

    global_rank: int
    agree: Callable[[bool], bool] = all_agree

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0



def module_state_dict(root: FullyShardedDataParallel, sharded: bool, is_global_zero: bool) -> dict[str, Any]:
    """The full state dict with the unwrapped module's keys, gathered unit by unit and kept on rank 0 only; with
    ``sharded``, this rank's parameter shards (FairScale's ``local_state_dict``). A collective call."""
    if sharded:
        return root.local_state_dict()
    state_dict = root.state_dict()  # every rank gathers, rank 0 keeps
    return add_aliases(state_dict, root) if is_global_zero else state_dict


def filtered_local_state(
    root: FullyShardedDataParallel, keys: Sequence[str], keep: Callable[[str, Any], bool]
) -> tuple[dict[str, Any], list[str]]:
    """``fabric.save(..., filter=...)`` of a sharded model: ``(this rank's local state dict, the keys kept)``.

    ``keep(key, value)`` is asked about each key of the unwrapped module's state dict (``keys``), as Fabric asks it
    about a full state dict; ``value`` is the module's tensor under that name on this rank (an original parameter's
    slice of this rank's shard, or a buffer). What it keeps must be the same on every rank (a collective call; a
    ``ValueError`` on every rank otherwise). The state dict holds each flat parameter that holds a kept key (whole:
    its other keys are not loaded from it) and each kept buffer; what is kept is recorded with the checkpoint.
    """
    module = unwrapped(root)
    values = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    kept = [key for key in keys if keep(key, values.get(key))]
    if any(other != kept for other in all_gather_object(kept)):
        raise ValueError(
            "`fabric.save(..., filter=...)` kept other keys of the model on some ranks than on others: a sharded"
            " checkpoint needs the same keys from every rank. Decide by the key (and by what every rank's value shares,"
            " such as `requires_grad`), not by the values of this rank's shard."
        )
    local, metadata, wanted = root.local_state_dict(), root.local_metadata_dict(), set(kept)
    state: dict[str, Any] = {}
    for unit in metadata["param_metadata"]:
        prefix = f"{unit['fsdp_path']}." if unit["fsdp_path"] else ""
        for flat, info in unit["params"].items():
            if any(prefix + name in wanted for name in info["names"]):
                state[prefix + flat] = local[prefix + flat]
    for name in metadata["buffer_names"]:
        if name in local and buffer_name(name) in wanted:
            state[name] = local[name]
    return state, kept


def expected_shapes(model: ShardedModel) -> dict[str, Any]:
    """The keys and shapes of the unwrapped module's state dict, known without gathering anything."""
    root = model.root
    shapes: dict[str, Any] = {p.name: p.shape for m in model.layout.managed.values() for p in m.pieces}
    for path, module in root.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:  # as `state_dict` has them
                shapes[buffer_name(f"{path}.{name}" if path else name)] = buffer.shape
    return apply_aliases(shapes, state_aliases(root))


def is_sharded_checkpoint(storage: ShardedStorage, path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (one that a crash left half-replaced included)."""
    return storage.is_sharded(storage.recover(Path(str(path))))


def together(ranks: Ranks, storage: ShardedStorage, action: Callable[[], Any], path: Any, step: str) -> None:
    """Run ``action`` on every rank, then agree: if it failed anywhere, it fails everywhere, and rank 0 removes the
    unfinished sharded checkpoint, so that no rank is left waiting for another and the previous one stays as it was."""
    error: Optional[BaseException] = None
    try:
        action()
    except Exception as exception:  # reported to every rank below, then re-raised here
        error = exception
    if ranks.agree(error is None):
        return
    if ranks.is_global_zero:
        storage.abort_sharded(path)
    if error is not None:
        raise error
    raise RuntimeError(
        f"Another process failed to {step} the sharded checkpoint {path} (its error is in its log). The"
        " previous checkpoint of that name, if any, is unchanged."
    )


@dataclass(frozen=True)
class InBackground:
    """How a save runs in the background: on ``writer``'s thread (the CheckpointIO plugin's), rank 0 waiting at most
    ``timeout`` seconds for the other ranks' shards (the strategy's collective timeout)."""

    writer: BackgroundWriter
    timeout: float = 1800.0


def save_sharded(
    ranks: Ranks, storage: ShardedStorage, checkpoint: dict[str, Any], path: Any, model: ShardedModel,
    optimizers: Sequence[Optimizer], fabric: Optional[dict[str, Any]] = None,
    background: Optional[InBackground] = None,
) -> None:
    """The ranks of one replica write their shards of ``checkpoint`` (made with :func:`module_state_dict` and
    :func:`optimizer_state` with ``sharded``) into the checkpoint directory ``path``; rank 0 its meta file last.

    Without hybrid sharding that replica is every rank. Under hybrid sharding every replica holds the same shards,
    so the shard group of rank 0 writes them once (a checkpoint of ``shard_size`` shards); the other replicas write
    nothing but take part in every agreement, so that a failure anywhere fails everywhere.

    ``checkpoint`` is the Trainer's, or with ``fabric`` (the keys of the model and of the optimizers) what
    ``fabric.save`` writes (see :func:`~lightning_fairscale.fsdp.state.sharded_checkpoint.split_checkpoint`).

    With ``background``, only the staging directory is made before this returns: the previous background save has
    ended first, everywhere (:func:`~lightning_fairscale.checkpoint.background.settle`), then each rank's shard and
    the meta dict are copied (the next step changes the shards in place) and written on the writer's thread; rank
    0's thread waits for every shard file, then writes ``meta.pt`` and renames the directory into place. No
    collective runs on those threads. A failure there leaves the previous checkpoint as it was and is raised on
    every rank at the next save or load (at teardown, on the rank that failed).
    """
    if background is not None:
        settle(background.writer, ranks.agree)  # the previous save is in place (or failed) everywhere
    shard_rank, shards, writes = shard_writer(ranks, model.root)
    orders = [model.order(optimizer) for optimizer in optimizers]
    plans = [model.whole.get(optimizer) for optimizer in optimizers]
    meta, shard = split_checkpoint(checkpoint, model.root, model.layout, optimizers, orders, shards, fabric,
                                   [plan.describe() if plan is not None else {} for plan in plans])
    # Each step ends with an agreement, so that a failure on one rank (a full disk...) fails every rank with the
    # previous checkpoint untouched, instead of leaving the others waiting for it.
    zero = ranks.is_global_zero
    together(ranks, storage, lambda: storage.begin_sharded(path) if zero else None, path, "prepare")
    if background is not None:
        _save_in_background(background, storage, meta if zero else None, shard if writes else None, path, shard_rank,
                            shards)
        return
    together(ranks, storage, lambda: storage.save_shard(shard, path, shard_rank, shards) if writes else None, path,
             "write")
    together(ranks, storage, lambda: storage.commit_sharded(meta, path, shards) if zero else None, path, "complete")


def _save_in_background(
    background: InBackground, storage: ShardedStorage, meta: Optional[dict[str, Any]],
    shard: Optional[dict[str, Any]], path: Any, shard_rank: int, shards: int,
) -> None:
    """Phases 2 and 3 on the writer's thread, from copies taken here (see :func:`save_sharded`)."""
    writer = background.writer
    if shard is not None:
        shard = snapshot(shard)
        writer.submit(lambda: storage.save_shard_in_background(shard, path, shard_rank, shards))
    if meta is not None:
        meta = snapshot(meta)

        def commit() -> None:
            try:
                storage.wait_for_shards(path, shards, background.timeout, writer.cancelled)
                storage.commit_sharded(meta, path, shards)
            except BaseException:
                storage.abort_sharded(path)
                raise

        writer.submit(commit)


def shard_writer(ranks: Ranks, root: FullyShardedDataParallel) -> tuple[int, int, bool]:
    """``(shard rank, number of shards, whether this rank writes its shard)`` in a sharded checkpoint.

    The shards are those of the root unit's group: every rank without hybrid sharding, the shard group under it.
    Replica 0, the shard group of global rank 0, writes: its ranks are ``0 ... shard_size - 1``, whose shard rank is
    their global rank (see :func:`~lightning_fairscale.fsdp.patches.hybrid.hybrid_groups`).
    """
    shard_rank, shards = root.rank, root.world_size
    return shard_rank, shards, ranks.global_rank == shard_rank


def buffer_name(name: str) -> str:
    """The unwrapped module's name of a buffer of the wrapped model."""
    return clean_path(name + ".").rstrip(".")


def load_full(
    model: ShardedModel, state_dict: dict[str, Any], strict: bool,
    optimizers: Sequence[tuple[Optimizer, dict[str, Any]]] = (), relax: str = RELAX_FABRIC,
) -> IncompatibleKeys:
    """Load a full state dict (the unwrapped module's keys) and plain optimizer states into this rank's shards;
    returns the keys the state dict and the model did not share (a warning names them, from rank 0).

    Only the slices this rank owns are read, unit by unit, so a memory-mapped checkpoint is never read whole.

    Args:
        model: the sharded model.
        state_dict: the full state dict.
        strict: whether missing and unexpected keys are errors (shapes that differ always are). Without it, the
            model's parameters and buffers that the state dict lacks keep their values, and its other entries are
            ignored.
        optimizers: ``(optimizer, plain state dict)`` for each optimizer to restore (re-pointed to the model's
            shards).
        relax: how to turn strict loading off, the end of the error that a strict load raises (see
            :func:`~lightning_fairscale.checkpoint.checks.check_state_dict_fits`).
    """
    keys = check_state_dict_fits(state_dict, expected_shapes(model), strict, relax)
    layout = model.layout
    load_full_state_dict(model.root, lambda p: layout.managed[p].pieces, state_dict, buffer_name)
    for optimizer, state in optimizers:  # this rank's slices (its owned parameters' whole states) of a plain state
        load_plain(state, optimizer, layout, model.order(optimizer), model.whole.get(optimizer))
    report_partial_load(keys)
    return keys


def load_sharded(
    ranks: Ranks, storage: ShardedStorage, path: Any, model: ShardedModel,
    optimizers: Callable[[dict[str, Any], int], Sequence[tuple[int, Optimizer]]],
    weights_only: Optional[bool], strict: bool = True, relax: str = RELAX_FABRIC, key: str = "state_dict",
) -> tuple[dict[str, Any], IncompatibleKeys]:
    """Load a sharded checkpoint saved by any number of processes into this rank's shards; returns its meta dict
    and the keys the checkpoint and the model did not share (a warning names them, from rank 0).

    Args:
        ranks: this process's global rank and the agreement of all ranks.
        storage: where the checkpoint's files are (see :class:`~lightning_fairscale.checkpoint.files.ShardedStorage`).
        path: the checkpoint directory.
        model: the sharded model.
        optimizers: given the meta dict and the number of optimizer states saved, the optimizers to restore (re-pointed
            to the model's shards), each with the position of its state in the checkpoint; raises when they do not
            fit.
        weights_only: passed to ``torch.load``.
        strict: whether missing and unexpected keys are errors, as for :func:`load_full`. Without it the model may
            also be wrapped otherwise than the saved one: its parameters are then found by name.
        relax: as for :func:`load_full`.
        key: the shards' model state to load: ``"state_dict"``, or
            :data:`~lightning_fairscale.fsdp.state.sharded_checkpoint.CURRENT_MODEL_STATE` (saved beside it by
            Lightning's ``WeightAveraging``).
    """
    meta = storage.load_meta(path, weights_only=weights_only)
    saved_world_size = check_fits(meta, path)
    aliases = meta[FORMAT_KEY].get("aliases", [])

    def read_shard(rank: int) -> dict[str, Any]:
        shard = storage.load_shard(path, rank, saved_world_size, weights_only=weights_only)
        return shard if key == "state_dict" else {**shard, "state_dict": shard[key]}

    shards = SavedShards(read_shard, saved_world_size)
    found: list[IncompatibleKeys] = []

    # `fabric.save(..., filter=...)`: the model's keys the checkpoint holds (the others are not in it).
    kept = meta[FORMAT_KEY].get(FABRIC_RECORD, {}).get("kept")

    def read() -> None:
        pieces = shards.pieces(aliases)
        saved = {name: piece.shape for name, piece in pieces.items() if kept is None or name in kept}
        saved.update(apply_aliases({k: v.shape for k, v in shards.buffers(buffer_name).items()}, aliases))
        found.append(check_state_dict_fits(saved, expected_shapes(model), strict, relax))
        alike = wrapped_alike(shards.file(0), model.root)
        if alike and kept is None:
            shards.load_into(model.root)
        elif strict and not alike:
            check_wrapping(shards.file(0), model.root, path)  # raises, naming the consolidation command
        else:  # by name: what a filtered checkpoint holds, or a partial load into another model
            layout = model.layout
            shards.load_by_name(model.root, lambda p: layout.managed[p].pieces, buffer_name, aliases, names=saved)
        for index, optimizer in optimizers(meta, len(shards.file(0).get("optimizer_states", []))):
            if not alike:  # a partial load: the param groups' hyperparameters only, when there is no state to lose
                saved_optimizer = shards.file(0)["optimizer_states"][index]
                _check_no_optimizer_state(saved_optimizer, path)
                load_view_states(optimizer, model.layout, saved_optimizer["param_groups"], lambda *_: None)
                continue
            params = managed_params(model.order(optimizer))
            plan = model.whole.get(optimizer)
            check_saved_path(shards.file(0)["optimizer_layouts"][index], plan, index)
            groups, source = shards.optimizer_source(index, managed_positions(params, model.root))
            position = {id(param): m for m, param in enumerate(params)}
            if plan is None:
                load_view_states(
                    optimizer, model.layout, groups, lambda managed, *at: source(position[id(managed)], *at)
                )
                continue
            # The whole path: each of this rank's parameters from the saving rank that owned it (any world size).
            whole = saved_source(shards.file, shards.world_size, index, source,
                                 lambda m, k: model.layout.managed[params[m]].pieces[k])
            owned = {(p.m, p.piece) for p in plan.owned()}

            def whole_state(managed: Any, k: int, *_: Any) -> Any:
                m = position[id(managed)]
                return whole(m, k) if (m, k) in owned else None

            load_view_states(optimizer, model.layout, groups, whole_state)

    together(ranks, storage, read, path, "read")
    meta.pop(FORMAT_KEY)
    report_partial_load(found[0])
    return meta, found[0]


def _check_no_optimizer_state(saved: dict[str, Any], path: Any) -> None:
    """A sharded optimizer state is laid out over the saved model's FSDP parameters: it cannot follow the model's
    parameters into other ones by name, as the model's state can (a partial load)."""
    if any(saved["state"].values()):
        raise ValueError(
            f"The sharded checkpoint {path} was saved from a model with other parameters or wrapping, and its"
            " optimizer state is laid out over that model's FSDP parameters: it does not load into this model's."
            " Load the model's state only (`fabric.load(path, {'model': model}, strict=False)`, or"
            " `trainer.validate(model, ckpt_path=...)` before `trainer.fit(model)`), or resume with an optimizer"
            " that keeps no per-parameter state (SGD without momentum)."
        )
