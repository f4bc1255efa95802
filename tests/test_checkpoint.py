"""Full checkpoints: standard Lightning files, exact resume (also on another number of processes), no fairscale needed.

The trainings of this module share two launches (``conftest.run_jobs``): :func:`two_processes` (the straight run,
its resume, the FSDP/DDP comparison and the file loaded without FairScale) and :func:`one_process` (the resume on
one process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scenarios.common import assert_adam_close, build_network, max_difference, reference_training
from scenarios.config import Scenario

from conftest import (
    PARTIAL,
    Jobs,
    assert_loads_without_fairscale,
    assert_partial_resume,
    assert_strict_refusal,
    partial_jobs,
    run_jobs,
)

STEPS = Scenario(steps=4, samples=8, scheduler=True)  # Adam + StepLR, one step per epoch
CHECKPOINT = "epoch=1-step=2.ckpt"  # the straight run's checkpoint that the resumes start from


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoint")


def no_optimizer_state_jobs(folder: Path, kind: str) -> dict[str, Scenario]:
    path = str(folder / f"validated-{kind}")
    return {
        f"validated-{kind}": Scenario(validate_only=True, state_dict_type=kind, save_ckpt=path),
        f"no-optimizer-state-{kind}": Scenario(steps=2, samples=8, state_dict_type=kind, ckpt_path=path),
    }


@pytest.fixture(scope="module")
def two_processes(folder: Path) -> Jobs:
    """The straight run: four steps in one go, with a ModelCheckpoint every epoch (one epoch is one step here); then
    its resume from step 2, two steps saved by FSDP and by Lightning's DDP, and the file for the fairscale-free load."""
    jobs = {
        "straight": STEPS.replace(checkpoint_dir=str(folder / "ck")),
        "resumed-2": STEPS.replace(ckpt_path=str(folder / "ck" / CHECKPOINT), devices=2),
        "fsdp": Scenario(steps=2, samples=8, save_ckpt=str(folder / "fsdp.ckpt")),
        "ddp": Scenario(steps=2, samples=8, save_ckpt=str(folder / "ddp.ckpt"), strategy_name="ddp"),
        "final": Scenario(steps=2, save_ckpt=str(folder / "final.ckpt")),
        **partial_jobs(folder / "partial-source.ckpt", "full"),
        # Lightning's strict loading, as its DDP has it, under the sharded optimizer strategy.
        "partial-ddp_sharded": PARTIAL.replace(ckpt_path=str(folder / "partial-source.ckpt"), strict_loading=False,
                                               strategy_name="ddp_sharded"),
        # Issue 48 item 2: stages of new modules after `fit` (test and validate from the best checkpoint, fit again).
        **{
            f"new-modules-{kind}": Scenario(
                new_modules=True, checkpoint_dir=str(folder / f"new-modules-{kind}"), state_dict_type=kind
            )
            for kind in ("full", "sharded")
        },
        # Saved after `validate` only, so with no optimizer state, in both formats; then resumed.
        **{
            job: config for kind in ("full", "sharded") for job, config in no_optimizer_state_jobs(folder, kind).items()
        },
    }
    return run_jobs(folder / "two_processes", jobs, failing=["partial-full-strict"])


@pytest.fixture(scope="module")
def one_process(two_processes: Jobs, folder: Path) -> Jobs:
    jobs = {"resumed-1": STEPS.replace(ckpt_path=str(folder / "ck" / CHECKPOINT), devices=1)}
    return run_jobs(folder / "one_process", jobs)


@pytest.mark.parametrize("devices", [2, 1])
def test_resume_is_exact(request: pytest.FixtureRequest, two_processes: Jobs, devices: int) -> None:
    launch = two_processes if devices == 2 else request.getfixturevalue("one_process")
    resumed = launch[f"resumed-{devices}"]
    assert resumed["global_step"] == 4
    if devices == 2:
        assert max_difference(resumed["state_dict"], two_processes["straight"]["state_dict"]) == 0.0
    else:  # one process sums the gradient in another order: Adam's update relative to its size (ADAM_RTOL)
        assert_adam_close(resumed["state_dict"], two_processes["straight"]["state_dict"])


