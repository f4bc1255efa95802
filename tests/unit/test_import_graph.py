"""The package's import graph, read from the sources: the engine imports no Lightning module, and only
``_compat`` imports Lightning's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "src" / "lightning_fairscale"
LIGHTNING = ("pytorch_lightning", "lightning_fabric", "lightning")

#: The engine: FairScale glue, wrapping, optimizer layouts, loading and the checkpoint format, shared by the
#: Trainer's and Fabric's strategies. Testable without Lightning.
ENGINE = (
    "checkpoint",
    "checkpoint.background",
    "checkpoint.checks",
    "checkpoint.fabric",
    "checkpoint.files",
    "checkpoint.legacy",
    "checkpoint.safetensors",
    "consolidate",
    "convert_1x",
    "distributed",
    "distributed.collectives",
    "distributed.exchanges",
    "distributed.process_exit",
    "distributed.torch_private",
    "fsdp",
    "fsdp.patches",
    "fsdp.unit",
    "fsdp.wrapping",
    "fsdp.state",
    "fsdp.engine",
    "fsdp.model",
    "fsdp.run",
    "fsdp.state.export",
    "fsdp.unit.frozen_params",
    "fsdp.patches.grad_norm",
    "fsdp.patches.hybrid",
    "fsdp.wrapping.activation_checkpointing",
    "fsdp.state.averaging",
    "fsdp.patches.bookkeeping",
    "fsdp.unit.copying",
    "fsdp.unit.gathered",
    "fsdp.patches.bucketing",
    "fsdp.wrapping.compile",
    "fsdp.patches.backward_hooks",
    "fsdp.patches.one_rank",
    "fsdp.unit.recompute",
    "fsdp.patches.forward_grads",
    "fsdp.patches.workarounds",
    "fsdp.config",
    "fsdp.patches.cpu_streams",
    "fsdp.patches.deprecations",
    "fsdp.unit.materialize",
    "fsdp.state.optim",
    "fsdp.unit.original_params",
    "fsdp.state.optim_state",
    "fsdp.unit.param_views",
    "fsdp.wrapping.policies",
    "fsdp.patches.prefetch",
    "fsdp.patches.reduce_scatter",
    "fsdp.unit.recovery",
    "fsdp.state.resharding",
    "fsdp.state.saving",
    "fsdp.state.checkpoints",
    "fsdp.state.sharded_checkpoint",
    "fsdp.wrapping.summary",
    "fsdp.unit.ties",
    "fsdp.unit.state_names",
    "fsdp.unit.step_state",
    "fsdp.unit.units",
    "fsdp.unit.instances",
    "fsdp.unit.unit_state",
    "fsdp.wrapping.unwrapping",
    "fsdp.state.unsharded_shapes",
    "mixed_precision",
    "mixed_precision.grad_scaler",
    "mixed_precision.settings",
    "sharded_ddp",
    "sharded_ddp.config",
    "sharded_ddp.engine",
    "sharded_ddp.trainability",
)

#: The adapters' shared knowledge of Lightning's arguments and registries, which imports no Lightning either, so that
#: the Trainer's adapters, Fabric's and their ``lightning`` flavour share it.
ADAPTERS_WITHOUT_LIGHTNING = ("_adapters",)


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
    """The modules of this package among ``names``, relative to it (modules only, not the names inside them), with
    the subpackages that contain them: importing ``a.b.c`` runs ``a/b/__init__.py`` first. (The package's own
    ``__init__`` registers the strategies with Lightning; the engine's code never needs it.)"""
    inside = {n.removeprefix("lightning_fairscale.") for n in names if n.startswith("lightning_fairscale.")}
    modules = {n for n in inside if _module_file(n).is_file()}
    return modules | {m.rsplit(".", k)[0] for m in modules for k in range(1, m.count(".") + 1)}


def closure(name: str) -> set[str]:
    """``name`` and every module of the package it imports, directly or not."""
    seen, todo = set(), [name, *own_modules({f"lightning_fairscale.{name}"})]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(own_modules(imports(module)))
    return seen


def test_the_engine_list_names_every_engine_module() -> None:
    """Every module of the engine's folders (and the command-line tools) is in ``ENGINE``, so each is checked."""
    folders = {"checkpoint", "distributed", "fsdp", "mixed_precision", "sharded_ddp"}
    modules = {
        ".".join(path.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__")
        for path in SOURCE.rglob("*.py")
        if path.relative_to(SOURCE).parts[0] in folders
    }
    assert modules - set(ENGINE) == set()


def test_the_engine_list_names_real_modules() -> None:
    for name in ENGINE + ADAPTERS_WITHOUT_LIGHTNING:
        assert _module_file(name).is_file(), name


@pytest.mark.parametrize("name", ENGINE + ADAPTERS_WITHOUT_LIGHTNING)
def test_an_engine_module_imports_no_lightning_module(name: str) -> None:
    for module in closure(name):
        lightning = sorted(n for n in imports(module) if n.split(".")[0] in LIGHTNING)
        assert not lightning, f"{name} imports {module}, which imports {lightning}"


#: The engine's folders, lowest first: a folder imports only folders of lower layers, so there is no cycle between
#: them. The adapters (``strategies``, ``fabric``, ``precision``,
#: ``plugins``, ``callbacks``) sit above all of them; the command-line tools (``consolidate``, ``convert_1x``) too.
LAYERS = (("distributed",), ("mixed_precision",), ("checkpoint",), ("fsdp", "sharded_ddp"))


def _folder_imports(folder: str) -> set[str]:
    """The package's folders that the modules of ``folder`` import (itself left out)."""
    found = set()
    for path in (SOURCE / folder).rglob("*.py"):
        module = ".".join(path.relative_to(SOURCE).with_suffix("").parts)
        found.update(name.split(".")[0] for name in own_modules(imports(module)))
    return {name for name in found if (SOURCE / name).is_dir()} - {folder}


def test_the_engine_folders_are_layers_without_cycles() -> None:
    rank = {folder: level for level, folders in enumerate(LAYERS) for folder in folders}
    assert set(rank) == {p.name for p in SOURCE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()} - {
        "strategies", "fabric", "precision", "plugins", "callbacks", "lightning"
    }, "a new folder: place it in LAYERS (engine) or among the adapters"
    for folder, level in rank.items():
        above = sorted(name for name in _folder_imports(folder) if rank.get(name, len(LAYERS)) >= level)
        assert not above, f"{folder}/ imports {above}: a folder may only import folders of lower layers ({LAYERS})"


#: The FSDP engine's own layers, lowest first: FairScale's gaps (``patches``), the unit class and what it knows about
#: its parameters (``unit``), putting units on a model and taking them off (``wrapping``), optimizer state and
#: checkpoints (``state``); on top the modules of ``fsdp/`` itself (``config``: the options; ``run``: what a run derives
#: from them; ``model``: the sharded model; ``engine``: making one). A layer imports only layers below it.
FSDP_LAYERS = ("patches", "unit", "wrapping", "state")


def test_the_fsdp_folders_are_layers() -> None:
    rank = {name: level for level, name in enumerate(FSDP_LAYERS)}
    folders = {p.name for p in (SOURCE / "fsdp").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(FSDP_LAYERS), "a new folder of fsdp/: place it in FSDP_LAYERS"
    assert {p.stem for p in (SOURCE / "fsdp").glob("*.py")} == {"__init__", "config", "engine", "model", "run"}
    offenders = []
    for layer, level in rank.items():
        for path in (SOURCE / "fsdp" / layer).glob("*.py"):
            module = f"fsdp.{layer}.{path.stem}"
            for name in own_modules(imports(module)):
                parts = name.split(".")
                if parts[0] != "fsdp" or len(parts) < 2:
                    continue
                target = rank.get(parts[1], len(FSDP_LAYERS))  # fsdp.config, .run, .model, .engine: the top
                if target > level:
                    offenders.append(f"{module} imports {name}")
    assert offenders == KNOWN_LAYER_BREACHES


#: Imports of a higher layer not yet taken out (issue 49): this list only shrinks.
KNOWN_LAYER_BREACHES: list[str] = []


def _module_names() -> list[str]:
    return [
        ".".join(path.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__")
        for path in SOURCE.rglob("*.py")
        if path.relative_to(SOURCE).parts[0] != "lightning" and path.name != "__init__.py"
    ]


def import_cycles() -> list[list[str]]:
    """The package's modules that import each other, directly or not (imports inside functions included): the
    strongly connected components of the module graph with more than one module."""
    graph = {name: sorted(own_modules(imports(name)) & set(_module_names())) for name in _module_names()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return cycles


#: Import circles not yet taken apart (issue 49): this list only shrinks.
KNOWN_CYCLES = [
]


def test_no_module_imports_itself_through_others() -> None:
    assert sorted(import_cycles()) == sorted(KNOWN_CYCLES)


#: The prefix of the attributes the package wrote into objects it does not own (FairScale's units and flat
#: parameters, the user's modules and optimizers) before issue 49; what it knows lives in objects of its own now
#: (``fsdp.unit.unit_state`` and the owners' weak maps). Spelt in two parts, so that this file does not hold it.
_MARKER = "_lightning" + "_fairscale_"


def test_no_marker_attribute_is_written_into_objects_of_others() -> None:
    found = [
        f"{path.relative_to(SOURCE)}:{number}"
        for path in SOURCE.rglob("*.py")
        if path.relative_to(SOURCE).parts[0] != "lightning"  # generated copies of the adapters: regenerated
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _MARKER in line
    ]
    assert found == [], f"state of ours written into others' objects again (keep it in an object of ours): {found}"


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


#: Lightning's private attributes (see ``_compat.PRIVATE_ATTRIBUTES``), read here from the source so that this test
#: needs no Lightning import.
PRIVATE_ATTRIBUTES = {"_timeout", "_checkpoint_io", "_layer_sync", "_precision_plugin", "_precision",
                      "_trainer", "_launcher", "_start_method", "_optimizer", "_compiler_ctx",
                      "_average_model"}  # fmt: skip


def test_the_private_attribute_list_is_compats() -> None:
    tree = ast.parse((SOURCE / "_compat.py").read_text())
    assignments = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    (listed,) = [n.value for n in assignments if ast.unparse(n.targets[0]) == "PRIVATE_ATTRIBUTES"]
    assert set(ast.literal_eval(listed)) == PRIVATE_ATTRIBUTES


def test_only_the_compatibility_module_touches_private_lightning_attributes() -> None:
    """``obj._timeout``, ``self._checkpoint_io = ...``: only ``_compat`` reads or writes them."""
    offenders = []
    for path in SOURCE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
                offenders.append(f"{path.relative_to(SOURCE)}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:  # getattr(obj, "_launcher")
                offenders.append(f"{path.relative_to(SOURCE)}:{node.lineno}: {node.value!r}")
    assert not offenders, offenders


def test_the_engine_runs_where_lightning_cannot_be_imported() -> None:
    """The same, at run time: every engine module imports in a process where no Lightning package can be imported
    (the package's ``__init__``, which registers the strategies with Lightning, is bypassed)."""
    script = (
        "import importlib, sys, types\n"
        "for name in ('pytorch_lightning', 'lightning_fabric', 'lightning'): sys.modules[name] = None\n"
        "package = types.ModuleType('lightning_fairscale'); package.__path__ = [sys.argv[1]]\n"
        "sys.modules['lightning_fairscale'] = package\n"
        "for name in sys.argv[2:]: importlib.import_module('lightning_fairscale.' + name)\n"
    )
    command = [sys.executable, "-c", script, str(SOURCE), *ENGINE, *ADAPTERS_WITHOUT_LIGHTNING]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]



#: The one module that reaches torch's private names: the engine's lowest layer, which imports no Lightning.
TORCH_PRIVATE = Path("distributed") / "torch_private.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _torch_aliases(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or to one of its modules (``torch``, ``dist``, ``nn``...)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            aliases.update(alias.asname or alias.name for alias in node.names if alias.name[:1].islower())
    return aliases


def _attribute_path(node: ast.AST) -> list[str]:
    """``["torch", "_C", "_current_graph_task_id"]`` for ``torch._C._current_graph_task_id``; ``[]`` when the chain
    does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def test_only_the_torch_compatibility_module_uses_private_torch_names() -> None:
    """``from torch.x import _Name``, ``torch._C...``, ``dist.distributed_c10d._get_default_store()``: only
    ``distributed/torch_private.py`` (attributes of the objects torch returns, a module's ``_parameters``, are not
    torch's module namespace and are not counted)."""
    offenders = []
    for path in SOURCE.rglob("*.py"):
        relative = path.relative_to(SOURCE)
        if relative == TORCH_PRIVATE:
            continue
        tree = ast.parse(path.read_text())
        aliases = _torch_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                names = [a.name for a in node.names if _private(a.name)]
                if names or any(_private(part) for part in node.module.split(".")):
                    offenders.append(f"{relative}:{node.lineno}: from {node.module} import {names}")
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
                private = [n for n in names if any(map(_private, n.split(".")))]
                offenders += [f"{relative}:{node.lineno}: import {n}" for n in private]
            elif isinstance(node, ast.Attribute):
                parts = _attribute_path(node)
                if parts and parts[0] in aliases and _private(parts[-1]) and not any(map(_private, parts[:-1])):
                    offenders.append(f"{relative}:{node.lineno}: {'.'.join(parts)}")
    assert not offenders, offenders


def test_the_package_keeps_small_files_and_few_top_level_modules() -> None:
    """The sizes a newcomer can read: each front end's FSDP strategy under 450 lines, no hand-written module over
    500 (the generated copies in ``lightning/`` are the sources' size), at most six modules at the package's top."""
    sizes = {
        path.relative_to(SOURCE).as_posix(): len(path.read_text().splitlines())
        for path in SOURCE.rglob("*.py")
        if path.relative_to(SOURCE).parts[0] != "lightning"
    }
    assert sizes["strategies/fully_sharded.py"] < 450 and sizes["fabric/fully_sharded.py"] < 450
    assert not {name: size for name, size in sizes.items() if size > 500}
    assert len([path for path in SOURCE.glob("*.py")]) <= 6
