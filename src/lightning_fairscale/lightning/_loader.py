"""Serves ``lightning_fairscale.lightning.<module>``: our Lightning-bound modules, bound to ``lightning.pytorch``.

``pytorch_lightning`` and ``lightning.pytorch`` are two copies of the same classes, and each Trainer accepts only its
own copy's strategies and plugins. Our strategies, precision plugins and CheckpointIO plugin subclass Lightning's, so
each package needs classes of its own, but their logic must not be written twice. This module therefore loads the
*same source files* a second time, under the name ``lightning_fairscale.lightning.<module>``, with their imports
renamed before compiling:

* ``pytorch_lightning[.x]`` becomes ``lightning.pytorch[.x]`` and ``lightning_fabric[.x]`` becomes
  ``lightning.fabric[.x]``;
* ``lightning_fairscale.<m>`` becomes ``lightning_fairscale.lightning.<m>`` when ``<m>`` is one of the modules in
  :data:`BOUND` (they subclass or register with Lightning), and stays as it is otherwise: FairScale glue, wrapping,
  optimizer layouts, the checkpoint file format and consolidation do not depend on which Lightning runs them, and
  both packages share them (one ``fsdp.units``, one ``CheckpointFileError``...).

Nothing else changes: the code compiles from the original file with its line numbers, so tracebacks, coverage and
debuggers point at the one source. This is what Lightning does itself to build ``lightning.pytorch`` from one source
tree, done here at import time instead of at packaging time.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import CodeType, ModuleType
from typing import Optional

#: The package whose Lightning-bound modules this loader serves again.
SOURCE_PACKAGE = "lightning_fairscale"
#: Where it serves them.
TARGET_PACKAGE = "lightning_fairscale.lightning"
#: The modules of the package that subclass or register with Lightning (relative names), packages marked by being
#: prefixes of others. Everything else is shared by both Lightning packages.
BOUND = (
    "_compat",
    "callbacks",
    "callbacks.model_summary",
    "fabric",
    "fabric._common",
    "fabric.fully_sharded",
    "fabric.sharded",
    "plugins",
    "plugins.checkpoint_io",
    "precision",
    "precision.fully_sharded",
    "precision.fully_sharded_amp",
    "precision.sharded",
    "precision.sharded_amp",
    "strategies",
    "strategies._callbacks",
    "strategies.fully_sharded",
    "strategies.sharded",
    "strategies.sharded_spawn",
)
#: Lightning's standalone packages, and where the unified ``lightning`` package has the same code.
RENAMED = {"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning.fabric"}


def _is_package(name: str) -> bool:
    return any(other.startswith(name + ".") for other in BOUND)


def renamed_module(module: str) -> str:
    """Where ``module`` (an absolute import) comes from in the ``lightning`` flavour of a bound module.

    Example:
        >>> renamed_module("pytorch_lightning.strategies")
        'lightning.pytorch.strategies'
        >>> renamed_module("lightning_fairscale.strategies.fully_sharded")
        'lightning_fairscale.lightning.strategies.fully_sharded'
        >>> renamed_module("lightning_fairscale.fsdp.units")
        'lightning_fairscale.fsdp.units'
    """
    top, _, rest = module.partition(".")
    if top in RENAMED:
        return RENAMED[top] + ("." + rest if rest else "")
    if top == SOURCE_PACKAGE and rest in BOUND:
        return f"{TARGET_PACKAGE}.{rest}"
    return module


class _RenameImports(ast.NodeTransformer):
    """Renames the modules of absolute imports as :func:`renamed_module` says; keeps every name they bind."""

    def __init__(self, filename: str) -> None:
        self.filename = filename

    def visit_Import(self, node: ast.Import) -> ast.Import:
        for alias in node.names:
            renamed = renamed_module(alias.name)
            if renamed == alias.name:
                continue
            if alias.asname is None:
                if "." in alias.name:  # binds the top package, whose renamed counterpart has another name
                    raise ImportError(
                        f"{self.filename}:{node.lineno}: `import {alias.name}` cannot be renamed for the `lightning`"
                        " package; use `from ... import ...` or `import ... as ...`."
                    )
                # ``import pytorch_lightning`` -> ``import lightning.pytorch as pytorch_lightning``
                alias.asname = alias.name
            alias.name = renamed
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.level:
            raise ImportError(f"{self.filename}:{node.lineno}: relative imports are not renamed; use absolute ones.")
        module = node.module or ""
        if module == SOURCE_PACKAGE and any(alias.name in BOUND for alias in node.names):
            raise ImportError(
                f"{self.filename}:{node.lineno}: import Lightning-bound modules by their full name"
                f" (`from {SOURCE_PACKAGE}.<module> import ...`), so the `lightning` flavour can rename them."
            )
        node.module = renamed_module(module)
        return node


def compile_for_lightning(source: bytes, filename: str) -> CodeType:
    """Compile a module's source with its imports renamed for the ``lightning`` package (see the module docstring)."""
    tree = _RenameImports(filename).visit(ast.parse(source, filename))
    return compile(tree, filename, "exec", dont_inherit=True)


class _Loader(importlib.abc.Loader):
    def __init__(self, source_spec: importlib.machinery.ModuleSpec) -> None:
        self.source_spec = source_spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        origin = self.source_spec.origin
        assert origin is not None and self.source_spec.loader is not None
        source = self.source_spec.loader.get_source(self.source_spec.name)  # type: ignore[attr-defined]
        exec(compile_for_lightning(source.encode(), origin), module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_fairscale.lightning.<m>`` for the modules ``<m>`` in :data:`BOUND`."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        prefix = TARGET_PACKAGE + "."
        if not fullname.startswith(prefix) or fullname[len(prefix) :] not in BOUND:
            return None
        relative = fullname[len(prefix) :]
        source_spec = importlib.util.find_spec(f"{SOURCE_PACKAGE}.{relative}")
        if source_spec is None or source_spec.origin is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, _Loader(source_spec), origin=source_spec.origin, is_package=_is_package(relative)
        )
        spec.has_location = True  # ``__file__`` is the one source file
        if spec.submodule_search_locations is not None:
            spec.submodule_search_locations = []  # submodules come from this finder, or are the shared ones
        return spec


_FINDER = _Finder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
