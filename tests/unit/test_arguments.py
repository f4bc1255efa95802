"""Argument validation of both strategies, and the strategies' own checks, beyond tests/test_strategy_config.py and
tests/test_sharded.py (which check the constructor with the most common bad arguments)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

from lightning_fairscale import DDPFullyShardedStrategy, DDPShardedStrategy, ShardedCheckpointIO
from lightning_fairscale import fabric
from lightning_fairscale.plugins.checkpoint_io import sharded_storage
from lightning_fairscale.precision import FullyShardedHalfPrecisionPlugin, FullyShardedMixedPrecisionPlugin
from lightning_fairscale.sharded_ddp import config as sharded_config
from lightning_fairscale.fsdp import config as fsdp_config, fairscale_kwargs, run as fsdp_run
from lightning_fairscale.checkpoint.checks import (
    RELAX_FABRIC,
    RELAX_TRAINER,
    IncompatibleKeys,
    check_state_dict_fits,
    describe_partial_load,
)

FSDP_ARGUMENTS = {"min_num_params": 0, "bucket_cap_mb": 25, "compute_dtype": None, "policy": None, "kwargs": {}}


def validate_fsdp(**changes: Any) -> None:
    fsdp_config.validate_arguments(**{**FSDP_ARGUMENTS, **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"min_num_params": 1e6},
        {"bucket_cap_mb": 0},
        {"bucket_cap_mb": -1},  # <= 0 disables bucketing
        {"bucket_cap_mb": 2.5},
        *({"compute_dtype": dtype} for dtype in (torch.float32, torch.float16, torch.bfloat16)),
        {"kwargs": {"verbose": True, "no_broadcast_optim_state": True, "force_input_to_fp32": True}},
    ],
)
def test_fsdp_accepts_valid_arguments(changes: dict[str, Any]) -> None:
    validate_fsdp(**changes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"min_num_params": True}, "`min_num_params` must be a number >= 0, got True"),
        ({"min_num_params": None}, "`min_num_params` must be a number"),
        ({"bucket_cap_mb": True}, r"`bucket_cap_mb` must be a number of megabytes \(<= 0 disables bucketing\)"),
        ({"bucket_cap_mb": None}, "`bucket_cap_mb` must be"),
        ({"compute_dtype": torch.float64}, "torch.float32, torch.float16 or torch.bfloat16, got torch.float64"),
    ],
)
def test_fsdp_refuses_bad_values(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_fsdp(**changes)


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("module", "wraps the model itself"),
        ("process_group", "makes its process groups"),
        ("move_params_to_cpu", "use `cpu_offload`"),
        ("state_dict_device", "use `state_dict_to_cpu`"),
    ],
)
def test_fsdp_refuses_the_arguments_it_sets_itself_saying_what_to_use(name: str, hint: str) -> None:
    with pytest.raises(TypeError, match=f"does not take `{name}`: .*{hint}"):
        validate_fsdp(kwargs={name: None})


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("limit_all_gathers", "no all-gather rate limiter"),
        ("forward_prefetch", "the forward gathers the next units ahead"),
        ("sync_module_states", "seed every rank alike"),
    ],
)
def test_arguments_of_torchs_fsdp_say_what_to_do_instead(name: str, hint: str) -> None:
    with pytest.raises(TypeError, match=f"does not take `{name}`, an argument of torch's FSDP .*{hint}"):
        validate_fsdp(kwargs={name: None})


def test_an_unknown_fsdp_argument_lists_the_ones_that_can_be_passed() -> None:
    with pytest.raises(TypeError) as error:
        validate_fsdp(kwargs={"reshard_after_fwd": False})
    message = str(error.value)
    assert "unexpected argument `reshard_after_fwd`" in message
    listed = set(message.split("which takes: ")[1].rstrip(".").split(", "))
    assert {"reshard_after_forward", "verbose", "bucket_cap_mb"} <= listed
    assert not listed & set(fairscale_kwargs._MANAGED_FSDP_ARGUMENTS)  # those set by the strategy are not offered


def test_fsdp_validates_the_policy() -> None:
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        validate_fsdp(policy="size")
    validate_fsdp(policy={nn.Linear})


def test_strategies_take_torch_policies_and_refuse_a_callable_of_neither_signature() -> None:
    for strategy_class in (DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy):
        transformer = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
        strategy_class(auto_wrap_policy=transformer)
        strategy_class(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        with pytest.raises(TypeError, match="torch's `\\(module, recurse, nonwrapped_numel\\) -> bool`"):
            strategy_class(auto_wrap_policy=transformer_auto_wrap_policy)  # `transformer_layer_cls` not bound


STRATEGIES = [DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy]
ON_GPU = {"parallel_devices": [torch.device("cuda", 0)]}  # a device object only: no CUDA needed


@pytest.mark.parametrize("strategy_class", STRATEGIES, ids=["trainer", "fabric"])
@pytest.mark.parametrize(
    ("cpu_offload", "offloads"),
    [(CPUOffload(offload_params=False), False), (CPUOffload(offload_params=True), True), (False, False),
     (True, True), (None, False)],
    ids=["CPUOffload-False", "CPUOffload-True", "False", "True", "None"],
)
def test_cpu_offload_takes_a_bool_or_torchs_cpu_offload(strategy_class: type, cpu_offload: Any, offloads: bool) -> None:
    strategy = strategy_class(cpu_offload=cpu_offload, **ON_GPU)
    assert strategy.cpu_offload is offloads
    assert strategy.fsdp_kwargs()["cpu_offload"] is offloads  # what FairScale gets


def test_cpu_offload_refuses_other_values_and_keeps_its_check_of_move_grads_to_cpu() -> None:
    with pytest.raises(TypeError, match=r"`cpu_offload` must be True or False, or torch's .*CPUOffload.*got 'yes'"):
        DDPFullyShardedStrategy(cpu_offload="yes")
    with pytest.raises(ValueError, match="move_grads_to_cpu"):
        DDPFullyShardedStrategy(cpu_offload=CPUOffload(offload_params=True), move_grads_to_cpu=False)
    DDPFullyShardedStrategy(cpu_offload=CPUOffload(offload_params=False), move_grads_to_cpu=False)  # no offload


class Block(nn.Module):
    pass


@pytest.mark.parametrize("strategy_class", STRATEGIES, ids=["trainer", "fabric"])
@pytest.mark.parametrize(
    "policy",
    [
        {Block},
        ModuleWrapPolicy({Block}),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    ],
    ids=["set", "ModuleWrapPolicy", "transformer"],
)
def test_activation_checkpointing_policy_is_activation_checkpointing(strategy_class: type, policy: Any) -> None:
    assert strategy_class(activation_checkpointing_policy=policy).activation_checkpointing == (Block,)
    assert strategy_class(activation_checkpointing=Block).activation_checkpointing == (Block,)
    assert strategy_class().activation_checkpointing == ()


@pytest.mark.parametrize("strategy_class", STRATEGIES, ids=["trainer", "fabric"])
def test_activation_checkpointing_given_twice_says_which_to_keep(strategy_class: type) -> None:
    with pytest.raises(ValueError, match="pass one. Keep `activation_checkpointing_policy`.* remove `activation_chec"):
        strategy_class(activation_checkpointing=Block, activation_checkpointing_policy={Block})
    with pytest.raises(TypeError, match="`activation_checkpointing_policy` must name the classes"):
        strategy_class(activation_checkpointing_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1))


def test_fsdp_keeps_the_wrap_controls_as_tuples_or_none() -> None:
    strategy = DDPFullyShardedStrategy(exclude_wrap_modules={nn.ModuleList}, force_leaf_modules=[nn.LSTM, nn.GRU])
    assert strategy.exclude_wrap_modules == (nn.ModuleList,)
    assert strategy.force_leaf_modules == (nn.LSTM, nn.GRU)
    default = DDPFullyShardedStrategy()
    # None (not an empty tuple): FairScale's own defaults apply to the size policy.
    assert default.exclude_wrap_modules is None and default.force_leaf_modules is None


def check_settings(strategy: DDPFullyShardedStrategy, device: torch.device) -> None:
    """The strategy's check of its options against the device and its precision plugin (in `setup_environment`)."""
    fsdp_run.check_settings(strategy.config, device, strategy.precision_plugin.precision)


