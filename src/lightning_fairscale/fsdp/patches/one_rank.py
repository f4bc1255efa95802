"""Mixed precision with nothing to shard: workaround 21 of :mod:`lightning_fairscale.fsdp.patches.workarounds`.

With ``mixed_precision=True`` on a process group of one rank (``Trainer(devices=1, precision="bf16-mixed")``, or a
hybrid layout whose shard groups hold one rank each), FairScale 0.4.13 does not shard a flat parameter: its half
copy (``_fp16_shard``) is its full parameter in the forward and the backward. Two of its paths break there:

* Its post-reduction hook is called with ``param.grad.data``, a detached alias of the gradient, and casts that
  alias to the parameter's dtype: the parameter kept its half gradient, which the optimizer's fp32 views of the
  original parameters refused at the first backward ("the gradient must match the tensor's grad_dtype").
  :func:`keep_cast_gradient` gives the parameter the gradient FairScale cast.
* Its post-backward hook frees the half copy after every backward, also one that does not synchronise
  (``no_sync``: accumulating micro-batches), after which a unit that keeps its full parameters between passes (the
  root) still says it holds them (``has_full_params``): the next forward read the freed copy (``RuntimeError:
  setStorage ... storage of size 0``). :func:`forget_freed_half_params` clears that flag, so the forward casts the
  fp32 shard to half again, as after any other backward.

Neither changes anything where the parameters are sharded (their full parameters are gathered into buffers of their
own) or without mixed precision.
"""

from __future__ import annotations


import torch
from torch import Tensor
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP

__all__ = ["forget_freed_half_params", "keep_cast_gradient"]


def keep_cast_gradient(unit: _FairScaleFSDP, param: torch.nn.Parameter, reduced: Tensor) -> None:
    """After FairScale's post-reduction hook for ``param`` of ``unit``: where the gradient it reduced (``reduced``)
    is no longer the parameter's own (FairScale cast the alias it was given, or our hook reduced a copy), the
    parameter's gradient becomes it. Not for a sharded parameter (FairScale keeps its shard apart) nor when gradients
    go to CPU memory (FairScale hands the parameter its fp32 copy there at the end of the backward)."""
    if getattr(param, "_is_sharded", True) or unit.move_grads_to_cpu or param.grad is None:
        return
    if param.grad.data_ptr() != reduced.data_ptr():
        param.grad = reduced


def forget_freed_half_params(unit: _FairScaleFSDP) -> None:
    """Before ``unit`` rebuilds its full parameters: if a half copy that stands for an unsharded full parameter was
    freed, ``unit`` no longer holds its full parameters."""
    if not (unit.mixed_precision and unit.has_full_params):
        return
    for param in unit.params:
        half = getattr(param, "_fp16_shard", None)
        if not param._is_sharded and half is not None and half.untyped_storage().size() == 0:
            unit.has_full_params = False
            return
