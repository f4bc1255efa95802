"""Each option of a strategy declared once: a field of the strategy's frozen configuration, made by :func:`option`.

A configuration (:class:`~lightning_fairscale.fsdp.config.FullyShardedConfig`,
:class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig`) declares an option as
``name: Type = option(default, summary=..., doc=..., accepts=..., check=...)``: its name, the type the configuration
keeps, its default, the type the strategies' constructors take (``accepts``, as source text, when wider), the check
that turns a given value into the kept one (or raises, saying what to do), whether it may change after set-up, and
its documentation (a one-line ``summary`` and the full ``doc``). Everything else comes from that field:

* the configuration's checks (:func:`check_options`, from its ``__post_init__``) and its ``Args:``
  (:func:`documented`);
* written into the source by ``make options`` (``tools/generate_options.py``), where type checkers, editors and
  LightningCLI read them: the Trainer's and Fabric's constructors' parameters and ``Args:`` entries, and the typed
  attributes of the strategies (:mod:`lightning_fairscale._adapters.options`). ``tests/unit/test_declared_options.py``
  fails while the source differs from what the command writes.

Nothing here imports Lightning (nor torch): the engine's configurations use it.

Example:
    >>> import dataclasses
    >>> @documented
    ... @dataclasses.dataclass(frozen=True)
    ... class Config:
    ...     '''A configuration.'''
    ...     size: int = option(8, summary="the size.", doc="the size, a number.", check=lambda v, config: int(v))
    ...     def __post_init__(self) -> None:
    ...         check_options(self)
    >>> Config(size=2.0).size, [name for name, _ in declared(Config)]
    (2, ['size'])
    >>> print(Config.__doc__.split("Args:")[1].strip())
    size: the size, a number.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Optional, TypeVar

__all__ = ["Declaration", "check_options", "declared", "documented", "option"]

#: The key of a field's ``metadata`` that holds its :class:`Declaration`.
KEY = "lightning_fairscale.option"
_Config = TypeVar("_Config", bound=type)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What a configuration field declares about its option, besides its name, type and default."""

    #: One line: the constructors' ``Args:`` entry.
    summary: str
    #: The full documentation: the configuration's ``Args:`` entry and the strategies' attribute's docstring.
    doc: str
    #: The constructors' and the attribute setter's annotation, as source text; ``None``: the field's own.
    accepts: Optional[str] = None
    #: ``check(value, config)``: the value the configuration keeps (the fields before this one already checked);
    #: raises ``ValueError``/``TypeError`` saying what is accepted. ``None``: any value of the type.
    check: Optional[Callable[[Any, Any], Any]] = None
    #: Whether the option may change once the strategy is set up (it is read at each use: each save, each load).
    changeable: bool = False


def option(
    default: Any = dataclasses.MISSING,
    *,
    summary: str,
    doc: Optional[str] = None,
    accepts: Optional[str] = None,
    check: Optional[Callable[[Any, Any], Any]] = None,
    changeable: bool = False,
) -> Any:
    """A configuration field that declares one option of the strategies (see the module's docstring); ``doc``
    defaults to the ``summary``."""
    declaration = Declaration(inspect.cleandoc(summary), inspect.cleandoc(doc or summary), accepts, check, changeable)
    return dataclasses.field(default=default, metadata={KEY: declaration})


def declared(config_class: type) -> list[tuple[str, dataclasses.Field[Any]]]:
    """The options of ``config_class``, in their order: its fields made by :func:`option` (``InitVar`` ones too,
    which the configuration takes but does not keep)."""
    fields: dict[str, dataclasses.Field[Any]] = config_class.__dataclass_fields__  # type: ignore[attr-defined]
    return [(name, field) for name, field in fields.items() if KEY in field.metadata]


def declaration(field: dataclasses.Field[Any]) -> Declaration:
    """The :class:`Declaration` of an option's field."""
    return field.metadata[KEY]


def check_options(config: Any) -> None:
    """Replace each option of ``config`` (a frozen dataclass being built) by what its check keeps, in their order."""
    for name, field in declared(type(config)):
        check = declaration(field).check
        if check is not None and name in {f.name for f in dataclasses.fields(config)}:
            object.__setattr__(config, name, check(getattr(config, name), config))


def documented(config_class: _Config) -> _Config:
    """``config_class`` with an ``Args:`` section, one entry per option (its ``doc``), added to its docstring (before
    its ``Raises:``)."""
    entries = []
    for name, field in declared(config_class):
        first, *rest = declaration(field).doc.splitlines()
        entries.append("\n".join([f"    {name}: {first}", *(f"        {line}" if line else "" for line in rest)]))
    doc, raises, after = inspect.cleandoc(config_class.__doc__ or "").partition("\n\nRaises:\n")
    config_class.__doc__ = f"{doc}\n\nArgs:\n" + "\n".join(entries) + f"{raises}{after}\n"
    return config_class
