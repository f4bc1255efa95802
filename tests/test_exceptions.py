"""An exception inside a training step (issue 47, item 5): the user's exception reaches the caller unchanged on every
rank, ``OnExceptionCheckpoint`` writes the last completed step's weights (full or sharded; a sharded one consolidates
with ``lightning-fairscale-consolidate``), and a later job resumes from it exactly as unsharded training goes on.

One launch (:func:`launch`): for each strategy and place of the exception, a job that fails in step :data:`FAIL_AT`
(every rank raises the test's ``UserError``), then a job that resumes from its checkpoint to :data:`STEPS`. Lightning's
own ``"ddp"`` is there too: the reference for what a Lightning user expects of the same run. The same launch runs
the FSDP options of :data:`VARIANTS` and Fabric loops that catch the error and go on; a rank-local exception has a
launch of its own (its process group does not survive it).
"""

from __future__ import annotations

import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch
from scenarios.common import assert_adam_close, max_difference, reference_training
from scenarios.config import FabricScenario, Scenario

from conftest import Jobs, run_jobs

STEPS, FAIL_AT = 6, 3
BASE = Scenario(steps=STEPS, samples=8)  # Adam, one step per epoch (an exact resume in Lightning)

#: (job prefix, the strategy's fields, whether its checkpoint is a sharded directory)
STRATEGIES = {
    "full": ({}, False),
    "sharded": ({"state_dict_type": "sharded"}, True),
    "ddp_sharded": ({"strategy_name": "ddp_sharded"}, False),
    "ddp": ({"strategy_name": "ddp"}, False),
}
PLACES = ("step", "forward", "backward", "optimizer")
CASES = [(kind, where) for kind in STRATEGIES for where in PLACES if kind != "ddp" or where == "step"]


#: The FSDP options that change what a step leaves behind, each with an exception in the backward (full checkpoint):
#: compute in bf16 (fp16 copies of the shards), the backward gathering ahead before computing (workaround 16's
#: BACKWARD_PRE mode), activation checkpointing (forwards recomputed inside the backward). Each is compared with the
#: same training without the exception ("straight-...").
VARIANTS = {
    "bf16": {"precision": "bf16-mixed"},
    "pre": {"backward_prefetch": "BACKWARD_PRE"},
    "checkpointing": {"checkpointing": True},
}

#: Fabric: a loop that catches the user's error in step FAIL_AT, saves, and goes on; each strategy and place.
FABRIC_CASES = [(strategy, where) for strategy in ("fsdp", "sharded") for where in ("forward", "backward")]


def fabric_job(folder: Path, strategy: str, where: str) -> FabricScenario:
    return FabricScenario(
        strategy=strategy, policy="size", steps=STEPS, samples=8, save_at=FAIL_AT, fail_at=(FAIL_AT, where),
        save_dir=str(folder / f"fabric-{strategy}-{where}"),
    )


def checkpoint_path(folder: Path, kind: str, where: str) -> Path:
    return folder / f"{kind}-{where}" / "on_exception.ckpt"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exceptions")


@pytest.fixture(scope="module")
def launch(folder: Path) -> Jobs:
    failing, resumed = {}, {}
    for kind, where in CASES:
        fields, _ = STRATEGIES[kind]
        config = BASE.replace(**fields)
        failing[f"fail-{kind}-{where}"] = config.replace(
            fail_at=(FAIL_AT, where), on_exception_dir=str(checkpoint_path(folder, kind, where).parent)
        )
        resumed[f"resume-{kind}-{where}"] = config.replace(
            ckpt_path=str(checkpoint_path(folder, kind, where)), record_loaded=True
        )
    for variant, fields in VARIANTS.items():
        config = BASE.replace(**fields)
        resumed[f"straight-{variant}"] = config
        failing[f"fail-{variant}"] = config.replace(
            fail_at=(FAIL_AT, "backward"), on_exception_dir=str(folder / variant)
        )
        resumed[f"resume-{variant}"] = config.replace(ckpt_path=str(folder / variant / "on_exception.ckpt"))
    fabric = {f"fabric-{strategy}-{where}": fabric_job(folder, strategy, where) for strategy, where in FABRIC_CASES}
    return run_jobs(folder / "launch", {**failing, **resumed, **fabric}, failing=list(failing))


