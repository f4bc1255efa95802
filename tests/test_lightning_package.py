"""The unified ``lightning`` package as well as ``pytorch_lightning``: the same classes for both, from one source.

Equivalence, checkpoint and registry tests run against both packages; checkpoints written through one package resume
through the other.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from scenarios.common import max_difference, reference_training
from scenarios.config import Scenario

import lightning_fairscale
import lightning_fairscale.lightning as for_lightning
from conftest import TESTS, Jobs, run_jobs, run_script
from lightning_fairscale.fsdp.options import FullyShardedOptions
from lightning_fairscale.lightning import _loader

PACKAGES = ["pytorch_lightning", "lightning"]
LIGHTNING = {"pytorch_lightning": pl, "lightning": L}
OURS = {"pytorch_lightning": lightning_fairscale, "lightning": for_lightning}
NAMES = {
    "fsdp_fairscale": "DDPFullyShardedStrategy",
    "ddp_fully_sharded": "DDPFullyShardedStrategy",
    "ddp_sharded": "DDPShardedStrategy",
    "ddp_sharded_find_unused_parameters_false": "DDPShardedStrategy",
    "ddp_sharded_spawn": "DDPSpawnShardedStrategy",
}
STEPS = Scenario(steps=4, samples=8, scheduler=True)  # one step per epoch: every epoch end is a resume point


# ------------------------------------------------------------------------------------------------------------------
# The classes


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("name", list(NAMES))
def test_registry_names_reach_either_trainer(package: str, name: str) -> None:
    trainer = LIGHTNING[package].Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert type(trainer.strategy) is getattr(OURS[package], NAMES[name])
    assert isinstance(trainer.strategy, LIGHTNING[package].strategies.Strategy)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_trainer_takes_its_own_classes_in_one_process(package: str) -> None:
    ours, lightning = OURS[package], LIGHTNING[package]
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ours.DDPFullyShardedStrategy(state_dict_type="sharded"),
        plugins=[ours.ShardedCheckpointIO(), ours.FullyShardedMixedPrecisionPlugin("bf16-mixed", "cpu")],
        logger=False,
    )
    assert isinstance(trainer.strategy.checkpoint_io, ours.ShardedCheckpointIO)
    assert isinstance(trainer.strategy.precision_plugin, ours.FullyShardedMixedPrecisionPlugin)
    assert isinstance(trainer.strategy.precision_plugin, lightning.plugins.precision.Precision)
    # The other package's Trainer refuses them: its strategies are other classes (the guide quotes this message).
    other = LIGHTNING[PACKAGES[1 - PACKAGES.index(package)]]
    with pytest.raises(ValueError, match="must be either a string or an instance of `.*strategies.Strategy`"):
        other.Trainer(accelerator="cpu", devices=2, strategy=ours.DDPFullyShardedStrategy(), logger=False)


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize(("name", "plugin"), [("fsdp_fairscale", "FullyShardedHalfPrecisionPlugin"),
                                              ("ddp_sharded", "ShardedHalfPrecisionPlugin")])
def test_each_trainer_gets_its_own_true_half_precision_plugin(package: str, name: str, plugin: str) -> None:
    lightning = LIGHTNING[package]
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=name, precision="bf16-true", logger=False)
    assert type(trainer.strategy.precision_plugin) is getattr(OURS[package], plugin)
    assert isinstance(trainer.strategy.precision_plugin, lightning.plugins.precision.HalfPrecision)


def test_the_flavours_share_everything_but_the_lightning_classes() -> None:
    top, mirror = lightning_fairscale.strategies.fully_sharded, for_lightning.strategies.fully_sharded
    assert top is not mirror and top.__file__ == mirror.__file__  # one source file, compiled twice
    # The options (shared) come first, then each package's access to Lightning's internals and its base class.
    assert mirror.DDPFullyShardedStrategy.__mro__[1:4] == (
        FullyShardedOptions, for_lightning._compat.StrategyInternals, L.strategies.DDPStrategy
    )
    assert top.DDPFullyShardedStrategy.__mro__[1:4] == (
        FullyShardedOptions, lightning_fairscale._compat.StrategyInternals, pl.strategies.DDPStrategy
    )
    # Modules without Lightning classes are the same module objects in both.
    assert mirror.fsdp_engine is top.fsdp_engine
    assert mirror.FullyShardedDataParallel is top.FullyShardedDataParallel
    assert for_lightning.checkpoint_io.CheckpointFileError is lightning_fairscale.plugins.checkpoint_io.CheckpointFileError


def _imported_at_import_time(statements: list[ast.stmt]) -> set[str]:
    """The modules that top-level statements import (``if TYPE_CHECKING:`` blocks and function bodies excluded)."""
    found: set[str] = set()
    for node in statements:
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_fairscale":
            found.update(f"lightning_fairscale.{alias.name}" for alias in node.names)  # submodules
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            found |= _imported_at_import_time(node.body) | _imported_at_import_time(node.orelse)
        elif isinstance(node, ast.Try):
            found |= _imported_at_import_time(node.body)
    return found


def test_the_bound_modules_are_those_that_import_lightning() -> None:
    """Every module that imports Lightning is in ``_loader.BOUND``, and every bound module needs Lightning.

    A bound module imports Lightning itself or imports another bound module (``precision/__init__`` imports its
    submodules, say). Shared modules may use the ``pytorch_lightning`` classes (``consolidate`` reads files with the
    default ``ShardedCheckpointIO``); they must not import Lightning themselves.
    """
    root = Path(lightning_fairscale.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).with_suffix("")
        if relative.parts[0] == "lightning":
            continue  # the flavour's own package
        name = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
        imports[name] = _imported_at_import_time(ast.parse(path.read_text()).body)

    def imports_lightning(name: str) -> bool:
        return any(module.partition(".")[0] in _loader.RENAMED for module in imports[name])

    def imports_bound(name: str) -> bool:
        return any(module.removeprefix("lightning_fairscale.") in _loader.BOUND for module in imports[name])

    direct = {name for name in imports if name and imports_lightning(name)}
    assert direct <= set(_loader.BOUND), "these modules import Lightning: add them to _loader.BOUND"
    assert all(imports_lightning(name) or imports_bound(name) for name in _loader.BOUND)
    assert direct  # the scan found the imports at all


@pytest.mark.parametrize(
    ("source", "renamed"),
    [
        ("import pytorch_lightning as pl", "import lightning.pytorch as pl"),
        ("import pytorch_lightning", "import lightning.pytorch as pytorch_lightning"),
        ("from lightning_fabric.plugins import CheckpointIO", "from lightning.fabric.plugins import CheckpointIO"),
        ("from lightning_fairscale.precision import X", "from lightning_fairscale.lightning.precision import X"),
        ("from lightning_fairscale.fsdp.policies import X", "from lightning_fairscale.fsdp.policies import X"),
        ("from lightning_fairscale.fsdp import units", "from lightning_fairscale.fsdp import units"),
        ("import torch.distributed as dist", "import torch.distributed as dist"),
    ],
)
def test_imports_are_renamed_for_lightning(source: str, renamed: str) -> None:
    tree = _loader._RenameImports("x.py").visit(ast.parse(source))
    assert ast.unparse(tree) == renamed


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("from .fully_sharded import X", "relative imports"),
        ("import pytorch_lightning.strategies", "cannot be renamed"),
        ("from lightning_fairscale import strategies", "by their full name"),
    ],
)
def test_imports_that_cannot_be_renamed_are_refused(source: str, match: str) -> None:
    with pytest.raises(ImportError, match=match):
        _loader.compile_for_lightning(source.encode(), "x.py")


# ------------------------------------------------------------------------------------------------------------------
# Training on 2 CPU processes


@pytest.mark.parametrize("package", PACKAGES)
def test_fully_sharded_training_equals_unsharded_training(request: pytest.FixtureRequest, package: str) -> None:
    result = _launch(request, package)["fully-sharded"]
    assert result["package"] == package
    assert len(result["units"]) == 3
    assert max_difference(result["state_dict"], reference_training(3, "adam")) < 1e-5


@pytest.mark.parametrize("package", PACKAGES)
def test_sharded_ddp_training_equals_unsharded_training(tmp_path: Path, package: str) -> None:
    out = tmp_path / "results.pt"
    args = ["--out", str(out), "--cases", "adamw,sgd-groups", "--devices", "2", "--workdir", str(tmp_path)]
    # Both ranks start at once (a cluster launcher's variables), importing in parallel: Lightning launches nothing.
    run_script([str(TESTS / "scenarios" / "sharded_train.py"), *args], cwd=tmp_path, package=package, ranks=2)
    results = torch.load(out, weights_only=False)
    from test_sharded import assert_sharded, reference

    for name, optimizer in (("adamw", "AdamW"), ("sgd-groups", "SGD")):
        assert_sharded(results[name], optimizer)
        assert max_difference(results[name]["state_dict"], reference(name)) < 1e-5


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints across the packages


STATE_DICT_TYPES = ["full", "sharded"]


def _straight_jobs(folder: Path) -> dict[str, Scenario]:
    """Four steps with a checkpoint at every epoch end, saved full and sharded."""
    return {
        f"straight-{kind}": STEPS.replace(checkpoint_dir=str(folder / f"ck-{kind}"), state_dict_type=kind)
        for kind in STATE_DICT_TYPES
    }


def _resume_jobs(written: Jobs) -> dict[str, Scenario]:
    """Resumes from the step-2 checkpoints that the straight jobs of ``written`` (another package's launch) wrote."""
    return {
        f"resume-{kind}": STEPS.replace(ckpt_path=str(_checkpoint(written, kind, 2)), state_dict_type=kind)
        for kind in STATE_DICT_TYPES
    }


def _checkpoint(jobs: Jobs, kind: str, step: int) -> Path:
    return jobs.folder / f"ck-{kind}" / f"epoch={step - 1}-step={step}.ckpt"


# Each package trains in one launch; the resumes of the other package's checkpoints go where they can, in dependency
# order: pytorch_lightning writes, lightning resumes and writes, pytorch_lightning resumes those in a last launch.
@pytest.fixture(scope="module")
def pl_runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    folder = tmp_path_factory.mktemp("pytorch_lightning")
    jobs = {**_straight_jobs(folder), "fully-sharded": Scenario(policy="blocks", steps=3)}
    return run_jobs(folder, jobs, package="pytorch_lightning")


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory, pl_runs: Jobs) -> Jobs:
    folder = tmp_path_factory.mktemp("lightning")
    jobs = {**_resume_jobs(pl_runs), **_straight_jobs(folder), "fully-sharded": Scenario(policy="blocks", steps=3)}
    return run_jobs(folder, jobs, package="lightning")


