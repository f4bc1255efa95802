"""The same scenarios on GPUs with NCCL. Skipped where CUDA is not available (CI has no GPU)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from scenarios.common import max_difference, reference_training

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_auto_wrap_on_gpus_equals_unsharded_training(train: Callable[..., dict[str, Any]]) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train("--accelerator", "gpu", "--devices", str(devices), "--steps", "3", "--samples", str(8 * devices))
    assert result["units"], "no FSDP unit was created"
    expected = reference_training(3, "adam", num_samples=8 * devices)
    assert max_difference(result["state_dict"], expected) < 1e-4  # TF32 and reduction order on the GPU


def test_clip_by_norm_on_gpus(train: Callable[..., dict[str, Any]]) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(
        "--accelerator", "gpu", "--devices", str(devices), "--optimizer", "sgd", "--steps", "3",
        "--clip-val", "0.05", "--samples", str(8 * devices),
    )
    expected = reference_training(3, "sgd", clip=(0.05, "norm"), num_samples=8 * devices)
    assert max_difference(result["state_dict"], expected) < 1e-4


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_on_gpus(train: Callable[..., dict[str, Any]], precision: str) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(
        "--accelerator", "gpu", "--devices", str(devices), "--precision", precision, "--steps", "6",
        "--samples", str(8 * devices), "--clip-val", "0.05", "--optimizer", "sgd",
    )
    dtype = "torch.float16" if precision == "16-mixed" else "torch.bfloat16"
    assert result["compute"] == [(dtype, dtype)]
    assert result["losses"][-1] < result["losses"][0]
    expected = reference_training(6, "sgd", clip=(0.05, "norm"), num_samples=8 * devices)
    assert max_difference(result["state_dict"], expected) < 1e-3


def test_cpu_offload_on_gpus(train: Callable[..., dict[str, Any]]) -> None:
    devices = min(2, torch.cuda.device_count())
    result = train(
        "--accelerator", "gpu", "--devices", str(devices), "--precision", "16-mixed", "--cpu-offload",
        "--steps", "3", "--samples", str(8 * devices),
    )
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
