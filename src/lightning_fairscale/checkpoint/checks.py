"""Checkpoint checks shared by the FairScale strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

from lightning_fairscale.checkpoint.legacy import CurrentOptimizer, OptimizerStatePolicy, adopt_optimizer_states


def optimizer_states(checkpoint: Mapping[str, Any], optimizers: Sequence[Any]) -> list[dict[str, Any]]:
    """The checkpoint's optimizer states, one per optimizer; a ``ValueError`` that says what to do otherwise."""
    states = checkpoint["optimizer_states"]
    check_optimizer_count(len(states), len(optimizers))
    return states


def check_optimizer_count(saved: int, optimizers: int) -> None:
    """A ``ValueError`` that says what to do when a checkpoint holds another number of optimizer states."""
    if saved != optimizers:
        raise ValueError(
            f"The checkpoint holds {saved} optimizer states but `configure_optimizers` returned"
            f" {optimizers} optimizers. Resume with the optimizers the checkpoint was saved with."
        )


def resumable_optimizer_states(
    checkpoint: Mapping[str, Any],
    optimizers: Sequence[Any],
    shapes: Sequence[Sequence[Sequence[Sequence[int]]]],
    policy: OptimizerStatePolicy,
    owner: str,
    warn: Callable[[str], Any],
) -> list[dict[str, Any]]:
    """:func:`optimizer_states`, those of a Lightning 1.x FairScale checkpoint in the plain layout (see
    :mod:`lightning_fairscale.checkpoint.legacy`); ``warn`` gets the message saying what was adopted.

    ``optimizers`` are the user's optimizers (their class names go into the messages) and ``shapes``, for each, the
    shapes of its parameters by param group, in the order the user listed them.
    """
    optimizer_states(checkpoint, optimizers)
    current = [CurrentOptimizer(type(opt).__name__, groups) for opt, groups in zip(optimizers, shapes)]
    states, note = adopt_optimizer_states(checkpoint, current, policy, owner)
    if note:
        warn(note)
    return states


def check_state_dict_fits(saved: Mapping[str, Any], expected: Mapping[str, Any], strict: bool) -> None:
    """Raise a ``ValueError`` that lists what differs when ``saved`` (a state dict) does not fit ``expected`` (key to
    shape), before FSDP gathers anything: missing and unexpected keys (with ``strict``) and shape mismatches."""
    problems = []
    if strict:
        missing = [k for k in expected if k not in saved]
        unexpected = [k for k in saved if k not in expected]
        if missing:
            problems.append(f"missing keys {_first(missing)}")
        if unexpected:
            problems.append(f"unexpected keys {_first(unexpected)}")
    mismatched = [
        f"{k}: checkpoint {tuple(saved[k].shape)}, model {tuple(shape)}"
        for k, shape in expected.items()
        if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(shape)
    ]
    if mismatched:
        problems.append(f"different shapes for {_first(mismatched)}")
    if problems:
        raise ValueError(
            f"The checkpoint's state_dict does not fit the model: {'; '.join(problems)}. It was saved from another"
            " model or configuration; load it into the model it was saved from."
        )


def _first(items: Sequence[str], count: int = 5) -> str:
    shown = ", ".join(items[:count])
    return f"[{shown}{f' and {len(items) - count} more' if len(items) > count else ''}]"
