"""Writes what the strategies' options declare into the source: each option is declared once, as a field of its
configuration (``fsdp/config.py``, ``sharded_ddp/config.py``, made by ``lightning_fairscale.option_fields.option``).

From each declared field this script writes, where type checkers, editors, LightningCLI and Sphinx read them:

* the typed attribute of the options' mixin (``_adapters/options.py``, between its ``BEGIN generated`` and
  ``END generated`` lines): ``name: Option[<the config's type>, <the accepted type>] = Option()`` and its docstring
  (the option's ``doc``, and whether it may change after set-up);
* the parameter of the Trainer's and Fabric's constructors (``strategies/``, ``fabric/``): ``name: <accepted type> =
  <default>``, and its entry in the class docstring's ``Args:`` (the option's ``summary``).

Lightning's own parameters of a constructor (``accelerator``, ``timeout``...), their ``Args:`` entries and
``**kwargs`` are the source's, kept as they are and where they are: each follows the option it follows today
(Lightning 1.x's positional order); a new option goes after the last one, an option removed goes. Every other line
stays. The option's accepted type is written as declared (source text): the constructor's module must import the
names it uses.

Run ``make options`` (``python tools/generate_options.py``, with the package's environment: it imports the
configurations) after declaring or changing an option, then ``make lightning``; ``--check`` only names the files out of
date, and ``tests/unit/test_declared_options.py`` fails while one is. ``--root`` writes another copy of the
repository (the test's, with a toy option).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_fairscale"
COMMAND = "make options"
#: The configurations, and the constructors (file under the package, class) that take their options.
CONFIGS = {
    "fsdp.config.FullyShardedConfig": (
        ("strategies/fully_sharded.py", "DDPFullyShardedStrategy"),
        ("fabric/fully_sharded.py", "DDPFullyShardedStrategy"),
    ),
    "sharded_ddp.config.ShardedDDPConfig": (
        ("strategies/sharded.py", "DDPShardedStrategy"),
        ("fabric/sharded.py", "DDPShardedStrategy"),
    ),
}
MIXINS = "_adapters/options.py"
END = "    # END generated"
#: The longest line (the project's, ruff's `line-length`).
WIDTH = 120


class GenerationError(Exception):
    """A source the script cannot rewrite: the message names the file and what to fix."""


def load_config(name: str) -> Any:
    module, _, cls = f"{PACKAGE}.{name}".rpartition(".")
    return getattr(importlib.import_module(module), cls)


def options(config_class: Any) -> list[tuple[str, Any, Any]]:
    """``(name, field, declaration)`` of each option of ``config_class``, in their order."""
    from lightning_fairscale.option_fields import declaration, declared

    return [(name, field, declaration(field)) for name, field in declared(config_class)]


def default_source(field: Any) -> str:
    """The default as source text: strings in double quotes, large integers with ``_`` (``100_000_000``)."""
    default = field.default
    if default is dataclasses.MISSING:
        raise GenerationError(f"option `{field.name}` has no default: a strategy's every option needs one")
    if isinstance(default, str):
        return json.dumps(default)
    return f"{default:_}" if type(default) is int else repr(default)


def type_source(field: Any, text: Any) -> str:
    """An annotation as source text (the configurations' are, postponed), its strings in double quotes."""
    if not isinstance(text, str):
        raise GenerationError(f"option `{field.name}`: its type must be source text (declare `accepts=`)")
    return text if '"' in text else text.replace("'", '"')


def accepted_type(field: Any, declared: Any) -> str:
    return type_source(field, declared.accepts or field.type)


def indented(text: str, first: str, rest: str) -> list[str]:
    """``text``'s lines, the first after ``first``, the others after ``rest`` (blank lines kept blank)."""
    head, *tail = text.splitlines()
    return [first + head, *(rest + line if line else "" for line in tail)]


def render_attributes(config_class: Any) -> list[str]:
    """The mixin's lines for ``config_class``'s options (not those the configuration does not keep: ``InitVar``)."""
    lines = []
    kept = {field.name for field in dataclasses.fields(config_class)}
    for name, field, declared in options(config_class):
        if name not in kept:
            continue
        types = f"{type_source(field, field.type)}, {accepted_type(field, declared)}"
        line = f"    {name}: Option[{types}] = Option()"
        lines += [line] if len(line) <= WIDTH else [f"    {name}: Option[", f"        {types}", "    ] = Option()"]
        when = "Read at each use: may change at any time." if declared.changeable else "Fixed at setup."
        doc = f"{declared.doc[0].upper()}{declared.doc[1:]} {when}"
        # Not at hyphens: "all-reduced" and "lightning-fairscale-consolidate" stay whole.
        lines += textwrap.wrap(
            doc, WIDTH - 3, initial_indent='    """', subsequent_indent="    ", break_on_hyphens=False
        )
        lines[-1] += '"""'
    return lines


def rewrite_mixins(text: str, config_classes: list[Any]) -> str:
    lines = text.splitlines()
    for config_class in config_classes:
        begin = f"    # BEGIN generated from {config_class.__name__} by `{COMMAND}`"
        if begin not in lines:
            raise GenerationError(f"{MIXINS}: no line `{begin.strip()}` (and `{END.strip()}` after it)")
        start = lines.index(begin) + 1
        end = lines.index(END, start)
        lines[start:end] = render_attributes(config_class)
    return "\n".join(lines) + "\n"


def _class(tree: ast.Module, name: str, path: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise GenerationError(f"{path}: no class {name}")


def rewrite_constructor(text: str, path: str, class_name: str, config_class: Any) -> str:
    """``text`` (a strategy's module) with ``class_name``'s constructor parameters and ``Args:`` entries of the
    options written from ``config_class``, Lightning's kept where they follow."""
    lines = text.splitlines()
    node = _class(ast.parse(text), class_name, path)
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None or init.args.vararg or init.args.kwonlyargs or init.args.kwarg is None:
        raise GenerationError(f"{path}: {class_name}.__init__(self, ..., **kwargs) expected")
    declared = {name: (field, d) for name, field, d in options(config_class)}
    parameters = init.args.args[1:]  # not `self`
    if any(p.lineno == init.lineno or p.end_lineno != p.lineno for p in parameters):
        raise GenerationError(f"{path}: {class_name}.__init__ must have one parameter a line")
    # Lightning's parameters, each after the option it follows (None: before the first option).
    follows: dict[Any, list[str]] = {}
    previous = None
    for parameter in parameters:
        if parameter.arg in declared:
            previous = parameter.arg
        else:
            follows.setdefault(previous, []).append(parameter.arg)
    missing = [name for name in follows if name is not None and name not in declared]
    if missing:
        raise GenerationError(f"{path}: Lightning's parameters follow a removed option {missing}: place them")
    order = [*follows.get(None, []), *(n for name in declared for n in (name, *follows.get(name, [])))]
    source = {p.arg: lines[p.lineno - 1] for p in parameters}
    signature = []
    for name in order:
        if name in declared:
            field, d = declared[name]
            signature.append(f"        {name}: {accepted_type(field, d)} = {default_source(field)},")
        else:
            signature.append(source[name])
    first, last = parameters[0].lineno - 1, parameters[-1].lineno  # the lines of the parameters after `self`
    doc_node = node.body[0]
    if not (isinstance(doc_node, ast.Expr) and isinstance(doc_node.value, ast.Constant)):
        raise GenerationError(f"{path}: {class_name} has no docstring")
    args_start = next(
        (i for i in range(doc_node.lineno - 1, doc_node.end_lineno or 0) if lines[i] == "    Args:"), None
    )
    if args_start is None:
        raise GenerationError(f"{path}: {class_name}'s docstring has no `Args:` section")
    args_end = next(i for i in range(args_start + 1, len(lines)) if not lines[i].strip())
    entries: dict[str, list[str]] = {}
    for line in lines[args_start + 1 : args_end]:
        if line.startswith("        ") and not line.startswith("         "):
            entries[line.strip().split(":", 1)[0].lstrip("*")] = [line]
        else:
            list(entries.values())[-1].append(line)
    documented = []
    for name in [*order, "kwargs"]:
        if name in declared:
            documented += indented(declared[name][1].summary, f"        {name}: ", "            ")
        elif name in entries:
            documented += entries[name]
        else:
            raise GenerationError(f"{path}: {class_name}'s `Args:` has no entry for Lightning's `{name}`")
    # Replace from the bottom up, so that the line numbers above stay right.
    lines[first:last] = signature
    lines[args_start + 1 : args_end] = documented
    return "\n".join(lines) + "\n"


def render(root: Path) -> dict[Path, str]:
    """Every file this script writes under ``root`` (a repository), with the text it would have."""
    package = root / "src" / PACKAGE
    configs = {name: load_config(name) for name in CONFIGS}
    written = {package / MIXINS: rewrite_mixins((package / MIXINS).read_text(), list(configs.values()))}
    for name, constructors in CONFIGS.items():
        for relative, class_name in constructors:
            path = package / relative
            written[path] = rewrite_constructor(path.read_text(), relative, class_name, configs[name])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only name the files out of date (exit 1 if any)")
    parser.add_argument("--root", type=Path, default=REPOSITORY, help="the repository to write (default: this one)")
    arguments = parser.parse_args(argv)
    sys.path.insert(0, str(arguments.root / "src"))
    try:
        written = render(arguments.root)
    except GenerationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stale = [path for path, text in written.items() if path.read_text() != text]
    for path in stale:
        print(f"{'out of date' if arguments.check else 'wrote'}: {path.relative_to(arguments.root)}")
        if not arguments.check:
            path.write_text(written[path])
    return 1 if arguments.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
