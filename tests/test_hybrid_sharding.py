"""Hybrid sharding (``sharding_strategy="HYBRID_SHARD"``) on 4 CPU processes as 2 simulated nodes of 2, against
single-process training without any wrapper.

Three launches, one after the other (each runs many jobs in the same processes, ``conftest.run_jobs``):

1. 4 processes started by torchrun as on two nodes (``torchrun --nnodes 2 --nproc-per-node 2 --node-rank n``, one
   per node, sharing ``--master-addr``/``--master-port``): the Trainer's trainings and a Fabric loop. Each rank
   shards over the 2 ranks of its node and replicates across the 2 nodes.
2. 2 processes, one node, full sharding: resumes the hybrid sharded checkpoint, and writes one of its own.
3. 4 processes started as Lightning's documentation starts a multi-node run: one process per node, given
   ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; the Trainer's own launcher (``Trainer(num_nodes=2,
   devices=2)``) starts each node's second rank. It trains again, checks the process groups' lifecycle over several
   stages, and resumes the 2-process checkpoint under hybrid sharding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from scenarios.common import assert_adam_close, max_difference, reference_training
from scenarios.config import Config, FabricScenario, Scenario

from conftest import Jobs, run_jobs
from lightning_fairscale import consolidate
from lightning_fairscale.plugins.checkpoint_io import META_FILE, shard_file_name

NODES = Scenario(num_nodes=2, devices=2)
CLIP = (0.05, "norm")  # the clip value bites
STEPS = {"steps": 4, "samples": 8, "scheduler": True}  # one step per epoch: every epoch end resumes exactly
HYBRID_STEPS = NODES.replace(sharding_strategy="HYBRID_SHARD", **STEPS, state_dict_type="sharded")
SOURCE = "epoch=1-step=2.ckpt"  # the sharded checkpoint of step 2 that the other runs resume from
JOBS: dict[str, Config] = {
    # Shard over each node's ranks (the default mesh), Adam, clipping by norm.
    "hybrid": NODES.replace(sharding_strategy="HYBRID_SHARD", steps=3, clip=CLIP, save_ckpt="hybrid.ckpt"),
    # The same shape given as a mesh, with gradient accumulation (`no_sync`: no traffic on the accumulating steps).
    "mesh-accumulate": NODES.replace(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2), steps=2, accumulate=2,
                                     samples=32, clip=CLIP),
    # Today's behaviour over all 4 ranks, for the memory comparison.
    "full": NODES.replace(steps=3, clip=CLIP),
    # Sharded checkpoints at every epoch end (one step each), written by replica 0; then resumed at step 2.
    "sharded": HYBRID_STEPS.replace(checkpoint_dir="ck-sharded"),
    "sharded-resumed": HYBRID_STEPS.replace(ckpt_path=f"ck-sharded/{SOURCE}"),
    # Fabric's strategy, hybrid, in the same processes: Adam, clipping by norm.
    "fabric-hybrid": FabricScenario(strategy="fsdp", num_nodes=2, sharding_strategy="HYBRID_SHARD", steps=3,
                                    clip_norm=0.05),
}  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return run_jobs(tmp_path_factory.mktemp("hybrid"), JOBS, nodes=2, launcher="torchrun")


@pytest.fixture(scope="module")
def consolidated(jobs: Jobs) -> Path:
    """The hybrid sharded checkpoint of step 2, consolidated with the command-line tool's code."""
    target = jobs.folder / "consolidated.ckpt"
    assert consolidate.main([str(jobs.folder / "ck-sharded" / SOURCE), str(target)]) == 0
    return target


@pytest.fixture(scope="module")
def two_processes(jobs: Jobs, consolidated: Path) -> Jobs:
    """2 processes, one node, FULL_SHARD: resume from the hybrid sharded checkpoint and from its consolidation."""
    steps = Scenario(devices=2, **STEPS, state_dict_type="sharded")
    resumes = {
        "full-from-hybrid": steps.replace(ckpt_path=str(jobs.folder / "ck-sharded" / SOURCE)),
        "full-from-consolidated": steps.replace(ckpt_path=str(consolidated)),
        # Sharded checkpoints of its own (2 shards, full sharding), for the hybrid resume of the third launch.
        "full-source": steps.replace(checkpoint_dir="ck-full"),
    }
    return run_jobs(jobs.folder / "two_processes", resumes)


@pytest.fixture(scope="module")
def lightning_launcher(two_processes: Jobs) -> Jobs:
    """4 processes, 2 nodes: one started per node, Lightning's launcher starts the other (see the module's doc)."""
    launched = {
        # Adam, clipping by norm; then validate, test and predict on the sharded module; then `unshard_module`.
        "launcher-hybrid": NODES.replace(sharding_strategy="HYBRID_SHARD", steps=3, clip=CLIP, eval_after=True),
        # The full-sharding checkpoint of step 2 (2 shards) resumed on 4 processes under hybrid sharding.
        "hybrid-from-full": HYBRID_STEPS.replace(record_loaded=True,
                                                 ckpt_path=str(two_processes.folder / "ck-full" / SOURCE)),
    }  # fmt: skip
    return run_jobs(two_processes.folder.parent / "lightning_launcher", launched, nodes=2, launcher="lightning")


