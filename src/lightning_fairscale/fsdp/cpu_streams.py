"""FairScale's FSDP on a host without CUDA: its stream calls and ``record_stream`` (workarounds 1 and 2 of
:mod:`lightning_fairscale.fsdp.units`)."""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, Optional

import torch
from fairscale.nn.data_parallel import fully_sharded_data_parallel as _fsdp_module
from torch import Tensor

__all__ = [
    "install",
    "is_installed",
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


_install_lock = threading.Lock()


_record_stream_library: Optional[torch.library.Library] = None


def is_installed() -> bool:
    """Whether the CPU workarounds are active in this process."""
    return isinstance(getattr(_fsdp_module, "torch", None), _TorchWithoutCuda)


def install() -> None:
    """Activate the workarounds 1 and 2 for this process. Idempotent; does nothing when CUDA is available.

    The strategy calls this before wrapping a module for a CPU run. Calling it yourself is only needed when you
    use :class:`FullyShardedDataParallel` directly on CPU, outside the Trainer.

    Example:
        >>> from lightning_fairscale.fsdp import cpu_streams
        >>> cpu_streams.install()
        >>> cpu_streams.is_installed() or torch.cuda.is_available()
        True
    """
    global _record_stream_library
    if torch.cuda.is_available():
        return
    with _install_lock:
        if _record_stream_library is None:
            library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - registering a missing kernel
            library.impl("record_stream", _record_stream_on_cpu, "CPU")
            _record_stream_library = library
        if not is_installed():
            _fsdp_module.torch = _TorchWithoutCuda("torch")  # type: ignore[attr-defined]


def _record_stream_on_cpu(tensor: Tensor, stream: Any) -> None:
    """CPU memory is not stream-ordered: there is nothing to record (workaround 2)."""
    return None
