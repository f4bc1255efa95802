"""What a sharded parameter's view knows of its layout, whose code reads it locally, and the collectives that make
its reads whole (:mod:`~lightning_fairscale.fsdp.unit.sharded_reads` has the tensors and their rules).

A read is a collective: the first time a parameter is read some way, the ranks agree through the store within
:data:`AGREEMENT_TIMEOUT` seconds (:func:`agree`), so that a read made on one rank only ends in an error naming the
parameter, never in a hang. Reductions and gathers are autograd functions whose backward gives each rank the
gradient of its slice, averaged over the ranks as DDP averages gradients.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import types
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_fairscale.distributed.torch_private import default_store, plain_torch_functions, torch_functions_again

__all__ = [
    "AGREEMENT_TIMEOUT",
    "Gather",
    "ShardLayout",
    "SumAcrossShards",
    "agree",
    "gather",
    "group_world",
    "local_reads",
    "end_steps",
    "local_steps",
    "reads_locally",
]

#: Seconds the ranks wait for each other the first time a parameter is read some way (``LIGHTNING_FAIRSCALE_READ_
#: TIMEOUT``): past it, a read made on some ranks only fails on them.
AGREEMENT_TIMEOUT = float(os.environ.get("LIGHTNING_FAIRSCALE_READ_TIMEOUT", "10"))

#: Each layout's serial number, the same on every rank (all ranks make their views in the same order): the store's
#: keys of one model's reads are not another's.
_SERIAL = itertools.count()


@dataclass(eq=False)
class ShardLayout:
    """How one original parameter is split: rank ``r`` of ``group`` holds its flattened elements ``ranges[r]``."""

    name: str
    shape: torch.Size
    ranges: tuple[tuple[int, int], ...]
    rank: int
    group: Optional[ProcessGroup] = None
    #: Whether an empty view (this rank holds none of the parameter) reads as having an empty gradient now: the
    #: ranks holding elements hold their gradients (every rank must make the same reductions).
    empty_grad: Optional[Callable[[], bool]] = None
    serial: int = field(default_factory=lambda: next(_SERIAL))
    #: The kinds of reads the ranks have agreed on (:func:`agree`).
    agreed: set[str] = field(default_factory=set)

    @property
    def local_numel(self) -> int:
        lo, hi = self.ranges[self.rank]
        return hi - lo

    @property
    def world(self) -> int:
        return len(self.ranges)

    def __deepcopy__(self, memo: Any) -> ShardLayout:
        """A copy of a tensor of this layout (EMA weights) is split alike, and is read as a tensor of its own (its
        own agreements; no gradient stands in for its missing one)."""
        return replace(self, serial=next(_SERIAL), agreed=set(), empty_grad=None)

    def same_split(self, other: ShardLayout) -> bool:
        """Whether tensors of ``self`` and ``other`` hold the same elements on every rank (element-wise together)."""
        if other is self:
            return True
        return other.shape == self.shape and other.ranges == self.ranges and other.group is self.group


# ------------------------------------------------------------------------------------------------------------------
# Whose code reads


_STATE = threading.local()
#: Callers whose reads stay local: the engine, FairScale, Lightning's bookkeeping, the optimizers' step...
_LOCAL_CALLERS = (
    "lightning_fairscale.", "fairscale.", "lightning.", "pytorch_lightning.", "lightning_fabric.", "torch.optim.",
    "torch.distributed.", "torch.nn.modules.module", "torch.serialization", "torch._utils", "torch.utils.hooks",
    "torch.amp.", "torch.cuda.amp.",
)
#: Torch's Python entry points between the user's call and ``__torch_function__``: skipped to find the caller.
_TORCH_ENTRIES = ("torch.overrides", "torch.functional", "torch._tensor", "torch.nn.functional", "torch.nn.parameter")
#: Code object -> True (a local caller), False (the user's), None (an entry point to look past).
_CALLERS: dict[types.CodeType, Optional[bool]] = {}


@contextlib.contextmanager
def local_reads() -> Iterator[None]:
    """Inside, sharded parameters and gradients are this rank's plain local slices (no collective)."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def local_steps(optimizer: Optimizer) -> tuple[RemovableHandle, RemovableHandle]:
    """Make ``optimizer``'s steps run with plain local tensors at torch's own speed: ``__torch_function__`` off for
    the step (an element-wise optimizer's dozen operations per parameter would each pay it), on again for the
    closure the step calls (Lightning's closure runs ``training_step`` and the backward, which read as the user's
    code). The handles of the two hooks (they live with the optimizer)."""

    def before(_: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        end_steps()  # a step that raised never ran its post-hook
        guard = plain_torch_functions()
        guard.__enter__()
        _STATE.steps = [*getattr(_STATE, "steps", []), (guard, _foreach_as_for_plain_tensors(optimizer))]
        if len(args) > 1 and callable(args[1]):  # torch passes the optimizer itself first
            args = (args[0], _closure_with_reads(args[1]), *args[2:])
        elif callable(kwargs.get("closure")):
            kwargs = {**kwargs, "closure": _closure_with_reads(kwargs["closure"])}
        return args, kwargs

    def after(*_: Any) -> None:
        end_steps()

    return optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)


