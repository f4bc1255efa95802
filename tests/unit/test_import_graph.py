"""The package's import graph, read from the sources: the engine imports no Lightning module, and only
``_compat`` imports Lightning's private names."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
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
    "checkpointer",
    "consolidate",
    "convert_1x",
    "distributed",
    "distributed.collectives",
    "distributed.exchanges",
    "distributed.fairscale_private",
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
    "fsdp.patches.workaround_table",
    "fsdp.config",
    "fsdp.fairscale_kwargs",
    "fsdp.patches.cpu_streams",
    "fsdp.patches.deprecations",
    "fsdp.unit.materialize",
    "fsdp.state.optim",
    "fsdp.unit.original_params",
    "fsdp.state.optim_state",
    "fsdp.unit.param_views",
    "fsdp.unit.shard_layout",
    "fsdp.unit.sharded_reads",
    "fsdp.wrapping.policies",
    "fsdp.patches.prefetch",
    "fsdp.patches.reduce_scatter",
    "fsdp.unit.recovery",
    "fsdp.state.resharding",
    "fsdp.state.saving",
    "fsdp.state.sharded_checkpoint",
    "fsdp.wrapping.summary",
    "fsdp.unit.ties",
    "fsdp.unit.state_names",
    "fsdp.unit.step_state",
    "fsdp.unit.units",
    "fsdp.unit.instances",
    "fsdp.unit.unit_state",
    "fsdp.unit.not_run",
    "fsdp.unit.rank_agreement",
    "fsdp.wrapping.unwrapping",
    "fsdp.state.unsharded_shapes",
    "fsdp.state.optimizer_paths",
    "fsdp.state.whole_owners",
    "fsdp.state.whole_step",
    "fsdp.state.whole_state",
    "mixed_precision",
    "mixed_precision.grad_scaler",
    "mixed_precision.settings",
    "sharded_ddp",
    "sharded_ddp.config",
    "sharded_ddp.engine",
    "sharded_ddp.grad_norms",
    "sharded_ddp.trainability",
)

#: The adapters' shared knowledge of Lightning's arguments and registries, and the options' typed properties, which
#: import no Lightning either, so that the Trainer's adapters, Fabric's and their ``lightning`` flavour share them.
ADAPTERS_WITHOUT_LIGHTNING = ("_adapters", "_adapters.options")


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
    folders = {"checkpoint", "checkpointer", "distributed", "fsdp", "mixed_precision", "sharded_ddp"}
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
#: them. The adapters (``strategies``, ``fabric``, ``precision``, ``plugins``, ``callbacks``, and ``_adapters``, what
#: they share) sit above all of them; the command-line tools (``consolidate``, ``convert_1x``) too. The checkpointer
#: (every save and load goes through it) is the top layer: it calls the engines, none calls it.
LAYERS = (("distributed",), ("mixed_precision",), ("checkpoint",), ("fsdp", "sharded_ddp"), ("checkpointer",))


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
        "strategies", "fabric", "precision", "plugins", "callbacks", "lightning", "_adapters"
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
    top = {"__init__", "config", "engine", "fairscale_kwargs", "model", "run"}
    assert {p.stem for p in (SOURCE / "fsdp").glob("*.py")} == top
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
    names = _module_names()
    graph = {name: sorted(own_modules(imports(name)) & set(names)) for name in names}
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
#: (``fsdp.unit.unit_state``: the units' records and the models' owners). Spelt in two parts, so that this file
#: does not hold it.
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
                      "_average_model", "_forward_module", "_use_lottery_ticket_hypothesis"}  # fmt: skip


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
    450 (the generated copies in ``lightning/`` are the sources' size), at most six modules at the package's top."""
    sizes = {
        path.relative_to(SOURCE).as_posix(): len(path.read_text().splitlines())
        for path in SOURCE.rglob("*.py")
        if path.relative_to(SOURCE).parts[0] != "lightning"
    }
    assert sizes["strategies/fully_sharded.py"] < 450 and sizes["fabric/fully_sharded.py"] < 450
    assert not {name: size for name, size in sizes.items() if size > 450}
    assert len([path for path in SOURCE.glob("*.py")]) <= 6


