"""A checkpoint to Hugging Face-ready safetensors: what ``save_pretrained`` writes, one tensor at a time.

:func:`export_safetensors` reads a sharded checkpoint directory (any number of saving processes) or a full
checkpoint file (the Trainer's, Fabric's or a plain state dict) and writes the model's tensors into a folder as
``save_pretrained`` does (:mod:`lightning_fairscale.checkpoint.safetensors`): ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` above ``max_shard_size``. With the
model's ``config.json`` beside them (``model.config.save_pretrained(folder)``), ``from_pretrained(folder)`` loads them.

* **The prefix.** A LightningModule holds the Hugging Face model under an attribute (``self.model``): its keys start
  with ``model.``. ``prefix="model."`` strips it and leaves out the keys outside it (a loss module's buffers, a
  second model), which the report lists.
* **Tied parameters, written once.** safetensors refuses tensors that share memory, and Hugging Face's own
  ``save_pretrained`` writes a tied parameter once, under its first name (the input embedding's,
  ``transformer.wte.weight``), leaving out the others (``lm_head.weight``), which ``from_pretrained`` ties again.
  The export does the same without importing transformers: the names of one tensor are found in the checkpoint
  itself. In a sharded checkpoint they are the names recorded at save time (``state_aliases``: each tied
  parameter's second name, and a module's second path) and FairScale's own record of the parameters it flattened
  once; in a full checkpoint, keys whose tensors are the same storage, as ``torch.save`` keeps them (every full
  checkpoint of this package, and ``model.state_dict()``). Of one tensor's names the first in the state dict's
  order (the module's registration order, where the embedding comes before the output layer) is written; the
  report lists the others. ``drop_keys`` leaves out any key by name: a tied key saved as a separate copy, which
  nothing in the file marks as tied, or a name the user wants written under its other name instead.
* **Memory.** Nothing is gathered: the source files are memory-mapped, each tensor is read (from the slices of the
  saving ranks that hold it, for a sharded checkpoint), written and let go, and the pages read are handed back to
  the kernel (:func:`lightning_fairscale.fsdp.state.resharding.release_pages`). The process holds one tensor at a time.

Nothing here imports Lightning or Hugging Face.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from torch import Tensor

from lightning_fairscale.checkpoint.files import (
    FORMAT_KEY,
    find_checkpoint,
    is_sharded,
    load_meta,
    load_shard,
    read_file,
)
from lightning_fairscale.checkpoint.safetensors import TensorEntry, write_model
from lightning_fairscale.fsdp.state.resharding import SavedShards, release_pages
from lightning_fairscale.fsdp.unit.state_names import apply_aliases, clean_path

__all__ = ["ExportReport", "export_safetensors"]


@dataclass
class ExportReport:
    """What :func:`export_safetensors` wrote and left out."""

    #: The files written, the index last when there is one.
    files: list[Path] = field(default_factory=list)
    #: The names of the tensors written (the prefix stripped).
    written: list[str] = field(default_factory=list)
    #: The bytes of the tensors written.
    total_bytes: int = 0
    #: Each left-out name of a tensor written under another name: ``{"lm_head.weight": "transformer.wte.weight"}``.
    tied: dict[str, str] = field(default_factory=dict)
    #: The checkpoint's keys outside the prefix, left out.
    outside_prefix: list[str] = field(default_factory=list)
    #: The keys ``drop_keys`` left out.
    dropped: list[str] = field(default_factory=list)
    #: The state dict's entries that are not tensors (``_extra_state`` objects), left out.
    not_tensors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Saved:
    """A tensor of the checkpoint under one of its names; ``identity`` is the same for every name of one tensor."""

    name: str
    identity: Hashable
    entry: TensorEntry


def export_safetensors(
    source: Union[str, Path],
    output: Union[str, Path],
    prefix: str = "",
    max_shard_size: Union[int, str] = "5GB",
    drop_keys: Iterable[str] = (),
    key: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> ExportReport:
    """Write the model of the checkpoint ``source`` into the folder ``output`` as ``save_pretrained`` does.

    Args:
        source: a sharded checkpoint directory, or a full checkpoint file.
        output: the folder to write into (created if needed). Its other files (``config.json``) are left alone; the
            model files of an earlier export there are replaced.
        prefix: the LightningModule's attribute that holds the model, e.g. ``"model."`` (the ``.`` may be left out):
            stripped from the keys under it; the keys outside it are left out. ``""``: every key, as it is.
        max_shard_size: the largest file, as ``save_pretrained`` takes it (``"5GB"`` is 5 * 10**9 bytes; an int is
            bytes); a larger model is split into several files and an index.
        drop_keys: keys to leave out (with or without the prefix).
        key: in a full checkpoint, the entry that holds the model's state dict; by default the Trainer's
            ``"state_dict"``, else the only entry that is a state dict (Fabric's ``{"model": ...}``), else the file
            itself when it is a state dict. A sharded checkpoint records its own.
        progress: called with a line of text as the export goes.

    Returns:
        What was written and left out (:class:`ExportReport`).

    Raises:
        CheckpointFileError: ``source`` is missing or damaged.
        ValueError: no state dict found, no key under ``prefix``, or a dtype safetensors lacks.
    """
    say = progress or (lambda message: None)
    source, output = Path(source), Path(output)
    if output.exists() and not output.is_dir():
        raise ValueError(f"The output {output} exists and is not a folder.")
    if output.resolve() == find_checkpoint(source).resolve():
        raise ValueError("The output folder must not be the checkpoint itself.")
    report = ExportReport()
    if is_sharded(find_checkpoint(source)):
        say(f"reading the sharded checkpoint {source}")
        saved = _sharded_tensors(source)
    else:
        say(f"reading the checkpoint file {source}")
        saved = _full_tensors(source, key, report)
    entries = _choose(saved, _normalized(prefix), set(drop_keys), report)
    say(f"writing {len(entries)} tensors to {output}")
    count = [0]

    def written(entry: TensorEntry) -> None:
        count[0] += 1
        if count[0] % 100 == 0 or count[0] == len(entries):
            say(f"  {count[0]}/{len(entries)} tensors")

    report.files = write_model(output, entries, max_shard_size, progress=written)
    report.written = [entry.name for entry in entries]
    report.total_bytes = sum(entry.nbytes for entry in entries)
    return report


def _normalized(prefix: str) -> str:
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def _choose(saved: list[_Saved], prefix: str, drop: set[str], report: ExportReport) -> list[TensorEntry]:
    """The entries to write: each tensor once, under its first name inside the prefix that is not dropped."""
    groups: dict[Hashable, list[_Saved]] = {}
    for item in saved:
        groups.setdefault(item.identity, []).append(item)
    inside = [item for item in saved if item.name.startswith(prefix)]
    if saved and not inside:
        tops = sorted({item.name.split(".", 1)[0] + "." for item in saved})
        raise ValueError(f"No key of the checkpoint starts with the prefix {prefix!r}; its keys start with {tops}.")
    entries = []
    for group in groups.values():
        kept: Optional[TensorEntry] = None
        for item in group:
            if not item.name.startswith(prefix):
                report.outside_prefix.append(item.name)
                continue
            name = item.name[len(prefix) :]
            if name in drop or item.name in drop:
                report.dropped.append(name)
            elif kept is None:
                kept = TensorEntry(name, item.entry.dtype, item.entry.shape, item.entry.read, item.entry.done)
                entries.append(kept)
            else:
                report.tied[name] = kept.name
        if kept is not None:  # a name outside the prefix of a tensor written inside it is a tie, not a loss
            for item in group:
                if not item.name.startswith(prefix) and item.name in report.outside_prefix:
                    report.outside_prefix.remove(item.name)
                    report.tied[item.name] = kept.name
    return entries


def _sharded_tensors(path: Path) -> list[_Saved]:
    """Every tensor of a sharded checkpoint under each of its names (the unwrapped module's), read on demand."""
    meta = load_meta(path, weights_only=False)
    info = meta.get(FORMAT_KEY)
    if not isinstance(info, dict) or "world_size" not in info:
        raise ValueError(f"{path} is not a sharded checkpoint written by lightning-fairscale.")
    world_size = int(info["world_size"])
    shards = SavedShards(lambda rank: load_shard(path, rank, world_size, weights_only=False), world_size)
    aliases = info.get("aliases", [])
    saved = []
    for name, piece in shards.pieces(aliases).items():
        entry = TensorEntry(name, shards.dtype(piece), tuple(piece.shape), functools.partial(shards.read_piece, piece))
        saved.append(_Saved(name, ("parameter", piece.key, piece.offset), entry))
    buffers = apply_aliases(shards.buffers(clean_path), aliases)
    saved += [_tensor(name, value) for name, value in buffers.items()]
    return saved


def _full_tensors(path: Path, key: Optional[str], report: ExportReport) -> list[_Saved]:
    """Every tensor of the state dict in a full checkpoint file (memory-mapped), by its keys; its other entries are
    recorded in ``report``."""
    checkpoint = read_file(path, weights_only=False)
    state_dict = _state_dict_of(checkpoint, key, path)
    report.not_tensors += [name for name, value in state_dict.items() if not isinstance(value, Tensor)]
    return [_tensor(name, value) for name, value in state_dict.items() if isinstance(value, Tensor)]


def _tensor(name: str, value: Tensor) -> _Saved:
    """A saved tensor; the names of one storage, at one offset, with one shape and strides, are one tensor."""
    if value.numel() == 0:
        identity: Hashable = ("empty", name)
    else:
        identity = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
                    value.dtype)  # fmt: skip
    return _Saved(name, identity, TensorEntry(name, value.dtype, tuple(value.shape), lambda: value, release_pages))


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, Tensor) for v in value.values())


def _state_dict_of(checkpoint: Any, key: Optional[str], path: Path) -> Mapping[str, Any]:
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    if key is not None:
        if not isinstance(checkpoint.get(key), Mapping):
            raise ValueError(f"{path} has no state dict under {key!r}; its entries: {sorted(checkpoint)}.")
        return checkpoint[key]
    if isinstance(checkpoint.get("state_dict"), Mapping):  # the Trainer's
        return checkpoint["state_dict"]
    candidates: Sequence[str] = [k for k, v in checkpoint.items() if _is_state_dict(v)]
    if len(candidates) == 1:  # Fabric's {"model": state dict, "optimizer": ...}
        return checkpoint[candidates[0]]
    if _is_state_dict(checkpoint):  # torch.save(model.state_dict())
        return checkpoint
    raise ValueError(
        f"Which entry of {path} holds the model's state dict? Name it with `key` (`--key`); the entries that are"
        f" state dicts: {sorted(candidates)}, all entries: {sorted(checkpoint)}."
    )
