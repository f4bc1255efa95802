"""The model's own parameters after wrapping (workaround 17) and tied parameters, on 2 real ranks and in process.

A tiny language model with tied input and output embeddings (``head.weight is embed.weight``), as HuggingFace's and
LitGPT's are, trained sharded on 2 forked ranks and compared with the same training unsharded in this process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.fsdp.unit.sharded_reads import ShardedParameter, local_reads

from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.unit.state_names import clean_path
from lightning_fairscale.fsdp.unit import original_params
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .helpers import fsdp_kwargs, run_ranks, shard, wrap

VOCAB, WIDTH, BATCH = 11, 6, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x)).relu()


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    named = dict(model.named_parameters())
    return [
        {"params": [p for n, p in named.items() if not n.endswith("bias")], "weight_decay": 0.1},
        {"params": [p for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH * world_size, 5), generator=g)
    part = ids[rank * BATCH : (rank + 1) * BATCH] if rank >= 0 else ids
    return part, part.roll(1, dims=1)


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))


STEPS = 3


def _rank_run(rank: int, world_size: int) -> dict[str, Any]:
    cpu_streams.install()
    model = TiedLM()
    optimizer = torch.optim.AdamW(_groups(model), lr=0.05)
    sharded = shard(model, optimizer, policy={Block}, min_num_params=0)
    out: dict[str, Any] = {"tied": model.head.weight is model.embed.weight}
    params = list(model.named_parameters())
    out["names"] = [clean_path(n) for n, _ in params]
    # Views (which know they are sharded: sharded_reads), not FairScale's flat parameters.
    out["plain_parameters"] = all(type(p) in (nn.Parameter, ShardedParameter) for _, p in params)
    out["optimizer_holds_them"] = optimizer.param_groups[0]["params"][0] is model.embed.weight and all(
        any(p is q for q in optimizer.param_groups[0]["params"] + optimizer.param_groups[1]["params"])
        for _, p in params
    )
    out["copies"] = [p.detach().clone() for p in copy.deepcopy([p for _, p in params])]
    out["grads"] = []
    for step in range(STEPS):
        loss = _loss(sharded.root, *_batch(step, rank, world_size))
        loss.backward()
        # Between the backward and the step: each attribute is the parameter, with its slice of the gradient (read
        # locally: what the optimizer sees; user code reads the whole, test_sharded_reads.py).
        with local_reads():
            out["grads"].append({clean_path(n): None if p.grad is None else p.grad.clone() for n, p in params})
            out.setdefault("sizes", {clean_path(n): p.numel() for n, p in params})
        optimizer.step()
        optimizer.zero_grad()
        with local_reads():
            out.setdefault("sums", []).append([float(p.sum()) for _, p in model.named_parameters()])
    # Accumulating (`no_sync`): each parameter's gradient is its slice of this rank's own gradient, not reduced yet.
    with sharded.root.no_sync():
        _loss(sharded.root, *_batch(STEPS, rank, world_size)).backward()
    with local_reads():
        out["local_grads"] = {clean_path(n): None if p.grad is None else p.grad.clone() for n, p in params}
    optimizer.zero_grad()
    # A later stage (`fit` after `validate`, or a second `fit`): its optimizer is made over `model.parameters()` of
    # the sharded model, and saves its state in their order, shaped like the plain module's parameters.
    later = torch.optim.Adam(model.parameters(), lr=0.0)  # state, without moving the weights
    wrapped = fsdp_engine.wrapped_model(sharded.root)
    wrapped.repoint(later)
    _loss(sharded.root, *_batch(0, rank, world_size)).backward()
    later.step()
    consolidated = wrapped.optimizer_state(later, sharded=False)
    out["later_state"] = {i: tuple(s["exp_avg"].shape) for i, s in consolidated.get("state", {}).items()}
    later.zero_grad()
    out["still_tied"] = model.head.weight is model.embed.weight
    out["same_objects"] = all(p is q for (_, p), (_, q) in zip(params, model.named_parameters()))
    state = wrapped.state_dict(sharded=False, is_global_zero=rank == 0)
    out["state_keys"] = sorted(state) if rank == 0 else None
    full = unwrap_module(sharded.root)
    out["unwrapped_tied"] = full.head.weight is full.embed.weight
    out["parameters"] = {n: p.detach().clone() for n, p in full.named_parameters()}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_rank_run, 2, tmp_path_factory.mktemp("original-params"))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    model = TiedLM()
    optimizer = torch.optim.AdamW(_groups(model), lr=0.05)
    grads = []
    for step in range(STEPS):
        _loss(model, *_batch(step, -1, 2)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return {
        "grads": grads,
        "parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": copy.deepcopy(model.state_dict()),
    }


@pytest.mark.workaround(17)
def test_the_attributes_are_the_optimizers_parameters_and_the_tie_holds(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["tied"] and r["still_tied"] and r["unwrapped_tied"]
        assert r["names"] == [n for n, _ in TiedLM().named_parameters()]  # one name per parameter, as unwrapped
        assert r["plain_parameters"], "no FairScale flat parameter among model.parameters()"
        assert r["optimizer_holds_them"]
        assert r["same_objects"], "the same parameter objects from step to step"


@pytest.mark.workaround(12)
def test_the_attributes_hold_this_ranks_slice_and_its_gradient(
    ranks: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    for name, expected in TiedLM().named_parameters():
        # The ranks' slices, in rank order, make the whole parameter (deep copies taken after setup).
        index = [n for n, _ in TiedLM().named_parameters()].index(name)
        joined = torch.cat([r["copies"][index] for r in ranks])
        torch.testing.assert_close(joined, expected.detach().reshape(-1), rtol=0, atol=0)
    for step in range(STEPS):
        for name, grad in reference["grads"][step].items():
            parts = [r["grads"][step][name] for r in ranks]
            for r, part in zip(ranks, parts):
                assert (part is None) == (r["sizes"][name] == 0), f"{name}: a gradient exactly where elements are"
            joined = torch.cat([p for p in parts if p is not None])
            torch.testing.assert_close(joined, grad.reshape(-1), rtol=0, atol=1e-6)


@pytest.mark.workaround(12)
def test_accumulating_parameters_hold_their_slice_of_this_ranks_own_gradient(
    ranks: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    for rank, r in enumerate(ranks):
        model = TiedLM()
        model.load_state_dict(reference["state"])
        _loss(model, *_batch(STEPS, rank, len(ranks))).backward()
        for name, param in model.named_parameters():
            before = sum(other["sizes"][name] for other in ranks[:rank])
            expected = param.grad.reshape(-1)[before : before + r["sizes"][name]]
            if r["sizes"][name] == 0:
                assert r["local_grads"][name] is None
                continue
            # This rank's own gradient (its half of the batch, its mean), not the average over the ranks.
            torch.testing.assert_close(r["local_grads"][name], expected, rtol=0, atol=1e-6)


@pytest.mark.workaround(17)
def test_training_equals_unsharded_and_the_full_state_dict_has_every_name(
    ranks: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    for r in ranks:
        for name, expected in reference["parameters"].items():
            torch.testing.assert_close(r["parameters"][name], expected, rtol=0, atol=1e-6)
    assert ranks[0]["state_keys"] == sorted(TiedLM().state_dict())  # `head.weight` as well as `embed.weight`


def test_a_later_stages_optimizer_saves_its_state_in_the_order_of_the_parameters(ranks: list[dict[str, Any]]) -> None:
    """The validate -> fit bug: an optimizer made over the sharded model's parameters saved the root unit's first."""
    shapes = {i: tuple(p.shape) for i, p in enumerate(TiedLM().parameters())}
    assert ranks[0]["later_state"] == shapes


def test_auto_wrap_keeps_a_tie_in_one_unit(process_group: Any) -> None:
    model = TiedLM()
    root = wrap(model, policy={nn.Embedding, nn.Linear, Block}, min_num_params=0)
    units = {clean_path(p + ".").rstrip(".") for p, m in root.named_modules()
             if isinstance(m, FullyShardedDataParallel)}
    assert "embed" not in units and "head" not in units  # they stay with the root, which holds both names
    assert {"blocks.0", "blocks.1"} <= units
    fsdp_engine.finish_wrapping(root, ParameterLayout().after_wrapping(root))  # wrapped by hand: originals installed
    assert model.head.weight is model.embed.weight


def test_a_unit_forgotten_inside_fairscales_layout_stays_in_it(process_group: Any) -> None:
    """``forget`` (before unwrapping) inside a ``fairscale_layout`` context: its end must not put the original
    parameters back on units that are FairScale's again for good."""
    root = wrap(TiedLM(), policy={Block}, min_num_params=0)
    fsdp_engine.finish_wrapping(root, ParameterLayout().after_wrapping(root))
    assert not any("flat_param" in name for name, _ in root.named_parameters())  # the originals are shown
    with original_params.fairscale_layout(root):
        original_params.forget(root)
    assert any("flat_param" in name for name, _ in root.named_parameters())  # FairScale's layout, as forget left it
    assert not original_params.is_installed(root)


