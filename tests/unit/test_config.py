"""The engines' configurations (``FullyShardedConfig``, ``ShardedDDPConfig``) and the engine functions they drive,
without Lightning: built, checked, turned into FairScale's arguments, and wrapping a model on the one-rank group."""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

import lightning_fairscale
from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.run import check_settings, fsdp_kwargs, offloads_to_cpu
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.sharded_ddp import engine as sharded_engine
from lightning_fairscale.sharded_ddp.config import (
    ShardedDDPConfig,
    broadcast_fp16,
    reduce_buffer_size,
    sharded_ddp_kwargs,
)

from .helpers import Block, Net, unit_paths

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # a device object only: no CUDA needed
TIMEOUT = timedelta(seconds=60)


# ------------------------------------------------------------------------------------------------------------------
# FullyShardedConfig: built once, in one form, frozen


def test_the_defaults_are_the_strategys() -> None:
    config = FullyShardedConfig()
    assert (config.cpu_offload, config.flatten_parameters, config.reshard_after_forward) == (False, True, True)
    assert (config.bucket_cap_mb, config.min_num_params, config.state_dict_type) == (25, 10**8, "full")
    assert (config.sharding_strategy, config.device_mesh, config.mesh_request) == ("FULL_SHARD", None, None)
    assert (config.activation_checkpointing, config.exclude_wrap_modules, config.fairscale_kwargs) == ((), None, {})
    assert (config.lightning_1x_optimizer_state, config.backward_prefetch) == ("error", "BACKWARD_POST")


def test_values_are_kept_in_one_form() -> None:
    given = {"verbose": True}
    config = FullyShardedConfig(
        cpu_offload=CPUOffload(offload_params=True),
        min_num_params=1e3,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        activation_checkpointing_policy=ModuleWrapPolicy({Block}),
        exclude_wrap_modules={nn.ModuleList},
        force_leaf_modules=[nn.LSTM, nn.GRU],
        fairscale_kwargs=given,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )
    assert config.backward_prefetch == "BACKWARD_PRE"
    assert FullyShardedConfig(backward_prefetch=None).backward_prefetch is None
    assert config.cpu_offload is True and config.min_num_params == 1000 and type(config.min_num_params) is int
    # ZeRO-2: the user's `reshard_after_forward` kept as given (FSDP gets False, see `fsdp_kwargs`).
    assert (config.sharding_strategy, config.reshard_after_forward) == ("SHARD_GRAD_OP", True)
    assert config.activation_checkpointing == (Block,)
    assert (config.exclude_wrap_modules, config.force_leaf_modules) == ((nn.ModuleList,), (nn.LSTM, nn.GRU))
    given["verbose"] = False  # the config keeps its own copy
    assert config.fairscale_kwargs == {"verbose": True}


def test_a_device_mesh_is_kept_as_its_shape() -> None:
    class Mesh:  # what the config reads of torch's 2-D DeviceMesh
        shape = (2, 4)

    config = FullyShardedConfig(sharding_strategy="hybrid_shard", device_mesh=Mesh())
    assert (config.sharding_strategy, config.device_mesh, config.mesh_request) == ("HYBRID_SHARD", (2, 4), (2, 4))
    assert FullyShardedConfig(sharding_strategy="HYBRID_SHARD").mesh_request == "node"