@pytest.mark.parametrize(("kind", "where"), CASES)
def test_user_exception_reaches_the_caller_unchanged(launch: Jobs, kind: str, where: str) -> None:
    for error in launch.errors(f"fail-{kind}-{where}"):
        assert error["type"] == "UserError", error["traceback"][-3000:]
        assert error["message"] == f"NaN guard: not finite in step {FAIL_AT} ({where})"
        assert error["trained_batches"] == FAIL_AT


@pytest.mark.parametrize(("kind", "where"), CASES)
def test_checkpoint_holds_the_last_completed_step_and_resumes_exactly(
    launch: Jobs, folder: Path, kind: str, where: str
) -> None:
    resumed = launch[f"resume-{kind}-{where}"]
    # After Adam's steps: relative to the update (scenarios.common.ADAM_RTOL), as the resumed weights below.
    assert_adam_close(resumed["loaded"], reference_training(FAIL_AT, num_samples=8), what="the checkpoint's weights")
    assert resumed["global_step"] == STEPS
    assert_adam_close(resumed["state_dict"], reference_training(STEPS, num_samples=8))


@pytest.mark.parametrize("where", [w for k, w in CASES if k == "sharded"])
def test_sharded_checkpoint_consolidates(launch: Jobs, folder: Path, tmp_path: Path, where: str) -> None:
    source = checkpoint_path(folder, "sharded", where)
    assert source.is_dir()
    tool = Path(sys.executable).parent / "lightning-fairscale-consolidate"
    subprocess.run([str(tool), str(source), str(tmp_path / "full.ckpt")], check=True, capture_output=True)
    consolidated = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert consolidated["global_step"] == FAIL_AT
    assert_adam_close(consolidated["state_dict"], reference_training(FAIL_AT, num_samples=8))


@pytest.mark.parametrize(("strategy", "where"), FABRIC_CASES)
def test_fabric_loop_saves_and_goes_on_after_the_users_error(launch: Jobs, strategy: str, where: str) -> None:
    """The loop caught the error in step FAIL_AT and went on: one step fewer than unsharded training of STEPS (every
    step trains on the same batch here), and the checkpoints it saved after the error resume to STEPS exactly."""
    result = launch[f"fabric-{strategy}-{where}"]
    assert_adam_close(result["final"], reference_training(STEPS - 1, num_samples=8))
    expected = reference_training(STEPS, num_samples=8)
    kinds = ["full", "sharded"] if strategy == "fsdp" else ["full"]
    assert sorted(result["resumed"]) == sorted(kinds)
    for kind in kinds:
        assert_adam_close(result["resumed"][kind], expected, what=kind)  # after Adam's steps (ADAM_RTOL)


def test_rank_local_exception_ends_without_waiting_for_the_timeout(tmp_path: Path) -> None:
    """Only rank 0 raises (in ``training_step``), with an ``OnExceptionCheckpoint``: rank 1 is still in the step's
    collectives, so the checkpoint's gathering would wait until the collective timeout (120 s here), as Lightning's
    ``"ddp"`` waits at its barrier. Rank 0 finds out through the store that it failed alone, skips the save (saying
    why) and its own exception goes on unchanged; rank 1 then fails at once (its peer is gone)."""
    name = "rank-local"
    config = BASE.replace(fail_at=(FAIL_AT, "step"), fail_rank=0, on_exception_dir=str(tmp_path / "ck"), timeout=120)
    started = time.monotonic()
    launch = run_jobs(tmp_path / "launch", {name: config}, failing=[name], killed=name, timeout=100)
    assert time.monotonic() - started < 90
    (error,) = launch.errors(name, ranks=1)  # rank 0's
    assert error["type"] == "UserError", error["traceback"][-3000:]
    assert error["message"] == f"NaN guard: not finite in step {FAIL_AT} (step)"
    assert "did not raise within" in launch.output(name)
    assert not (tmp_path / "ck" / "on_exception.ckpt").exists()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_options_of_the_units_recover_too(launch: Jobs, variant: str) -> None:
    """An exception in the backward under each option of :data:`VARIANTS`: the user's exception, and the resumed run
    ends as the same training without the exception (and, in fp32, as unsharded training)."""
    for error in launch.errors(f"fail-{variant}"):
        assert error["type"] == "UserError", error["traceback"][-3000:]
    resumed, straight = launch[f"resume-{variant}"], launch[f"straight-{variant}"]
    assert resumed["global_step"] == STEPS
    assert max_difference(resumed["state_dict"], straight["state_dict"]) < 1e-6
    if variant != "bf16":
        assert_adam_close(resumed["state_dict"], reference_training(STEPS, num_samples=8))
