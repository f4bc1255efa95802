"""The collectives this package issues, with their tensors on the device the process group's backend needs.

NCCL takes CUDA tensors only (a CPU tensor fails with "No backend type associated with device type cpu"), but some
of the tensors that take part in our collectives live on the CPU: with ``cpu_offload`` FairScale keeps the parameter
shards, their gradients and therefore the optimizer state in CPU memory. Gloo takes tensors where they are. So every
collective of this package goes through the functions here, which

1. move the tensors to :func:`group_device` (for NCCL the current CUDA device, where Lightning has put this rank;
   for gloo the tensor's own device: nothing moves), and
2. bring the results back to where the caller had them: in place for ``all_reduce`` and ``reduce_scatter_tensor``,
   on the input's device for ``gather``.

Object collectives (``all_gather_object``) need nothing of this: PyTorch serialises the object into a tensor on the
group's device itself. They are here too, so that this module is the one list of our collectives. Collectives of
FairScale (FSDP's all-gathers and reduce-scatters, OSS's consolidation) and of Lightning (``barrier``,
``reduce_boolean_decision``) choose their devices themselves. FSDP's units on CPU move their parameters and gradients
by the point-to-point exchanges of :mod:`~lightning_fairscale.distributed.exchanges` (gloo only: nothing to move).

This module does not import Lightning: both Lightning packages share it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fairscale.distributed import exchanges

__all__ = [
    "all_agree",
    "all_equal",
    "all_gather_object",
    "all_reduce",
    "all_reduced_bytes",
    "forget_group",
    "gather",
    "group_device",
    "current_name",
    "gather_object",
    "point_to_point",
    "point_to_point_bytes",
    "recording_traffic",
    "reduce_scatter_tensor",
    "Transfer",
]


def _device_types(group: Optional[ProcessGroup]) -> set[str]:
    """The device types ``group``'s backends take tensors of, e.g. ``{"cuda"}`` for NCCL, ``{"cpu", "cuda"}`` for
    gloo, from its backend configuration (``"cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``, ``"cpu:gloo,cuda:nccl"``)."""
    config = dist.get_backend_config(group)
    return {pair.split(":", 1)[0].strip() for pair in config.split(",") if ":" in pair}


def _current_device(device_type: str) -> torch.device:
    """This process's current device of ``device_type``: ``cuda:<torch.cuda.current_device()>`` for CUDA."""
    module = getattr(torch, device_type, None)
    current = getattr(module, "current_device", None)
    return torch.device(device_type, current()) if callable(current) else torch.device(device_type)


def group_device(group: Optional[ProcessGroup], device: torch.device) -> torch.device:
    """Where a tensor on ``device`` must be for a collective on ``group``: ``device`` itself when the group's backend
    takes tensors there (gloo: any; NCCL: CUDA), else the current device of the type the backend takes (CUDA first).

    Example:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> group_device(None, torch.device("cpu"))
        device(type='cpu')
        >>> dist.destroy_process_group()
    """
    types = _device_types(group)
    if device.type in types or not types:
        return device
    return _current_device("cuda" if "cuda" in types else sorted(types)[0])


def _in_place(tensor: Tensor, group: Optional[ProcessGroup], collective: Callable[[Tensor], Any]) -> Tensor:
    """Run an in-place ``collective`` on ``tensor``, moved to the group's device and back when it must be."""
    device = group_device(group, tensor.device)
    moved = tensor if device == tensor.device else tensor.to(device)
    collective(moved)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


#: The bytes of the tensors :func:`all_reduce` has reduced in this process, by process group (``None``: the world).
_all_reduced: dict[Optional[ProcessGroup], int] = {}


def all_reduced_bytes(group: Optional[ProcessGroup] = None) -> int:
    """How many bytes of tensors this process has all-reduced over ``group`` through :func:`all_reduce` so far.

    Under hybrid sharding the gradient shards cross the nodes this way only (over the replica group), once per
    synchronising backward: the figure the documentation's traffic model is checked against.
    """
    return _all_reduced.get(group, 0)


def forget_group(group: ProcessGroup) -> None:
    """Drop what this module keeps about ``group`` (its :func:`all_reduced_bytes`), which is being destroyed: no
    reference here must keep a destroyed group alive."""
    _all_reduced.pop(group, None)
    _sent_bytes.pop(group, None)


def all_reduce(
    tensor: Tensor,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
) -> Tensor:
    """``dist.all_reduce`` of ``tensor``, in place, wherever ``tensor`` lives. Returns ``tensor``."""
    _all_reduced[group] = _all_reduced.get(group, 0) + tensor.numel() * tensor.element_size()
    return _in_place(tensor, group, lambda t: dist.all_reduce(t, op=op, group=group))


def all_agree(decision: bool, group: Optional[ProcessGroup] = None) -> bool:
    """Whether ``decision`` is true on every rank of ``group`` (the default group: all ranks); ``decision`` itself
    when no process group exists. A collective call, which fails after the group's timeout when a rank is lost.

    What Lightning's ``strategy.reduce_boolean_decision(decision, all=True)`` answers, without the strategy: the
    engine's sharded checkpoint ends each phase with it. Not counted in :func:`all_reduced_bytes` (no gradients).
    """
    if not dist.is_available() or not dist.is_initialized():
        return decision
    flag = torch.tensor(int(decision))
    _in_place(flag, group, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group))
    return bool(flag)


