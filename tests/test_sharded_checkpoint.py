"""Sharded checkpoints: one file per rank, exact resume, offline consolidation, and nothing lost when a save dies.

The trainings of this module share launches (``conftest.run_jobs``), one per number of processes, in the order their
checkpoints need: :func:`first` (2 processes: the straight runs, the first resume, the other setups, the first
resharding hop), :func:`one_process` (1 process: what loads the source checkpoint or a 2-process hop on one process)
and :func:`last` (2 processes: the hop back from one process, and the resumes of the killed saves with the straight
run they are compared with). A killed or write-failing save keeps a launch of its own through Lightning's launcher,
whose rank 0 is what notices a lost child.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from scenarios.common import assert_adam_close, max_difference, reference_training
from scenarios.config import Kill, Scenario

from conftest import (
    PARTIAL,
    Jobs,
    assert_loads_without_fairscale,
    assert_partial_resume,
    assert_strict_refusal,
    command,
    partial_jobs,
    run_jobs,
    run_script,
)
from lightning_fairscale.checkpoint.files import ShardedStorage
from lightning_fairscale import consolidate as consolidate_tool
from lightning_fairscale.plugins.checkpoint_io import META_FILE, ShardedCheckpointIO, shard_file_name

STEPS = Scenario(steps=4, samples=8, scheduler=True)  # one step per epoch: every epoch end is a clean resume point
SOURCE = "epoch=1-step=2.ckpt"  # the checkpoint of the straight runs that the other runs load
# Resumes at step 2 and stops there: the hop only loads and saves again.
NO_MORE_STEPS = Scenario(steps=2, samples=8, scheduler=True, state_dict_type="sharded")
SETUPS = {  # name -> the scenario's fields
    "unflattened": {"flatten": False},
    "manual-wrap-aliases": {"model": "manual", "optimizer": "sgd"},
    "bf16-mixed": {"precision": "bf16-mixed"},
}
#: The recipe of a modern fine-tuning script: AdamW with decay on weights and none on biases (two param groups that
#: split every FSDP unit), the first layer's and a block's weights frozen inside units that also train, clipping.
FROZEN = ("net.0.weight", "net.1.up.weight")
RECIPE = STEPS.replace(optimizer="adamw", params="split", freeze=FROZEN, clip=(0.05, "norm"))
# Rank 0 writes its shard, then meta.pt, for each sharded checkpoint: 3 is its second shard, 4 the second meta.pt.
KILLS = {
    "full-rank0": ("full", 0, 2),
    "sharded-rank1-shard": ("sharded", 1, 2),
    "sharded-rank0-shard": ("sharded", 0, 3),
    "sharded-rank0-meta": ("sharded", 0, 4),
}

#: Where these tests keep sharded checkpoints (what `ShardedCheckpointIO().sharded_storage()` gives).
STORAGE = ShardedStorage()



@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded_checkpoint")


@pytest.fixture(scope="module")
def first(folder: Path) -> Jobs:
    """2 processes: the straight runs (sharded and full), then what starts from them or needs nothing else."""
    source = str(folder / "ck-sharded" / SOURCE)
    jobs = {
        "sharded": STEPS.replace(checkpoint_dir=str(folder / "ck-sharded"), state_dict_type="sharded"),
        "full": STEPS.replace(checkpoint_dir=str(folder / "ck-full"), state_dict_type="full"),
        # Also the resharding test's run that goes on from the source on 2 processes: the same scenario.
        "resumed": STEPS.replace(ckpt_path=source, state_dict_type="sharded"),
        "hop-2": NO_MORE_STEPS.replace(ckpt_path=source, devices=2, save_ckpt=str(folder / "hop-2.ckpt")),
        "save-top-k": STEPS.replace(checkpoint_dir=str(folder / "ck-top-k"), save_top_k=2, state_dict_type="sharded"),
    }
    for kind in ("full", "sharded"):  # the recipe: straight, then resumed at step 2 (the next jobs of this launch)
        jobs[f"recipe-{kind}"] = RECIPE.replace(checkpoint_dir=str(folder / f"recipe-{kind}"), state_dict_type=kind)
    for kind in ("full", "sharded"):
        jobs[f"recipe-resumed-{kind}"] = RECIPE.replace(ckpt_path=str(folder / f"recipe-{kind}" / SOURCE))
    # Strict loading off: a changed model resumes from the old one's sharded checkpoint (saved here on 2 processes).
    jobs.update(partial_jobs(folder / "partial-source.ckpt", "sharded"))
    for name, variant in SETUPS.items():
        for kind in ("full", "sharded"):
            directory = str(folder / f"setup-{name}-{kind}")
            jobs[f"setup-{name}-{kind}"] = Scenario(steps=2, samples=8, **variant, checkpoint_dir=directory,
                                                    state_dict_type=kind)
    return run_jobs(folder / "first", jobs, failing=["partial-sharded-strict"])


@pytest.fixture(scope="module")
def source(first: Jobs, folder: Path) -> Path:
    """The sharded checkpoint at step 2 (2 processes), which the other runs load."""
    return folder / "ck-sharded" / SOURCE


@pytest.fixture(scope="module")
def consolidated(source: Path, folder: Path) -> dict[str, Any]:
    """The source consolidated once, with the command-line tool: its output and the file."""
    target = folder / "consolidated.ckpt"
    return {"output": consolidate(source, target, "script"), "path": target}


@pytest.fixture(scope="module")
def one_process(source: Path, consolidated: dict[str, Any], folder: Path) -> Jobs:
    """1 process: the consolidated checkpoint, the source and the 2-process hop loaded on one process."""
    source_path = str(source)
    jobs = {
        "consolidated-resumed": STEPS.replace(ckpt_path=str(consolidated["path"]), devices=1),
        "hop-1": NO_MORE_STEPS.replace(ckpt_path=source_path, devices=1, save_ckpt=str(folder / "hop-1.ckpt")),
        "back-2": NO_MORE_STEPS.replace(ckpt_path=str(folder / "hop-2.ckpt"), devices=1,
                                        save_ckpt=str(folder / "back-2.ckpt")),
        "continued-1": STEPS.replace(ckpt_path=source_path, devices=1, state_dict_type="sharded"),
        "another-wrapping": STEPS.replace(ckpt_path=source_path, policy="blocks", devices=1),
        "recipe-resumed-1": RECIPE.replace(ckpt_path=str(folder / "recipe-sharded" / SOURCE), devices=1),
        "partial-resharded": PARTIAL.replace(ckpt_path=str(folder / "partial-source.ckpt"), strict_loading=False,
                                             devices=1),
    }  # fmt: skip
    return run_jobs(folder / "one_process", jobs, failing=["another-wrapping"])


def _killed_save(folder: Path, state_dict_type: str, kill: Kill, timeout: float) -> Scenario:
    """The straight run with a ``last.ckpt`` in ``folder``, whose save ``kill`` interrupts."""
    return STEPS.replace(checkpoint_dir=str(folder), save_last=True, state_dict_type=state_dict_type, kill=kill,
                         timeout=timeout)


#: A disk that fills up while a rank writes the second last.ckpt: the checkpoint type, the rank, the error expected.
FULL_DISKS = {
    "full-rank0": ("full", 0, "No space left on device"),
    "sharded-rank1": ("sharded", 1, "Another process failed to write the sharded checkpoint"),
}


@pytest.fixture(scope="module")
def interrupted(folder: Path) -> dict[str, subprocess.CompletedProcess]:
    """The saves of the second last.ckpt that fail: a rank SIGKILLed halfway through a file (:data:`KILLS`), a full
    disk (:data:`FULL_DISKS`, ``full-...``). One launch each (Lightning's launcher), two at a time (a launch waits for
    its second rank's start-up)."""
    saves = {name: (kind, Kill(nth, rank)) for name, (kind, rank, nth) in KILLS.items()}
    saves.update({f"full-{name}": (kind, Kill(2, rank, how="enospc")) for name, (kind, rank, _) in FULL_DISKS.items()})

    def launch(name: str) -> subprocess.CompletedProcess:
        state_dict_type, kill = saves[name]
        workdir = folder / f"killed-{name}"
        workdir.mkdir()
        config = _killed_save(workdir / "ck", state_dict_type, kill, timeout=60)
        return run_script(command(config, workdir / "unused.pt"), cwd=workdir, expect_ok=False)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(saves, pool.map(launch, saves)))


