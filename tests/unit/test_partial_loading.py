"""Partial loading (strict loading off) in the engine: a model whose code changed since the checkpoint (a layer
gone, one added) takes what fits from a full state dict or a sharded checkpoint of any world size, the rest keeps
its values, and the keys that did not fit come back as torch reports them; strict loading names them instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_fairscale.checkpoint.checks import RELAX_TRAINER, IncompatibleKeys
from lightning_fairscale.checkpoint.files import ShardedStorage
from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp.model import WrappedModel
from lightning_fairscale.checkpoint.fabric import Roles
from lightning_fairscale.checkpoint.files import FABRIC_RECORD, FORMAT_KEY
from lightning_fairscale import checkpointer
from lightning_fairscale.checkpointer import FabricLayout, Files, TrainerLayout
from lightning_fairscale.fsdp.state import saving
from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.state.saving import Ranks
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .helpers import OUT_FEATURES, Block, Net, assert_optimizer_states_equal, batches, parameters_of, run_ranks, step
from .helpers import wrap

#: What `PartialNet` lacks of `Net`'s state dict, and what it has more.
GONE = ["blocks.0.norm.weight", "blocks.0.norm.bias"]
NEW = ["extra.weight", "extra.bias"]
#: Each Block a unit (the first one's flat parameter loses its first pieces), the root holds `inp`, `out` and `extra`.
POLICIES = {"blocks": {Block}, "root-only": None}


class PartialNet(Net):
    """``Net`` after its code changed: the first block without its LayerNorm, and a new layer at the end."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.blocks[0].norm = nn.Identity()
        self.extra = nn.Linear(OUT_FEATURES, OUT_FEATURES)

    def forward(self, x: Tensor) -> Tensor:
        return self.extra(super().forward(x))


def wrapped(module: nn.Module, policy: Any = None, flatten: bool = True) -> WrappedModel:
    layout = ParameterLayout.before_wrapping(module)
    root = wrap(module, policy=policy, flatten=flatten)
    return WrappedModel(root, layout.after_wrapping(root))


