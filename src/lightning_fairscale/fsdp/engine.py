"""Making a sharded model for ``DDPFullyShardedStrategy``, for the Trainer's strategy and for Fabric's: one engine,
two adapters.

The Trainer's strategy (:mod:`lightning_fairscale.strategies.fully_sharded`) and Fabric's
(:mod:`lightning_fairscale.fabric.fully_sharded`) call these functions at their own hooks:

* :func:`set_up_run`: the check of the options against the device and the precision, and the process groups of a
  run (:class:`~lightning_fairscale.fsdp.patches.hybrid.ProcessGroups`), made once the default group exists (a
  strategy's teardown hands them to :func:`~lightning_fairscale.fsdp.patches.hybrid.release_groups`);
* :func:`wrapping_context` and :func:`wrap_model`: manual and automatic wrapping, activation checkpointing; the
  result is a :class:`~lightning_fairscale.fsdp.model.WrappedModel`, the one object a strategy keeps of a sharded
  model (what it does with it afterwards: :mod:`lightning_fairscale.fsdp.model`);
* :func:`wrapped_model` and :func:`is_set_up`: the sharded model of a root set up before (by another stage or
  strategy, or wrapped by hand).

They take the strategy's :class:`~lightning_fairscale.fsdp.config.FullyShardedConfig` and what the run adds (the
device, the precision, the process groups, the ranks), passed in by the strategies: nothing here imports Lightning
or calls back into a strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, Sequence
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed.fsdp.wrap as torch_wrap
from fairscale.nn.wrap import enable_wrap
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale.distributed import process_exit
from lightning_fairscale.fsdp.patches import cpu_streams, hybrid
from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups, resolve_mesh, sharding_groups
from lightning_fairscale.fsdp.unit import original_params, recovery, unit_state
from lightning_fairscale.fsdp.unit.state_names import is_wrapped
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel, fsdp_instances
from lightning_fairscale.fsdp.wrapping.activation_checkpointing import apply_activation_checkpointing
from lightning_fairscale.fsdp.wrapping.compile import Compiler, compile_regions, take_compiled
from lightning_fairscale.fsdp.wrapping.policies import wrap_module
from lightning_fairscale.fsdp.wrapping.summary import unit_summary
from lightning_fairscale.fsdp.wrapping.unwrapping import remember_root, unwrapped
from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.model import WrappedModel
from lightning_fairscale.fsdp.run import check_settings, fsdp_kwargs, wrap_policy

__all__ = [
    "finish_wrapping",
    "is_set_up",
    "make_process_groups",
    "set_up_run",
    "wrap_model",
    "wrapped_model",
    "wrapping_context",
]


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
    """FSDP's process groups (see :class:`~lightning_fairscale.fsdp.patches.hybrid.ProcessGroups`): a collective call.

    All ranks create them together; they honour ``timeout``, so a lost rank cannot stall the others. They are closed
    when the interpreter exits (see :mod:`lightning_fairscale.distributed.process_exit`).
    """
    request = config.mesh_request
    mesh = None if request is None else resolve_mesh(request, world_size, num_nodes)
    # Made once per layout, reused by later stages; see `fsdp.patches.hybrid` for when they are destroyed.
    groups = sharding_groups(mesh, rank, world_size, timeout)
    process_exit.record_groups(*groups.all())
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
    describe: Optional[Callable[[str], Any]] = None, optimizers: Optional[Sequence[Optimizer]] = None,
    compiler: Optional[Compiler] = None,
) -> WrappedModel:
    """Wrap ``module`` (activation checkpointing, auto wrap unless it holds units already, the root unit) on
    ``device``, over ``groups``, under ``precision`` (the precision plugin's setting).

    ``optimizers``, made over ``module``'s parameters, are re-pointed to the shards, and the unsharded parameters are
    freed. Without it (``None``), optimizers made later or elsewhere are re-pointed by
    :meth:`~lightning_fairscale.fsdp.model.WrappedModel.repoint`; until
    :meth:`~lightning_fairscale.fsdp.model.WrappedModel.forget_originals`, the parameters from before wrapping are
    known (while alive).
    ``describe`` gets the summary of the units (the front end's way to log it).

    ``torch.compile`` (workaround 18, :mod:`~lightning_fairscale.fsdp.wrapping.compile`): the ``torch.compile``\\ d
    submodules of ``module`` are unwrapped before wrapping and ``compiler`` is that of a ``torch.compile(module)``
    the front end took off; once wrapped, their layers are compiled, each unit's gather and reshard around them.
    """
    # Before anything records names: a compiled submodule's parameters are named without `_orig_mod.`.
    to_compile = take_compiled(module, compiler)
    # Materialising replaces the meta parameters: kept alive until the layout knows where they went, so that the
    # ids it knows them by stay theirs (they hold no memory).
    placeholders = [param for param in module.parameters() if param.is_meta]
    originals = list(module.parameters())
    layout = ParameterLayout.before_wrapping(module)
    checkpointed = apply_activation_checkpointing(
        module, config.activation_checkpointing, config.activation_checkpointing_offload
    )
    if is_wrapped(module) and config.auto_wrap_policy is not None:
        rank_zero_warn(  # in Lightning's FSDPStrategy's words first, so that a warning filter written for it matches
            "A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The policy will be ignored. The model"
            " already holds FSDP units (wrapped in `configure_model`, or by hand): they are kept as they are."
        )
    policy = wrap_policy(config, own_units=checkpointed, root=module)
    with wrapping_context(config, device, groups, precision):
        root = wrap_module(module, policy, **fsdp_kwargs(config, device, groups, precision))
    layout.after_wrapping(root)
    del placeholders
    model = finish_wrapping(root, layout, checkpointed, originals)
    # After activation checkpointing: a checkpointed layer is compiled inside its checkpoint.
    if to_compile and not compile_regions(module, to_compile):
        rank_zero_warn(
            "The model was given compiled (`torch.compile`), but it has no layer outside FSDP's units to compile: it"
            " runs eagerly. The strategy compiles the modules below the one it wraps (a unit's layer, a block):"
            " put the computation in submodules, or pass the model uncompiled."
        )
    remember_root(module, root)
    owner = unit_state.owner_of(root)
    if owner.groups is None and groups.all_gather is not None and root.process_group is groups.all_gather:
        hybrid.hold(groups)  # what its units shard over (not a root built by hand over others): kept while it is
        owner.groups = groups
    if owner.cpu_hold is None:  # FairScale's CPU workarounds 1-2, for as long as the model is sharded
        owner.cpu_hold = cpu_streams.hold_while_alive(root)
    process_exit.release_at_exit(*fsdp_instances(root), owner)  # their references to process groups dropped at exit
    if describe is not None:
        describe(f"{config.owner}: {unit_summary(root)}")
    if optimizers is not None:
        model.repoint(*optimizers, path=config.optimizer_path, owner=config.owner)
        model.forget_originals()  # from here on nothing refers to the unsharded parameters: they are freed
    return model


def wrapped_model(root: Module, compiler: Optional[Compiler] = None) -> WrappedModel:
    """The :class:`~lightning_fairscale.fsdp.model.WrappedModel` of ``root`` (:func:`finish_wrapping`): one per
    sharded model, whichever stage or strategy set it up, so that every stage's optimizers hold the same original
    parameters. With ``compiler`` (the model was given compiled again), its layers are compiled (those compiled
    already stay as they are)."""
    if not isinstance(root, FullyShardedDataParallel):
        raise TypeError(f"A sharded model is the root FSDP unit of a model, not a {type(root).__name__}.")
    model = WrappedModel.of(root)
    if model is None:  # every front end asks only for a root `wrap_model` made (`is_set_up`, `wrapped_root`)
        raise ValueError("This FSDP unit is not the root of a model the strategy set up (`wrap_model`).")
    if compiler is not None:
        module = unwrapped(root)
        compile_regions(module, [(module, compiler)])
    return model


def is_set_up(module: Module) -> bool:
    """Whether ``module`` is the root unit of a model :func:`wrap_model` (or :func:`wrapped_model`) set up."""
    owner = unit_state.peek_owner(module) if isinstance(module, FullyShardedDataParallel) else None
    return owner is not None and owner.wrapped is not None


def finish_wrapping(
    root: FullyShardedDataParallel, layout: ParameterLayout, checkpointed: Sequence[Module] = (),
    originals: Iterable[torch.nn.Parameter] = (),
) -> WrappedModel:
    """The sharded model, once ``layout`` knows where its original parameters went: this rank's views of them
    become the attributes of ``root``'s modules again, under their names, tied ones included (workaround 17,
    :mod:`~lightning_fairscale.fsdp.unit.original_params`), and the
    :class:`~lightning_fairscale.fsdp.model.WrappedModel` is kept on ``root``."""
    views, orders = layout.originals(), layout.parameter_names
    owner = unit_state.adopt(root, list(fsdp_instances(root)))  # the model's owner; workaround 28: the loop followed
    for unit in fsdp_instances(root):
        original_params.install(unit, views, orders, owner)
    recovery.number_root(root)  # names its failed steps alike on every rank
    # A later stage, or another strategy, takes the model as it is (the root keeps what the model knows).
    return WrappedModel(root, layout, checkpointed, originals)

