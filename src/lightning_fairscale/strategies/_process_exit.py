"""Close the process group before the interpreter exits.

Lightning keeps the process group open after a stage (the Trainer may run again). Left open until the interpreter
shuts down, gloo's worker threads are destroyed while still joinable and the C++ runtime aborts the process
("terminate called without an active exception", SIGABRT) — a successful run then ends with a failed exit code,
which the spawn launcher reports as a crash. Destroying the group from an ``atexit`` handler runs before that.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def close_process_group_at_exit() -> None:
    """Register (once per process) the ``atexit`` handler that destroys the default process group."""
    global _registered
    if not _registered:
        atexit.register(_destroy_process_group)
        _registered = True
