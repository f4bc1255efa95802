"""A process group that behaves like NCCL on a GPU, for CPU-only machines.

NCCL takes tensors on its device (CUDA) only: a collective on a CPU tensor fails. :class:`FakeNccl` gives the real
single-process gloo group the same rule, with the ``meta`` device standing in for CUDA:

* ``torch.distributed.get_backend_config`` says ``"meta:nccl"``: the backend's device is ``meta``;
* a fake GPU: ``tensor.to("meta")`` gives a tensor that says it is on ``meta`` but keeps its data in CPU memory
  (:class:`OnFakeGpu`), so gloo can still do the work; moving it to the CPU gives a plain tensor back;
* the collectives (``torch.distributed.all_reduce``, ``gather``...) refuse any tensor that is not on the fake GPU,
  with NCCL's message, and record the devices they saw;
* a second, phantom rank: ``all_reduce`` adds :attr:`FakeNccl.peer` to the result (``SUM``) or takes the maximum
  with it (``MAX``), as another rank's contribution would, so that a result which never comes back to the caller's
  tensor shows (on one real rank the reduction would change nothing).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

FAKE_GPU = torch.device("meta")
#: The collectives the fake backend checks (everything ``lightning_fairscale`` could call on a group).
CHECKED = ("all_reduce", "gather", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "broadcast")
CHECKED += tuple(name for name in ("reduce_scatter_single", "all_gather_single") if hasattr(dist, name))  # torch 2.13


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device ``Tensor.to(*args, **kwargs)`` moves to; ``None`` when it keeps the device (a dtype only)."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for arg in args[1:]:
        if isinstance(arg, (torch.device, str)):
            return torch.device(arg)
        if isinstance(arg, torch.Tensor):
            return arg.device
    return None


class OnFakeGpu(torch.Tensor):
    """CPU memory that says it is on :data:`FAKE_GPU`. What is computed from it stays there, until moved off."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `device` property
            return FAKE_GPU
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        moved_off = func is torch.Tensor.to and _target_device(args, kwargs) not in (None, FAKE_GPU)
        if func is torch.Tensor.cpu or moved_off:
            return result.as_subclass(torch.Tensor)  # moved off the fake GPU: a plain tensor
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            return args[0]  # in place: the tensor written to stays what it was
        return torch._tensor._convert(result, cls)


class _FakeGpuMode(TorchFunctionMode):
    """Makes ``tensor.to(FAKE_GPU)`` of a plain tensor give an :class:`OnFakeGpu` copy."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and _target_device(args, kwargs) == FAKE_GPU:
            tensor = args[0]
            return tensor if isinstance(tensor, OnFakeGpu) else tensor.detach().clone().as_subclass(OnFakeGpu)
        return func(*args, **kwargs)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class FakeNccl:
    """The default (gloo) group, as NCCL on a GPU would treat it. Use :meth:`active` around the code under test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.peer = 0.0
        #: (collective, devices of its tensor arguments), in call order.
        self.calls: list[tuple[str, list[torch.device]]] = []

    def _strict(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        def collective(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for value in (*args, *kwargs.values()) for t in _tensors(value)]
            devices = [t.device for t in tensors]
            self.calls.append((name, devices))
            for device in devices:
                if device != FAKE_GPU:
                    raise RuntimeError(f"No backend type associated with device type {device.type}")
            result = real(*args, **kwargs)
            if name == "all_reduce":
                tensor, op = args[0], kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
                with torch.no_grad():
                    if op == dist.ReduceOp.MAX:
                        tensor.clamp_(min=self.peer)
                    else:
                        tensor.add_(self.peer)
            return result

        return collective

    @contextlib.contextmanager
    def active(self) -> Iterator[FakeNccl]:
        """Inside: the default group is "NCCL" on the fake GPU."""
        with self._monkeypatch.context() as patch:
            patch.setattr(dist, "get_backend_config", lambda group=None: f"{FAKE_GPU.type}:nccl")
            for name in CHECKED:
                patch.setattr(dist, name, self._strict(name, getattr(dist, name)))
            with _FakeGpuMode():
                yield self

    def seen(self, name: str) -> list[list[torch.device]]:
        """The devices of the tensors of each call of the collective ``name``."""
        return [devices for called, devices in self.calls if called == name]
