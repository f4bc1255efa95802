"""Writing the safetensors format one tensor at a time, in the files Hugging Face's ``save_pretrained`` writes.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``, padded with
spaces to a multiple of 8 bytes), then the tensors' raw little-endian bytes, back to back, offsets counted from the
end of the header. The header needs only each tensor's dtype and shape, so it is written first and the tensors are
then produced and written one by one: at no point is more than one tensor in memory (the ``safetensors`` package's
``save_file`` takes all of a file's tensors at once, which for the 5 GB files of a large model is 5 GB of memory, and
it is not a dependency of this package). Within a file the tensors go by decreasing element size, as ``safetensors``
orders them, so that every tensor starts at an offset aligned to its element size.

A model that does not fit ``max_shard_size`` is split as ``huggingface_hub`` splits a state dict (a new file when the
next tensor would tip the current one over the limit; a tensor larger than the limit alone in its file):
``model-00001-of-0000N.safetensors``... and ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
"weight_map": {name: file}}``); else one ``model.safetensors``. Each file is written under a hidden name, flushed to
disk and renamed into place (:mod:`lightning_fairscale.checkpoint.files`), the index last; then the files of an
earlier export to the same folder that this one did not write (a single file, an index, other shards) are removed,
so that ``from_pretrained`` never reads a mix. Nothing here depends on Lightning, FairScale or Hugging Face.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from lightning_fairscale.checkpoint.files import fsync_directory, hidden_path

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "TensorEntry",
    "dtype_name",
    "parse_size",
    "plan_files",
    "shard_name",
    "write_model",
]

#: The file of a model that fits one file, and the index of a split one (Hugging Face's names).
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_PATTERN = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}  # fmt: skip
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):  # fmt: skip
    if hasattr(torch, _name):  # newer torch releases only
        _DTYPES[getattr(torch, _name)] = _code


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``.

    Example:
        >>> dtype_name(torch.bfloat16)
        'BF16'

    Raises:
        ValueError: safetensors has no such dtype.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"safetensors cannot hold tensors of dtype {dtype}.")
    return _DTYPES[dtype]


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: Union[int, str]) -> int:
    """Bytes, from an int or a size as Hugging Face writes it (``"5GB"`` is 5 * 10**9 bytes, ``"5GiB"`` 5 * 2**30).

    Example:
        >>> parse_size("5GB"), parse_size("200MiB"), parse_size(1000)
        (5000000000, 209715200, 1000)
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if match is None:
        raise ValueError(f"Not a size: {size!r} (examples: 5GB, 500MB, 2GiB, 1000000).")
    return int(float(match[1]) * _UNITS[match[2] or ""])


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its name, dtype and shape (for the header), and ``read``, which produces its values (a
    tensor of that dtype and number of elements), called once, when its turn comes to be written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], Tensor]
    #: Called with the values once they are written (a memory-mapped source releases their pages).
    done: Callable[[Tensor], None] = lambda values: None

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * _element_size(self.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shard_name(index: int, count: int) -> str:
    """Hugging Face's name of file ``index`` (0-based) of ``count``.

    Example:
        >>> shard_name(0, 3)
        'model-00001-of-00003.safetensors'
    """
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_files(entries: Sequence[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    """The entries of each file, in order: as ``huggingface_hub.split_torch_state_dict_into_shards`` splits."""
    files: list[list[TensorEntry]] = []
    current: list[TensorEntry] = []
    size = 0
    for entry in entries:
        if entry.nbytes > max_bytes:  # alone in a file of its own
            files.append([entry])
            continue
        if current and size + entry.nbytes > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current or not files:
        files.append(current)
    return files


def _header(entries: Sequence[TensorEntry], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for entry in entries:
        offsets = [offset, offset + entry.nbytes]
        header[entry.name] = {"dtype": dtype_name(entry.dtype), "shape": list(entry.shape), "data_offsets": offsets}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _write_tensor(f: object, entry: TensorEntry) -> None:
    values = entry.read()
    if values.dtype != entry.dtype or values.numel() * values.element_size() != entry.nbytes:
        got = f"{tuple(values.shape)} {values.dtype}"
        raise ValueError(f"{entry.name}: expected {entry.shape} {entry.dtype}, got {got}")
    contiguous = values.detach().cpu().contiguous()
    if entry.nbytes:
        f.write(memoryview((ctypes.c_char * entry.nbytes).from_address(contiguous.data_ptr())))  # type: ignore[attr-defined]
    entry.done(values)


def _write_file(path: Path, entries: Sequence[TensorEntry], metadata: dict[str, str],
                progress: Callable[[TensorEntry], None]) -> None:  # fmt: skip
    """One safetensors file, written under a hidden name and renamed into place."""
    ordered = sorted(entries, key=lambda e: -_element_size(e.dtype))  # stable: aligned offsets
    partial = hidden_path(path, "partial")
    try:
        with open(partial, "wb") as f:
            header = _header(ordered, metadata)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for entry in ordered:
                _write_tensor(f, entry)
                progress(entry)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def _write_text(path: Path, text: str) -> None:
    partial = hidden_path(path, "partial")
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def write_model(
    directory: Path, entries: Iterable[TensorEntry], max_shard_size: Union[int, str] = "5GB",
    progress: Optional[Callable[[TensorEntry], None]] = None,
) -> list[Path]:
    """Write ``entries`` into ``directory`` as ``save_pretrained`` does (see the module's docstring); returns the
    files written (the index last). Other files of ``directory`` (``config.json``...) are left alone.

    Raises:
        ValueError: two entries have one name, or a dtype safetensors lacks.
    """
    if sys.byteorder != "little":
        raise ValueError("safetensors files are little-endian: write them on a little-endian machine.")
    entries = list(entries)
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"Tensors named twice: {sorted({n for n in names if names.count(n) > 1})}")
    for entry in entries:
        dtype_name(entry.dtype)  # before anything is written
    directory.mkdir(parents=True, exist_ok=True)
    files = plan_files(entries, parse_size(max_shard_size))
    metadata = {"format": "pt"}  # what transformers checks before it loads a file
    names_of = [SINGLE_NAME] if len(files) == 1 else [shard_name(i, len(files)) for i in range(len(files))]
    written = []
    for name, file_entries in zip(names_of, files):
        _write_file(directory / name, file_entries, metadata, progress or (lambda entry: None))
        written.append(directory / name)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: name for name, file_entries in zip(names_of, files) for e in file_entries},
        }
        _write_text(directory / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(directory / INDEX_NAME)
    fsync_directory(directory)
    _remove_stale(directory, {path.name for path in written})
    return written


def _remove_stale(directory: Path, written: set[str]) -> None:
    """Remove the model files of an earlier export that this one did not write (only names Hugging Face gives)."""
    for path in directory.iterdir():
        ours = path.name in (SINGLE_NAME, INDEX_NAME) or _SHARD_PATTERN.match(path.name)
        if ours and path.name not in written and path.is_file():
            path.unlink()
