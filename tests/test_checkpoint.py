"""Full checkpoints: standard Lightning files, exact resume (also on another number of processes), no fairscale needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from scenarios.common import build_network, max_difference

from conftest import TESTS, assert_loads_without_fairscale, run_script

Train = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four steps in one go (Adam + StepLR), with a ModelCheckpoint every epoch (one epoch is one step here)."""
    folder = tmp_path_factory.mktemp("straight")
    out = folder / "result.pt"
    args = ["--out", str(out), "--steps", "4", "--samples", "8", "--scheduler", "--checkpoint-dir", str(folder / "ck")]
    run_script([str(TESTS / "scenarios" / "train.py"), *args], cwd=folder)
    return {"result": torch.load(out, weights_only=False), "checkpoints": folder / "ck"}


@pytest.mark.parametrize("devices", [2, 1])
def test_resume_is_exact(train: Train, straight_run: dict[str, Any], devices: int) -> None:
    checkpoint = straight_run["checkpoints"] / "epoch=1-step=2.ckpt"
    resumed = train("--steps", "4", "--samples", "8", "--scheduler", "--ckpt-path", str(checkpoint), "--devices", str(devices))
    assert resumed["global_step"] == 4
    tolerance = 0.0 if devices == 2 else 1e-6  # one process sums the gradient in another order
    assert max_difference(resumed["state_dict"], straight_run["result"]["state_dict"]) <= tolerance


def test_checkpoint_is_a_standard_lightning_checkpoint(straight_run: dict[str, Any]) -> None:
    checkpoint = torch.load(straight_run["checkpoints"] / "epoch=1-step=2.ckpt", weights_only=False)
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


def test_checkpoint_matches_plain_ddp(train: Train, tmp_path: Path) -> None:
    """The same two steps under Lightning's DDP write the same model and optimizer state."""
    ours, theirs = tmp_path / "fsdp.ckpt", tmp_path / "ddp.ckpt"
    train("--steps", "2", "--samples", "8", "--save-ckpt", str(ours))
    train("--steps", "2", "--samples", "8", "--save-ckpt", str(theirs), "--strategy-name", "ddp")
    a, b = torch.load(ours, weights_only=False), torch.load(theirs, weights_only=False)
    assert max_difference(a["state_dict"], b["state_dict"]) < 1e-6
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[index][key], sb[index][key], atol=1e-6, rtol=0)


def test_checkpoint_loads_without_fairscale(train: Train, tmp_path: Path) -> None:
    path = tmp_path / "final.ckpt"
    result = train("--steps", "2", "--save-ckpt", str(path))
    assert_loads_without_fairscale(path, result["state_dict"], tmp_path)
