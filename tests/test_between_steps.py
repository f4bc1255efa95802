"""Between steps: what a loop may change in the model's state under DDPFullyShardedStrategy (Trainer and Fabric),
each run against its unsharded reference (``scenarios/between_steps.py``); all in one launch.

* freezing and unfreezing after set-up (gradual unfreezing): frozen layers get no gradient, no update and no change
  of Adam's state; unfrozen ones train again; a unit frozen whole, or in part; clipping leaves frozen ones out;
* two optimizers with manual optimization (a GAN: ``toggle_optimizer``, ``manual_backward``, ``clip_gradients``),
  two backward passes in one training step, the second through the generator's kept graph (``detach=False``);
* save -> resume exact after it, full and sharded checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from scenarios.common import assert_adam_close
from scenarios.config import BetweenSteps

from conftest import TESTS, Jobs, run_jobs

SCRIPT = TESTS / "scenarios" / "between_steps.py"

_CASES: dict[str, dict[str, Any]] = {
    "freeze": {},
    "freeze-clip": {"clip": 0.05},
    "freeze-setup-frozen": {"setup_frozen": True},
    "freeze-resume-full": {"save_at": 4},
    "freeze-resume-sharded": {"save_at": 4, "state_dict_type": "sharded"},
    "gan": {"case": "gan", "steps": 4},
    "gan-attached": {"case": "gan", "steps": 4, "detach": False},
    "gan-clip": {"case": "gan", "steps": 4, "clip": 0.05, "detach": False},
    "gan-resume-full": {"case": "gan", "steps": 4, "save_at": 2},
    "gan-resume-sharded": {"case": "gan", "steps": 4, "save_at": 2, "state_dict_type": "sharded"},
}
JOBS = {
    **{f"trainer-{name}": BetweenSteps(**fields) for name, fields in _CASES.items()},
    **{f"fabric-{name}": BetweenSteps(front="fabric", **fields) for name, fields in _CASES.items()},
    # Lightning's resume from an epoch's end checkpoint is not the continuous training (it restores one step more
    # than it trained): the Trainer's resumes are compared with the same resume under Lightning's unsharded DDP.
    "trainer-freeze-resume-ddp": BetweenSteps(save_at=4, strategy="ddp"),
    "trainer-gan-resume-ddp": BetweenSteps(case="gan", steps=4, save_at=2, strategy="ddp"),
}
#: The unsharded run each job is compared with: its own reference, but for the Trainer's resumes.
UNSHARDED = {
    name: f"trainer-{name.split('-')[1]}-resume-ddp" if name.startswith("trainer-") and "resume" in name else name
    for name in JOBS
    if not name.endswith("-ddp")
}


@pytest.fixture(scope="module")
def between(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    folder: Path = tmp_path_factory.mktemp("between")
    jobs = {name: config.replace(save_dir=str(folder / name)) for name, config in JOBS.items()}
    return run_jobs(folder, jobs, script=SCRIPT, timeout=600)


@pytest.mark.parametrize("name", list(UNSHARDED))
def test_matches_unsharded(between: Jobs, name: str) -> None:
    result = between[name]
    unsharded = between[UNSHARDED[name]]
    expected = unsharded["final"] if UNSHARDED[name] != name else result["reference"]
    # Adam: the whole update relative to its size (scenarios.common.ADAM_RTOL), not 1e-5 on every weight.
    assert_adam_close(result["final"], expected, result["start"], what=f"{name}, against unsharded training")
