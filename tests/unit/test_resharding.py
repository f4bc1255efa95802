"""In-process tests of :mod:`lightning_fairscale.fsdp.state.resharding`: FairScale's chunking, slices from any saved
layout, and memory-mapped pages given back (seconds, no launched processes)."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.fsdp.unit import units
from lightning_fairscale.fsdp.state.resharding import SavedShards, copy_overlaps, owned_range, release_pages


def fairscale_shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """What FairScale's ``_get_shard`` keeps on ``rank``: its ``torch.chunk``, zero-padded to the first chunk's size."""
    chunks = list(flat.chunk(world_size))
    chunks += [flat.new_empty(0)] * (world_size - len(chunks))
    return nn.functional.pad(chunks[rank], [0, chunks[0].numel() - chunks[rank].numel()])


@pytest.mark.parametrize("numel", [1, 5, 10, 37, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_owned_range_is_fairscales_chunking(numel: int, world_size: int) -> None:
    flat = torch.arange(numel, dtype=torch.float32)
    for rank in range(world_size):
        start, stop, shard = owned_range(numel, rank, world_size)
        expected = fairscale_shard(flat, rank, world_size)
        assert shard == expected.numel() == math.ceil(numel / world_size)
        assert torch.equal(expected[: stop - start], flat[start:stop])
        assert not expected[stop - start :].any()  # the rest is padding


def saved_files(flat: torch.Tensor, world_size: int, key: str = "flat_param_0") -> dict[int, dict[str, Any]]:
    """The shard dicts ``world_size`` saving ranks would have written for one root unit holding ``flat``."""
    metadata = {"param_metadata": [{"fsdp_path": "", "params": {key: {"numels": [flat.numel()]}}}]}
    return {
        r: {"state_dict": {key: fairscale_shard(flat, r, world_size)}, "shard_metadata": metadata}
        for r in range(world_size)
    }


@pytest.mark.parametrize(("saved", "now"), [(2, 1), (1, 2), (2, 2), (2, 3), (3, 2), (4, 3), (1, 4)])
def test_every_new_shard_is_assembled_from_the_saved_ones(saved: int, now: int) -> None:
    flat = torch.randn(23)
    files = saved_files(flat, saved)
    opened: list[int] = []
    shards = SavedShards(lambda r: opened.append(r) or files[r], saved)
    for rank in range(now):
        opened.clear()
        start, stop, size = owned_range(flat.numel(), rank, now)
        segments = shards._segments(flat.numel(), start, stop, lambda f: f["state_dict"]["flat_param_0"])
        out = copy_overlaps(torch.full((size,), float("nan")), start, segments)
        assert torch.equal(out, fairscale_shard(flat, rank, now))
    # Each saving rank's file is read at most once, however many new ranks a process serves.
    assert sorted(shards._files) == list(range(saved))


def test_a_rank_opens_only_the_saved_files_that_overlap_its_slice() -> None:
    flat = torch.randn(40)
    files = saved_files(flat, 4)
    shards = SavedShards(lambda r: files[r], 4)
    start, stop, size = owned_range(40, 0, 2)  # elements 0..19: saving ranks 0 and 1 (10 each)
    segments = shards._segments(40, start, stop, lambda f: f["state_dict"]["flat_param_0"])
    copy_overlaps(torch.empty(size), start, segments)
    assert sorted(shards._files) == [0, 1]


def _wrapped(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2)))
    cpu = torch.device("cpu")
    net[2] = units.FullyShardedDataParallel(net[2], compute_device=cpu)
    return units.FullyShardedDataParallel(net, compute_device=cpu)


def test_a_checkpoint_of_two_ranks_loads_into_one(process_group: None) -> None:
    """The shards two ranks would have saved (FairScale's layout) load into a one-rank model exactly."""
    source, target = _wrapped(0), _wrapped(1)
    metadata = source.local_metadata_dict()
    local = source.local_state_dict()
    files = {
        r: {
            "state_dict": {
                k: fairscale_shard(v.reshape(-1), r, 2) if "flat_param" in k else v for k, v in local.items()
            },
            "shard_metadata": metadata,
        }
        for r in range(2)
    }
    SavedShards(lambda r: files[r], 2).load_into(target)
    for (name, a), (_, b) in zip(source.local_state_dict().items(), target.local_state_dict().items()):
        assert torch.equal(a, b), name


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are handed back on Linux only")


@LINUX_ONLY
def test_released_pages_read_back_from_the_file(tmp_path: Any) -> None:
    path = tmp_path / "t.pt"
    saved = {"a": torch.randn(300_000), "b": torch.randn(10)}
    torch.save(saved, path)
    loaded = torch.load(path, mmap=True)
    expected = loaded["a"].clone()
    before = _resident_kib()
    release_pages(loaded["a"])
    assert _resident_kib() < before - 1000  # the 1.2 MB read for the clone were handed back
    assert torch.equal(loaded["a"], expected) and torch.equal(loaded["b"], saved["b"])  # and read again


@LINUX_ONLY
def test_release_leaves_memory_that_is_not_a_file_alone() -> None:
    tensor = torch.randn(300_000)  # anonymous memory: dropping its pages would zero it
    expected = tensor.clone()
    release_pages(tensor)
    assert torch.equal(tensor, expected)