def test_the_config_is_frozen_and_a_changed_copy_is_checked_again() -> None:
    config = FullyShardedConfig(activation_checkpointing=Block, cpu_offload=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.state_dict_type = "sharded"  # type: ignore[misc]
    assert dataclasses.replace(config) == config  # its own values pass the checks again, unchanged
    assert dataclasses.replace(config, state_dict_type="sharded").state_dict_type == "sharded"
    with pytest.raises(ValueError, match='`state_dict_type` must be "full" .* got \'local\''):
        dataclasses.replace(config, state_dict_type="local")
    with pytest.raises(ValueError, match="leave `move_grads_to_cpu` unset"):
        dataclasses.replace(config, move_grads_to_cpu=False)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"min_num_params": -1}, ValueError, "`min_num_params` must be a number >= 0, got -1."),
        ({"bucket_cap_mb": "25"}, ValueError,
         "`bucket_cap_mb` must be a number of megabytes (<= 0 disables bucketing), got '25'."),
        ({"compute_dtype": torch.int8}, ValueError,
         "`compute_dtype` must be torch.float32, torch.float16 or torch.bfloat16, got torch.int8."),
        ({"state_dict_type": "local"}, ValueError,
         '`state_dict_type` must be "full" (one file, loadable anywhere) or "sharded" (one file per rank), got'
         " 'local'."),
        ({"cpu_offload": "yes"}, TypeError,
         "`cpu_offload` must be True or False, or torch's `torch.distributed.fsdp.CPUOffload(offload_params=...)`,"
         " got 'yes'."),
        ({"fairscale_kwargs": {"mixed_precision": True}}, TypeError,
         "`DDPFullyShardedStrategy` does not take `mixed_precision`: the `precision` flag of the Trainer or Fabric"
         " sets it."),
        ({"fairscale_kwargs": {"limit_all_gathers": True}}, TypeError,
         "`DDPFullyShardedStrategy` does not take `limit_all_gathers`, an argument of torch's FSDP (Lightning's"
         " FSDPStrategy): FairScale has no all-gather rate limiter (on CPU our forward gathers ahead what fits in"
         " `bucket_cap_mb`, and at least the next unit): remove it."),
        ({"backward_prefetch": "AFTER"}, ValueError, "`backward_prefetch` must be torch's BackwardPrefetch"),
        ({"sharding_strategy": "NO_SHARD"}, ValueError, 'that is plain data parallel, use `strategy="ddp"`'),
        ({"device_mesh": (2, 2)}, ValueError, 'pass `sharding_strategy="HYBRID_SHARD"` with it'),
        ({"activation_checkpointing": Block, "activation_checkpointing_policy": {Block}}, ValueError,
         "pass one. Keep `activation_checkpointing_policy`"),
        ({"exclude_wrap_modules": "ModuleList"}, TypeError, "exclude_wrap_modules"),
        ({"lightning_1x_optimizer_state": "keep", "owner": "MyStrategy"}, ValueError, "MyStrategy"),
        ({"fairscale_kwargs": {"use_orig_params": False}}, ValueError,
         "always keeps the original parameters (torch FSDP's `use_orig_params=True`)"),
    ],
)
def test_bad_arguments_fail_when_the_config_is_built(arguments: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as raised:
        FullyShardedConfig(**arguments)
    assert message in str(raised.value)


def test_an_unknown_fairscale_argument_lists_those_that_can_be_passed() -> None:
    with pytest.raises(TypeError, match="unexpected argument `reshard_after_fwd`.*which takes: .*verbose"):
        FullyShardedConfig(fairscale_kwargs={"reshard_after_fwd": False})


# ------------------------------------------------------------------------------------------------------------------
# What FairScale gets


@pytest.mark.parametrize(
    ("precision", "options", "expected"),
    [
        ("32-true", {}, {"mixed_precision": False, "fp32_reduce_scatter": False}),
        ("32-true", {"fp32_reduce_scatter": True}, {"fp32_reduce_scatter": False}),  # only meaningful when mixed
        ("bf16-mixed", {}, {"mixed_precision": True, "compute_dtype": torch.bfloat16}),
        ("16-mixed", {"fp32_reduce_scatter": True}, {"mixed_precision": True, "fp32_reduce_scatter": True,
                                                    "compute_dtype": torch.float16}),
        ("bf16-mixed", {"compute_dtype": torch.float32}, {"compute_dtype": torch.float32}),  # the option wins
        ("bf16-true", {}, {"mixed_precision": False, "compute_dtype": torch.bfloat16}),  # units hold bf16
        ("16-true", {}, {"mixed_precision": False, "compute_dtype": torch.float16}),
    ],
)
def test_fsdp_kwargs_follow_the_precision(precision: str, options: dict[str, Any], expected: dict[str, Any]) -> None:
    kwargs = fsdp_kwargs(FullyShardedConfig(**options), CPU, ProcessGroups(), precision)
    assert {k: kwargs[k] for k in expected} == expected
    if precision == "32-true" and "compute_dtype" not in options:
        assert "compute_dtype" not in kwargs  # FairScale's default: the parameters' dtype


@pytest.mark.workaround(10)
def test_fsdp_kwargs_follow_the_device() -> None:
    config = FullyShardedConfig(cpu_offload=True, state_dict_to_cpu=False)
    on_gpu, on_cpu = (fsdp_kwargs(config, device, ProcessGroups(), "32-true") for device in (GPU, CPU))
    assert (on_gpu["compute_device"], on_gpu["cpu_offload"], on_gpu["move_grads_to_cpu"]) == (GPU, True, None)
    assert (on_cpu["compute_device"], on_cpu["cpu_offload"], on_cpu["move_grads_to_cpu"]) == (CPU, False, False)
    assert (on_gpu["state_dict_device"], on_cpu["state_dict_device"]) == (GPU, CPU)  # state_dict_to_cpu=False
    assert offloads_to_cpu(config, GPU) and not offloads_to_cpu(config, CPU)
    assert fsdp_kwargs(FullyShardedConfig(), GPU, ProcessGroups(), "32-true")["state_dict_device"] == CPU


def test_fsdp_kwargs_carry_the_groups_the_init_function_and_fairscales_own_arguments() -> None:
    groups = ProcessGroups("all-gather", "reduce-scatter", "replicas", (2, 1))

    def init_fn(module: nn.Module) -> None:
        nn.init.zeros_(module.weight)

    config = FullyShardedConfig(param_init_fn=init_fn, fairscale_kwargs={"verbose": True, "bucket_cap_mb": 1})
    kwargs = fsdp_kwargs(config, CPU, groups, "32-true")
    assert (kwargs["process_group"], kwargs["process_group_reduce_scatter"]) == ("all-gather", "reduce-scatter")
    assert (kwargs["replica_group"], kwargs["param_init_fn"], kwargs["verbose"]) == ("replicas", init_fn, True)
    assert kwargs["bucket_cap_mb"] == 1  # FairScale's own argument, given as such, wins over the option
    plain = fsdp_kwargs(FullyShardedConfig(), CPU, ProcessGroups(), "32-true")
    assert plain["process_group"] is None and not {"process_group_reduce_scatter", "replica_group"} & set(plain)
    # The prefetch modes of our FSDP class (workaround 16), from torch's names.
    modes = [fsdp_kwargs(FullyShardedConfig(backward_prefetch=name), CPU, ProcessGroups(), "32-true")
             ["backward_prefetch"] for name in ("BACKWARD_POST", "backward_pre", None)]
    assert modes == ["BACKWARD_POST", "BACKWARD_PRE", None]


@pytest.mark.parametrize(
    ("options", "precision", "match"),
    [
        ({"compute_dtype": torch.bfloat16}, "32-true",
         "needs mixed precision, but the precision is '32-true'. Pass `precision='bf16-mixed'`"),
        ({"compute_dtype": torch.float16}, "bf16-true", "contradicts precision='bf16-true'.* precision='bf16-mixed'"),
        ({"fp32_reduce_scatter": True}, "16-true", r"fp32_reduce_scatter=True\)` needs mixed precision.*'16-mixed'"),
    ],
)
def test_options_that_contradict_the_precision_fail_before_training(
    options: dict[str, Any], precision: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_settings(FullyShardedConfig(**options), CPU, precision)


def test_a_backward_prefetch_other_than_the_default_warns_on_cuda() -> None:
    with pytest.warns(UserWarning, match=r"backward_prefetch=BACKWARD_PRE\)` has no effect on CUDA"):
        check_settings(FullyShardedConfig(backward_prefetch="BACKWARD_PRE"), torch.device("cuda", 0), "32-true")


@pytest.mark.workaround(10)
def test_options_that_do_nothing_on_the_cpu_warn() -> None:
    with pytest.warns(UserWarning, match=r"`DDPFullyShardedStrategy\(cpu_offload=True\)` has no effect .* CPU"):
        check_settings(FullyShardedConfig(cpu_offload=True), CPU, "32-true")
    check_settings(FullyShardedConfig(compute_dtype=torch.bfloat16), CPU, "bf16-mixed")  # agrees: no error


# ------------------------------------------------------------------------------------------------------------------
# The engine, driven by a config alone (the one-rank gloo group)


def test_wrap_model_makes_the_units_the_config_asks_for(process_group: dist.ProcessGroup) -> None:
    config = FullyShardedConfig(auto_wrap_policy={Block}, activation_checkpointing=Block, bucket_cap_mb=1)
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=TIMEOUT)
    assert groups.all_gather is not None and groups.replica is None
    model, reference = Net(), Net()
    described: list[str] = []
    wrapped = fsdp_engine.wrap_model(config, model, CPU, groups, "32-true", described.append)
    assert isinstance(wrapped.root, FullyShardedDataParallel)
    assert unit_paths(wrapped.root) == ["", "blocks.0", "blocks.1"]
    assert all(unit.process_group is groups.all_gather for unit in wrapped.root.modules()
               if isinstance(unit, FullyShardedDataParallel))
    # Checkpointed in place: FairScale's `checkpoint_wrapper` gives each block its own `forward`.
    assert len(wrapped.checkpointed) == 2
    assert all(isinstance(m, Block) and "forward" in m.__dict__ for m in wrapped.checkpointed)
    assert described and described[0].startswith("DDPFullyShardedStrategy: ")
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapped.root(x), reference(x), rtol=0, atol=1e-6)


