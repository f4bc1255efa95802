"""Saying which process was lost when a collective fails, instead of gloo's or NCCL's "Connection reset by peer".

When a rank dies (killed, out of memory, a crash), the others fail in their next collective with an error about a
socket or a timeout that names no rank. Two sources say which ranks are gone:

* On a node's rank 0 started by Lightning's launcher, the launched processes themselves: one that has exited is
  lost, and that is known at once. This must be fast: the launcher's own watchdog thread polls its children every
  five seconds and SIGKILLs the whole node (printing only "Child process ... terminated") when it finds one dead.
* Otherwise the process group's store, which every rank can reach without collectives: each survivor leaves a key
  and waits two seconds for the others'. Ranks that leave none are reported lost. When the store itself is gone,
  the rank that hosts it (rank 0) is the one lost.
"""

from __future__ import annotations

import logging
import signal
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from lightning_fairscale.distributed.torch_private import default_store

__all__ = ["explain_collective_failure", "is_collective_failure", "report_collective_failure"]

log = logging.getLogger(__name__)

_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Timeout",
    # gloo, for every other operation in flight on a connection that an operation's timeout closed (several
    # exchanges of workaround 16 are in flight at once): the first to be waited for may not be the one that timed out.
    "timeout caused pair closure",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
    "gloo",
)


def is_collective_failure(exception: BaseException) -> bool:
    """Whether ``exception`` is a failed collective (a lost peer or a timeout) rather than an error of the model."""
    if isinstance(exception, getattr(dist, "DistError", ())):
        return True
    return isinstance(exception, RuntimeError) and any(sign in str(exception) for sign in _SIGNS)


def explain_collective_failure(
    exception: BaseException, timeout: Optional[timedelta], wait_s: float = 2.0, launcher: Any = None
) -> Optional[str]:
    """A sentence naming the lost ranks (or the timeout) when ``exception`` is a failed collective; else ``None``."""
    if not is_collective_failure(exception) or not dist.is_available() or not dist.is_initialized():
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    waited = f" within the timeout of {timeout.total_seconds():g} s" if timeout is not None else ""
    lost = _exited_children(rank, launcher) or _lost_ranks(rank, world_size, wait_s)
    if lost is None:
        who = "rank 0, which hosts the rendezvous store, is gone (killed or crashed)"
    elif lost:
        names = ", ".join(str(r) for r in lost)
        who = f"rank{'s' if len(lost) > 1 else ''} {names} did not answer (killed, crashed or stuck)"
    else:
        who = f"every rank is still running, so a collective did not complete{waited}"
    return (
        f"Rank {rank} of {world_size}: a collective failed because {who}. Look at the lost ranks' logs for their cause"
        " (for example out of memory, or the job scheduler killed them); restart from the last checkpoint."
    )


def report_collective_failure(exception: BaseException, timeout: Optional[timedelta], launcher: Any) -> None:
    """Log which ranks were lost when ``exception`` is a failed collective, and stop this node's other ranks.

    Called from the strategies' ``on_exception``. The processes this one launched (rank 0 of a node started by
    Lightning's launcher) could otherwise wait in a collective forever, or until their timeout.
    """
    message = explain_collective_failure(exception, timeout, launcher=launcher)
    if message is None:
        return
    log.error(message)
    if getattr(launcher, "procs", None):
        launcher.kill(signal.SIGKILL)


def _exited_children(rank: int, launcher: Any) -> list[int]:
    """The global ranks of the processes this one launched that have already exited (none when it launched none).

    Lightning's launcher starts local ranks 1..n-1 from local rank 0, so child ``i`` has global rank ``rank + i + 1``.
    """
    children = getattr(launcher, "procs", None) or []
    return [rank + i + 1 for i, child in enumerate(children) if child.poll() is not None]


def _lost_ranks(rank: int, world_size: int, wait_s: float) -> Optional[list[int]]:
    """The ranks that did not check in within ``wait_s`` seconds; ``None`` when the store cannot be reached."""
    try:
        store = default_store()
        prefix = "lightning_fairscale/alive/"
        store.set(f"{prefix}{rank}", "1")
        deadline = time.monotonic() + wait_s
        keys = [f"{prefix}{r}" for r in range(world_size)]
        while True:
            present = [r for r, key in enumerate(keys) if store.check([key])]
            if len(present) == world_size or time.monotonic() > deadline:
                return [r for r in range(world_size) if r not in present]
            time.sleep(0.2)
    except Exception:  # the store's host (rank 0) is gone, or the store timed out
        return None
