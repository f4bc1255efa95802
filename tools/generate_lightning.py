"""Writes ``src/lightning_fairscale/lightning/``: our Lightning-bound modules for the unified ``lightning`` package.

``pytorch_lightning`` and ``lightning.pytorch`` are two copies of the same classes, and each Trainer accepts only its
own copy's strategies and plugins, so each package needs classes of its own; their logic must not be written twice.
This script copies every *bound* module ``lightning_fairscale/<m>.py`` (one that imports Lightning, imports a bound
module, or is the package of one) to ``lightning_fairscale/lightning/<m>.py`` with its imports renamed:

* ``pytorch_lightning[.x]`` becomes ``lightning.pytorch[.x]`` and ``lightning_fabric[.x]`` becomes
  ``lightning.fabric[.x]``;
* ``lightning_fairscale.<m>`` becomes ``lightning_fairscale.lightning.<m>`` when ``<m>`` is bound, and stays as it is
  otherwise: the engine (FairScale glue, wrapping, optimizer layouts, the checkpoint format) does not depend on which
  Lightning runs it, and both packages share it.

Only the module names inside import statements change, in place: every other character and every line stays, so line
``n + 1`` of a copy is line ``n`` of its source (the copy's first line is a header naming the source and this
command). Lightning builds ``lightning.pytorch`` from ``pytorch_lightning``'s sources the same way.

Run ``make lightning`` (``python tools/generate_lightning.py``) after changing a bound module; ``--check`` only says
which copies are out of date. ``tests/unit/test_lightning_modules.py`` fails while one is. The script lives outside
the package because it is a build step: it needs no Lightning, and installed copies have no use for it.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
#: The package whose bound modules are copied, and where the copies go.
PACKAGE = "lightning_fairscale"
TARGET = "lightning_fairscale.lightning"
SOURCE_ROOT = REPOSITORY / "src" / PACKAGE
TARGET_ROOT = SOURCE_ROOT / "lightning"
#: Files of the target folder that are written by hand (its ``__init__`` gathers the public names).
HANDWRITTEN = (TARGET_ROOT / "__init__.py",)
#: Lightning's standalone packages, and where the unified ``lightning`` package has the same code.
RENAMED = {"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning.fabric"}
COMMAND = "make lightning"


class GenerationError(Exception):
    """A source that cannot be copied with renamed imports: the message names the file, the line and the fix."""


def source_modules() -> dict[str, Path]:
    """Every module of the package outside the target folder, by its name relative to the package (packages by their
    ``__init__``). The package's own ``__init__`` is left out: ``lightning/__init__.py`` is its hand-written twin."""
    modules = {}
    for path in sorted(SOURCE_ROOT.rglob("*.py")):
        relative = path.relative_to(SOURCE_ROOT)
        if relative.parts[0] == TARGET_ROOT.name or relative == Path("__init__.py"):
            continue
        parts = relative.with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(tree: ast.Module) -> set[str]:
    """The absolute module names that the imports of ``tree`` name, anywhere in it (function bodies and
    ``if TYPE_CHECKING:`` blocks included: the copy must rename those too)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def bound_modules(imports: dict[str, set[str]]) -> tuple[str, ...]:
    """The modules to copy, from what each module imports (``imports``: relative name -> absolute module names).

    A module is bound when it imports Lightning, imports a bound module, or is the package of a bound module (the
    copy needs its packages).

    Example:
        >>> bound_modules({
        ...     "fsdp.unit.units": {"torch"},
        ...     "strategies": set(),
        ...     "strategies.ddp": {"pytorch_lightning.strategies", "lightning_fairscale.fsdp.unit.units"},
        ...     "precision": {"lightning_fairscale.strategies.ddp"},
        ... })
        ('precision', 'strategies', 'strategies.ddp')
    """
    bound = {name for name, modules in imports.items() if any(m.partition(".")[0] in RENAMED for m in modules)}
    while True:
        parents = {name.rsplit(".", k)[0] for name in bound for k in range(1, name.count(".") + 1)}
        importers = {name for name, modules in imports.items() if any(_own(m) in bound for m in modules)}
        grown = bound | parents | importers
        if grown == bound:
            return tuple(sorted(bound))
        bound = grown


def _own(module: str) -> str | None:
    """``module`` relative to the package, or None when it is not one of the package's submodules."""
    prefix = PACKAGE + "."
    return module[len(prefix) :] if module.startswith(prefix) else None


