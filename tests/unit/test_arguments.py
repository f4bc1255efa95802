"""Argument validation of both strategies, and the strategies' own checks, beyond tests/test_strategy_config.py and
tests/test_sharded.py (which check the constructor with the most common bad arguments)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.plugins.precision import Precision
from torch import nn

from lightning_fairscale import DDPFullyShardedStrategy, DDPShardedStrategy, ShardedCheckpointIO
from lightning_fairscale.precision import FullyShardedHalfPrecisionPlugin, FullyShardedMixedPrecisionPlugin
from lightning_fairscale import oss
from lightning_fairscale.fsdp import options as fsdp_options
from lightning_fairscale.checkpoint.checks import check_state_dict_fits

FSDP_ARGUMENTS = {"min_num_params": 0, "bucket_cap_mb": 25, "compute_dtype": None, "policy": None, "kwargs": {}}


def validate_fsdp(**changes: Any) -> None:
    fsdp_options.validate_arguments(**{**FSDP_ARGUMENTS, **changes})


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


def test_an_unknown_fsdp_argument_lists_the_ones_that_can_be_passed() -> None:
    with pytest.raises(TypeError) as error:
        validate_fsdp(kwargs={"reshard_after_fwd": False})
    message = str(error.value)
    assert "unexpected argument `reshard_after_fwd`" in message
    listed = set(message.split("which takes: ")[1].rstrip(".").split(", "))
    assert {"reshard_after_forward", "verbose", "bucket_cap_mb"} <= listed
    assert not listed & set(fsdp_options._MANAGED_FSDP_ARGUMENTS)  # those set by the strategy are not offered


def test_fsdp_validates_the_policy() -> None:
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        validate_fsdp(policy="size")
    validate_fsdp(policy={nn.Linear})


def test_fsdp_keeps_the_wrap_controls_as_tuples_or_none() -> None:
    strategy = DDPFullyShardedStrategy(exclude_wrap_modules={nn.ModuleList}, force_leaf_modules=[nn.LSTM, nn.GRU])
    assert strategy.exclude_wrap_modules == (nn.ModuleList,)
    assert strategy.force_leaf_modules == (nn.LSTM, nn.GRU)
    default = DDPFullyShardedStrategy()
    # None (not an empty tuple): FairScale's own defaults apply to the size policy.
    assert default.exclude_wrap_modules is None and default.force_leaf_modules is None


@pytest.mark.parametrize(("dtype", "flag"), [(torch.float16, "16-mixed"), (torch.bfloat16, "bf16-mixed")])
def test_compute_dtype_without_mixed_precision_names_the_flag_to_use(dtype: torch.dtype, flag: str) -> None:
    strategy = DDPFullyShardedStrategy(compute_dtype=dtype)
    strategy.precision_plugin = Precision()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=f"needs mixed precision, but the precision is '32-true'.*"
                                         f"precision='{flag}'"):
        strategy._check_settings(cpu)
    strategy.precision_plugin = FullyShardedMixedPrecisionPlugin(flag, "cpu")  # type: ignore[arg-type]
    strategy._check_settings(cpu)
    DDPFullyShardedStrategy(compute_dtype=torch.float32)._check_settings(cpu)  # float32 needs nothing


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_half_precision_refuses_options_asking_for_another_dtype(precision: str, dtype: torch.dtype) -> None:
    cpu = torch.device("cpu")
    mixed = precision.replace("-true", "-mixed")
    for other in {torch.float32, torch.float16, torch.bfloat16} - {dtype}:
        strategy = DDPFullyShardedStrategy(compute_dtype=other)
        strategy.precision_plugin = FullyShardedHalfPrecisionPlugin(precision)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"compute_dtype={other}\\)` contradicts precision='{precision}', which"
                                             f" holds .* in {dtype}.*Leave `compute_dtype` unset.*'{mixed}'"):
            strategy._check_settings(cpu)
    strategy = DDPFullyShardedStrategy(fp32_reduce_scatter=True)
    strategy.precision_plugin = FullyShardedHalfPrecisionPlugin(precision)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"fp32_reduce_scatter=True\\)` needs mixed precision.*'{mixed}'"):
        strategy._check_settings(cpu)
    for agreeing in (None, dtype):  # unset, or the precision's own dtype: nothing to contradict
        strategy = DDPFullyShardedStrategy(compute_dtype=agreeing)
        strategy.precision_plugin = FullyShardedHalfPrecisionPlugin(precision)  # type: ignore[arg-type]
        strategy._check_settings(cpu)


def test_sharded_checkpoints_need_the_sharded_checkpoint_io() -> None:
    strategy = DDPFullyShardedStrategy(state_dict_type="sharded")
    assert type(strategy.checkpoint_io) is ShardedCheckpointIO  # the default
    strategy.checkpoint_io = TorchCheckpointIO()
    with pytest.raises(TypeError, match="directories with .*ShardedCheckpointIO.*given TorchCheckpointIO"):
        strategy._sharded_io()


@pytest.mark.parametrize("kwargs", [{}, {"reduce_buffer_size": 0}, {"reduce_buffer_size": 2**20},
                                    {"broadcast_buffers": False, "auto_refresh_trainable": False}])
def test_sharded_accepts_valid_arguments(kwargs: dict[str, Any]) -> None:
    oss.validate_arguments("DDPShardedStrategy", False, kwargs)
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
        oss.validate_arguments("DDPSpawnShardedStrategy", False, kwargs)


def test_sharded_errors_name_the_strategy_used() -> None:
    with pytest.raises(ValueError, match="`DDPSpawnShardedStrategy` does not support `find_unused_parameters=True`"):
        oss.validate_arguments("DDPSpawnShardedStrategy", True, {})
    with pytest.raises(TypeError) as error:
        oss.validate_arguments("DDPShardedStrategy", False, {"bucket_cap_mb": 25})
    listed = set(str(error.value).split("which takes: ")[1].rstrip(".").split(", "))
    assert "reduce_buffer_size" in listed and not listed & set(oss._MANAGED_SDP_ARGUMENTS)


SHAPES = {"w": torch.Size([2, 3]), "b": torch.Size([2])}


def test_a_fitting_state_dict_passes() -> None:
    check_state_dict_fits({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, SHAPES, strict=True)
    check_state_dict_fits({"w": torch.zeros(2, 3), "extra": 1}, SHAPES, strict=False)  # non-strict: keys may differ


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
        check_state_dict_fits(saved, SHAPES, strict=strict)