@pytest.mark.parametrize(("dtype", "flag"), [(torch.float16, "16-mixed"), (torch.bfloat16, "bf16-mixed")])
def test_compute_dtype_without_mixed_precision_names_the_flag_to_use(dtype: torch.dtype, flag: str) -> None:
    strategy = DDPFullyShardedStrategy(compute_dtype=dtype)
    strategy.precision_plugin = Precision()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=f"needs mixed precision, but the precision is '32-true'.*"
                                         f"precision='{flag}'"):
        check_settings(strategy, cpu)
    strategy.precision_plugin = FullyShardedMixedPrecisionPlugin(flag, "cpu")  # type: ignore[arg-type]
    check_settings(strategy, cpu)
    check_settings(DDPFullyShardedStrategy(compute_dtype=torch.float32), cpu)  # float32 needs nothing


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_half_precision_refuses_options_asking_for_another_dtype(precision: str, dtype: torch.dtype) -> None:
    cpu = torch.device("cpu")
    mixed = precision.replace("-true", "-mixed")
    for other in {torch.float32, torch.float16, torch.bfloat16} - {dtype}:
        strategy = DDPFullyShardedStrategy(compute_dtype=other)
        strategy.precision_plugin = FullyShardedHalfPrecisionPlugin(precision)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"compute_dtype={other}\\)` contradicts precision='{precision}', which"
                                             f" holds .* in {dtype}.*Leave `compute_dtype` unset.*'{mixed}'"):
            check_settings(strategy, cpu)
    strategy = DDPFullyShardedStrategy(fp32_reduce_scatter=True)
    strategy.precision_plugin = FullyShardedHalfPrecisionPlugin(precision)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"fp32_reduce_scatter=True\\)` needs mixed precision.*'{mixed}'"):
        check_settings(strategy, cpu)
    for agreeing in (None, dtype):  # unset, or the precision's own dtype: nothing to contradict
        strategy = DDPFullyShardedStrategy(compute_dtype=agreeing)
        strategy.precision_plugin = FullyShardedHalfPrecisionPlugin(precision)  # type: ignore[arg-type]
        check_settings(strategy, cpu)


