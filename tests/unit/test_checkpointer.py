"""Every checkpoint the package saves or loads goes through the checkpointer (:mod:`lightning_fairscale.checkpointer`):
its entry functions are replaced by recording ones, and each path (the Trainer's and Fabric's saves and loads, full
and sharded, under FSDP and sharded DDP, a Lightning 1.x file, consolidation, export, the 1.x conversion) must show up
in the record, with no file written or read around it (``torch.save``/``torch.load`` of a file seen only inside an
entry).

The Trainer and Fabric run on one CPU process, in this process.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from scenarios.common import RegressionModel
from torch import nn

from lightning_fairscale import DDPFullyShardedStrategy, DDPShardedStrategy, checkpointer, consolidate, convert_1x
from lightning_fairscale import fabric as fabric_strategies

from .helpers import one_process, Block, Net, batches, fabric_on_one_process

ENTRIES = ("save_full", "save_sharded", "load", "read_full", "read_fabric", "consolidate", "export", "convert_1x")
FIXTURE_1X = Path(__file__).parents[1] / "fixtures" / "lightning_1x" / "fsdp_sgd.ckpt"


class Record:
    """The checkpointer's entries called, outermost only, and the file reads and writes seen outside them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.outside: list[str] = []
        self.depth = 0

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch) -> Record:
    record = Record()

    def entry(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            if record.depth == 0:
                record.calls.append(name)
            record.depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                record.depth -= 1

        return spy

    def file_io(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            file = args[1] if name == "torch.save" else args[0]
            if record.depth == 0 and not isinstance(file, io.BytesIO):  # not a tensor pickled for a collective
                record.outside.append(name)
            return real(*args, **kwargs)

        return spy

    for name in ENTRIES:
        monkeypatch.setattr(checkpointer, name, entry(name, getattr(checkpointer, name)))
    monkeypatch.setattr(torch, "save", file_io("torch.save", torch.save))
    monkeypatch.setattr(torch, "load", file_io("torch.load", torch.load))
    return record


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net(seed=0)

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        x, y = (torch.cat(tensors) for tensors in zip(*batches(2)))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x) // 2)


def trainer(strategy: Any, steps: int, model: pl.LightningModule, ckpt_path: Any = None) -> pl.Trainer:
    run = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    run.fit(model, ckpt_path=ckpt_path)
    return run


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_the_trainers_fsdp_saves_and_loads_go_through_it(record: Record, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "last.ckpt"
    with one_process():
        run = trainer(DDPFullyShardedStrategy(auto_wrap_policy={Block}, state_dict_type=kind), 1, Module())
        record.take()
        run.save_checkpoint(path)
        assert record.take() == ["save_sharded" if kind == "sharded" else "save_full"]
    with one_process():
        trainer(DDPFullyShardedStrategy(auto_wrap_policy={Block}, state_dict_type=kind), 2, Module(), path)
        assert record.take() == ["load"]
    assert record.outside == []


def test_the_trainers_sharded_ddp_saves_and_loads_go_through_it(record: Record, tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    with one_process():
        run = trainer(DDPShardedStrategy(), 1, Module())
        record.take()
        run.save_checkpoint(path)
        assert record.take() == ["save_full"]
    with one_process():
        trainer(DDPShardedStrategy(), 2, Module(), path)
        assert record.take() == ["read_full"]
    assert record.outside == []


def test_a_lightning_1x_file_loads_through_it(record: Record) -> None:
    with one_process():
        model = RegressionModel(optimizer="plain_sgd", params="trainer", depth=1, scheduler=True, num_samples=8)
        trainer(DDPFullyShardedStrategy(), 3, model, FIXTURE_1X)  # its step: restored, nothing trained
        assert record.take() == ["load"]
    assert record.outside == []


@pytest.mark.parametrize("kind", ["full", "sharded", "ddp_sharded"])
def test_fabrics_saves_and_loads_go_through_it(record: Record, tmp_path: Path, kind: str) -> None:
    def strategy() -> Any:
        if kind == "ddp_sharded":
            return fabric_strategies.DDPShardedStrategy()
        return fabric_strategies.DDPFullyShardedStrategy(auto_wrap_policy={Block}, state_dict_type=kind)

    path = tmp_path / "last.ckpt"
    for saving in (True, False):
        with fabric_on_one_process(strategy()) as fabric:
            module = Net(seed=0)
            model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=0.01))
            if saving:
                fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
                assert record.take() == ["save_sharded" if kind == "sharded" else "save_full"]
            else:
                state = {"model": model, "optimizer": optimizer, "step": 0}
                fabric.load(path, state)
                assert record.take() == ["load" if kind == "sharded" else "read_fabric"] and state["step"] == 1
                fabric.load_raw(path, model)
                assert record.take() == ["load" if kind == "sharded" else "read_fabric"]
    assert record.outside == []


def test_the_command_line_tools_go_through_it(record: Record, tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    with fabric_on_one_process(fabric_strategies.DDPFullyShardedStrategy(state_dict_type="sharded")) as fabric:
        model = fabric.setup_module(Net(seed=0))
        fabric.save(path, {"model": model})
    record.take()
    assert consolidate.main([str(path), str(tmp_path / "full.ckpt"), "--quiet"]) == 0
    assert record.take() == ["consolidate"]
    assert consolidate.main([str(path), str(tmp_path / "export"), "--format", "safetensors", "--quiet"]) == 0
    assert record.take() == ["export"]
    assert convert_1x.main([str(FIXTURE_1X), str(tmp_path / "converted.ckpt")]) == 0
    assert record.take() == ["convert_1x"]
    assert record.outside == []
