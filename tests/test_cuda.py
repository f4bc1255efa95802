"""The same scenarios on GPUs with NCCL. Skipped where CUDA is not available (CI has no GPU)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from scenarios.common import BLOCK_UNITS_ORDER, materialized_start, max_difference, reference_training
from scenarios.config import Scenario

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def on_gpus(devices: int, **fields: Any) -> Scenario:
    """The scenario ``fields`` on ``devices`` GPUs."""
    return Scenario(accelerator="gpu", devices=devices, **fields)


def test_auto_wrap_on_gpus_equals_unsharded_training(train: Callable[..., dict[str, Any]]) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(on_gpus(devices, steps=3, samples=8 * devices))
    assert result["units"], "no FSDP unit was created"
    expected = reference_training(3, "adam", num_samples=8 * devices)
    assert max_difference(result["state_dict"], expected) < 1e-4  # TF32 and reduction order on the GPU


def test_clip_by_norm_on_gpus(train: Callable[..., dict[str, Any]]) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(on_gpus(devices, optimizer="sgd", steps=3, clip=(0.05, "norm"), samples=8 * devices))
    expected = reference_training(3, "sgd", clip=(0.05, "norm"), num_samples=8 * devices)
    assert max_difference(result["state_dict"], expected) < 1e-4


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_on_gpus(train: Callable[..., dict[str, Any]], precision: str) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(
        on_gpus(devices, precision=precision, steps=6, samples=8 * devices, clip=(0.05, "norm"), optimizer="sgd")
    )
    dtype = "torch.float16" if precision == "16-mixed" else "torch.bfloat16"
    assert result["compute"] == [(dtype, dtype)]
    assert result["losses"][-1] < result["losses"][0]
    expected = reference_training(6, "sgd", clip=(0.05, "norm"), num_samples=8 * devices)
    assert max_difference(result["state_dict"], expected) < 1e-3


@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "cpu-offload"])
def test_true_bf16_on_gpus(train: Callable[..., dict[str, Any]], offload: bool) -> None:
    """bf16-true with NCCL: parameters, gradients and momentum in bf16, also with the shards in CPU memory."""
    devices = min(2, torch.cuda.device_count())
    result = train(
        on_gpus(devices, precision="bf16-true", optimizer="sgd", steps=6, samples=8 * devices, cpu_offload=offload)
    )
    bf16 = {"torch.bfloat16"}
    assert result["compute"] == [("torch.bfloat16", "torch.bfloat16")]
    assert result["dtypes"]["parameters"] == result["dtypes"]["gradients"] == bf16
    assert result["dtypes"]["optimizer_state"] == {("momentum_buffer", "torch.bfloat16")}
    assert {str(v.dtype) for v in result["state_dict"].values()} == bf16
    assert result["losses"][-1] < result["losses"][0] / 2, result["losses"]


def test_cpu_offload_on_gpus(train: Callable[..., dict[str, Any]]) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(on_gpus(devices, precision="16-mixed", cpu_offload=True, steps=3, samples=8 * devices))
    assert result["losses"][-1] < result["losses"][0]


def test_sharded_ddp_on_gpus(tmp_path: Any) -> None:
    """DDPShardedStrategy with NCCL: 32-bit, clipping by norm, fp16 with FairScale's ShardedGradScaler, bf16."""
    from conftest import TESTS, run_script
    from test_sharded import reference

    devices = min(2, torch.cuda.device_count())
    out = tmp_path / "results.pt"
    cases = "sgd,clip-norm,fp16,bf16"
    args = ["--out", str(out), "--cases", cases, "--devices", str(devices), "--accelerator", "gpu"]
    run_script([str(TESTS / "scenarios" / "sharded_train.py"), *args, "--workdir", str(tmp_path)], cwd=tmp_path)
    results = torch.load(out, weights_only=False)
    if devices == 2:
        assert max_difference(results["sgd"]["state_dict"], reference("sgd")) < 1e-4
        assert max_difference(results["clip-norm"]["state_dict"], reference("clip-norm")) < 1e-4
    for name in ("fp16", "bf16"):
        assert results[name]["global_step"] == 3


def test_cpu_offload_clips_by_norm_with_layers_made_in_configure_model(train: Callable[..., dict[str, Any]]) -> None:
    """With ``cpu_offload``: the layers ``configure_model`` creates stay in CPU memory (FairScale asserts it; created
    on the GPU they would also have other random weights than the reference), the norm of the CPU gradients is
    all-reduced over NCCL, and teardown gathers the CPU optimizer state (momentum) over NCCL."""
    devices = min(2, torch.cuda.device_count())
    result = train(
        on_gpus(devices, model="lazy", cpu_offload=True, optimizer="sgd", steps=3, clip=(0.05, "norm"),
                samples=8 * devices)
    )  # fmt: skip
    expected = reference_training(3, "sgd", clip=(0.05, "norm"), num_samples=8 * devices)
    assert max_difference(result["state_dict"], expected) < 1e-4
    assert max_difference(expected, reference_training(3, "sgd", num_samples=8 * devices)) > 1e-2  # clipping bit


def test_cpu_offload_takes_a_model_the_user_put_on_the_gpu(train: Callable[..., dict[str, Any]]) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(on_gpus(devices, cpu_offload=True, model_on_gpu=True, steps=2, samples=8 * devices))
    assert max_difference(result["state_dict"], reference_training(2, "adam", num_samples=8 * devices)) < 1e-4


@pytest.mark.parametrize("offload", [True, False], ids=["cpu_offload", "on-gpu"])
def test_model_built_on_meta_is_initialised_where_its_shards_live(
    train: Callable[..., dict[str, Any]], offload: bool
) -> None:
    """``trainer.init_module(empty_init=True)``: each unit is materialised and initialised on the GPU (in CPU memory
    with ``cpu_offload``), from rank 0's random state of that device, just before it is sharded."""
    devices = min(2, torch.cuda.device_count())
    result = train(
        on_gpus(devices, init="empty", policy="blocks", steps=3, samples=8 * devices, cpu_offload=offload)
    )
    start = materialized_start(BLOCK_UNITS_ORDER, device="cpu" if offload else "cuda")
    expected = reference_training(3, "adam", num_samples=8 * devices, start=start)
    assert max_difference(result["state_dict"], expected) < 1e-4


@pytest.mark.parametrize("offload", [True, False], ids=["cpu_offload", "on-gpu"])
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_checkpoints_resume_exactly_on_gpus(
    train: Callable[..., dict[str, Any]], tmp_path: Any, state_dict_type: str, offload: bool
) -> None:
    """Save (a ModelCheckpoint every epoch, one step each) and resume; full saving gathers the optimizer state over
    NCCL, from CPU memory with ``cpu_offload``."""
    devices = min(2, torch.cuda.device_count())
    common = on_gpus(
        devices, steps=4, samples=8, scheduler=True, state_dict_type=state_dict_type, cpu_offload=offload
    )
    straight = train(common.replace(checkpoint_dir=str(tmp_path / "ck")))
    assert max_difference(straight["state_dict"], reference_training(4, "adam", scheduler=True, num_samples=8)) < 1e-4
    checkpoint = tmp_path / "ck" / "epoch=1-step=2.ckpt"
    assert checkpoint.is_dir() if state_dict_type == "sharded" else checkpoint.is_file()
    resumed = train(common.replace(ckpt_path=str(checkpoint)))
    assert resumed["global_step"] == 4
    assert max_difference(resumed["state_dict"], straight["state_dict"]) < 1e-6
