"""Checkpoint checks shared by the FairScale strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def optimizer_states(checkpoint: Mapping[str, Any], optimizers: Sequence[Any]) -> list[dict[str, Any]]:
    """The checkpoint's optimizer states, one per optimizer; a ``ValueError`` that says what to do otherwise."""
    states = checkpoint["optimizer_states"]
    if len(states) != len(optimizers):
        raise ValueError(
            f"The checkpoint holds {len(states)} optimizer states but `configure_optimizers` returned"
            f" {len(optimizers)} optimizers. Resume with the optimizers the checkpoint was saved with."
        )
    return states
