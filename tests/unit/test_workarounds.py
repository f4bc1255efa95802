"""The table of FairScale workarounds (``fsdp/patches/workarounds.py``) and the tests marked with its numbers; and
the in-process tests of the workarounds no other unit test covers (8, 14, 22, 23, 27)."""

from __future__ import annotations

import ast
import importlib.util
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from fairscale.nn import checkpoint_wrapper
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_fairscale.fsdp.patches import cpu_streams, hybrid, prefetch
from lightning_fairscale.fsdp.patches.workarounds import WORKAROUNDS, table
from lightning_fairscale.fsdp.unit import gathered
from lightning_fairscale.fsdp.wrapping.activation_checkpointing import apply_activation_checkpointing

from .helpers import Block, Net, batches, run_ranks, wrap

TESTS = Path(__file__).resolve().parents[1]


def marked_tests() -> dict[int, set[str]]:
    """Number -> the tests marked ``@pytest.mark.workaround(number)`` (``"tests/unit/test_x.py::test_y"``), read from
    the test files' sources (nothing is run or collected)."""
    marked: dict[int, set[str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for decorator in node.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                if call is not None and ast.unparse(call.func) == "pytest.mark.workaround":
                    (number,) = [ast.literal_eval(arg) for arg in call.args]
                    name = f"{path.relative_to(TESTS.parent).as_posix()}::{node.name}"
                    marked.setdefault(number, set()).add(name)
    return marked


def test_the_table_is_numbered_from_1_without_gaps_and_names_real_modules() -> None:
    assert [w.number for w in WORKAROUNDS] == list(range(1, len(WORKAROUNDS) + 1))
    for w in WORKAROUNDS:
        assert importlib.util.find_spec(f"lightning_fairscale.{w.module}") is not None, (w.number, w.module)
        assert w.title and w.devices and w.fairscale_does and w.our_fix, w.number


def test_every_workaround_has_a_marked_test_and_every_marker_a_workaround() -> None:
    marked = marked_tests()
    numbers = {w.number for w in WORKAROUNDS}
    assert sorted(numbers - set(marked)) == [], "workarounds without a test marked @pytest.mark.workaround(number)"
    assert sorted(set(marked) - numbers) == [], "markers that name no workaround of the table"


def test_each_workarounds_record_names_its_marked_tests() -> None:
    """The table's column of tests is the markers: a marker added or removed is named in the record too."""
    marked = marked_tests()
    differ = {w.number: (sorted(w.tests), sorted(marked.get(w.number, ()))) for w in WORKAROUNDS}
    assert {n: pair for n, pair in differ.items() if pair[0] != pair[1]} == {}


def test_the_module_docstring_holds_the_table() -> None:
    from lightning_fairscale.fsdp.patches import workarounds

    assert workarounds.__doc__ is not None and table() in workarounds.__doc__
    assert table().count("\n   * - ") == len(WORKAROUNDS) + 1  # the header and one row each


# ------------------------------------------------------------------------------------------------------------------
# Workaround 8: gradient shards reduced through FairScale's bucket are views into its buffer.


def _gradient_storage(rank: int, world_size: int) -> list[tuple[int, int]]:
    cpu_streams.install()  # workaround 1, in this forked rank only (the engine holds it while a model lives)
    root = wrap(Net(), policy={Block})  # each unit far below the 1 MB bucket: reduced together
    x, y = (t[rank::world_size] for t in batches(1)[0])  # this rank's share of the batch
    nn.functional.mse_loss(root(x), y).backward()
    flat = [p for unit in root.modules() if isinstance(unit, type(root)) for p in unit.params]
    return [(p.grad.untyped_storage().nbytes(), p.grad.numel() * p.grad.element_size()) for p in flat]


@pytest.mark.workaround(8)
def test_gradient_shards_reduced_in_a_bucket_hold_only_their_own_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through FairScale's (gloo) bucketer, as on CUDA (the CPU's overlapping reducer is turned off): each unit's
    gradient shard holds its own bytes, not the bucket's whole buffer (1 MB)."""
    monkeypatch.setattr(prefetch, "OVERLAP_ON_CPU", False)  # the forked ranks inherit it
    for storages in run_ranks(_gradient_storage, 2, tmp_path):
        assert len(storages) == 3
        assert all(storage == own for storage, own in storages), storages


# ------------------------------------------------------------------------------------------------------------------
# Workaround 14: hybrid sharding, which FairScale does not know.


def _hybrid_state(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    cpu_streams.install()  # workaround 1, in this forked rank only
    all_gather, reduce_scatter, replicas = hybrid.hybrid_groups((2, 1), rank, timeout=timedelta(seconds=30))
    root = wrap(
        Net(), policy={Block}, process_group=all_gather, process_group_reduce_scatter=reduce_scatter,
        replica_group=replicas,
    )
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1)
    for batch in batches(2):
        x, y = (t[rank::world_size] for t in batch)  # this rank's half of the global batch
        nn.functional.mse_loss(root(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    with root.summon_full_params():
        return {name: value.clone() for name, value in root.state_dict().items()}


@pytest.mark.workaround(14)
def test_two_replicas_of_one_shard_each_train_as_unsharded(tmp_path: Path) -> None:
    """Two ranks, each its own shard group and the two of them replicas: two SGD steps give plain training's
    parameters on the whole batch (each rank's gradient averaged over the replicas)."""
    plain = Net()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in batches(2):
        nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for state in run_ranks(_hybrid_state, 2, tmp_path):
        for (name, want), got in zip(plain.state_dict().items(), state.values()):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------------------------
# Workaround 27: FairScale keeps the root gathered after a forward without a backward (an evaluation).


def _output_after_the_shards_change(rank: int, world_size: int) -> torch.Tensor:
    cpu_streams.install()  # workaround 1, in this forked rank only
    root = wrap(Net(), policy={Block})
    x, y = (t[rank::world_size] for t in batches(1)[0])
    nn.functional.mse_loss(root(x), y).backward()  # a training step's forward and backward: everything set up
    with torch.no_grad():
        root(x)  # an evaluation: the root keeps its full parameters
        for param in root.params:  # the root's own parameters (``inp``, ``out``) written in their shards, as weight
            param._fp32_shard.zero_()  # averaging's swap does
        gathered.drop_full_params(root)
        return root(x)


@pytest.mark.workaround(27)
def test_a_forward_after_an_evaluation_sees_what_was_written_into_the_shards(tmp_path: Path) -> None:
    """The root's ``out`` layer zeroed in its shards after an evaluation's forward: the next forward gives zeros."""
    for output in run_ranks(_output_after_the_shards_change, 2, tmp_path):
        assert torch.equal(output, torch.zeros_like(output)), output


# ------------------------------------------------------------------------------------------------------------------
# Workaround 22: FairScale's checkpoint_wrapper recomputed a layer without the forward's autocast.


def _gradients_under_cpu_autocast(model: nn.Module) -> list[torch.Tensor]:
    x, y = batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.workaround(22)
def test_activation_checkpointing_recomputes_under_the_forwards_autocast() -> None:
    """The gradients of a checkpointed model under CPU autocast (bf16) are those of the plain model, exactly; with
    FairScale's ``checkpoint_wrapper`` (what the strategy used before) the recomputation runs without autocast and
    fails here (on GPT-2's attention it gave wrong gradients silently)."""
    expected = _gradients_under_cpu_autocast(Net())
    model = Net()
    assert apply_activation_checkpointing(model, (Block,)) == list(model.blocks)
    for got, want in zip(_gradients_under_cpu_autocast(model), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    fairscale = Net()
    for index, block in enumerate(fairscale.blocks):
        fairscale.blocks[index] = checkpoint_wrapper(block)
    with pytest.raises(RuntimeError, match="must have the same dtype"):  # recomputed without autocast: bf16 meets fp32
        _gradients_under_cpu_autocast(fairscale)


# ------------------------------------------------------------------------------------------------------------------
# Workaround 23: the model's own (torch's non-reentrant) checkpoint around a unit.


class _CheckpointingNet(Net):
    """``Net`` whose forward runs each block through torch's non-reentrant checkpoint, as Hugging Face's
    ``gradient_checkpointing_enable`` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.out(x)


@pytest.mark.workaround(23)
@pytest.mark.usefixtures("process_group")
def test_a_unit_inside_torchs_checkpoint_recomputes_and_trains_as_unsharded() -> None:
    """Each block a unit, recomputed by torch's checkpoint inside the backward: two steps give the plain model's
    gradients and parameters."""
    plain, root = _CheckpointingNet(), wrap(_CheckpointingNet(), policy={Block})
    assert sum(isinstance(m, type(root)) for m in root.modules()) == 3
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, root)]
    for x, y in batches(2):
        for model, optimizer in zip((plain, root), optimizers):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    with root.summon_full_params():
        for (name, want), got in zip(plain.state_dict().items(), root.state_dict().values()):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