def _assert_hybrid_training(result: dict[str, Any], cluster: str, steps: int) -> None:
    """4 processes as 2 nodes of 2 (started by the launcher behind ``cluster``): unsharded training's weights, half
    of the model's 16 bytes per parameter (Adam) on each rank, and across the nodes one all-reduce of this rank's
    gradient shards (fp32) per step."""
    assert (result["cluster"], result["world_size"], result["num_nodes"]) == (cluster, 4, 2)
    assert {unit["world_size"] for unit in result["units"]} == {2}  # each unit shards over its node's 2 ranks
    assert_adam_close(result["state_dict"], reference_training(steps, "adam", clip=(0.05, "norm")))
    _assert_half_of_16_bytes_per_parameter(result["memory"], result["state_dict"])
    assert result["replica_bytes"] == steps * 4 * sum(unit["local_numel"] for unit in result["units"])


def _assert_half_of_16_bytes_per_parameter(memory: dict[str, float], state_dict: dict[str, torch.Tensor]) -> None:
    """Parameters, gradients and Adam's two moments in fp32, of half the model: 16Ψ/2 bytes (padding and Adam's
    `step` tensors aside)."""
    total = sum(v.numel() for v in state_dict.values())  # no buffers in this model
    kinds = ("parameters", "gradients", "optimizer_state")
    assert sum(memory[f"memory/{kind}_bytes"] for kind in kinds) == pytest.approx(16 * total / 2, rel=0.03)


@pytest.mark.workaround(14)
def test_hybrid_under_torchrun_equals_unsharded_training(jobs: Jobs) -> None:
    _assert_hybrid_training(jobs["hybrid"], "TorchElasticEnvironment", steps=3)


def test_hybrid_under_the_trainers_own_launcher_equals_unsharded_training(lightning_launcher: Jobs) -> None:
    _assert_hybrid_training(lightning_launcher["launcher-hybrid"], "LightningEnvironment", steps=3)


def test_fabric_hybrid_loop_equals_unsharded_training(jobs: Jobs) -> None:
    result = jobs["fabric-hybrid"]
    assert (result["cluster"], result["world_size"]) == ("TorchElasticEnvironment", 4)
    assert all(norm > 0.05 for norm in result["norms"])  # every step was clipped
    assert_adam_close(result["final"], reference_training(3, "adam", clip=(0.05, "norm")))
    _assert_half_of_16_bytes_per_parameter(result["memory"], result["final"])
    assert result["replica_bytes"] == 3 * result["shard_bytes"]
    # The user's L2 over `model.parameters()` outside the forward: the whole model's, over the shard group only.
    l2 = sum(value.double().pow(2).sum().item() for value in result["final"].values())
    assert result["l2_outside_forward"] == pytest.approx(l2, rel=1e-5)


def test_process_groups_are_made_once_and_destroyed_with_the_sharded_module(
    jobs: Jobs, lightning_launcher: Jobs
) -> None:
    """fit, validate, test and predict on one sharded module: the groups of the first stage serve every later one
    (none is made again), live while the module is sharded over them, and are destroyed by ``unshard_module``; the
    same under full sharding (one fit: its all-gather and reduce-scatter groups)."""
    hybrid, full = lightning_launcher["launcher-hybrid"]["groups"], jobs["full"]["groups"]
    assert (hybrid["stages"], hybrid["reused"], full["stages"]) == (4, True, 1)
    assert hybrid["alive_before_unshard"] == [True] * 3  # all-gather, reduce-scatter, replica
    assert hybrid["alive_after_unshard"] == [False] * 3
    assert (full["alive_before_unshard"], full["alive_after_unshard"]) == ([True] * 2, [False] * 2)


def test_full_sharded_checkpoint_of_2_processes_resumes_under_hybrid_sharding_on_4(
    two_processes: Jobs, lightning_launcher: Jobs
) -> None:
    """The 2 shards of full sharding, loaded by each node's 2 ranks: the weights of step 2 exactly as saved, then
    two steps under hybrid sharding as the 2 processes took them."""
    consolidated = two_processes.folder / "ck-full-consolidated.ckpt"
    assert consolidate.main([str(two_processes.folder / "ck-full" / SOURCE), str(consolidated)]) == 0
    saved = torch.load(consolidated, weights_only=False)
    resumed = lightning_launcher["hybrid-from-full"]
    assert saved["global_step"] == 2 and resumed["global_step"] == 4
    assert max_difference(resumed["loaded"], saved["state_dict"]) == 0.0
    assert_adam_close(resumed["state_dict"], two_processes["full-source"]["state_dict"])
    assert_adam_close(resumed["state_dict"], reference_training(4, "adam", scheduler=True, num_samples=8))


def test_mesh_with_accumulation_equals_unsharded_training(jobs: Jobs) -> None:
    result = jobs["mesh-accumulate"]
    expected = reference_training(2, "adam", accumulate=2, clip=(0.05, "norm"), num_samples=32)
    assert_adam_close(result["state_dict"], expected)