def test_a_walk_skips_a_unit_met_before_with_everything_below_it(process_group: Any) -> None:
    """``named_modules`` of a unit holding the original parameters, given a ``memo`` that holds it: nothing, as
    torch's walk skips a module met before (a model that holds one unit under two names)."""
    root = wrap(TiedLM(), policy={Block}, min_num_params=0)
    fsdp_engine.finish_wrapping(root, ParameterLayout().after_wrapping(root))
    unit = next(m for m in root.modules() if isinstance(m, FullyShardedDataParallel) and m is not root)
    assert list(unit.named_modules(memo={unit})) == []
    parent = nn.ModuleDict({"a": unit, "b": unit})
    walked = list(parent.named_modules())
    assert len({id(module) for _, module in walked}) == len(walked)  # each module once
    assert walked[1:] == list(unit.named_modules(prefix="a")) and not any(name.startswith("b") for name, _ in walked)


def test_only_a_root_the_strategy_set_up_is_a_sharded_model(process_group: Any) -> None:
    """Issue 55's read-along finding: `wrapped_model` learnt the layout of a root wrapped by hand, a branch no front
    end reached (each asks only for a root `wrap_model` made); it is an error now."""
    root = wrap(TiedLM(), policy={Block}, min_num_params=0)
    with pytest.raises(ValueError, match="not the root of a model the strategy set up"):
        fsdp_engine.wrapped_model(root)


