"""Optimizers that read whole tensors under DDPFullyShardedStrategy (Trainer and Fabric), each run against its
unsharded reference (``scenarios/whole_optimizers.py``); all in one launch of 2 processes (and one of 1 process for
the checkpoint a resharded resume loads).

Outside a unit's forward every parameter an optimizer holds is this rank's 1-D slice of a flat shard. Before the
whole path (``fsdp/state/whole_step.py``), measured with this scenario on the commit before it: Adafactor ended
6.5e-3 off the unsharded run after 4 steps (0.135 of the largest weight update, 4.8e-2), Trainer and Fabric, and
its resumes alike; the user's LARS 8.4e-4 off (0.018 of the update); Muon failed at its first step inside torch
(``ValueError: Param gradient must be a 2D matrix``); LBFGS failed at its first step
(``TypeError: LBFGS.step() missing 1 required positional argument: 'closure'``; the issue's run with a closure
trained nothing: its own ``_params`` list got no gradient). ``optimizer_path="elementwise"`` forces that old path:
``test_the_old_path_is_wrong`` checks that the comparison catches it.

Tolerance: FairScale refuses float64 parameters, so these runs are FP32, and Adafactor's and LARS's steps divide by
a norm of the gradient: the difference from the reference is compared with the size of the update (the largest
``|reference - initial|``), at :data:`RELATIVE` of it (the whole path ends 1e-5 of the update off or closer: the
summation order of the gradient's reduction: 3e-7 to 7.5e-6 of the update measured; the slices' path ends 0.135 of
the update off).

Muon's reference sums each gradient in the sharded run's order (``scenarios.whole_optimizers.ranks_backward``: each
rank's half of the batch, the two gradients added), so that on any CPU it gets the same bits, and ends 0.0 off. With
the full batch's gradient it did not hold on every CPU: ``torch.optim.Muon`` rounds its input to bfloat16, and each
gradient here has rank 8 at most (a batch of 8 rows; matrices of 16 to 64 columns): a rounding that moves one element
adds a direction of the null space, whose singular value its 5 Newton-Schulz steps multiply by up to
``3.4445**5`` (~490, their slope at zero). Under ``MKL_CBWR=COMPATIBLE`` the owner's whole gradient at step 1 was the
full batch's to 3.9e-7 of its largest element (same shape, layout and dtype: the summation order alone), which
rounded 1 of 2048 elements of the first Block's ``up.weight`` (2 of the second's) to the neighbouring bfloat16 and
moved the orthogonalised update by 0.050 (its largest element 0.31): 0.101 of the 4-step update at the end. The
unsharded training itself, under COMPATIBLE or ``ATEN_CPU_CAPABILITY=default``, ends 0.085 and 0.11 of the update
from the same training in this CPU's default order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from scenarios.common import max_difference
from scenarios.config import WholeOptimizers

from conftest import TESTS, Jobs, run_jobs

SCRIPT = TESTS / "scenarios" / "whole_optimizers.py"
#: The largest difference from the unsharded run, as a fraction of the update (see the module's docstring).
RELATIVE = 1e-3
#: The same under ``"bf16-mixed"``: the forward and backward run in bf16 (8 significant bits), and sharding sums each
#: gradient in another order (two half-batch means reduced in bf16), so a gradient differs by up to about 2**-8 of
#: itself, and Adafactor's normalised step carries that into each step's update: 1.4e-2 of the update measured after
#: 4 steps (6.6e-4), where the slices' path ends 0.135 off. (``"bf16-true"`` rounds the weights themselves to bf16:
#: the whole path ends one bf16 spacing of the largest weights off, 7.8e-3, the slices' path two: measured by hand,
#: not a test.)
RELATIVE_BF16 = 5e-2

W = WholeOptimizers
_TRAINER: dict[str, WholeOptimizers] = {
    "adafactor": W(),
    "adafactor-groups-frozen": W(groups=True, frozen=True),
    "adafactor-clip-accumulate": W(clip=0.05, accumulate=2),
    "adafactor-manual": W(manual=True, clip=0.05),
    "adafactor-validate-fit": W(stages="validate-fit"),
    "adafactor-fit-fit": W(stages="fit-fit"),
    "muon": W(optimizer="muon"),
    "lars": W(optimizer="lars"),
    "lars-groups": W(optimizer="lars", groups=True),
    "adam": W(optimizer="adam"),
    "adafactor-resume-full": W(save_at=2),
    "adafactor-resume-sharded": W(save_at=2, state_dict_type="sharded"),
    "adafactor-bf16-mixed": W(precision="bf16-mixed"),
}
_FABRIC: dict[str, WholeOptimizers] = {
    "adafactor": W(front="fabric"),
    "adafactor-clip-accumulate": W(front="fabric", clip=0.05, accumulate=2, groups=True),
    "muon": W(front="fabric", optimizer="muon"),
    "lars": W(front="fabric", optimizer="lars"),
    "adafactor-resume-full": W(front="fabric", save_at=2),
    "adafactor-resume-sharded": W(front="fabric", save_at=2, state_dict_type="sharded"),
    "muon-resume-sharded": W(front="fabric", optimizer="muon", save_at=2, state_dict_type="sharded"),
}
JOBS: dict[str, WholeOptimizers] = {
    **{f"trainer-{name}": config for name, config in _TRAINER.items()},
    **{f"fabric-{name}": config for name, config in _FABRIC.items()},
    "trainer-adafactor-elementwise": W(optimizer_path="elementwise"),
    # Lightning's resume from an epoch's end is compared with the same resume under Lightning's unsharded DDP.
    "trainer-adafactor-resume-ddp": W(save_at=2, strategy="ddp"),
    "trainer-lbfgs": W(optimizer="lbfgs"),
    "fabric-lars-raises": W(front="fabric", optimizer="lars-raises"),
}
FAILING = ["trainer-lbfgs", "fabric-lars-raises"]
#: The path each job's optimizers step on.
PATHS = {name: ["whole", "elementwise"] if config.optimizer == "muon" else
         ["elementwise"] if config.optimizer == "adam" or config.optimizer_path == "elementwise" else ["whole"]
         for name, config in JOBS.items() if config.strategy == "fsdp" and name not in FAILING}
#: The runs compared with their own reference, and the Trainer's resumes with the DDP resume.
COMPARED = {name: "trainer-adafactor-resume-ddp" if name.startswith("trainer-") and "resume" in name else name
            for name in PATHS if not name.endswith("-elementwise")}
COMPARED["fabric-adafactor-resharded"] = "fabric-adafactor-resharded"


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    folder: Path = tmp_path_factory.mktemp("whole")
    # A sharded checkpoint saved by 1 process at step 2, resumed by 2 (`fabric-adafactor-resharded`).
    saved = folder / "one"
    one = {"fabric-save-one": W(front="fabric", devices=1, steps=2, save_at=2, state_dict_type="sharded",
                                save_dir=str(saved))}
    run_jobs(folder / "one-launch", one, script=SCRIPT, timeout=300)
    jobs = {name: config.replace(save_dir=str(folder / name)) for name, config in JOBS.items()}
    jobs["fabric-adafactor-resharded"] = W(front="fabric", save_at=2, load_from=str(saved / "whole-sharded.ckpt"),
                                           save_dir=str(folder / "resharded"))
    return run_jobs(folder / "launch", jobs, failing=FAILING, script=SCRIPT, timeout=900)


def relative_difference(result: dict[str, Any], expected: dict[str, Any], initial: dict[str, Any]) -> float:
    update = max_difference(expected, initial)
    assert update > 1e-3, f"the reference hardly trained ({update:.3g}): nothing to compare"
    return max_difference(result, expected) / update


@pytest.mark.parametrize("name", list(COMPARED))
def test_matches_unsharded(whole: Jobs, name: str) -> None:
    result = whole[name]
    other = COMPARED[name]
    expected = whole[other]["final"] if other != name else result["reference"]
    difference = relative_difference(result["final"], expected, result["initial"])
    tolerance = RELATIVE_BF16 if JOBS.get(name, W()).precision == "bf16-mixed" else RELATIVE
    assert difference < tolerance, f"{name}: {difference:.3g} of the update off unsharded training"


@pytest.mark.parametrize("name", list(PATHS))
def test_each_optimizer_takes_its_path(whole: Jobs, name: str) -> None:
    assert whole[name]["paths"] == PATHS[name]


def test_the_old_path_is_wrong(whole: Jobs) -> None:
    """Adafactor on this rank's slices (the path of every optimizer before the whole path, forced here): far off,
    so the comparison above would catch a whole path that silently stepped slices."""
    result = whole["trainer-adafactor-elementwise"]
    assert relative_difference(result["final"], result["reference"], result["initial"]) > 0.05


def test_lbfgs_is_refused_before_the_first_step(whole: Jobs) -> None:
    for error in whole.errors("trainer-lbfgs"):
        assert error["type"] == "ValueError", error["traceback"][-3000:]
        message = error["message"]
        assert "LBFGS" in message and "whole parameter vector" in message and 'strategy="ddp"' in message
        assert "configure_optimizers" in error["traceback"] or "setup" in error["traceback"]
        assert "training_step" not in error["traceback"]


@pytest.mark.parametrize("name", [n for n, c in JOBS.items() if c.front == "fabric" and c.save_at is not None])
def test_checkpoints_hold_the_plain_optimizers_state(whole: Jobs, name: str) -> None:
    """The optimizer state a checkpoint holds (a full file; a sharded one consolidated offline) is the state dict of
    the same optimizer over the unsharded model at the same step: whole-shaped, in the user's order."""
    result = whole[name]
    saved, expected = result["checkpoint_states"], result["reference_states"]
    assert len(saved) == len(expected) > 0
    for got, want in zip(saved, expected):
        assert sorted(got["state"]) == sorted(want["state"])
        assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
        for index, state in want["state"].items():
            assert sorted(got["state"][index]) == sorted(state), index
            for key, value in state.items():
                value, other = torch.as_tensor(value).float(), torch.as_tensor(got["state"][index][key]).float()
                assert other.shape == value.shape, (index, key)
                assert torch.allclose(other, value, rtol=1e-4, atol=1e-7), (index, key)


def test_a_step_that_raises_on_its_owner_fails_every_rank_without_waiting(whole: Jobs) -> None:
    """The user's step raises on the rank that owns the last layer's weight only; the other rank, waiting for that
    rank's updated slices, is told and raises too (the launch would otherwise wait until the group's timeout)."""
    errors = whole.errors("fabric-lars-raises")
    users = [e for e in errors if e["type"] == "ValueError"]
    told = [e for e in errors if e["type"] == "RuntimeError"]
    assert len(users) == 1 and "refused the 4x32 weight" in users[0]["message"], errors
    assert len(told) == 1 and "The optimizer step failed on rank" in told[0]["message"], errors
