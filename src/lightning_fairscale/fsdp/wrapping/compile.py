"""``torch.compile`` under FairScale's FSDP: regional compilation, workaround 18 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`.

Dynamo cannot trace a FairScale unit: its forward swaps ``param.data`` between the shard and the gathered full
parameter (``update_p_data``), frees storage by resizing it and runs collectives, none of which a graph can hold
(inductor fails on the swapped sizes, ``aot_eager`` on an in-place change in the backward, ``eager`` on a gradient
of the shard's size). So the user's ``torch.compile`` is taken as "compile my layers": what each unit *computes*
is compiled, and the unit's gather, reshard and reduce-scatter run around it, eagerly, as torchtitan compiles each
block of a sharded model ("regional compilation").

* :func:`take_compiled` (before wrapping): every ``torch.compile``\\ d submodule (torch's ``OptimizedModule``) is
  replaced by the module it wraps, so that the auto-wrap policy sees the user's classes (``{Block}``), the
  parameter names (and so checkpoint keys) have no ``_orig_mod.``, and the optimizer holds the same parameters.
  Each one is remembered with its compiler (the ``OptimizedModule``'s own, with the options the user gave), and
  the whole model with the compiler of a ``torch.compile(model)`` that the front end took off.
* :func:`compile_regions` (after wrapping): each remembered module is compiled in its *regions*: the largest
  modules in it that hold no FSDP unit (a unit's wrapped module itself when that holds no other unit, a block
  compiled in ``__init__``; below the LightningModule, its layers, embedding and head). The top module (the
  LightningModule, Fabric's model) is never a region: the Trainer runs its ``training_step`` through it, and its
  own ``forward`` calls the units. A region's ``forward`` becomes the compiled one, as Lightning's ``from_compiled``
  does for a LightningModule; a layer that recomputes its activations (a ``CheckpointedForward`` of
  :mod:`~lightning_fairscale.fsdp.wrapping.activation_checkpointing`) gets its class's ``forward`` compiled *inside* the
  checkpoint, so that the recomputation runs the compiled code too.
* A unit's ``__call__`` is excluded from dynamo
  (:class:`~lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel`): a compile around a unit (Fabric compiles
  the model its strategy returns again; a user may compile a sharded model) runs the unit eagerly instead of tracing
  FairScale, while the compiled regions inside still run compiled.

The parameters a region's graph reads are FairScale's views of the gathered flat parameter during the unit's
forward (workaround 17): plain tensors, new each step, which dynamo takes as inputs (it guards their sizes and
dtypes, not their identity), so that nothing recompiles from step to step; the gradient reaches the flat parameter
through the views as in eager mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.fsdp.wrapping.activation_checkpointing import CheckpointedForward
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel, fsdp_instances

__all__ = [
    "Compiler",
    "compile_regions",
    "compiler_from_options",
    "is_compiled",
    "regions",
    "take_compiled",
    "uncompile_regions",
    "unwrap_compiled",
]

#: What compiles a function: ``torch.compile`` with the user's options (a dynamo context, or
#: ``torch.compile(backend=...)`` without a model, which returns one).
Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]


class CompiledForward:
    """A region's compiled ``forward`` (:func:`compile_regions`), the mark by which it is found again, with the
    ``forward`` it replaced (``None``: its class's) to give back. A checkpointed region's is its
    :class:`~lightning_fairscale.fsdp.wrapping.activation_checkpointing.CheckpointedForward` computing the compiled
    function, which knows the one it replaced (``compiled_from``)."""

    def __init__(self, compiled: Callable[..., Any], replaced: Optional[Callable[..., Any]]) -> None:
        self.compiled = compiled
        self.replaced = replaced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


def compiler_from_options(options: dict[str, Any]) -> Compiler:
    """The compiler of ``torch.compile(model, **options)``: the same options, for the regions."""
    return torch.compile(**options)  # without a model, torch.compile returns the decorator


def _compiled_parts(module: nn.Module) -> Optional[tuple[nn.Module, Compiler]]:
    """``(the module it wraps, its compiler)`` when ``module`` is torch's ``OptimizedModule`` (the result of
    ``torch.compile(module)``), else ``None``. Read by its attributes (``_orig_mod``, ``dynamo_ctx``), which the
    engine can do without importing the class from ``torch._dynamo``."""
    inner, compiler = getattr(module, "_orig_mod", None), getattr(module, "dynamo_ctx", None)
    if isinstance(inner, nn.Module) and callable(compiler):
        return inner, compiler
    return None


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, Optional[Compiler]]:
    """``(the module, None)``, or for the result of ``torch.compile(module)``, ``(module, its compiler)``."""
    parts = _compiled_parts(module)
    return (module, None) if parts is None else parts


def take_compiled(module: nn.Module, compiler: Optional[Compiler] = None) -> list[tuple[nn.Module, Compiler]]:
    """Replace every ``torch.compile``\\ d submodule of ``module`` by the module it wraps, in place; returns what to
    compile once wrapped: each of them with its compiler, then ``module`` itself with ``compiler`` if given (the
    compile of the whole model, taken off by the front end).

    Raises:
        ValueError: ``module`` itself is compiled (the front end must take that off and pass ``compiler``).
    """
    if _compiled_parts(module) is not None:
        raise ValueError(
            "The model given to the FSDP engine is still a `torch.compile` wrapper: take the compiled module's"
            " `_orig_mod` and pass its compiler instead."
        )
    targets: list[tuple[nn.Module, Compiler]] = []
    stack = [module]
    while stack:
        parent = stack.pop()
        for name, child in list(parent._modules.items()):
            parts = None if child is None else _compiled_parts(child)
            while parts is not None:  # `torch.compile(torch.compile(layer))`: the innermost compiler wins
                child, compiler_of_child = parts
                parent._modules[name] = child
                targets.append((child, compiler_of_child))
                parts = _compiled_parts(child)
            if child is not None:
                stack.append(child)
    # The whole model last: a layer compiled on its own keeps its own options (see `compile_regions`).
    return targets if compiler is None else [*targets, (module, compiler)]


def _holds_unit(module: nn.Module) -> bool:
    return next(fsdp_instances(module), None) is not None


def _wrapped_module(unit: _FairScaleFSDP) -> nn.Module:
    """The user's module inside a FairScale unit (inside its ``FlattenParamsWrapper`` when it has one)."""
    inner = unit.module
    return getattr(inner, "module", inner) if type(inner).__name__ == "FlattenParamsWrapper" else inner