@pytest.fixture(scope="module")
def last(one_process: Jobs, interrupted: dict[str, subprocess.CompletedProcess], folder: Path) -> Jobs:
    """2 processes: the hop back from one process, the straight run, and the resumes of the killed saves."""
    jobs = {
        "back-1": NO_MORE_STEPS.replace(ckpt_path=str(folder / "hop-1.ckpt"), devices=2,
                                        save_ckpt=str(folder / "back-1.ckpt")),
        "straight": STEPS,
    }
    for name, (state_dict_type, _, _) in KILLS.items():
        checkpoint = folder / f"killed-{name}" / "ck" / "last.ckpt"
        if checkpoint.exists():  # otherwise the test fails on the checkpoint, and the other tests go on
            jobs[f"resumed-{name}"] = STEPS.replace(ckpt_path=str(checkpoint), state_dict_type=state_dict_type)
    return run_jobs(folder / "last", jobs)


def consolidate(source: Path, target: Path, how: str = "in-process") -> str:
    """Consolidate with the installed script, ``python -m`` or (the same code, without starting Python) in-process."""
    if how == "in-process":
        assert consolidate_tool.main([str(source), str(target)]) == 0
        return ""
    if how == "script":
        command = [str(Path(sys.executable).parent / "lightning-fairscale-consolidate"), str(source), str(target)]
    else:
        command = [sys.executable, "-m", "lightning_fairscale.consolidate", str(source), str(target)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_each_rank_writes_its_own_shard(first: Jobs, folder: Path) -> None:
    directory = folder / "ck-sharded" / SOURCE
    assert sorted(p.name for p in directory.iterdir()) == [META_FILE, shard_file_name(0, 2), shard_file_name(1, 2)]
    full = torch.load(folder / "ck-full" / SOURCE, weights_only=False)
    full_numel = sum(t.numel() for t in full["state_dict"].values())
    for rank in range(2):
        shard = torch.load(directory / shard_file_name(rank, 2), weights_only=True)
        local = sum(t.numel() for t in shard["state_dict"].values())
        assert local <= full_numel / 2 + 8  # half the model (plus padding): no rank held the full model
        assert all("_fsdp_wrapped_module" not in k for k in shard["state_dict"])
    meta = torch.load(directory / META_FILE, weights_only=False)
    assert "state_dict" not in meta and meta["global_step"] == 2 and meta["lightning_fairscale"]["world_size"] == 2
    # Saving sharded changes nothing in training itself.
    assert max_difference(first["sharded"]["state_dict"], first["full"]["state_dict"]) == 0.0


def test_resume_from_sharded_checkpoint_is_exact(first: Jobs) -> None:
    resumed = first["resumed"]
    assert resumed["global_step"] == 4
    assert max_difference(resumed["state_dict"], first["sharded"]["state_dict"]) == 0.0


@pytest.mark.parametrize("how", ["script", "module"])
def test_consolidated_checkpoint_equals_the_full_one(
    source: Path, consolidated: dict[str, Any], folder: Path, tmp_path: Path, how: str
) -> None:
    if how == "script":  # the module fixture's consolidation
        output, target = consolidated["output"], consolidated["path"]
    else:
        target = tmp_path / "consolidated.ckpt"
        output = consolidate(source, target, how)
    assert "reading shard 2/2" in output and "done" in output  # progress is printed
    ours = torch.load(target, weights_only=False)
    full = torch.load(folder / "ck-full" / SOURCE, weights_only=False)
    assert ours.keys() == full.keys()
    _assert_same_checkpoint(ours, full)
    assert ours["hyper_parameters"] == full["hyper_parameters"]


def test_consolidated_checkpoint_loads_without_fairscale(consolidated: dict[str, Any], tmp_path: Path) -> None:
    target = consolidated["path"]
    expected = torch.load(target, weights_only=False)["state_dict"]
    assert_loads_without_fairscale(target, expected, tmp_path)


def test_consolidated_checkpoint_resumes_on_one_process(first: Jobs, one_process: Jobs) -> None:
    resumed = one_process["consolidated-resumed"]
    assert resumed["global_step"] == 4
    # One process sums in another order than two: Adam's update relative to its size (scenarios.common.ADAM_RTOL).
    assert_adam_close(resumed["state_dict"], first["sharded"]["state_dict"])


def test_another_wrapping_names_the_consolidation_command(one_process: Jobs) -> None:
    (error,) = one_process.errors("another-wrapping", ranks=1)
    assert "wrapped differently" in error["message"]
    assert "lightning-fairscale-consolidate" in error["message"]
    assert error["trained_batches"] in (0, None)  # refused before any batch trained


def test_a_changed_model_resumes_partially_from_a_sharded_checkpoint(first: Jobs) -> None:
    """`strict_loading = False`: a model with a layer more and one less resumes from the old model's sharded
    checkpoint on as many processes: its parameters are found by name in the saved flat parameters."""
    source, warned = first["partial-source-sharded"], first.output("partial-sharded")
    assert_partial_resume(first["partial-sharded"], source, warned=warned)
    assert_strict_refusal(first.errors("partial-sharded-strict"))


def test_a_changed_model_resumes_partially_from_a_sharded_checkpoint_of_another_world_size(
    first: Jobs, one_process: Jobs
) -> None:
    resumed = one_process["partial-resharded"]
    assert resumed["world_size"] == 1
    assert_partial_resume(resumed, first["partial-source-sharded"], warned=one_process.output("partial-resharded"))


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
def test_resharding_resume_is_exact(
    request: pytest.FixtureRequest, first: Jobs, one_process: Jobs, consolidated: dict[str, Any], folder: Path,
    tmp_path: Path, devices: int,
) -> None:
    """Saved by 2 processes, resumed on ``devices`` and saved again there, then resumed on the other number and
    saved again: each hop consolidates to exactly what the original consolidates to (2 -> 1 -> 2, 2 -> 2 -> 1)."""
    if devices == 1:
        request.getfixturevalue("last")  # the hop back to 2 processes
    hop, back = folder / f"hop-{devices}.ckpt", folder / f"back-{devices}.ckpt"
    assert sorted(p.name for p in hop.iterdir()) == [META_FILE, *(shard_file_name(r, devices) for r in range(devices))]
    assert sorted(p.name for p in back.iterdir()) == [
        META_FILE, *(shard_file_name(r, 3 - devices) for r in range(3 - devices))
    ]
    expected = torch.load(consolidated["path"], weights_only=False)
    for saved in (hop, back):
        consolidate(saved, tmp_path / f"{saved.stem}.full")
        _assert_same_checkpoint(torch.load(tmp_path / f"{saved.stem}.full", weights_only=False), expected)
    # Training goes on from the resharded state as the unsharded reference does.
    continued = one_process["continued-1"] if devices == 1 else first["resumed"]
    assert continued["global_step"] == 4
    reference = reference_training(4, scheduler=True, num_samples=8)
    assert_adam_close(continued["state_dict"], reference)


def test_save_top_k_removes_old_checkpoint_directories(first: Jobs, folder: Path) -> None:
    assert first["save-top-k"]["global_step"] == 4
    assert sorted(p.name for p in (folder / "ck-top-k").iterdir()) == ["epoch=2-step=3.ckpt", "epoch=3-step=4.ckpt"]


@pytest.mark.parametrize("name", KILLS)
def test_killed_save_keeps_the_previous_checkpoint(
    interrupted: dict[str, subprocess.CompletedProcess], last: Jobs, folder: Path, name: str
) -> None:
    """A rank is SIGKILLed halfway through a file of the second last.ckpt: the first stays whole and resumes exactly."""
    proc = interrupted[name]
    assert proc.returncode != 0, proc.stdout[-2000:]
    checkpoints = folder / f"killed-{name}" / "ck"
    checkpoint = checkpoints / "last.ckpt"
    meta = torch.load(checkpoint / META_FILE if checkpoint.is_dir() else checkpoint, weights_only=False)
    assert meta["global_step"] == 1  # the checkpoint written before the killed one, untouched
    assert [p.name for p in checkpoints.iterdir() if not p.name.startswith(".")] == ["last.ckpt"]
    resumed = last[f"resumed-{name}"]
    assert max_difference(resumed["state_dict"], last["straight"]["state_dict"]) == 0.0


@pytest.mark.parametrize("name", FULL_DISKS)
def test_a_failed_write_fails_every_rank_and_keeps_the_previous_checkpoint(
    interrupted: dict[str, subprocess.CompletedProcess], folder: Path, name: str
) -> None:
    """The disk fills up while a rank writes the second last.ckpt."""
    proc = interrupted[f"full-{name}"]
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert FULL_DISKS[name][2] in proc.stderr, proc.stderr[-4000:]
    last = folder / f"killed-full-{name}" / "ck" / "last.ckpt"
    meta = torch.load(last / META_FILE if last.is_dir() else last, weights_only=False)
    assert meta["global_step"] == 1


# ------------------------------------------------------------------------------------------------------------------
# The file layer on its own (one process)


def test_an_unfinished_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    STORAGE.begin_sharded(target)
    STORAGE.save_shard({"state_dict": {}}, target, 0, 2)  # rank 1 never wrote: the save must not complete
    with pytest.raises(RuntimeError, match="were not written"):
        STORAGE.commit_sharded({"global_step": 1}, target, 2)
    assert not target.exists()
    STORAGE.abort_sharded(target)
    assert list(tmp_path.iterdir()) == []


def test_a_crash_between_the_renames_finds_the_previous_checkpoint(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    target = tmp_path / "last.ckpt"
    STORAGE.begin_sharded(target)
    STORAGE.save_shard({"state_dict": {"w": torch.ones(1)}}, target, 0, 1)
    STORAGE.commit_sharded({"global_step": 1}, target, 1)
    target.rename(tmp_path / ".last.ckpt.replaced")  # what the next save does first
    assert io.load_checkpoint(target)["global_step"] == 1
    assert torch.equal(STORAGE.load_shard(target, 0, 1)["state_dict"]["w"], torch.ones(1))


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
    STORAGE.begin_sharded(tmp_path / "b.ckpt")
    STORAGE.save_shard({}, tmp_path / "b.ckpt", 0, 1)
    STORAGE.commit_sharded({}, tmp_path / "b.ckpt", 1)
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", SETUPS)
def test_consolidation_matches_full_checkpoints_of_other_setups(
    first: Jobs, folder: Path, tmp_path: Path, name: str
) -> None:
    consolidate(folder / f"setup-{name}-sharded" / SOURCE, tmp_path / "consolidated.ckpt")
    ours = torch.load(tmp_path / "consolidated.ckpt", weights_only=False)
    full = torch.load(folder / f"setup-{name}-full" / SOURCE, weights_only=False)
    assert set(ours["state_dict"]) == set(full["state_dict"])
    assert max_difference(ours["state_dict"], full["state_dict"]) == 0.0
    (a,), (b,) = ours["optimizer_states"], full["optimizer_states"]
    assert a["param_groups"] == b["param_groups"]
    for index, state in b["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(a["state"][index][key]), torch.as_tensor(value)), (index, key)


# ----------------------------------------------------------------------------------------------------------------
# The recipe: param groups that split units, frozen parameters inside units that train


def _recipe_reference(steps: int = 4) -> dict[str, torch.Tensor]:
    return reference_training(
        steps, "adamw", clip=(0.05, "norm"), scheduler=True, num_samples=8, freeze=FROZEN, params="split"
    )


def test_the_recipe_equals_unsharded_training_and_leaves_frozen_weights_untouched(first: Jobs) -> None:
    initial = reference_training(0, "adamw", num_samples=8)
    expected = _recipe_reference()
    for kind in ("full", "sharded"):
        result = first[f"recipe-{kind}"]
        assert_adam_close(result["state_dict"], expected, what=kind)
        for name in FROZEN:
            assert torch.equal(result["state_dict"][name], initial[name]), (kind, name)
    # The groups' hyperparameters and the freezing change the result: the equality above shows both kept.
    plain = reference_training(4, "adamw", clip=(0.05, "norm"), scheduler=True, num_samples=8)
    assert max_difference(expected, plain) > 1e-3


def test_the_recipe_holds_optimizer_state_for_trainable_parameters_only(first: Jobs, folder: Path) -> None:
    model = reference_training(0, "adamw", num_samples=8)
    # Rank 0's Adam state at the end of fit, against the same model's without freezing (the "full" run).
    frozen_bytes = first["recipe-full"]["memory"]["memory/optimizer_state_bytes"]
    all_bytes = first["full"]["memory"]["memory/optimizer_state_bytes"]
    assert frozen_bytes < 0.8 * all_bytes
    checkpoint = torch.load(folder / "recipe-full" / SOURCE, weights_only=False)
    [state] = checkpoint["optimizer_states"]
    names = [n for group in _recipe_groups(model) for n in group]
    assert [names[i] for i in sorted(state["state"])] == [n for n in names if n not in FROZEN]
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.1, 0.0]


def _recipe_groups(state_dict: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names in the param groups of ``split_param_groups``, in its order."""
    names = list(state_dict)
    return [[n for n in names if n.endswith("weight")], [n for n in names if n.endswith("bias")]]


@pytest.mark.parametrize("resume", ["resumed-full", "resumed-sharded", "resumed-1"])
def test_the_recipe_resumes_exactly(first: Jobs, one_process: Jobs, resume: str) -> None:
    """Half-way from a full checkpoint, a sharded one, and the sharded one on one process (resharded)."""
    result = (one_process if resume.endswith("-1") else first)[f"recipe-{resume}"]
    assert result["global_step"] == 4
    # One process sums in another order than two: AdamW's update relative to its size (scenarios.common.ADAM_RTOL).
    assert_adam_close(result["state_dict"], first["recipe-sharded"]["state_dict"])


def test_the_recipes_sharded_checkpoint_consolidates_to_its_full_one(first: Jobs, folder: Path, tmp_path: Path) -> None:
    consolidate(folder / "recipe-sharded" / SOURCE, tmp_path / "consolidated.ckpt")
    ours = torch.load(tmp_path / "consolidated.ckpt", weights_only=False)
    full = torch.load(folder / "recipe-full" / SOURCE, weights_only=False)
    assert max_difference(ours["state_dict"], full["state_dict"]) == 0.0
    (a,), (b,) = ours["optimizer_states"], full["optimizer_states"]
    assert a["param_groups"] == b["param_groups"] and sorted(a["state"]) == sorted(b["state"])
    for index, state in b["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(a["state"][index][key]), torch.as_tensor(value)), (index, key)
