"""A unit run on some ranks only (issue 54 item 4, ``fsdp/unit/rank_agreement.py``), in process: every rank raises
at once, naming the unit, before any gather pairs the wrong tensors; gloo's overlapped path (the gathers started
ahead, workaround 16) and FairScale's own synchronous gathers (the path CUDA takes); the check's collective on an
NCCL-like group (``fake_nccl.py``).

Before: the forked ranks ended with gloo's ``Connection closed by peer`` (one rank failed at a gather, the other
lost it), naming no unit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Block
from torch import Tensor, nn

from lightning_fairscale.distributed import collectives
from lightning_fairscale.fsdp.patches import cpu_streams, prefetch
from lightning_fairscale.fsdp.unit.rank_agreement import RankDivergenceError
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .fake_nccl import FAKE_GPU, FakeNccl
from .helpers import Net, batches, parameters_of, run_ranks, shard


class Skipping(Net):
    """``Net`` whose second Block runs only when asked."""

    def forward(self, x: Tensor, second: bool = True) -> Tensor:  # type: ignore[override]
        h = self.blocks[0](self.inp(x))
        return self.out(self.blocks[1](h) if second else h)


def _diverge(rank: int, world_size: int, overlap: bool, first_step_alike: bool) -> dict[str, Any]:
    """Rank 0 runs the second Block, rank 1 does not (after one step run alike, if asked); then a step alike."""
    cpu_streams.install()  # FairScale on CPU (workarounds 1, 2)
    prefetch.OVERLAP_ON_CPU = overlap  # read when the root sets up, in its first forward
    model = Skipping()
    sharded = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy={Block})
    data = batches(3)

    def step(second: bool, batch: int) -> None:
        x, y = data[batch]
        nn.functional.mse_loss(sharded.root(x[rank::world_size], second), y[rank::world_size]).backward()
        sharded.optimizer.step()
        sharded.optimizer.zero_grad()

    if first_step_alike:
        step(True, 0)
    before = {k: v.clone() for k, v in parameters_of(sharded.root).items()}
    started = time.monotonic()
    try:
        step(rank == 0, 1)
    except RankDivergenceError as error:
        message, seconds = str(error), time.monotonic() - started
    else:
        message, seconds = "", 0.0
    unchanged = all(torch.equal(v, before[k]) for k, v in parameters_of(sharded.root).items())
    step(True, 2)  # the ranks go on together
    return {"message": message, "seconds": seconds, "unchanged": unchanged, "after": parameters_of(
        unwrap_module(sharded.root))}


@pytest.mark.parametrize("first_step_alike", [False, True], ids=["first-step", "after-a-step"])
@pytest.mark.parametrize("overlap", [True, False], ids=["gathers-ahead", "fairscale-gathers"])
def test_a_unit_run_on_one_rank_only_raises_on_every_rank_naming_it(
    tmp_path: Path, overlap: bool, first_step_alike: bool
) -> None:
    results = run_ranks(_diverge, 2, tmp_path, overlap, first_step_alike)
    for rank, result in enumerate(results):
        assert "The FSDP unit 'blocks.1' ran on rank(s) 0 in this forward" in result["message"], rank
        assert "rank 1 went on to 'out'" not in result["message"]  # the root's own layers are not a unit
        assert "rank 1 went on to the end of the forward" in result["message"], result["message"]
        assert result["seconds"] < 5, result["seconds"]  # the group's timeout is 30 s
        assert result["unchanged"], rank  # the step stopped before the optimizer
    torch.testing.assert_close(results[0]["after"], results[1]["after"], rtol=0, atol=0)


def test_the_check_runs_on_the_groups_device_and_tells_a_different_value(fake_nccl: FakeNccl) -> None:
    fake_nccl.peer = 0  # type: ignore[assignment]
    with fake_nccl.active():
        assert collectives.all_equal(0)  # the phantom peer's 0: the same
        fake_nccl.peer = 7  # type: ignore[assignment]
        assert not collectives.all_equal(0)
    assert fake_nccl.seen("all_reduce") == [[FAKE_GPU], [FAKE_GPU]]
