"""All-gathers and reduce-scatters of CPU tensors over gloo, as direct exchanges between the ranks.

Why: gloo's own ``all_gather_single`` and ``reduce_scatter`` stage their tensors through buffers of their own (the
reduce-scatter copies its whole input) and run algorithms meant for many ranks. Between a few ranks of one machine
that is most of their cost. ``benchmarks/collectives.py`` measures one collective alone on 2 cores, 2 ranks, 1 thread
each (torch 2.13): for a 1.58 MB shard (one layer of ``benchmarks/speed.py``'s small model) gloo's all-gather took
2.43 ms and its reduce-scatter 3.70 ms, the exchanges here 1.31 and 1.70 ms; for a 9.5 MB shard (the whole small
model) 10.3 and 18.0 ms against 6.2 and 6.3 ms, where ``dist.all_reduce`` of the same gradient (DDP's collective)
took 12.3 ms.

An exchange is ``dist.isend``/``dist.irecv`` between every pair of ranks, straight from and into the tensors' memory
(gloo sends and receives unbound buffers over it: no staging copy). Each rank sends ``N - 1`` chunks and receives
``N - 1``, the bytes of gloo's ring algorithms. A reduce-scatter sums what it received on the caller's thread when it
is waited for, in rank order (rank 0's chunk plus rank 1's, and so on; the first peer's arrives in ``output``
itself). On 2 ranks that is ``a + b``, the same bits as gloo's sum (addition of two terms commutes); beyond, gloo
adds in an order of its own, and a result may differ from its in the last bit.

Both return a handle whose ``wait()`` completes the collective, so they start asynchronous work as gloo's collectives
with ``async_op=True`` do. Each kind has its own tag: a gather and a reduction in flight together between the same
ranks cannot take each other's messages, and each kind is started in the same order on every rank (FSDP's order of
units), which is all gloo's matching of messages needs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["Exchange", "all_gather", "is_gloo", "reduce_scatter", "usable"]

#: The message tags of the two kinds of exchange.
GATHER_TAG, REDUCE_TAG = 17, 18


def is_gloo(group: Optional[ProcessGroup]) -> bool:
    """Whether ``group`` is a gloo group that torch knows (``False`` for another backend, or a destroyed group)."""
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError, AttributeError):
        return False


def usable(group: Optional[ProcessGroup], *tensors: Tensor) -> bool:
    """Whether the exchanges here can replace gloo's collectives for ``tensors`` on ``group``: a gloo group of
    more than one rank, dense contiguous CPU tensors."""
    if not is_gloo(group) or dist.get_world_size(group) < 2:
        return False
    return all(t.device.type == "cpu" and t.is_contiguous() and not t.is_sparse for t in tensors)


class Exchange:
    """A started exchange of ``kind`` ``"all_gather"`` or ``"reduce_scatter"``: :meth:`wait` waits for its messages
    and finishes it (a reduce-scatter's sum), once."""

    def __init__(self, kind: str, works: list[Any], finish: Optional[Callable[[], None]] = None) -> None:
        self.kind = kind
        self._works = works
        self._finish = finish

    def wait(self) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return True


def _chunk(tensor: Tensor, index: int, size: int) -> Tensor:
    return tensor.narrow(0, index * size, size)


def all_gather(output: Tensor, shard: Tensor, group: Optional[ProcessGroup] = None) -> Exchange:
    """Start gathering every rank's ``shard`` (1-D, one size on every rank) into ``output`` (1-D, their
    concatenation in rank order)."""
    me, size = dist.get_rank(group), shard.numel()
    works = []
    for peer in range(dist.get_world_size(group)):
        if peer != me:
            works.append(dist.isend(shard, group=group, group_dst=peer, tag=GATHER_TAG))
            works.append(dist.irecv(_chunk(output, peer, size), group=group, group_src=peer, tag=GATHER_TAG))
    _chunk(output, me, size).copy_(shard)
    return Exchange("all_gather", works)


def reduce_scatter(output: Tensor, chunks: list[Tensor], group: Optional[ProcessGroup] = None) -> Exchange:
    """Start the sum over the ranks of their ``chunks[r]`` into ``output`` on each rank ``r`` (``chunks``: one 1-D
    tensor of ``output``'s size per rank). ``chunks`` must stay unchanged until the exchange is waited for."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [peer for peer in range(world) if peer != me]
    # The first peer's chunk arrives in ``output`` itself; the others' (beyond 2 ranks) in buffers of their own.
    received = {peer: (output if i == 0 else output.new_empty(output.shape)) for i, peer in enumerate(peers)}
    works = []
    for peer in peers:
        works.append(dist.isend(chunks[peer], group=group, group_dst=peer, tag=REDUCE_TAG))
        works.append(dist.irecv(received[peer], group=group, group_src=peer, tag=REDUCE_TAG))

    def finish() -> None:
        if not peers:  # a group of one
            output.copy_(chunks[me])
            return
        for rank in range(world):
            if rank != peers[0]:
                output.add_(chunks[me] if rank == me else received[rank])

    return Exchange("reduce_scatter", works, finish)
