"""Fabric's checkpoints (``lightning_fairscale.checkpoint.fabric``): ``fabric.save`` writes the keys of the state,
as Lightning's Fabric does, and ``fabric.load`` reads them, the Trainer's files and the files of the previous version.

Each test launches Fabric on one CPU process, in this process, with FSDP (each ``Block`` a unit) or sharded DDP, and
compares with a plain ``Net`` trained by the same steps without Fabric (one rank: exactly the same).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_fabric import Fabric
from lightning_fabric.wrappers import _unwrap_objects
from torch import nn

from lightning_fairscale.checkpoint.fabric import FABRIC_KEYS, is_trainer_layout, to_trainer_layout
from lightning_fairscale.checkpoint.files import FABRIC_RECORD, FORMAT_KEY
from lightning_fairscale.fsdp.state.sharded_checkpoint import consolidate
from lightning_fairscale.plugins.checkpoint_io import META_FILE, ShardedCheckpointIO, shard_file_name
from lightning_fairscale.fabric import DDPFullyShardedStrategy, DDPShardedStrategy

from .helpers import (
    Block,
    Net,
    assert_optimizer_states_equal,
    assert_tensors_equal,
    batches,
    fabric_on_one_process,
    run_ranks,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "fabric_0x"
STRATEGIES = {"fsdp": lambda: DDPFullyShardedStrategy(auto_wrap_policy={Block}), "ddp_sharded": DDPShardedStrategy}
BATCHES = batches(2)


@pytest.fixture(params=list(STRATEGIES))
def fabric(request: pytest.FixtureRequest) -> Iterator[Fabric]:
    yield from _launched(request.param)


@pytest.fixture
def fsdp() -> Iterator[Fabric]:
    yield from _launched("fsdp")


def _launched(name: str) -> Iterator[Fabric]:
    """Fabric on one process of a gloo group in this process (:func:`~unit.helpers.fabric_on_one_process`)."""
    with fabric_on_one_process(STRATEGIES[name]()) as fabric:
        yield fabric


def objects(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = Net(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def train(fabric: Any, model: nn.Module, optimizer: Any, scheduler: Any, steps: range) -> None:
    for index in steps:
        x, y = BATCHES[index]
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss) if fabric is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def set_up(fabric: Fabric, seed: int = 0) -> dict[str, Any]:
    """A state to save or load: a model, its optimizer and LR scheduler set up with ``fabric``, and a step count."""
    model, optimizer, scheduler = objects(seed)
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)  # it follows sharded DDP's OSS
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}


def plain(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The same objects without Fabric, trained ``steps`` steps."""
    model, optimizer, scheduler = objects()
    train(None, model, optimizer, scheduler, range(steps))
    return model, optimizer, scheduler


def saved(fabric: Fabric, path: Path, sharded: bool = False) -> dict[str, Any]:
    """The state after one step, saved to ``path`` (a sharded checkpoint with ``sharded``)."""
    state = set_up(fabric)
    train(fabric, state["model"], state["optimizer"], state["scheduler"], range(1))
    state["step"] = 1
    if sharded:
        fabric.strategy.state_dict_type = "sharded"
    fabric.save(path, state)
    return state


def assert_resumes_exactly(fabric: Fabric, state: dict[str, Any]) -> None:
    """``state`` holds the objects after one step: the second step gives plain training's second step."""
    model, optimizer, scheduler = plain(1)
    assert_tensors_equal(weights(fabric, state["model"]), model.state_dict())
    assert state["scheduler"].state_dict() == scheduler.state_dict()
    train(fabric, state["model"], state["optimizer"], state["scheduler"], range(1, 2))
    train(None, model, optimizer, scheduler, range(1, 2))
    assert_tensors_equal(weights(fabric, state["model"]), model.state_dict())


