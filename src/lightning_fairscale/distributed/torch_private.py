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

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import _Policy
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim.lr_scheduler import _LRScheduler

__all__ = [
    "ModuleIncompatibleKeys",
    "TorchPolicy",
    "TorchLRScheduler",
    "default_store",
    "in_backward",
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


def plain_torch_functions() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called: torch's own operations on their
    data (what ``torch.Tensor.__torch_function__`` runs its operation in)."""
    return torch._C.DisableTorchFunctionSubclass()


def torch_functions_again() -> Any:
    """Inside :func:`plain_torch_functions`: a context in which tensor subclasses' ``__torch_function__`` is called
    again."""
    return torch._C._EnableTorchFunction()