def test_checkpoint_is_a_standard_lightning_checkpoint(two_processes: Jobs, folder: Path) -> None:
    checkpoint = torch.load(folder / "ck" / CHECKPOINT, weights_only=False)
    plain = {"net." + k: v for k, v in build_network().state_dict().items()}
    assert {k: v.shape for k, v in checkpoint["state_dict"].items()} == {k: v.shape for k, v in plain.items()}
    (optimizer,) = checkpoint["optimizer_states"]
    assert optimizer["param_groups"][0]["params"] == list(range(len(plain)))
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(0.01 * 0.7**2)
    shapes = [v.shape for v in plain.values()]
    for index, shape in enumerate(shapes):
        state = optimizer["state"][index]
        assert state["exp_avg"].shape == shape and state["exp_avg_sq"].shape == shape
        assert float(state["step"]) == 2.0


def test_checkpoint_matches_plain_ddp(two_processes: Jobs, folder: Path) -> None:
    """The same two steps under Lightning's DDP write the same model and optimizer state."""
    assert two_processes["fsdp"]["strategy"] == "DDPFullyShardedStrategy"
    assert two_processes["ddp"]["strategy"] == "DDPStrategy"
    a = torch.load(folder / "fsdp.ckpt", weights_only=False)
    b = torch.load(folder / "ddp.ckpt", weights_only=False)
    assert_adam_close(a["state_dict"], b["state_dict"])  # Adam's update: relative to its size (ADAM_RTOL)
    # Adam's moments are sums of the gradients and of their squares: not amplified, within 1e-6.
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[index][key], sb[index][key], atol=1e-6, rtol=0)


def test_checkpoint_loads_without_fairscale(two_processes: Jobs, folder: Path, tmp_path: Path) -> None:
    assert_loads_without_fairscale(folder / "final.ckpt", two_processes["final"]["state_dict"], tmp_path)


def test_a_changed_model_resumes_partially_from_a_full_checkpoint(two_processes: Jobs) -> None:
    """`strict_loading = False`: a model with a layer more and one less resumes from the old model's full checkpoint."""
    source = two_processes["partial-source-full"]
    assert_partial_resume(two_processes["partial-full"], source, warned=two_processes.output("partial-full"))
    assert_strict_refusal(two_processes.errors("partial-full-strict"))


def test_sharded_ddp_honours_strict_loading_as_lightnings_ddp(two_processes: Jobs) -> None:
    """Lightning's own `load_state_dict(..., strict=strict_loading)`: what fits loads, silently (as under DDP)."""
    resumed = two_processes["partial-ddp_sharded"]
    assert resumed["strategy"] == "DDPShardedStrategy"
    assert_partial_resume(resumed, two_processes["partial-source-full"], warned=None)


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_checkpoint_without_optimizer_state_resumes_with_a_fresh_one(two_processes: Jobs, kind: str) -> None:
    """``trainer.save_checkpoint`` after ``validate`` only (no optimizer exists) holds no optimizer state: resuming
    it trains on from its weights with a fresh optimizer state and a warning, where it was refused with an error."""
    resumed = two_processes[f"no-optimizer-state-{kind}"]
    assert resumed["global_step"] == 2
    assert_adam_close(resumed["state_dict"], reference_training(2, "adam", num_samples=8))
    if kind == "full":  # the first of the two: Python shows a warning once per process
        assert "holds no optimizer state" in two_processes.output(f"no-optimizer-state-{kind}")


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_new_modules_after_fit_get_none_of_its_optimizers(two_processes: Jobs, kind: str) -> None:
    """Issue 48 item 2: after `fit(model)`, `test(NewModule(), ckpt_path="best")` and `validate(NewModule(),
    ckpt_path=best)` give the best checkpoint's loss computed unsharded, and `fit(NewModule())` trains the new module
    from its own weights with its own, fresh optimizer: one epoch of it is unsharded training's first epoch."""
    result = two_processes[f"new-modules-{kind}"]
    best = result["best"]
    assert Path(best).name.startswith("epoch=") and (Path(best).is_dir() == (kind == "sharded"))
    expected = result["best_loss_unsharded"]
    assert abs(result["test_new"][0]["test_loss"] - expected) < 1e-6
    assert abs(result["validate_new"][0]["val_loss"] - expected) < 1e-6
    assert result["refit_steps"] == 6
    assert_adam_close(result["state_dict"], reference_training(2))
