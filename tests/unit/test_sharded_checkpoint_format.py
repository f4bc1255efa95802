"""sharded_checkpoint.py: splitting a checkpoint, the checks on loading one, and the offline consolidation.

Checkpoints of one rank are written from real FSDP units. Those of 2 and 3 ranks are built from them by hand with
FairScale's sharding rule (``torch.flatten(t).chunk(world_size)``, the short chunks padded with zeros: FairScale's
``FullyShardedDataParallel._get_shard``), which ``test_multirank.py`` checks against real ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fairscale.checkpoint.files import ShardedStorage
from lightning_fairscale.checkpoint.files import FORMAT_KEY
from lightning_fairscale.fsdp.state.sharded_checkpoint import check_fits, check_wrapping, consolidate, split_checkpoint
from lightning_fairscale.fsdp.unit.state_names import state_aliases

from .helpers import OPTIMIZERS, Block, Net, Sharded, assert_optimizer_states_equal, assert_tensors_equal, batches
from .helpers import param_groups, shard, split_by_hand, step, wrap

pytestmark = pytest.mark.usefixtures("process_group")

POLICY = {True: {nn.Linear}, False: {Block}}
TRAINER_STATE = {"epoch": 1, "global_step": 2, "loops": {"fit_loop": {"epoch_progress": 7}}}

#: Where these tests keep sharded checkpoints (what `ShardedCheckpointIO().sharded_storage()` gives).
STORAGE = ShardedStorage()



def trained(optimizer: str, flatten: bool) -> tuple[Sharded, nn.Module, torch.optim.Optimizer]:
    model, reference = Net(), Net()
    plain = OPTIMIZERS[optimizer](param_groups(reference, flatten))
    sharded = shard(model, OPTIMIZERS[optimizer](param_groups(model, flatten)), policy=POLICY[flatten], flatten=flatten)
    for batch in batches(2):
        step(sharded.root, sharded.optimizer, batch)
        step(reference, plain, batch)
    return sharded, reference, plain


def split(sharded: Sharded) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the strategy's sharded save hands to the CheckpointIO plugin on one rank."""
    checkpoint = {
        **TRAINER_STATE,
        "state_dict": sharded.root.local_state_dict(),
        "optimizer_states": [sharded.optimizer.state_dict()],
    }
    return split_checkpoint(
        checkpoint, sharded.root, sharded.layout, [sharded.optimizer], [sharded.orders], world_size=1
    )


def write(path: Path, meta: dict[str, Any], shards: list[dict[str, Any]]) -> Path:
    STORAGE.begin_sharded(path)
    for rank, shard_ in enumerate(shards):
        STORAGE.save_shard(shard_, path, rank, len(shards))
    STORAGE.commit_sharded({**meta, FORMAT_KEY: {**meta[FORMAT_KEY], "world_size": len(shards)}}, path, len(shards))
    return path


def test_split_checkpoint_puts_the_shards_apart_from_the_trainer_state() -> None:
    sharded, _, _ = trained("adam", flatten=True)
    meta, shard_ = split(sharded)
    assert {k: v for k, v in meta.items() if k != FORMAT_KEY} == TRAINER_STATE
    info = meta[FORMAT_KEY]
    assert (info["format_version"], info["world_size"]) == (2, 1)
    assert info["aliases"] == state_aliases(sharded.root)
    assert set(info["versions"]) == {"lightning_fairscale", "torch", "fairscale"}
    assert shard_["world_size"] == 1
    assert shard_["shard_metadata"] == sharded.root.local_metadata_dict()
    assert shard_["optimizer_states"] == [sharded.optimizer.state_dict()]
    assert sorted(shard_["state_dict"]) == ["blocks.0.down.flat_param_0", "blocks.0.up.flat_param_0",
                                            "blocks.1.down.flat_param_0", "blocks.1.up.flat_param_0",
                                            "flat_param_0", "inp.flat_param_0", "out.flat_param_0"]
    [layout] = shard_["optimizer_layouts"]
    assert len(layout["params"]) == len(sharded.layout.managed) == 7
    assert [len(order) for order in layout["orders"]] == [4, 12]
    assert len(layout["views"]) == 16  # one rank: one view per original parameter, over the whole of it




@pytest.mark.parametrize(
    ("optimizer", "flatten"),
    [("sgd", True), ("adam", True), ("adam", False)],
)
def test_consolidating_one_ranks_checkpoint_gives_the_full_checkpoint(
    tmp_path: Path, optimizer: str, flatten: bool
) -> None:
    sharded, reference, plain = trained(optimizer, flatten)
    meta, shard_ = split(sharded)
    full = consolidate(write(tmp_path / "last.ckpt", meta, [shard_]))
    assert {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")} == TRAINER_STATE
    assert_tensors_equal(full["state_dict"], reference.state_dict())
    [state] = full["optimizer_states"]
    assert_optimizer_states_equal(state, plain.state_dict())


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(("optimizer", "flatten"), [("sgd", True), ("adam", True), ("adam", False)])
def test_consolidating_several_ranks_checkpoint_gives_the_full_checkpoint(
    tmp_path: Path, optimizer: str, flatten: bool, world_size: int
) -> None:
    sharded, reference, plain = trained(optimizer, flatten)
    meta, shard_ = split(sharded)
    shards = split_by_hand(shard_, world_size)
    units = shards[-1]["shard_metadata"]["param_metadata"]
    paddings = [info["padding"] for unit in units for info in unit["params"].values()]
    assert any(paddings), "the shards should need padding, so that dropping it is tested"
    progress: list[str] = []
    full = consolidate(write(tmp_path / "last.ckpt", meta, shards), progress=progress.append)
    assert progress[0] == f"reading shard 1/{world_size}" and "consolidating optimizer 1/1" in progress
    assert_tensors_equal(full["state_dict"], reference.state_dict())
    assert_optimizer_states_equal(full["optimizer_states"][0], plain.state_dict())


def test_check_fits_tells_the_saving_world_size_and_refuses_foreign_files() -> None:
    assert check_fits({FORMAT_KEY: {"world_size": 2}}, "ckpts/last.ckpt") == 2  # any number of processes resumes it
    with pytest.raises(ValueError, match="not a sharded checkpoint written by lightning-fairscale"):
        check_fits({"epoch": 1}, "ckpts/last.ckpt")


def test_check_wrapping_refuses_a_model_wrapped_differently() -> None:
    sharded, _, _ = trained("sgd", flatten=True)
    _, shard_ = split(sharded)
    check_wrapping(shard_, wrap(Net(), policy={nn.Linear}), "last.ckpt")  # the same wrapping, another instance
    with pytest.raises(ValueError, match=r"wrapped differently \(FSDP units \['', 'inp', 'blocks.0.up'.*this run has "
                                         r"\['', 'blocks.0', 'blocks.1'\].*lightning-fairscale-consolidate"):
        check_wrapping(shard_, wrap(Net(), policy={Block}), "last.ckpt")
    with pytest.raises(ValueError, match="wrapped differently"):  # the same units, unflattened parameters
        check_wrapping(shard_, wrap(Net(), policy={nn.Linear}, flatten=False), "last.ckpt")
