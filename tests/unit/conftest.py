"""Fixtures of the in-process unit tests: a single-process gloo group, and that group made to behave like NCCL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from fake_nccl import FakeNccl


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """The default process group of this process alone (gloo, world size 1), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_nccl(gloo_group: None, monkeypatch: pytest.MonkeyPatch) -> FakeNccl:
    """The default group, treated as NCCL treats CPU tensors inside ``with fake_nccl.active():``."""
    return FakeNccl(monkeypatch)