def test_sharded_checkpoints_need_the_sharded_storage() -> None:
    strategy = DDPFullyShardedStrategy(state_dict_type="sharded")
    assert type(strategy.checkpoint_io) is ShardedCheckpointIO  # the default
    strategy.checkpoint_io = TorchCheckpointIO()
    with pytest.raises(TypeError, match="directories with .*ShardedCheckpointIO.*given TorchCheckpointIO"):
        sharded_storage(strategy.checkpoint_io)


@pytest.mark.parametrize("kwargs", [{}, {"reduce_buffer_size": 0}, {"reduce_buffer_size": 2**20},
                                    {"broadcast_buffers": False, "auto_refresh_trainable": False}])
def test_sharded_accepts_valid_arguments(kwargs: dict[str, Any]) -> None:
    sharded_config.validate_arguments("DDPShardedStrategy", False, kwargs)
    assert DDPShardedStrategy(**kwargs).sharded_ddp_kwargs() == {"reduce_buffer_size": 0, **kwargs}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reduce_buffer_size": True}, ValueError, "`reduce_buffer_size` must be a number of elements >= 0"),
        ({"reduce_buffer_size": 1.5}, ValueError, "`reduce_buffer_size` must be"),
        ({"module": None}, TypeError, "does not take `module`: the strategy wraps the model itself"),
    ],
)
def test_sharded_refuses_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        sharded_config.validate_arguments("DDPSpawnShardedStrategy", False, kwargs)


def test_sharded_errors_name_the_strategy_used() -> None:
    with pytest.raises(ValueError, match="`DDPSpawnShardedStrategy` does not support `find_unused_parameters=True`"):
        sharded_config.validate_arguments("DDPSpawnShardedStrategy", True, {})
    with pytest.raises(TypeError) as error:
        sharded_config.validate_arguments("DDPShardedStrategy", False, {"bucket_cap_mb": 25})
    listed = set(str(error.value).split("which takes: ")[1].rstrip(".").split(", "))
    assert "reduce_buffer_size" in listed and not listed & set(sharded_config._MANAGED_SDP_ARGUMENTS)


SHAPES = {"w": torch.Size([2, 3]), "b": torch.Size([2])}


