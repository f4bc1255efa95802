"""Torch's own gradient norms, exact over the gradients that sharded DDP partitions (issue 53, item 6).

After a backward pass that reduces, ``ShardedDataParallel`` leaves each gradient on the rank whose OSS partition owns
its parameter only (the other ranks' ``param.grad`` is ``None``): that is the memory it saves. A user's own
``torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)`` (in ``on_before_optimizer_step``, or before
``optimizer.step()`` in a Fabric loop) would clip each rank's gradients by the norm of its partition alone, and train
another model than unsharded training, silently (3.6e-3 off after 4 SGD steps).

The design: while a sharded model's gradients are partitioned (from the end of a reducing backward pass to the start
of the next backward pass, or until the strategy ends), torch's total norm, the one function through which
``clip_grad_norm_`` and ``get_total_norm`` compute one however they were imported
(:func:`~lightning_fairscale.distributed.torch_private.set_total_norm_implementation`), is replaced by
:func:`_partitioned_total_norm`: the norm of the gradients this rank owns, reduced over the ranks (one scalar per
call), combined with the norm of the tensors every rank holds whole (anything else: a frozen layer's gradient,
another model's). ``clip_grad_norm_`` then scales each rank's gradients by the same coefficient, the unsharded one.
So **a total norm that includes a partitioned gradient is a collective call** (one of other tensors only stays
local): every rank must make it
(as with torch's FSDP ``clip_grad_norm_``); code that computes one on rank 0 only would wait for the others.

The alternatives weighed: all-reducing every gradient to every rank (what DDP holds) gives up the memory that sharded
DDP is for; gradients that know they are partial (a tensor subclass) would slow and change every optimizer's
kernels, and a per-parameter norm of a gradient a rank does not hold still cannot be read; computing the norms once
after each backward and caching them cannot follow a gradient changed afterwards (unscaled, clipped by value) on the
ranks that do not own it. Norms that torch does not compute through that function (a loop over ``p.grad.norm()``,
Lightning's ``grad_norm``) are per rank: the guide says so and how to read them.

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fairscale.distributed import collectives
from lightning_fairscale.distributed.torch_private import (
    has_total_norm_implementation,
    set_total_norm_implementation,
    total_norm_implementation,
)



class PartitionHolder(Protocol):
    """What this module needs of a :class:`~lightning_fairscale.sharded_ddp.trainability.Trainability` (which
    imports this module)."""

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live."""

    def gradient_owners(self) -> tuple[set[int], set[int]]:
        """The ``id`` of each gradient this rank holds: of its own parameters, and of the other ranks'."""

__all__ = ["PARTITIONED", "PartitionHolder", "PartitionedGradients", "torch_norms_follow_partitions"]


def torch_norms_follow_partitions() -> bool:
    """Whether this torch lets the user's ``clip_grad_norm_`` be made exact over partitioned gradients (2.6 on)."""
    return has_total_norm_implementation()


