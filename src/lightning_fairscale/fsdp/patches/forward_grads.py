"""A gradient shard beside a gathered parameter: workaround 26 of :mod:`lightning_fairscale.fsdp.patches.workarounds`.

Between steps a flat parameter keeps its gradient *shard* (FairScale's reduce-scatter set it; the optimizer's views
hold slices of it, :mod:`~lightning_fairscale.fsdp.unit.param_views`) until the next backward decides what to do with
it. During the next forward, FairScale points the same parameter's ``data`` at the *full* gathered parameter: for as
long as the unit computes, the parameter's ``data`` and ``grad`` have different sizes, which eager code never looks
at, but ``torch.compile`` does. A compiled region (workaround 18) reads the views of the gathered parameter, and
dynamo, which describes a view's base to build its fake tensors, copies the base's gradient onto a fake tensor of
the base's size: ``RuntimeError: attempting to assign a gradient of size '[2080]' to a tensor of size '[4160]'``.
That happens whenever dynamo compiles with a gradient held, that is at any compile after the first step: an
evaluation forward (``training`` changed: a new graph), a batch of another size, a ``torch._dynamo.reset()``. Every
backend failed so, and a model whose only compile happened at the first step trained.

:func:`gradients_set_aside` takes the gradients off the unit's flat parameters for its forward and gives the same
tensors back after it (FairScale's forward ends with the shards in ``data`` again), so that what dynamo sees is a
parameter without a gradient, and nothing else changes: the backward's hooks find the gradient where they always
did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import Tensor, nn

__all__ = ["gradients_set_aside"]


@contextlib.contextmanager
def gradients_set_aside(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Inside: no parameter of ``params`` (a unit's, before its forward: their shards in ``data``) holds a
    gradient of its shard's size; after: each has the one it had again.

    A gradient of another size (the whole parameter's, left by a ``no_sync`` backward) stays: it is the gathered
    parameter's size, which is what dynamo compares it with. After a forward that failed half-way (the gathered
    parameter still in ``data``) a gradient cannot be given back to a parameter of another size: it is dropped, as
    the step that failed would have replaced it.
    """
    held: list[tuple[nn.Parameter, Tensor]] = []
    for param in params:
        grad = param.grad
        # A gradient in another dtype than the shard (the half one of workaround 21, on one rank: where nothing is
        # sharded, the sizes never differ) stays: it could not be given back to the float32 shard.
        if grad is not None and grad.shape == param.shape and grad.dtype == param.dtype:
            held.append((param, grad))
            param.grad = None
    try:
        yield
    finally:
        for param, grad in held:
            if param.grad is None and param.shape == grad.shape:
                param.grad = grad