def test_a_fitting_state_dict_passes() -> None:
    keys = check_state_dict_fits({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, SHAPES, strict=True)
    assert keys == IncompatibleKeys([], [])
    # Non-strict: keys may differ, and come back as torch's `load_state_dict` reports them.
    keys = check_state_dict_fits({"w": torch.zeros(2, 3), "extra": 1}, SHAPES, strict=False)
    assert (keys.missing_keys, keys.unexpected_keys) == (["b"], ["extra"])
    # Shapes stand for tensors (a sharded checkpoint's, known without reading them).
    shapes = {"w": torch.Size([2, 3]), "b": torch.Size([2])}
    assert check_state_dict_fits(shapes, SHAPES, strict=True) == IncompatibleKeys([], [])


@pytest.mark.parametrize(
    ("saved", "strict", "match"),
    [
        ({"w": torch.zeros(2, 3)}, True, r"missing keys \[b\]"),
        ({"w": torch.zeros(2, 3), "b": torch.zeros(2), "c": torch.zeros(1)}, True, r"unexpected keys \[c\]"),
        ({"w": torch.zeros(3, 2), "b": torch.zeros(2)}, False, r"different shapes for \[w: checkpoint \(3, 2\), "
                                                               r"model \(2, 3\)\]"),
    ],
)
def test_a_state_dict_of_another_model_is_described(saved: dict[str, Any], strict: bool, match: str) -> None:
    with pytest.raises(ValueError, match=f"does not fit the model: {match}.*load it into the model it was saved from"):
        check_state_dict_fits(saved, SHAPES, strict=strict, relax="RELAX")


def test_a_strict_error_lists_the_first_keys_counts_the_rest_and_says_how_to_relax() -> None:
    saved = {f"old.{i}": torch.zeros(1) for i in range(8)}
    with pytest.raises(ValueError) as error:
        check_state_dict_fits(saved, SHAPES, strict=True, relax=RELAX_TRAINER)
    message = str(error.value)
    assert "missing keys [w, b]" in message
    assert "unexpected keys [old.0, old.1, old.2, old.3, old.4 and 3 more]" in message
    assert message.endswith(f"{RELAX_TRAINER}.") and "strict_loading = False" in message
    # Shapes that differ: strict loading off would not help, so the error does not suggest it.
    with pytest.raises(ValueError, match="different shapes") as error:
        check_state_dict_fits({"w": torch.zeros(3)}, SHAPES, strict=False, relax=RELAX_FABRIC)
    assert "strict" not in str(error.value)


def test_a_partial_load_is_described_shortly() -> None:
    assert describe_partial_load(IncompatibleKeys([], [])) == ""
    message = describe_partial_load(IncompatibleKeys(["extra.weight"], [f"k{i}" for i in range(7)]))
    assert "the model's entries that the checkpoint lacks keep their values (1): [extra.weight]" in message
    assert "the checkpoint's entries that the model lacks were ignored (7): [k0, k1, k2, k3, k4 and 2 more]" in message


@pytest.mark.parametrize("strategy_class", [DDPFullyShardedStrategy, fabric.DDPFullyShardedStrategy])
def test_set_timeout(strategy_class: type) -> None:
    """Lightning's ``test_set_timeout`` of its FSDPStrategy, for ours (issue 48 item 3d): with torch's
    ``init_process_group`` mocked, ``setup_environment`` passes the timeout to it, and the strategy's own groups
    (made by ``new_group``, mocked too: Lightning's tests of strategies that make groups mock their making) get the
    timeout as well. No call asks the default group, which does not exist: the world size is the strategy's."""
    from datetime import timedelta
    from unittest import mock

    from lightning_fabric.plugins.environments import LightningEnvironment

    timeout = timedelta(seconds=30)
    strategy = strategy_class(timeout=timeout, parallel_devices=[torch.device("cpu")])
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = mock.Mock()
    with (
        mock.patch("torch.distributed.init_process_group") as init_process_group,
        mock.patch("torch.distributed.new_group") as new_group,
    ):
        strategy.setup_environment()
    environment = strategy.cluster_environment
    init_process_group.assert_called_with(
        "gloo", rank=environment.global_rank(), world_size=environment.world_size(),
        timeout=timeout, device_id=None,
    )
    assert new_group.call_count == 2 and all(call.kwargs["timeout"] == timeout for call in new_group.call_args_list)
