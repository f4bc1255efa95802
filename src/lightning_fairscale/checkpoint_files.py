"""The files of a checkpoint, whoever writes them: atomic writes, errors that name a damaged file, shard names.

These functions do not depend on Lightning; :class:`~lightning_fairscale.checkpoint_io.ShardedCheckpointIO` (the
CheckpointIO plugin), the strategy and the offline consolidation all use them, for either Lightning package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

__all__ = ["META_FILE", "CheckpointFileError", "MapLocation", "read_file", "shard_file_name", "write_atomically"]

#: The file of a sharded checkpoint directory that holds everything but the shards; written last.
META_FILE = "meta.pt"
#: What ``torch.load`` accepts as ``map_location``.
MapLocation = Union[Callable[..., Any], torch.device, str, dict[str, str], None]


class CheckpointFileError(RuntimeError):
    """A checkpoint file is missing, truncated or not a checkpoint."""


def shard_file_name(rank: int, world_size: int) -> str:
    """The name of ``rank``'s file in a sharded checkpoint directory.

    Example:
        >>> shard_file_name(1, 2)
        'shard-00001-of-00002.pt'
    """
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def hidden_path(path: Path, suffix: str) -> Path:
    """The hidden sibling ``.<name>.<suffix>`` of ``path``, where a write is staged or an old version parked."""
    return path.parent / f".{path.name}.{suffix}"


def fsync_directory(directory: Path) -> None:
    """Flush a directory's entries (a rename in it) to disk, where the file system allows."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems do not open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds either its old content or all of the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = hidden_path(path, "partial")
    with open(partial, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    fsync_directory(path.parent)


def read_file(path: Path, map_location: MapLocation = "cpu", weights_only: Optional[bool] = None) -> Any:
    """``torch.load`` with an error that names the file when it is truncated or not a checkpoint."""
    if not path.is_file():
        raise CheckpointFileError(f"Checkpoint file not found: {path}.")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)
    except Exception as error:  # torch raises RuntimeError, EOFError, UnpicklingError ... for damaged files
        if "Weights only load failed" in str(error):
            raise  # a readable file with objects torch refuses to unpickle: torch's message says what to do
        raise CheckpointFileError(
            f"Could not read the checkpoint file {path}: it is truncated, corrupt or not a PyTorch checkpoint"
            f" ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Use another checkpoint;"
            " checkpoints written by lightning-fairscale are never left half-written, so this file was damaged or"
            " replaced afterwards."
        ) from error