def test_each_rank_holds_half_of_the_model(jobs: Jobs) -> None:
    """Shards of 1/2 of the model under hybrid sharding, twice those of full sharding over the 4 ranks."""
    hybrid, full = jobs["hybrid"]["memory"], jobs["full"]["memory"]
    total = sum(v.numel() for v in jobs["hybrid"]["state_dict"].values())  # no buffers in this model
    assert hybrid["memory/parameters_bytes"] == pytest.approx(4 * total / 2, rel=0.02)
    for key in ("parameters", "gradients", "optimizer_state"):
        key = f"memory/{key}_bytes"
        assert hybrid[key] == pytest.approx(2 * full[key], rel=0.05), key


@pytest.mark.workaround(14)
def test_one_all_reduce_of_the_gradient_shards_crosses_the_nodes_per_step(jobs: Jobs) -> None:
    """The bytes all-reduced over the replica group: this rank's gradient shards (fp32), once per optimizer step,
    also with accumulation (the accumulating backwards reduce nothing)."""
    for name, steps in (("hybrid", 3), ("mesh-accumulate", 2)):
        result = jobs[name]
        shard_bytes = 4 * sum(unit["local_numel"] for unit in result["units"])
        assert result["replica_bytes"] == steps * shard_bytes, name
    assert jobs["full"]["replica_bytes"] is None


def test_sharded_checkpoint_is_written_once_by_replica_0(jobs: Jobs) -> None:
    """One shard per rank of a shard group (2), not one per process (4): the replicas' identical shards are written
    once; nothing is left staged beside the checkpoints."""
    folder = jobs.folder / "ck-sharded"
    assert sorted(p.name for p in folder.iterdir()) == [f"epoch={e}-step={e + 1}.ckpt" for e in range(4)]
    directory = folder / SOURCE
    assert sorted(p.name for p in directory.iterdir()) == [META_FILE, shard_file_name(0, 2), shard_file_name(1, 2)]
    assert torch.load(directory / META_FILE, weights_only=False)["lightning_fairscale"]["world_size"] == 2
    total = sum(v.numel() for v in jobs["sharded"]["state_dict"].values())
    for rank in range(2):  # each file holds its half of the model (plus padding)
        shard = torch.load(directory / shard_file_name(rank, 2), weights_only=True)
        assert sum(t.numel() for t in shard["state_dict"].values()) <= total / 2 + 8


def test_resume_from_hybrid_sharded_checkpoint_is_exact(jobs: Jobs) -> None:
    """Every replica loads the same 2 shards: the resumed run is the straight one, bit for bit."""
    straight, resumed = jobs["sharded"], jobs["sharded-resumed"]
    assert resumed["global_step"] == 4
    assert max_difference(resumed["state_dict"], straight["state_dict"]) == 0.0
    expected = reference_training(4, "adam", scheduler=True, num_samples=8)
    assert_adam_close(straight["state_dict"], expected)


@pytest.mark.parametrize("name", ["full-from-hybrid", "full-from-consolidated"])
def test_full_sharding_on_2_processes_resumes_a_hybrid_sharded_checkpoint(
    jobs: Jobs, two_processes: Jobs, name: str
) -> None:
    """The hybrid checkpoint of step 2 (directly, and consolidated) resumes on one node of 2 under FULL_SHARD."""
    resumed = two_processes[name]
    assert resumed["global_step"] == 4 and {unit["world_size"] for unit in resumed["units"]} == {2}
    assert_adam_close(resumed["state_dict"], jobs["sharded"]["state_dict"])  # 2 processes sum in another order


def test_consolidated_hybrid_checkpoint_is_the_model_and_optimizer_of_step_2(consolidated: Path) -> None:
    checkpoint: dict[str, Any] = torch.load(consolidated, weights_only=False)
    expected = reference_training(2, "adam", scheduler=True, num_samples=8)
    assert checkpoint["global_step"] == 2
    assert_adam_close(checkpoint["state_dict"], expected)
    (optimizer,) = checkpoint["optimizer_states"]
    shapes = [value.shape for value in expected.values()]
    assert [state["exp_avg"].shape for _, state in sorted(optimizer["state"].items())] == shapes


def test_full_checkpoint_is_the_unsharded_model_and_optimizer(jobs: Jobs) -> None:
    """Each replica gathers within itself; rank 0 writes the file: the trained weights, and Adam's state laid out
    as a plain optimizer over the unwrapped module holds it (every rank's shard once, none twice)."""
    checkpoint = torch.load(jobs.folder / "hybrid.ckpt", weights_only=False)
    expected = reference_training(3, "adam", clip=(0.05, "norm"))
    assert_adam_close(checkpoint["state_dict"], expected)
    (optimizer,) = checkpoint["optimizer_states"]
    shapes = [value.shape for value in expected.values()]
    assert [state["exp_avg"].shape for _, state in sorted(optimizer["state"].items())] == shapes
