"""The strategies' options (``_adapters.options.FullyShardedOptions``, ``ShardedDDPOptions``): typed properties
that mypy sees, written in the source with their docstrings; before setup each may change, after it only those the
strategy reads at each use (``state_dict_type``, ``lightning_1x_optimizer_state``), the others raise at once.

The Trainer's strategies run ``fit`` and Fabric's ``launch`` on one CPU process, in this process (a gloo group of
one rank), so the options are fixed by the strategies' own set-up, not by a call of the test's.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fairscale import fabric, strategies
from lightning_fairscale._adapters import options

from .helpers import one_process, fabric_on_one_process

SOURCE = Path(__file__).resolve().parents[2] / "src"
FSDP = [strategies.DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy]
SHARDED = [strategies.DDPShardedStrategy, fabric.DDPShardedStrategy]
ALL = [*FSDP, *SHARDED, strategies.DDPSpawnShardedStrategy, fabric.DDPSpawnShardedStrategy]


# ---------------------------------------------------------------------------------------------------------------------
# Declared in the source


@pytest.mark.parametrize("strategy_class", ALL, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_the_docstring_is_the_sources_and_documents_every_constructor_argument(strategy_class: type) -> None:
    """Written in the source (as editors show it: nothing rewrites it at import), with an ``Args:`` entry for each
    argument of the constructor, ``*args``/``**kwargs`` with their stars, in the constructor's order."""
    module = ast.parse(Path(inspect.getfile(strategy_class)).read_text())
    node = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == strategy_class.__name__)
    assert strategy_class.__doc__ == ast.get_docstring(node, clean=False)
    doc = inspect.cleandoc(strategy_class.__doc__ or "")
    section = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0]
    entries = [line.split(":", 1) for line in section.splitlines() if not line.startswith("        ")]
    assert all(text.strip() for _, text in entries), "an empty `Args:` entry"
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    parameters = list(inspect.signature(strategy_class.__init__).parameters.values())[1:]
    assert [name.strip() for name, _ in entries] == [stars.get(p.kind, "") + p.name for p in parameters]


@pytest.mark.parametrize("strategy_class", ALL, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_a_strategy_is_lightnings_class_and_the_mixin_adds_names_lightning_does_not_have(strategy_class: type) -> None:
    """The options' mixin comes after Lightning's class: Lightning's attributes win, and none has the name of an
    option (so the mixin changes nothing of Lightning's behaviour); the Trainer's ``isinstance`` checks hold."""
    mro = strategy_class.__mro__
    lightning = [c for c in mro[:-1] if c.__module__.split(".")[0] != "lightning_fairscale"]
    mixin = next(c for c in mro if c.__module__ == options.__name__)
    assert mro.index(lightning[0]) < mro.index(mixin) and issubclass(strategy_class, lightning[0])
    ours = {name for klass in mixin.__mro__[:-1] for name in vars(klass) if not name.startswith("__")}
    theirs = {name for klass in lightning for name in dir(klass)} | set(vars(lightning[0]()))
    assert ours >= {"config", "sync_each_batch", "_fix_options"} and not ours & theirs


def test_mypy_sees_the_options_types(tmp_path: Path) -> None:
    """What an editor and a type checker see: each option's type, and an error for a value of another type.
    (Lightning, torch and FairScale are not followed, which keeps this a few seconds: the types are ours.)"""
    pytest.importorskip("mypy")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent("""\
        from lightning_fairscale.fabric import DDPFullyShardedStrategy as FabricFSDP, DDPShardedStrategy as FabricDDP
        from lightning_fairscale.strategies import DDPFullyShardedStrategy, DDPShardedStrategy

        strategy = DDPFullyShardedStrategy()
        reveal_type(strategy.min_num_params)
        reveal_type(FabricFSDP().state_dict_type)
        reveal_type(DDPShardedStrategy().config)
        reveal_type(FabricDDP().sync_each_batch)
        strategy.min_num_params = 10**6
        strategy.exclude_wrap_modules = []
        strategy.min_num_params = "big"
        FabricFSDP().state_dict_type = "local"
        DDPShardedStrategy().sync_each_batch = "yes"
        """))
    config = tmp_path / "mypy.ini"
    config.write_text(textwrap.dedent("""\
        [mypy]
        [mypy-torch.*,pytorch_lightning.*,lightning_fabric.*,lightning_utilities.*,fairscale.*,fsspec.*]
        follow_imports = skip
        ignore_missing_imports = true
        """))
    arguments = ["--config-file", str(config), "--cache-dir", str(tmp_path / "cache"), "--no-error-summary"]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "mypy", *arguments, str(snippet)], capture_output=True, text=True, env=environment
    )
    lines = [line.removeprefix(f"{snippet}:") for line in result.stdout.splitlines()]
    assert lines == [
        '5: note: Revealed type is "int"',
        '''6: note: Revealed type is "Literal['full'] | Literal['sharded']"''',
        '7: note: Revealed type is "lightning_fairscale.sharded_ddp.config.ShardedDDPConfig"',
        '8: note: Revealed type is "bool"',
        '11: error: Incompatible types in assignment (expression has type "str", variable has type "int")'
        "  [assignment]",
        '12: error: Incompatible types in assignment (expression has type "Literal[\'local\']", variable has type'
        ' "Literal[\'full\', \'sharded\']")  [assignment]',
        '13: error: Incompatible types in assignment (expression has type "str", variable has type "bool")'
        "  [assignment]",
    ], result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------------------------------