@pytest.fixture(scope="module")
def pl_resumes(tmp_path_factory: pytest.TempPathFactory, lightning_runs: Jobs) -> Jobs:
    return run_jobs(tmp_path_factory.mktemp("pytorch_lightning-resumes"), _resume_jobs(lightning_runs))


def _launch(request: pytest.FixtureRequest, package: str, resumes: bool = False) -> Jobs:
    """The launch that trains through ``package`` (with ``resumes``: the one that resumes the other's checkpoints)."""
    if package == "lightning":
        return request.getfixturevalue("lightning_runs")
    return request.getfixturevalue("pl_resumes" if resumes else "pl_runs")


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
@pytest.mark.parametrize(("writer", "reader"), [("pytorch_lightning", "lightning"), ("lightning", "pytorch_lightning")])
def test_a_checkpoint_written_through_one_package_resumes_through_the_other(
    request: pytest.FixtureRequest, writer: str, reader: str, state_dict_type: str
) -> None:
    straight = _launch(request, writer)[f"straight-{state_dict_type}"]
    assert straight["package"] == writer
    resumed = _launch(request, reader, resumes=True)[f"resume-{state_dict_type}"]
    assert (resumed["package"], resumed["global_step"]) == (reader, 4)
    assert max_difference(resumed["state_dict"], straight["state_dict"]) == 0.0


