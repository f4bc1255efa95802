"""materialize.py: modules built on the meta device, materialised unit by unit as FSDP wraps them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.nn.wrap import enable_wrap, wrap as fairscale_wrap
from torch import Tensor, nn

from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.unit.materialize import check_materializable, materialize, to_device_keeping_meta
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .helpers import (
    OPTIMIZERS, Block, Net, batches, fsdp_kwargs, parameters_of, run_ranks, shard, small_block, step, wrap,
)  # fmt: skip

pytestmark = [
    pytest.mark.usefixtures("process_group"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),  # inside FairScale
]
CPU = torch.device("cpu")
#: The order FSDP initialises ``Net``'s modules in with each Block a unit: the Blocks as they are wrapped, then the
#: root's own modules in ``modules()`` order.
BLOCK_UNITS_ORDER = ["blocks.0.norm", "blocks.0.up", "blocks.0.down", "blocks.1.norm", "blocks.1.up",
                     "blocks.1.down", "inp", "out"]  # fmt: skip


def meta_net() -> Net:
    """``Net`` on the meta device (its constructor's seeding has no effect then: nothing random is drawn)."""
    with torch.device("meta"):
        return Net()


def initialised_in_order(order: list[str], seed: int = 5) -> dict[str, Tensor]:
    """``Net``'s parameters when each module of ``order`` runs ``reset_parameters()`` in turn from ``seed``."""
    net = meta_net().to_empty(device=CPU)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name in order:
            net.get_submodule(name).reset_parameters()
    return parameters_of(net)


def full_parameters(root: nn.Module) -> dict[str, Tensor]:
    """The unwrapped module's parameters (one rank: the whole of each)."""
    return parameters_of(unwrap_module(root))


def test_each_unit_is_initialised_by_reset_parameters_before_it_is_sharded() -> None:
    net = meta_net()
    torch.manual_seed(5)
    root = wrap(net, policy={Block})
    params = full_parameters(root)
    assert all(p.device == CPU and bool(p.isfinite().all()) for p in params.values())
    expected = initialised_in_order(BLOCK_UNITS_ORDER)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, atol=0, rtol=0, msg=name)
    # Not the initialisation of an eager build: the units came first.
    assert not torch.equal(params["inp.weight"], initialised_in_order(["inp"])["inp.weight"])


def test_a_model_that_is_one_unit_gets_the_weights_of_an_eager_build() -> None:
    """Within a unit, modules are initialised in ``modules()`` order: the order their constructors ran in."""
    eager = parameters_of(Net(seed=3))
    net = meta_net()
    torch.manual_seed(3)
    root = wrap(net)  # min_num_params=10**9: one unit, the root
    params = full_parameters(root)
    for name, value in eager.items():
        torch.testing.assert_close(params[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_optimizer_made_over_the_meta_parameters_trains_the_shards(optimizer: str) -> None:
    """As the Trainer does: the optimizer is created before wrapping, over the (meta) parameters, then re-pointed."""
    module = meta_net()
    torch.manual_seed(5)
    sharded = shard(module, OPTIMIZERS[optimizer](module.parameters()), policy={Block})
    plain = Net()
    with torch.no_grad():
        for name, value in initialised_in_order(BLOCK_UNITS_ORDER).items():
            plain.get_parameter(name).copy_(value)
    plain_optimizer = OPTIMIZERS[optimizer](plain.parameters())
    for batch in batches(2):
        step(sharded.root, sharded.optimizer, batch)
        step(plain, plain_optimizer, batch)
    params = full_parameters(sharded.root)
    for name, value in parameters_of(plain).items():
        torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0, msg=name)


def test_buffers_are_recreated_by_reset_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert materialize(model, CPU)
    norm = model[1]
    assert torch.equal(norm.running_mean, torch.zeros(4)) and torch.equal(norm.running_var, torch.ones(4))
    assert norm.num_batches_tracked.item() == 0 and norm.num_batches_tracked.dtype == torch.long
    assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert not materialize(model, CPU)  # nothing left to do


def test_shared_parameters_stay_shared() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    materialize(model, CPU)
    assert model[1].weight is model[0].weight and not model[0].weight.is_meta
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad


def test_only_meta_tensors_are_replaced_and_frozen_parameters_stay_frozen() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].to_empty(device=CPU)
    nn.init.constant_(model[0].weight, 7.0)
    model[1].weight.requires_grad_(False)
    materialize(model, CPU)
    assert torch.equal(model[0].weight, torch.full((2, 2), 7.0))  # a module without meta tensors is left alone
    assert not model[1].weight.requires_grad and model[1].bias.requires_grad


def test_param_init_fn_initialises_each_module_that_held_meta_tensors() -> None:
    seen = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            assert tensor.device == CPU  # already materialised, not yet initialised
            tensor.fill_(0.5)

    root = wrap(meta_net(), policy={Block}, param_init_fn=init)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in full_parameters(root).values())
    # Only the modules with tensors of their own, unit by unit (not the Blocks, Sequential or Net themselves).
    assert seen == ["LayerNorm", "Linear", "Linear"] * 2 + ["Linear", "Linear"]


