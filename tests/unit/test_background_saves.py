"""Checkpoints written in the background (``ShardedCheckpointIO(async_save=True)``), in one process: the copy taken
on the caller's thread, the order of writes and removals, errors, and rank 0's wait for the shards of a sharded save.
The multi-process runs (Trainer, Fabric, a process killed during a background write) are in
``tests/test_async_checkpoint.py``."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from lightning_fairscale.checkpoint.background import BackgroundWriter, settle, snapshot
from lightning_fairscale.checkpoint.files import (
    CheckpointFileError,
    ShardedStorage,
    begin_sharded,
    failure_marker,
    save_shard,
    wait_for_shards,
)
from lightning_fairscale import checkpointer
from lightning_fairscale.plugins.checkpoint_io import ShardedCheckpointIO, background_io, checkpoint_files
from pytorch_lightning.plugins.io import AsyncCheckpointIO


def test_snapshot_copies_tensors_once_and_keeps_containers() -> None:
    shared = torch.zeros(3)
    state = OrderedDict(a=shared, b=shared, c=[torch.ones(1), (2, "x")])
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    copy = snapshot(state)
    shared.add_(5)
    assert torch.equal(copy["a"], torch.zeros(3)) and copy["a"] is copy["b"]
    assert type(copy) is OrderedDict and copy._metadata == {"": {"version": 1}}  # type: ignore[attr-defined]
    assert copy["c"][1] == (2, "x") and copy["c"][0] is not state["c"][0]


def _blocked(writer: BackgroundWriter) -> threading.Event:
    """Holds ``writer``'s thread until the returned event is set."""
    release = threading.Event()
    writer.submit(release.wait)
    return release


def test_a_background_save_returns_at_once_and_writes_the_state_of_the_moment(tmp_path: Path) -> None:
    io = ShardedCheckpointIO(async_save=True)
    release = _blocked(io.writer)
    weights = torch.zeros(4)
    io.save_checkpoint({"w": weights}, tmp_path / "last.ckpt")
    weights.add_(1)  # the next optimizer step
    assert not (tmp_path / "last.ckpt").exists()
    release.set()
    loaded = io.load_checkpoint(tmp_path / "last.ckpt")  # waits for the write
    assert torch.equal(loaded["w"], torch.zeros(4))
    io.teardown()
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_removal_waits_for_the_writes_before_it(tmp_path: Path) -> None:
    """ModelCheckpoint(save_top_k=1): the new checkpoint is saved, then the old one removed."""
    io = ShardedCheckpointIO(async_save=True)
    io.save_checkpoint({"step": 1}, tmp_path / "step=1.ckpt")
    io.wait()
    release = _blocked(io.writer)
    io.save_checkpoint({"step": 2}, tmp_path / "step=2.ckpt")
    io.remove_checkpoint(tmp_path / "step=1.ckpt")
    assert (tmp_path / "step=1.ckpt").is_file()  # still the only complete checkpoint
    release.set()
    io.teardown()
    assert [p.name for p in tmp_path.iterdir()] == ["step=2.ckpt"]


def test_after_a_failed_write_nothing_queued_runs_and_the_error_is_raised(tmp_path: Path) -> None:
    io = ShardedCheckpointIO(async_save=True)
    io.save_checkpoint({"step": 1}, tmp_path / "step=1.ckpt")
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "other-file").touch()  # not a checkpoint: a save refuses to replace it
    io.save_checkpoint({"step": 2}, tmp_path / "blocked")
    io.remove_checkpoint(tmp_path / "step=1.ckpt")
    with pytest.raises(IsADirectoryError):
        io.teardown()
    assert (tmp_path / "step=1.ckpt").is_file()  # the removal behind the failed write did not run
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_the_next_save_raises_a_background_error(tmp_path: Path) -> None:
    io = ShardedCheckpointIO(async_save=True)
    io.writer.submit(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    while io.writer.busy:
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"step": 2}, tmp_path / "last.ckpt")
    io.teardown()


def test_settle_agrees_and_raises_everywhere() -> None:
    writer = BackgroundWriter()
    writer.submit(lambda: None)
    settle(writer, agree=lambda ok: ok)  # nothing failed
    writer.submit(lambda: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError, match="disk"):
        settle(writer, agree=lambda ok: ok)
    with pytest.raises(RuntimeError, match="Another process failed to write a checkpoint in the background"):
        settle(writer, agree=lambda ok: False)  # this rank is fine, another is not
    writer.close()


def test_lightning_async_checkpoint_io_around_ours_saves_on_our_thread(tmp_path: Path) -> None:
    wrapped = AsyncCheckpointIO(ShardedCheckpointIO())
    assert background_io(wrapped) is wrapped.checkpoint_io
    assert background_io(ShardedCheckpointIO()) is None
    checkpointer.save_full(checkpoint_files(wrapped, 0), tmp_path / "last.ckpt", {"step": 1})
    assert wrapped._executor is None  # Lightning's thread is not used: one thread, one order
    assert wrapped.load_checkpoint(tmp_path / "last.ckpt") == {"step": 1}
    wrapped.checkpoint_io.teardown()


def test_rank_zero_waits_for_every_shard(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    begin_sharded(target)
    with pytest.raises(CheckpointFileError, match=r"were not written within 0 s"):
        wait_for_shards(target, 2, timeout=0.05)
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(CheckpointFileError, match="cancelled"):
        wait_for_shards(target, 2, timeout=60, cancelled=cancelled)
    failure_marker(target, 1, 2).touch()
    with pytest.raises(CheckpointFileError, match=r"Rank\(s\) \[1\] failed"):
        wait_for_shards(target, 2, timeout=60)
    begin_sharded(target)  # the next save starts clean
    save_shard({"w": torch.ones(1)}, target, 0, 2)
    threading.Timer(0.05, lambda: save_shard({"w": torch.ones(1)}, target, 1, 2)).start()
    ShardedStorage().wait_for_shards(target, 2, timeout=60)
