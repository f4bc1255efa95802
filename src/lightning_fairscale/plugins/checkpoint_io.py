"""The files of a checkpoint: full checkpoints as one file, sharded checkpoints as a directory, both atomic.

:class:`ShardedCheckpointIO` is the strategy's CheckpointIO plugin. A **full** checkpoint is one file, written by
rank 0. A **sharded** checkpoint (``DDPFullyShardedStrategy(state_dict_type="sharded")``) is a directory::

    epoch=3-step=400.ckpt/
        meta.pt                    # Lightning's loops/callbacks/hparams state, world size, versions
        shard-00000-of-00002.pt    # rank 0's parameter shard, optimizer shard and FairScale's shard metadata
        shard-00001-of-00002.pt    # rank 1's

Nothing a user saved is lost when a save fails or the process is killed mid-write, whichever kind of checkpoint
replaces whichever kind:

* A file is written to a hidden ``.<name>.partial`` file beside its target, flushed to disk and then renamed into
  place. The target is the old checkpoint or the new one, never a mix.
* A directory is saved in three phases, each ending with an agreement of all ranks: rank 0 *prepares* an empty
  ``.<name>.partial`` directory; every rank *writes* its shard into it; rank 0 *commits*: it checks every shard is
  there, writes ``meta.pt`` last, and renames the directory into place.
* Renaming into place parks an old checkpoint of the same name as ``.<name>.replaced`` when a single rename cannot
  replace it, and deletes it only once the new one is in place. At every instant ``<name>`` is a complete checkpoint,
  or it is missing and ``.<name>.replaced`` is the last complete one: :meth:`ShardedCheckpointIO.recover` (and so
  loading) finds it there. :mod:`lightning_fairscale.checkpoint.files` has the protocol step by step.

Remote paths (``s3://`` ...) go through fsspec as in Lightning's ``TorchCheckpointIO``, without these guarantees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from fsspec.implementations.local import LocalFileSystem
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import get_filesystem
from lightning_fairscale._compat import _PATH, checkpoint_io_slot, set_checkpoint_io_slot
from typing_extensions import override

from lightning_fairscale.checkpoint import files as files
from lightning_fairscale.checkpoint.files import (
    META_FILE,
    CheckpointFileError,
    MapLocation,
    hidden_path,
    read_file,
    remove_path,
    shard_file_name,
    write_atomically,
)

# The file-level names are re-exported here, where they were first defined.
__all__ = [
    "META_FILE",
    "CheckpointFileError",
    "ShardedCheckpointIO",
    "default_checkpoint_io",
    "shard_file_name",
    "sharded_checkpoint_io",
]


def _is_local(path: _PATH) -> bool:
    return isinstance(get_filesystem(path), LocalFileSystem)


class ShardedCheckpointIO(TorchCheckpointIO):
    """Writes full checkpoints as one file and sharded checkpoints as a directory of per-rank files, atomically.

    The default CheckpointIO plugin of :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`. Its
    sharded-checkpoint methods are called by the strategy on every rank, between the strategy's collectives; the
    ``save_checkpoint``/``load_checkpoint``/``remove_checkpoint`` methods are Lightning's CheckpointIO interface.

    Example:
        >>> import tempfile, torch
        >>> io = ShardedCheckpointIO()
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, f"{tmp}/last.ckpt")
        ...     io.load_checkpoint(f"{tmp}/last.ckpt")["state_dict"]["w"]
        tensor([1., 1.])
    """

    # --------------------------------------------------------------------------------------------------------------
    # Lightning's CheckpointIO interface

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write a full checkpoint to the file ``path`` atomically (rank 0 calls this)."""
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        write_atomically(checkpoint, Path(path))
        return None

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: MapLocation = lambda storage, loc: storage, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Read a full checkpoint file, or the metadata of a sharded checkpoint directory (no shards)."""
        if not _is_local(path):
            # Lightning annotates `map_location` as a callable only; it hands it to `torch.load`, which takes them all.
            return super().load_checkpoint(
                path, map_location=map_location, weights_only=weights_only  # type: ignore[arg-type]
            )
        target = self.recover(Path(path))
        if target.is_dir():
            return self.load_meta(target, weights_only=weights_only)
        if not target.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return read_file(target, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete a checkpoint file or directory (what ``ModelCheckpoint(save_top_k=...)`` calls).

        A previous version parked beside it by an interrupted save goes too, so that it cannot come back as ``path``.
        """
        if not _is_local(path):
            return super().remove_checkpoint(path)
        remove_path(Path(path))
        remove_path(hidden_path(Path(path), "replaced"))
        return None

    # --------------------------------------------------------------------------------------------------------------
    # Sharded checkpoints

    @staticmethod
    def is_sharded(path: _PATH) -> bool:
        """Whether ``path`` is a sharded checkpoint directory."""
        return _is_local(path) and files.is_sharded(Path(path))

    @staticmethod
    def recover(path: Path) -> Path:
        """``path``, or the checkpoint (file or directory) it replaced when a save was interrupted between renames."""
        return files.find_checkpoint(path)

    @staticmethod
    def staging_directory(path: _PATH) -> Path:
        """Where the shards of a checkpoint for ``path`` are assembled before it is renamed into place."""
        return files.staging_directory(Path(path))

    def begin_sharded(self, path: _PATH) -> None:
        """Prepare an empty staging directory for ``path`` (rank 0, before the shards are written)."""
        if not _is_local(path):
            raise ValueError(f"Sharded checkpoints are written to a local or mounted file system, got {path}.")
        files.begin_sharded(Path(path))

    def save_shard(self, shard: dict[str, Any], path: _PATH, rank: int, world_size: int) -> None:
        """Write this rank's shard into the staging directory of ``path`` (every rank)."""
        files.save_shard(shard, Path(path), rank, world_size)

    def commit_sharded(self, meta: dict[str, Any], path: _PATH, world_size: int) -> None:
        """Write ``meta.pt`` after checking every shard is there, then move the directory into place (rank 0)."""
        files.commit_sharded(meta, Path(path), world_size)

    def abort_sharded(self, path: _PATH) -> None:
        """Remove the staging directory of a save that failed (rank 0); the previous checkpoint stays as it was."""
        files.abort_sharded(Path(path))

    def load_meta(self, path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The metadata of the sharded checkpoint directory ``path``."""
        return files.load_meta(Path(path), weights_only=weights_only)

    def load_shard(
        self,
        path: _PATH,
        rank: int,
        world_size: int,
        map_location: MapLocation = "cpu",
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """``rank``'s file of the sharded checkpoint directory ``path``."""
        return files.load_shard(Path(path), rank, world_size, map_location=map_location, weights_only=weights_only)


def sharded_checkpoint_io(io: Any) -> ShardedCheckpointIO:
    """``io``, the CheckpointIO plugin of a ``DDPFullyShardedStrategy(state_dict_type="sharded")``, which must write
    sharded checkpoint directories."""
    if not isinstance(io, ShardedCheckpointIO):
        raise TypeError(
            f'`DDPFullyShardedStrategy(state_dict_type="sharded")` writes its checkpoint directories with'
            f" `lightning_fairscale.ShardedCheckpointIO`, but the strategy was given {type(io).__name__}. Remove"
            " the CheckpointIO plugin, pass a `ShardedCheckpointIO` (or a subclass), or use"
            ' `state_dict_type="full"`.'
        )
    return io


def default_checkpoint_io(base: Any) -> Any:
    """The ``checkpoint_io`` property of a strategy whose Lightning class is ``base``: the CheckpointIO plugin the
    strategy was given, else a :class:`ShardedCheckpointIO` where Lightning would make its ``TorchCheckpointIO``.

    In a strategy's class body: ``checkpoint_io = default_checkpoint_io(DDPStrategy)``. Lightning's own property
    (``base.checkpoint_io``) still returns the plugin, so that what it does besides (the Trainer's completes a
    wrapping plugin such as ``AsyncCheckpointIO``) stays as it is.
    """
    inherited = base.checkpoint_io  # Lightning's property

    def get(strategy: Any) -> Any:
        if checkpoint_io_slot(strategy) is None:
            set_checkpoint_io_slot(strategy, ShardedCheckpointIO())
        return inherited.fget(strategy)

    def set_(strategy: Any, io: Optional[Any]) -> None:
        set_checkpoint_io_slot(strategy, io)

    return property(
        get,
        set_,
        doc=":class:`~lightning_fairscale.ShardedCheckpointIO` unless the strategy was given another CheckpointIO"
        " plugin: checkpoint files are written beside their target and renamed into place, so a save killed midway"
        " keeps the previous checkpoint.",
    )
