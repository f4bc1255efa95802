"""The files of a checkpoint, whoever writes them: atomic writes, errors that name a damaged file, shard names.

These functions do not depend on Lightning; :class:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO` (the
CheckpointIO plugin), the strategy and the offline consolidation all use them, for either Lightning package.

**How a checkpoint is replaced.** A checkpoint ``NAME`` is a file (full) or a directory (sharded, complete once it
holds ``meta.pt``), and either kind may replace either kind. Two hidden siblings take part, each a file or a
directory:

* ``.NAME.partial``: the new checkpoint while it is written; never read, and cleared by the next save of ``NAME``.
* ``.NAME.replaced``: the previous checkpoint, parked while the new one is renamed into place.

The **invariant**: at every instant, ``NAME`` is complete if it exists, and if it does not exist,
``.NAME.replaced`` holds the last complete checkpoint (if there ever was one). :func:`find_checkpoint` returns
whichever it is, so a process killed at any point leaves the old or the new checkpoint loadable. Each step keeps it:

1. *Stage*: the new checkpoint is written completely to ``.NAME.partial`` and flushed to disk (for a directory:
   every shard, then ``meta.pt`` last). ``NAME`` and ``.NAME.replaced`` are not touched.
2. *Park*: only while ``NAME`` exists (so it is the newest complete checkpoint), a stale ``.NAME.replaced`` is
   deleted and ``NAME`` is renamed to ``.NAME.replaced``. When ``NAME`` is missing, ``.NAME.replaced`` is the only
   complete checkpoint and stays. A file replacing a file skips this step: one ``os.replace`` swaps them.
3. *Swap*: ``.NAME.partial`` is renamed to ``NAME`` (``os.replace``, atomic on POSIX file systems), the directory
   entry is flushed, and only then is ``.NAME.replaced`` deleted.

A directory that is not a sharded checkpoint (no ``meta.pt``) and not empty is never replaced: it may hold anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

__all__ = [
    "FABRIC_RECORD",
    "FORMAT_KEY",
    "META_FILE",
    "CheckpointFileError",
    "MapLocation",
    "ShardedStorage",
    "abort_sharded",
    "begin_sharded",
    "commit_sharded",
    "find_checkpoint",
    "is_sharded",
    "load_meta",
    "load_shard",
    "move_into_place",
    "read_file",
    "save_shard",
    "shard_file_name",
    "save_shard_or_mark",
    "staging_directory",
    "wait_for_shards",
    "write_atomically",
]

#: The file of a sharded checkpoint directory that holds everything but the shards; written last.
META_FILE = "meta.pt"
#: What ``torch.load`` accepts as ``map_location``.
MapLocation = Union[Callable[..., Any], torch.device, str, dict[str, str], None]

#: The key of the meta dict that describes the sharded checkpoint itself.
FORMAT_KEY = "lightning_fairscale"
#: The entry of ``meta[FORMAT_KEY]`` that a Fabric save adds: ``{"model": key, "optimizers": [keys]}``, the keys of
#: the state that held the model and the optimizers (in the order of the shards' ``optimizer_states``).
FABRIC_RECORD = "fabric"


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


def remove_path(path: Path) -> None:
    """Delete the file or directory ``path``, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a checkpoint file, or a sharded checkpoint directory with its ``meta.pt`` (written last)."""
    return path.is_file() or (path / META_FILE).is_file()


def find_checkpoint(path: Path) -> Path:
    """``path``, or the previous checkpoint parked beside it when a save was interrupted between its renames."""
    replaced = hidden_path(path, "replaced")
    if not path.exists() and is_complete(replaced):
        return replaced
    return path


def check_replaceable(path: Path) -> None:
    """Refuse to save over a directory that is not a sharded checkpoint: replacing it would delete what it holds.

    Raises:
        IsADirectoryError: ``path`` is a directory that is neither empty nor a sharded checkpoint.
    """
    if path.is_dir() and not (path / META_FILE).is_file() and any(path.iterdir()):
        raise IsADirectoryError(
            f"Cannot save a checkpoint to {path}: it is a directory that is not a sharded checkpoint (it has no"
            f" {META_FILE}), so it may hold other files. Move or delete it, or save under another name."
        )


def move_into_place(staged: Path, path: Path) -> None:
    """Rename the complete checkpoint ``staged`` (file or directory) to ``path``, replacing whatever kind is there.

    Steps 2 and 3 of the protocol in this module's docstring: at every instant ``path`` or its parked
    ``.<name>.replaced`` sibling holds a complete checkpoint.

    Raises:
        IsADirectoryError: ``path`` is a directory that is neither empty nor a sharded checkpoint.
    """
    check_replaceable(path)
    replaced = hidden_path(path, "replaced")
    if path.is_file() and staged.is_file():
        os.replace(staged, path)  # a file over a file: one atomic rename, nothing to park
    elif path.exists():
        # `path` is complete, so whatever is parked is older: drop it, then park `path` (a rename cannot replace
        # a directory, nor put a file where a directory is).
        remove_path(replaced)
        os.replace(path, replaced)
        os.replace(staged, path)
    else:
        # Nothing at `path`: a parked `.replaced`, if any, is the last complete checkpoint and stays until the swap.
        os.replace(staged, path)
    fsync_directory(path.parent)  # the new entry is on disk before the previous checkpoint goes
    remove_path(replaced)


def write_atomically(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds either its old content or all of the new one.

    ``path`` may hold a file or a sharded checkpoint directory; either is replaced (see the module docstring).
    """
    check_replaceable(path)  # before writing anything
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = hidden_path(path, "partial")
    remove_path(partial)  # left by a save that was killed: a file, or the staging directory of a sharded save
    try:
        with open(partial, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)  # a failed save leaves nothing behind; the previous checkpoint is untouched
        raise
    move_into_place(partial, path)


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


