"""What ``DDPFullyShardedStrategy`` does, for the Trainer's strategy and for Fabric's: one engine, two adapters.

The Trainer's strategy (:mod:`lightning_fairscale.strategies.fully_sharded`) and Fabric's
(:mod:`lightning_fairscale.fabric.fully_sharded`) call these functions at their own hooks:

* :func:`set_up_run`: the process groups of a run (:class:`~lightning_fairscale.fsdp.config.ProcessGroups`), made
  once the default group exists;
* :func:`wrapping_context` and :func:`wrap_model`: manual and automatic wrapping, activation checkpointing, and the
  :class:`~lightning_fairscale.fsdp.optim.ParameterLayout` that re-points optimizers made over the unwrapped module;
* :func:`module_state_dict`, :func:`optimizer_state`, :func:`save_sharded`: the two checkpoint formats;
* :func:`load_full` and :func:`load_sharded`: loading either format into this rank's shards, gathering nothing;
  with strict loading off, what fits (partial loading), reporting the keys that did not as ``torch`` does.

They take the strategy's :class:`~lightning_fairscale.fsdp.config.FullyShardedConfig` and what the run adds (the
device, the precision, the process groups, the ranks, the CheckpointIO plugin), passed in by the strategies: nothing
here imports Lightning or calls back into a strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.fsdp.wrap as torch_wrap
from fairscale.nn.wrap import enable_wrap
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale.distributed import process_exit
from lightning_fairscale.distributed.collectives import all_agree
from lightning_fairscale.fsdp import cpu_streams, original_params
from lightning_fairscale.fsdp.compile import Compiler, compile_regions, take_compiled
from lightning_fairscale.fsdp.config import (
    FullyShardedConfig,
    ProcessGroups,
    check_settings,
    fsdp_kwargs,
    wrap_policy,
)
from lightning_fairscale.fsdp.hybrid import resolve_mesh, sharding_groups
from lightning_fairscale.fsdp.units import FullyShardedDataParallel, fsdp_instances
from lightning_fairscale.fsdp.optim import (
    GroupOrder,
    ParameterLayout,
    consolidate_state,
    load_plain_state,
    load_view_states,
    managed_params,
    managed_positions,
    repoint_optimizer,
)
from lightning_fairscale.fsdp.resharding import SavedShards, load_full_state_dict
from lightning_fairscale.fsdp.sharded_checkpoint import (
    FORMAT_KEY,
    check_fits,
    check_wrapping,
    split_checkpoint,
    wrapped_alike,
)
from lightning_fairscale.checkpoint.checks import RELAX_FABRIC, IncompatibleKeys, check_state_dict_fits
from lightning_fairscale.fsdp.summary import unit_summary
from lightning_fairscale.fsdp.activation_checkpointing import apply_activation_checkpointing
from lightning_fairscale.fsdp.policies import wrap_module
from lightning_fairscale.fsdp.state_names import add_aliases, apply_aliases, clean_path, is_wrapped, state_aliases
from lightning_utilities.core.rank_zero import rank_zero_warn
from lightning_fairscale.fsdp.unwrapping import remember_root

__all__ = [
    "Ranks",
    "WrappedModel",
    "buffer_name",
    "finish_wrapping",
    "is_sharded_checkpoint",
    "load_full",
    "load_sharded",
    "make_process_groups",
    "module_state_dict",
    "optimizer_state",
    "repoint",
    "save_sharded",
    "set_up_run",
    "shard_writer",
    "state_dict_keys",
    "together",
    "wrap_model",
    "wrapped_model",
    "wrapping_context",
]



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


@dataclass
class WrappedModel:
    """A model wrapped by :func:`wrap_model`: its root unit, where its original parameters went, and the layers that
    recompute their activations (to undo it when unwrapping)."""

    root: FullyShardedDataParallel
    layout: ParameterLayout
    checkpointed: list[Module] = field(default_factory=list)


def set_up_run(
    config: FullyShardedConfig, device: torch.device, precision: str, rank: int, world_size: int, num_nodes: int,
    timeout: Optional[timedelta],
) -> ProcessGroups:
    """Everything FSDP needs before the first unit is made, on every rank together: the check of the options against
    the device and ``precision`` (the precision plugin's setting), and the process groups (returned). FairScale's
    CPU workarounds are held by each model :func:`wrap_model` wraps for the CPU, while it lives."""
    check_settings(config, device, precision)
    return make_process_groups(config, rank, world_size, num_nodes, timeout)


def make_process_groups(
    config: FullyShardedConfig, rank: int, world_size: int, num_nodes: int, timeout: Optional[timedelta]
) -> ProcessGroups:
    """FSDP's process groups (see :class:`~lightning_fairscale.fsdp.config.ProcessGroups`): a collective call.

    All ranks create them together; they honour ``timeout``, so a lost rank cannot stall the others. They are closed
    when the interpreter exits (see :mod:`lightning_fairscale.distributed.process_exit`).
    """
    request = config.mesh_request
    mesh = None if request is None else resolve_mesh(request, world_size, num_nodes)
    # Made once per layout, reused by later stages; see `fsdp.hybrid` for when they are destroyed.
    groups = ProcessGroups(*sharding_groups(mesh, rank, timeout), mesh=mesh)
    process_exit.record_groups(groups.all_gather, groups.reduce_scatter, groups.replica)
    return groups


@contextlib.contextmanager
def wrapping_context(
    config: FullyShardedConfig, device: torch.device, groups: ProcessGroups, precision: str
) -> Generator[None, None, None]:
    """Inside this context, ``fairscale.nn.wrap`` and ``torch.distributed.fsdp.wrap.wrap`` make FSDP units."""
    kwargs = fsdp_kwargs(config, device, groups, precision)
    with (
        enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=wrap_policy(config), **kwargs),
        torch_wrap.enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs),
    ):
        yield


def wrap_model(
    config: FullyShardedConfig, module: Module, device: torch.device, groups: ProcessGroups, precision: str,
    describe: Optional[Callable[[str], Any]] = None, compiler: Optional[Compiler] = None,
) -> WrappedModel:
    """Wrap ``module`` (activation checkpointing, auto wrap unless it holds units already, the root unit) on
    ``device``, over ``groups``, under ``precision`` (the precision plugin's setting).

    The optimizers created over ``module`` are not changed yet: :func:`repoint` them, then call
    ``layout.forget_originals()``. ``describe`` gets the summary of the units (the front end's way to log it).

    ``torch.compile`` (workaround 18, :mod:`~lightning_fairscale.fsdp.compile`): the ``torch.compile``\\ d
    submodules of ``module`` are unwrapped before wrapping and ``compiler`` is that of a ``torch.compile(module)``
    the front end took off; once wrapped, their layers are compiled, each unit's gather and reshard around them.
    """
    # Before anything records names: a compiled submodule's parameters are named without `_orig_mod.`.
    to_compile = take_compiled(module, compiler)
    # Materialising replaces the meta parameters: kept alive until the layout knows where they went, so that the
    # ids it knows them by stay theirs (they hold no memory).
    placeholders = [param for param in module.parameters() if param.is_meta]
    layout = ParameterLayout.before_wrapping(module)
    checkpointed = apply_activation_checkpointing(
        module, config.activation_checkpointing, config.activation_checkpointing_offload
    )
    if is_wrapped(module) and config.auto_wrap_policy is not None:
        rank_zero_warn(  # as Lightning's FSDPStrategy
            "An FSDP `auto_wrap_policy` is set, but the model already holds FSDP units (wrapped in `configure_model`)."
            " The policy is ignored."
        )
    policy = wrap_policy(config, own_units=checkpointed, root=module)
    with wrapping_context(config, device, groups, precision):
        root = wrap_module(module, policy, **fsdp_kwargs(config, device, groups, precision))
    layout.after_wrapping(root)
    del placeholders
    model = finish_wrapping(root, layout, checkpointed)
    # After activation checkpointing: a checkpointed layer is compiled inside its checkpoint.
    if to_compile and not compile_regions(module, to_compile):
        rank_zero_warn(
            "The model was given compiled (`torch.compile`), but it has no layer outside FSDP's units to compile: it"
            " runs eagerly. The strategy compiles the modules below the one it wraps (a unit's layer, a block):"
            " put the computation in submodules, or pass the model uncompiled."
        )
    remember_root(module, root)
    cpu_streams.hold_while_alive(root)  # FairScale's CPU workarounds 1-2, for as long as the model is sharded
    process_exit.release_at_exit(*fsdp_instances(root))  # their process groups are released at exit
    if describe is not None:
        describe(f"{config.owner}: {unit_summary(root)}")
    return model


#: The attribute of a root unit that holds its :class:`WrappedModel`.
_WRAPPED = "_lightning_fairscale_wrapped"


def wrapped_model(root: FullyShardedDataParallel) -> WrappedModel:
    """The :class:`WrappedModel` of ``root`` (:func:`finish_wrapping`): one per sharded model, whichever stage or
    strategy set it up, so that every stage's optimizers hold the same original parameters."""
    kept = root.__dict__.get(_WRAPPED)
    if kept is None:  # a root wrapped by hand, outside `wrap_model`: learn its layout now
        return finish_wrapping(root, ParameterLayout().after_wrapping(root))
    layout, checkpointed = kept
    return WrappedModel(root, layout, checkpointed)


def finish_wrapping(
    root: FullyShardedDataParallel, layout: ParameterLayout, checkpointed: Sequence[Module] = ()
) -> WrappedModel:
    """The sharded model, once ``layout`` knows where its original parameters went: this rank's views of them
    become the attributes of ``root``'s modules again, under their names, tied ones included (workaround 17,
    :mod:`~lightning_fairscale.fsdp.original_params`), and the :class:`WrappedModel` is kept on ``root``."""
    originals, orders = layout.originals(), layout.parameter_names
    for unit in fsdp_instances(root):
        original_params.install(unit, originals, orders)
    # A later stage, or another strategy, takes the model as it is. What the root keeps refers to it weakly only
    # (the layout), so that a sharded model nobody uses any more is freed at once, not by the garbage collector.
    model = WrappedModel(root, layout, list(checkpointed))
    root.__dict__[_WRAPPED] = (layout, model.checkpointed)
    return model


def repoint(optimizer: Optimizer, layout: ParameterLayout) -> GroupOrder:
    """Make ``optimizer`` hold this rank's views of its parameters; returns the order of its state in checkpoints.

    An optimizer made over the original parameters keeps the order the user listed them in. One made over the
    managed parameters (after wrapping) has no such order: its state is saved in the order of the unwrapped module's
    ``parameters()``, as a plain optimizer over them would save it, so that either one loads the other's checkpoint.
    """
    over_managed = all(param in layout.managed for group in optimizer.param_groups for param in group["params"])
    orders = repoint_optimizer(optimizer, layout)
    return [layout.in_module_order(order) for order in orders] if over_managed else orders


# ----------------------------------------------------------------------------------------------------------------
# State dicts and checkpoints


def module_state_dict(root: FullyShardedDataParallel, sharded: bool, is_global_zero: bool) -> dict[str, Any]:
    """The full state dict with the unwrapped module's keys, gathered unit by unit and kept on rank 0 only; with
    ``sharded``, this rank's parameter shards (FairScale's ``local_state_dict``). A collective call."""
    if sharded:
        return root.local_state_dict()
    state_dict = root.state_dict()  # every rank gathers, rank 0 keeps
    return add_aliases(state_dict, root) if is_global_zero else state_dict


def optimizer_state(optimizer: Optimizer, layout: ParameterLayout, order: GroupOrder, sharded: bool) -> dict:
    """The full optimizer state in the layout of a plain optimizer, on rank 0 (``{}`` on the other ranks); with
    ``sharded``, this rank's state over its views, as it is (its layout is saved beside it). A collective call."""
    return optimizer.state_dict() if sharded else consolidate_state(optimizer, layout, order)


def is_sharded_checkpoint(io: Any, path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (one that a crash left half-replaced included)."""
    return hasattr(io, "is_sharded") and io.is_sharded(io.recover(Path(str(path))))


def together(ranks: Ranks, io: Any, action: Callable[[], Any], path: Any, step: str) -> None:
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
        io.abort_sharded(path)
    if error is not None:
        raise error
    raise RuntimeError(
        f"Another process failed to {step} the sharded checkpoint {path} (its error is in its log). The"
        " previous checkpoint of that name, if any, is unchanged."
    )


def save_sharded(
    ranks: Ranks, io: Any, checkpoint: dict[str, Any], path: Any, model: WrappedModel,
    optimizers: Sequence[Optimizer], orders: Sequence[GroupOrder], fabric: Optional[dict[str, Any]] = None,
) -> None:
    """The ranks of one replica write their shards of ``checkpoint`` (made with :func:`module_state_dict` and
    :func:`optimizer_state` with ``sharded``) into the checkpoint directory ``path``; rank 0 its meta file last.

    Without hybrid sharding that replica is every rank. Under hybrid sharding every replica holds the same shards,
    so the shard group of rank 0 writes them once (a checkpoint of ``shard_size`` shards); the other replicas write
    nothing but take part in every agreement, so that a failure anywhere fails everywhere.

    ``checkpoint`` is the Trainer's, or with ``fabric`` (the keys of the model and of the optimizers) what
    ``fabric.save`` writes (see :func:`~lightning_fairscale.fsdp.sharded_checkpoint.split_checkpoint`)."""
    shard_rank, shards, writes = shard_writer(ranks, model.root)
    meta, shard = split_checkpoint(checkpoint, model.root, model.layout, optimizers, orders, shards, fabric)
    # Each step ends with an agreement, so that a failure on one rank (a full disk...) fails every rank with the
    # previous checkpoint untouched, instead of leaving the others waiting for it.
    zero = ranks.is_global_zero
    together(ranks, io, lambda: io.begin_sharded(path) if zero else None, path, "prepare")
    together(ranks, io, lambda: io.save_shard(shard, path, shard_rank, shards) if writes else None, path, "write")
    together(ranks, io, lambda: io.commit_sharded(meta, path, shards) if zero else None, path, "complete")


def shard_writer(ranks: Ranks, root: FullyShardedDataParallel) -> tuple[int, int, bool]:
    """``(shard rank, number of shards, whether this rank writes its shard)`` in a sharded checkpoint.

    The shards are those of the root unit's group: every rank without hybrid sharding, the shard group under it.
    Replica 0, the shard group of global rank 0, writes: its ranks are ``0 ... shard_size - 1``, whose shard rank is
    their global rank (see :func:`~lightning_fairscale.fsdp.hybrid.hybrid_groups`).
    """
    shard_rank, shards = root.rank, root.world_size
    return shard_rank, shards, ranks.global_rank == shard_rank


def buffer_name(name: str) -> str:
    """The unwrapped module's name of a buffer of the wrapped model."""
    return clean_path(name + ".").rstrip(".")


def state_dict_keys(model: WrappedModel) -> list[str]:
    """The keys of the unwrapped module's state dict, known without gathering anything."""
    return list(_expected_shapes(model))


def _expected_shapes(model: WrappedModel) -> dict[str, Any]:
    """The keys and shapes of the unwrapped module's state dict, known without gathering anything."""
    shapes: dict[str, Any] = {p.name: p.shape for m in model.layout.managed.values() for p in m.pieces}
    for path, module in model.root.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:  # as `state_dict` has them
                shapes[buffer_name(f"{path}.{name}" if path else name)] = buffer.shape
    return apply_aliases(shapes, state_aliases(model.root))


def load_full(
    model: WrappedModel, state_dict: dict[str, Any], strict: bool,
    optimizers: Sequence[tuple[Optimizer, GroupOrder, dict[str, Any]]] = (), relax: str = RELAX_FABRIC,
) -> IncompatibleKeys:
    """Load a full state dict (the unwrapped module's keys) and plain optimizer states into this rank's shards;
    returns the keys the state dict and the model did not share.

    Only the slices this rank owns are read, unit by unit, so a memory-mapped checkpoint is never read whole.

    Args:
        model: the wrapped model.
        state_dict: the full state dict.
        strict: whether missing and unexpected keys are errors (shapes that differ always are). Without it, the
            model's parameters and buffers that the state dict lacks keep their values, and its other entries are
            ignored.
        optimizers: ``(optimizer, order, plain state dict)`` for each optimizer to restore.
        relax: how to turn strict loading off, the end of the error that a strict load raises (see
            :func:`~lightning_fairscale.checkpoint.checks.check_state_dict_fits`).
    """
    keys = check_state_dict_fits(state_dict, _expected_shapes(model), strict, relax)
    layout = model.layout
    load_full_state_dict(model.root, lambda p: layout.managed[p].pieces, state_dict, buffer_name)
    for optimizer, order, state in optimizers:
        load_plain_state(state, optimizer, layout, order)
    return keys


def load_sharded(
    ranks: Ranks, io: Any, path: Any, model: WrappedModel,
    optimizers: Callable[[dict[str, Any], int], Sequence[tuple[int, Optimizer, GroupOrder]]],
    weights_only: Optional[bool], strict: bool = True, relax: str = RELAX_FABRIC,
) -> tuple[dict[str, Any], IncompatibleKeys]:
    """Load a sharded checkpoint saved by any number of processes into this rank's shards; returns its meta dict
    and the keys the checkpoint and the model did not share.

    Args:
        ranks: this process's global rank and the agreement of all ranks.
        io: the :class:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO`.
        path: the checkpoint directory.
        model: the wrapped model.
        optimizers: given the meta dict and the number of optimizer states saved, the optimizers to restore, each
            with the position of its state in the checkpoint and its order (:func:`repoint`); raises when they do
            not fit.
        weights_only: passed to ``torch.load``.
        strict: whether missing and unexpected keys are errors, as for :func:`load_full`. Without it the model may
            also be wrapped otherwise than the saved one: its parameters are then found by name.
        relax: as for :func:`load_full`.
    """
    meta = io.load_meta(path, weights_only=weights_only)
    saved_world_size = check_fits(meta, path)
    aliases = meta[FORMAT_KEY].get("aliases", [])
    shards = SavedShards(
        lambda r: io.load_shard(path, r, saved_world_size, weights_only=weights_only),
        saved_world_size,
    )
    found: list[IncompatibleKeys] = []

    def read() -> None:
        saved = {name: piece.shape for name, piece in shards.pieces(aliases).items()}
        saved.update(apply_aliases({k: v.shape for k, v in shards.buffers(buffer_name).items()}, aliases))
        found.append(check_state_dict_fits(saved, _expected_shapes(model), strict, relax))
        alike = wrapped_alike(shards.file(0), model.root)
        if alike:
            shards.load_into(model.root)
        elif strict:
            check_wrapping(shards.file(0), model.root, path)  # raises, naming the consolidation command
        else:
            layout = model.layout
            shards.load_by_name(model.root, lambda p: layout.managed[p].pieces, buffer_name, aliases)
        for index, optimizer, order in optimizers(meta, len(shards.file(0).get("optimizer_states", []))):
            if not alike:  # a partial load: the param groups' hyperparameters only, when there is no state to lose
                saved_optimizer = shards.file(0)["optimizer_states"][index]
                _check_no_optimizer_state(saved_optimizer, path)
                load_view_states(optimizer, model.layout, saved_optimizer["param_groups"], lambda *_: None)
                continue
            params = managed_params(order)
            groups, source = shards.optimizer_source(index, managed_positions(params, model.root))
            position = {id(param): m for m, param in enumerate(params)}
            load_view_states(
                optimizer, model.layout, groups, lambda managed, *at: source(position[id(managed)], *at)
            )

    together(ranks, io, read, path, "read")
    meta.pop(FORMAT_KEY)
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
