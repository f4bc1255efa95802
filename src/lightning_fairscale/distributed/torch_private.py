"""Every private name of torch that lightning-fairscale uses, in one place.

torch may rename or remove a private name in any release; reaching them all through this module means an upgrade
breaks this one file, with an error that names what moved. No other module of the package imports a private torch
name or reads a private attribute of a torch module (``torch._C``, ``torch.distributed.distributed_c10d._...``):
``tests/unit/test_import_graph.py`` checks it. Lightning's private names live in :mod:`lightning_fairscale._compat`,
which imports Lightning; this module is the engine's, the lowest layer, importable without Lightning. FairScale's
private names and attributes live beside it, in :mod:`~lightning_fairscale.distributed.fairscale_private`.

Checked against torch 2.4 to 2.13.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as _clip_grad
from torch.distributed.fsdp.wrap import _Policy
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim.lr_scheduler import _LRScheduler

__all__ = [
    "ModuleIncompatibleKeys",
    "TorchPolicy",
    "TorchLRScheduler",
    "default_store",
    "in_backward",
    "has_total_norm_implementation",
    "total_norm_implementation",
    "set_total_norm_implementation",
    "plain_torch_functions",
    "torch_functions_again",
]

#: The base class of torch's FSDP auto-wrap policy objects (``ModuleWrapPolicy``, ``CustomPolicy``...).
TorchPolicy = _Policy
#: What ``nn.Module.load_state_dict`` returns (missing and unexpected keys).
ModuleIncompatibleKeys = _IncompatibleKeys
#: The base class of torch's LR schedulers (what Fabric's strategies are given with the model and optimizers).
TorchLRScheduler = _LRScheduler


def default_store() -> Any:
    """The key-value store of the default process group (the one every rank reached at its set-up)."""
    return dist.distributed_c10d._get_default_store()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (hooks, recomputed forwards)."""
    return torch._C._current_graph_task_id() != -1


#: The cell :func:`_total_norm_cell` found (its contents change; the cell does not).
_TOTAL_NORM_CELL: list[Any] = []


def _total_norm_cell() -> Any:
    """The closure cell of ``torch.nn.utils.get_total_norm`` (``clip_grad._get_total_norm``, a ``no_grad`` wrapper)
    that holds the function it runs: the one object through which every binding of ``get_total_norm`` and of
    ``clip_grad_norm_`` (which calls it by its module-level name), early ``from torch.nn.utils import ...`` included,
    computes a total norm.

    Raises:
        RuntimeError: this torch has no such cell (before 2.6, ``clip_grad_norm_`` computed its norm inline).
    """
    if _TOTAL_NORM_CELL:
        return _TOTAL_NORM_CELL[0]
    wrapper = getattr(_clip_grad, "_get_total_norm", None)
    inner = getattr(wrapper, "__wrapped__", None)
    closure = getattr(wrapper, "__closure__", None) or ()
    cells = [cell for cell in closure if inner is not None and cell.cell_contents is inner]
    if len(cells) != 1:
        raise RuntimeError(
            f"torch {torch.__version__} computes the norm of `torch.nn.utils.clip_grad_norm_` otherwise than torch"
            " 2.6 to 2.13, where lightning-fairscale makes it exact over sharded gradients."
        )
    _TOTAL_NORM_CELL.append(cells[0])
    return cells[0]


def has_total_norm_implementation() -> bool:
    """Whether this torch computes its total norms through one function that can be set
    (:func:`set_total_norm_implementation`): torch 2.6 and later."""
    try:
        _total_norm_cell()
    except RuntimeError:
        return False
    return True


def total_norm_implementation() -> Callable[..., Any]:
    """The function ``torch.nn.utils.get_total_norm`` and ``clip_grad_norm_`` compute a total norm with now
    (torch's own, undecorated: call it under ``torch.no_grad()``, or one set by
    :func:`set_total_norm_implementation`)."""
    return _total_norm_cell().cell_contents  # type: ignore[no-any-return]


def set_total_norm_implementation(function: Callable[..., Any]) -> None:
    """Make every binding of ``torch.nn.utils.get_total_norm`` and ``clip_grad_norm_`` compute total norms with
    ``function`` (same signature as ``get_total_norm``; run under ``torch.no_grad()``). Whoever sets it puts back
    what :func:`total_norm_implementation` gave before."""
    _total_norm_cell().cell_contents = function


def plain_torch_functions() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called: torch's own operations on their
    data (what ``torch.Tensor.__torch_function__`` runs its operation in)."""
    return torch._C.DisableTorchFunctionSubclass()


def torch_functions_again() -> Any:
    """Inside :func:`plain_torch_functions`: a context in which tensor subclasses' ``__torch_function__`` is called
    again."""
    return torch._C._EnableTorchFunction()
