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
  both packages share them (one ``fairscale_cpu``, one ``CheckpointFileError``...).

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
from pathlib import Path
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
    "checkpoint_io",
    "fabric",
    "fabric._common",
    "fabric.fully_sharded",
    "fabric.sharded",
    "model_summary",
    "precision",
    "precision.fully_sharded",
    "precision.sharded",
    "strategies",
    "strategies._callbacks",
    "strategies.fully_sharded",
    "strategies.sharded",
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
        >>> renamed_module("lightning_fairscale.fsdp.fairscale_cpu")
        'lightning_fairscale.fsdp.fairscale_cpu'
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


class _StubBodies(ast.NodeTransformer):
    """Keeps what a type checker reads of a module (imports, classes, signatures, annotated names, docstrings) and
    replaces every body and value by ``...``; drops the statements that only run."""

    _KEPT = (
        ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.AnnAssign, ast.Assign
    )  # fmt: skip

    def _body(self, body: list[ast.stmt], keep_docstring: bool = True) -> list[ast.stmt]:
        kept: list[ast.stmt] = []
        if keep_docstring and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            kept.append(body[0])
        for node in body:
            if isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports, and the like: keep the branches' statements
                kept.extend(self._body(node.body, keep_docstring=False) + self._body(node.orelse, keep_docstring=False))
            elif isinstance(node, ast.Try):  # an optional import: what the `try` binds
                kept.extend(self._body(node.body, keep_docstring=False))
            elif isinstance(node, self._KEPT):
                kept.append(self.visit(node))
        return kept or [ast.Expr(ast.Constant(...))]

    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body = self._body(node.body)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        node.body = self._body(node.body)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        docstring = ast.get_docstring(node, clean=False)
        node.body = [ast.Expr(ast.Constant(docstring))] if docstring else []
        node.body.append(ast.Expr(ast.Constant(...)))
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AnnAssign:
        node.value = ast.Constant(...) if node.value is not None else None
        return node

    def visit_Assign(self, node: ast.Assign) -> ast.Assign:
        if not (isinstance(node.value, ast.Name) or _is_alias(node)):  # `val_dataloader = train_dataloader` stays
            node.value = ast.Constant(...)
        return node


def _is_alias(node: ast.Assign) -> bool:
    return isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)


def stub_for_lightning(source: str, filename: str) -> str:
    r"""The type stub of a bound module's ``lightning`` flavour: the module with its imports renamed (as
    :func:`compile_for_lightning` does) and its bodies left out.

    Type checkers and IDEs cannot follow this loader, so the flavour's modules come with these stubs
    (``lightning_fairscale/lightning/<module>.pyi``, written by ``make stubs`` and checked to be current by the
    tests): ``lightning_fairscale.lightning.DDPFullyShardedStrategy`` is then, for them too, a subclass of
    ``lightning.pytorch.strategies.DDPStrategy`` with the constructor's signature.

    Example:
        >>> source = "import pytorch_lightning as pl\ndef f(x: int) -> int:\n    return x"
        >>> print(stub_for_lightning(source, "m.py"), end="")
        import lightning.pytorch as pl
        <BLANKLINE>
        def f(x: int) -> int:
            ...
    """
    tree = _StubBodies().visit(_RenameImports(filename).visit(ast.parse(source, filename)))
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def stubs() -> dict[Path, str]:
    """Every stub of the ``lightning`` flavour (see :func:`stub_for_lightning`), by the path it belongs at."""
    found = {}
    for name in BOUND:
        parts = name.split(".")
        source = Path(*parts, "__init__.py") if _is_package(name) else Path(*parts[:-1], parts[-1] + ".py")
        header = f"# Generated by `make stubs` from {source.as_posix()}: do not edit.\n"
        text = stub_for_lightning((_PACKAGE_ROOT / source).read_text(), f"{SOURCE_PACKAGE}/{source.as_posix()}")
        found[_PACKAGE_ROOT / "lightning" / source.with_suffix(".pyi")] = header + text
    return found


def write_stubs() -> None:
    """Write :func:`stubs` (after a change to a bound module; ``tests/unit`` fails while one is out of date)."""
    for path, text in stubs().items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(_PACKAGE_ROOT.parent)}")


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
