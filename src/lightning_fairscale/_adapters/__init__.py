"""What the Trainer's and Fabric's strategies share about their constructors and names, without importing Lightning.

Each strategy of ours subclasses one Lightning class (the Trainer's or Fabric's ``DDPStrategy``) and holds its
engine's configuration (:class:`~lightning_fairscale.fsdp.config.FullyShardedConfig`,
:class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig`) as ``strategy.config``. Its constructor takes the
arguments of both: :func:`lightning_arguments` are those its Lightning base class gets, :func:`config_arguments` those
of the configuration; :func:`register_strategies` puts its names in a Lightning registry. The options' typed
attributes, the mixin each strategy puts after Lightning's class, are :mod:`lightning_fairscale._adapters.options`.

This is adapter knowledge (the names of Lightning's arguments, when a strategy is set up), kept apart from the engine;
this package imports no Lightning module, so that the Trainer's adapters (``strategies/``, which need
``pytorch_lightning``), Fabric's (``fabric/``) and their ``lightning`` flavour (:mod:`lightning_fairscale.lightning`)
share it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Optional

__all__ = [
    "LIGHTNING_ARGUMENTS",
    "check_spawn_start_method",
    "config_arguments",
    "lightning_arguments",
    "register_strategies",
]

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
#: Every argument of a strategy's constructor that goes to Lightning, not to its configuration: those of
#: ``DDPStrategy`` and the precision plugin, as ``precision_plugin`` (the Trainer's name) or ``precision`` (Fabric's).
LIGHTNING_ARGUMENTS = (*_BASE_ARGUMENTS, "precision_plugin", "precision")


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


def config_arguments(config_class: type, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``config_class`` (a dataclass), from a strategy constructor's arguments (its
    ``locals()``): those named as its fields (its ``InitVar`` too), and the constructor's extra keyword arguments
    (``kwargs``) as ``fairscale_kwargs``.

    Every other argument must be one of Lightning's (:data:`LIGHTNING_ARGUMENTS`): a constructor argument that
    neither the configuration nor Lightning takes would be lost, so it raises a ``TypeError`` instead.

    Example:
        >>> from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig
        >>> config_arguments(ShardedDDPConfig, {"self": None, "timeout": 5, "kwargs": {"reduce_buffer_size": 8}})
        {'fairscale_kwargs': {'reduce_buffer_size': 8}}
        >>> config_arguments(ShardedDDPConfig, {"self": None, "bucket_cap_mb": 25, "kwargs": {}})
        Traceback (most recent call last):
        ...
        TypeError: ShardedDDPConfig takes no argument `bucket_cap_mb`, and neither does Lightning: ...
    """
    names = set(inspect.signature(config_class).parameters) - {"fairscale_kwargs", "owner"}
    # `__class__`: in the `locals()` of a method that calls `super()`.
    unknown = set(arguments) - names - set(LIGHTNING_ARGUMENTS) - {"self", "kwargs", "__class__"}
    if unknown:
        name = sorted(unknown)[0]
        raise TypeError(
            f"{config_class.__name__} takes no argument `{name}`, and neither does Lightning: a strategy's arguments"
            f" are its configuration's ({', '.join(sorted(names))}) and Lightning's"
            f" ({', '.join(LIGHTNING_ARGUMENTS)})."
        )
    return {
        **{name: value for name, value in arguments.items() if name in names},
        "fairscale_kwargs": _without_base_defaults(_class_of(arguments.get("self")), arguments["kwargs"]),
    }


def _class_of(owner: Optional[object]) -> Optional[type]:
    return None if owner is None else type(owner)


def _without_base_defaults(strategy_class: Optional[type], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` less the arguments of the Lightning base class of ``strategy_class`` that hold that class's
    default.

    LightningCLI (jsonargparse) reads a strategy's ``**kwargs`` as going to the base class its constructor calls
    (``DDPStrategy``), and passes that class's own arguments with their defaults (``ddp_comm_hook=None``...):
    nothing was chosen, so nothing is lost. Such an argument with another value still fails, as any unknown one.
    """
    mro = strategy_class.__mro__ if strategy_class is not None else ()
    base = next((c for c in mro if not c.__module__.startswith("lightning_fairscale")), object)
    try:
        parameters = inspect.signature(base).parameters if base is not object else {}
    except (TypeError, ValueError):  # a class without a Python signature: nothing to drop
        parameters = {}
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    return {name: value for name, value in kwargs.items() if name not in defaults or defaults[name] is not value}


def register_strategies(
    registry: Any, strategy: type, names: Iterable[str], description: str, **init_params: Any
) -> None:
    """Register ``strategy`` under ``names`` with a Lightning registry (the Trainer's or Fabric's), where free:
    Lightning's own names (``"fsdp"``...) stay Lightning's, and registering again is no error."""
    for name in names:
        if name not in registry:
            registry.register(name, strategy, description=description, **init_params)


def check_spawn_start_method(start_method: str) -> None:
    """``DDPSpawnShardedStrategy`` starts its processes with multiprocessing: any ``start_method`` but ``"popen"``."""
    if start_method == "popen":
        raise ValueError(
            "`DDPSpawnShardedStrategy` starts its processes with multiprocessing; for `start_method='popen'` use"
            " `DDPShardedStrategy` (`strategy='ddp_sharded'`)."
        )