#: The one module that imports FairScale's private names and lists the private attributes of FairScale's objects
#: that the package uses (the engine's lowest layer, beside ``torch_private``).
FAIRSCALE_PRIVATE = Path("distributed") / "fairscale_private.py"


def _defined_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: at its top level (functions, classes, assignments), in a class body
    (methods, class attributes), or as an attribute it stores on any object (``self._x = ...``, ``p._x = ...``,
    ``setattr(obj, "_x", ...)``)."""
    found = set()
    for body in [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                found.add(node.args[1].value)
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):  # ``self.__x``: ``_Class__x``
        inside = _defined_private_names(ast.Module(body=cls.body, type_ignores=[]))
        found.update(f"_{cls.name.lstrip('_')}{name}" for name in inside if name.startswith("__"))
    return {name for name in found if _private(name)}


def _torch_private_names() -> set[str]:
    """The private names of the torch classes FairScale's classes extend (a module's ``_parameters``, an optimizer's
    ``_opt_called``, a scaler's ``_enabled``...): torch's, which the torch test above covers."""
    import torch

    written = (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, torch.autograd.Function)
    names = {name for cls in (*written, torch.Tensor) for name in dir(cls) if _private(name)}
    for cls in written:  # and what their methods store (a tensor's attributes are all in its ``dir``)
        tree = ast.parse(Path(inspect.getfile(cls)).read_text())
        (body,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__]
        names |= _defined_private_names(ast.Module(body=[body], type_ignores=[]))
    return names


def fairscale_private_names() -> set[str]:
    """Every private name FairScale's installed sources define, less torch's and Lightning's."""
    spec = importlib.util.find_spec("fairscale")
    assert spec is not None and spec.origin is not None
    names: set[str] = set()
    for path in Path(spec.origin).parent.rglob("*.py"):
        names |= _defined_private_names(ast.parse(path.read_text()))
    return names - _torch_private_names() - PRIVATE_ATTRIBUTES


def _fairscale_members(path: Path, tree: ast.Module) -> dict[ast.ClassDef, set[str]]:
    """The classes of one of our modules that extend a FairScale class (directly or through one of ours), each with
    the names the FairScale classes among its bases define (their ``vars``). A class's bases are evaluated in the
    imported module's namespace; one made inside a function on a local base counts as extending none."""
    dotted = ".".join(("lightning_fairscale", *path.relative_to(SOURCE).with_suffix("").parts))
    namespace = vars(importlib.import_module(dotted.removesuffix(".__init__")))
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            members: set[str] = set()
            for base in node.bases:
                try:
                    value = eval(compile(ast.Expression(base), str(path), "eval"), namespace)  # noqa: S307
                except NameError:
                    continue
                mro = value.__mro__ if isinstance(value, type) else ()
                members.update(*(vars(c) for c in mro if c.__module__.split(".")[0] == "fairscale"))
            if members:
                found[node] = members
    return found


