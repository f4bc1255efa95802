"""What user code reads outside a unit's forward under DDPFullyShardedStrategy (Trainer and Fabric), each run against
its unsharded reference (``scenarios/reads.py``); all in one launch of 2 processes.

Before the view parameters knew they were sharded: the penalty in ``training_step`` raised ``IndexError`` (the
orthogonality penalty on a 1-D slice; without it the L2 penalty alone ended 0.0035 off), clipping over
``self.parameters()`` ended 2.3e-4 off, and the callback logged 3.23 on rank 0 and 3.22 on rank 1 for a weight
whose norm is 4.57.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scenarios.common import max_difference
from scenarios.config import Reads

from conftest import TESTS, Jobs, run_jobs

SCRIPT = TESTS / "scenarios" / "reads.py"
ATOL = 1e-5

JOBS = {
    "trainer-penalty": Reads(case="penalty"),
    # The penalty in both micro-batches of each step, the first under `no_sync` (before: refused at its backward).
    "trainer-penalty-accumulate": Reads(case="penalty", accumulate=2),
    "trainer-clip": Reads(case="clip"),
    "trainer-log": Reads(case="log"),
    "trainer-one-rank": Reads(case="one_rank", steps=2),
    "fabric-penalty": Reads(front="fabric", case="penalty"),
    "fabric-clip": Reads(front="fabric", case="clip"),
}


@pytest.fixture(scope="module")
def reads(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    folder: Path = tmp_path_factory.mktemp("reads")
    return run_jobs(folder, JOBS, script=SCRIPT, timeout=600)


@pytest.mark.parametrize("name", [name for name in JOBS if name != "trainer-one-rank"])
def test_training_matches_unsharded(reads: Jobs, name: str) -> None:
    result = reads[name]
    difference = max_difference(result["final"], result["reference"])
    assert difference < ATOL, f"{name}: {difference:.3g} off unsharded training"


@pytest.mark.parametrize("name", ["trainer-log", "fabric-penalty", "fabric-clip"])
def test_every_rank_reads_the_whole_weight_and_gradient_norms(reads: Jobs, name: str) -> None:
    result = reads[name]
    expected = [value for pair in result["expected_norms"] for value in pair]
    for rank, logged in enumerate(result["norms"]):
        assert [value for pair in logged for value in pair] == pytest.approx(expected, rel=1e-5), f"rank {rank}"


def test_a_read_on_rank_0_only_ends_in_seconds_with_an_error_naming_the_parameter(reads: Jobs) -> None:
    message, seconds = reads["trainer-one-rank"]["one_rank"]
    assert "net.2.up.weight" in message and "every rank" in message and "local_slice" in message
    assert seconds < 30