class PartitionedGradients:
    """The sharded models whose gradients are partitioned now, for which torch's total norm is replaced.

    One per process (:data:`PARTITIONED`): torch's function is one per process. It holds our own
    :class:`~lightning_fairscale.sharded_ddp.trainability.Trainability` objects weakly (each dies with its wrapped
    model), and torch's function is replaced exactly while it holds a live one.
    """

    def __init__(self) -> None:
        self._states: weakref.WeakSet[PartitionHolder] = weakref.WeakSet()
        #: What torch computed total norms with before this object replaced it (``None``: not replaced now).
        self._previous: Optional[Callable[..., Tensor]] = None

    def add(self, state: PartitionHolder) -> None:
        """``state``'s gradients are partitioned (a backward pass reduced them to their owners)."""
        if not torch_norms_follow_partitions():
            return
        if state not in self._states:
            self._states.add(state)
            weakref.finalize(state, self._forget_dead)  # a model dropped without `close`: torch's own again at once
        if self._previous is None:
            self._previous = total_norm_implementation()
            set_total_norm_implementation(self._total_norm)

    def discard(self, state: PartitionHolder) -> None:
        """``state``'s gradients are no longer partitioned (a backward pass starts, or the strategy ends)."""
        self._states.discard(state)
        if not self._states:
            self._restore()

    def _forget_dead(self) -> None:
        if not list(self._states):  # iterating skips the dead ones
            self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            set_total_norm_implementation(self._previous)
            self._previous = None

    def _total_norm(
        self,
        tensors: Union[Tensor, Any],
        norm_type: Union[float, int, str] = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> Tensor:
        previous = self._previous
        assert previous is not None, "torch's total norm is replaced only while models are held"
        states = list(self._states)
        if not states or not dist.is_initialized():  # the models died, or their ranks are gone: torch's own again
            self._restore()
            return previous(tensors, norm_type, error_if_nonfinite, foreach)
        return _partitioned_total_norm(states, previous, tensors, norm_type, error_if_nonfinite, foreach)


#: The process's one :class:`PartitionedGradients`.
PARTITIONED = PartitionedGradients()


def _partitioned_total_norm(
    states: list[PartitionHolder],
    local_norm: Callable[..., Tensor],
    tensors: Union[Tensor, Any],
    norm_type: Union[float, int, str],
    error_if_nonfinite: bool,
    foreach: Optional[bool],
) -> Tensor:
    """The norm of ``tensors`` as if every rank's partition of the gradients were here. A collective call.

    Each tensor is one of: a gradient this rank owns (its norm is reduced over the ranks), a gradient another rank
    owns that this rank still holds (never the reduced gradient: left out; after a reducing backward pass there is
    none, see ``Trainability.end_backward``), or a tensor every rank holds whole (counted once).
    """
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    p = float(norm_type)
    if not (p > 0):  # NaN or <= 0: no sum of powers to reduce
        raise ValueError(
            f"`DDPShardedStrategy`: the norm of order {norm_type} of gradients that each rank holds a partition of"
            " cannot be combined across ranks; use a positive order (2, 1, 'inf'), or `strategy='ddp'`."
        )
    owned: set[int] = set()
    elsewhere: set[int] = set()
    for state in states:
        mine, others = state.gradient_owners()
        owned.update(mine)
        elsewhere.update(others)
    partition = [t for t in tensors if id(t) in owned]
    if not partition and not any(id(t) in elsewhere for t in tensors):
        # No gradient of a partitioned model: torch's own norm, no collective. Which models still hold partitioned
        # gradients can differ between ranks (a model dropped is freed when each rank's garbage collector runs), so
        # a norm of anything else (another model's, Lightning's "ddp" after ours) must not wait for the other ranks.
        return local_norm(tensors, norm_type, error_if_nonfinite, foreach)
    whole = [t for t in tensors if id(t) not in owned and id(t) not in elsewhere]
    dtype = tensors[0].dtype if tensors else torch.get_default_dtype()
    device = tensors[0].device if tensors else states[0].device
    with torch.no_grad():
        # float64, on every rank alike (a rank may hold no gradient of the call, whose norm torch makes float32).
        mine_norm = local_norm(partition, p, False, foreach).to(states[0].device, torch.float64)
        whole_norm = local_norm(whole, p, False, foreach).to(states[0].device, torch.float64)
        if math.isinf(p):
            collectives.all_reduce(mine_norm, op=dist.ReduceOp.MAX)
            total = torch.maximum(mine_norm, whole_norm)
        else:
            power = mine_norm.pow(p)
            collectives.all_reduce(power, op=dist.ReduceOp.SUM)
            total = (power + whole_norm.pow(p)).pow(1.0 / p)
        total = total.to(device, dtype)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be clipped. To"
            " disable this error and scale the gradients by the non-finite norm anyway, set"
            " `error_if_nonfinite=False`"
        )
    return total