# Before setup: every option reads and writes, checked


@pytest.mark.parametrize("strategy_class", FSDP)
def test_before_setup_every_option_reads_and_writes_through_a_checked_config(strategy_class: type) -> None:
    strategy = strategy_class()
    for field in dataclasses.fields(strategy.config):
        if field.name not in ("fairscale_kwargs", "owner"):
            setattr(strategy, field.name, getattr(strategy, field.name))  # each one's own value passes again
    strategy.min_num_params, strategy.cpu_offload = 1e6, torch.distributed.fsdp.CPUOffload(offload_params=True)
    assert (strategy.min_num_params, strategy.cpu_offload, strategy.config.cpu_offload) == (1_000_000, True, True)
    with pytest.raises(ValueError, match="`state_dict_type` must be"):
        strategy.state_dict_type = "local"
    assert strategy.state_dict_type == "full"  # a refused value leaves the config as it was


# ---------------------------------------------------------------------------------------------------------------------
# After setup


def fit(strategy: Any, tmp_path: Path) -> Any:
    from pytorch_lightning import Trainer
    from pytorch_lightning.demos.boring_classes import BoringModel

    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    return trainer


def assert_fixed(strategy: Any, name: str, value: Any) -> None:
    """Setting option ``name`` raises, saying what to do, and leaves it as it was; so does replacing the config."""
    before = strategy.config
    with pytest.raises(RuntimeError, match=rf"`{name}` cannot change once the strategy is set up.*set it before the"
                                           r" run starts; for another run, make a new strategy"):
        setattr(strategy, name, value)
    with pytest.raises(RuntimeError, match=rf"`{name}` cannot change"):
        strategy.config = dataclasses.replace(strategy.config, **{name: value})
    assert strategy.config is before


def test_trainer_fsdp_options_are_fixed_at_setup_but_the_checkpoint_format(tmp_path: Path) -> None:
    strategy = strategies.DDPFullyShardedStrategy(state_dict_type="sharded", min_num_params=100)
    with one_process():
        trainer = fit(strategy, tmp_path)
        for name, value in [("min_num_params", 10), ("sharding_strategy", "SHARD_GRAD_OP"), ("cpu_offload", True),
                            ("sync_each_batch", True), ("auto_wrap_policy", {torch.nn.Linear})]:
            assert_fixed(strategy, name, value)
        strategy.min_num_params = 100  # the same value: nothing changes
        # Read at each save: a last checkpoint as one full file, from a run that wrote sharded ones.
        strategy.state_dict_type = "full"
        trainer.save_checkpoint(tmp_path / "full.ckpt")
        strategy.lightning_1x_optimizer_state = "reset"
    assert (tmp_path / "full.ckpt").is_file() and strategy.config.lightning_1x_optimizer_state == "reset"


def test_trainer_sharded_options_are_fixed_at_setup_but_the_1x_policy(tmp_path: Path) -> None:
    strategy = strategies.DDPShardedStrategy()
    with one_process():
        fit(strategy, tmp_path)
    assert_fixed(strategy, "sync_each_batch", True)
    strategy.lightning_1x_optimizer_state = "reset"
    assert strategy.lightning_1x_optimizer_state == "reset"


@pytest.mark.parametrize("strategy_class", [fabric.DDPFullyShardedStrategy, fabric.DDPShardedStrategy])
def test_fabric_options_are_fixed_at_launch(strategy_class: type, tmp_path: Path) -> None:
    strategy = strategy_class()
    strategy.sync_each_batch = True  # before launch: any option
    with fabric_on_one_process(strategy):
        assert_fixed(strategy, "sync_each_batch", False)
        if strategy_class is fabric.DDPFullyShardedStrategy:
            assert_fixed(strategy, "min_num_params", 10)
            strategy.state_dict_type = "sharded"
        strategy.lightning_1x_optimizer_state = "reset"
    assert strategy.sync_each_batch is True and strategy.lightning_1x_optimizer_state == "reset"