def all_equal(value: int, group: Optional[ProcessGroup] = None) -> bool:
    """Whether ``value`` (an int64) is the same on every rank of ``group``: one all-reduce of two integers (the
    maximum of the value and of its negation), on every rank alike. Not counted by :func:`all_reduced_bytes`."""
    both = torch.tensor([value, -value], dtype=torch.int64)
    _in_place(both, group, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
    return both.tolist() == [value, -value]


def broadcast(tensor: Tensor, src: int = 0, group: Optional[ProcessGroup] = None) -> Tensor:
    """``dist.broadcast`` of ``tensor`` from rank ``src``, in place, wherever ``tensor`` lives. Returns ``tensor``."""
    return _in_place(tensor, group, lambda t: dist.broadcast(t, src=src, group=group))


def gather(tensor: Tensor, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[list[Tensor]]:
    """Every rank's ``tensor`` (all of one shape), in rank order, on rank ``dst`` (a global rank); ``None`` on the
    other ranks. The results are on ``tensor``'s device.

    Where the group's device is another one (CPU shards on NCCL), the gathered tensors are there only until each
    has been copied back: the largest that our callers gather is one optimizer-state entry of one FSDP unit, no more
    than FSDP's own all-gather of that unit's parameters in the forward pass.
    """
    device = group_device(group, tensor.device)
    moved = tensor.to(device).contiguous()
    is_dst = dist.get_rank() == dst
    received = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))] if is_dst else None
    dist.gather(moved, received, dst=dst, group=group)
    if received is None:
        return None
    return [t.to(tensor.device) for t in received]


#: The collectives of one tensor in and one out, by the names torch has given them, newest first: torch 2.13
#: deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` (a ``FutureWarning`` at every call site) for the
#: ``*_single`` names, which older releases lack; the underscored names are FairScale's, deprecated since torch 2.2.
CURRENT_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather_into_tensor": ("all_gather_single", "all_gather_into_tensor"),
    "_all_gather_base": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "_reduce_scatter_base": ("reduce_scatter_single", "reduce_scatter_tensor"),
}


def current_name(name: str) -> Callable[..., Any]:
    """The function of ``torch.distributed`` that does what ``name`` does, under the newest name this torch has
    (not deprecated): ``current_name("all_gather_into_tensor")`` is ``dist.all_gather_single`` on torch 2.13,
    ``dist.all_gather_into_tensor`` before. Looked up at each call, so that :func:`recording_traffic` sees it."""
    for candidate in CURRENT_NAMES.get(name, (name,)):
        function = getattr(dist, candidate, None)
        if function is not None:
            return function
    raise AttributeError(f"torch.distributed has no {name} (nor any newer name of it)")


def reduce_scatter_tensor(
    output: Tensor,
    input: Tensor,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
) -> Tensor:
    """The reduce-scatter of ``input`` into ``output`` (in place), wherever ``output`` and ``input`` live: torch's
    ``reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13)."""
    reduce_scatter = current_name("reduce_scatter_tensor")
    device = group_device(group, input.device)
    if device == input.device == output.device:
        reduce_scatter(output, input, op=op, group=group)
        return output
    moved_output = output.to(device)
    reduce_scatter(moved_output, input.to(device), op=op, group=group)
    output.copy_(moved_output)
    return output


def all_gather_object(obj: Any, group: Optional[ProcessGroup] = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank. PyTorch picks the device for the group."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def gather_object(obj: Any, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[list[Any]]:
    """Every rank's ``obj`` (picklable), in rank order, on rank ``dst`` (a global rank); ``None`` elsewhere."""
    everyone: Optional[list[Any]] = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, everyone, dst=dst, group=group)
    return everyone


#: The message tag of :func:`point_to_point` (apart from the exchanges' tags: both may be in flight at once).
POINT_TO_POINT_TAG = 19