def test_a_manual_wrap_that_splits_a_tie_fails_naming_both_names(process_group: Any) -> None:
    model = TiedLM()
    model.embed = FullyShardedDataParallel(model.embed, **fsdp_kwargs())
    with pytest.raises(ValueError, match=r"`head\.weight` is tied to `embed\.weight`.*do not wrap either alone"):
        wrap(model, policy=None)


def test_a_tie_across_the_module_tree_is_written_under_both_names_offline(tmp_path: Path, process_group: Any) -> None:
    """A full state dict of the wrapped model holds every name, and loads strictly into a plain model."""
    model = TiedLM()
    root = wrap(model, policy={Block}, min_num_params=0)
    # A root wrapped by hand: its layout learnt, its originals installed.
    state = fsdp_engine.finish_wrapping(root, ParameterLayout().after_wrapping(root)).state_dict(False, True)
    plain = TiedLM()
    plain.load_state_dict(state, strict=True)
    assert plain.head.weight is plain.embed.weight


def test_a_term_on_the_parameters_outside_the_forward_reaches_their_gradients(process_group: Any) -> None:
    """An L2 term summed over ``model.parameters()`` after the forward: its gradient reaches the optimizer's
    parameters as it would unsharded (the views' own gradients are added to FairScale's)."""
    model, plain = TiedLM(), TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    sharded = shard(model, optimizer, policy={Block}, min_num_params=0)
    for step in range(2):
        ids, targets = _batch(step, -1, 1)
        for net, opt in ((sharded.root, optimizer), (plain, plain_optimizer)):
            loss = _loss(net, ids, targets)
            params = model.parameters() if net is sharded.root else plain.parameters()
            (loss + 0.5 * sum(p.pow(2).sum() for p in params)).backward()
            opt.step()
            opt.zero_grad()
    full = unwrap_module(sharded.root)
    for (name, expected), (_, actual) in zip(plain.named_parameters(), full.named_parameters()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