def renamed_module(module: str, bound: tuple[str, ...]) -> str:
    """Where ``module`` (an absolute import) comes from in the copy of a bound module.

    Example:
        >>> bound = ("strategies", "strategies.fully_sharded")
        >>> renamed_module("pytorch_lightning.strategies", bound)
        'lightning.pytorch.strategies'
        >>> renamed_module("lightning_fairscale.strategies.fully_sharded", bound)
        'lightning_fairscale.lightning.strategies.fully_sharded'
        >>> renamed_module("lightning_fairscale.fsdp.unit.units", bound)
        'lightning_fairscale.fsdp.unit.units'
    """
    top, _, rest = module.partition(".")
    if top in RENAMED:
        return RENAMED[top] + ("." + rest if rest else "")
    if _own(module) in bound:
        return f"{TARGET}.{_own(module)}"
    return module


class _Edits:
    """Replacements in a source's lines, each within one line, by byte offset (as the AST counts columns)."""

    def __init__(self, source: str) -> None:
        self.lines = source.splitlines(keepends=True)
        self.edits: list[tuple[int, int, int, str]] = []  # (line index, start, end, new text)

    def text(self, line: int, start: int, end: int | None = None) -> str:
        return self.lines[line - 1].encode()[start:end].decode()

    def replace(self, line: int, start: int, end: int, new: str) -> None:
        self.edits.append((line - 1, start, end, new))

    def apply(self) -> str:
        lines = list(self.lines)
        for index, start, end, new in sorted(self.edits, reverse=True):  # right to left: offsets stay valid
            encoded = lines[index].encode()
            lines[index] = (encoded[:start] + new.encode() + encoded[end:]).decode()
        return "".join(lines)


