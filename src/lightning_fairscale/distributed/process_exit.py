"""Close the process groups that this package's strategies made, for good, before the interpreter shuts down.

Lightning keeps the process group open after a stage (the Trainer may run again), so the groups live until the
process exits. Left to the interpreter's finalization, gloo's worker threads are stopped only when the last Python
object referencing a group is freed; when that happens while the interpreter is being torn down, a worker thread
that touches Python (releasing a tensor of a finished collective) is killed, and the C++ runtime aborts the process
("terminate called without an active exception", SIGABRT). The run succeeded, yet the process fails — and under
Lightning's launchers rank 1 dies silently while rank 0 exits 0.

``torch.distributed.destroy_process_group`` alone does not prevent it: it shuts the groups down and forgets them, but
gloo joins its threads only when the group objects are freed, and FairScale's objects keep them alive (FSDP's
``process_group``, ``ShardedDataParallel``'s and OSS's ``group``, a bucketer's buckets; our strategies hold the groups
they create) for as long as the Trainer or the sharded module is referenced — by a user's module-level ``trainer`` or
``model``, until finalization. So the ``atexit`` handler registered here, which runs while the interpreter is still
whole, destroys the groups, drops the references that those objects hold to them, and collects the garbage, so that
every group (and its threads) is gone before finalization begins.

Only what this package made is touched, recorded when it is made (nothing is searched for):

* the default group, when a strategy's set-up created it (:func:`close_process_group_at_exit` is told the default
  group from before the set-up). It is destroyed with every group (a group cannot outlive the default one). A
  default group the user created (``torch.distributed.init_process_group`` before the Trainer or Fabric) stays theirs:
  usable until they destroy it, in their own ``atexit`` handlers too;
* the groups the strategies make (:func:`record_groups`: FSDP's all-gather and reduce-scatter groups, the hybrid
  groups), destroyed one by one when the default group is the user's;
* the strategies, and the FairScale objects the engines build (:func:`release_at_exit`: FSDP units with their
  reduce-scatter bucketer, ``ShardedDataParallel``, OSS), held weakly: their references to groups are dropped.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch.distributed as dist

__all__ = [
    "close_process_group_at_exit",
    "closing_at_exit",
    "default_group",
    "record_groups",
    "release_at_exit",
]

_strategies: weakref.WeakSet[Any] = weakref.WeakSet()
#: The FairScale objects the engines built, whose references to process groups are dropped at exit.
_holders: weakref.WeakSet[Any] = weakref.WeakSet()
#: The groups the strategies made (torch's registry holds them anyway until they are destroyed).
_groups: list[dist.ProcessGroup] = []
#: The default group, when one of our strategies' set-up created it.
_default: Optional[dist.ProcessGroup] = None
_registered = False


def default_group() -> Optional[dist.ProcessGroup]:
    """The default process group of this process now, or ``None``: call before a set-up that may create it, and
    give the answer to :func:`close_process_group_at_exit` after it."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def close_process_group_at_exit(holder: object, default_before: Optional[dist.ProcessGroup]) -> None:
    """Have the groups that ``holder``'s set-up made closed, and freed, when the interpreter exits.

    Args:
        holder: a strategy (of either front end), which may keep process groups as attributes (dropped at exit).
        default_before: :func:`default_group` before the set-up: the default group is closed at exit only when the
            set-up created it.
    """
    global _default
    _strategies.add(holder)
    current = default_group()
    if current is not None and current is not default_before:
        _default = current
    _register()


@contextlib.contextmanager
def closing_at_exit(holder: object) -> Iterator[None]:
    """Around a strategy's set-up of its process groups (Lightning's ``setup_environment``): what it made is closed
    when the interpreter exits (see :func:`close_process_group_at_exit`)."""
    before = default_group()
    yield
    close_process_group_at_exit(holder, before)


def record_groups(*groups: Optional[dist.ProcessGroup]) -> None:
    """Record process groups a strategy made, to destroy at exit (``None`` and non-member placeholders skipped)."""
    _groups.extend(group for group in groups if isinstance(group, dist.ProcessGroup) and group not in _groups)
    _register()


def release_at_exit(*objects: Any) -> None:
    """Record FairScale objects an engine built (weakly): at exit, their references to process groups are dropped."""
    _holders.update(objects)
    _register()


def _register() -> None:
    global _registered
    if not _registered:
        atexit.register(_close_process_groups)
        _registered = True


def _close_process_groups() -> None:
    global _default
    if _default is not None and _default is default_group():
        dist.destroy_process_group()  # all of them: ours were made over it
    else:  # the user's default group (or none left): only ours go
        _destroy(_groups)
    _groups.clear()
    _default = None
    for obj in _with_reducers(list(_strategies) + list(_holders)):
        _drop_process_groups(obj)
    gc.collect()


def _destroy(groups: Iterable[dist.ProcessGroup]) -> None:
    for group in groups:
        with contextlib.suppress(ValueError):  # destroyed already (by the user, or with the default group)
            dist.destroy_process_group(group)


def _with_reducers(holders: list[Any]) -> list[Any]:
    """The holders, and the reduce-scatter bucketer of each FSDP unit among them (its buckets hold the group)."""
    reducers = [getattr(holder, "__dict__", {}).get("_reducer") for holder in holders]
    return holders + [reducer for reducer in reducers if reducer is not None]


def _drop_process_groups(obj: Any) -> None:
    """Empty each attribute of ``obj`` that is a process group, a tuple or list of them, or a dict keyed by them."""
    for name, value in list(getattr(obj, "__dict__", {}).items()):
        if isinstance(value, dist.ProcessGroup):
            obj.__dict__[name] = None
        elif isinstance(value, (tuple, list)) and value and all(isinstance(v, dist.ProcessGroup) for v in value):
            obj.__dict__[name] = type(value)()
        elif dataclasses.is_dataclass(value) and any(_refers_to_group(v) for v in vars(value).values()):
            obj.__dict__[name] = None  # e.g. a strategy's `ProcessGroups` (frozen: dropped whole)
        elif isinstance(value, dict) and any(_refers_to_group(key) for key in value):
            value.clear()  # e.g. a bucketer's buckets, keyed by (dtype, device, group)


def _refers_to_group(key: Any) -> bool:
    return isinstance(key, dist.ProcessGroup) or (
        isinstance(key, tuple) and any(isinstance(k, dist.ProcessGroup) for k in key)
    )