def expected_after_partial_load(source: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    """The shared entries from ``source``, the new layer as ``PartialNet(seed)`` initialized it."""
    initial = parameters_of(PartialNet(seed))
    return {name: source[name] if name in source else value for name, value in initial.items()}


def assert_parameters(model: WrappedModel, expected: dict[str, Tensor]) -> None:
    actual = parameters_of(unwrap_module(model.root))
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def this_rank() -> Ranks:
    """This process on the default process group (one rank in-process, or forked ranks)."""
    return Ranks(torch.distributed.get_rank())


def save_sharded(model: WrappedModel, path: Path, optimizer: Any = None) -> None:
    ranks = this_rank()
    checkpoint: dict[str, Any] = {"state_dict": model.state_dict(True, ranks.is_global_zero)}
    if optimizer is not None:
        checkpoint["optimizer_states"] = [optimizer.state_dict()]
    optimizers = [optimizer] if optimizer is not None else []
    layout = TrainerLayout(version="2.6.0", owner="DDPFullyShardedStrategy")
    files = Files(ranks, ShardedStorage())
    checkpointer.save_sharded(model.settled(), files, path, {**checkpoint, "global_step": 3}, layout, optimizers)


def load_sharded(model: WrappedModel, path: Path, strict: bool, optimizer: Any = None) -> Any:
    if optimizer is not None:
        model.repoint(optimizer)

    def optimizers(meta: dict[str, Any], saved: int) -> list[tuple[int, Any]]:
        return [(0, optimizer)] if optimizer is not None else []

    storage = ShardedStorage()
    return saving.load_sharded(this_rank(), storage, path, model.settled(), optimizers, False, strict, RELAX_TRAINER)


@pytest.mark.parametrize("flatten", [True, False], ids=["flat", "unflattened"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_full_state_dict_loads_what_fits(process_group: None, policy: str, flatten: bool) -> None:
    source = Net(seed=0).state_dict()
    model = wrapped(PartialNet(seed=1), POLICIES[policy], flatten)
    with pytest.warns(UserWarning, match=r"strict loading off: the model's entries that the checkpoint lacks"):
        keys = model.load_full(source, strict=False)
    assert isinstance(keys, IncompatibleKeys)
    assert (sorted(keys.missing_keys), sorted(keys.unexpected_keys)) == (sorted(NEW), sorted(GONE))
    assert_parameters(model, expected_after_partial_load(source, seed=1))


def test_a_strict_load_names_the_keys_and_changes_nothing(process_group: None) -> None:
    model = wrapped(PartialNet(seed=1), {Block})
    with pytest.raises(ValueError, match=r"missing keys \[extra.weight, extra.bias\]; unexpected keys "
                                         r"\[blocks.0.norm.weight, blocks.0.norm.bias\].*strict_loading = False"):
        model.load_full(Net(seed=0).state_dict(), strict=True, relax=RELAX_TRAINER)
    assert_parameters(model, parameters_of(PartialNet(seed=1)))


def test_shapes_that_differ_stay_an_error(process_group: None) -> None:
    source = Net(seed=0).state_dict()
    source["out.bias"] = torch.zeros(OUT_FEATURES + 1)
    with pytest.raises(ValueError, match=r"different shapes for \[out.bias: checkpoint \(3,\), model \(2,\)\]"):
        wrapped(PartialNet(seed=1), {Block}).load_full(source, strict=False)


class WithBuffers(nn.Module):
    """A persistent buffer (in the state dict) and a non-persistent one (not in it: never a missing key)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("scale", torch.full((2,), 2.0), persistent=False)


def test_buffers_load_by_name_and_non_persistent_ones_are_not_expected(process_group: None) -> None:
    source = WithBuffers()
    source.count += 5
    model = wrapped(WithBuffers())
    assert model.load_full(source.state_dict(), strict=True) == IncompatibleKeys([], [])
    assert model.root.module.count.item() == 5  # type: ignore[union-attr]
    # A buffer the checkpoint lacks keeps its value.
    without = {k: v for k, v in source.state_dict().items() if k != "count"}
    fresh = wrapped(WithBuffers())
    with pytest.warns(UserWarning, match=r"keep their values \(1\): \[count\]"):
        assert fresh.load_full(without, strict=False) == IncompatibleKeys(["count"], [])
    assert fresh.root.module.count.item() == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_sharded_checkpoint_loads_what_fits_by_name(process_group: None, tmp_path: Path, policy: str) -> None:
    save_sharded(wrapped(Net(seed=0), {Block}), tmp_path / "ck")
    model = wrapped(PartialNet(seed=1), POLICIES[policy])
    with pytest.warns(UserWarning, match=r"strict loading off: .*the checkpoint's entries that the model lacks"):
        meta, keys = load_sharded(model, tmp_path / "ck", strict=False)
    assert meta == {"global_step": 3}
    assert (sorted(keys.missing_keys), sorted(keys.unexpected_keys)) == (sorted(NEW), sorted(GONE))
    assert_parameters(model, expected_after_partial_load(Net(seed=0).state_dict(), seed=1))
    # Strict: the keys are named before anything loads (not the wrapping, which differs too).
    strict_model = wrapped(PartialNet(seed=1), POLICIES[policy])
    with pytest.raises(ValueError, match=r"missing keys \[extra.weight, extra.bias\].*strict_loading = False"):
        load_sharded(strict_model, tmp_path / "ck", strict=True)
    assert_parameters(strict_model, parameters_of(PartialNet(seed=1)))


def test_a_sharded_optimizer_state_does_not_follow_the_parameters_by_name(process_group: None, tmp_path: Path) -> None:
    """The model's state finds its parameters by name; the optimizer's, laid out over the saved flat parameters,
    cannot: a stateful optimizer is refused clearly, a stateless one loads."""
    for name, make in {"adam": torch.optim.Adam, "plain-sgd": torch.optim.SGD}.items():
        source = Net(seed=0)
        optimizer = make(source.parameters(), lr=0.1)
        model = wrapped(source, {Block})
        model.repoint(optimizer)
        step(model.root, optimizer, batches(1)[0])
        save_sharded(model, tmp_path / name, optimizer)
        target = PartialNet(seed=1)
        count = len(list(target.parameters()))
        fresh_optimizer = make(target.parameters(), lr=0.1)
        partial = wrapped(target, {Block})
        if name == "adam":
            with pytest.raises(ValueError, match="optimizer state is laid out over that model's FSDP parameters"):
                load_sharded(partial, tmp_path / name, strict=False, optimizer=fresh_optimizer)
        else:
            with pytest.warns(UserWarning, match="strict loading off"):
                load_sharded(partial, tmp_path / name, strict=False, optimizer=fresh_optimizer)
            assert fresh_optimizer.state_dict()["param_groups"][0]["params"] == list(range(count))  # views of all
            assert not fresh_optimizer.state_dict()["state"]


def test_the_checkpoint_service_takes_plain_values_in_fabrics_layout(process_group: None, tmp_path: Path) -> None:
    """The checkpointer alone, fed plain values (no strategy): ``fabric.save``'s state in Fabric's layout, the
    roles recorded with it, then into another model and optimizer, the state's other entries restored in place."""
    source = Net(seed=0)
    optimizer = torch.optim.Adam(source.parameters(), lr=0.1)
    model = wrapped(source, {Block})
    model.repoint(optimizer)
    step(model.root, optimizer, batches(1)[0])
    state = {"model": model.root, "optimizer": optimizer, "step": 3}
    files, path = Files(this_rank(), ShardedStorage()), tmp_path / "ck"
    checkpointer.save_sharded(model.settled(), files, path, state, FabricLayout(Roles.of(state, lambda m: True)))
    meta = files.storage.load_meta(path)
    assert meta[FORMAT_KEY][FABRIC_RECORD] == {"model": "model", "optimizers": ["optimizer"]} and meta["step"] == 3

    target_module = Net(seed=1)
    fresh = torch.optim.Adam(target_module.parameters(), lr=0.1)
    target = wrapped(target_module, {Block})
    target.repoint(fresh)
    into = {"model": target.root, "optimizer": fresh, "step": 0}
    layout = FabricLayout(Roles.of(into, lambda m: True))
    rest = checkpointer.load(target.settled(), files, path, layout, True, False, state=into)
    assert rest == {} and into["step"] == 3
    assert_optimizer_states_equal(target.optimizer_state(fresh, False), model.optimizer_state(optimizer, False), 0)
    assert_parameters(target, parameters_of(unwrap_module(model.root)))


# ----------------------------------------------------------------------------------------------------------------
# Several ranks: saved by 2, loaded by 2 and by 3 (padding moves, pieces straddle the shards)


def save_on_ranks(rank: int, world_size: int, path: Path) -> None:
    cpu_streams.install()
    save_sharded(wrapped(Net(seed=0), {Block}), path)


def load_on_ranks(rank: int, world_size: int, path: Path, policy: str) -> dict[str, Any]:
    cpu_streams.install()
    sharded = wrapped(PartialNet(seed=1), POLICIES[policy])
    _, keys = load_sharded(sharded, path, strict=False)
    full = wrapped(PartialNet(seed=1), POLICIES[policy])  # the full state dict's path, on these ranks too
    full.load_full(Net(seed=0).state_dict(), strict=False)
    return {
        "keys": keys,
        "sharded": parameters_of(unwrap_module(sharded.root)),
        "full": parameters_of(unwrap_module(full.root)),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_partial_loads_on_several_ranks(tmp_path: Path, world_size: int) -> None:
    path = tmp_path / "ck"
    for directory in ("save", *(f"load-{policy}" for policy in POLICIES)):
        (tmp_path / directory).mkdir()
    run_ranks(save_on_ranks, 2, tmp_path / "save", path)
    expected = expected_after_partial_load(Net(seed=0).state_dict(), seed=1)
    for policy in POLICIES:
        for result in run_ranks(load_on_ranks, world_size, tmp_path / f"load-{policy}", path, policy):
            assert (sorted(result["keys"].missing_keys), sorted(result["keys"].unexpected_keys)) == (
                sorted(NEW), sorted(GONE)
            )
            for kind in ("sharded", "full"):
                assert sorted(result[kind]) == sorted(expected)
                for name, value in expected.items():
                    assert torch.equal(result[kind][name], value), (kind, name)