def test_a_consolidated_checkpoint_loads_through_lightning(lightning_runs: Jobs, tmp_path: Path) -> None:
    target = tmp_path / "full.ckpt"
    source = _checkpoint(lightning_runs, "sharded", 4)
    command = ["-m", "lightning_fairscale.consolidate", str(source), str(target)]
    run_script(command, cwd=tmp_path)
    expected = lightning_runs.folder / "straight-sharded.pt"
    script = tmp_path / "load.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "from scenarios.common import RegressionModel, max_difference\n"
        "from scenarios.flavor import LightningModule\n"
        "assert issubclass(RegressionModel, LightningModule) and LightningModule.__module__.startswith('lightning.')\n"
        f"model = RegressionModel.load_from_checkpoint({str(target)!r})\n"
        f"expected = torch.load({str(expected)!r}, weights_only=False)['state_dict']\n"
        "assert max_difference(model.state_dict(), expected) == 0.0\n"
        "print('loaded through lightning')\n"
    )
    proc: subprocess.CompletedProcess = run_script([str(script)], cwd=tmp_path, package="lightning")
    assert "loaded through lightning" in proc.stdout


def test_the_lightning_flavour_names_the_extra_when_lightning_is_missing(tmp_path: Path) -> None:
    script = tmp_path / "missing.py"
    script.write_text(
        "import sys\n"
        "sys.modules['lightning'] = None  # as if not installed\n"
        "import lightning_fairscale  # works: pytorch_lightning users are not affected\n"
        "try:\n"
        "    import lightning_fairscale.lightning\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    proc = run_script([str(script)], cwd=tmp_path)
    assert 'pip install "lightning-fairscale[lightning]"' in proc.stdout
    assert importlib.import_module("lightning_fairscale.lightning") is for_lightning
