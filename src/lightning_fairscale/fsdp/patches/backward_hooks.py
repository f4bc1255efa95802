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

:func:`register_post_backward_hooks` registers FairScale's hook as FairScale does, unless the same unit's hook is on
that accumulator already (all hooks of one accumulator run together, once all of its gradients are summed: one
suffices, in every case FairScale's docstring lists: a module called twice in a forward, activation checkpointing,
forward-forward-backward-backward under ``no_sync``, parameters shared between units). Which hooks are on it is noted
in the flat parameter's record of ours, which the unit layer keeps and passes in: nothing is written into the
parameter.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = ["HookRecord", "register_post_backward_hooks"]


class HookRecord(Protocol):
    """Where a flat parameter's gradient accumulator is noted with the ``id`` of each unit whose hook is on it."""

    hooked: Optional[tuple[Any, set[int]]]


def register_post_backward_hooks(unit: Any, record_of: Callable[[torch.nn.Parameter], HookRecord]) -> None:
    """FairScale's ``_register_post_backward_hooks`` for ``unit``, with at most one hook of it per accumulator
    (``record_of``: each flat parameter's record, where the hooks on its accumulator are noted)."""
    if not torch.is_grad_enabled():
        return  # FairScale registers none then either
    for param in unit.params:
        if not param.requires_grad:
            continue
        grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]  # its accumulator, as FairScale finds it
        record = record_of(param)
        hooked = record.hooked
        if hooked is None or hooked[0] is not grad_acc:
            hooked = record.hooked = (grad_acc, set[int]())
        if id(unit) in hooked[1]:
            continue
        handle = grad_acc.register_hook(functools.partial(unit._post_backward_hook, param))
        param._shard_bwd_hook = (grad_acc, handle)  # FairScale's attribute: it keeps the accumulator alive
        hooked[1].add(id(unit))
