"""``lightning_fairscale.distributed.collectives``: tensors go to the group's device for the transfer and come back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from unit.fake_nccl import FAKE_GPU, FakeNccl, OnFakeGpu

from lightning_fairscale.distributed import collectives, exchanges

from .helpers import run_ranks


def test_the_fake_backend_refuses_cpu_tensors_like_nccl(fake_nccl: FakeNccl) -> None:
    """The simulation the tests below rely on: a CPU tensor handed to a collective fails, as with NCCL."""
    with fake_nccl.active(), pytest.raises(RuntimeError, match="device type cpu"):
        dist.all_reduce(torch.ones(2))


def test_gloo_takes_tensors_where_they_are(process_group: None) -> None:
    assert collectives.group_device(None, torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize(
    ("config", "expected"), [("cpu:gloo,cuda:nccl", "cpu"), ("cpu:gloo,cuda:gloo", "cpu"), ("meta:nccl", "meta")]
)
def test_group_device_follows_the_backends_device_types(
    monkeypatch: pytest.MonkeyPatch, config: str, expected: str
) -> None:
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert collectives.group_device(None, torch.device("cpu")) == torch.device(expected)


@pytest.mark.parametrize(("op", "peer", "expected"), [("SUM", 10.0, [11.0, 12.0]), ("MAX", 1.5, [1.5, 2.0])])
def test_all_reduce_moves_the_tensor_and_reduces_in_place(
    fake_nccl: FakeNccl, op: str, peer: float, expected: list[float]
) -> None:
    tensor = torch.tensor([1.0, 2.0])
    fake_nccl.peer = peer
    with fake_nccl.active():
        result = collectives.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    assert fake_nccl.seen("all_reduce") == [[FAKE_GPU]]
    assert result is tensor and type(tensor) is torch.Tensor and tensor.device.type == "cpu"
    assert tensor.tolist() == expected  # the other rank's part came back into the caller's tensor


def test_gather_returns_the_shards_on_the_callers_device(fake_nccl: FakeNccl) -> None:
    shard = torch.arange(6.0).view(2, 3)
    with fake_nccl.active():
        gathered = collectives.gather(shard, dst=0)
    assert fake_nccl.seen("gather") == [[FAKE_GPU, FAKE_GPU]]  # the shard and the (one rank's) receive buffer
    assert gathered is not None and len(gathered) == 1
    assert not isinstance(gathered[0], OnFakeGpu) and gathered[0].device.type == "cpu"
    assert torch.equal(gathered[0], shard)


def test_reduce_scatter_writes_the_callers_output(fake_nccl: FakeNccl) -> None:
    output, source = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    with fake_nccl.active():
        collectives.reduce_scatter_tensor(output, source)
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    assert fake_nccl.seen(name) == [[FAKE_GPU, FAKE_GPU]]  # torch's current name: no deprecation warning
    assert type(output) is torch.Tensor and output.tolist() == [1.0, 2.0, 3.0]


def test_all_gather_object(fake_nccl: FakeNccl) -> None:
    with fake_nccl.active():
        assert collectives.all_gather_object({"a": [1, 2]}) == [{"a": [1, 2]}]


def _agree_on_rank(rank: int, world_size: int) -> list[bool]:
    return [collectives.all_agree(True), collectives.all_agree(rank != 1)]


def test_all_agree_is_true_only_where_every_rank_is(tmp_path: Path) -> None:
    """The agreement that ends each phase of a sharded save: one rank's ``False`` is every rank's."""
    assert (collectives.all_agree(True), collectives.all_agree(False)) == (True, False)  # no group: its own
    assert run_ranks(_agree_on_rank, 3, tmp_path) == [[True, False]] * 3


def test_no_copy_where_the_backend_takes_the_tensor(process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On gloo the collective gets the caller's tensor itself: no copy, no extra memory."""
    seen: list[torch.Tensor] = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kwargs: (seen.append(tensor), real(tensor, **kwargs)))
    tensor = torch.ones(3)
    collectives.all_reduce(tensor)
    assert seen[0] is tensor


@pytest.mark.usefixtures("process_group")
def test_recording_traffic_counts_each_collective_once_with_its_group_and_payload() -> None:
    import warnings

    group = dist.new_group()
    real, real_exchange = dist.all_gather_into_tensor, exchanges.all_gather
    with collectives.recording_traffic() as transfers:
        collectives.all_reduce(torch.ones(3), group=group)  # through this package
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # `_all_gather_base` is deprecated: FairScale still calls it
            dist._all_gather_base(torch.empty(4), torch.ones(4))  # calls `all_gather_into_tensor`: counted once
        collectives.reduce_scatter_tensor(torch.empty(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        gather = collectives.current_name("all_gather_into_tensor")  # torch 2.13's name, counted under it
        gather(torch.empty(2, dtype=torch.float16), torch.ones(2, dtype=torch.float16))
        # the exchanges FSDP's units use on CPU, as the collectives they replace
        exchanges.all_gather(torch.empty(3), torch.ones(3), group=group).wait()
        exchanges.reduce_scatter(torch.empty(2), [torch.ones(2)]).wait()
    dist.all_reduce(torch.ones(1))  # after the block: not recorded
    assert transfers == [
        collectives.Transfer("all_reduce", (0,), 12),
        collectives.Transfer("all_gather", (0,), 16),
        collectives.Transfer("reduce_scatter", (0,), 16),
        collectives.Transfer("all_gather", (0,), 4),
        collectives.Transfer("all_gather", (0,), 12),
        collectives.Transfer("reduce_scatter", (0,), 8),
    ]
    assert dist.all_gather_into_tensor is real  # torch's functions are given back
    assert exchanges.all_gather is real_exchange