def test_use_orig_params_true_is_what_the_strategy_does() -> None:
    assert FullyShardedConfig(fairscale_kwargs={"use_orig_params": True}).fairscale_kwargs == {}


#: Lightning's FSDPStrategy's warnings (``pytorch_lightning/strategies/fsdp.py``,
#: ``lightning_fabric/strategies/fsdp.py``): ours start with the same words (issue 48 item 3b), so that a filter
#: written for Lightning's (``warnings``' ``message`` matches from the start) matches ours too; Lightning's own
#: tests match a part of them.
LIGHTNING_WRAPPED = "A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The policy will be ignored."
LIGHTNING_CHECKPOINTED = (
    "FSDP checkpointing is configured, but the model already contains checkpointed layers. Checkpointing will be"
    " ignored."
)


def _in_lightnings_words(record: Any, lightning: str) -> None:
    """One warning of ``record`` starts with Lightning's text, and a filter written for Lightning's silences it."""
    messages = [str(w.message) for w in record]
    assert any(m.startswith(lightning) for m in messages), messages
    with warnings.catch_warnings():
        warnings.filterwarnings("error")
        warnings.filterwarnings("ignore", message=re.escape(lightning))
        for message in messages:
            if message.startswith(lightning):
                warnings.warn(message, UserWarning, stacklevel=1)  # raises unless the filter matches


