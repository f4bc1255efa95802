"""LightningCLI: the strategy from a YAML file (the user guide's own) and from the command line, on 2 processes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from scenarios.common import assert_adam_close, reference_training

from conftest import TESTS, run_script

SCRIPT = TESTS / "scenarios" / "cli_train.py"
GUIDE = TESTS.parent / "docs" / "guide.rst"
ATOL = 1e-5
#: What the tests add to the configs: a short run, no loggers or checkpoints, the scenarios' own sampler.
TRAINER = {
    "max_steps": 3, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
    "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0, "use_distributed_sampler": False,
}  # fmt: skip


def guide_config() -> dict[str, Any]:
    """The YAML config of the user guide's LightningCLI section, its layer class replaced by the scenarios' Block."""
    section = GUIDE.read_text().split("LightningCLI and YAML configs", 1)[1]
    block = re.search(r"\.\. code-block:: yaml\n\n((?:    .*\n|\n)+)", section)
    assert block is not None, "the guide's LightningCLI section has no YAML block"
    text = "\n".join(line[4:] for line in block.group(1).splitlines())
    assert "my_project.model.Block" in text
    return yaml.safe_load(text.replace("my_project.model.Block", "scenarios.common.Block"))


def run_cli(tmp_path: Path, config: dict[str, Any], *args: str, package: str = "pytorch_lightning") -> dict[str, Any]:
    path, out = tmp_path / "input.yaml", tmp_path / "result.pt"  # the CLI saves its own config.yaml here
    path.write_text(yaml.safe_dump(config))
    run_script([str(SCRIPT), "fit", "--config", str(path), *args, "--out", str(out)], cwd=tmp_path, package=package)
    return torch.load(out, weights_only=False)


def test_strategy_from_the_guides_yaml(tmp_path: Path) -> None:
    config = guide_config()
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_fairscale.strategies.DDPFullyShardedStrategy"
    config["trainer"].update(TRAINER)
    result = run_cli(tmp_path, config)
    assert result["strategy"] == "DDPFullyShardedStrategy"
    # Built as the YAML says: each Block its own unit, and checkpointed; the scalar settings as given.
    assert result["units"] == ["(root)", "net.1", "net.2"]
    assert result["auto_wrap_policy"] == result["activation_checkpointing"] == ["Block"]
    assert result["checkpointed"] == ["Block", "Block"]
    assert result["bucket_cap_mb"] == strategy["init_args"]["bucket_cap_mb"] == 10
    assert result["reshard_after_forward"] is strategy["init_args"]["reshard_after_forward"] is False
    assert result["global_step"] == 3
    assert_adam_close(result["state_dict"], reference_training(3, "adam"))


@pytest.mark.parametrize("package", ["lightning"])
def test_strategy_by_registry_name_on_the_command_line(tmp_path: Path, package: str) -> None:
    config = {"trainer": {"accelerator": "cpu", "devices": 2, **TRAINER}}
    result = run_cli(tmp_path, config, "--trainer.strategy=fsdp_fairscale", package=package)
    assert result["strategy"] == "DDPFullyShardedStrategy"
    assert result["units"] == ["(root)"]  # the default min_num_params wraps nothing of this small model
    assert result["auto_wrap_policy"] is None and result["activation_checkpointing"] == []
    assert_adam_close(result["state_dict"], reference_training(3, "adam"))


@pytest.mark.parametrize("front", ["Trainer", "Fabric"])
def test_device_mesh_annotation_parses_with_jsonargparse(front: str) -> None:
    """Lightning's regression test for its issue #21580, for our strategies (issue 48 item 3a): the constructor's
    annotation of ``device_mesh``, as ``inspect.signature`` gives it, is a type jsonargparse (LightningCLI) parses
    ``[1, 2]`` with; a postponed annotation was a string it could not call."""
    import inspect

    from jsonargparse import ArgumentParser

    from lightning_fairscale import DDPFullyShardedStrategy
    from lightning_fairscale.fabric import DDPFullyShardedStrategy as FabricDDPFullyShardedStrategy

    strategy_class = DDPFullyShardedStrategy if front == "Trainer" else FabricDDPFullyShardedStrategy
    annotation = inspect.signature(strategy_class.__init__).parameters["device_mesh"].annotation
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--device_mesh", type=annotation, default=None)
    assert parser.parse_args(["--device_mesh", "[1, 2]"]).device_mesh == (1, 2)
    assert parser.parse_args([]).device_mesh is None
    with pytest.raises(Exception, match="tuple with 2 elements"):  # a mesh has two sizes
        parser.parse_args(["--device_mesh", "[1, 2, 3]"])
    parsed = parser.parse_args(["--device_mesh", "[1, 2]"]).device_mesh
    assert strategy_class(sharding_strategy="HYBRID_SHARD", device_mesh=parsed).device_mesh == (1, 2)
