"""Fixtures of the in-process unit tests: a single-process gloo group (for FSDP units), and that group made to
behave like NCCL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_fairscale.fsdp.patches import cpu_streams
from unit.fake_nccl import FakeNccl


@pytest.fixture(scope="package", autouse=True)
def one_thread() -> Iterator[None]:
    """Compute on one thread: the models are tiny, and on a shared machine more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def process_group() -> Iterator[dist.ProcessGroup]:
    """The default process group: gloo, one rank, in this process (FairScale's CPU patches installed).

    FSDP units need a process group; with one rank they keep whole parameters, so the engine's results can be
    compared exactly with a plain module's.
    """
    assert not dist.is_initialized(), "a previous test left its process group behind"
    cpu_streams.install()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_nccl(process_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> FakeNccl:
    """The default group, treated as NCCL treats CPU tensors inside ``with fake_nccl.active():``."""
    return FakeNccl(monkeypatch)