def test_a_policy_for_a_model_that_holds_units_already_warns(process_group: dist.ProcessGroup) -> None:
    """As Lightning's FSDPStrategy: the policy is ignored, and says so in Lightning's words."""
    config = FullyShardedConfig(auto_wrap_policy={Block})
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=TIMEOUT)
    model = Net()
    with fsdp_engine.wrapping_context(config, CPU, groups, "32-true"):
        model.blocks[0] = FullyShardedDataParallel(model.blocks[0], **fsdp_kwargs(config, CPU, groups, "32-true"))
    with pytest.warns(UserWarning, match="the model is already wrapped") as record:  # Lightning's test's match
        wrapped = fsdp_engine.wrap_model(config, model, CPU, groups, "32-true")
    _in_lightnings_words(record, LIGHTNING_WRAPPED)
    assert unit_paths(wrapped.root) == ["", "blocks.0"]


def test_a_model_checkpointed_already_is_not_checkpointed_again(process_group: dist.ProcessGroup) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    config = FullyShardedConfig(auto_wrap_policy={Block}, activation_checkpointing=Block)
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=TIMEOUT)
    model, reference = Net(), Net()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    # Lightning's test's match
    with pytest.warns(UserWarning, match="is configured, but the model already contains checkpointed layers") as record:
        wrapped = fsdp_engine.wrap_model(config, model, CPU, groups, "32-true")
    _in_lightnings_words(record, LIGHTNING_CHECKPOINTED)
    assert wrapped.checkpointed == []  # none of ours: torch's wrappers only, once
    assert not any("forward" in m.__dict__ for m in wrapped.root.modules() if isinstance(m, Block))
    assert sum(isinstance(m, CheckpointWrapper) for m in wrapped.root.modules()) == 2
    x = torch.randn(4, 3, requires_grad=True)
    torch.testing.assert_close(wrapped.root(x), reference(x), rtol=0, atol=1e-6)


def test_hybrid_groups_come_back_with_their_mesh(process_group: dist.ProcessGroup) -> None:
    config = FullyShardedConfig(sharding_strategy="HYBRID_SHARD", min_num_params=0)
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=TIMEOUT)
    assert groups.mesh == (1, 1) and groups.replica is not None
    wrapped = fsdp_engine.wrap_model(config, Net(), CPU, groups, "32-true")
    assert wrapped.root.replica_group is groups.replica