def point_to_point(
    sends: list[tuple[int, Tensor]], receives: list[tuple[int, Tensor]], group: Optional[ProcessGroup] = None
) -> None:
    """Send each ``(peer, tensor)`` of ``sends`` to that rank of ``group`` and receive each of ``receives`` from its
    peer, all at once (``torch.distributed.batch_isend_irecv``), and wait for them; the received tensors are filled
    in place, wherever they live. Two messages between the same pair of ranks match in the order each lists them.
    The bytes this rank sends are counted by :func:`point_to_point_bytes`."""
    if not sends and not receives:
        return
    _sent_bytes[group] = _sent_bytes.get(group, 0) + sum(_nbytes(t) for _, t in sends)
    ops = []
    back: list[tuple[Tensor, Tensor]] = []
    for peer, tensor in sends:
        moved = tensor.to(group_device(group, tensor.device)).contiguous()
        ops.append(dist.P2POp(dist.isend, moved, group=group, tag=POINT_TO_POINT_TAG, group_peer=peer))
    for peer, tensor in receives:
        device = group_device(group, tensor.device)
        target = tensor if device == tensor.device and tensor.is_contiguous() else torch.empty(
            tensor.shape, dtype=tensor.dtype, device=device
        )
        if target is not tensor:
            back.append((tensor, target))
        ops.append(dist.P2POp(dist.irecv, target, group=group, tag=POINT_TO_POINT_TAG, group_peer=peer))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for tensor, target in back:
        tensor.copy_(target)


#: The bytes :func:`point_to_point` has sent from this process, by process group (``None``: the world).
_sent_bytes: dict[Optional[ProcessGroup], int] = {}


def point_to_point_bytes(group: Optional[ProcessGroup] = None, every_group: bool = False) -> int:
    """How many bytes this process has sent through :func:`point_to_point` over ``group`` (``None``: the world) so
    far, or with ``every_group`` over all groups together (what the optimizers' whole path moves over the shard
    groups: ``benchmarks/whole_optimizers.py`` reports it)."""
    return sum(_sent_bytes.values()) if every_group else _sent_bytes.get(group, 0)


@dataclass(frozen=True)
class Transfer:
    """One collective call seen by :func:`recording_traffic`: its kind (``"all_gather"``, ``"reduce_scatter"`` or
    ``"all_reduce"``), the global ranks of its group, and its payload: the bytes of the whole tensor it gathers,
    scatters or reduces (a reduce-scatter's input, an all-gather's output)."""

    kind: str
    ranks: tuple[int, ...]
    nbytes: int


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


#: The collectives of ``torch.distributed`` that :func:`recording_traffic` counts: name -> (kind, payload of the
#: bound arguments). The underscored ones are the names FairScale calls (routed to the newest names by
#: :mod:`lightning_fairscale.fsdp.patches.deprecations`), the ``*_single`` ones torch 2.13's.
_RECORDED: dict[str, tuple[str, Callable[[dict[str, Any]], int]]] = {
    "all_gather": ("all_gather", lambda a: _nbytes(a["tensor"]) * len(a["tensor_list"])),
    "all_gather_single": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "_all_gather_base": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "reduce_scatter": ("reduce_scatter", lambda a: sum(_nbytes(t) for t in a["input_list"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "all_reduce": ("all_reduce", lambda a: _nbytes(a["tensor"])),
}


@contextlib.contextmanager
def recording_traffic() -> Iterator[list[Transfer]]:
    """Record the all-gathers, reduce-scatters and all-reduces that this process runs through ``torch.distributed``
    while inside: this package's, FairScale's (FSDP's parameter all-gathers and gradient reduce-scatters) and DDP's
    when its communication hook calls ``torch.distributed.all_reduce``; and the exchanges of
    :mod:`~lightning_fairscale.distributed.exchanges` (FSDP's units on CPU), each as the collective it replaces.
    Yields the list the calls are appended to.

    A measurement tool (``benchmarks/hybrid_traffic.py`` models the bytes each rank sends with it): while it is
    active, those functions of ``torch.distributed`` are wrapped; a collective that calls another (``_all_gather_base``
    calls ``all_gather_into_tensor``) counts once.
    """
    transfers: list[Transfer] = []
    originals = {name: getattr(dist, name) for name in _RECORDED if hasattr(dist, name)}
    depth = [0]

    def recorded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        kind, payload = _RECORDED[name]
        signature = inspect.signature(function)

        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                bound = signature.bind(*args, **kwargs).arguments
                group = bound.get("group") or dist.group.WORLD
                transfers.append(Transfer(kind, tuple(dist.get_process_group_ranks(group)), payload(bound)))
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    exchanged: dict[str, Callable[..., exchanges.Exchange]] = {
        "all_gather": exchanges.all_gather, "reduce_scatter": exchanges.reduce_scatter
    }

    def exchange(kind: str, function: Callable[..., exchanges.Exchange]) -> Callable[..., exchanges.Exchange]:
        @functools.wraps(function)
        def call(
            output: Tensor, inputs: Tensor | list[Tensor], group: Optional[ProcessGroup] = None
        ) -> exchanges.Exchange:
            payload = _nbytes(output) if kind == "all_gather" else sum(_nbytes(t) for t in inputs)
            transfers.append(Transfer(kind, tuple(dist.get_process_group_ranks(group or dist.group.WORLD)), payload))
            return function(output, inputs, group=group)

        return call

    for name, function in originals.items():
        setattr(dist, name, recorded(name, function))
    for kind, function in exchanged.items():
        setattr(exchanges, kind, exchange(kind, function))
    try:
        yield transfers
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        for kind, function in exchanged.items():
            setattr(exchanges, kind, function)
