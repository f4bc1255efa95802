"""FairScale's FSDP on a host without CUDA: its stream calls and ``record_stream`` (workarounds 1 and 2 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`).

Both change process state: FairScale's FSDP module gets its own view of ``torch`` (module global ``torch``), and
``aten::record_stream`` a CPU kernel (a ``torch.library`` registration). They are held, counted, by what needs them:
each model a strategy wrapped to compute on the CPU holds them while it lives (:func:`hold_while_alive`; the Trainer's
``unshard_module()`` ends the hold at once), and when the last holder is gone FairScale's module has the ``torch``
it had and the kernel is deregistered, as if this package had never run. Not at the strategy's ``teardown``: the
model stays sharded after it, and FairScale's code still runs on it (``trainer.save_checkpoint``,
``unshard_module()``, the next stage, a Fabric model in the user's loop), which fails with "Torch not compiled with
CUDA enabled" without them. :func:`install` is the process-long hold for users of the FSDP class itself.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from typing import Any, Optional

import torch
from fairscale.nn.data_parallel import fully_sharded_data_parallel as _fsdp_module
from torch import Tensor, nn

__all__ = [
    "hold_while_alive",
    "install",
    "is_installed",
    "release",
]


class _CpuStream(torch.Stream):
    """A stream that orders nothing: CPU work already runs in program order."""

    def __new__(cls) -> _CpuStream:
        return super().__new__(cls, device="cpu")

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for on the CPU."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for on the CPU."""

    def synchronize(self) -> None:
        """Nothing to synchronize on the CPU."""


_CPU_STREAM = _CpuStream()


def _cpu_current_stream(device: Any = None) -> _CpuStream:
    return _CPU_STREAM


def _cpu_stream_context(stream: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _cpu_synchronize(device: Any = None) -> None:
    return None


def _cpu_new_stream(*args: Any, **kwargs: Any) -> _CpuStream:
    return _CPU_STREAM


class _CudaWithoutCuda(types.ModuleType):
    """``torch.cuda`` as FairScale's FSDP sees it on a host without CUDA (workaround 1).

    Stream calls become no-ops on one CPU stream; every other attribute is the real ``torch.cuda`` one.
    """

    current_stream = staticmethod(_cpu_current_stream)
    stream = staticmethod(_cpu_stream_context)
    synchronize = staticmethod(_cpu_synchronize)
    Stream = staticmethod(_cpu_new_stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithoutCuda(types.ModuleType):
    """``torch`` as FairScale's FSDP sees it on a host without CUDA: only ``cuda`` differs."""

    cuda = _CudaWithoutCuda("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# The workarounds are process state (FairScale's module global, a dispatcher registration), so they are counted: each
# holder (a wrapped model computing on the CPU, or `install`'s process-long hold) keeps them, and the last one to go
# undoes them. Re-entrant: a holder's finalizer may run (garbage collection) while this thread is inside `_acquire`.
_lock = threading.RLock()
_holds = 0
_pinned = False
#: The module's entry in ``torch.library``: the CPU kernel of ``aten::record_stream`` lives as long as this object.
_record_stream_library: Optional[torch.library.Library] = None
#: What FairScale's module held as ``torch`` before the workarounds were installed: given back when they are undone.
_fairscale_torch: Any = None


def is_installed() -> bool:
    """Whether the CPU workarounds are active in this process."""
    return isinstance(getattr(_fsdp_module, "torch", None), _TorchWithoutCuda)


def install() -> None:
    """Activate the workarounds 1 and 2 for the rest of this process. Idempotent; does nothing when CUDA is available.

    The strategies do not call this: they hold the workarounds for as long as a model they wrapped computes on the
    CPU (:func:`hold_while_alive`). Calling it yourself is only needed when you use :class:`FullyShardedDataParallel`
    directly on CPU, outside the Trainer and Fabric.

    Example:
        >>> from lightning_fairscale.fsdp.patches import cpu_streams
        >>> cpu_streams.install()
        >>> cpu_streams.is_installed() or torch.cuda.is_available()
        True
    """
    global _pinned
    if torch.cuda.is_available():
        return
    with _lock:
        if not _pinned:
            _pinned = True
            _acquire()


def hold_while_alive(root: nn.Module) -> Optional[weakref.finalize]:
    """Keep the workarounds active for as long as ``root`` (a wrapped model) lives, or until :func:`release` of the
    hold returned (kept by the model's owner, which takes one hold per model; ``None``: nothing held).

    FairScale's code runs on a sharded model after the strategy's ``teardown`` too (``trainer.save_checkpoint``,
    ``unshard_module()``, the next stage, a Fabric model in the user's loop), so the model holds the workarounds, not
    the strategy; once no model computing on the CPU is left, FairScale and torch are as they were. Does nothing
    when CUDA is available, or for a model computing on a GPU.
    """
    device = getattr(root, "compute_device", None)
    if torch.cuda.is_available() or device is None or device.type != "cpu":
        return None
    with _lock:
        _acquire()
        return weakref.finalize(root, _release)


def release(hold: Optional[weakref.finalize]) -> None:
    """End a hold of :func:`hold_while_alive` now (its model was unwrapped), rather than when its model is garbage
    collected; a hold ended already (or ``None``) stays as it is."""
    if hold is not None:
        hold()  # runs `_release` once: a finalizer called early does not run again


def _acquire() -> None:
    global _holds
    with _lock:
        _holds += 1
        if _holds == 1:
            _set_installed(True)


def _release() -> None:
    global _holds
    with _lock:
        _holds -= 1
        if _holds == 0:
            _set_installed(False)


def _set_installed(installed: bool) -> None:
    """Install or undo both workarounds. The kernel is deregistered by dropping its ``Library`` (torch ties the
    registration to the object's life); nothing can call it then: no model that needs it is left."""
    global _record_stream_library, _fairscale_torch
    if installed:
        library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - registering a missing kernel
        library.impl("record_stream", _record_stream_on_cpu, "CPU")
        _record_stream_library = library
        _fairscale_torch = _fsdp_module.torch
        _fsdp_module.torch = _TorchWithoutCuda("torch")
    else:
        _fsdp_module.torch = _fairscale_torch
        _record_stream_library = _fairscale_torch = None


def _record_stream_on_cpu(tensor: Tensor, stream: Any) -> None:
    """CPU memory is not stream-ordered: there is nothing to record (workaround 2)."""
    return None
