"""One post-backward hook per gradient accumulator: workaround 20 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`.

FairScale 0.4.13 registers its post-backward hook (which reduce-scatters a unit's gradient and frees its full
parameters) on the gradient accumulator of each flat parameter in every forward, and never removes one: "registering
the hook everytime and let them fire and hook being removed/freed automatically", on the assumption that the
accumulator dies with the step's graph. It does not: FairScale keeps it alive itself (``p._shard_bwd_hook`` holds
it), so the next forward adds one more hook to the same accumulator. After ``k`` steps each flat parameter's
backward called the hook ``k`` times (measured: 276 calls per unit over 23 steps, 1 + 2 + ... + 23): a cost that grows
with the run, on every device. All but the first call of a backward find no gradient (the first sets
``param.grad = None`` once it starts the reduction) or repeat idempotent work (freeing, switching to the shard), so
the extra calls change no result; but on CPU each one also made workaround 16's prefetcher wait for the reductions in
flight beyond its bucket budget, which the first call leaves in flight beside the next unit's all-gather (gradients
larger than half the bucket: the 18.9 M model's layers in ``benchmarks/speed.py``).

Keeping the accumulator alive also kept the whole model alive after its training: the accumulator holds its parameter
(autograd's C++ node holds the tensor, which then keeps its Python object), the parameter held the accumulator
(``p._shard_bwd_hook``), and the hook holds the unit, and through it the module, its optimizer and a Trainer: a cycle
through autograd's C++ objects that the garbage collector cannot see, so every sharded model that ever ran a backward
stayed in memory for the life of the process (a sweep of trials in one process grew by a model's state per trial).

:func:`register_post_backward_hooks` registers FairScale's hook as FairScale does, unless the same unit's hook is on
that accumulator already (all hooks of one accumulator run together, once all of its gradients are summed: one
suffices, in every case FairScale's docstring lists: a module called twice in a forward, activation checkpointing,
forward-forward-backward-backward under ``no_sync``, parameters shared between units), and returns the accumulators
it hooked: FairScale registers the hooks before its module computes, so the unit holds them for the rest of its
forward, and not after it (:class:`~lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel`): from then on
the step's graph keeps each accumulator (and its hooks) until its backward, as autograd keeps any node, and it goes
with the graph, so that the next step's forward finds a new one. (A parameter the forward did not use has its
accumulator in no graph: its hook could not run either way.) An accumulator is known by the dictionary of hooks that
autograd keeps for it (``RemovableHandle.hooks_dict_ref``: one per accumulator, for as long as it lives), weakly, in
the flat parameter's record of ours, which the unit layer keeps and passes in: nothing is written into the parameter.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP

__all__ = ["HookRecord", "register_post_backward_hooks"]


class HookRecord(Protocol):
    """Where a flat parameter's gradient accumulator is noted (weakly, by its hooks' dictionary) with the ``id`` of
    each unit whose hook is on it."""

    hooked: Optional[tuple[weakref.ref[Any], set[int]]]


class _PostBackwardHook:
    """FairScale's ``functools.partial(unit._post_backward_hook, param)``, holding the unit weakly: the accumulator
    lives as long as something holds a tensor of its graph (FairScale's views of the full parameters, kept for the
    backward's recomputations), and must not keep the model alive through its hook."""

    __slots__ = ("param", "unit")

    def __init__(self, unit: _FairScaleFSDP, param: torch.nn.Parameter) -> None:
        self.unit = weakref.ref(unit)
        self.param = param  # the accumulator holds it anyway

    def __call__(self, *unused: Any) -> None:
        unit = self.unit()
        if unit is not None:
            unit._post_backward_hook(self.param, *unused)


def register_post_backward_hooks(
    unit: _FairScaleFSDP, record_of: Callable[[torch.nn.Parameter], HookRecord]
) -> list[torch.autograd.graph.Node]:
    """FairScale's ``_register_post_backward_hooks`` for ``unit``, with at most one hook of it per accumulator
    (``record_of``: each flat parameter's record, where the hooks on its accumulator are noted). Returns the
    accumulators hooked, which nothing else holds until the module's forward puts them in its graph."""
    accumulators: list[Any] = []
    if not torch.is_grad_enabled():
        return accumulators  # FairScale registers none then either
    for param in unit.params:
        if not param.requires_grad:
            continue
        grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]  # its accumulator, as FairScale finds it
        handle = grad_acc.register_hook(_PostBackwardHook(unit, param))
        hooks = handle.hooks_dict_ref()  # the accumulator's own: the same for as long as it lives
        record = record_of(param)
        hooked = record.hooked
        if hooked is None or hooked[0]() is not hooks:
            hooked = record.hooked = (weakref.ref(hooks), set[int]())
        if id(unit) in hooked[1]:
            handle.remove()  # this unit's hook is on it already
            continue
        hooked[1].add(id(unit))
        accumulators.append(grad_acc)
    return accumulators