def _closure_with_reads(closure: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        try:
            with torch_functions_again():
                return closure()
        except BaseException:
            end_steps()  # the step ends here, without its post-hook: the user's reads are whole again
            raise

    return run


def _foreach_as_for_plain_tensors(optimizer: Optimizer) -> list[dict[str, Any]]:
    """torch's optimizers choose their ``foreach`` kernels by default (``foreach=None``) on CUDA for plain tensors
    only, not for tensor subclasses: for the step, such a group asks for them explicitly (what it gets for plain
    tensors); :func:`end_steps` gives it its ``None`` back. The groups changed."""
    changed = []
    for group in optimizer.param_groups:
        params = group.get("params") or []
        by_default = group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable")
        if by_default and params and all(p.is_cuda for p in params):
            group["foreach"] = True
            changed.append(group)
    return changed


def end_steps() -> None:
    """Leave the plain context of the optimizer steps still in it (one that raised, or the step just done)."""
    steps = getattr(_STATE, "steps", [])
    while steps:
        guard, changed = steps.pop()
        for group in changed:
            group["foreach"] = None
        guard.__exit__(None, None, None)


def reads_locally() -> bool:
    if getattr(_STATE, "depth", 0):
        return True
    frame = sys._getframe(3)  # 0: here, 1: sharded_reads' dispatch, 2: __torch_function__, 3: the caller
    while frame is not None:
        code = frame.f_code
        kind = _CALLERS.get(code, 0)
        if kind == 0:
            module = frame.f_globals.get("__name__") or ""
            local = module.startswith(_LOCAL_CALLERS)
            kind = _CALLERS[code] = None if module.startswith(_TORCH_ENTRIES) else local
        if kind is not None:
            return bool(kind)
        frame = frame.f_back  # type: ignore[assignment]
    return False


# ------------------------------------------------------------------------------------------------------------------
# Collectives with autograd


def group_world(group: Optional[ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class SumAcrossShards(torch.autograd.Function):
    """The sum of every rank's ``part``; backward: the average of every rank's upstream gradient (DDP's)."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, group: Optional[ProcessGroup]) -> Tensor:
        ctx.group = group
        total = part.detach().clone()
        if group_world(group) > 1:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _averaged(grad, ctx.group), None


def _averaged(grad: Tensor, group: Optional[ProcessGroup]) -> Tensor:
    world = group_world(group)
    grad = grad.detach().clone().contiguous()
    if world > 1:
        dist.all_reduce(grad, group=group)
        grad.div_(world)
    return grad


def gather(local: Tensor, layout: ShardLayout) -> Tensor:
    sizes = [hi - lo for lo, hi in layout.ranges]
    flat = local.detach().reshape(-1)
    if layout.world > 1 and group_world(layout.group) > 1:
        padded = flat.new_zeros(max(sizes))
        padded[: flat.numel()] = flat
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=layout.group)
        flat = torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])
    return flat.view(layout.shape)


class Gather(torch.autograd.Function):
    """The whole parameter from every rank's slice; backward: this rank's slice of the averaged whole gradient."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, layout: ShardLayout) -> Tensor:
        ctx.layout = layout
        return gather(local, layout)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        layout = ctx.layout
        lo, hi = layout.ranges[layout.rank]
        return _averaged(grad, layout.group).reshape(-1)[lo:hi].clone(), None


def agree(layout: ShardLayout, kind: str) -> None:
    """The first time ``layout``'s parameter is read as ``kind``: wait (at most :data:`AGREEMENT_TIMEOUT` seconds)
    for every rank of its group to make the same read, else fail here rather than hang in the collective."""
    if kind in layout.agreed:
        return
    if layout.world > 1 and dist.is_initialized() and group_world(layout.group) > 1:
        ranks = dist.get_process_group_ranks(layout.group) if layout.group is not None else range(layout.world)
        key = f"lightning_fairscale/reads/{layout.serial}/{kind}/"
        store = default_store()
        store.set(key + str(dist.get_rank()), "1")
        try:
            store.wait([key + str(r) for r in ranks], timedelta(seconds=AGREEMENT_TIMEOUT))
        except Exception:  # the store's timeout (DistStoreError), whatever its class in this torch
            raise RuntimeError(
                f"`{layout.name}` was read ({kind}) on rank {dist.get_rank()}, but not on every rank of its shard "
                f"group within {AGREEMENT_TIMEOUT:g} s. Under DDPFullyShardedStrategy each rank holds a slice of "
                "it, and reading the whole parameter (or its gradient) is a collective: read it on every rank (e.g. "
                "outside `if trainer.is_global_zero:`), or read this rank's slice explicitly with "
                "`lightning_fairscale.local_slice(param)` or inside `with lightning_fairscale.local_reads():`."
            ) from None
    layout.agreed.add(kind)
