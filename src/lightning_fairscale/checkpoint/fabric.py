"""Fabric's checkpoint state in the files the Trainer writes, and back.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})`` names its objects freely; a Lightning
checkpoint keeps the model's state under ``"state_dict"``, the optimizers' under ``"optimizer_states"`` (a list) and
the LR schedulers' under ``"lr_schedulers"``. The Fabric strategies write Lightning's layout, so that one file format
serves both, and every tool for it (``lightning-fairscale-consolidate``, resharding, ``load_from_checkpoint``)
applies to Fabric's checkpoints:

* the model (the module the strategy set up; the one module of the state otherwise) -> ``"state_dict"``, with the
  unwrapped module's keys;
* each optimizer, in the order of the state -> ``"optimizer_states"``, in the layout of a plain optimizer;
* each LR scheduler, in the order of the state -> ``"lr_schedulers"``;
* every other entry under its own key, and :data:`FABRIC_KEYS`, the names the state gave to each of these, and
  ``"pytorch-lightning_version"``, which the Trainer requires.

Loading maps them back by these names; a Trainer's checkpoint has no names, and maps by position (its first
optimizer to the state's first optimizer...). A checkpoint written by Fabric's own strategies (objects under their
own keys) loads too. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["FABRIC_KEYS", "Roles", "convert", "optimizer_positions", "restore", "to_checkpoint"]

#: The checkpoint entry that records under which names Fabric's state held the model, optimizers and schedulers.
FABRIC_KEYS = "lightning_fairscale_fabric"
#: Lightning's own entries: a Fabric state that uses these names for other things cannot be saved in its layout.
_LIGHTNING_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "pytorch-lightning_version", FABRIC_KEYS)
_STRICT_HINT = " To leave such entries as they are, pass `strict=False`."


@dataclass
class Roles:
    """Which keys of a Fabric state hold the model, the optimizers and the LR schedulers."""

    model: Optional[str] = None
    optimizers: list[str] = field(default_factory=list)
    schedulers: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, state: Mapping[str, Any], ours: Callable[[Module], bool]) -> Roles:
        """The roles in ``state``; ``ours`` tells the modules the strategy set up.

        Raises:
            ValueError: the state holds several modules the strategy set up (a checkpoint holds one model).
        """
        modules = [key for key, value in state.items() if isinstance(value, Module)]
        set_up = [key for key in modules if ours(state[key])]
        if len(set_up) > 1:
            raise ValueError(
                f"The state holds several models set up with the strategy ({', '.join(set_up)}), but a checkpoint holds"
                " one model. Save each model with its optimizers to a file of its own."
            )
        model = set_up[0] if set_up else (modules[0] if len(modules) == 1 else None)
        return cls(
            model=model,
            optimizers=[key for key, value in state.items() if isinstance(value, Optimizer)],
            schedulers=[key for key, value in state.items() if isinstance(value, LRScheduler)],
        )

    def keys(self) -> set[str]:
        return {*([self.model] if self.model else []), *self.optimizers, *self.schedulers}


def convert(
    state: Mapping[str, Any],
    roles: Roles,
    model_state: Callable[[Module], dict[str, Any]],
    optimizer_state: Callable[[Optimizer], dict[str, Any]],
    filter: Optional[Mapping[str, Callable[[str, Any], bool]]] = None,
) -> dict[str, Any]:
    """Fabric's state with its objects replaced by their state dicts (the model's and the optimizers' through the
    strategy: collective calls) and ``filter`` applied, as ``fabric.save`` documents it."""
    converted: dict[str, Any] = {}
    for key, value in state.items():
        if key == roles.model:
            value = model_state(value)
        elif key in roles.optimizers:
            value = optimizer_state(value)
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):  # other modules, schedulers...
            value = value.state_dict()
        if filter and key in filter and isinstance(value, dict):
            value = {name: item for name, item in value.items() if filter[key](name, item)}
        converted[key] = value
    return converted


def to_checkpoint(converted: Mapping[str, Any], roles: Roles, version: str) -> dict[str, Any]:
    """Lightning's checkpoint layout of a converted Fabric state (see the module's docstring).

    Raises:
        ValueError: the state uses one of Lightning's own names for something else.
    """
    taken = [key for key in _LIGHTNING_KEYS if key in converted and key not in roles.keys()]
    if taken:
        raise ValueError(
            f"The state's entries {taken} have names that Lightning's checkpoints use for the model, optimizers and"
            " LR schedulers, which the FairScale strategies save under them. Rename these entries."
        )
    checkpoint = {key: value for key, value in converted.items() if key not in roles.keys()}
    if roles.model is not None:
        checkpoint["state_dict"] = converted[roles.model]
    checkpoint["optimizer_states"] = [converted[key] for key in roles.optimizers]
    checkpoint["lr_schedulers"] = [converted[key] for key in roles.schedulers]
    checkpoint["pytorch-lightning_version"] = version
    checkpoint[FABRIC_KEYS] = {"model": roles.model, "optimizers": roles.optimizers, "schedulers": roles.schedulers}
    return checkpoint


def _positions(
    names: list[str], saved: Optional[list[str]], count: int, what: str, strict: bool
) -> list[tuple[int, str]]:
    """``(position in the checkpoint's list, key)`` of each of ``names``: by name where the checkpoint recorded the
    names, else by position (a Trainer's checkpoint)."""
    if saved is not None:
        missing = [name for name in names if name not in saved]
        if missing and strict:
            raise KeyError(
                f"The checkpoint has no {what} saved as {missing} (it holds {saved}). Load with the names it was saved"
                f" with.{_STRICT_HINT}"
            )
        return [(saved.index(name), name) for name in names if name in saved]
    if count != len(names) and names:
        raise ValueError(
            f"The checkpoint holds {count} {what} and the state to load has {len(names)}. A Trainer's checkpoint keeps"
            " them in the order `configure_optimizers` returned them: load as many, in that order."
        )
    return list(enumerate(names))


def optimizer_positions(checkpoint: Mapping[str, Any], roles: Roles, count: int, strict: bool) -> list[tuple[int, str]]:
    """``(position in the checkpoint's ``optimizer_states``, key)`` for each optimizer of the state to load."""
    saved = checkpoint.get(FABRIC_KEYS, {}).get("optimizers")
    return _positions(roles.optimizers, saved, count, "optimizer states", strict)


def restore(
    checkpoint: dict[str, Any],
    state: dict[str, Any],
    roles: Roles,
    strict: bool,
    load_model: Optional[Callable[[Module, dict[str, Any]], None]],
    load_optimizer: Optional[Callable[[Optimizer, dict[str, Any]], None]],
) -> dict[str, Any]:
    """Restore ``state`` from ``checkpoint`` in place (as ``fabric.load`` does); returns what was not restored.

    ``load_model`` and ``load_optimizer`` load the model's and the optimizers' states; ``None`` when they are loaded
    already (a sharded checkpoint's, which the strategy reads from the shards).

    Raises:
        KeyError: with ``strict``, an entry of ``state`` is not in the checkpoint.
    """
    checkpoint = dict(checkpoint)
    if roles.model is not None and load_model is not None:
        entry = "state_dict" if "state_dict" in checkpoint else roles.model
        if entry in checkpoint:
            load_model(state[roles.model], checkpoint.pop(entry))
        elif strict:
            raise KeyError(f"The checkpoint holds no model state ('state_dict' or {roles.model!r}).{_STRICT_HINT}")
    if load_optimizer is not None:
        _restore_listed(checkpoint, state, roles.optimizers, "optimizer_states", "optimizers", strict, load_optimizer)
    _restore_listed(checkpoint, state, roles.schedulers, "lr_schedulers", "schedulers", strict, None)
    if checkpoint.pop(FABRIC_KEYS, None) is not None:  # written by Fabric: the version is ours, not the user's
        checkpoint.pop("pytorch-lightning_version", None)
    for entry in ("optimizer_states", "lr_schedulers"):
        if checkpoint.get(entry) == []:
            del checkpoint[entry]
    others = [key for key in state if key not in roles.keys()]
    missing = [key for key in others if key not in checkpoint]
    if missing and strict:
        raise KeyError(f"The requested state has an entry {missing[0]!r} that the checkpoint does not.{_STRICT_HINT}")
    for key in others:
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if hasattr(state[key], "load_state_dict") and not isinstance(state[key], (Module, Optimizer)):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


def _restore_listed(
    checkpoint: dict[str, Any], state: dict[str, Any], names: list[str], entry: str, record_key: str, strict: bool,
    load: Optional[Callable[[Any, dict[str, Any]], None]],
) -> None:
    if not names:
        return
    if entry not in checkpoint:  # written by Fabric's own strategies: under their own keys
        for name in names:
            if name in checkpoint:
                (load or _load_state_dict)(state[name], checkpoint.pop(name))
            elif strict:
                raise KeyError(f"The requested state has an entry {name!r} that the checkpoint does not.{_STRICT_HINT}")
        return
    saved = checkpoint.pop(entry)
    record = checkpoint.get(FABRIC_KEYS, {}).get(record_key)
    what = "optimizer states" if entry == "optimizer_states" else "LR scheduler states"
    for position, name in _positions(names, record, len(saved), what, strict):
        (load or _load_state_dict)(state[name], saved[position])


def _load_state_dict(obj: Any, value: dict[str, Any]) -> None:
    obj.load_state_dict(value)
