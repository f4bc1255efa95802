"""The same scenarios on GPUs with NCCL. Skipped where CUDA is not available (CI has no GPU).

Every training of this module runs in one launch of ``scenarios/train.py`` (``conftest.run_jobs``, a job each),
sharded DDP's in one of ``scenarios/sharded_train.py``: a launch on a GPU machine costs ~25 s (importing, CUDA and
NCCL set-up), a job seconds. With one GPU the launch is one process, and a job that fails lets the others run (its
test reports its error; an error that breaks the process's CUDA context, such as a device-side assert, fails the
jobs after it too, each with its own traceback); with two, an error ends the launch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Jobs, run_jobs
from scenarios.common import BLOCK_UNITS_ORDER, materialized_start, max_difference, reference_training
from scenarios.config import Scenario

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def devices() -> int:
    """The GPUs the scenarios train on: two where there are, else one."""
    return min(2, torch.cuda.device_count())


def on_gpus(**fields: Any) -> Scenario:
    """The scenario ``fields`` on :func:`devices` GPUs, ``8 x devices`` samples unless given."""
    return Scenario(accelerator="gpu", devices=devices(), **{"samples": 8 * devices(), **fields})


def resume_jobs(folder: Path) -> dict[str, Scenario]:
    """For each way of saving, with and without ``cpu_offload``: the straight run (a ModelCheckpoint every epoch,
    one step each), then the run resumed from its checkpoint of step 2 (the same launch, after it)."""
    jobs = {}
    for state_dict_type in ("full", "sharded"):
        for offload, where in ((True, "cpu_offload"), (False, "on-gpu")):
            name = f"resume-{state_dict_type}-{where}"
            common = on_gpus(steps=4, samples=8, scheduler=True, state_dict_type=state_dict_type, cpu_offload=offload)
            jobs[f"{name}-straight"] = common.replace(checkpoint_dir=str(folder / name))
            jobs[f"{name}-resumed"] = common.replace(ckpt_path=str(folder / name / "epoch=1-step=2.ckpt"))
    return jobs


def gpu_jobs(folder: Path) -> dict[str, Scenario]:
    """Every training of the tests below, by name."""
    sgd_clip = {"optimizer": "sgd", "clip": (0.05, "norm")}
    return {
        "auto-wrap": on_gpus(steps=3),
        "clip-norm": on_gpus(steps=3, **sgd_clip),
        **{f"mixed-{p}": on_gpus(precision=p, steps=6, **sgd_clip) for p in ("16-mixed", "bf16-mixed")},
        **{
            f"true-bf16-{where}": on_gpus(precision="bf16-true", optimizer="sgd", steps=6, cpu_offload=offload)
            for offload, where in ((False, "on-gpu"), (True, "cpu_offload"))
        },
        "cpu-offload": on_gpus(precision="16-mixed", cpu_offload=True, steps=3),
        "lazy-offload-clip": on_gpus(model="lazy", cpu_offload=True, steps=3, **sgd_clip),
        "offload-model-on-gpu": on_gpus(cpu_offload=True, model_on_gpu=True, steps=2),
        **{
            f"meta-{where}": on_gpus(init="empty", policy="blocks", steps=3, cpu_offload=offload)
            for offload, where in ((True, "cpu_offload"), (False, "on-gpu"))
        },
        **resume_jobs(folder / "checkpoints"),
    }


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    folder = tmp_path_factory.mktemp("cuda")
    trainings = gpu_jobs(folder)
    return run_jobs(folder, trainings, may_fail=list(trainings) if devices() == 1 else (), timeout=600)


def test_auto_wrap_on_gpus_equals_unsharded_training(jobs: Jobs) -> None:
    result = jobs["auto-wrap"]
    assert result["units"], "no FSDP unit was created"
    expected = reference_training(3, "adam", num_samples=8 * devices())
    assert max_difference(result["state_dict"], expected) < 1e-4  # TF32 and reduction order on the GPU


def test_clip_by_norm_on_gpus(jobs: Jobs) -> None:
    expected = reference_training(3, "sgd", clip=(0.05, "norm"), num_samples=8 * devices())
    assert max_difference(jobs["clip-norm"]["state_dict"], expected) < 1e-4


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_on_gpus(jobs: Jobs, precision: str) -> None:
    result = jobs[f"mixed-{precision}"]
    dtype = "torch.float16" if precision == "16-mixed" else "torch.bfloat16"
    assert result["compute"] == [(dtype, dtype)]
    assert result["losses"][-1] < result["losses"][0]
    expected = reference_training(6, "sgd", clip=(0.05, "norm"), num_samples=8 * devices())
    assert max_difference(result["state_dict"], expected) < 1e-3


@pytest.mark.parametrize("where", ["on-gpu", "cpu_offload"])
def test_true_bf16_on_gpus(jobs: Jobs, where: str) -> None:
    """bf16-true with NCCL: parameters, gradients and momentum in bf16, also with the shards in CPU memory."""
    result = jobs[f"true-bf16-{where}"]
    bf16 = {"torch.bfloat16"}
    assert result["compute"] == [("torch.bfloat16", "torch.bfloat16")]
    assert result["dtypes"]["parameters"] == result["dtypes"]["gradients"] == bf16
    assert result["dtypes"]["optimizer_state"] == {("momentum_buffer", "torch.bfloat16")}
    assert {str(v.dtype) for v in result["state_dict"].values()} == bf16
    assert result["losses"][-1] < result["losses"][0] / 2, result["losses"]


def test_cpu_offload_on_gpus(jobs: Jobs) -> None:
    result = jobs["cpu-offload"]
    assert result["losses"][-1] < result["losses"][0]


def test_sharded_ddp_on_gpus(tmp_path: Path) -> None:
    """DDPShardedStrategy with NCCL: 32-bit, clipping by norm, fp16 with FairScale's ShardedGradScaler, bf16."""
    from conftest import TESTS, run_script
    from test_sharded import reference

    out = tmp_path / "results.pt"
    cases = "sgd,clip-norm,fp16,bf16"
    args = ["--out", str(out), "--cases", cases, "--devices", str(devices()), "--accelerator", "gpu"]
    run_script([str(TESTS / "scenarios" / "sharded_train.py"), *args, "--workdir", str(tmp_path)], cwd=tmp_path)
    results = torch.load(out, weights_only=False)
    if devices() == 2:
        assert max_difference(results["sgd"]["state_dict"], reference("sgd")) < 1e-4
        assert max_difference(results["clip-norm"]["state_dict"], reference("clip-norm")) < 1e-4
    for name in ("fp16", "bf16"):
        assert results[name]["global_step"] == 3


