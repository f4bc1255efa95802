# Generated from lightning_fairscale/plugins/checkpoint_io.py by `make lightning`: do not edit.
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
  or it is missing and ``.<name>.replaced`` is the last complete one: :meth:`ShardedStorage.recover` (and so
  loading) finds it there. :mod:`lightning_fairscale.checkpoint.files` has the protocol step by step.

**In the background** (``ShardedCheckpointIO(async_save=True)``, or Lightning's ``AsyncCheckpointIO`` around a
``ShardedCheckpointIO``): the state is copied on the training thread and the files are written on a thread of the
plugin's (:mod:`lightning_fairscale.checkpoint.background`), with the same protocol, so a process that dies during a
background write keeps the previous checkpoint; removals (``ModelCheckpoint``'s top-k) wait for the writes queued
before them, and loading waits for every pending write.

Remote paths (``s3://`` ...) go through fsspec as in Lightning's ``TorchCheckpointIO``, without these guarantees.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning_fairscale.lightning._compat import _PATH, AnyStrategy, checkpoint_io_slot, set_checkpoint_io_slot
from lightning.pytorch.plugins.io import AsyncCheckpointIO
import torch
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_fairscale.checkpoint.background import BackgroundWriter, snapshot
from lightning_fairscale.checkpoint.files import (
    META_FILE,
    CheckpointFileError,
    MapLocation,
    ShardedStorage,
    hidden_path,
    read_file,
    remove_path,
    shard_file_name,
    write_atomically,
)
from lightning_fairscale.checkpointer import Files
from lightning_fairscale.distributed.collectives import all_agree
from lightning_fairscale.fsdp.state.saving import Ranks

# The file-level names are re-exported here, where they were first defined.
__all__ = [
    "META_FILE",
    "CheckpointFileError",
    "ShardedCheckpointIO",
    "ShardedStorage",
    "background_io",
    "background_writer",
    "checkpoint_files",
    "default_checkpoint_io",
    "finish_background",
    "shard_file_name",
    "sharded_storage",
]


def _is_local(path: _PATH) -> bool:
    return isinstance(get_filesystem(path), LocalFileSystem)


class ShardedCheckpointIO(TorchCheckpointIO):
    """Writes full checkpoints as one file and sharded checkpoints as a directory of per-rank files, atomically.

    The default CheckpointIO plugin of :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`. Its
    sharded-checkpoint methods are called by the strategy on every rank, between the strategy's collectives; the
    ``save_checkpoint``/``load_checkpoint``/``remove_checkpoint`` methods are Lightning's CheckpointIO interface.

    Args:
        async_save: write checkpoints in the background: a save copies the state and returns, a thread of the
            plugin writes the files (atomically, as always), removals and loads wait for the writes before them,
            and ``teardown`` (the end of a Trainer's stage, of Fabric's strategy) waits for all of them. Lightning's
            ``AsyncCheckpointIO(ShardedCheckpointIO())`` does the same under the package's strategies. A
            background failure is raised by the next save, load or teardown (on every rank, under
            :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`).

    Example:
        >>> import tempfile, torch
        >>> io = ShardedCheckpointIO()
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, f"{tmp}/last.ckpt")
        ...     io.load_checkpoint(f"{tmp}/last.ckpt")["state_dict"]["w"]
        tensor([1., 1.])
    """

    def __init__(self, async_save: bool = False) -> None:
        super().__init__()
        #: Whether ``save_checkpoint`` writes in the background.
        self.async_save = async_save
        self._writer: Optional[BackgroundWriter] = None

    # --------------------------------------------------------------------------------------------------------------
    # Lightning's CheckpointIO interface

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write a full checkpoint to the file ``path`` atomically (rank 0 calls this); with ``async_save``, in the
        background (:meth:`save_in_background`)."""
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if self.async_save:
            return self.save_in_background(checkpoint, path)
        write_atomically(checkpoint, Path(path))
        return None

    def save_in_background(self, checkpoint: dict[str, Any], path: _PATH) -> None:
        """Copy ``checkpoint``'s tensors now and write the copy to the local file ``path`` on the plugin's thread,
        atomically, after the writes queued before it. Raises the error of an earlier background write, if any."""
        self._raise_background_error()
        copy = snapshot(checkpoint)
        self.writer.submit(lambda: write_atomically(copy, Path(path)))

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: MapLocation = lambda storage, loc: storage, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Read a full checkpoint file, or the metadata of a sharded checkpoint directory (no shards)."""
        self.wait()  # a checkpoint being written in the background is read once it is in place
        if not _is_local(path):
            # Lightning annotates `map_location` as a callable only; it hands it to `torch.load`, which takes them all.
            return super().load_checkpoint(
                path, map_location=map_location, weights_only=weights_only  # type: ignore[arg-type]
            )
        storage = self.sharded_storage()
        target = storage.recover(path)
        if target.is_dir():
            return storage.load_meta(target, weights_only=weights_only)
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
        if self._writer is not None:  # after the writes queued before it (a newer checkpoint is in place first)
            self._writer.submit(lambda: self._remove(Path(path)))
            return None
        self._remove(Path(path))
        return None

    @staticmethod
    def _remove(path: Path) -> None:
        remove_path(path)
        remove_path(hidden_path(path, "replaced"))

    @override
    def teardown(self) -> None:
        """Wait for the background writes, then end the plugin's thread; raises a background write's error."""
        if self._writer is not None:
            cancelled = self._writer.cancelled.is_set()
            error = self._writer.close()
            if error is not None and cancelled:  # the run failed: its own error is the one to see
                warnings.warn(f"A checkpoint being written in the background was not completed: {error}", stacklevel=2)
            elif error is not None:
                raise error

    # --------------------------------------------------------------------------------------------------------------
    # Background writes

    @property
    def writer(self) -> BackgroundWriter:
        """The plugin's background thread, on which it writes and removes checkpoints in order (made when first
        used; the strategies use it for the shards of sharded checkpoints too)."""
        if self._writer is None:
            self._writer = BackgroundWriter()
        return self._writer

    def wait(self) -> None:
        """Wait until every background write and removal is done; raises the error of one that failed."""
        if self._writer is not None:
            error = self._writer.wait()
            if error is not None:
                raise error

    def _raise_background_error(self) -> None:
        error = None if self._writer is None else self._writer.take_error()
        if error is not None:
            raise error

    # --------------------------------------------------------------------------------------------------------------
    # Sharded checkpoints

    def sharded_storage(self) -> ShardedStorage:
        """Where sharded checkpoint directories are written and read: the local (or a mounted) file system, in three
        atomic phases. Override it to store them elsewhere."""
        return ShardedStorage()


def sharded_storage(io: Any, saving: bool = True) -> ShardedStorage:
    """The :class:`~lightning_fairscale.checkpoint.files.ShardedStorage` of a strategy's CheckpointIO plugin ``io``
    (a :class:`ShardedCheckpointIO`, or Lightning's ``AsyncCheckpointIO`` around one).

    Only a ``ShardedCheckpointIO`` writes sharded checkpoint directories: for another plugin, a save
    (``DDPFullyShardedStrategy(state_dict_type="sharded")``) raises; loading reads them from the local file system.
    """
    plugin = _unwrapped(io)  # a wrapping plugin (Lightning's `_WrappingCheckpointIO`): the one it wraps
    if isinstance(plugin, ShardedCheckpointIO):
        return plugin.sharded_storage()
    if not saving:
        return ShardedStorage()
    raise TypeError(
        f'`DDPFullyShardedStrategy(state_dict_type="sharded")` writes its checkpoint directories with'
        f" `lightning_fairscale.ShardedCheckpointIO`, but the strategy was given {type(io).__name__}. Remove"
        " the CheckpointIO plugin, pass a `ShardedCheckpointIO` (or a subclass), or use"
        ' `state_dict_type="full"`.'
    )


def _unwrapped(io: Any) -> Any:
    """The plugin that ``io`` wraps (through Lightning's wrapping plugins), or ``io``."""
    plugin = io
    while not isinstance(plugin, ShardedCheckpointIO) and getattr(plugin, "checkpoint_io", None) not in (None, plugin):
        plugin = plugin.checkpoint_io
    return plugin


def background_io(io: Any) -> Optional[ShardedCheckpointIO]:
    """The :class:`ShardedCheckpointIO` that writes a strategy's checkpoints in the background, if any: the plugin
    ``io`` itself with ``async_save=True``, or the one inside Lightning's ``AsyncCheckpointIO``.

    The checkpointer then writes through it (full checkpoints with :meth:`ShardedCheckpointIO.save_in_background`,
    the shards of sharded ones on its :attr:`~ShardedCheckpointIO.writer`), so that writes and removals share one
    thread and one order; Lightning's ``AsyncCheckpointIO``'s own thread is not used.
    """
    plugin = _unwrapped(io)
    if not isinstance(plugin, ShardedCheckpointIO):
        return None
    wrapped_async = False
    wrapper = io
    while wrapper is not plugin:
        wrapped_async = wrapped_async or isinstance(wrapper, AsyncCheckpointIO)
        wrapper = wrapper.checkpoint_io
    return plugin if plugin.async_save or wrapped_async else None


class _PluginFiles:
    """The full files of :class:`~lightning_fairscale.checkpointer.Files`: written and read with the plugin ``io``,
    in the background where it saves there (see :func:`background_io`)."""

    def __init__(self, io: Any) -> None:
        self.io = io

    def write(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any]) -> None:
        background = background_io(self.io)
        if background is not None and storage_options is None and _is_local(path):
            background.save_in_background(checkpoint, path)
        else:
            self.io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def read(self, path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
        torch.cuda.empty_cache()  # as Lightning's strategies do before reading a checkpoint
        return self.io.load_checkpoint(path, weights_only=weights_only)


def checkpoint_files(
    io: Any, global_rank: int, timeout: Optional[timedelta] = None, sharded_save: bool = False,
    agree: Callable[[bool], bool] = all_agree,
) -> Files:
    """Where the checkpointer (:mod:`lightning_fairscale.checkpointer`) writes and reads a strategy's checkpoints
    with its CheckpointIO plugin ``io``: this rank (``agree``: how all ranks agree, a collective), the plugin's
    sharded storage (for a ``sharded_save``, only a :class:`ShardedCheckpointIO`'s: see :func:`sharded_storage`), its
    full files, and its background writer (see :func:`background_io`), on which rank 0 waits at most ``timeout`` (the
    strategy's collective timeout) for the other ranks' shards."""
    return Files(
        Ranks(global_rank, agree), sharded_storage(io, saving=sharded_save), _PluginFiles(io), background_writer(io),
        (timeout or default_pg_timeout).total_seconds(),
    )


def background_writer(io: Any) -> Optional[BackgroundWriter]:
    """The thread on which the plugin ``io`` writes in the background (see :func:`background_io`), if it does."""
    background = background_io(io)
    return None if background is None else background.writer


def finish_background(io: Any, failed: bool = False) -> None:
    """At a strategy's teardown: wait for the background writes of a :class:`ShardedCheckpointIO` inside Lightning's
    ``AsyncCheckpointIO`` (whose ``teardown`` does not reach it; the plugin's own ``teardown`` waits otherwise).
    After a ``failed`` run, rank 0 stops waiting for the shards of other processes, which may be gone."""
    background = background_io(io)
    if background is None:
        return
    if failed:
        background.writer.cancel()
    if background is not io:
        background.teardown()


def default_checkpoint_io(base: Any) -> Any:
    """The ``checkpoint_io`` property of a strategy whose Lightning class is ``base``: the CheckpointIO plugin the
    strategy was given, else a :class:`ShardedCheckpointIO` where Lightning would make its ``TorchCheckpointIO``.

    Lightning's ``AsyncCheckpointIO()`` given without a plugin inside gets a :class:`ShardedCheckpointIO` there.

    In a strategy's class body: ``checkpoint_io = default_checkpoint_io(DDPStrategy)``. Lightning's own property
    (``base.checkpoint_io``) still returns the plugin, so that what it does besides (the Trainer's completes a
    wrapping plugin such as ``AsyncCheckpointIO``) stays as it is.
    """
    inherited = base.checkpoint_io  # Lightning's property

    def get(strategy: AnyStrategy) -> Any:
        plugin = checkpoint_io_slot(strategy)
        if plugin is None:
            set_checkpoint_io_slot(strategy, ShardedCheckpointIO())
        elif isinstance(plugin, AsyncCheckpointIO) and plugin.checkpoint_io is None:
            plugin.checkpoint_io = ShardedCheckpointIO()  # `AsyncCheckpointIO()` alone: around ours, not Torch's
        return inherited.fget(strategy)

    def set_(strategy: AnyStrategy, io: Optional[CheckpointIO]) -> None:
        set_checkpoint_io_slot(strategy, io)

    return property(
        get,
        set_,
        doc=":class:`~lightning_fairscale.ShardedCheckpointIO` unless the strategy was given another CheckpointIO"
        " plugin: checkpoint files are written beside their target and renamed into place, so a save killed midway"
        " keeps the previous checkpoint.",
    )
