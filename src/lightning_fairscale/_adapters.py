"""What the Trainer's and Fabric's strategies share about their constructors and names, without importing Lightning.

Each strategy of ours subclasses one Lightning class (the Trainer's or Fabric's ``DDPStrategy``) and holds its
engine's configuration (:class:`~lightning_fairscale.fsdp.config.FullyShardedConfig`,
:class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig`) as ``strategy.config``. Its constructor takes the
arguments of both: :func:`lightning_arguments` are those its Lightning base class gets, :func:`config_arguments` those
of the configuration. :func:`config_property` gives the strategy its options as attributes, and
:func:`register_strategies` its names in a Lightning registry.

This is adapter knowledge (the names of Lightning's arguments), kept apart from the engine; it imports no Lightning
module, so that the Trainer's adapters (``strategies/``, which need ``pytorch_lightning``), Fabric's (``fabric/``) and
their ``lightning`` flavour (:mod:`lightning_fairscale.lightning`) share this one module.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Literal, TypeVar

__all__ = [
    "LIGHTNING_ARGUMENTS",
    "check_spawn_start_method",
    "config_arguments",
    "config_property",
    "lightning_arguments",
    "register_strategies",
    "strategy_options",
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


#: The ``Args:`` entries of Lightning's arguments, for the Trainer's strategies and for Fabric's.
_LIGHTNING_DOCS = {
    "accelerator": "the accelerator; {front_end} sets it.",
    "parallel_devices": "the devices of this node; {front_end} sets them.",
    "cluster_environment": "the cluster environment; {front_end} sets it.",
    "checkpoint_io": "the checkpoint IO plugin (default: :class:`~lightning_fairscale.ShardedCheckpointIO`, which\n"
    "    writes each checkpoint file, and each sharded checkpoint directory, atomically).",
    "process_group_backend": '``"nccl"``, ``"gloo"``... (default: from the device).',
    "timeout": "how long collectives wait for the other ranks before failing.",
    "start_method": '``"popen"`` (re-run the script for each rank, the default) or ``"spawn"``/``"fork"``.',
}
_PRECISION_DOCS = {
    "Trainer": {
        "precision_plugin": "the precision plugin; the Trainer's ``precision`` flag chooses it.",
        "precision": "another name for ``precision_plugin`` (Fabric's).",
    },
    "Fabric": {
        "precision": "the precision plugin; Fabric's ``precision`` flag chooses it.",
        "precision_plugin": "another name for ``precision`` (the Trainer's).",
    },
}

Strategy = TypeVar("Strategy", bound=type)


def strategy_options(config_class: type, front_end: Literal["Trainer", "Fabric"]) -> Callable[[Strategy], Strategy]:
    """A class decorator that gives a strategy its options, declared once in ``config_class``: a
    :func:`config_property` for each field, and the ``Args:`` section of its docstring.

    The strategy's docstring lists in ``Args:`` only what is its own (``**kwargs``...); the section it gets holds
    an entry for every argument of its constructor, in the constructor's order: its own, else the configuration's
    (the ``Args:`` of ``config_class``'s docstring), else Lightning's, as the Trainer's or Fabric's strategies take
    them. A constructor argument nobody documents is an error here, at import.
    """

    def decorate(strategy: Strategy) -> Strategy:
        for field in dataclasses.fields(config_class):
            if field.name not in ("fairscale_kwargs", "owner") and field.name not in vars(strategy):
                setattr(strategy, field.name, config_property(field.name))
        lightning = {
            name: text.format(front_end=front_end)
            for name, text in {**_LIGHTNING_DOCS, **_PRECISION_DOCS[front_end]}.items()
        }
        known = {**lightning, **_args_entries(config_class.__doc__ or ""), **_args_entries(strategy.__doc__ or "")}
        parameters = list(inspect.signature(strategy.__init__).parameters.values())[1:]  # type: ignore[misc]
        names = [("**" if p.kind is inspect.Parameter.VAR_KEYWORD else "") + p.name for p in parameters]
        undocumented = [name for name in names if name not in known]
        if undocumented:
            raise TypeError(f"{strategy.__qualname__}: no `Args:` entry for {undocumented}.")
        entries = "\n".join(f"{name}: {known[name]}" for name in names)
        strategy.__doc__ = _with_args_section(strategy.__doc__ or "", entries)
        return strategy

    return decorate


def _args_entries(doc: str) -> dict[str, str]:
    """The entries of the ``Args:`` section of a Google-style docstring: name (``**kwargs`` with its stars) ->
    its text, continuation lines indented by four spaces."""
    section = _args_section(inspect.cleandoc(doc))
    entries: dict[str, str] = {}
    name = None
    for line in textwrap.dedent(section).splitlines():
        match = re.match(r"^(\**\w+): ?(.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name is not None and line.strip():
            entries[name] += "\n" + line
    return entries


def _args_section(doc: str) -> str:
    """The lines of the ``Args:`` section of a docstring cleaned by ``inspect.cleandoc`` (empty when it has none)."""
    match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n(?=[ \t]))*)", doc, flags=re.MULTILINE)
    return match.group(1) if match else ""


def _with_args_section(doc: str, entries: str) -> str:
    """``doc`` (a class docstring) with its ``Args:`` section made of ``entries``, indented as the section was."""
    clean = inspect.cleandoc(doc)
    body = textwrap.indent(entries, "    ") + "\n"
    if _args_section(clean) or "\nArgs:\n" in f"\n{clean}\n":
        clean = re.sub(r"^Args:\n((?:[ \t]+.*\n?|\n(?=[ \t]))*)", lambda _: "Args:\n" + body, clean, count=1,
                       flags=re.MULTILINE)
    else:
        clean = f"{clean}\n\nArgs:\n{body}"
    return clean


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
        "fairscale_kwargs": _without_base_defaults(arguments.get("self"), arguments["kwargs"]),
    }


def _without_base_defaults(strategy: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` less the arguments of the strategy's Lightning base class that hold that class's default.

    LightningCLI (jsonargparse) reads a strategy's ``**kwargs`` as going to the base class its constructor calls
    (``DDPStrategy``), and passes that class's own arguments with their defaults (``ddp_comm_hook=None``...):
    nothing was chosen, so nothing is lost. Such an argument with another value still fails, as any unknown one.
    """
    base = next((c for c in type(strategy).__mro__ if not c.__module__.startswith("lightning_fairscale")), object)
    try:
        parameters = inspect.signature(base).parameters if strategy is not None and base is not object else {}
    except (TypeError, ValueError):  # a class without a Python signature: nothing to drop
        parameters = {}
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    return {name: value for name, value in kwargs.items() if name not in defaults or defaults[name] is not value}


def config_property(name: str) -> Any:
    """A property of a strategy that reads its ``config.<name>``; setting it gives the strategy a copy of the config
    with the new value, checked as the constructor checks it (``strategy.state_dict_type = "sharded"``)."""

    def get(strategy: Any) -> Any:
        return getattr(strategy.config, name)

    def set_(strategy: Any, value: Any) -> None:
        strategy.config = dataclasses.replace(strategy.config, **{name: value})

    return property(get, set_, doc=f"The strategy's ``config.{name}``.")


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