def test_cpu_offload_clips_by_norm_with_layers_made_in_configure_model(jobs: Jobs) -> None:
    """With ``cpu_offload``: the layers ``configure_model`` creates stay in CPU memory (FairScale asserts it; created
    on the GPU they would also have other random weights than the reference), the norm of the CPU gradients is
    all-reduced over NCCL, and teardown gathers the CPU optimizer state (momentum) over NCCL."""
    expected = reference_training(3, "sgd", clip=(0.05, "norm"), num_samples=8 * devices())
    assert max_difference(jobs["lazy-offload-clip"]["state_dict"], expected) < 1e-4
    assert max_difference(expected, reference_training(3, "sgd", num_samples=8 * devices())) > 1e-2  # clipping bit


def test_cpu_offload_takes_a_model_the_user_put_on_the_gpu(jobs: Jobs) -> None:
    expected = reference_training(2, "adam", num_samples=8 * devices())
    assert max_difference(jobs["offload-model-on-gpu"]["state_dict"], expected) < 1e-4


@pytest.mark.parametrize("where", ["cpu_offload", "on-gpu"])
def test_model_built_on_meta_is_initialised_where_its_shards_live(jobs: Jobs, where: str) -> None:
    """``trainer.init_module(empty_init=True)``: each unit is materialised and initialised on the GPU (in CPU memory
    with ``cpu_offload``), from rank 0's random state of that device, just before it is sharded."""
    start = materialized_start(BLOCK_UNITS_ORDER, device="cpu" if where == "cpu_offload" else "cuda")
    expected = reference_training(3, "adam", num_samples=8 * devices(), start=start)
    assert max_difference(jobs[f"meta-{where}"]["state_dict"], expected) < 1e-4


@pytest.mark.parametrize("where", ["cpu_offload", "on-gpu"])
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_checkpoints_resume_exactly_on_gpus(jobs: Jobs, state_dict_type: str, where: str) -> None:
    """Save and resume (:func:`resume_jobs`); full saving gathers the optimizer state over NCCL, from CPU memory with
    ``cpu_offload``."""
    name = f"resume-{state_dict_type}-{where}"
    straight = jobs[f"{name}-straight"]
    expected = reference_training(4, "adam", scheduler=True, num_samples=8)
    assert max_difference(straight["state_dict"], expected) < 1e-4
    checkpoint = jobs.folder / "checkpoints" / name / "epoch=1-step=2.ckpt"
    assert checkpoint.is_dir() if state_dict_type == "sharded" else checkpoint.is_file()
    resumed = jobs[f"{name}-resumed"]
    assert resumed["global_step"] == 4
    assert max_difference(resumed["state_dict"], straight["state_dict"]) < 1e-6
