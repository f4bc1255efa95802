"""The package's import graph, read from the sources: the engine imports no Lightning module, and only
``_compat`` imports Lightning's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "src" / "lightning_fairscale"
LIGHTNING = ("pytorch_lightning", "lightning_fabric", "lightning")

#: The engine: FairScale glue, wrapping, optimizer layouts, loading and the checkpoint format, shared by the
#: Trainer's and Fabric's strategies. Testable without Lightning.
ENGINE = (
    "checkpoint_files",
    "collectives",
    "consolidate",
    "convert_1x",
    "fabric_checkpoint",
    "fairscale_cpu",
    "fsdp_engine",
    "fsdp_options",
    "legacy_checkpoint",
    "mixed_precision",
    "optim",
    "oss",
    "resharding",
    "sharded_checkpoint",
    "strategies._lost_ranks",
    "strategies._process_exit",
    "strategy_arguments",
    "summary",
    "wrapping",
)


def _module_file(name: str) -> Path:
    path = SOURCE.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports(name: str) -> set[str]:
    """The absolute names of the modules that module ``name`` (relative to the package) imports, anywhere in it."""
    tree = ast.parse(_module_file(name).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def own_modules(names: set[str]) -> set[str]:
    """The modules of this package among ``names``, relative to it (modules only, not the names inside them)."""
    inside = {n.removeprefix("lightning_fairscale.") for n in names if n.startswith("lightning_fairscale.")}
    return {n for n in inside if _module_file(n).is_file()}


def closure(name: str) -> set[str]:
    """``name`` and every module of the package it imports, directly or not."""
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(own_modules(imports(module)))
    return seen


def test_the_engine_list_names_real_modules() -> None:
    for name in ENGINE:
        assert _module_file(name).is_file(), name


@pytest.mark.parametrize("name", ENGINE)
def test_an_engine_module_imports_no_lightning_module(name: str) -> None:
    for module in closure(name):
        lightning = sorted(n for n in imports(module) if n.split(".")[0] in LIGHTNING)
        assert not lightning, f"{name} imports {module}, which imports {lightning}"


def test_only_the_compatibility_module_imports_private_lightning_names() -> None:
    offenders = []
    for path in SOURCE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIGHTNING:
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
                if private or any(part.startswith("_") for part in node.module.split(".")):
                    offenders.append(f"{path.relative_to(SOURCE)}: from {node.module} import {private}")
    assert not offenders, offenders
