"""fsdp/patches/bookkeeping.py: FairScale's per-step bookkeeping, the same effect for less Python work."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module
from torch import nn

from lightning_fairscale.fsdp.patches import bookkeeping
from lightning_fairscale.fsdp.unit import units as fsdp_units

from .helpers import Block, Net, batches, step, wrap

pytestmark = pytest.mark.usefixtures("process_group")


def test_a_step_writes_fairscales_plain_state_without_modules_setattr(monkeypatch: pytest.MonkeyPatch) -> None:
    root = wrap(Net(), policy={Block})
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1)
    step(root, optimizer, batches(1)[0])  # the first step initialises lazily: new attributes
    written: list[str] = []
    module_setattr = nn.Module.__setattr__

    def counted(self: nn.Module, name: str, value: Any) -> None:
        if isinstance(self, fsdp_module.FullyShardedDataParallel):
            written.append(name)
        module_setattr(self, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", counted)
    states: list[Any] = []
    monkeypatch.setattr(fsdp_units.FullyShardedDataParallel, "_rebuild_full_params", _spy(states))
    step(root, optimizer, batches(2)[1])
    assert states, "the step did not run FairScale's bookkeeping"
    assert written == []  # with the unit class's `__setattr__` removed, FairScale's dozens come back


def _spy(states: list[Any]) -> Any:
    rebuild = fsdp_units.FullyShardedDataParallel._rebuild_full_params

    def spied(self: Any, *args: Any, **kwargs: Any) -> Any:
        states.append(self.training_state)
        return rebuild(self, *args, **kwargs)

    return spied


def test_set_attribute_still_registers_parameters_modules_and_buffers() -> None:
    set_attribute = fsdp_units.FullyShardedDataParallel.__setattr__  # the unit class's, on a plain module
    module = nn.Linear(2, 2)
    set_attribute(module, "extra", nn.Parameter(torch.ones(1)))
    set_attribute(module, "child", nn.ReLU())
    module.register_buffer("scale", torch.ones(1))
    set_attribute(module, "scale", torch.zeros(1))
    set_attribute(module, "flag", True)
    set_attribute(module, "flag", False)  # now a plain attribute: written directly
    assert module.flag is False
    set_attribute(module, "flag", nn.ReLU())  # a plain attribute given a module: registered
    assert "flag" in module._modules and "flag" not in module.__dict__
    set_attribute(module, "plain", 1)
    set_attribute(module, "plain", nn.Parameter(torch.ones(1)))
    assert "plain" in module._parameters and "plain" not in module.__dict__
    assert dict(module.named_parameters())["extra"] is module.extra
    assert dict(module.named_children()) == {"child": module.child, "flag": module.flag}
    assert torch.equal(dict(module.named_buffers())["scale"], torch.zeros(1))
    with pytest.raises(TypeError, match="cannot assign"):  # a parameter's name still takes only a parameter
        set_attribute(module, "weight", 3)


class Normed(nn.Module):
    """A block with buffers of every kind: float (cast to the unit's dtype), integer (moved only), ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)  # running_mean/var (float), num_batches_tracked (int64)
        self.register_buffer("empty", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class Pair(nn.Sequential):
    """Two ``Normed`` and a buffer of its own: a unit with units inside."""

    def __init__(self) -> None:
        super().__init__(Normed(), Normed())
        self.register_buffer("offset", torch.zeros(2))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Normed(), Pair(), Normed())
    model.register_buffer("scale", torch.ones(2))  # the root unit's own
    return model


def _units_with_buffer_dtypes() -> nn.Module:
    root = wrap(_model(), policy={Normed, Pair})
    inner = [m for m in root.modules() if isinstance(m, fsdp_module.FullyShardedDataParallel) and m is not root]
    for index, unit in enumerate(inner):  # each unit its own buffer dtype: the innermost unit decides
        unit.buffer_dtype = (torch.float16, torch.bfloat16, torch.float64)[index % 3]
    root.buffer_dtype = torch.float32
    return root


@pytest.mark.parametrize("dtype", [None, torch.float32])  # float32 as a state dict asks: no unit's own dtype
def test_cast_buffers_equals_fairscales_with_each_unit_deciding_for_its_modules(
    dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _units_with_buffer_dtypes()
    bookkeeping.cast_buffers(root, dtype=dtype)
    fairscales = _units_with_buffer_dtypes()
    # FairScale's own walk throughout: each unit it reaches calls `_cast_buffers` of the units inside it.
    fairscale_cast = fsdp_module.FullyShardedDataParallel._cast_buffers
    monkeypatch.setattr(fsdp_units.FullyShardedDataParallel, "_cast_buffers", fairscale_cast)
    fairscales._cast_buffers(dtype=dtype)
    ours = {name: (b.dtype, b.device) for name, b in root.named_buffers()}
    assert ours == {name: (b.dtype, b.device) for name, b in fairscales.named_buffers()}
    floats = {d for d, _ in ours.values()} - {torch.int64}
    assert floats == ({torch.float16, torch.bfloat16, torch.float64, torch.float32} if dtype is None else {dtype})
    if dtype is None:  # a unit's own buffer takes its dtype, not the units' inside it nor the root's
        pair = next(m for m in root.modules() if isinstance(m, fsdp_module.FullyShardedDataParallel) and any(
            isinstance(c, Pair) for c in m.modules()) and m is not root)
        assert next(b for n, b in pair.named_buffers() if n.endswith("offset")).dtype == pair.buffer_dtype


class _AskedSet(set):
    """A memo that records each module it is asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[nn.Module] = []

    def __contains__(self, module: object) -> bool:
        self.asked.append(module)  # type: ignore[arg-type]
        return super().__contains__(module)


def test_a_units_cast_buffers_visits_each_module_once() -> None:
    root = wrap(_model(), policy={Normed})
    memo = _AskedSet()
    root._cast_buffers(memo=memo)
    assert sorted(map(id, memo.asked)) == sorted(map(id, root.modules()))
    memo = _AskedSet()
    fsdp_module.FullyShardedDataParallel._cast_buffers(root, memo=memo)  # FairScale's: again for each unit above
    assert len(memo.asked) > len(list(root.modules()))
