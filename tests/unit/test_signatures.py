"""The strategies' arguments beyond their declaration (``tests/unit/test_declared_options.py``): unknown ones refused,
the user's values kept and derived ones computed where used, and LightningCLI reading them from a config file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fairscale import fabric, strategies
from lightning_fairscale._adapters import config_arguments
from lightning_fairscale.fsdp.config import FullyShardedConfig

ON_CPU = {"parallel_devices": [torch.device("cpu")]}  # for `fsdp_kwargs()`, which needs the device


def test_unknown_arguments_raise_saying_what_is_accepted() -> None:
    arguments = {"self": None, "kwargs": {}, "timeout": None, "min_num_params": 5, "reshard_after_fwd": False}
    with pytest.raises(TypeError, match=r"takes no argument `reshard_after_fwd`.*min_num_params.*timeout"):
        config_arguments(FullyShardedConfig, arguments)
    del arguments["reshard_after_fwd"]
    assert config_arguments(FullyShardedConfig, arguments) == {"min_num_params": 5, "fairscale_kwargs": {}}


@pytest.mark.parametrize("strategy_class", [strategies.DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy])
def test_the_users_values_are_kept_and_derived_ones_computed_where_used(strategy_class: type) -> None:
    strategy = strategy_class(sharding_strategy="SHARD_GRAD_OP", **ON_CPU)
    assert strategy.reshard_after_forward is True  # what the user passed (the default)
    assert strategy.fsdp_kwargs()["reshard_after_forward"] is False  # ZeRO-2: what FSDP gets
    strategy.config = dataclasses.replace(strategy.config, sharding_strategy="FULL_SHARD")
    assert strategy.fsdp_kwargs()["reshard_after_forward"] is True
    strategy.sharding_strategy = "_HYBRID_SHARD_ZERO2"
    assert strategy.fsdp_kwargs()["reshard_after_forward"] is False
    strategy.sharding_strategy = "HYBRID_SHARD"
    assert strategy.fsdp_kwargs()["reshard_after_forward"] is True
    explicit = strategy_class(reshard_after_forward=False, **ON_CPU)
    assert explicit.reshard_after_forward is explicit.fsdp_kwargs()["reshard_after_forward"] is False


@pytest.mark.parametrize("strategy_class", [strategies.DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy])
def test_device_mesh_is_a_property(strategy_class: type) -> None:
    assert strategy_class().device_mesh is None
    assert strategy_class(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4)).device_mesh == (2, 4)


@pytest.mark.filterwarnings("ignore:No seed found")  # LightningCLI seeds the run
def test_lightning_cli_reads_the_device_mesh_from_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.demos.boring_classes import BoringModel

    init_args = {"sharding_strategy": "HYBRID_SHARD", "device_mesh": [1, 2]}
    trainer = {
        "accelerator": "cpu", "devices": 2, "logger": False, "enable_checkpointing": False,
        "strategy": {"class_path": "lightning_fairscale.strategies.DDPFullyShardedStrategy", "init_args": init_args},
    }  # fmt: skip
    monkeypatch.setattr("sys.argv", ["cli"])  # the CLI reads `args` only (not pytest's command line)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": trainer}))
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, strategies.DDPFullyShardedStrategy)
    assert (strategy.sharding_strategy, strategy.device_mesh) == ("HYBRID_SHARD", (1, 2))
