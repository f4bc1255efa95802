"""The front ends are thin: no function of the package takes a strategy typed ``Any``, and no module reaches into a
strategy's private members from outside its class (issue 55, item 2).

The Trainer's and Fabric's strategies translate Lightning's calls into the engine's: the modules beside them take the
engine's typed objects (a ``WrappedModel``, the models a Fabric strategy set up) or, where a Lightning object is truly
needed, Lightning's ``Strategy``, and use only its public members. Lightning's own private attributes are read and
written in ``_compat.py`` alone (``tests/unit/test_import_graph.py`` checks that list).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "lightning_fairscale"
#: The one module that may touch a Lightning strategy's private attributes (Lightning's, not ours).
COMPAT = SOURCE / "_compat.py"


def _sources(root: Path) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(root.rglob("*.py")):
        if "lightning" not in path.relative_to(root).parts[:1]:  # `lightning/`: generated copies of these modules
            yield path, ast.parse(path.read_text(), str(path))


def _is_strategy(node: ast.expr) -> bool:
    """Whether ``node`` names a strategy: ``strategy``, ``self._strategy``, ``trainer.strategy``..."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.lstrip("_") == "strategy"


def _private_members(node: ast.ClassDef) -> set[str]:
    """The private members ``node`` defines: methods, and attributes it sets on ``self``."""
    private = {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    private |= {
        n.attr for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        and isinstance(n.ctx, ast.Store)
    }  # fmt: skip
    return {name for name in private if name.startswith("_") and not name.endswith("__")}


def _strategy_classes(root: Path) -> dict[tuple[Path, str], set[str]]:
    """Our strategy classes (in ``strategies/`` and ``fabric/``) by module and name, with the private members each
    defines, and the strategies' option mixins (``_adapters/options.py``: the base classes whose typed options each
    strategy inherits)."""
    classes: dict[tuple[Path, str], set[str]] = {}
    for path, tree in _sources(root):
        mixins = path.parent.name == "_adapters" and path.name == "options.py"
        if path.parent.name not in ("strategies", "fabric") and not mixins:
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Options" if mixins else "Strategy"):
                classes[path, node.name] = _private_members(node)
    return classes


def strategy_parameters_typed_any(root: Path = SOURCE) -> list[str]:
    """``path:line name`` of each parameter named ``strategy`` whose annotation is ``Any``, ``object`` or missing."""
    found = []
    for path, tree in _sources(root):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                arguments = node.args
                for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else "Any"
                    if arg.arg == "strategy" and annotation.strip("'\"") in ("Any", "typing.Any", "object"):
                        found.append(f"{path.relative_to(root)}:{arg.lineno} {arg.arg}: {annotation}")
    return found


def private_strategy_accesses(root: Path = SOURCE) -> list[str]:
    """``path:line expression`` of each read or write of a strategy's private member from outside its class: an
    attribute ``_x`` of an expression naming a strategy (outside ``_compat.py``, where Lightning's are), or, from
    another module than a class's, an attribute named as one of our strategy classes' private members on anything
    but ``self``."""
    classes = _strategy_classes(root)
    ours = set().union(*classes.values())
    found = []
    for path, tree in _sources(root):
        own: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                own |= classes.get((path, node.name), set())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.endswith("__"):
                continue
            receiver = node.value
            is_self = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
            is_super = isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "super"
            compat = path == root / COMPAT.name
            if node.attr in own:  # the class's own machinery in its module (the options' descriptor)
                continue
            if not compat and (_is_strategy(receiver) or (node.attr in ours - own and not (is_self or is_super))):
                found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_strategy_typed_any() -> None:
    """A function over a strategy says which: Lightning's ``Strategy`` (or one of its classes), or ours."""
    assert strategy_parameters_typed_any() == []


def test_no_private_strategy_members_from_outside() -> None:
    """What a module beside a strategy needs of it comes as the engine's typed objects or its public members."""
    assert private_strategy_accesses() == []


def test_the_scans_find_what_they_look_for(tmp_path: Path) -> None:
    """The scans see a ``strategy: Any`` parameter and a strategy's private member reached from outside its class
    (so that an empty answer above means none), and not a class's use of its own members."""
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "fsdp.py").write_text(
        "class FSDPStrategy:\n"
        "    def __init__(self) -> None:\n"
        "        self._set_up = []\n"
        "    def _is_ours(self, module: object) -> bool:\n"
        "        return module in self._set_up\n"
    )
    (tmp_path / "parts.py").write_text(
        "from typing import Any\n"
        "def save(strategy: Any, path: str) -> None:\n"
        "    strategy._is_ours(path)\n"
        "def recover(holder: 'FSDPStrategy', other: Any) -> None:\n"
        "    holder._set_up.clear()\n"
        "    other._private_of_another_kind()\n"
    )
    (tmp_path / "_compat.py").write_text("def timeout(strategy: 'Strategy') -> float:\n    return strategy._timeout\n")
    assert strategy_parameters_typed_any(tmp_path) == ["parts.py:2 strategy: Any"]
    assert private_strategy_accesses(tmp_path) == ["parts.py:3 strategy._is_ours", "parts.py:5 holder._set_up"]
