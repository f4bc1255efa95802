"""The reduce-scatters in flight of a root's units on CPU (gloo): the other half of workaround 16 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`, beside the gathers ahead of
:mod:`~lightning_fairscale.fsdp.patches.prefetch`.

:class:`AsyncReduceScatter` replaces FairScale's reduce-scatter bucketer: each unit's gradient is reduce-scattered
asynchronously, straight from the gradient (no bucket to copy it into): between 2 ranks by an exchange of
:mod:`~lightning_fairscale.distributed.exchanges`, which receives the peer's chunk into the result itself; beyond, by
gloo in pieces of :data:`PIECE_BYTES` (gloo copies a reduce-scatter's whole input into a buffer of its own, a
unit-sized transient; a piece's is small). How many reductions are in flight the backward mode says
(:func:`~lightning_fairscale.fsdp.patches.prefetch.overlap`); all are done when the backward ends.

A module of its own: the reducer knows nothing of units or of the order of a pass (it reduces what it is given, and
waits when told), while the :class:`~lightning_fairscale.fsdp.patches.prefetch.Prefetcher` decides, from the units'
order and the memory budget, when its reductions are waited for.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fairscale.distributed import exchanges

__all__ = ["PIECE_BYTES", "AsyncReduceScatter", "pieces"]

#: The bytes of each rank's piece of a reduce-scatter by gloo (beyond 2 ranks; gloo's own buffer holds one piece per
#: thread at a time).
PIECE_BYTES = 4 * 2**20


_Reduction = tuple[list[Any], Tensor, list[Tensor], int, Optional[Callable[[Tensor], None]]]


class AsyncReduceScatter:
    """The reducer of a root's units on CPU (gloo), in place of FairScale's ``ReduceScatterBucketer``: the same
    interface (``reduce_scatter_async``, ``flush``, ``teardown``), each gradient reduce-scattered asynchronously, in
    pieces, as soon as it is computed, at most ``max_in_flight`` at a time (``0``: each is waited for at once);
    callbacks run on this thread, in order, when their reduction is waited for (the next call beyond the limit,
    :meth:`settle` or :meth:`flush`).

    Args:
        max_in_flight: how many reductions may be in flight.
        budget_bytes: how many bytes of gradients :meth:`settle` leaves in flight: the synchronous path's bucket
            holds that much (FairScale's ``bucket_cap_mb``), so small gradients may go on reducing while the next
            layers compute at no more memory than it.
    """

    def __init__(self, max_in_flight: int = 1, budget_bytes: int = 0) -> None:
        self.max_in_flight = max_in_flight
        self.budget_bytes = budget_bytes
        #: Each reduction in flight: its pieces' handles, its output, its inputs (and their bytes), its callback.
        self._in_flight: deque[_Reduction] = deque()
        #: The bytes of the gradients in flight.
        self.bytes_in_flight = 0

    def reduce_scatter_async(
        self, input_list: list[Tensor], group: ProcessGroup, callback_fn: Optional[Callable[[Tensor], None]] = None
    ) -> None:
        """Start reducing ``input_list`` (one 1-D chunk per rank) over ``group``; ``callback_fn`` gets this rank's
        reduced chunk."""
        while self._in_flight and len(self._in_flight) >= self.max_in_flight:
            self._complete_oldest()
        output = torch.empty_like(input_list[0])
        if len(input_list) == 2 and exchanges.usable(group, output, *input_list):
            # Between 2 ranks an exchange receives the peer's chunk into `output` itself: no buffer at all. Beyond,
            # it would hold N - 2 received chunks at once, where gloo's pieces hold a few pieces.
            works: list[Any] = [exchanges.reduce_scatter(output, input_list, group=group)]
        else:
            works = [
                dist.reduce_scatter(output[piece], [chunk[piece] for chunk in input_list], group=group, async_op=True)
                for piece in pieces(output.numel(), output.element_size())
            ]
        # The inputs stay referenced until their reduction is waited for: gloo reads them on its own threads.
        size = sum(chunk.numel() * chunk.element_size() for chunk in input_list)
        self._in_flight.append((works, output, input_list, size, callback_fn))
        self.bytes_in_flight += size
        if self.max_in_flight == 0:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        works, output, _, size, callback_fn = self._in_flight.popleft()
        for work in works:
            work.wait()
        self.bytes_in_flight -= size
        if callback_fn is not None:
            callback_fn(output)

    def settle(self, budget_bytes: Optional[int] = None) -> None:
        """Wait for the oldest reductions until at most ``budget_bytes`` (default :attr:`budget_bytes`) of gradients
        are in flight."""
        limit = self.budget_bytes if budget_bytes is None else budget_bytes
        while self._in_flight and self.bytes_in_flight > limit:
            self._complete_oldest()

    def flush(self) -> None:
        """Wait for every reduction started, and run their callbacks."""
        while self._in_flight:
            self._complete_oldest()

    def teardown(self) -> None:
        """Nothing is kept between backwards (FairScale's bucketer frees its buffers here)."""
        self.flush()


def pieces(numel: int, element_size: int, piece_bytes: Optional[int] = None) -> list[slice]:
    """The consecutive slices, of at most ``piece_bytes`` (:data:`PIECE_BYTES`) each, that cover ``numel``
    elements.

    Example:
        >>> pieces(10, 4, piece_bytes=16)
        [slice(0, 4, None), slice(4, 8, None), slice(8, 10, None)]
    """
    step = max(1, (piece_bytes or PIECE_BYTES) // element_size)
    return [slice(start, min(start + step, numel)) for start in range(0, numel, step)] or [slice(0, 0)]