def rename_imports(source: str, filename: str, bound: tuple[str, ...], modules: tuple[str, ...] = ()) -> str:
    """``source`` with the module names of its imports renamed as :func:`renamed_module` says, every other character
    and every line kept; ``modules`` (the package's modules, relative) lets it refuse ``from <bound package> import
    <shared module>``, which the copy could not find.

    Example:
        >>> print(rename_imports("import pytorch_lightning as pl  # the Trainer's\\nx = 1\\n", "m.py", ()), end="")
        import lightning.pytorch as pl  # the Trainer's
        x = 1
    """
    tree = ast.parse(source, filename)
    edits = _Edits(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                _rename_import(edits, alias, bound, f"{filename}:{node.lineno}")
        elif isinstance(node, ast.ImportFrom):
            _rename_import_from(edits, node, bound, modules, f"{filename}:{node.lineno}")
    return edits.apply()


def _rename_import(edits: _Edits, alias: ast.alias, bound: tuple[str, ...], where: str) -> None:
    renamed = renamed_module(alias.name, bound)
    if renamed == alias.name:
        return
    if alias.asname is None and "." in alias.name:  # binds the top package, whose renamed counterpart has another name
        raise GenerationError(
            f"{where}: `import {alias.name}` cannot be renamed for the `lightning` package; write"
            f" `from {alias.name.rpartition('.')[0]} import ...` or `import {alias.name} as ...`."
        )
    if edits.text(alias.lineno, alias.col_offset, alias.end_col_offset).split()[0] != alias.name:
        raise GenerationError(f"{where}: write the module name `{alias.name}` on one line, without spaces.")
    # ``import pytorch_lightning`` -> ``import lightning.pytorch as pytorch_lightning``: the same name bound.
    new = renamed if alias.asname else f"{renamed} as {alias.name}"
    edits.replace(alias.lineno, alias.col_offset, alias.col_offset + len(alias.name.encode()), new)


def _rename_import_from(
    edits: _Edits, node: ast.ImportFrom, bound: tuple[str, ...], modules: tuple[str, ...], where: str
) -> None:
    if node.level:
        raise GenerationError(f"{where}: relative imports are not renamed; write the absolute module name.")
    module = node.module or ""
    names = [alias.name for alias in node.names]
    if module == PACKAGE and any(name in bound for name in names):
        raise GenerationError(
            f"{where}: import Lightning-bound modules by their full name (`from {PACKAGE}.<module> import ...`), so"
            " that the copy for the `lightning` package can rename them."
        )
    renamed = renamed_module(module, bound)
    if renamed == module:
        return
    shared = [name for name in names if f"{_own(module)}.{name}" in modules and f"{_own(module)}.{name}" not in bound]
    if shared:
        raise GenerationError(
            f"{where}: `from {module} import {shared[0]}` imports a module that both packages share, which the copy"
            f" for the `lightning` package would look for in {renamed}; write `import {module}.{shared[0]} as ...`."
        )
    match = re.match(rb"from\s+([\w.]+)", edits.lines[node.lineno - 1].encode()[node.col_offset :])
    if match is None or match.group(1).decode() != module:
        raise GenerationError(f"{where}: write `from {module} import` on one line, without spaces in the name.")
    start = node.col_offset + match.start(1)
    edits.replace(node.lineno, start, start + len(match.group(1)), renamed)


def header(source: Path) -> str:
    """The first line of the copy of ``source``."""
    return f"# Generated from {source.relative_to(SOURCE_ROOT.parent).as_posix()} by `{COMMAND}`: do not edit.\n"


_HEADER = re.compile(rf"# Generated from \S+ by `{COMMAND}`")


def generated() -> dict[Path, str]:
    """Every copy, by the path it belongs at: what ``make lightning`` writes."""
    modules = source_modules()
    imports = {name: imported_modules(ast.parse(path.read_text(), str(path))) for name, path in modules.items()}
    bound = bound_modules(imports)
    copies = {}
    for name in bound:
        path = modules[name]
        source = path.read_text()
        filename = path.relative_to(REPOSITORY).as_posix()
        copies[TARGET_ROOT / path.relative_to(SOURCE_ROOT)] = header(path) + rename_imports(
            source, filename, bound, tuple(modules)
        )
    return copies


def on_disk() -> set[Path]:
    """The copies in the target folder now: the files with a header (the generator removes no other file)."""
    return {path for path in TARGET_ROOT.rglob("*.py") if _HEADER.match(path.read_text())}


def stale(copies: dict[Path, str]) -> list[str]:
    """The copies that differ from ``copies`` (missing, changed or left over), relative to the repository."""
    found = {path for path, text in copies.items() if not path.is_file() or path.read_text() != text}
    found |= on_disk() - set(copies)
    return sorted(path.relative_to(REPOSITORY).as_posix() for path in found)


def write(copies: dict[Path, str]) -> None:
    """Write ``copies`` and remove the copies of modules that are gone (and the folders they leave empty)."""
    for path, text in copies.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPOSITORY)}")
    left_over = sorted(on_disk() - set(copies))
    for path in left_over:
        path.unlink()
        print(f"removed {path.relative_to(REPOSITORY)}")
    for folder in sorted({path.parent for path in left_over}, reverse=True):
        if folder != TARGET_ROOT and not any(folder.rglob("*.py")):
            shutil.rmtree(folder)  # what is left is bytecode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; fail when a copy is out of date")
    args = parser.parse_args(argv)
    try:
        copies = generated()
    except GenerationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check:
        outdated = stale(copies)
        for path in outdated:
            print(f"out of date: {path}; run `{COMMAND}`", file=sys.stderr)
        return 1 if outdated else 0
    write(copies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
