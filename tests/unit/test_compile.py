"""Regional compilation (workaround 18, ``fsdp/wrapping/compile.py``) in process, on a one-rank gloo group with
``aot_eager``: what is compiled, the names and keys, a compile around the units, giving the layers back. The 2-process
trainings, each form of compile and inductor, are in ``tests/test_compile.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import Block
from torch import nn

from lightning_fairscale.fsdp.wrapping.activation_checkpointing import apply_activation_checkpointing
from lightning_fairscale.fsdp.wrapping.compile import compile_regions, is_compiled, take_compiled, uncompile_regions
from lightning_fairscale.fsdp.unit.state_names import clean_path

from .helpers import Net, batches, shard

BACKEND = "aot_eager"


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for x, y in batches(steps):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.workaround(18)
def test_compiled_layers_train_as_eager_ones_and_keep_their_names(process_group: Any) -> None:
    torch._dynamo.reset()
    reference = Net()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    _train(reference, reference_optimizer)

    model = Net()
    model.blocks[0] = torch.compile(model.blocks[0], backend=BACKEND)  # compiled in `__init__`
    targets = take_compiled(model, torch.compile(backend=BACKEND))  # and `torch.compile(model)`
    assert [type(m).__name__ for m, _ in targets] == ["Block", "Net"]
    assert not [n for n, _ in model.named_parameters() if "_orig_mod" in n]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    checkpointed = apply_activation_checkpointing(model, (Block,))
    sharded = shard(model, optimizer, policy={Block}, min_num_params=0)
    regions = compile_regions(model, targets)
    # The largest modules without a unit: `inp`, each block (inside its unit), `out`; never the top module.
    assert [type(r).__name__ for r in regions] == ["Block", "Linear", "Block", "Linear"]
    assert all(is_compiled(r) for r in (model.inp, model.out, *checkpointed))
    # A compile around the units, `fullgraph=True` even (Fabric compiles the model its strategy returns): the units
    # run eagerly, the regions compiled.
    outer = torch.compile(sharded.root, backend=BACKEND, fullgraph=True)
    _train(outer, optimizer)
    state = sharded.root.state_dict()
    assert sorted(state) == sorted(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)
    assert {clean_path(n) for n, _ in model.named_parameters()} == {n for n, _ in reference.named_parameters()}

    uncompile_regions(model)
    assert not any(is_compiled(m) for m in model.modules())
    assert all("forward" not in m.__dict__ for m in (model.inp, model.out))
    assert all(m.__dict__["forward"].inner is Block.forward for m in checkpointed)  # the checkpoint's own again


def test_a_model_with_nothing_to_compile_runs_eagerly_with_a_warning(process_group: Any) -> None:
    from lightning_fairscale.fsdp import engine as fsdp_engine
    from lightning_fairscale.fsdp.config import FullyShardedConfig
    from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups

    model = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="no layer outside FSDP's units to compile"):
        wrapped = fsdp_engine.wrap_model(
            FullyShardedConfig(), model, torch.device("cpu"), ProcessGroups(), "32-true",
            compiler=torch.compile(backend=BACKEND),
        )
    assert not any(is_compiled(m) for m in wrapped.root.modules())
    wrapped.root(torch.ones(1, 3)).sum().backward()


def test_the_engine_refuses_a_compile_wrapper_for_the_model(process_group: Any) -> None:
    with pytest.raises(ValueError, match="still a `torch.compile` wrapper"):
        take_compiled(torch.compile(nn.Linear(3, 2), backend=BACKEND))
