"""FairScale 0.4.13's calls that recent torch deprecates, kept off the user's console (workaround 19 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`).

FairScale calls three things that torch warns about on every rank, with nothing a user can do about them:

* ``dist._all_gather_base`` (FSDP's parameter all-gathers) and ``dist._reduce_scatter_base`` (its gradient buckets):
  ``FutureWarning: ... is a private function and will be deprecated``, reported at ``torch/distributed/c10d_logger.py``
  whoever the caller is. FairScale's two modules that call them get a view of ``torch.distributed``
  (:class:`_DistributedView`, their module global ``dist``) in which these two names are torch's current functions
  for the same collective (:func:`lightning_fairscale.distributed.collectives.current_name`: ``all_gather_single``
  and ``reduce_scatter_single`` on torch 2.13, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before);
  every other name is torch's own. Nothing is raised, so nothing is filtered, and the collectives are the same.
* ``Tensor.storage()`` (``UserWarning: TypedStorage is deprecated``), called inline all over FSDP's code. A warnings
  filter ignores exactly that message and category where the warning's location is a FairScale module
  (``module="fairscale\\."``): the same call in the user's code, or in any other package, still warns.

Why not ``warnings.catch_warnings()`` around our calls into FairScale: FSDP's backward hooks (which free storages and
reduce-scatter) run on the autograd engine's device threads under CUDA, and ``catch_warnings`` swaps the process's
one filter list, so it is not safe there; and each ``catch_warnings`` resets Python's record of the warnings already
shown, so a user's warning that Python shows once would be printed again after each of our calls. Both changes here
are made once, are thread-safe, and touch only FairScale's own calls. Nothing here depends on Lightning.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import torch.distributed as dist
from fairscale.nn.data_parallel import fully_sharded_data_parallel as _fsdp_module

from lightning_fairscale.distributed.collectives import current_name
from lightning_fairscale.distributed.fairscale_private import reduce_scatter_bucketer as _bucketer_module

__all__ = [
    "FAIRSCALE_MODULES",
    "STORAGE_FILTER",
    "install",
    "is_installed",
]

#: FairScale's modules that call ``dist._all_gather_base`` / ``dist._reduce_scatter_base``.
FAIRSCALE_MODULES = (_fsdp_module, _bucketer_module)

#: The deprecated names FairScale calls, given their current functions by :class:`_DistributedView`.
_RENAMED = ("_all_gather_base", "_reduce_scatter_base")

#: The filter of torch's ``TypedStorage`` warning where FairScale's code calls ``Tensor.storage()``:
#: ``(action, message, category, module)``, as ``warnings.filterwarnings`` takes them.
STORAGE_FILTER = ("ignore", "TypedStorage is deprecated", UserWarning, r"fairscale\.")


class _DistributedView(types.ModuleType):
    """``torch.distributed`` as FairScale's modules see it: its private collectives under their current names."""

    def __init__(self) -> None:
        super().__init__(dist.__name__, dist.__doc__)

    def __getattr__(self, name: str) -> Any:
        if name in _RENAMED:
            return current_name(name)  # looked up at each call: `recording_traffic` wraps torch's functions
        return getattr(dist, name)


#: Where FairScale's FSDP calls ``Tensor.storage()``: the location :func:`_storage_filter_applies` checks.
_FAIRSCALE_LOCATION = _fsdp_module.__name__


def _storage_filter_applies() -> bool:
    """Whether the first of the process's filters that matches FairScale's ``TypedStorage`` warning is ours."""
    action, message, category, module = STORAGE_FILTER
    text = "TypedStorage is deprecated. It will be removed in the future"
    for f_action, f_message, f_category, f_module, _ in warnings.filters:
        if (
            (f_message is None or f_message.match(text))
            and issubclass(category, f_category)
            and (f_module is None or f_module.match(_FAIRSCALE_LOCATION))
        ):
            return bool(
                f_action == action and f_category is category and getattr(f_message, "pattern", None) == message
                and getattr(f_module, "pattern", None) == module
            )
    return False


def install() -> None:
    """Give FairScale's modules the view of ``torch.distributed``, and put the ``TypedStorage`` filter first among
    those that match FairScale's warning (each FSDP unit calls it: a ``warnings.catch_warnings`` block or a
    ``simplefilter`` of the caller may have dropped or shadowed it since)."""
    for module in FAIRSCALE_MODULES:
        if not isinstance(module.dist, _DistributedView):
            module.dist = _DistributedView()
    if not _storage_filter_applies():
        action, message, category, module_pattern = STORAGE_FILTER
        warnings.filterwarnings(action, message=message, category=category, module=module_pattern)  # type: ignore[arg-type]


def is_installed() -> bool:
    """Whether FairScale's calls are kept quiet (:func:`install` has run and its filter is in place)."""
    return all(isinstance(m.dist, _DistributedView) for m in FAIRSCALE_MODULES) and _storage_filter_applies()
