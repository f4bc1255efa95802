"""Checkpoints written in the background, and the throughput and device-stats callbacks, under both strategies.

One launch (Lightning's launcher) kills a process during a background write: rank 1 dies halfway through writing its
shard of the second ``last.ckpt`` on the plugin's thread, while training goes on. The previous ``last.ckpt`` stays
whole and ``fit(ckpt_path="last")`` resumes from it exactly. One shared launch (``conftest.run_jobs``) then runs that
resume, ``ModelCheckpoint``'s top-k with both ways of asking for background saves (full and sharded), and the same
training with ``ThroughputMonitor`` and ``DeviceStatsMonitor`` under ``"fsdp_fairscale"``, ``"ddp_sharded"`` and
``"ddp"``, compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from scenarios.common import GLOBAL_BATCH, max_difference
from scenarios.config import Kill, Scenario

from conftest import Jobs, command, run_jobs, run_script
from lightning_fairscale.plugins.checkpoint_io import META_FILE

STEPS = Scenario(steps=4, samples=8, scheduler=True)  # one step per epoch: every epoch end is a clean resume point
KILLED = STEPS.replace(save_last=True, state_dict_type="sharded", async_save="option", kill=Kill(2, rank=1),
                       timeout=60)
TOP_K = {"full": "option", "sharded": "lightning"}  # state_dict_type -> how the background saves are asked for
STRATEGIES = {"fsdp_fairscale": "", "ddp_sharded": "ddp_sharded", "ddp": "ddp"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("async_checkpoint")


@pytest.fixture(scope="module")
def killed(folder: Path) -> dict[str, Any]:
    """The killed run, and what its checkpoint folder held when it died (the resume then writes there)."""
    workdir = folder / "killed"
    workdir.mkdir()
    config = KILLED.replace(checkpoint_dir=str(workdir / "ck"))
    proc = run_script(command(config, workdir / "unused.pt"), cwd=workdir, expect_ok=False)
    last = workdir / "ck" / "last.ckpt"
    step = torch.load(last / META_FILE, weights_only=False)["global_step"] if (last / META_FILE).is_file() else None
    return {"proc": proc, "files": sorted(p.name for p in last.parent.iterdir()), "global_step": step}


@pytest.fixture(scope="module")
def runs(killed: dict[str, Any], folder: Path) -> Jobs:
    jobs = {
        "straight": STEPS,
        # The killed run again, from its last checkpoint, as a job restarted by a cluster would be.
        "resumed-last": KILLED.replace(kill=None, ckpt_path="last", checkpoint_dir=str(folder / "killed" / "ck")),
    }
    for kind, how in TOP_K.items():
        jobs[f"top-k-{kind}"] = STEPS.replace(checkpoint_dir=str(folder / f"top-k-{kind}"), save_top_k=2,
                                              state_dict_type=kind, async_save=how)
    for name, registered in STRATEGIES.items():
        jobs[f"throughput-{name}"] = Scenario(steps=4, throughput=True, model_summary=True, strategy_name=registered)
    return run_jobs(folder / "runs", jobs)


def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(
    killed: dict[str, Any], runs: Jobs, folder: Path
) -> None:
    proc = killed["proc"]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "on thread lightning-fairscale-checkpoint" in output, output[-3000:]  # the background thread's write
    # The first last.ckpt, whole (the second one's staging directory, never read, may be left, or removed by rank 0).
    assert killed["global_step"] == 1
    assert [name for name in killed["files"] if not name.startswith(".")] == ["last.ckpt"]
    checkpoints = folder / "killed" / "ck"
    resumed = runs["resumed-last"]
    assert resumed["global_step"] == 4
    assert max_difference(resumed["state_dict"], runs["straight"]["state_dict"]) == 0.0
    # The resumed run's own background saves completed: its last.ckpt is the end of training.
    assert torch.load(checkpoints / "last.ckpt" / META_FILE, weights_only=False)["global_step"] == 4


@pytest.mark.parametrize("kind", TOP_K)
def test_top_k_removes_old_checkpoints_after_the_new_ones_are_written(runs: Jobs, folder: Path, kind: str) -> None:
    result = runs[f"top-k-{kind}"]
    assert max_difference(result["state_dict"], runs["straight"]["state_dict"]) == 0.0
    directory = folder / f"top-k-{kind}"
    assert sorted(p.name for p in directory.iterdir()) == ["epoch=2-step=3.ckpt", "epoch=3-step=4.ckpt"]
    last = directory / "epoch=3-step=4.ckpt"
    saved = torch.load(last / META_FILE if kind == "sharded" else last, weights_only=False)
    assert saved["global_step"] == 4
    if kind == "full":  # the state of the moment of the save, not a later one
        assert max_difference(saved["state_dict"], result["state_dict"]) == 0.0


def _logged(result: dict) -> dict[str, float]:
    """Every metric the run logged, the last value of each."""
    merged: dict[str, float] = {}
    for metrics in result["metrics"]:
        merged.update(metrics)
    return merged


@pytest.mark.parametrize("name", ["fsdp_fairscale", "ddp_sharded"])
def test_throughput_and_device_stats_report_what_ddp_reports(runs: Jobs, name: str) -> None:
    ours, ddp = _logged(runs[f"throughput-{name}"]), _logged(runs["throughput-ddp"])
    assert ours.keys() == ddp.keys()
    assert {f"train/{key}" for key in ("device/flops_per_sec", "device/samples_per_sec", "flops_per_sec",
                                       "samples_per_sec")} <= ours.keys()
    assert any(key.startswith("DeviceStatsMonitor.on_train_batch_start/cpu_") for key in ours)
    flops = runs[f"throughput-{name}"]["flops_per_batch"]
    assert flops == runs["throughput-ddp"]["flops_per_batch"] > 0
    # The FLOPs per second are the whole model's: the measured FLOPs per sample, at the measured rate.
    per_sample = flops / (GLOBAL_BATCH // 2)
    assert ours["train/device/flops_per_sec"] == pytest.approx(ours["train/device/samples_per_sec"] * per_sample,
                                                                rel=1e-6)
    # Samples per second: the whole world's, as under "ddp" (each rank's rate times the 2 ranks), not a shard's share.
    # (A relation, not a ratio to "ddp"'s rate: the two runs' speeds depend on the machine's load.)
    for logged in (ours, ddp):
        assert logged["train/samples_per_sec"] == pytest.approx(logged["train/device/samples_per_sec"] * 2, rel=1e-6)
    # What the rates divide, counted (not timed): the same batches and samples as "ddp"'s run.
    assert (ours["train/batches"], ours["train/samples"]) == (ddp["train/batches"], ddp["train/samples"])
    assert ours["train/samples"] > 0
    # The model's parameter count is the whole model's (the model summary), not this rank's shard.
    ours_summary, ddp_summary = runs[f"throughput-{name}"]["summaries"], runs["throughput-ddp"]["summaries"]
    assert ours_summary[0]["total"] == ddp_summary[0]["total"] > 0