def test_sharded_ddp_wraps_with_the_configs_arguments(process_group: dist.ProcessGroup) -> None:
    config = ShardedDDPConfig(fairscale_kwargs={"broadcast_buffers": False, "auto_refresh_trainable": False})
    model = nn.Linear(3, 2)
    optimizer = sharded_engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(optimizer, OSS)
    wrapped, _ = sharded_engine.wrap_model(config, model, [optimizer], num_nodes=1)
    assert isinstance(wrapped, ShardedDataParallel) and wrapped.module is model
    assert (wrapped._enable_broadcast_buffers, wrapped._auto_refresh_trainable) == (False, False)


# ------------------------------------------------------------------------------------------------------------------
# ShardedDDPConfig


def test_sharded_ddp_config_and_what_follows_from_it() -> None:
    assert ShardedDDPConfig() == ShardedDDPConfig(False, "error", False, {}, "DDPShardedStrategy")
    assert [reduce_buffer_size(ShardedDDPConfig(), nodes) for nodes in (1, 2)] == [0, 2**23]  # Lightning 1.x's
    explicit = ShardedDDPConfig(fairscale_kwargs={"reduce_buffer_size": 0, "broadcast_buffers": False})
    assert sharded_ddp_kwargs(explicit, num_nodes=2) == {"reduce_buffer_size": 0, "broadcast_buffers": False}
    assert [broadcast_fp16(p, n) for p, n in [("16-mixed", 2), ("16-mixed", 1), ("bf16-mixed", 2)]] == [
        True, False, False
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        explicit.find_unused_parameters = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"find_unused_parameters": True, "owner": "DDPSpawnShardedStrategy"}, ValueError,
         "`DDPSpawnShardedStrategy` does not support `find_unused_parameters=True`"),
        ({"fairscale_kwargs": {"reduce_buffer_size": 1.5}}, ValueError,
         "`reduce_buffer_size` must be a number of elements >= 0 (0: no buckets), got 1.5."),
        ({"fairscale_kwargs": {"sharded_optimizer": None}}, TypeError,
         "`DDPShardedStrategy` does not take `sharded_optimizer`: the strategy shards the optimizers of"
         " `configure_optimizers` (or of `fabric.setup`)."),
        ({"fairscale_kwargs": {"bucket_cap_mb": 25}}, TypeError,
         "`DDPShardedStrategy` got an unexpected argument `bucket_cap_mb`. Extra keyword arguments go to FairScale's"
         " ShardedDataParallel, which takes: auto_refresh_trainable, broadcast_buffers,"),
        ({"lightning_1x_optimizer_state": "keep"}, ValueError, "DDPShardedStrategy"),
    ],
)
def test_sharded_ddp_config_refuses_bad_arguments(arguments: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as raised:
        ShardedDDPConfig(**arguments)
    assert message in str(raised.value)


# ------------------------------------------------------------------------------------------------------------------
# Without Lightning


def test_the_configs_build_where_lightning_cannot_be_imported() -> None:
    """Both configurations are built, and FairScale's arguments made, in a process where no Lightning package can be
    imported (the package's ``__init__``, which registers the strategies with Lightning, bypassed)."""
    script = (
        "import sys, types, torch\n"
        "for name in ('pytorch_lightning', 'lightning_fabric', 'lightning'): sys.modules[name] = None\n"
        "package = types.ModuleType('lightning_fairscale'); package.__path__ = [sys.argv[1]]\n"
        "sys.modules['lightning_fairscale'] = package\n"
        "from lightning_fairscale.fsdp.config import FullyShardedConfig\n"
        "from lightning_fairscale.fsdp.run import fsdp_kwargs\n"
        "from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups\n"
        "from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig, sharded_ddp_kwargs\n"
        "config = FullyShardedConfig(min_num_params=10, fairscale_kwargs={'verbose': True})\n"
        "kwargs = fsdp_kwargs(config, torch.device('cpu'), ProcessGroups(), 'bf16-mixed')\n"
        "assert kwargs['compute_dtype'] is torch.bfloat16 and kwargs['verbose']\n"
        "assert sharded_ddp_kwargs(ShardedDDPConfig(), 1) == {'reduce_buffer_size': 0}\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning_fabric')\n"
        "            and sys.modules[m] is not None]\n"
    )
    source = str(Path(lightning_fairscale.__file__).parent)
    proc = subprocess.run([sys.executable, "-c", script, source], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_transformer_policy_for_checkpointing_names_its_classes() -> None:
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert FullyShardedConfig(activation_checkpointing_policy=policy).activation_checkpointing == (Block,)
