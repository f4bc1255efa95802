"""Our code on a backend that takes GPU tensors only (NCCL), where the tensors are in CPU memory (``cpu_offload``).

Simulated on the CPU with :class:`fake_nccl.FakeNccl`: a collective that gets a tensor which is not on the backend's
device fails, as NCCL does. Each test also checks that the results came back right.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from unit.fake_nccl import FAKE_GPU, FakeNccl
from torch import nn

from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.mixed_precision.grad_scaler import ShardedGradScaler
from lightning_fairscale.fsdp.state.optim import ParameterLayout, repoint_optimizer
from lightning_fairscale.fsdp.state.optim_state import consolidate_state
from lightning_fairscale.precision.fully_sharded import FullyShardedMixedPrecisionPlugin, FullyShardedPrecisionPlugin
from lightning_fairscale.strategies import DDPFullyShardedStrategy


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture
def trained(process_group: None) -> Iterator[tuple[torch.optim.Optimizer, ParameterLayout, list, nn.Module]]:
    """Two Adam steps of a one-rank FSDP model on the CPU: optimizer state in CPU memory, as with ``cpu_offload``."""
    cpu_streams.install()
    module = _network()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    layout = ParameterLayout.before_wrapping(module)
    world = dist.group.WORLD
    model = FullyShardedDataParallel(
        module, process_group=world, process_group_reduce_scatter=world, compute_device=torch.device("cpu")
    )
    layout.after_wrapping(model)
    order = repoint_optimizer(optimizer, layout)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    yield optimizer, layout, order, model
    del model


def test_full_optimizer_state_is_gathered_through_the_gpu(
    trained: tuple[torch.optim.Optimizer, ParameterLayout, list, nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full checkpoints and teardown: ``consolidate_state`` on CPU-resident state (issue: NCCL refused it)."""
    optimizer, layout, order, _ = trained
    expected = consolidate_state(optimizer, layout, order)  # plain gloo: the reference
    fake = FakeNccl(monkeypatch)
    with fake.active():
        state = consolidate_state(optimizer, layout, order)
    assert fake.seen("gather"), "consolidate_state gathered nothing: the test does not test the transfer"
    assert all(device == FAKE_GPU for devices in fake.seen("gather") for device in devices)
    assert state["param_groups"] == expected["param_groups"]
    assert state["state"].keys() == expected["state"].keys() and len(state["state"]) == 4
    for index, entries in expected["state"].items():
        for key, value in entries.items():
            got = state["state"][index][key]
            assert type(got) is torch.Tensor and got.device.type == "cpu", key
            torch.testing.assert_close(got, value, rtol=0, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clipping_by_norm_reduces_the_norm_through_the_gpu(fake_nccl: FakeNccl, norm_type: float) -> None:
    """The FSDP precision plugins clip gradients in CPU memory (``move_grads_to_cpu``) with a global norm."""
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    for p in params:
        p.grad = torch.ones(2)  # this rank: 2-norm 2, max 1
    # The phantom other rank: its sum of squares is 12 (2-norm of both: 4), or its maximum 4.
    fake_nccl.peer = 12.0 if norm_type == 2.0 else 4.0
    optimizer = torch.optim.SGD(params, lr=1.0)
    with fake_nccl.active():
        FullyShardedPrecisionPlugin().clip_grad_by_norm(optimizer, 1.0, norm_type=norm_type)
    assert fake_nccl.seen("all_reduce") == [[FAKE_GPU]]
    for p in params:
        assert type(p.grad) is torch.Tensor and p.grad.device.type == "cpu"
        torch.testing.assert_close(p.grad, torch.full((2,), 1.0 / (4.0 + 1e-6)))  # clipped by the global norm 4


@pytest.mark.parametrize("other_rank_found_inf", [False, True])
def test_grad_scaler_agrees_with_the_other_ranks_on_infs(fake_nccl: FakeNccl, other_rank_found_inf: bool) -> None:
    """fp16 with ``cpu_offload``: the inf/NaN flags of CPU gradients are combined across ranks, in place."""
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = ShardedGradScaler(device="cpu", init_scale=4.0)
    scaler.scale(param.sum()).backward()  # finite gradients on this rank
    fake_nccl.peer = 1.0 if other_rank_found_inf else 0.0
    with fake_nccl.active():
        scaler.unscale_(optimizer)
    assert fake_nccl.seen("all_reduce") == [[FAKE_GPU]]
    scaler.step(optimizer)
    scaler.update()
    if other_rank_found_inf:  # every rank skips this step and backs off
        assert param.tolist() == [1.0, 1.0, 1.0] and scaler.get_scale() == 2.0
    else:
        assert param.tolist() == [0.0, 0.0, 0.0] and scaler.get_scale() == 4.0


def test_fp16_on_cuda_scales_with_the_scaler_that_combines_cpu_flags() -> None:
    """The behaviour is tested above; FairScale's own scaler drops the combined flags of CPU gradients."""
    with warnings.catch_warnings():  # without CUDA the scaler warns and disables itself
        warnings.simplefilter("ignore")
        plugin = FullyShardedMixedPrecisionPlugin("16-mixed", "cuda")
    assert type(plugin.scaler) is ShardedGradScaler


def _on_gpu(offload: bool) -> DDPFullyShardedStrategy:
    return DDPFullyShardedStrategy(cpu_offload=offload, parallel_devices=[torch.device("cuda", 0)])


def test_configure_model_creates_layers_on_the_cpu_with_cpu_offload() -> None:
    """Lightning runs ``configure_model`` inside ``tensor_init_context``, which creates tensors on the GPU; FairScale
    asserts that offloaded shards are in CPU memory. Nothing is allocated on a GPU here (no CUDA needed)."""
    with _on_gpu(offload=True).tensor_init_context():
        assert torch.get_default_device() == torch.device("cpu")
        assert nn.Linear(2, 2).weight.device == torch.device("cpu")
    with _on_gpu(offload=False).tensor_init_context():  # Lightning's behaviour otherwise
        assert torch.get_default_device() == torch.device("cuda", 0)
