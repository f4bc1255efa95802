"""``export_safetensors`` (issue 36): a sharded or full checkpoint to the files Hugging Face's ``save_pretrained``
writes, read back by the ``safetensors`` package itself (and, in ``tests/test_hf_models.py``, by ``from_pretrained``).

The sharded checkpoints are written from real FSDP units of one rank, and split by hand into 2 ranks' shards
(FairScale's chunking, padding included: ``helpers.split_by_hand``)."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.checkpoint.safetensors import parse_size, plan_files, TensorEntry
from lightning_fairscale.consolidate import main as consolidate_main
from lightning_fairscale.fsdp.state.saving import module_state_dict
from lightning_fairscale.fsdp.state.export import export_safetensors
from lightning_fairscale.fsdp.state.sharded_checkpoint import split_checkpoint

from .helpers import WIDTH, Block, shard, small_block, split_by_hand
from .test_sharded_checkpoint_format import write

# The safetensors package comes with the Hugging Face test packages (the Makefile's `$(VENV)/hf`), in a folder of their
# own, last on the path: put there by this module, not by whichever test module ran before it.
if os.path.join(sys.prefix, "hf") not in sys.path:
    sys.path.append(os.path.join(sys.prefix, "hf"))
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("process_group")

VOCAB = 11


class TiedLM(nn.Module):
    """An embedding tied to the output layer (``head.weight`` *is* ``embed.weight``), a block, a batch norm (float
    and int64 buffers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = small_block()
        self.norm = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.norm.running_mean.uniform_()
            self.norm.num_batches_tracked.fill_(7)


class Holder(nn.Module):
    """A LightningModule's layout: the model under ``model``, and a buffer of its own outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TiedLM()
        self.register_buffer("class_weights", torch.arange(3.0))


def expected() -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for the model: its state dict, the tied output layer left out."""
    state = {k: v.clone() for k, v in TiedLM().state_dict().items()}
    del state["head.weight"]
    return state


def sharded_checkpoint(directory: Path, world_size: int) -> Path:
    holder = Holder()
    sharded = shard(holder, torch.optim.SGD(holder.parameters(), lr=0.1), policy={Block})
    checkpoint = {"state_dict": sharded.root.local_state_dict(), "optimizer_states": [sharded.optimizer.state_dict()]}
    meta, shard_ = split_checkpoint(checkpoint, sharded.root, sharded.layout, [sharded.optimizer], [sharded.orders], 1)
    return write(directory / "sharded.ckpt", meta, split_by_hand(shard_, world_size))


def full_checkpoint(path: Path, **extra: Any) -> Path:
    torch.save({"state_dict": Holder().state_dict(), "global_step": 3, **extra}, path)
    return path


def read_back(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export, through the ``safetensors`` package (the index, when there is one, names the
    files); each file's header has the ``pt`` format ``from_pretrained`` checks."""
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with open(folder / name, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        assert header["__metadata__"] == {"format": "pt"} and length % 8 == 0
        part = safetensors_torch.load_file(str(folder / name))
        assert not set(part) & set(tensors)
        tensors.update(part)
    return tensors


def assert_exported(folder: Path, expected_tensors: dict[str, torch.Tensor]) -> None:
    tensors = read_back(folder)
    assert sorted(tensors) == sorted(expected_tensors)
    for name, value in expected_tensors.items():
        assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value), name
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], "a partial file was left behind"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_sharded_checkpoint_exports_as_save_pretrained_writes(tmp_path: Path, world_size: int) -> None:
    """The prefix stripped, the tied output layer written once (under the embedding's name), the buffers (int64 too),
    the LightningModule's own buffer left out: one ``model.safetensors``."""
    source = sharded_checkpoint(tmp_path, world_size)
    report = export_safetensors(source, tmp_path / "hf", prefix="model")
    assert_exported(tmp_path / "hf", expected())
    assert report.tied == {"head.weight": "embed.weight"}
    assert report.outside_prefix == ["class_weights"]
    assert [p.name for p in report.files] == ["model.safetensors"]


def test_a_full_checkpoint_exports_alike_and_ties_are_found_from_shared_storage(tmp_path: Path) -> None:
    source = full_checkpoint(tmp_path / "full.ckpt")
    report = export_safetensors(source, tmp_path / "hf", prefix="model.")
    assert_exported(tmp_path / "hf", expected())
    assert report.tied == {"head.weight": "embed.weight"} and report.outside_prefix == ["class_weights"]


def test_the_strategys_full_save_stores_a_tie_once_and_exports_it_once(tmp_path: Path) -> None:
    """FairScale's full state dict clones every name; the strategy's (``module_state_dict``) gives the tied key the
    known key's tensor, as ``torch``'s own ``state_dict()`` does: the saved file shares it, and the export sees it."""
    holder = Holder()
    sharded = shard(holder, torch.optim.SGD(holder.parameters(), lr=0.1), policy={Block})
    state = module_state_dict(sharded.root, sharded=False, is_global_zero=True)
    assert state["model.head.weight"] is state["model.embed.weight"]
    torch.save({"state_dict": state}, tmp_path / "full.ckpt")
    report = export_safetensors(tmp_path / "full.ckpt", tmp_path / "hf", prefix="model.")
    assert_exported(tmp_path / "hf", expected())
    assert report.tied == {"head.weight": "embed.weight"}


def test_a_copy_of_a_tied_parameter_is_written_unless_dropped(tmp_path: Path) -> None:
    """A checkpoint that holds the tied key as a separate copy: nothing marks it as tied, so it is written (loading
    it is harmless), unless ``drop_keys`` names it."""
    state = {k: v.clone() for k, v in TiedLM().state_dict().items()}  # clones: no shared storage left
    torch.save(state, tmp_path / "plain.pt")
    export_safetensors(tmp_path / "plain.pt", tmp_path / "copy")
    assert sorted(read_back(tmp_path / "copy")) == sorted(state)
    report = export_safetensors(tmp_path / "plain.pt", tmp_path / "dropped", drop_keys=["head.weight"])
    assert_exported(tmp_path / "dropped", expected())
    assert report.dropped == ["head.weight"]


def test_above_the_size_limit_the_files_are_split_with_an_index_and_replace_an_earlier_export(tmp_path: Path) -> None:
    source = sharded_checkpoint(tmp_path, 2)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    export_safetensors(source, out, prefix="model.")
    report = export_safetensors(source, out, prefix="model.", max_shard_size=200)  # bytes: several files
    names = sorted(p.name for p in out.iterdir())
    count = len(report.files) - 1
    assert count > 2 and names == sorted(
        ["config.json", "model.safetensors.index.json", *[f"model-{i:05d}-of-{count:05d}.safetensors"
                                                         for i in range(1, count + 1)]]
    ), names  # the single file of the first export is gone, the config stays
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected().values())
    assert sorted(index["weight_map"]) == sorted(expected())
    assert_exported(out, expected())
    export_safetensors(source, out, prefix="model.")  # back to one file: the shards and the index go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_the_files_are_split_as_huggingface_hub_splits() -> None:
    def entry(name: str, numel: int) -> TensorEntry:
        return TensorEntry(name, torch.float32, (numel,), lambda: torch.zeros(numel))

    entries = [entry("a", 10), entry("b", 20), entry("big", 100), entry("c", 5), entry("d", 1)]
    files = [[e.name for e in file] for file in plan_files(entries, max_bytes=100)]
    # 40 + 80 > 100 bytes: a new file; "big" (400 bytes) alone, the current file still open; 80 + 20 fits; + 4 not.
    assert files == [["a"], ["big"], ["b", "c"], ["d"]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1.5MB") == 1_500_000


def test_the_command_line_exports_and_says_what_it_left_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = sharded_checkpoint(tmp_path, 2)
    code = consolidate_main([str(source), str(tmp_path / "hf"), "--format", "safetensors", "--prefix", "model."])
    assert code == 0
    out = capsys.readouterr().out
    assert "tied: head.weight is embed.weight" in out and "left out 1 keys outside the prefix" in out, out
    assert_exported(tmp_path / "hf", expected())
    assert consolidate_main([str(source), str(tmp_path / "x"), "--format", "safetensors", "--prefix", "net."]) == 1
    assert "No key of the checkpoint starts with the prefix 'net.'" in capsys.readouterr().err
