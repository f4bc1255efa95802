"""Units whose forward does not run in a step (issue 54 item 1; workaround 29), under DDPFullyShardedStrategy
(Trainer and Fabric) and ``"ddp_sharded"``, each run against its unsharded reference (``scenarios/unused_units.py``);
all in one launch.

* a head used only in ``predict_step``, a unit of its own by the layer-class policy; layers every forward skips, units
  by the size policy; a unit that runs in every other batch (and, accumulating, in the accumulating batch only);
* FULL_SHARD, SHARD_GRAD_OP, hybrid; activation checkpointing, accumulation, clipping by norm;
* save -> resume exact after it, full and sharded checkpoints.

Before workaround 29 every FSDP job failed at its first backward, on both ranks, with ``AttributeError:
'FlatParameter' object has no attribute '_full_param_padded'``. The ``"ddp_sharded"`` jobs passed already (pinned),
but for a layer that ran only in a step's accumulating micro-batch: 0.071 off before workaround 30.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from scenarios.common import max_difference
from scenarios.config import UnusedUnits

from conftest import TESTS, Jobs, run_jobs

SCRIPT = TESTS / "scenarios" / "unused_units.py"
#: After 6 AdamW steps of lr 1e-2 (``eps=1e-3``: the update is smooth in the gradient): a thousandth of one step.
ATOL = 1e-5

_CASES: dict[str, dict[str, Any]] = {
    "aux": {},
    "size": {"case": "size"},
    "alternate": {"case": "alternate"},
    "alternate-accumulate": {"case": "alternate", "accumulate": 2, "steps": 4},
    "alternate-clip-checkpointing": {"case": "alternate", "clip": 0.05, "checkpointing": True},
    "alternate-grad-op": {"case": "alternate", "sharding_strategy": "SHARD_GRAD_OP"},
    "alternate-hybrid": {"case": "alternate", "sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)},
    "alternate-hybrid-accumulate": {
        "case": "alternate", "sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1), "accumulate": 2, "steps": 4
    },
    "aux-resume-full": {"save_at": 3},
    "size-resume-sharded": {"case": "size", "save_at": 3, "state_dict_type": "sharded"},
    "alternate-resume-full": {"case": "alternate", "save_at": 3},
    "alternate-resume-sharded": {"case": "alternate", "save_at": 3, "state_dict_type": "sharded"},
}
_FABRIC = ("aux", "size", "alternate", "alternate-accumulate", "alternate-clip-checkpointing", "alternate-resume-full",
           "alternate-resume-sharded")
JOBS: dict[str, UnusedUnits] = {
    **{f"trainer-{name}": UnusedUnits(**fields) for name, fields in _CASES.items()},
    **{f"fabric-{name}": UnusedUnits(front="fabric", **fields) for name, fields in _CASES.items() if name in _FABRIC},
    "sharded-aux": UnusedUnits(strategy="ddp_sharded"),
    "sharded-alternate": UnusedUnits(strategy="ddp_sharded", case="alternate"),
    "sharded-alternate-clip": UnusedUnits(strategy="ddp_sharded", case="alternate", clip=0.05),
    "sharded-alternate-accumulate": UnusedUnits(strategy="ddp_sharded", case="alternate", accumulate=2, steps=4),
    # Issue 54 item 4, last (it fails on every rank): the second Block runs on rank 0 only.
    **{f"{front}-diverge": UnusedUnits(front=front, case="diverge") for front in ("trainer", "fabric")},
    # Lightning's resume from an epoch's end checkpoint is not the continuous training: the Trainer's resumes are
    # compared with the same resume under Lightning's unsharded DDP (find_unused_parameters=True).
    **{
        f"ddp-{name}": UnusedUnits(strategy="ddp", **{k: v for k, v in fields.items() if k != "state_dict_type"})
        for name, fields in _CASES.items()
        if "resume" in name
    },
}
#: The run each job is compared with: the unsharded reference, but for the Trainer's resumes.
UNSHARDED = {
    name: f"ddp-{name.removeprefix('trainer-')}" if name.startswith("trainer-") and "resume" in name else name
    for name in JOBS
    if not name.startswith("ddp-") and not name.endswith("-diverge")
}
DIVERGE = [name for name in JOBS if name.endswith("-diverge")]


@pytest.fixture(scope="module")
def unused(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    folder: Path = tmp_path_factory.mktemp("unused")
    jobs = {name: config.replace(save_dir=str(folder / name)) for name, config in JOBS.items()}
    jobs = {**{n: c for n, c in jobs.items() if n not in DIVERGE}, **{n: jobs[n] for n in DIVERGE}}
    return run_jobs(folder, jobs, failing=DIVERGE, script=SCRIPT, timeout=900)


@pytest.mark.workaround(29)
@pytest.mark.workaround(30)
@pytest.mark.parametrize("name", list(UNSHARDED))
def test_matches_unsharded(unused: Jobs, name: str) -> None:
    result = unused[name]
    other = UNSHARDED[name]
    expected = unused[other]["final"] if other != name else result["reference"]
    difference = max_difference(result["final"], expected)
    assert difference < ATOL, f"{name}: {difference:.3g} off unsharded training"


def test_the_ddp_resumes_are_a_training_with_the_unused_units() -> None:
    """The references of the Trainer's resumes train the same schedule (a check of the scenario itself)."""
    assert {name for name in JOBS if name.startswith("ddp-")} == {
        UNSHARDED[name] for name in UNSHARDED if UNSHARDED[name] != name
    }


@pytest.mark.parametrize("name", DIVERGE)
def test_a_unit_run_on_one_rank_only_ends_the_run_on_every_rank_naming_it(unused: Jobs, name: str) -> None:
    """Issue 54 item 4: the job ends on every rank at the rank-divergent unit, with its name and what to do. Before,
    rank 0 reported gloo's ``Read error`` and rank 1 nothing (issue 54); with workaround 29 alone, both ranks waited
    for the job's 20 s collective timeout and ended with ``RuntimeError: Application timeout caused pair closure``."""
    path = "net.b2" if name.startswith("trainer-") else "b2"  # its path in the user's model: the module, or the Net
    for rank, error in enumerate(unused.errors(name)):
        assert error["type"] == "RankDivergenceError", (rank, error["traceback"])
        message = error["message"]
        assert f"FSDP unit '{path}' ran on rank(s) 0 in this forward" in message, (rank, message)
        assert "rank 1 went on to the end of the forward" in message, (rank, message)
        assert "Run it on every rank" in message and "empty input" in message, (rank, message)
