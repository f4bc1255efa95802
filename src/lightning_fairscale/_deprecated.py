"""Lightning 1.x's names of this package's classes, kept as deprecated aliases.

Code written for Lightning 1.x's FairScale support, or for the original extension, imports its names from the module
paths it knew (``lightning_fairscale.precision.sharded_amp``...). Where a class has a new name, the module answers
the old one with the class itself through a module ``__getattr__`` (PEP 562), which warns on every access naming the
new name: importing the package warns about nothing, and ``isinstance`` checks hold either way.

Shared by both Lightning packages: the warning is Lightning's (``rank_zero_deprecation``, from
``lightning_utilities``), so it shows once per line of user code, from rank 0, as Lightning's own deprecations do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_deprecation

__all__ = ["deprecated_alias"]

#: Frames between ``warnings.warn`` and the code that accessed the alias: ``lightning_utilities``' ``_warn``,
#: ``rank_zero_warn``, its ``rank_zero_only`` wrapper, ``rank_zero_deprecation``, :func:`deprecated_alias`, the
#: module's ``__getattr__``; then the user's line (a unit test checks that the warning points there).
_USER_FRAME = 7


def deprecated_alias(module: str, name: str, namespace: Mapping[str, Any], renamed: Mapping[str, str]) -> Any:
    """The value of ``module.name`` for a module ``__getattr__``: the class that the old ``name`` now has another
    name for, found in the module's ``namespace`` (its ``globals()``) under ``renamed[name]``, with a deprecation
    warning that names the new one.

    Raises:
        AttributeError: ``name`` is not an old name (as for any missing attribute, so ``hasattr``, submodule
            imports and ``from module import *`` work as usual).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = deprecated_alias("pkg", "OldName", {"NewName": int}, {"OldName": "NewName"})
        >>> value is int, str(caught[0].message)
        (True, "`pkg.OldName` is Lightning 1.x's name of `NewName` and is deprecated. Use `from pkg import NewName`.")
    """
    if name not in renamed:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = renamed[name]
    rank_zero_deprecation(
        f"`{module}.{name}` is Lightning 1.x's name of `{new}` and is deprecated. Use `from {module} import {new}`.",
        stacklevel=_USER_FRAME,
    )
    return namespace[new]