# ----------------------------------------------------------------------------------------------------------------
# Sharded checkpoint directories: the three-phase commit (prepare, write, commit), each phase ended by an agreement of
# all ranks (the strategy's), and their reading. Local paths only.


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory."""
    return path.is_dir() and (path / META_FILE).is_file()


def staging_directory(path: Path) -> Path:
    """Where the shards of a checkpoint for ``path`` are assembled before it is renamed into place."""
    return hidden_path(path, "partial")


def begin_sharded(path: Path) -> None:
    """Phase 1, rank 0: an empty staging directory for ``path``, after checking that ``path`` may be replaced."""
    check_replaceable(path)  # before any rank writes its shard
    staging = staging_directory(path)
    remove_path(staging)  # left by a save that was killed: a staging directory, or a full save's partial file
    staging.mkdir(parents=True)


def save_shard(shard: dict[str, Any], path: Path, rank: int, world_size: int) -> None:
    """Phase 2, every rank: write this rank's shard into the staging directory of ``path``."""
    write_atomically(shard, staging_directory(path) / shard_file_name(rank, world_size))


def commit_sharded(meta: dict[str, Any], path: Path, world_size: int) -> None:
    """Phase 3, rank 0: write ``meta.pt`` after checking every shard is there, then move the directory into place."""
    staging = staging_directory(path)
    names = [shard_file_name(r, world_size) for r in range(world_size)]
    missing = [name for name in names if not (staging / name).is_file()]
    if missing:
        raise CheckpointFileError(f"Shards {missing} of the checkpoint {path} were not written.")
    write_atomically(meta, staging / META_FILE)  # the directory is complete from here on
    move_into_place(staging, path)


def failure_marker(path: Path, rank: int, world_size: int) -> Path:
    """The file a rank leaves in the staging directory of ``path`` when writing its shard in the background failed."""
    return staging_directory(path) / f".{shard_file_name(rank, world_size)}.failed"


def save_shard_or_mark(shard: dict[str, Any], path: Path, rank: int, world_size: int) -> None:
    """Phase 2 in the background (no agreement follows it): :func:`save_shard`, and on failure a marker that rank 0's
    :func:`wait_for_shards` sees, so that it gives up at once instead of waiting for the shard."""
    try:
        save_shard(shard, path, rank, world_size)
    except BaseException:
        with contextlib.suppress(OSError):
            failure_marker(path, rank, world_size).touch()
        raise


def wait_for_shards(path: Path, world_size: int, timeout: float, cancelled: Optional[threading.Event] = None) -> None:
    """Rank 0, in the background: wait until every rank's shard of ``path`` is in its staging directory (each is
    renamed there once complete), instead of an agreement of the ranks, which a background thread cannot make.

    Raises:
        CheckpointFileError: a rank failed to write its shard, the wait was cancelled (the run failed), or
            ``timeout`` seconds passed.
    """
    staging = staging_directory(path)
    names = [shard_file_name(r, world_size) for r in range(world_size)]
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        failed = [r for r in range(world_size) if failure_marker(path, r, world_size).exists()]
        if failed:
            raise CheckpointFileError(f"Rank(s) {failed} failed to write their shard of {path} (see their log).")
        missing = [name for name in names if not (staging / name).is_file()]
        if not missing:
            return
        if cancelled is not None and cancelled.is_set():
            raise CheckpointFileError(f"The save of {path} was cancelled: the run failed before {missing} were in.")
        if time.monotonic() > deadline:
            raise CheckpointFileError(f"Shards {missing} of {path} were not written within {timeout:.0f} s.")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def abort_sharded(path: Path) -> None:
    """Rank 0, after a failed phase: remove the staging directory; the previous checkpoint stays as it was.

    If the commit failed after parking the previous checkpoint, it is renamed back to ``path``.
    """
    shutil.rmtree(staging_directory(path), ignore_errors=True)
    replaced = hidden_path(path, "replaced")
    if not path.exists() and find_checkpoint(path) == replaced:
        os.replace(replaced, path)


