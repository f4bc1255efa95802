"""Checkpoint checks shared by the FairScale strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_fairscale.checkpoint.legacy import CurrentOptimizer, OptimizerStatePolicy, adopt_optimizer_states


#: The warning when a checkpoint without optimizer state is resumed (see :func:`restores_optimizer_states`).
NO_OPTIMIZER_STATE = (
    "The checkpoint holds no optimizer state: it was saved where no optimizer existed (in the process that launched a"
    " spawned `fit` whose ranks did not gather the sharded optimizer state, by Lightning's own `ddp_spawn`, or after"
    " `validate`, `test` or `predict` only). Training continues from its weights and progress with a fresh optimizer"
    " state, as `configure_optimizers` made it."
)


def optimizer_states(
    checkpoint: Mapping[str, Any], optimizers: Sequence[Any], warn: Callable[[str], Any]
) -> list[dict[str, Any]]:
    """The checkpoint's optimizer states, one per optimizer, or none (see :func:`restores_optimizer_states`)."""
    states = checkpoint["optimizer_states"]
    return states if restores_optimizer_states(len(states), len(optimizers), warn) else []


def restores_optimizer_states(saved: int, optimizers: int, warn: Callable[[str], Any]) -> bool:
    """Whether to load a checkpoint's ``saved`` optimizer states into ``optimizers`` optimizers.

    ``False``, after ``warn`` got :data:`NO_OPTIMIZER_STATE`, when it holds none: a file written where no optimizer
    existed resumes with a fresh optimizer state. Any other difference is an error (:func:`check_optimizer_count`).

    Example:
        >>> restores_optimizer_states(0, 1, warn=lambda message: print(message[:40]))
        The checkpoint holds no optimizer state:
        False
    """
    if saved == 0 and optimizers:
        warn(NO_OPTIMIZER_STATE)
        return False
    check_optimizer_count(saved, optimizers)
    return True


def check_optimizer_count(saved: int, optimizers: int) -> None:
    """A ``ValueError`` that says what to do when a checkpoint holds another number of optimizer states."""
    if saved != optimizers:
        raise ValueError(
            f"The checkpoint holds {_count(saved, 'optimizer state')} but `configure_optimizers` returned"
            f" {_count(optimizers, 'optimizer')}: it was saved with other optimizers. Resume with the optimizers the"
            " checkpoint was saved with."
        )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def resumable_optimizer_states(
    checkpoint: Mapping[str, Any],
    optimizers: Sequence[Any],
    shapes: Sequence[Sequence[Sequence[Sequence[int]]]],
    policy: OptimizerStatePolicy,
    owner: str,
    warn: Callable[[str], Any],
) -> list[dict[str, Any]]:
    """:func:`optimizer_states`, those of a Lightning 1.x FairScale checkpoint in the plain layout (see
    :mod:`lightning_fairscale.checkpoint.legacy`); ``warn`` gets the message saying what was adopted, or that the
    checkpoint holds no optimizer state (then none are returned).

    ``optimizers`` are the user's optimizers (their class names go into the messages) and ``shapes``, for each, the
    shapes of its parameters by param group, in the order the user listed them.
    """
    if not optimizer_states(checkpoint, optimizers, warn):
        return []
    current = [CurrentOptimizer(type(opt).__name__, groups) for opt, groups in zip(optimizers, shapes)]
    states, note = adopt_optimizer_states(checkpoint, current, policy, owner)
    if note:
        warn(note)
    return states


class IncompatibleKeys(NamedTuple):
    """What a state dict and a model did not have in common, as ``torch.nn.Module.load_state_dict`` reports it."""

    #: The model's entries that the state dict lacks (their values were left as they were).
    missing_keys: list[str]
    #: The state dict's entries that the model has no place for (ignored).
    unexpected_keys: list[str]


#: The end of the error a strict load raises, by front end: how to load only what fits.
RELAX_TRAINER = "set `strict_loading = False` on the LightningModule (e.g. `self.strict_loading = False` in `__init__`)"
RELAX_FABRIC = "pass `strict=False` to `fabric.load` (or `fabric.load_raw`)"


def check_state_dict_fits(
    saved: Mapping[str, Any], expected: Mapping[str, Any], strict: bool, relax: str = RELAX_FABRIC
) -> IncompatibleKeys:
    """The keys that ``saved`` (a state dict, or key to shape) and ``expected`` (key to shape) do not share, checked
    before anything is loaded or gathered.

    Raises:
        ValueError: with ``strict``, keys differ (the message lists them and ends with ``relax``, how to load what
            fits); or, strict or not, shapes differ.

    Example:
        >>> saved = {"w": torch.zeros(2), "old": torch.zeros(1)}
        >>> check_state_dict_fits(saved, {"w": torch.Size([2]), "new": torch.Size([3])}, strict=False)
        IncompatibleKeys(missing_keys=['new'], unexpected_keys=['old'])
    """
    keys = IncompatibleKeys([k for k in expected if k not in saved], [k for k in saved if k not in expected])
    problems = []
    if strict and keys.missing_keys:
        problems.append(f"missing keys {_first(keys.missing_keys)}")
    if strict and keys.unexpected_keys:
        problems.append(f"unexpected keys {_first(keys.unexpected_keys)}")
    mismatched = [
        f"{k}: checkpoint {tuple(_shape(saved[k]))}, model {tuple(shape)}"
        for k, shape in expected.items()
        if k in saved and _shape(saved[k]) is not None and tuple(_shape(saved[k])) != tuple(shape)
    ]
    if mismatched:  # no strictness helps: the values cannot go into these parameters
        raise ValueError(
            f"The checkpoint's state_dict does not fit the model: different shapes for {_first(mismatched)}. It was"
            " saved from another model or configuration; load it into the model it was saved from."
        )
    if problems:
        raise ValueError(
            f"The checkpoint's state_dict does not fit the model: {'; '.join(problems)}. It was saved from another"
            " model or configuration; load it into the model it was saved from, or, to load what fits (the model's"
            f" entries that the checkpoint lacks keep their values, its other entries are ignored), {relax}."
        )
    return keys


def describe_partial_load(keys: IncompatibleKeys) -> str:
    """The warning that tells what a non-strict load left out (``""`` when the keys matched)."""
    missing, unexpected = keys
    parts = []
    if missing:
        parts.append(f"the model's entries that the checkpoint lacks keep their values ({len(missing)}): "
                     f"{_first(missing)}")
    if unexpected:
        parts.append(f"the checkpoint's entries that the model lacks were ignored ({len(unexpected)}): "
                     f"{_first(unexpected)}")
    return f"Loaded the checkpoint's state_dict with strict loading off: {'; '.join(parts)}." if parts else ""


def report_partial_load(keys: IncompatibleKeys) -> None:
    """Tell once (rank 0) what a load with strict loading off left out, as :func:`describe_partial_load` says it."""
    message = describe_partial_load(keys)
    if message:
        rank_zero_warn(message)


def _shape(value: Any) -> Any:
    """The shape of a state-dict entry (given as a tensor, or as its shape); ``None`` for what has none."""
    return value if isinstance(value, torch.Size) else getattr(value, "shape", None)


def _first(items: Sequence[str], count: int = 5) -> str:
    shown = ", ".join(items[:count])
    return f"[{shown}{f' and {len(items) - count} more' if len(items) > count else ''}]"
