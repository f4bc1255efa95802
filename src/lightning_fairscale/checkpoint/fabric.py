"""Fabric's checkpoints, and the mapping between them and the Trainer's files, both ways.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})`` writes what Lightning's own Fabric
strategies write: the keys of the state, each module and optimizer replaced by its state dict, so that
``torch.load(path)["model"]`` is the model's state dict (as Fabric users, conversion scripts and LitGPT read it):

* the model (the module the strategy set up; the one module of the state otherwise) -> its full state dict, with the
  unwrapped module's keys (gathered on rank 0);
* each optimizer -> the state of a plain optimizer over the unwrapped module;
* every other object with ``state_dict`` and ``load_state_dict`` (LR schedulers, other modules...) -> its state
  dict; every other value as it is; ``filter`` as ``fabric.save`` defines it.

A sharded checkpoint (``state_dict_type="sharded"``, :mod:`lightning_fairscale.fsdp.state.sharded_checkpoint`) keeps the
model's and the optimizers' states in each rank's shard, and every other entry in its meta file under its own key; the
meta file's own record (:data:`~lightning_fairscale.checkpoint.files.FORMAT_KEY`) names the model's and the optimizers'
keys (:data:`~lightning_fairscale.checkpoint.files.FABRIC_RECORD`).

The Trainer's layout maps onto a Fabric state when Fabric loads a Trainer's checkpoint (:func:`restore`), and a
Fabric checkpoint onto the Trainer's layout when the Trainer resumes from one (:func:`to_trainer_layout`); the files
themselves stay as they were written:

================================  ==============================================================================
The Trainer's checkpoint          A Fabric checkpoint (``fabric.load``'s state)
================================  ==============================================================================
``"state_dict"``                  the model
``"optimizer_states"[i]``         the state's i-th optimizer (the Trainer: the file's i-th optimizer state)
``"lr_schedulers"[i]``            the state's i-th LR scheduler (the Trainer: the file's i-th scheduler state)
``"pytorch-lightning_version"``   left in the remainder (the Trainer: the running version)
everything else                   under its own key
================================  ==============================================================================

A Trainer's checkpoint is told by its ``"pytorch-lightning_version"``, which Fabric's checkpoints do not have. The
Trainer tells the entries of a Fabric checkpoint by their content: the model is the state dict that shares keys with
the LightningModule's, the optimizers are the optimizer state dicts (``"state"`` and ``"param_groups"``) and the
LR schedulers the scheduler state dicts (``"base_lrs"`` and ``"last_epoch"``), in the file's order. The files that
lightning-fairscale's Fabric strategies wrote before (the Trainer's layout, with the names of the state under
:data:`FABRIC_KEYS`) load by those names. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_fairscale.checkpoint.files import FABRIC_RECORD, FORMAT_KEY

__all__ = [
    "FABRIC_KEYS",
    "VERSION_KEY",
    "Restored",
    "Roles",
    "convert",
    "is_trainer_layout",
    "model_state_of",
    "optimizer_positions",
    "restore",
    "to_trainer_layout",
]

#: The entry of the files that lightning-fairscale's Fabric strategies wrote in the Trainer's layout (before they
#: wrote Fabric's): the names the state gave to the model, optimizers and LR schedulers. Read, never written.
FABRIC_KEYS = "lightning_fairscale_fabric"
#: The entry every Trainer checkpoint has, and Fabric's do not.
VERSION_KEY = "pytorch-lightning_version"
_STRICT_HINT = " To leave such entries as they are, pass `strict=False`."


@dataclass
class Roles:
    """Which keys of a Fabric state hold the model, the optimizers and the LR schedulers."""

    model: Optional[str] = None
    optimizers: list[str] = field(default_factory=list)
    schedulers: list[str] = field(default_factory=list)
    #: The model's keys a filtered sharded checkpoint holds (``None``: all of them).
    kept: Optional[list[str]] = None

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

    def record(self) -> dict[str, Any]:
        """What a sharded Fabric checkpoint records of the roles
        (:data:`~lightning_fairscale.checkpoint.files.FABRIC_RECORD`)."""
        record: dict[str, Any] = {"model": self.model, "optimizers": list(self.optimizers)}
        return record if self.kept is None else {**record, "kept": list(self.kept)}


def convert(
    state: Mapping[str, Any],
    roles: Roles,
    states: Mapping[str, dict[str, Any]],
    filter: Optional[Mapping[str, Callable[[str, Any], bool]]] = None,
) -> dict[str, Any]:
    """What ``fabric.save`` writes of ``state``: the model's and the optimizers' entries replaced by their states in
    ``states`` (by key: what the strategy made of them, full or this rank's shard), every other stateful object by its
    state dict, and ``filter`` applied as Fabric applies it (an entry that keeps none of its items is left out)."""
    converted: dict[str, Any] = {}
    for key, value in state.items():
        if key == roles.model or key in roles.optimizers:
            value = states[key]
        elif _stateful(value):  # other modules, LR schedulers...
            value = value.state_dict()
        if filter and key in filter and isinstance(value, dict):
            kept = {name: item for name, item in value.items() if filter[key](name, item)}
            if kept:
                converted[key] = kept
        else:
            converted[key] = value
    return converted


def is_trainer_layout(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` (a full file, or a sharded checkpoint's meta dict) is in the Trainer's layout."""
    return VERSION_KEY in checkpoint or FABRIC_KEYS in checkpoint


# ----------------------------------------------------------------------------------------------------------------
# Loading in Fabric


class Restored(NamedTuple):
    """What :func:`restore` leaves to the strategy: the checkpoint's entries the state did not ask for (``rest``),
    and the states of the model and the optimizers to load, each with its object, in the state's order (``loads``:
    the strategy loads them into its shards, the model with ``strict``)."""

    rest: dict[str, Any]
    loads: list[tuple[Any, dict[str, Any]]]


def restore(
    checkpoint: dict[str, Any], state: dict[str, Any], roles: Roles, strict: bool, loaded: bool = False
) -> Restored:
    """Restore ``state`` from ``checkpoint`` (either layout) in place, as ``fabric.load`` does, but for the model and
    the optimizers, whose states come back to load (:class:`Restored`); ``loaded``: the strategy has loaded them
    already (from the shards of a sharded checkpoint, whose meta dict is ``checkpoint``). Other modules load with
    ``strict``, other objects with ``load_state_dict``; plain values replace the state's.

    Raises:
        KeyError: with ``strict``, an entry of ``state`` is not in the checkpoint.
    """
    checkpoint = _from_trainer_layout(checkpoint, roles, strict) if is_trainer_layout(checkpoint) else dict(checkpoint)
    ours = {roles.model, *roles.optimizers} - {None}
    missing = [key for key in state if key not in checkpoint and not (loaded and key in ours)]
    if missing and strict:
        raise KeyError(f"The requested state has an entry {missing[0]!r} that the checkpoint does not.{_STRICT_HINT}")
    loads = []
    for key, obj in list(state.items()):
        if (loaded and key in ours) or key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if key in ours:
            loads.append((obj, value))
        elif isinstance(obj, Module):
            obj.load_state_dict(value, strict=strict)
        elif _stateful(obj):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return Restored(checkpoint, loads)


def _from_trainer_layout(checkpoint: Mapping[str, Any], roles: Roles, strict: bool) -> dict[str, Any]:
    """The Trainer's checkpoint (or a sharded one's meta dict) with its entries under the state's keys (see the
    module's table); what the state does not ask for stays under the Trainer's keys."""
    checkpoint = dict(checkpoint)
    names = checkpoint.pop(FABRIC_KEYS, None)  # written by lightning-fairscale's Fabric strategies before
    if names is not None:  # the version was theirs, not the user's
        checkpoint.pop(VERSION_KEY, None)
    if roles.model is not None and "state_dict" in checkpoint:
        checkpoint[roles.model] = checkpoint.pop("state_dict")
    for entry, keys, what in (
        ("optimizer_states", roles.optimizers, "optimizers"),
        ("lr_schedulers", roles.schedulers, "schedulers"),
    ):
        if keys and entry in checkpoint:
            saved = checkpoint.pop(entry)
            recorded = names.get(what) if names is not None else None
            for position, key in _positions(keys, recorded, len(saved), entry, strict):
                checkpoint[key] = saved[position]
        if checkpoint.get(entry) == []:
            del checkpoint[entry]
    return checkpoint


def _positions(
    keys: list[str], recorded: Optional[list[str]], count: int, entry: str, strict: bool
) -> list[tuple[int, str]]:
    """``(position in the checkpoint's list, key)`` of each of ``keys``: by name where the checkpoint recorded the
    names, else by position (a Trainer's checkpoint)."""
    what = "optimizer states" if entry == "optimizer_states" else "LR scheduler states"
    if recorded is not None:
        missing = [key for key in keys if key not in recorded]
        if missing and strict:
            raise KeyError(
                f"The checkpoint has no {what} saved as {missing} (it holds {recorded}). Load with the names it was"
                f" saved with.{_STRICT_HINT}"
            )
        return [(recorded.index(key), key) for key in keys if key in recorded]
    if count != len(keys):
        raise ValueError(
            f"The checkpoint holds {count} {what} and the state to load has {len(keys)}. A Trainer's checkpoint keeps"
            f" them in the order `configure_optimizers` returned them (its {entry!r}): load as many, in that order."
        )
    return list(enumerate(keys))


def optimizer_positions(meta: Mapping[str, Any], roles: Roles, count: int, strict: bool) -> list[tuple[int, str]]:
    """``(position in the shards' optimizer states, key)`` for each optimizer of the state to load from a sharded
    checkpoint whose meta dict (with its own record) is ``meta`` and whose shards hold ``count`` optimizer states."""
    record = meta.get(FORMAT_KEY, {}).get(FABRIC_RECORD)
    if record is not None:  # a Fabric checkpoint
        return _positions(roles.optimizers, record["optimizers"], count, "optimizer_states", strict)
    names = meta.get(FABRIC_KEYS)
    recorded = names.get("optimizers") if names is not None else None
    return _positions(roles.optimizers, recorded, count, "optimizer_states", strict)


def model_state_of(file: Mapping[str, Any], model_keys: Collection[str]) -> Mapping[str, Any]:
    """What ``fabric.load_raw(path, model)`` loads of a file: the file itself when it is a state dict (it shares
    keys with the model's), the model's entry of a checkpoint in either layout otherwise."""
    if any(key in model_keys for key in file) or not any(isinstance(value, Mapping) for value in file.values()):
        return file
    if is_trainer_layout(file) and isinstance(file.get("state_dict"), Mapping):
        return file["state_dict"]
    key = _model_entry(file, model_keys)
    return file[key] if key is not None else file


# ----------------------------------------------------------------------------------------------------------------
# Loading in the Trainer


def to_trainer_layout(checkpoint: Mapping[str, Any], version: str, model_keys: Optional[Collection[str]]) -> dict:
    """A Fabric checkpoint in the Trainer's layout (see the module's table), for the Trainer to resume from.

    Args:
        checkpoint: the full file, or a sharded checkpoint's meta dict (its model and optimizers are in the shards).
        version: the running Lightning's version, for ``"pytorch-lightning_version"``.
        model_keys: the keys of the LightningModule's state dict, to tell the model's entry; ``None`` for a meta
            dict.

    Raises:
        ValueError: no entry, or several, are state dicts of the LightningModule.
    """
    rest = dict(checkpoint)
    layout: dict[str, Any] = {}
    if model_keys is not None:
        key = _model_entry(rest, model_keys)
        if key is None:
            raise ValueError(
                f"The Fabric checkpoint holds no state dict of this LightningModule (its entries: {sorted(rest)}), so"
                " the Trainer cannot resume from it. Save the model in it: `fabric.save(path, {'model': model,"
                " 'optimizer': optimizer, ...})`."
            )
        layout["state_dict"] = rest.pop(key)
        layout["optimizer_states"] = [rest.pop(k) for k in list(rest) if _is_optimizer_state(rest[k])]
    layout["lr_schedulers"] = [rest.pop(k) for k in list(rest) if _is_scheduler_state(rest[k])]
    layout[VERSION_KEY] = version
    return {**rest, **layout}


def _model_entry(checkpoint: Mapping[str, Any], model_keys: Collection[str]) -> Optional[str]:
    """The key of the entry that is the model's state dict: of those that share keys with the model's, the one that
    shares most; among equals, the one named ``"model"``.

    Raises:
        ValueError: several entries share as many keys, and none is named ``"model"``.
    """
    wanted = set(model_keys)
    shared = {
        key: len(wanted.intersection(value))
        for key, value in checkpoint.items()
        if isinstance(value, Mapping) and not _is_optimizer_state(value)
    }
    most = max(shared.values(), default=0)
    if most == 0:
        return None
    best = [key for key, count in shared.items() if count == most]
    if len(best) == 1:
        return best[0]
    if "model" in best:
        return "model"
    raise ValueError(
        f"Several entries of the Fabric checkpoint ({best}) are state dicts of this model, and none is named 'model'."
        " Save the model under 'model', or the other modules in a file of their own."
    )


def _stateful(value: Any) -> bool:
    """Fabric's test of a stateful object (its ``_Stateful`` protocol)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == {"state", "param_groups"}


def _is_scheduler_state(value: Any) -> bool:
    return isinstance(value, Mapping) and {"base_lrs", "last_epoch"} <= set(value)
