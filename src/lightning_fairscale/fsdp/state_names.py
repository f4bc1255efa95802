"""The names of a wrapped module's parameters and submodules as the user wrote them: FairScale's wrapper prefixes
taken out of paths, and the aliases a state dict needs for modules registered under two names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from lightning_fairscale.fsdp.units import fsdp_instances

__all__ = [
    "add_aliases",
    "apply_aliases",
    "clean_path",
    "is_wrapped",
    "module_aliases",
]


_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_fpw_module.")


def clean_path(path: str) -> str:
    """A module path without FairScale's wrapper names, as the unwrapped module would name it.

    Example:
        >>> clean_path("_fsdp_wrapped_module._fpw_module.layer._fsdp_wrapped_module._fpw_module.weight")
        'layer.weight'
    """
    for name in _WRAPPER_NAMES:
        path = path.replace(name, "")
    return path


def is_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is, or contains, a FairScale FSDP unit."""
    return next(fsdp_instances(module), None) is not None


def module_aliases(root: nn.Module) -> list[tuple[str, str]]:
    """``(prefix, alias)`` pairs: every state-dict key starting with ``prefix`` also exists starting with ``alias``.

    A layer can be both an attribute of the LightningModule and part of a container that the user wrapped (the
    documentation's manual-wrap example does this). FSDP then saves its tensors under one name only; the plain
    module saves them under every name, and ``load_state_dict`` expects every name.
    """
    paths: dict[int, list[str]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        clean = clean_path(path + ".") if path else ""
        if clean not in paths.setdefault(id(module), []):
            paths[id(module)].append(clean)
    return [(known, alias) for names in paths.values() for known in names for alias in names if alias != known]


def apply_aliases(state_dict: dict[str, Any], aliases: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Add the keys :func:`module_aliases` names to ``state_dict`` (in place), and return it.

    Example:
        >>> apply_aliases({"blocks.0.weight": 1}, [("blocks.0.", "first.")])
        {'blocks.0.weight': 1, 'first.weight': 1}
    """
    for known, alias in aliases:
        for key in [k for k in state_dict if k.startswith(known)]:
            state_dict.setdefault(alias + key[len(known) :], state_dict[key])
    return state_dict


def add_aliases(state_dict: dict[str, Any], root: nn.Module) -> dict[str, Any]:
    """``state_dict`` with the keys of every module reachable under several names in ``root`` (see above)."""
    return apply_aliases(state_dict, module_aliases(root))