def _class_body_names(node: ast.ClassDef) -> set[str]:
    """The methods and class attributes a class's body defines (annotations alone define nothing)."""
    names = {m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assigned = [t for m in node.body if isinstance(m, ast.Assign) for t in m.targets]
    return names | {t.id for t in assigned if isinstance(t, ast.Name)}


def fairscale_private_uses() -> dict[str, set[str]]:
    """Where the package uses FairScale's private names: name -> {"path:line"} (the rule: see the test below)."""
    names = fairscale_private_names()
    uses: dict[str, set[str]] = {}
    for path in SOURCE.rglob("*.py"):
        relative = path.relative_to(SOURCE)
        if relative.parts[0] == "lightning" or relative == FAIRSCALE_PRIVATE:
            continue
        tree = ast.parse(path.read_text())
        fairscale_classes = _fairscale_members(path, tree)
        ours: dict[ast.AST, set[str]] = {}  # a method's ``self``/``cls`` -> the names that are ours on it
        found: list[tuple[str, ast.AST]] = []
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            own = _class_body_names(cls)
            if cls in fairscale_classes:  # FairScale's object: its own methods and attributes are FairScale's
                found += [(name, cls) for name in own & names & fairscale_classes[cls]]  # overrides
                own -= fairscale_classes[cls]
            else:  # our object: nothing on ``self`` is FairScale's (it is ours, torch's or Lightning's)
                own = names
            for method in cls.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.args.args:
                    first = method.args.args[0].arg
                    ours.update({n: own for n in ast.walk(method) if isinstance(n, ast.Name) and n.id == first})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in names and node.attr not in ours.get(node.value, ()):
                found.append((node.attr, node))
            elif isinstance(node, ast.Constant) and node.value in names:  # getattr(unit, "_is_root"), lists of names
                found.append((node.value, node))
        for name, node in found:
            uses.setdefault(name, set()).add(f"{relative}:{getattr(node, 'lineno', 0)}")
    return uses


def test_the_fairscale_private_list_is_what_the_package_uses() -> None:
    """``distributed/fairscale_private.py``'s ``PRIVATE_ATTRIBUTES`` lists exactly the private FairScale names the
    package uses.

    FairScale's private names: every name starting with ``_`` (not ``__x__``) that FairScale's installed sources
    define: at a module's top level, in a class body (a method, a class attribute), or stored on any object
    (``self._is_root = ...``, ``p._fp32_shard = ...``, ``setattr``), a ``__x`` of a class ``C`` under its mangled name
    ``_C__x``. Less torch's: the names of the torch classes
    FairScale's extend (``nn.Module``, ``Optimizer``, ``GradScaler``, ``autograd.Function``, ``Tensor``: their ``dir``
    and what their methods store), which are torch's and ``torch_private``'s concern; less Lightning's attributes
    (``_compat.PRIVATE_ATTRIBUTES``).

    A use, in any module of ours (less the generated ``lightning/`` and ``fairscale_private.py`` itself): an
    attribute ``obj._x`` (read, written, called, deleted), a string ``"_x"`` (``getattr``, ``__dict__`` keys, lists of
    attribute names), or a method or class attribute ``_x`` of a class of ours that extends a FairScale class which
    defines ``_x`` (an override). A name both ours and FairScale's: ``self._x`` (the first argument of a method) is
    never counted in a class of ours that extends no FairScale class (its attributes are ours, torch's or
    Lightning's), nor, in one that extends a FairScale class, when the class defines ``_x`` itself and no FairScale
    class among its bases does (a method of ours, e.g. our unit's ``_forward``); a module-level ``_x`` of ours is a
    name, not an attribute, and never counted.
    """
    from lightning_fairscale.distributed.fairscale_private import PRIVATE_ATTRIBUTES as LISTED

    used = fairscale_private_uses()
    unlisted = {name: sorted(where) for name, where in used.items() if name not in LISTED}
    assert not unlisted, f"FairScale private names used but not in fairscale_private.PRIVATE_ATTRIBUTES: {unlisted}"
    assert sorted(set(LISTED) - set(used)) == [], "listed in fairscale_private.PRIVATE_ATTRIBUTES but no longer used"


def _private_fairscale_import(node: ast.AST) -> list[str]:
    """What ``node`` imports from FairScale that is private: a ``_`` name or module, or anything of
    ``fairscale.internal`` (FairScale's helpers, outside its API)."""
    def private_module(module: str) -> bool:
        parts = module.split(".")
        return parts[0] == "fairscale" and (parts[1:2] == ["internal"] or any(map(_private, parts)))

    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if private_module(alias.name)]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "fairscale":
        module = node.module or ""
        return [f"{module}.{a.name}" for a in node.names if private_module(f"{module}.{a.name}") or _private(a.name)]
    return []


def test_only_the_fairscale_private_module_imports_private_fairscale_names() -> None:
    offenders = []
    for path in SOURCE.rglob("*.py"):
        relative = path.relative_to(SOURCE)
        if relative.parts[0] == "lightning" or relative == FAIRSCALE_PRIVATE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            line = getattr(node, "lineno", 0)
            offenders += [f"{relative}:{line}: {name}" for name in _private_fairscale_import(node)]
    assert not offenders, offenders
