"""The names of a wrapped module's parameters and submodules as the user wrote them: FairScale's wrapper prefixes
taken out of paths, and the aliases a state dict needs for modules registered under two names."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_fairscale.fsdp.unit.instances import fsdp_instances, named_fsdp_instances

__all__ = [
    "add_aliases",
    "apply_aliases",
    "clean_path",
    "fairscale_ties",
    "is_wrapped",
    "state_aliases",
    "tied_aliases",
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


def state_aliases(root: nn.Module) -> list[tuple[str, str]]:
    """``(known, alias)`` pairs: the other names under which the plain module's state dict holds a tensor.

    * A module reachable under several names: ``known`` and ``alias`` are prefixes (ending with ``.``), and every key
      starting with ``known`` also exists starting with ``alias``. A layer can be both an attribute of the
      LightningModule and part of a container that the user wrapped (the documentation's manual-wrap example does
      this): FSDP saves its tensors under one name only; the plain module saves them under every name, and
      ``load_state_dict`` expects every name.
    * A tied parameter (:mod:`lightning_fairscale.fsdp.unit.ties`): ``known`` and ``alias`` are whole keys
      (``("embed.weight", "lm_head.weight")``), as torch's ``state_dict`` writes it under both.
    """
    paths: dict[int, list[str]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        clean = clean_path(path + ".") if path else ""
        if clean not in paths.setdefault(id(module), []):
            paths[id(module)].append(clean)
    pairs = [(known, alias) for names in paths.values() for known in names for alias in names if alias != known]
    return pairs + tied_aliases(root)


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def tied_aliases(root: nn.Module) -> list[tuple[str, str]]:
    """``(known key, alias key)`` for every second name of a tied parameter that FairScale flattened once."""
    pairs = []
    for path, unit in named_fsdp_instances(root):
        prefix = clean_path(path + ".") if path else ""
        for flat in unit.params[: unit._num_flatten_params]:
            for module_name, source_path, _, name, _, source_name in flat._shared_param_infos:
                known = clean_path(prefix + _joined(source_path, source_name))
                pairs.append((known, clean_path(prefix + _joined(module_name, name))))
    return pairs


def fairscale_ties(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    """The tied parameters' ``(known key, alias key)`` pairs recorded in FairScale's ``local_metadata_dict`` (each
    unit's ``shared_param_info``), for sharded checkpoints saved before :func:`state_aliases` recorded them. FairScale
    builds each path from one name's module and the other name's attribute, which is right when both names end alike
    (``embed.weight``, ``lm_head.weight``); both directions are given, and only a known key adds its alias."""
    pairs = []
    for unit in metadata.get("param_metadata", []):
        prefix = f"{unit['fsdp_path']}." if unit.get("fsdp_path") else ""
        for first, second in unit.get("shared_param_info", []):
            pairs += [(prefix + first, prefix + second), (prefix + second, prefix + first)]
    return pairs


def apply_aliases(state_dict: dict[str, Any], aliases: Iterable[Sequence[str]]) -> dict[str, Any]:
    """Add the keys :func:`state_aliases` names to ``state_dict`` (in place), and return it.

    A tied parameter's second key that ``state_dict`` already holds as a copy of the same values (FairScale's full
    state dict clones each name) becomes the known key's tensor itself, as in ``torch``'s own ``state_dict()``: a
    checkpoint then stores it once, and whoever reads it (:mod:`lightning_fairscale.fsdp.state.export`) sees the tie.

    Example:
        >>> apply_aliases({"blocks.0.weight": 1}, [("blocks.0.", "first.")])
        {'blocks.0.weight': 1, 'first.weight': 1}
        >>> apply_aliases({"embed.weight": 1}, [("embed.weight", "head.weight")])
        {'embed.weight': 1, 'head.weight': 1}
        >>> tied = apply_aliases({"a": torch.ones(2), "b": torch.ones(2)}, [("a", "b")])
        >>> tied["b"] is tied["a"]
        True
    """
    for known, alias in aliases:
        if not known.endswith("."):  # a tied parameter's whole key
            if known in state_dict:
                if _same_values(state_dict[known], state_dict.get(alias)):
                    state_dict[alias] = state_dict[known]
                state_dict.setdefault(alias, state_dict[known])
            continue
        for key in [k for k in state_dict if k.startswith(known)]:
            state_dict.setdefault(alias + key[len(known) :], state_dict[key])
    return state_dict


def _same_values(known: Any, copy: Any) -> bool:
    """Whether ``copy`` is a separate tensor with ``known``'s values (a pair recorded wrongly, naming another
    parameter, has other values or another shape: it is left alone)."""
    return (
        isinstance(known, torch.Tensor) and isinstance(copy, torch.Tensor) and copy is not known
        and copy.shape == known.shape and copy.dtype == known.dtype and copy.device == known.device
        and bool(torch.equal(copy, known))
    )


def add_aliases(state_dict: dict[str, Any], root: nn.Module) -> dict[str, Any]:
    """``state_dict`` with the keys of every tensor reachable under several names in ``root`` (see above)."""
    return apply_aliases(state_dict, state_aliases(root))
