"""Hybrid sharding (``sharding_strategy="HYBRID_SHARD"``) on 4 CPU processes as 2 simulated nodes of 2, against
single-process training without any wrapper.

Every training of this module runs in one launch of 4 processes (``conftest.run_jobs(nodes=2)``): each shards over
the 2 ranks of its node and replicates across the 2 nodes.
"""

from __future__ import annotations

import pytest
import torch
from scenarios.common import max_difference, reference_training

from conftest import Jobs, run_jobs

ATOL = 2e-5
NODES = ["--num-nodes", "2", "--devices", "2"]
CLIP = ["--clip-val", "0.05", "--clip-alg", "norm"]  # the clip value bites
JOBS = {
    # Shard over each node's ranks (the default mesh), Adam, clipping by norm.
    "hybrid": [*NODES, "--sharding-strategy", "HYBRID_SHARD", "--steps", "3", *CLIP, "--save-ckpt", "hybrid.ckpt"],
    # The same shape given as a mesh, with gradient accumulation (`no_sync`: no traffic on the accumulating steps).
    "mesh-accumulate": [*NODES, "--sharding-strategy", "HYBRID_SHARD", "--device-mesh", "2", "2", "--steps", "2",
                        "--accumulate", "2", "--samples", "32", *CLIP],
    # Today's behaviour over all 4 ranks, for the memory comparison.
    "full": [*NODES, "--steps", "3", *CLIP],
    # Sharded checkpoints are not written under hybrid sharding yet: refused before training.
    "sharded-refused": [*NODES, "--sharding-strategy", "HYBRID_SHARD", "--state-dict-type", "sharded"],
}  # fmt: skip
FAILING = ["sharded-refused"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return run_jobs(tmp_path_factory.mktemp("hybrid"), JOBS, failing=FAILING, nodes=2)


def test_hybrid_equals_unsharded_training(jobs: Jobs) -> None:
    result = jobs["hybrid"]
    assert result["world_size"] == 4 and result["num_nodes"] == 2
    assert {unit["world_size"] for unit in result["units"]} == {2}  # each unit shards over its node's 2 ranks
    assert max_difference(result["state_dict"], reference_training(3, "adam", clip=(0.05, "norm"))) < ATOL


def test_mesh_with_accumulation_equals_unsharded_training(jobs: Jobs) -> None:
    result = jobs["mesh-accumulate"]
    expected = reference_training(2, "adam", accumulate=2, clip=(0.05, "norm"), num_samples=32)
    assert max_difference(result["state_dict"], expected) < ATOL


def test_each_rank_holds_half_of_the_model(jobs: Jobs) -> None:
    """Shards of 1/2 of the model under hybrid sharding, twice those of full sharding over the 4 ranks."""
    hybrid, full = jobs["hybrid"]["memory"], jobs["full"]["memory"]
    total = sum(v.numel() for v in jobs["hybrid"]["state_dict"].values())  # no buffers in this model
    assert hybrid["memory/parameters_bytes"] == pytest.approx(4 * total / 2, rel=0.02)
    for key in ("parameters", "gradients", "optimizer_state"):
        key = f"memory/{key}_bytes"
        assert hybrid[key] == pytest.approx(2 * full[key], rel=0.05), key


def test_one_all_reduce_of_the_gradient_shards_crosses_the_nodes_per_step(jobs: Jobs) -> None:
    """The bytes all-reduced over the replica group: this rank's gradient shards (fp32), once per optimizer step,
    also with accumulation (the accumulating backwards reduce nothing)."""
    for name, steps in (("hybrid", 3), ("mesh-accumulate", 2)):
        result = jobs[name]
        shard_bytes = 4 * sum(unit["local_numel"] for unit in result["units"])
        assert result["replica_bytes"] == steps * shard_bytes, name
    assert jobs["full"]["replica_bytes"] is None


def test_sharded_checkpoints_are_refused_under_hybrid_sharding(jobs: Jobs) -> None:
    for error in jobs.errors("sharded-refused", ranks=4):
        assert error["type"] == "NotImplementedError"
        assert 'state_dict_type="full"' in error["message"]


def test_full_checkpoint_is_the_unsharded_model_and_optimizer(jobs: Jobs) -> None:
    """Each replica gathers within itself; rank 0 writes the file: the trained weights, and Adam's state laid out
    as a plain optimizer over the unwrapped module holds it (every rank's shard once, none twice)."""
    checkpoint = torch.load(jobs.folder / "hybrid.ckpt", weights_only=False)
    expected = reference_training(3, "adam", clip=(0.05, "norm"))
    assert max_difference(checkpoint["state_dict"], expected) < ATOL
    (optimizer,) = checkpoint["optimizer_states"]
    shapes = [value.shape for value in expected.values()]
    assert [state["exp_avg"].shape for _, state in sorted(optimizer["state"].items())] == shapes
