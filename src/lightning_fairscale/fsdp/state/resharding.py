"""Loading saved state into the shards a rank owns now, without ever building the full model on any rank.

FairScale shards every FSDP-managed parameter of ``N`` elements the same way: with ``W`` ranks, each rank owns the
contiguous slice ``[r * s, min((r + 1) * s, N))`` of the (flattened) parameter, padded with zeros to ``s =
ceil(N / W)`` elements (``torch.chunk``, see FairScale's ``_get_shard``). Whatever the source of the saved values,
loading is therefore the same operation: for each managed parameter, copy into this rank's shard the parts of the
saved tensors that overlap its slice. Two sources exist:

* a **full** checkpoint (the unwrapped module's state dict and plain optimizer states): the saved tensors are the
  original parameters, each at its offset inside the flat parameter
  (:class:`~lightning_fairscale.fsdp.state.optim.Piece`);
* a **sharded** checkpoint saved by any number of processes (:class:`SavedShards`): the saved tensors are the
  flat shards of the saving ranks, rank ``r``'s at offset ``r * s_saved``.

Only the slices a rank owns are read. Checkpoint files are memory-mapped (``torch.load(mmap=True)``), so what a
rank does not touch is never read, and once a saved tensor has been copied its pages are handed back to the kernel
(:func:`release_pages`): at no point does a rank hold more than its own shards plus one saved tensor.

Nothing here depends on Lightning.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import math
import mmap
import sys
from collections.abc import Container, Iterable, Sequence
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.fsdp.unit.state_names import apply_aliases, fairscale_ties
from lightning_fairscale.fsdp.unit.units import fsdp_instances

__all__ = [
    "SavedPiece",
    "SavedShards",
    "copy_overlaps",
    "flat_numel",
    "load_buffers",
    "load_full_state_dict",
    "local_range",
    "owned_range",
    "release_pages",
]

#: Given a managed parameter's position, a piece and the elements ``[start, stop)`` of the whole flat parameter that
#: a view holds: the view's saved state, or ``None``.
ViewSource = Callable[[int, int, int, int], Optional[dict[str, Any]]]
#: ``(global offset, 1-D tensor)``: saved values of a flat parameter's elements ``offset ... offset + numel - 1``.
Segment = tuple[int, Tensor]


class SavedPiece(NamedTuple):
    """Where a sharded checkpoint holds one original parameter: at ``offset`` in the flat parameter saved under
    ``key`` (``numel`` real elements in all), with the original ``shape``."""

    key: str
    offset: int
    numel: int
    shape: torch.Size


def owned_range(numel: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """``(start, stop, shard_numel)``: the elements of a flat parameter of ``numel`` elements that ``rank`` owns,
    and the padded size of every rank's shard, as FairScale shards it.

    Example:
        >>> [owned_range(10, r, 4) for r in range(4)]
        [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]
        >>> owned_range(5, 3, 4)  # torch.chunk gives rank 3 nothing: it holds padding only
        (5, 5, 2)
    """
    shard = math.ceil(numel / world_size) if numel else 0
    start = min(rank * shard, numel)
    return start, min(start + shard, numel), shard


def flat_numel(param: nn.Parameter) -> int:
    """The number of real (unpadded) elements of an FSDP-managed parameter, over all ranks."""
    numels = getattr(param, "_param_numels", None)  # a flattened parameter: the sum of its pieces
    if numels is not None:
        return int(sum(numels))
    return torch.Size(param._orig_size).numel()  # type: ignore[attr-defined]


def copy_overlaps(
    out: Tensor, start: int, segments: Iterable[Segment], release: bool = True, keep: bool = False
) -> Tensor:
    """Fill the 1-D ``out`` (this rank's shard, covering elements ``start ... start + out.numel() - 1``) from the
    overlapping parts of ``segments``; what no segment covers (the padding) becomes zero, or, with ``keep`` (a
    partial load: parameters the checkpoint lacks), keeps its value. Returns ``out``.

    With ``release``, each saved tensor's memory-mapped pages are given back once it has been read.
    """
    if not keep:
        out.zero_()
    stop = start + out.numel()
    with torch.no_grad():
        for offset, saved in segments:
            lo, hi = max(start, offset), min(stop, offset + saved.numel())
            if lo < hi:
                out[lo - start : hi - start].copy_(saved[lo - offset : hi - offset])
            if release:
                release_pages(saved)
    return out


def load_buffers(root: nn.Module, state_dict: dict[str, Any], clean: Callable[[str], str]) -> None:
    """Copy the buffers of ``root`` (FSDP leaves them whole on every rank) from ``state_dict``, by clean name."""
    with torch.no_grad():
        for name, buffer in root.named_buffers():
            saved = state_dict.get(clean(name))
            if saved is not None:
                buffer.copy_(saved)


# ----------------------------------------------------------------------------------------------------------------
# Memory-mapped pages


_MADV_DONTNEED = 4
_libc: Any = None


def release_pages(tensor: Tensor) -> None:
    """Hand the pages of a memory-mapped, read-only ``tensor`` back to the kernel (Linux; elsewhere nothing).

    A memory-mapped checkpoint costs no memory until it is read, but every page read stays in the process's resident
    set for as long as any tensor of the file lives, and loading keeps small tensors of the file (loop states...)
    alive until the end: without this, loading would hold the checkpoint's bytes next to the shards they were copied
    into. ``madvise(MADV_DONTNEED)`` drops the pages; should anything read them again, the kernel reads them back
    from the file. Only memory that a file backs is touched (``/proc/self/maps`` tells): on anonymous memory the same
    call would zero the data.
    """
    global _libc
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    page = mmap.PAGESIZE
    begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    lo, hi = -(-begin // page) * page, end // page * page  # whole pages inside the tensor only
    if hi <= lo or not _in_file_mapping(begin, end):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def _in_file_mapping(begin: int, end: int) -> bool:
    """Whether the addresses ``[begin, end)`` lie in one private mapping of a regular file."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                if start <= begin and end <= stop:
                    path = fields[5].strip() if len(fields) == 6 else ""
                    return path.startswith("/") and fields[1].endswith("p")
    except OSError:
        pass
    return False


# ----------------------------------------------------------------------------------------------------------------
# Sharded checkpoints of any world size


class SavedShards:
    """The shards of a sharded checkpoint saved by ``world_size`` processes, read into the shards of another world
    size (or the same): each rank opens only the files whose slices overlap its own, and reads only those slices.

    Args:
        read: returns the shard dict that saving rank ``r`` wrote (memory-mapped); called at most once per rank.
        world_size: the number of processes that saved the checkpoint.

    The saved units must be the current model's (same units, same parameters): check with
    :func:`lightning_fairscale.fsdp.state.sharded_checkpoint.check_wrapping` first.
    """

    def __init__(self, read: Callable[[int], dict[str, Any]], world_size: int) -> None:
        self._read = read
        self.world_size = world_size
        self._files: dict[int, dict[str, Any]] = {}
        self._views: dict[tuple[int, int], dict[tuple[int, int], list[tuple[int, int, int]]]] = {}

    def file(self, rank: int) -> dict[str, Any]:
        """Saving rank ``rank``'s shard dict, read on first use."""
        if rank not in self._files:
            self._files[rank] = self._read(rank)
        return self._files[rank]

    @property
    def metadata(self) -> dict[str, Any]:
        """FairScale's ``local_metadata_dict`` of saving rank 0 (units, names, shapes)."""
        return self.file(0)["shard_metadata"]

    def _segments(
        self, numel: int, start: int, stop: int, tensor_of: Callable[[dict[str, Any]], Tensor]
    ) -> Iterable[Segment]:
        """The saved pieces of one flat tensor of ``numel`` real elements that overlap ``[start, stop)``."""
        if start >= stop:
            return
        size = tensor_of(self.file(0)).numel()  # every saving rank's shard of it has this (padded) size
        for rank in range(start // size, min((stop - 1) // size + 1, self.world_size)):
            offset = rank * size
            yield offset, tensor_of(self.file(rank)).reshape(-1)[: max(0, min(size, numel - offset))]

    def _keys(self) -> list[list[str]]:
        """For each saved unit (``root.modules()`` order), the state-dict keys of its managed parameters."""
        keys = []
        for unit in self.metadata["param_metadata"]:
            prefix = f"{unit['fsdp_path']}." if unit["fsdp_path"] else ""
            keys.append([prefix + name for name in unit["params"]])
        return keys

    def pieces(self, aliases: Iterable[tuple[str, str]] = ()) -> dict[str, SavedPiece]:
        """Where each original parameter lies in the saved flat parameters, by the unwrapped module's name (also
        under each alias: see :func:`lightning_fairscale.fsdp.unit.state_names.state_aliases`)."""
        found: dict[str, SavedPiece] = {}
        for unit in self.metadata["param_metadata"]:
            prefix = f"{unit['fsdp_path']}." if unit["fsdp_path"] else ""
            for flat, info in unit["params"].items():
                offset, total = 0, int(sum(info["numels"]))
                for name, shape, numel in zip(info["names"], info["shapes"], info["numels"]):
                    found[prefix + name] = SavedPiece(prefix + flat, offset, total, torch.Size(shape))
                    offset += int(numel)
        return apply_aliases(found, [*aliases, *fairscale_ties(self.metadata)])

    def dtype(self, piece: SavedPiece) -> torch.dtype:
        """The dtype the original parameter ``piece`` was saved in."""
        return self.file(0)["state_dict"][piece.key].dtype

    def read_piece(self, piece: SavedPiece) -> Tensor:
        """One original parameter's saved values, in its shape: a new tensor, read from the files whose slices hold
        it, whose pages are then released. What the export to safetensors writes, one tensor at a time."""
        numel = piece.shape.numel()
        out = torch.empty(numel, dtype=self.dtype(piece))
        stop = piece.offset + numel
        segments = self._segments(piece.numel, piece.offset, stop, lambda f: f["state_dict"][piece.key])
        return copy_overlaps(out, piece.offset, segments).view(piece.shape)

    def buffers(self, clean: Callable[[str], str]) -> dict[str, Tensor]:
        """The saved buffers, by the unwrapped module's name."""
        state_dict = self.file(0)["state_dict"]
        return {clean(name): state_dict[name] for name in self.metadata["buffer_names"] if name in state_dict}

    def load_by_name(
        self, root: nn.Module, pieces_of: Callable[[nn.Parameter], Sequence[Any]], clean: Callable[[str], str],
        aliases: Iterable[tuple[str, str]] = (), names: Optional[Container[str]] = None,
    ) -> None:
        """Copy this rank's slice of every original parameter of ``root`` that the checkpoint holds, found by name,
        and every buffer it holds; what it lacks keeps its value. ``root`` may be wrapped otherwise than the saved
        model, and hold other parameters (a partial load); shapes must have been checked.

        Args:
            root: the wrapped model.
            pieces_of: the original parameters (:class:`~lightning_fairscale.fsdp.state.optim.Piece`) a managed
                parameter holds.
            clean: the unwrapped name of a buffer of ``root``.
            aliases: the saved model's ``(prefix, alias)`` pairs.
            names: the original parameters to read (a filtered checkpoint holds those only); ``None``: all.
        """
        saved = {k: v for k, v in self.pieces(aliases).items() if names is None or k in names}
        for unit in fsdp_instances(root):
            for param in unit.params:
                start, stop, _ = _local_range(param, flat_numel(param), unit)
                pieces = pieces_of(param)
                found = [piece for piece in pieces if piece.name in saved]
                segments = [s for piece in found for s in self._piece_segments(piece, saved[piece.name], start, stop)]
                copy_overlaps(param.data.view(-1), start, segments, keep=len(found) < len(pieces))
        load_buffers(root, self.buffers(clean), clean)

    def _piece_segments(self, piece: Any, saved: SavedPiece, start: int, stop: int) -> Iterable[Segment]:
        """The saved values of one original parameter that fall in ``[start, stop)`` of the current flat parameter
        holding it, at their offsets there."""
        lo, hi = max(start, piece.offset), min(stop, piece.offset + piece.numel)
        if lo >= hi:
            return
        shift = saved.offset - piece.offset  # saved flat index = current flat index + shift
        segments = self._segments(saved.numel, lo + shift, hi + shift, lambda f: f["state_dict"][saved.key])
        for offset, values in segments:
            first, last = max(lo + shift, offset), min(hi + shift, offset + values.numel())
            if first < last:  # only this piece's elements: its neighbours in the saved flat parameter are others'
                yield first - shift, values[first - offset : last - offset]

    def load_into(self, root: nn.Module) -> None:
        """Copy this rank's slice of every managed parameter, and every buffer, into the wrapped ``root``."""
        keys = self._keys()
        for u, unit in enumerate(fsdp_instances(root)):
            for i, param in enumerate(unit.params):
                numel = flat_numel(param)
                start, stop, shard = _local_range(param, numel, unit)
                key = keys[u][i]
                segments = self._segments(numel, start, stop, lambda f: f["state_dict"][key])
                copy_overlaps(param.data.view(-1), start, segments)
        load_buffers(root, self.file(0)["state_dict"], lambda name: name)

    def optimizer_source(
        self, index: int, current: Sequence[tuple[int, int]]
    ) -> tuple[list[dict[str, Any]], ViewSource]:
        """The saved param groups of the ``index``-th optimizer, and where each of this run's views finds its state.

        Args:
            index: which of the saved optimizers.
            current: ``(unit, parameter)`` of each managed parameter the optimizer's original parameters live in,
                numbered as in checkpoints (:func:`lightning_fairscale.fsdp.state.optim_state.managed_positions`).

        Returns:
            The param groups (hyperparameters), and a function that, given a view's managed parameter's position
            ``m``, piece, and the elements ``[start, stop)`` of the whole flat parameter it holds, returns its state,
            read from the saved views (or, in checkpoints written before views, the saved managed shards) that
            overlap it; ``None`` when it had none.

        Raises:
            ValueError: the optimizer holds other parameters, or in another order, than the one that was saved.
        """
        saved_layout = self.file(0)["optimizer_layouts"][index]
        if [tuple(p) for p in saved_layout["params"]] != [tuple(p) for p in current]:
            raise ValueError(
                f"The checkpoint's optimizer {index} was saved over other parameters (FSDP units and order) than this"
                " run's optimizer holds. Resume with the optimizer configuration the checkpoint was saved with."
            )
        groups = copy.deepcopy(self.file(0)["optimizer_states"][index]["param_groups"])
        sizes = [_saved_param(self.file(0), u, i).numel() for u, i in current]
        if "views" not in saved_layout:
            return groups, functools.partial(self._from_managed_shards, index, sizes)
        return groups, functools.partial(self._from_saved_views, index, sizes)

    def _saved_views(self, rank: int, index: int) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
        """Saving rank ``rank``'s views of optimizer ``index``: ``(m, piece)`` -> ``[(entry, start, stop)]``."""
        if (rank, index) not in self._views:
            found: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
            for j, (m, k, start, stop) in enumerate(self.file(rank)["optimizer_layouts"][index]["views"]):
                if start < stop:  # an empty view holds nothing of the parameter
                    found.setdefault((m, k), []).append((j, start, stop))
            self._views[(rank, index)] = found
        return self._views[(rank, index)]

    def _from_saved_views(
        self, index: int, sizes: Sequence[int], m: int, piece: int, start: int, stop: int
    ) -> Optional[dict[str, Any]]:
        size = sizes[m]
        found: list[tuple[int, dict[str, Any]]] = []  # (global offset, saved state of a view of the piece)
        for rank in range(start // size, min((stop - 1) // size + 1, self.world_size)):
            state = self.file(rank)["optimizer_states"][index]["state"]
            for j, lo, _ in self._saved_views(rank, index).get((m, piece), []):
                if state.get(j):
                    found.append((rank * size + lo, state[j]))
        if not found:
            return None
        offset, first = found[0]
        view_numel = self._view_numel(index, m, piece, offset, sizes[m])
        out: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == view_numel:
                segments = [(offset, saved[key]) for offset, saved in found]
                out[key] = copy_overlaps(value.new_empty(stop - start), start, segments)
            else:  # per-parameter values ("step") are the same in every view
                out[key] = copy.deepcopy(value)
        return out

    def _view_numel(self, index: int, m: int, piece: int, offset: int, size: int) -> int:
        """The number of elements of the saved view of ``(m, piece)`` that starts at global ``offset``."""
        rank = offset // size
        for _, lo, hi in self._saved_views(rank, index).get((m, piece), []):
            if rank * size + lo == offset:
                return hi - lo
        raise KeyError((m, piece, offset))

    def _from_managed_shards(
        self, index: int, sizes: Sequence[int], m: int, piece: int, start: int, stop: int
    ) -> Optional[dict[str, Any]]:
        """A checkpoint written before views: each saving rank's state is over its whole shard of ``m``, for every
        piece of it (all of them had state then)."""
        entry = self.file(0)["optimizer_states"][index]["state"].get(m)
        if not entry:
            return None
        size = sizes[m]
        numel = self.world_size * size
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == size:
                segments = self._segments(numel, start, stop, lambda f: f["optimizer_states"][index]["state"][m][key])
                out[key] = copy_overlaps(value.new_empty(stop - start), start, segments)
            else:
                out[key] = copy.deepcopy(value)
        return out


def _saved_param(shard: dict[str, Any], unit: int, index: int) -> Tensor:
    entry = shard["shard_metadata"]["param_metadata"][unit]
    prefix = f"{entry['fsdp_path']}." if entry["fsdp_path"] else ""
    return shard["state_dict"][prefix + list(entry["params"])[index]]


def _local_range(param: nn.Parameter, numel: int, unit: _FairScaleFSDP) -> tuple[int, int, int]:
    """This rank's slice of ``param``: FairScale keeps parameters whole (not sharded) in a group of one process."""
    if not getattr(param, "_is_sharded", False):
        return 0, numel, numel
    start, stop, shard = owned_range(numel, unit.rank, unit.world_size)
    if param.data.numel() != shard:
        raise RuntimeError(
            f"FairScale holds {param.data.numel()} elements of this parameter on this rank, expected {shard}."
        )
    return start, stop, shard


def local_range(param: nn.Parameter, unit: _FairScaleFSDP) -> tuple[int, int, int]:
    """``(start, stop, shard_numel)`` of this rank's slice of the FSDP-managed ``param`` of ``unit``."""
    return _local_range(param, flat_numel(param), unit)


def load_full_state_dict(
    root: nn.Module, pieces_of: Callable[[nn.Parameter], Sequence[Any]], state_dict: dict[str, Any],
    clean: Callable[[str], str],
) -> None:
    """Copy this rank's slice of every managed parameter of ``root``, and every buffer, from the unwrapped module's
    ``state_dict``, one unit at a time: nothing is gathered, and only the slices this rank owns are read.

    Args:
        root: the wrapped model.
        pieces_of: the original parameters (:class:`~lightning_fairscale.fsdp.state.optim.Piece`) a managed parameter
        holds. state_dict: the full state dict, with the unwrapped module's keys (checked beforehand); the parameters it
            lacks keep their values.
        clean: the unwrapped name of a buffer of ``root``.
    """
    for unit in fsdp_instances(root):
        for param in unit.params:
            start, _, _ = local_range(param, unit)
            pieces = pieces_of(param)
            # A partial load (strict loading off) leaves the parameters the state dict lacks as they are.
            found = [piece for piece in pieces if piece.name in state_dict]
            segments = [(piece.offset, state_dict[piece.name].reshape(-1)) for piece in found]
            copy_overlaps(param.data.view(-1), start, segments, keep=len(found) < len(pieces))
    load_buffers(root, state_dict, clean)
