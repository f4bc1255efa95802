"""Close the process groups, for good, before the interpreter shuts down.

Lightning keeps the process group open after a stage (the Trainer may run again), so the groups live until the
process exits. Left to the interpreter's finalization, gloo's worker threads are stopped only when the last Python
object referencing a group is freed; when that happens while the interpreter is being torn down, a worker thread
that touches Python (releasing a tensor of a finished collective) is killed, and the C++ runtime aborts the process
("terminate called without an active exception", SIGABRT). The run succeeded, yet the process fails — and under
Lightning's launchers rank 1 dies silently while rank 0 exits 0.

``torch.distributed.destroy_process_group`` alone does not prevent it: it shuts the groups down and forgets them, but
gloo joins its threads only when the group objects are freed, and FairScale's objects keep them alive (FSDP's
``process_group``, ``ShardedDataParallel``'s and OSS's ``group``; our strategies hold the groups they create) for as
long as the Trainer is referenced — by a user's module-level ``trainer``, until finalization. So the ``atexit``
handler registered here, which runs while the interpreter is still whole, destroys the groups, drops the references
that those objects hold to them, and collects the garbage, so that every group (and its threads) is gone before
finalization begins.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

import torch.distributed as dist
from fairscale.internal.reduce_scatter_bucketer import Bucket, ReduceScatterBucketer
from fairscale.nn import FullyShardedDataParallel
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

#: FairScale's classes whose instances keep a process group as an attribute.
_FAIRSCALE_HOLDERS = (FullyShardedDataParallel, ShardedDataParallel, OSS, ReduceScatterBucketer, Bucket)

_strategies: weakref.WeakSet[Any] = weakref.WeakSet()
_registered = False


def close_process_group_at_exit(holder: Any = None) -> None:
    """Have the process groups closed and freed when the interpreter exits.

    Args:
        holder: an object that keeps process groups as attributes (a strategy's
            :class:`~lightning_fairscale.fsdp.config.ProcessGroups`), dropped then too.
    """
    global _registered
    if holder is not None:
        _strategies.add(holder)
    if not _registered:
        atexit.register(_close_process_groups)
        _registered = True


def _close_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    holders: list[Any] = list(_strategies)
    # ``type(obj)``, not ``isinstance``: isinstance falls back to ``obj.__class__``, which some objects answer with a
    # deprecation warning (torch.distributed.reduce_op) printed at every exit.
    holders += [obj for obj in gc.get_objects() if issubclass(type(obj), _FAIRSCALE_HOLDERS)]
    for obj in holders:
        _drop_process_groups(obj)
    del holders
    gc.collect()


def _drop_process_groups(obj: Any) -> None:
    """Empty each attribute of ``obj`` that is a process group, a tuple or list of them, or a dict keyed by them."""
    for name, value in list(getattr(obj, "__dict__", {}).items()):
        if isinstance(value, dist.ProcessGroup):
            obj.__dict__[name] = None
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, dist.ProcessGroup) for v in value):
            obj.__dict__[name] = type(value)()
        elif isinstance(value, dict) and any(_refers_to_group(key) for key in value):
            value.clear()  # e.g. a bucketer's buckets, keyed by (dtype, device, group)


def _refers_to_group(key: Any) -> bool:
    return isinstance(key, dist.ProcessGroup) or (
        isinstance(key, tuple) and any(isinstance(k, dist.ProcessGroup) for k in key)
    )