def weights(fabric: Fabric, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model set up with ``fabric`` (the unwrapped module's keys)."""
    return fabric.strategy.get_module_state_dict(_unwrap_objects(model))


def trainer_checkpoint() -> dict[str, Any]:
    """What the Trainer saves of the plain objects after one step."""
    model, optimizer, scheduler = plain(1)
    return {
        "state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()], "pytorch-lightning_version": "2.6.0", "global_step": 1,
        "loops": {"fit_loop": {}},
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# What fabric.save writes


def test_a_full_checkpoint_holds_the_states_under_the_states_keys(fabric: Fabric, tmp_path: Path) -> None:
    saved(fabric, tmp_path / "full.ckpt")
    file = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert list(file) == ["model", "optimizer", "scheduler", "step"]  # as Fabric writes them, nothing else
    model, optimizer, scheduler = plain(1)
    assert_tensors_equal(file["model"], model.state_dict())  # the unwrapped module's keys
    assert_optimizer_states_equal(file["optimizer"], optimizer.state_dict())  # a plain Adam over it
    assert (file["scheduler"], file["step"]) == (scheduler.state_dict(), 1)
    assert not is_trainer_layout(file)


def test_filter_keeps_what_fabric_keeps(fsdp: Fabric, tmp_path: Path) -> None:
    """Each filter picks items of its entry's state dict; an entry left with none is not written (as Fabric)."""
    state = set_up(fsdp)
    biases = {"model": lambda key, _: key.endswith("bias"), "optimizer": lambda *_: False}
    fsdp.save(tmp_path / "f.ckpt", state, filter=biases)
    file = torch.load(tmp_path / "f.ckpt", weights_only=True)
    assert list(file) == ["model", "scheduler", "step"]
    assert sorted(file["model"]) == sorted(key for key in Net().state_dict() if key.endswith("bias"))


def test_a_filtered_sharded_checkpoint_holds_and_loads_what_the_filter_kept(fsdp: Fabric, tmp_path: Path) -> None:
    """Issue 48 item 3c: a sharded save filters as Lightning's FSDPStrategy filters (the model's keys, the other
    entries' top-level keys); it loads with ``strict=False`` the keys kept, the others keep their values, and it
    consolidates into the full checkpoint's kept keys. Only the blocks' keys here: the root unit's flat parameter
    (``inp``, ``out``) is not written at all."""
    state = saved(fsdp, tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    fsdp.strategy.state_dict_type = "sharded"
    blocks = {
        "model": lambda key, value: key.startswith("blocks.") and value is not None,  # the module's tensor is given
        "optimizer": lambda *_: False,
    }
    fsdp.save(tmp_path / "s.ckpt", state, filter=blocks)
    kept = sorted(key for key in full["model"] if key.startswith("blocks."))
    meta = torch.load(tmp_path / "s.ckpt" / META_FILE, weights_only=True)
    record = meta[FORMAT_KEY][FABRIC_RECORD]
    assert (record["model"], record["optimizers"], sorted(record["kept"])) == ("model", [], kept)
    shard = torch.load(tmp_path / "s.ckpt" / shard_file_name(0, 1), weights_only=False)
    assert [key for key in shard["state_dict"] if "flat_param" in key and not key.startswith("blocks.")] == []
    consolidated = consolidate(tmp_path / "s.ckpt")
    assert sorted(consolidated) == ["model", "scheduler", "step"]
    assert_tensors_equal(consolidated["model"], {key: full["model"][key] for key in kept}, atol=0)

    other = set_up(fsdp, seed=1)  # other weights everywhere: the blocks come from the checkpoint, the rest stays
    before = weights(fsdp, other["model"])
    with pytest.raises(ValueError, match=r"missing keys \[inp.weight, inp.bias, out.weight, out.bias\]"):  # strict
        fsdp.load(tmp_path / "s.ckpt", {"model": other["model"]})
    assert_tensors_equal(weights(fsdp, other["model"]), before, atol=0)
    fsdp.load(tmp_path / "s.ckpt", {"model": other["model"]}, strict=False)
    loaded = weights(fsdp, other["model"])
    assert_tensors_equal({k: loaded[k] for k in kept}, {k: full["model"][k] for k in kept}, atol=0)
    rest = [key for key in before if key not in kept]
    assert rest and any(not torch.equal(before[k], full["model"][k]) for k in rest)  # so that a load of them shows
    assert_tensors_equal({k: loaded[k] for k in rest}, {k: before[k] for k in rest}, atol=0)


def test_a_sharded_save_keeps_an_optimizer_whole_or_not_at_all(fsdp: Fabric, tmp_path: Path) -> None:
    state = saved(fsdp, tmp_path / "full.ckpt")
    fsdp.strategy.state_dict_type = "sharded"
    with pytest.raises(ValueError, match="a sharded optimizer state is kept whole or not at all"):
        fsdp.save(tmp_path / "s.ckpt", state, filter={"optimizer": lambda key, _: key == "param_groups"})


def test_a_sharded_checkpoint_keeps_the_other_entries_in_its_meta_file(fsdp: Fabric, tmp_path: Path) -> None:
    saved(fsdp, tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    saved(fsdp, tmp_path / "sharded.ckpt", sharded=True)
    assert sorted(p.name for p in (tmp_path / "sharded.ckpt").iterdir()) == [META_FILE, shard_file_name(0, 1)]
    meta = torch.load(tmp_path / "sharded.ckpt" / META_FILE, weights_only=True)
    assert sorted(meta) == [FORMAT_KEY, "scheduler", "step"]
    assert meta[FORMAT_KEY][FABRIC_RECORD] == {"model": "model", "optimizers": ["optimizer"]}
    # Consolidated, it is the full checkpoint: Fabric's layout.
    consolidated = consolidate(tmp_path / "sharded.ckpt")
    assert sorted(consolidated) == sorted(full)
    assert_tensors_equal(consolidated["model"], full["model"], atol=0)
    assert_optimizer_states_equal(consolidated["optimizer"], full["optimizer"], atol=0)
    assert (consolidated["scheduler"], consolidated["step"]) == (full["scheduler"], 1)


def test_a_fabric_entry_named_as_the_meta_files_record_is_refused(fsdp: Fabric, tmp_path: Path) -> None:
    state = {**set_up(fsdp), FORMAT_KEY: 1}
    fsdp.strategy.state_dict_type = "sharded"
    with pytest.raises(ValueError, match="Rename this entry"):
        fsdp.save(tmp_path / "s.ckpt", state)
    assert not (tmp_path / "s.ckpt").exists()


# ------------------------------------------------------------------------------------------------------------------
# What fabric.load reads


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_a_checkpoint_resumes_exactly(fabric: Fabric, tmp_path: Path, sharded: bool) -> None:
    if sharded and isinstance(fabric.strategy, DDPShardedStrategy):
        pytest.skip("sharded DDP writes full checkpoints only")
    saved(fabric, tmp_path / "ck", sharded)
    state = {**set_up(fabric, seed=1), "epoch": 5}
    with pytest.raises(KeyError, match="'epoch'.*strict=False"):
        fabric.load(tmp_path / "ck", state)
    remainder = fabric.load(tmp_path / "ck", state, strict=False)
    assert (remainder, state["step"], state["epoch"]) == ({}, 1, 5)  # what the file lacks is left as it was
    assert_resumes_exactly(fabric, state)


def test_a_trainers_checkpoint_loads_by_position_and_returns_its_rest(fabric: Fabric, tmp_path: Path) -> None:
    torch.save(trainer_checkpoint(), tmp_path / "trainer.ckpt")
    state = set_up(fabric, seed=1)
    del state["step"]
    remainder = fabric.load(tmp_path / "trainer.ckpt", state)
    assert remainder == {"pytorch-lightning_version": "2.6.0", "global_step": 1, "loops": {"fit_loop": {}}}
    assert_resumes_exactly(fabric, state)
    second = torch.optim.SGD(state["model"].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds 1 optimizer states and the state to load has 2"):
        fabric.load(tmp_path / "trainer.ckpt", {**state, "second": second})


def test_sharded_ddp_names_the_consolidation_for_a_sharded_checkpoint(tmp_path: Path) -> None:
    """Sharded DDP has no sharded format: its IO (``ShardedCheckpointIO``, the default) recognises one, and it says
    how to load it."""
    with contextlib.contextmanager(_launched)("fsdp") as fsdp:
        saved(fsdp, tmp_path / "sharded.ckpt", sharded=True)
    with contextlib.contextmanager(_launched)("ddp_sharded") as sharded_ddp:
        assert type(sharded_ddp.strategy.checkpoint_io) is ShardedCheckpointIO
        with pytest.raises(ValueError, match="consolidate it into one file first.*lightning-fairscale-consolidate"):
            sharded_ddp.load(tmp_path / "sharded.ckpt", set_up(sharded_ddp))


@pytest.mark.parametrize("kind", ["full.ckpt", "sharded.ckpt"])
def test_the_files_of_the_previous_version_load_by_their_names(fsdp: Fabric, kind: str) -> None:
    """Written by the Fabric strategies of commit cb3a6b1 (the Trainer's layout, the names recorded): see
    ``tests/fixtures/fabric_0x/make_fabric_fixtures.py``."""
    state = set_up(fsdp, seed=1)
    assert fsdp.load(FIXTURES / kind, state) == {}  # the version and the record were not the user's
    assert state["step"] == 1
    assert_resumes_exactly(fsdp, state)


# ------------------------------------------------------------------------------------------------------------------
# fabric.load_raw


def test_load_raw_reads_a_state_dict_or_the_model_of_a_checkpoint(fabric: Fabric, tmp_path: Path) -> None:
    expected = plain(1)[0].state_dict()
    files = {"raw.pt": expected, "trainer.ckpt": trainer_checkpoint()}
    for name, content in files.items():
        torch.save(content, tmp_path / name)
    saved(fabric, tmp_path / "fabric.ckpt")
    paths = [tmp_path / name for name in ("raw.pt", "trainer.ckpt", "fabric.ckpt")]
    if isinstance(fabric.strategy, DDPFullyShardedStrategy):
        saved(fabric, tmp_path / "sharded.ckpt", sharded=True)
        paths += [tmp_path / "sharded.ckpt", FIXTURES / "full.ckpt", FIXTURES / "sharded.ckpt"]
    for path in paths:
        model = set_up(fabric, seed=1)["model"]
        fabric.load_raw(path, model)
        assert_tensors_equal(weights(fabric, model), expected)


# ------------------------------------------------------------------------------------------------------------------
# The Trainer's view of a Fabric checkpoint


def test_the_trainer_reads_a_fabric_checkpoint_in_its_layout(fsdp: Fabric, tmp_path: Path) -> None:
    saved(fsdp, tmp_path / "full.ckpt")
    file = torch.load(tmp_path / "full.ckpt", weights_only=True)
    keys = list(Net().state_dict())
    layout = to_trainer_layout(file, "2.6.0", keys)
    assert layout == {
        "state_dict": file["model"], "optimizer_states": [file["optimizer"]], "lr_schedulers": [file["scheduler"]],
        "pytorch-lightning_version": "2.6.0", "step": 1,
    }  # fmt: skip
    # A sharded checkpoint's meta dict: its LR schedulers (the model and the optimizers are in the shards).
    meta = {"scheduler": file["scheduler"], "step": 1}
    assert to_trainer_layout(meta, "2.6.0", None) == {
        "step": 1, "lr_schedulers": [file["scheduler"]], "pytorch-lightning_version": "2.6.0"
    }
    # The model is the entry that shares most keys with the LightningModule's, "model" among equals.
    ema = {"ema": file["model"], **file}
    assert to_trainer_layout(ema, "2.6.0", keys)["state_dict"] is file["model"]
    assert "ema" in to_trainer_layout(ema, "2.6.0", keys)
    with pytest.raises(ValueError, match=r"Several entries.*\['a', 'b'\]"):
        to_trainer_layout({"a": file["model"], "b": file["model"]}, "2.6.0", keys)
    with pytest.raises(ValueError, match="holds no state dict of this LightningModule"):
        to_trainer_layout({"step": 1, "optimizer": file["optimizer"]}, "2.6.0", keys)
    assert FABRIC_KEYS not in layout


# ------------------------------------------------------------------------------------------------------------------
# Background writes before a save


def _save_after_rank_1_failed_in_the_background(rank: int, world_size: int, path: str) -> str:
    """Fabric on this forked rank (the group is made): rank 1's earlier background write failed; then a save with
    ``state_dict_type="sharded"`` of a state that holds no set-up model (so a full file)."""
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: the group exists
    )  # fmt: skip
    io = ShardedCheckpointIO(async_save=True)
    strategy = DDPFullyShardedStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, plugins=[io])
    fabric.launch()
    if rank == 1:
        io.writer.submit(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        while io.writer.busy:
            time.sleep(0.01)
    try:
        fabric.save(path, {"step": 1})
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "saved"


def test_a_full_save_ends_every_rank_after_an_earlier_background_failure(tmp_path: Path) -> None:
    # Issue 55's read-along finding: Fabric's fallback full save (`state_dict_type="sharded"`, no set-up model in the
    # state) did not agree on earlier background writes, as the Trainer's full saves do: both ranks went on ("saved").
    results = run_ranks(_save_after_rank_1_failed_in_the_background, 2, tmp_path, str(tmp_path / "step=1.ckpt"))
    assert results[0].startswith("RuntimeError: Another process failed to write a checkpoint in the background")
    assert results[1] == "OSError: [Errno 28] No space left on device"
    assert not (tmp_path / "step=1.ckpt").exists()
