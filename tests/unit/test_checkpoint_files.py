"""checkpoint_files.py and the directory protocol of ShardedCheckpointIO, with saves interrupted at every step.

A crash is simulated where it would strike: at a rename (``os.replace`` raising), or by simply not calling the
remaining steps, as when the process is killed between them. (tests/test_sharded_checkpoint.py has the file layer's
damaged-file, missing-shard and crash-between-the-renames cases already.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lightning_fairscale.checkpoint.files import ShardedStorage
from lightning_fairscale.checkpoint.files import (
    staging_directory,
    CheckpointFileError,
    hidden_path,
    read_file,
    shard_file_name,
    write_atomically,
)
from lightning_fairscale.plugins.checkpoint_io import ShardedCheckpointIO

WORLD_SIZE = 2

#: Where these tests keep sharded checkpoints (what `ShardedCheckpointIO().sharded_storage()` gives).
STORAGE = ShardedStorage()



def test_shard_file_names_sort_in_rank_order() -> None:
    names = [shard_file_name(rank, 12) for rank in range(12)]
    assert names[0] == "shard-00000-of-00012.pt" and names[11] == "shard-00011-of-00012.pt"
    assert sorted(names) == names  # a directory listing gives the ranks in order
    assert shard_file_name(0, 2) != shard_file_name(0, 3)  # a shard names the world size it belongs to


def test_hidden_path_is_a_hidden_sibling() -> None:
    assert hidden_path(Path("/ckpts/epoch=1.ckpt"), "partial") == Path("/ckpts/.epoch=1.ckpt.partial")


def test_write_atomically_replaces_the_whole_file_or_nothing(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "model.ckpt"
    write_atomically({"w": torch.ones(3)}, target)  # creates the directory
    write_atomically({"w": torch.zeros(3), "extra": 1}, target)
    assert read_file(target, weights_only=False).keys() == {"w", "extra"}
    with pytest.raises(Exception, match="pickle|Can't"):
        write_atomically({"w": torch.full((3,), 7.0), "bad": lambda: None}, target)  # fails halfway through pickling
    kept = read_file(target, weights_only=False)
    assert torch.equal(kept["w"], torch.zeros(3)) and kept["extra"] == 1


def test_read_file_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileError, match=r"not found: .*missing\.ckpt"):
        read_file(tmp_path / "missing.ckpt")


def save_sharded(io: ShardedCheckpointIO, target: Path, step: int) -> None:
    """A complete sharded save of ``WORLD_SIZE`` ranks, as the strategy runs it (each rank writes its shard)."""
    STORAGE.begin_sharded(target)
    for rank in range(WORLD_SIZE):
        STORAGE.save_shard({"w": torch.full((2,), float(10 * step + rank))}, target, rank, WORLD_SIZE)
    STORAGE.commit_sharded({"global_step": step}, target, WORLD_SIZE)


def assert_holds(io: ShardedCheckpointIO, target: Path, step: int) -> None:
    assert io.load_checkpoint(target)["global_step"] == step
    for rank in range(WORLD_SIZE):
        assert torch.equal(STORAGE.load_shard(target, rank, WORLD_SIZE)["w"], torch.full((2,), float(10 * step + rank)))


def crash_at_rename(monkeypatch: pytest.MonkeyPatch, number: int) -> None:
    """Make the ``number``-th ``os.replace`` from now on fail, as if the process died there."""
    real, calls = os.replace, []

    def replace(source: Any, destination: Any) -> None:
        calls.append(source)
        if len(calls) == number:
            raise OSError("simulated crash")
        real(source, destination)

    monkeypatch.setattr(os, "replace", replace)


# The renames of a commit: 1. meta.pt into the staging directory, 2. the previous checkpoint aside (.replaced),
# 3. the staging directory into place.
PHASES: dict[str, Callable[[ShardedCheckpointIO, Path, pytest.MonkeyPatch], None]] = {
    "prepared": lambda io, target, mp: STORAGE.begin_sharded(target),
    "one-shard-written": lambda io, target, mp: (
        STORAGE.begin_sharded(target),
        STORAGE.save_shard({"w": torch.zeros(2)}, target, 0, WORLD_SIZE),
    ),
    "all-shards-written": lambda io, target, mp: (
        STORAGE.begin_sharded(target),
        [STORAGE.save_shard({"w": torch.zeros(2)}, target, r, WORLD_SIZE) for r in range(WORLD_SIZE)],
    ),
    "writing-meta": lambda io, target, mp: (crash_at_rename(mp, 3), save_sharded(io, target, 99)),
    "parking-the-previous": lambda io, target, mp: (crash_at_rename(mp, 4), save_sharded(io, target, 99)),
    "between-the-renames": lambda io, target, mp: (crash_at_rename(mp, 5), save_sharded(io, target, 99)),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_an_interrupted_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    io, target = ShardedCheckpointIO(), tmp_path / "last.ckpt"
    save_sharded(io, target, 1)
    try:
        PHASES[phase](io, target, monkeypatch)  # the renames before the crash: the two shards' own
    except OSError as error:
        assert "simulated crash" in str(error)
    monkeypatch.undo()
    assert STORAGE.is_sharded(STORAGE.recover(target))
    assert_holds(io, target, 1)
    save_sharded(io, target, 2)  # the next save is not disturbed by what the interrupted one left
    assert_holds(io, target, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_is_sharded_only_for_a_complete_directory(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    save_sharded(io, tmp_path / "done.ckpt", 1)
    STORAGE.begin_sharded(tmp_path / "staged.ckpt")
    io.save_checkpoint({"x": 1}, tmp_path / "full.ckpt")
    (tmp_path / "empty.ckpt").mkdir()
    assert STORAGE.is_sharded(tmp_path / "done.ckpt")
    assert not STORAGE.is_sharded(staging_directory(tmp_path / "staged.ckpt"))
    assert not any(STORAGE.is_sharded(tmp_path / name) for name in ("staged.ckpt", "full.ckpt", "empty.ckpt", "none"))
    with pytest.raises(CheckpointFileError, match=r"empty\.ckpt is not a complete sharded checkpoint: it has no meta"):
        STORAGE.load_meta(tmp_path / "empty.ckpt")


def test_load_shard_names_the_file_of_another_world_size(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    save_sharded(io, tmp_path / "last.ckpt", 1)
    with pytest.raises(CheckpointFileError, match=r"shard-00000-of-00003\.pt"):
        STORAGE.load_shard(tmp_path / "last.ckpt", 0, 3)


def test_sharded_checkpoints_need_a_local_file_system() -> None:
    with pytest.raises(ValueError, match="local or mounted file system, got memory://"):
        ShardedCheckpointIO().sharded_storage().begin_sharded("memory://checkpoints/last.ckpt")


def test_a_full_checkpoint_replaces_a_sharded_one_of_the_same_name(tmp_path: Path) -> None:
    io = ShardedCheckpointIO()
    save_sharded(io, tmp_path / "last.ckpt", 1)
    io.save_checkpoint({"global_step": 2}, tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 2


def test_a_crash_between_the_renames_finds_a_previous_full_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io, target = ShardedCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, target)
    crash_at_rename(monkeypatch, 5)
    with pytest.raises(OSError, match="simulated crash"):
        save_sharded(io, target, 2)
    monkeypatch.undo()
    assert io.load_checkpoint(target)["global_step"] == 1


def test_two_interrupted_saves_in_a_row_leave_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io, target = ShardedCheckpointIO(), tmp_path / "last.ckpt"
    save_sharded(io, target, 1)
    crash_at_rename(monkeypatch, 5)  # between the renames: the previous checkpoint is parked
    with pytest.raises(OSError, match="simulated crash"):
        save_sharded(io, target, 2)
    crash_at_rename(monkeypatch, 4)  # nothing to park this time: the 4th rename moves the new directory in
    with pytest.raises(OSError, match="simulated crash"):
        save_sharded(io, target, 3)
    monkeypatch.undo()
    assert io.load_checkpoint(target)["global_step"] in (1, 2, 3)


def test_a_failed_full_save_does_not_block_a_sharded_save_of_the_same_name(tmp_path: Path) -> None:
    io, target = ShardedCheckpointIO(), tmp_path / "last.ckpt"
    with pytest.raises(Exception, match="pickle|Can't"):
        io.save_checkpoint({"bad": lambda: None}, target)
    assert list(tmp_path.iterdir()) == []  # the failed save cleaned up after itself
    hidden_path(target, "partial").write_bytes(b"half a checkpoint")  # as a full save killed midway leaves it
    save_sharded(io, target, 1)
    assert_holds(io, target, 1)
    STORAGE.begin_sharded(target)  # a sharded save killed midway leaves its staging directory ...
    io.save_checkpoint({"global_step": 2}, target)  # ... where the next full save stages its file
    assert io.load_checkpoint(target)["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def save(io: ShardedCheckpointIO, kind: str, target: Path, step: int) -> None:
    if kind == "full":
        io.save_checkpoint({"global_step": step}, target)
    else:
        save_sharded(io, target, step)


@pytest.mark.parametrize("new", ["full", "sharded"])
@pytest.mark.parametrize("old", ["full", "sharded"])
def test_a_save_interrupted_at_any_rename_leaves_a_checkpoint_of_either_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str
) -> None:
    """Every rename of a save of either kind over either kind, in turn, is where the process dies."""
    crashed_at = []
    for number in range(1, 10):
        folder = tmp_path / f"crash-at-{number}"
        target = folder / "last.ckpt"
        io = ShardedCheckpointIO()
        save(io, old, target, 1)
        crash_at_rename(monkeypatch, number)
        try:
            save(io, new, target, 2)
        except OSError as error:
            assert "simulated crash" in str(error)
            crashed_at.append(number)
        monkeypatch.undo()
        assert io.load_checkpoint(target)["global_step"] == (1 if crashed_at[-1:] == [number] else 2)
        if crashed_at[-1:] != [number]:
            break  # the save ran through: every rename has been a crash point
        save(io, new, target, 3)  # the next save is not disturbed by what the interrupted one left
        assert io.load_checkpoint(target)["global_step"] == 3
        assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    # A file over a file is one rename; a file over a directory parks it first; a sharded save writes two shards and
    # meta.pt before it parks and swaps.
    assert len(crashed_at) == {"full": 1 if old == "full" else 2, "sharded": 5}[new]


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    io, target = ShardedCheckpointIO(), tmp_path / "results"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    for save_it in (lambda: io.save_checkpoint({"global_step": 1}, target), lambda: save_sharded(io, target, 1)):
        with pytest.raises(IsADirectoryError, match=r"results: it is a directory that is not a sharded checkpoint"):
            save_it()
    assert (target / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_a_failed_commit_puts_the_previous_checkpoint_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io, target = ShardedCheckpointIO(), tmp_path / "last.ckpt"
    save_sharded(io, target, 1)
    crash_at_rename(monkeypatch, 5)  # the previous checkpoint is parked, the new one fails to move in
    with pytest.raises(OSError, match="simulated crash"):
        save_sharded(io, target, 2)
    monkeypatch.undo()
    STORAGE.abort_sharded(target)  # what the strategy does when a step fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert_holds(io, target, 1)


def test_removing_a_checkpoint_removes_its_parked_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io, target = ShardedCheckpointIO(), tmp_path / "last.ckpt"
    save_sharded(io, target, 1)
    crash_at_rename(monkeypatch, 5)
    with pytest.raises(OSError, match="simulated crash"):
        save_sharded(io, target, 2)
    monkeypatch.undo()
    io.remove_checkpoint(target)
    assert not STORAGE.recover(target).exists()  # it does not come back from its hiding place