def regions(module: nn.Module, include_self: bool) -> list[nn.Module]:
    """The largest modules in ``module`` that hold no FSDP unit: ``module`` itself if it holds none (and
    ``include_self``), else, child by child, a unit's wrapped module, a child that holds no unit, or the regions of
    a child that does. What a compiled ``module`` computes outside them is left to eager mode."""
    if isinstance(module, FullyShardedDataParallel):
        return regions(_wrapped_module(module), include_self=True)
    if include_self and not _holds_unit(module):
        return [module]
    found: list[nn.Module] = []
    for child in module.children():
        found += regions(child, include_self=True)
    return found


def compile_regions(top: nn.Module, targets: Sequence[tuple[nn.Module, Compiler]]) -> list[nn.Module]:
    """Compile the regions of each target (:func:`take_compiled`) of the wrapped model ``top``, each with its
    target's compiler; ``top`` itself is never a region. Returns the regions compiled. A region compiled already
    (a block compiled in ``__init__`` of a model compiled as a whole) keeps its first compiler."""
    compiled: list[nn.Module] = []
    for target, compiler in targets:
        for region in regions(target, include_self=target is not top):
            if region is top or is_compiled(region) or _inside_compiled(region, compiled):
                continue
            _compile_forward(region, compiler)
            compiled.append(region)
    return compiled


def _inside_compiled(region: nn.Module, compiled: Sequence[nn.Module]) -> bool:
    return any(region is not c and any(region is m for m in c.modules()) for c in compiled)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_regions` compiled ``module``'s ``forward``."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, CheckpointedForward):
        return forward.compiled_from is not None
    return isinstance(forward, CompiledForward)


def _compile_forward(region: nn.Module, compiler: Compiler) -> None:
    """Give ``region`` a compiled ``forward`` (an attribute of the instance: its class is not changed, and nor are
    its name and its state dict's keys)."""
    own = region.__dict__.get("forward")
    if isinstance(own, CheckpointedForward):
        # The checkpoint runs the class's forward twice (forward, recomputation): compile that one, inside the
        # checkpoint, so that both run compiled code.
        region.forward = own.with_inner(compiler(own.inner))
    else:
        region.forward = CompiledForward(compiler(region.forward), own)


def uncompile_regions(module: nn.Module) -> None:
    """Give every region of ``module`` that :func:`compile_regions` compiled its ``forward`` back (before the
    activation checkpointing is removed, which recognises its own ``forward``)."""
    for submodule in module.modules():
        forward = submodule.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward) and forward.compiled_from is not None:
            submodule.__dict__["forward"] = forward.compiled_from
        elif isinstance(forward, CompiledForward):
            if forward.replaced is None:
                del submodule.__dict__["forward"]
            else:
                submodule.__dict__["forward"] = forward.replaced