def load_meta(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The metadata of the sharded checkpoint directory ``path`` (or of the one an interrupted save parked)."""
    directory = find_checkpoint(path)
    if not (directory / META_FILE).is_file():
        raise CheckpointFileError(
            f"{directory} is not a complete sharded checkpoint: it has no {META_FILE} (written last by every save)."
        )
    return read_file(directory / META_FILE, weights_only=weights_only)


def load_shard(
    path: Path, rank: int, world_size: int, map_location: MapLocation = "cpu", weights_only: Optional[bool] = None
) -> dict[str, Any]:
    """``rank``'s file of the sharded checkpoint directory ``path``, memory-mapped."""
    file = find_checkpoint(path) / shard_file_name(rank, world_size)
    return read_file(file, map_location=map_location, weights_only=weights_only)


class ShardedStorage:
    """Where the engine reads and writes sharded checkpoint directories: the seam between the checkpoint protocol
    (which ranks write what, when they agree) and the files. This one uses the local (or a mounted) file system, with
    the phases above; a subclass may store the same files elsewhere.

    :class:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO` offers one
    (:meth:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO.sharded_storage`); the strategies hand it to
    the engine. Paths are strings or path-like objects.

    Example:
        >>> import tempfile
        >>> storage = ShardedStorage()
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     storage.begin_sharded(f"{tmp}/last.ckpt")
        ...     storage.save_shard({"w": torch.ones(2)}, f"{tmp}/last.ckpt", rank=0, world_size=1)
        ...     storage.commit_sharded({"global_step": 7}, f"{tmp}/last.ckpt", world_size=1)
        ...     storage.is_sharded(f"{tmp}/last.ckpt"), storage.load_meta(f"{tmp}/last.ckpt")["global_step"]
        (True, 7)
    """

    def is_sharded(self, path: Any) -> bool:
        """Whether ``path`` is a complete sharded checkpoint directory."""
        return not _is_remote(path) and is_sharded(Path(path))

    def recover(self, path: Any) -> Path:
        """``path``, or the checkpoint (file or directory) it replaced when a save was interrupted between renames."""
        return find_checkpoint(Path(path))

    def begin_sharded(self, path: Any) -> None:
        """Phase 1, rank 0: an empty staging directory for ``path``."""
        if _is_remote(path):
            raise ValueError(f"Sharded checkpoints are written to a local or mounted file system, got {path}.")
        begin_sharded(Path(path))

    def save_shard(self, shard: dict[str, Any], path: Any, rank: int, world_size: int) -> None:
        """Phase 2, every rank that writes: this rank's shard, into the staging directory of ``path``."""
        save_shard(shard, Path(path), rank, world_size)

    def commit_sharded(self, meta: dict[str, Any], path: Any, world_size: int) -> None:
        """Phase 3, rank 0: ``meta.pt`` once every shard is there, then the directory into place."""
        commit_sharded(meta, Path(path), world_size)

    def save_shard_in_background(self, shard: dict[str, Any], path: Any, rank: int, world_size: int) -> None:
        """Phase 2 on a background thread: as :meth:`save_shard`, and a failure is left where
        :meth:`wait_for_shards` sees it (no agreement of the ranks follows)."""
        save_shard_or_mark(shard, Path(path), rank, world_size)

    def wait_for_shards(
        self, path: Any, world_size: int, timeout: float, cancelled: Optional[threading.Event] = None
    ) -> None:
        """Rank 0 on a background thread, before :meth:`commit_sharded`: wait until every shard is written (see
        :func:`wait_for_shards`)."""
        wait_for_shards(Path(path), world_size, timeout, cancelled)

    def abort_sharded(self, path: Any) -> None:
        """After a failed phase, rank 0: the staging directory goes; the previous checkpoint stays as it was."""
        abort_sharded(Path(path))

    def load_meta(self, path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The metadata of the sharded checkpoint directory ``path``."""
        return load_meta(Path(path), weights_only=weights_only)

    def load_shard(
        self, path: Any, rank: int, world_size: int, map_location: MapLocation = "cpu",
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``rank``'s file of the sharded checkpoint directory ``path``, memory-mapped."""
        return load_shard(Path(path), rank, world_size, map_location=map_location, weights_only=weights_only)


def _is_remote(path: Any) -> bool:
    """Whether ``path`` names a remote file system (``s3://...``): fsspec's paths, which Lightning's CheckpointIO
    plugins write without the guarantees of the local protocol."""
    return "://" in str(path)