def test_a_torch_style_param_init_fn_that_calls_to_empty_itself_works() -> None:
    def init(module: nn.Module) -> None:  # what torch FSDP's documentation shows
        module.to_empty(device=CPU, recurse=False)
        module.reset_parameters()  # type: ignore[operator]

    net = meta_net()
    torch.manual_seed(5)
    params = full_parameters(wrap(net, policy={Block}, param_init_fn=init))
    expected = initialised_in_order(BLOCK_UNITS_ORDER)
    assert all(torch.equal(params[name], value) for name, value in expected.items())


class Scaled(nn.Module):
    """A layer whose ``reset_parameters`` initialises its weight, but not the buffer made in ``__init__``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.register_buffer("scale", torch.arange(3).to(dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight * self.scale


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))


def test_a_module_that_cannot_be_initialised_is_refused_before_anything_is_materialised() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(NoReset()))
    with pytest.raises(ValueError) as error:
        wrap(model, policy={nn.Linear})
    message = str(error.value)
    assert "`1.0` (NoReset) holds `weight` on the meta device and has no `reset_parameters()`" in message
    assert "Give NoReset a `reset_parameters()`" in message and "param_init_fn" in message
    assert model[0].weight.is_meta  # the Linear (a unit of its own, wrapped first) was not materialised either
    with torch.device("meta"):
        unit = NoReset()
    with pytest.raises(ValueError, match=r"the module wrapped as an FSDP unit \(NoReset\) holds `weight`"):
        FullyShardedDataParallel(unit, **fsdp_kwargs())  # manual wrap: the unit's own check


def test_the_early_check_names_modules_by_their_path_in_the_model() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(NoReset()))
    with pytest.raises(ValueError, match=r"`1\.0` \(NoReset\)"):
        check_materializable(model, None)
    assert [path for path, _, _ in check_materializable(model, lambda m: None)] == ["0", "1.0"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_a_buffer_that_reset_parameters_leaves_out_is_an_error_naming_it(dtype: torch.dtype) -> None:
    """Floating-point buffers are found by the NaN they are filled with, others because nothing wrote them."""
    with torch.device("meta"):
        model = nn.Sequential(Scaled(dtype))
    with pytest.raises(ValueError) as error:
        materialize(model, CPU)
    message = str(error.value)
    assert "After `reset_parameters()` of `0` (Scaled), its buffer `scale`, built on the meta device," in message
    assert "was not initialised" in message and "param_init_fn" in message


def test_a_parameter_left_on_the_meta_device_by_param_init_fn_is_an_error() -> None:
    def init(module: nn.Module) -> None:
        module.weight = nn.Parameter(torch.empty(3, device="meta"))

    with torch.device("meta"):
        model = nn.Sequential(Scaled())
    with pytest.raises(ValueError, match="After `param_init_fn` of `0` \\(Scaled\\), its parameter `weight`.*is on"
                                         " the meta device again"):
        materialize(model, CPU, param_init_fn=init)


def test_manual_wrap_inside_a_meta_device_context_makes_real_shards() -> None:
    """``init_module(empty_init=True)`` with ``wrap`` in the constructor: the unit is made while ``meta`` is the
    default device, but what it holds is real."""
    with torch.device("meta"), enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_kwargs()):
        net = Net()  # seeds the random state with 0: the unit starts from that
        net.blocks[0] = fairscale_wrap(net.blocks[0])
    unit = net.blocks[0]
    assert isinstance(unit, FullyShardedDataParallel)
    assert all(p.device == CPU for p in unit.parameters()) and net.inp.weight.is_meta
    with torch.device("meta"):
        block = small_block()
    torch.manual_seed(0)
    materialize(block, CPU)
    root = wrap(net)  # the rest, with the root
    assert torch.equal(full_parameters(root)["blocks.0.up.weight"], block.up.weight)


def test_to_device_keeping_meta_moves_the_rest() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].to_empty(device=CPU)
    to_device_keeping_meta(model, torch.device("cpu"))
    assert model[0].weight.device == CPU and model[1].weight.is_meta


def _materialise_on_rank(rank: int, world_size: int) -> dict[str, Any]:
    net = meta_net()
    torch.manual_seed(100 + rank)  # seeded apart: the ranks must still agree
    root = wrap(net, policy={Block})
    after = torch.rand(1)  # every rank continues from the same random state too
    return {"params": full_parameters(root), "after": after}


def test_every_rank_gets_the_weights_of_rank_0s_random_state(tmp_path: Path) -> None:
    dist.destroy_process_group()  # the fixture's: the ranks make their own
    try:
        ranks = run_ranks(_materialise_on_rank, 2, tmp_path)
    finally:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    expected = initialised_in_order(BLOCK_UNITS_ORDER, seed=100)
    for result in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, atol=0, rtol=0, msg=name)
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])
