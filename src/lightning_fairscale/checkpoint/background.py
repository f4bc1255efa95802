"""Checkpoint files written in the background: one thread per CheckpointIO plugin, in the order they were asked for.

:class:`BackgroundWriter` runs a plugin's writes and removals one after another on a thread of its own, so that
training goes on while a checkpoint is written; :func:`snapshot` copies what a write will read, on the caller's thread,
so that the next optimizer step (which changes the parameters and the optimizer state in place) cannot reach the file.

What keeps a checkpoint safe is unchanged: every file is still written beside its target and renamed into place
(:mod:`lightning_fairscale.checkpoint.files`), so a process that dies during a background write leaves the previous
checkpoint whole. The order does the rest: a removal queued after a write (``ModelCheckpoint``'s top-k) runs only once
that write is in place, and after a failed write nothing queued behind it runs (the older checkpoints stay). An error
is kept until the owner asks for it (:meth:`BackgroundWriter.wait`, :meth:`BackgroundWriter.take_error`).

No Lightning import: the plugin (:class:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO`) and the
engine's sharded save (:func:`~lightning_fairscale.fsdp.state.saving.save_sharded`) share it.
"""

from __future__ import annotations

import threading
from copy import copy as shallow_copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

__all__ = ["BackgroundWriter", "settle", "snapshot"]


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that nothing else refers to: its tensors cloned (detached, on their device), its dicts, lists
    and tuples rebuilt; other values as they are (numbers, strings... that no step changes).

    A tensor that appears twice stays one tensor (one copy), so that a file keeps the sharing ``torch.save`` saw.

    Example:
        >>> live = {"w": torch.zeros(2)}
        >>> copy = snapshot(live)
        >>> _ = live["w"].add_(1)
        >>> copy["w"]
        tensor([0., 0.])
    """
    copies: dict[int, torch.Tensor] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in copies:
                copies[id(value)] = value.detach().clone()
            return copies[id(value)]
        if isinstance(value, dict):
            copied = shallow_copy(value)  # its type and attributes (a state dict's `_metadata`) stay
            for key, item in value.items():
                copied[key] = copy(item)
            return copied
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(copy(v) for v in value)
        return value

    return copy(obj)


class BackgroundWriter:
    """Runs checkpoint writes and removals on one background thread, in order.

    A failure is kept (the first one) until :meth:`wait` or :meth:`take_error` hands it over; until then, what was
    queued behind it is skipped, so that a removal never follows a write that failed. :meth:`cancel` makes a writer
    that waits for other processes' files (a sharded commit) give up: the strategies call it when a run fails.

    Pickling drops the thread (a spawn launcher pickles the strategy and its plugin before anything is written).

    Example:
        >>> writer = BackgroundWriter()
        >>> done = []
        >>> writer.submit(lambda: done.append(1))
        >>> writer.wait() is None, done
        (True, [1])
        >>> writer.close()
    """

    def __init__(self) -> None:
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: list[Future] = []
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        #: Set by :meth:`cancel`: a background action that waits for something gives up.
        self.cancelled = threading.Event()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def submit(self, action: Callable[[], Any]) -> None:
        """Run ``action`` on the background thread once everything queued before it is done."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-fairscale-checkpoint")
            self.cancelled.clear()

        def run() -> None:
            if self._error is not None:  # something before it failed: leave the files as they are
                return
            try:
                action()
            except BaseException as error:  # kept for the owner; the thread goes on
                with self._lock:
                    if self._error is None:
                        self._error = error

        self._pending = [future for future in self._pending if not future.done()]
        self._pending.append(self._executor.submit(run))

    @property
    def busy(self) -> bool:
        """Whether something queued has not finished yet."""
        return any(not future.done() for future in self._pending)

    def take_error(self) -> Optional[BaseException]:
        """The error of a background action that has failed so far (without waiting), which is then forgotten."""
        with self._lock:
            error, self._error = self._error, None
        return error

    def wait(self) -> Optional[BaseException]:
        """Wait until everything queued is done; return the first error since the last call (then forgotten)."""
        for future in self._pending:
            future.result()
        self._pending = []
        return self.take_error()

    def cancel(self) -> None:
        """Make a background action that waits for another process's files give up (see :attr:`cancelled`)."""
        self.cancelled.set()

    def close(self) -> Optional[BaseException]:
        """:meth:`wait`, then end the thread (a later :meth:`submit` starts another); returns the error, if any."""
        error = self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return error


def settle(writer: Optional[BackgroundWriter], agree: Callable[[bool], bool], wait: bool = True) -> None:
    """Every rank together: the background saves so far are done (with ``wait``; without it only those that have
    failed by now count) and succeeded everywhere (``agree``: the strategy's agreement of all ranks, a collective);
    otherwise every rank raises, the failed one its own error.

    The strategies call it before a save (so that a background failure ends every rank at the same point, and a
    sharded save starts once the previous one is complete) and before a load (a checkpoint is read once written).
    """
    error = None if writer is None else (writer.wait() if wait else writer.take_error())
    if agree(error is None):
        return
    if error is not None:
        raise error
    raise RuntimeError(
        "Another process failed to write a checkpoint in the background (its error is in its log). The previous"
        " checkpoint of that name, if any, is unchanged."
    )
