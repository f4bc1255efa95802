"""One declaration of options: the Trainer's and Fabric's strategies take the same arguments, which are their
configuration's fields plus Lightning's own, and each option has a property and an ``Args:`` entry on both.

The constructors stay explicit (LightningCLI and editors read their signatures); this test is what keeps the three
declarations (Trainer constructor, Fabric constructor, config fields) in step.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fairscale import fabric, strategies
from lightning_fairscale._adapters import config_arguments
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig

#: The arguments our strategies pass on to their Lightning base class (``DDPStrategy``, the Trainer's or Fabric's),
#: not to their configuration: Lightning's own, listed here rather than imported so that a change to the adapters'
#: list shows up as a change to this test. The precision plugin comes under both names, the Trainer's
#: (``precision_plugin``) and Fabric's (``precision``), on both strategies: a Lightning 1.x script passes either.
LIGHTNING_OWN = {
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "process_group_backend", "timeout",
    "start_method", "precision_plugin", "precision",
}  # fmt: skip
#: Config fields that are no constructor argument: the extra keyword arguments (``**kwargs``), and the strategy's
#: class name for the error messages.
NOT_ARGUMENTS = {"fairscale_kwargs", "owner"}

ON_CPU = {"parallel_devices": [torch.device("cpu")]}  # for `fsdp_kwargs()`, which needs the device

PAIRS = [
    pytest.param(strategies.DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy, FullyShardedConfig, id="fsdp"),
    pytest.param(strategies.DDPShardedStrategy, fabric.DDPShardedStrategy, ShardedDDPConfig, id="sharded"),
]


def explicit_parameters(cls: type) -> set[str]:
    """The named parameters of ``cls``'s constructor (not ``self``, not ``**kwargs``)."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in parameters if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def config_parameters(config_class: type) -> set[str]:
    """What a config is built from: its fields and ``InitVar`` (``activation_checkpointing_policy``)."""
    return set(inspect.signature(config_class).parameters) - NOT_ARGUMENTS


def documented_arguments(cls: type) -> set[str]:
    """The names of the ``Args:`` section of ``cls``'s docstring (Google style)."""
    doc = inspect.getdoc(cls) or ""
    assert "\nArgs:\n" in doc, f"{cls.__qualname__} has no `Args:` section"
    section = doc.split("\nArgs:\n", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # up to the next unindented line
    return set(re.findall(r"^    \**(\w+):", section, flags=re.MULTILINE)) - {"kwargs"}


@pytest.mark.parametrize(("trainer", "fabric_", "config_class"), PAIRS)
def test_trainer_fabric_and_config_declare_the_same_options(trainer: type, fabric_: type, config_class: type) -> None:
    options = config_parameters(config_class)
    assert explicit_parameters(trainer) == options | LIGHTNING_OWN
    assert explicit_parameters(fabric_) == options | LIGHTNING_OWN
    # Same defaults too: a script moved from the Trainer to Fabric behaves the same.
    trainer_defaults = {n: p.default for n, p in inspect.signature(trainer.__init__).parameters.items()}
    fabric_defaults = {n: p.default for n, p in inspect.signature(fabric_.__init__).parameters.items()}
    assert trainer_defaults == fabric_defaults
    # The strategies' defaults make the config's defaults (in its one form: `activation_checkpointing=None` is `()`).
    assert config_class(**{name: trainer_defaults[name] for name in options}) == config_class()


@pytest.mark.parametrize(("trainer", "fabric_", "config_class"), PAIRS)
def test_every_option_has_a_property_and_an_args_entry_on_both(
    trainer: type, fabric_: type, config_class: type
) -> None:
    fields = {f.name for f in dataclasses.fields(config_class)} - NOT_ARGUMENTS
    for cls in (trainer, fabric_):
        missing = sorted(name for name in fields if not isinstance(inspect.getattr_static(cls, name, None), property))
        assert not missing, f"{cls.__module__}.{cls.__qualname__} has no property for {missing}"
        assert documented_arguments(cls) == explicit_parameters(cls), cls.__module__


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
