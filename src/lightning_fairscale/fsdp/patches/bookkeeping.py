"""FairScale's per-step bookkeeping on a unit, with the same effect for less Python work.

Why: FairScale does some bookkeeping on every unit at every step, and on a model of many small units (the default
policy's ``min_num_params``) that Python work is a share of the step that the layers' computation does not hide
(``benchmarks/speed.py``: the ``hooks`` part of ``ours-mnp``). Two of its habits cost far more than what they do:

* It writes its plain state (``training_state``, ``has_full_params``, ``_pre_backward_hook_has_run``, ...) a dozen
  times a unit a step through ``nn.Module.__setattr__``, which looks the name up in the parameters, submodules and
  buffers first. The unit class's own ``__setattr__``
  (:class:`~lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel`) writes an attribute that is already a
  plain one directly.
* The root casts every buffer to its unit's device and dtype at every forward (``_cast_buffers``), and each unit
  walks its whole subtree and calls the same on every unit inside it, which walks its subtree again: a model's
  modules are visited once per unit above them. :func:`cast_buffers` visits each once, with the nearest unit above
  it deciding its device and dtype, as in FairScale's walk, where an inner unit casts its modules' buffers before
  an outer one reaches them.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from fairscale.nn.data_parallel.fully_sharded_data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from torch import nn

__all__ = ["cast_buffers"]

def cast_buffers(
    root: nn.Module, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
    memo: Optional[set[nn.Module]] = None,
) -> None:
    """FairScale's ``_cast_buffers`` on ``root`` (a unit): each floating-point buffer of each module below it to its
    nearest unit's ``compute_device`` and ``buffer_dtype`` (``device`` and ``dtype`` instead, where given), any other
    buffer to the device only; each module once (``memo``: those already done)."""
    memo = set() if memo is None else memo
    for module, unit in _with_their_unit(root):
        if module in memo:
            continue
        memo.add(module)
        for name, buffer in module.named_buffers(recurse=False):
            cast = buffer.to(device=device or unit.compute_device)
            if torch.is_floating_point(cast):
                cast = cast.to(dtype=dtype or unit.buffer_dtype)
            setattr(module, name, cast)


def _with_their_unit(root: nn.Module) -> Iterator[tuple[nn.Module, Any]]:
    """Every module below ``root`` (itself included) once, in pre-order, with the innermost unit that holds it."""
    seen: set[nn.Module] = set()
    stack: list[tuple[nn.Module, Any]] = [(root, root)]
    while stack:
        module, unit = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        unit = module if isinstance(module, _FairScaleFSDP) else unit
        yield module, unit
        children = [child for child in module._modules.values() if child is not None]
        stack.extend((child, unit) for child in reversed(children))
