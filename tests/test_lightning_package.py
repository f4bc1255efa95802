"""The unified ``lightning`` package as well as ``pytorch_lightning``: the same classes for both, from one source.

Equivalence, checkpoint and registry tests run against both packages; checkpoints written through one package resume
through the other.
"""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from scenarios.common import assert_adam_close, max_difference, reference_training
from scenarios.config import Scenario

import lightning_fairscale
import lightning_fairscale.lightning as for_lightning
from conftest import TESTS, Jobs, run_jobs, run_script
from lightning_fairscale.fsdp.config import FullyShardedConfig

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
    # A real module of its own, generated from the top-level one (`make lightning`), whose first line names it.
    assert Path(mirror.__file__) == Path(top.__file__).parents[1] / "lightning" / "strategies" / "fully_sharded.py"
    header = "# Generated from lightning_fairscale/strategies/fully_sharded.py by `make lightning`: do not edit."
    assert Path(mirror.__file__).read_text().partition("\n")[0] == header
    # Each subclasses its package's Lightning class, then the one shared options mixin (which imports no Lightning),
    # and holds the configuration, of one shared class.
    options = lightning_fairscale._adapters.options.FullyShardedOptions
    assert mirror.DDPFullyShardedStrategy.__bases__ == (L.strategies.DDPStrategy, options)
    assert top.DDPFullyShardedStrategy.__bases__ == (pl.strategies.DDPStrategy, options)
    assert type(mirror.DDPFullyShardedStrategy().config) is type(top.DDPFullyShardedStrategy().config)
    assert type(top.DDPFullyShardedStrategy().config) is FullyShardedConfig
    # Modules without Lightning classes are the same module objects in both.
    assert mirror.fsdp_engine is top.fsdp_engine
    assert mirror.fsdp_model.WrappedModel is top.fsdp_model.WrappedModel and mirror.ProcessGroups is top.ProcessGroups
    error = lightning_fairscale.plugins.checkpoint_io.CheckpointFileError
    assert for_lightning.plugins.checkpoint_io.CheckpointFileError is error


# ------------------------------------------------------------------------------------------------------------------
# Training on 2 CPU processes


@pytest.mark.parametrize("package", PACKAGES)
def test_fully_sharded_training_equals_unsharded_training(request: pytest.FixtureRequest, package: str) -> None:
    result = _launch(request, package)["fully-sharded"]
    assert result["package"] == package
    assert len(result["units"]) == 3
    assert_adam_close(result["state_dict"], reference_training(3, "adam"))


@pytest.mark.parametrize("package", PACKAGES)
def test_sharded_ddp_training_equals_unsharded_training(tmp_path: Path, package: str) -> None:
    out = tmp_path / "results.pt"
    args = ["--out", str(out), "--cases", "adamw,sgd-groups", "--devices", "2", "--workdir", str(tmp_path)]
    # Both ranks start at once (a cluster launcher's variables), importing in parallel: Lightning launches nothing.
    run_script([str(TESTS / "scenarios" / "sharded_train.py"), *args], cwd=tmp_path, package=package, ranks=2)
    results = torch.load(out, weights_only=False)
    from test_sharded import assert_sharded, reference

    assert_sharded(results["adamw"], "AdamW")
    assert_adam_close(results["adamw"]["state_dict"], reference("adamw"))  # as test_sharded does (ADAM_RTOL)
    assert_sharded(results["sgd-groups"], "SGD")
    assert max_difference(results["sgd-groups"]["state_dict"], reference("sgd-groups")) < 1e-5


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


def test_import_lightning_fairscale_does_not_import_lightning(tmp_path: Path) -> None:
    """A ``pytorch_lightning`` user gets no second Lightning; where ``lightning`` is not installed, the subpackage for
    it names the extra to install."""
    script = tmp_path / "missing.py"
    script.write_text(
        "import sys\n"
        "import lightning_fairscale\n"
        "print('imported lightning:', 'lightning' in sys.modules)\n"
        "sys.modules['lightning'] = None  # as if not installed\n"
        "try:\n"
        "    import lightning_fairscale.lightning\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    proc = run_script([str(script)], cwd=tmp_path)
    assert "imported lightning: False" in proc.stdout
    assert 'pip install "lightning-fairscale[lightning]"' in proc.stdout
    assert importlib.import_module("lightning_fairscale.lightning") is for_lightning


def test_import_lightning_fairscale_after_lightning_registers_the_names_with_lightning_too(tmp_path: Path) -> None:
    """``import lightning as L`` then ``import lightning_fairscale`` (isort's order): the names reach ``L.Trainer``
    and ``lightning.fabric.Fabric`` without importing ``lightning_fairscale.lightning`` by hand."""
    script = tmp_path / "registers.py"
    script.write_text(
        "import lightning as L\n"
        "import lightning_fairscale\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "trainer = L.Trainer(accelerator='cpu', devices=2, strategy='fsdp_fairscale', logger=False)\n"
        "print(type(trainer.strategy).__module__)\n"
        "print(STRATEGY_REGISTRY['ddp_sharded']['strategy'].__module__)\n"
    )
    lines = run_script([str(script)], cwd=tmp_path).stdout.split()
    assert "lightning_fairscale.lightning.strategies.fully_sharded" in lines
    assert "lightning_fairscale.lightning.fabric.sharded" in lines
