"""Sharded checkpoints: one file per rank, exact resume, offline consolidation, and nothing lost when a save dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from scenarios.common import max_difference, reference_training

from conftest import TRAIN_SCRIPT, assert_loads_without_fairscale, run_script
from lightning_fairscale.checkpoint_io import META_FILE, ShardedCheckpointIO, shard_file_name

Train = Callable[..., dict[str, Any]]
TrainFailing = Callable[..., Any]
STEPS = ("--steps", "4", "--samples", "8", "--scheduler")  # one step per epoch: every epoch end is a clean resume point


def _straight(folder: Path, state_dict_type: str) -> dict[str, Any]:
    out = folder / "result.pt"
    args = ["--out", str(out), *STEPS, "--checkpoint-dir", str(folder / "ck"), "--state-dict-type", state_dict_type]
    run_script([str(TRAIN_SCRIPT), *args], cwd=folder)
    return {"result": torch.load(out, weights_only=False), "checkpoints": folder / "ck"}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _straight(tmp_path_factory.mktemp("sharded"), "sharded")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _straight(tmp_path_factory.mktemp("full"), "full")


def consolidate(source: Path, target: Path, how: str = "script") -> str:
    if how == "script":
        command = [str(Path(sys.executable).parent / "lightning-fairscale-consolidate"), str(source), str(target)]
    else:
        command = [sys.executable, "-m", "lightning_fairscale.consolidate", str(source), str(target)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_each_rank_writes_its_own_shard(sharded_run: dict[str, Any], full_run: dict[str, Any]) -> None:
    directory = sharded_run["checkpoints"] / "epoch=1-step=2.ckpt"
    assert sorted(p.name for p in directory.iterdir()) == [META_FILE, shard_file_name(0, 2), shard_file_name(1, 2)]
    full = torch.load(full_run["checkpoints"] / "epoch=1-step=2.ckpt", weights_only=False)
    full_numel = sum(t.numel() for t in full["state_dict"].values())
    for rank in range(2):
        shard = torch.load(directory / shard_file_name(rank, 2), weights_only=True)
        local = sum(t.numel() for t in shard["state_dict"].values())
        assert local <= full_numel / 2 + 8  # half the model (plus padding): no rank held the full model
        assert all("_fsdp_wrapped_module" not in k for k in shard["state_dict"])
    meta = torch.load(directory / META_FILE, weights_only=False)
    assert "state_dict" not in meta and meta["global_step"] == 2 and meta["lightning_fairscale"]["world_size"] == 2
    # Saving sharded changes nothing in training itself.
    assert max_difference(sharded_run["result"]["state_dict"], full_run["result"]["state_dict"]) == 0.0


def test_resume_from_sharded_checkpoint_is_exact(train: Train, sharded_run: dict[str, Any]) -> None:
    directory = sharded_run["checkpoints"] / "epoch=1-step=2.ckpt"
    resumed = train(*STEPS, "--ckpt-path", str(directory), "--state-dict-type", "sharded")
    assert resumed["global_step"] == 4
    assert max_difference(resumed["state_dict"], sharded_run["result"]["state_dict"]) == 0.0


@pytest.mark.parametrize("how", ["script", "module"])
def test_consolidated_checkpoint_equals_the_full_one(
    sharded_run: dict[str, Any], full_run: dict[str, Any], tmp_path: Path, how: str
) -> None:
    target = tmp_path / "consolidated.ckpt"
    output = consolidate(sharded_run["checkpoints"] / "epoch=1-step=2.ckpt", target, how)
    assert "reading shard 2/2" in output and "done" in output  # progress is printed
    ours = torch.load(target, weights_only=False)
    full = torch.load(full_run["checkpoints"] / "epoch=1-step=2.ckpt", weights_only=False)
    assert ours.keys() == full.keys()
    _assert_same_checkpoint(ours, full)
    assert ours["hyper_parameters"] == full["hyper_parameters"]


def test_consolidated_checkpoint_loads_without_fairscale(sharded_run: dict[str, Any], tmp_path: Path) -> None:
    target = tmp_path / "consolidated.ckpt"
    consolidate(sharded_run["checkpoints"] / "epoch=1-step=2.ckpt", target)
    expected = torch.load(target, weights_only=False)["state_dict"]
    assert_loads_without_fairscale(target, expected, tmp_path)


def test_consolidated_checkpoint_resumes_on_one_process(
    train: Train, sharded_run: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "consolidated.ckpt"
    consolidate(sharded_run["checkpoints"] / "epoch=1-step=2.ckpt", target)
    resumed = train(*STEPS, "--ckpt-path", str(target), "--devices", "1")
    assert resumed["global_step"] == 4
    assert max_difference(resumed["state_dict"], sharded_run["result"]["state_dict"]) < 1e-6


def test_another_wrapping_names_the_consolidation_command(
    train_failing: TrainFailing, sharded_run: dict[str, Any]
) -> None:
    directory = sharded_run["checkpoints"] / "epoch=1-step=2.ckpt"
    proc = train_failing(*STEPS, "--ckpt-path", str(directory), "--policy", "blocks", "--devices", "1")
    assert "wrapped differently" in proc.stderr
    assert "lightning-fairscale-consolidate" in proc.stderr


def _assert_same_checkpoint(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Parameters, optimizer state and trainer state equal, bit for bit."""
    assert set(ours["state_dict"]) == set(theirs["state_dict"])
    for key, value in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    (a,), (b,) = ours["optimizer_states"], theirs["optimizer_states"]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for index, state in b["state"].items():
        assert state.keys() == a["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(a["state"][index][key]), torch.as_tensor(value)), (index, key)
    for key in ("epoch", "global_step", "loops", "lr_schedulers"):
        assert ours[key] == theirs[key], key


@pytest.mark.parametrize("devices", [1, 2])
def test_resharding_resume_is_exact(train: Train, sharded_run: dict[str, Any], tmp_path: Path, devices: int) -> None:
    """Saved by 2 processes, resumed on ``devices`` and saved again there, then resumed on the other number and
    saved again: each hop consolidates to exactly what the original consolidates to (2 -> 1 -> 2, 2 -> 2 -> 1)."""
    source = sharded_run["checkpoints"] / "epoch=1-step=2.ckpt"
    no_more_steps = ("--steps", "2", "--samples", "8", "--scheduler", "--state-dict-type", "sharded")
    hop = tmp_path / "hop.ckpt"
    train(*no_more_steps, "--ckpt-path", str(source), "--devices", str(devices), "--save-ckpt", str(hop))
    assert sorted(p.name for p in hop.iterdir()) == [META_FILE, *(shard_file_name(r, devices) for r in range(devices))]
    back = tmp_path / "back.ckpt"
    train(*no_more_steps, "--ckpt-path", str(hop), "--devices", str(3 - devices), "--save-ckpt", str(back))
    consolidate(source, tmp_path / "source.full")
    expected = torch.load(tmp_path / "source.full", weights_only=False)
    for saved in (hop, back):
        consolidate(saved, tmp_path / f"{saved.stem}.full")
        _assert_same_checkpoint(torch.load(tmp_path / f"{saved.stem}.full", weights_only=False), expected)
    # Training goes on from the resharded state as the unsharded reference does.
    continued = train(*STEPS, "--ckpt-path", str(source), "--devices", str(devices), "--state-dict-type", "sharded")
    assert continued["global_step"] == 4
    reference = reference_training(4, scheduler=True, num_samples=8)
    assert max_difference(continued["state_dict"], reference) < 1e-5


def test_save_top_k_removes_old_checkpoint_directories(train: Train, tmp_path: Path) -> None:
    train(*STEPS, "--checkpoint-dir", str(tmp_path / "ck"), "--save-top-k", "2", "--state-dict-type", "sharded")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=2-step=3.ckpt", "epoch=3-step=4.ckpt"]


@pytest.mark.parametrize(
    ("state_dict_type", "rank", "nth"),
    [("full", 0, 2), ("sharded", 1, 2), ("sharded", 0, 3), ("sharded", 0, 4)],
    # Rank 0 writes its shard, then meta.pt, for each sharded checkpoint: 3 is its second shard, 4 the second meta.pt.
    ids=["full-rank0", "sharded-rank1-shard", "sharded-rank0-shard", "sharded-rank0-meta"],
)
def test_killed_save_keeps_the_previous_checkpoint(
    train: Train, train_failing: TrainFailing, tmp_path: Path, state_dict_type: str, rank: int, nth: int
) -> None:
    """A rank is SIGKILLed halfway through a file of the second last.ckpt: the first stays whole and resumes exactly."""
    folder = tmp_path / "ck"
    common = ("--checkpoint-dir", str(folder), "--save-last", "--state-dict-type", state_dict_type)
    proc = train_failing(*STEPS, *common, "--kill-during-save", str(nth), "--kill-rank", str(rank), "--timeout", "60")
    assert proc.returncode != 0
    last = folder / "last.ckpt"
    meta = torch.load(last / META_FILE if last.is_dir() else last, weights_only=False)
    assert meta["global_step"] == 1  # the checkpoint written before the killed one, untouched
    assert [p.name for p in folder.iterdir() if not p.name.startswith(".")] == ["last.ckpt"]
    resumed = train(*STEPS, "--ckpt-path", str(last), "--state-dict-type", state_dict_type)
    straight = train(*STEPS)
    assert max_difference(resumed["state_dict"], straight["state_dict"]) == 0.0


@pytest.mark.parametrize(
    ("state_dict_type", "rank", "expected"),
    [("full", 0, "No space left on device"), ("sharded", 1, "Another process failed to write the sharded checkpoint")],
    ids=["full-rank0", "sharded-rank1"],
)
def test_a_failed_write_fails_every_rank_and_keeps_the_previous_checkpoint(
    train_failing: TrainFailing, tmp_path: Path, state_dict_type: str, rank: int, expected: str
) -> None:
    """The disk fills up while a rank writes the second last.ckpt."""
    folder = tmp_path / "ck"
    common = ("--checkpoint-dir", str(folder), "--save-last", "--state-dict-type", state_dict_type)
    proc = train_failing(
        *STEPS, *common, "--kill-during-save", "2", "--kill-rank", str(rank), "--kill-how", "enospc", "--timeout", "30"
    )
    assert expected in proc.stderr, proc.stderr[-4000:]
    last = folder / "last.ckpt"
    meta = torch.load(last / META_FILE if last.is_dir() else last, weights_only=False)
    assert meta["global_step"] == 1


# ------------------------------------------------------------------------------------------------------------------
# The file layer on its own (one process)


def test_an_unfinished_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.begin_sharded(target)
    io.save_shard({"state_dict": {}}, target, 0, 2)  # rank 1 never wrote: the save must not complete
    with pytest.raises(RuntimeError, match="were not written"):
        io.commit_sharded({"global_step": 1}, target, 2)
    assert not target.exists()
    io.abort_sharded(target)
    assert list(tmp_path.iterdir()) == []


def test_a_crash_between_the_renames_finds_the_previous_checkpoint(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.begin_sharded(target)
    io.save_shard({"state_dict": {"w": torch.ones(1)}}, target, 0, 1)
    io.commit_sharded({"global_step": 1}, target, 1)
    target.rename(tmp_path / ".last.ckpt.replaced")  # what the next save does first
    assert io.load_checkpoint(target)["global_step"] == 1
    assert torch.equal(io.load_shard(target, 0, 1)["state_dict"]["w"], torch.ones(1))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_file_gets_an_error_naming_it(tmp_path: Path, damage: str) -> None:
    io = ShardedCheckpointIO()
    path = tmp_path / "model.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}}, path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"not a checkpoint" * 10, "empty": b""}[damage])
    with pytest.raises(RuntimeError, match="model.ckpt.*truncated, corrupt or not a PyTorch checkpoint"):
        io.load_checkpoint(path)


def test_remove_checkpoint_removes_files_and_directories(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    io.save_checkpoint({"x": 1}, tmp_path / "a.ckpt")
    io.begin_sharded(tmp_path / "b.ckpt")
    io.save_shard({}, tmp_path / "b.ckpt", 0, 1)
    io.commit_sharded({}, tmp_path / "b.ckpt", 1)
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "variant",
    [("--flatten", "0"), ("--model", "manual", "--optimizer", "sgd"), ("--precision", "bf16-mixed")],
    ids=["unflattened", "manual-wrap-aliases", "bf16-mixed"],
)
def test_consolidation_matches_full_checkpoints_of_other_setups(
    train: Train, tmp_path: Path, variant: tuple[str, ...]
) -> None:
    steps = ("--steps", "2", "--samples", "8")
    train(*steps, *variant, "--checkpoint-dir", str(tmp_path / "full"))
    train(*steps, *variant, "--checkpoint-dir", str(tmp_path / "sharded"), "--state-dict-type", "sharded")
    consolidate(tmp_path / "sharded" / "epoch=1-step=2.ckpt", tmp_path / "consolidated.ckpt")
    ours = torch.load(tmp_path / "consolidated.ckpt", weights_only=False)
    full = torch.load(tmp_path / "full" / "epoch=1-step=2.ckpt", weights_only=False)
    assert set(ours["state_dict"]) == set(full["state_dict"])
    assert max_difference(ours["state_dict"], full["state_dict"]) == 0.0
    (a,), (b,) = ours["optimizer_states"], full["optimizer_states"]
    assert a["param_groups"] == b["param_groups"]
    for index, state in b["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(a["state"][index][key]), torch.as_tensor(value)), (index, key)
