"""The arguments that the FairScale strategies pass on to their Lightning base class (the Trainer's or Fabric's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["lightning_arguments"]

#: The arguments of Lightning's ``DDPStrategy`` (the Trainer's and Fabric's alike) that the strategies take too.
_BASE_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "process_group_backend",
    "timeout",
    "start_method",
)


def lightning_arguments(arguments: Mapping[str, Any], precision_name: str) -> dict[str, Any]:
    """The keyword arguments of the Lightning base strategy, from a strategy constructor's arguments.

    The precision plugin comes as ``precision_plugin`` (the Trainer's and Lightning 1.x's name) or as ``precision``
    (Fabric's); the base class takes it as ``precision_name``.

    Example:
        >>> arguments = dict.fromkeys(_BASE_ARGUMENTS) | {"precision_plugin": None, "precision": "plugin"}
        >>> lightning_arguments(arguments, "precision_plugin")["precision_plugin"]
        'plugin'
    """
    plugin, precision = arguments["precision_plugin"], arguments["precision"]
    if plugin is not None and precision is not None:
        raise ValueError(
            "Pass the precision plugin as `precision` or as `precision_plugin` (the same argument), not both."
        )
    base = {name: arguments[name] for name in _BASE_ARGUMENTS}
    return {**base, precision_name: plugin if precision is None else precision}
