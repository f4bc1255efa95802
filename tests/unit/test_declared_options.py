"""Each option declared once: a field of its configuration (``lightning_fairscale.option_fields.option``), from which
come the configuration's check and ``Args:``, and, written into the source by ``make options``
(``tools/generate_options.py``), the Trainer's and Fabric's constructor parameters and ``Args:`` entries and the
strategies' typed attributes.

A toy option added to a copy of the configuration, and nowhere else, appears in all of them once the command has run;
the source is what the command writes; and every declared option is, on each strategy, a parameter with the declared
type and default, an attribute reading the configuration, and an ``Args:`` entry.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest

from lightning_fairscale import fabric, strategies
from lightning_fairscale._adapters.options import Option
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.option_fields import declaration, declared
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "tools"))
import generate_options as generator  # noqa: E402

#: Each configuration and the strategies that take its options.
PAIRS = [
    pytest.param(FullyShardedConfig, [strategies.DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy], id="fsdp"),
    pytest.param(ShardedDDPConfig, [strategies.DDPShardedStrategy, fabric.DDPShardedStrategy], id="sharded"),
]
#: The constructors' parameters that are no option: Lightning's own (the precision plugin under the Trainer's name and
#: Fabric's, on both). Listed here, not imported: a change to the adapters' list shows as a change to this test.
LIGHTNING_OWN = [
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout", "start_method", "precision",
]  # fmt: skip


def test_the_source_is_what_make_options_writes() -> None:
    written = generator.render(REPOSITORY)
    stale = [str(path.relative_to(REPOSITORY)) for path, text in written.items() if path.read_text() != text]
    assert not stale, f"out of date: {stale}; run `make options` (then `make lightning`)"


def resolved(annotation: Any, module: Any) -> Any:
    """An annotation as an object: a postponed one (a string) evaluated in its module, as type checkers read it."""
    namespace = {**vars(typing), **vars(module)}
    namespace.setdefault("DeviceMesh", "DeviceMesh")  # imported for type checkers only: its name stands for it
    return eval(annotation, namespace) if isinstance(annotation, str) else annotation


@pytest.mark.parametrize(("config_class", "strategy_classes"), PAIRS)
def test_every_declared_option_is_a_parameter_an_attribute_and_documented(
    config_class: type, strategy_classes: list[type]
) -> None:
    options = declared(config_class)
    kept = {field.name for field in dataclasses.fields(config_class)}
    for strategy_class in strategy_classes:
        module = sys.modules[strategy_class.__module__]
        parameters = inspect.signature(strategy_class).parameters
        names = [name for name in parameters if name != "kwargs"]
        # The options, in their declared order, and Lightning's own arguments: nothing else.
        assert [name for name in names if name not in LIGHTNING_OWN] == [name for name, _ in options]
        assert sorted(set(names) - {name for name, _ in options}) == sorted(LIGHTNING_OWN)
        strategy = strategy_class()
        doc = inspect.getdoc(strategy_class) or ""
        for name, field in options:
            declared_as = declaration(field)
            parameter = parameters[name]
            assert parameter.default == field.default, name
            accepted = declared_as.accepts or field.type
            assert resolved(parameter.annotation, module) == resolved(accepted, module), name
            summary = declared_as.summary.replace("\n", " ")
            assert f"{name}: {summary}" in " ".join(line.strip() for line in doc.splitlines()), name
            if name in kept:  # an attribute that reads the configuration (an `InitVar` is not kept)
                assert isinstance(inspect.getattr_static(strategy_class, name), Option), name
                assert getattr(strategy, name) == getattr(strategy.config, name), name
        # The constructors' defaults make the configuration's defaults.
        defaults = {name: parameters[name].default for name, _ in options}
        assert config_class(**defaults) == config_class()
    # The Trainer's and Fabric's take the same arguments with the same defaults (Lightning's own too): a script moved
    # from one to the other behaves the same.
    trainer, fabric_ = (inspect.signature(cls).parameters for cls in strategy_classes)
    assert {n: p.default for n, p in trainer.items()} == {n: p.default for n, p in fabric_.items()}
    config_doc = " ".join(line.strip() for line in (config_class.__doc__ or "").splitlines())
    for name, field in options:
        assert f"{name}: {' '.join(declaration(field).doc.split())}" in config_doc, name


TOY = '''\
    toy_option: Optional[int] = option(
        None,
        check=lambda value, config: None if value is None else int(value),
        summary="a toy option of the test.",
        doc="""a toy option of the test, declared in the configuration
            and nowhere else.""",
    )
'''

CHECK = '''\
import inspect, json
from lightning_fairscale import fabric, strategies
from lightning_fairscale._adapters.options import FullyShardedOptions, Option
from lightning_fairscale.fsdp.config import FullyShardedConfig

documented = "toy_option: a toy option of the test, declared in the configuration" in FullyShardedConfig.__doc__
found = {"config": [FullyShardedConfig(toy_option="3").toy_option, FullyShardedConfig().toy_option],
         "config_doc": documented,
         "mixin": isinstance(inspect.getattr_static(FullyShardedOptions, "toy_option"), Option)}
for strategy_class in (strategies.DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy):
    parameters = inspect.signature(strategy_class).parameters
    strategy = strategy_class(toy_option="3")
    read = strategy.toy_option
    strategy.toy_option = "4"  # checked, as any option
    found[strategy_class.__module__] = {
        "parameter": [str(parameters["toy_option"]), list(parameters)[-2:]],
        "attribute": [read, strategy.toy_option, strategy.config.toy_option],
        "args": "toy_option: a toy option of the test." in strategy_class.__doc__,
    }
print(json.dumps(found))
'''

MYPY_SNIPPET = '''\
from lightning_fairscale.fabric import DDPFullyShardedStrategy as FabricFSDP
from lightning_fairscale.strategies import DDPFullyShardedStrategy

reveal_type(DDPFullyShardedStrategy(toy_option=3).toy_option)
FabricFSDP(toy_option="three")
'''


def test_a_toy_option_declared_once_appears_in_the_config_the_attributes_both_constructors_and_the_docs(
    tmp_path: Path,
) -> None:
    """In a copy of the package: the option added to ``FullyShardedConfig`` only, then ``make options`` run."""
    shutil.copytree(REPOSITORY / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    config = tmp_path / "src" / "lightning_fairscale" / "fsdp" / "config.py"
    anchor = "    #: Keyword arguments passed to FairScale's ``FullyShardedDataParallel``"
    assert config.read_text().count(anchor) == 1
    config.write_text(config.read_text().replace(anchor, TOY + anchor))
    environment = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    command = [sys.executable, str(REPOSITORY / "tools" / "generate_options.py"), "--root", str(tmp_path)]
    wrote = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=tmp_path)
    assert wrote.returncode == 0, wrote.stderr
    assert len(wrote.stdout.splitlines()) == 3  # the mixins and the two constructors
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=environment,
                            cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found.pop("config") == [3, None] and found.pop("config_doc") and found.pop("mixin")
    for strategy in found.values():
        assert strategy == {
            "parameter": ["toy_option: Optional[int] = None", ["toy_option", "kwargs"]],
            "attribute": [3, 4, 4],
            "args": True,
        }
    # What type checkers see: the parameter's type, and the attribute's.
    pytest.importorskip("mypy")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(MYPY_SNIPPET)
    mypy_config = tmp_path / "mypy.ini"
    mypy_config.write_text(textwrap.dedent("""\
        [mypy]
        [mypy-torch.*,pytorch_lightning.*,lightning_fabric.*,lightning_utilities.*,fairscale.*,fsspec.*]
        follow_imports = skip
        ignore_missing_imports = true
        """))
    arguments = ["--config-file", str(mypy_config), "--cache-dir", str(tmp_path / "cache"), "--no-error-summary"]
    checked = subprocess.run([sys.executable, "-m", "mypy", *arguments, snippet.name], capture_output=True, text=True,
                             env=environment, cwd=tmp_path)  # fmt: skip
    lines = [line.removeprefix(f"{snippet.name}:") for line in checked.stdout.splitlines()]
    assert lines == [
        '4: note: Revealed type is "int | None"',
        '5: error: Argument "toy_option" to "DDPFullyShardedStrategy" has incompatible type "str";'
        ' expected "int | None"  [arg-type]',
    ], checked.stdout + checked.stderr
