"""Many trainings in one process (a sweep, a notebook, a test suite): each trial a new model and a new Trainer (or
Fabric), dropped after it; nothing of a trial may outlive it.

Each rank runs the same trials one after another, on the default group the first one creates, and writes
``--out-dir/rank<N>.json``:

* ``trials``: for each trial, its kind (front end, strategy, what it did) and which of its objects are still alive
  after the user dropped them and the garbage was collected (weak references: the module and the Trainer, or the
  module, Fabric and what ``fabric.setup`` returned);
* ``rss``: VmRSS (``/proc/self/status``) after a first round of every kind (imports, caches and the allocator's
  pools warmed up), and after the measured trials that follow; ``state_bytes``: one trial's state on this rank (its
  parameter shards, their gradients and Adam's two moments);
* ``ddp``: whether Lightning's ``"ddp"`` trained after all of ours ends exactly where the same ``"ddp"`` training
  ended when it was the process's first (before anything of ours ran);
* ``fairscale_sees_torch``: whether FairScale's FSDP module sees the real ``torch`` again at the end (its CPU
  workarounds are held by each sharded model, and undone with the last one).

Every kind runs in the first round: the Trainer's ``fit``, ``validate``, ``test``, ``predict``, a ``fit`` that an
exception ends mid-step (caught by the user), and a ``fit`` interrupted as Ctrl-C interrupts it (a
``KeyboardInterrupt`` in the step: Lightning shuts down and calls ``sys.exit(1)``); with Fabric, a training loop, an
evaluation loop, and a loop that an exception ends between the forward and the backward; each under FSDP and
``"ddp_sharded"``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import signal
import sys
import weakref
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from models import Block  # noqa: E402
from scenarios.flavor import LightningModule, Trainer  # noqa: E402

WIDTH, DEPTH = 512, 4  # 4.2 M parameters: one trial's state (shards, gradients, Adam) is what the test measures
SAMPLES, BATCH = 16, 4  # per rank: 2 steps an epoch
PARSER = argparse.ArgumentParser()
PARSER.add_argument("--out-dir", required=True)
PARSER.add_argument("--rounds", type=int, default=1, help="measured rounds after the first")


class Failure(RuntimeError):
    """The exception a trial raises mid-step (a NaN guard's)."""


def network() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(*[Block(WIDTH) for _ in range(DEPTH)])


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(2 * SAMPLES, WIDTH, generator=g), torch.randn(2 * SAMPLES, WIDTH, generator=g))


class Model(LightningModule):
    """Trains :func:`network`; ``raises`` an exception (or a ``KeyboardInterrupt``) in its second training step."""

    def __init__(self, raises: Any = None) -> None:
        super().__init__()
        self.net = network()
        self.raises = raises

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        if self.raises is not None and batch_idx == 1:
            raise self.raises("in the step")  # after the forward: the units are mid-step
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        set_ = data()
        world_size, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(set_, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(set_, batch_size=BATCH, sampler=sampler)

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


def strategy_for(name: str, fabric: bool = False) -> Any:
    from scenarios import flavor

    if name == "fsdp":
        cls = flavor.FabricDDPFullyShardedStrategy if fabric else flavor.DDPFullyShardedStrategy
        return cls(auto_wrap_policy={Block})
    return name


def trainer_trial(strategy: str, stage: str) -> list[weakref.ref]:
    """One Trainer trial; returns weak references to its module and Trainer (the user drops both)."""
    raises = {"exception": Failure, "interrupt": KeyboardInterrupt}.get(stage)
    model = Model(raises)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy_for(strategy), max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    refs = [weakref.ref(model), weakref.ref(trainer)]
    if stage in ("fit", "exception", "interrupt"):
        handler = signal.getsignal(signal.SIGINT)
        try:
            trainer.fit(model)
        except Failure:
            assert stage == "exception"
        except SystemExit:  # Lightning's answer to a KeyboardInterrupt: shut down, then `sys.exit(1)`
            assert stage == "interrupt"
        finally:
            signal.signal(signal.SIGINT, handler)  # Lightning ignores Ctrl-C from then on
    else:
        getattr(trainer, stage)(model)
    return refs


def fabric_trial(strategy: str, stage: str) -> list[weakref.ref]:
    """One Fabric trial; returns weak references to the user's module, Fabric, and the module and optimizer
    ``fabric.setup`` returned (the user drops them all)."""
    from scenarios.flavor import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy_for(strategy, fabric=True))
    fabric.launch()
    module = network()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=1e-3))
    refs = [weakref.ref(module), weakref.ref(fabric), weakref.ref(model), weakref.ref(optimizer)]
    x, y = data().tensors
    for step in range(2):
        batch = slice(BATCH * (2 * step + fabric.global_rank), BATCH * (2 * step + fabric.global_rank + 1))
        if stage == "eval":
            with torch.no_grad():
                model(x[batch])
            continue
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        if stage == "exception" and step == 1:
            try:
                raise Failure("between the forward and the backward")
            except Failure:
                break  # the user's loop gives up on this trial
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return refs


def ddp_result() -> dict[str, list[float]]:
    """Lightning's own ``"ddp"``: a fit, and the weights it ends with."""
    model = Model()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    return {name: value.flatten()[:64].tolist() + [value.sum().item()] for name, value in model.state_dict().items()}


KINDS: list[tuple[str, str, str]] = [
    *[("trainer", s, stage) for s in ("fsdp", "ddp_sharded")
      for stage in ("fit", "validate", "test", "predict", "exception", "interrupt")],
    *[("fabric", s, stage) for s in ("fsdp", "ddp_sharded") for stage in ("fit", "eval", "exception")],
]  # fmt: skip
#: The measured trials after the first round: the ones that leave the most state behind when they leak.
MEASURED: list[tuple[str, str, str]] = [
    ("trainer", "fsdp", "fit"), ("fabric", "fsdp", "fit"), ("trainer", "ddp_sharded", "fit"),
    ("fabric", "ddp_sharded", "fit"), ("trainer", "fsdp", "exception"), ("trainer", "fsdp", "interrupt"),
    ("fabric", "fsdp", "exception"), ("trainer", "fsdp", "validate"),
]  # fmt: skip


def run(kind: tuple[str, str, str]) -> dict[str, Any]:
    front, strategy, stage = kind
    trial: Callable[[str, str], list[weakref.ref]] = trainer_trial if front == "trainer" else fabric_trial
    refs = trial(strategy, stage)
    gc.collect()
    return {"kind": "/".join(kind), "alive": [ref() is not None for ref in refs]}


def rss() -> int:
    """VmRSS of this process, in bytes, once the garbage is collected and malloc gave back what it holds free (what
    is left is what lives)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


if __name__ == "__main__":
    ARGS = PARSER.parse_args()
    from scenarios.flavor import register_strategy_names

    record: dict[str, Any] = {"ddp": {}}
    first_ddp = ddp_result()  # before anything of ours ran (the strategy names are not even registered yet)
    register_strategy_names()
    record["trials"] = [run(kind) for kind in KINDS]
    record["rss"] = [rss()]
    for _ in range(ARGS.rounds):
        record["trials"] += [run(kind) for kind in MEASURED]
        record["rss"].append(rss())
    record["ddp"]["exact"] = ddp_result() == first_ddp
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

    gc.collect()
    record["fairscale_sees_torch"] = fsdp_module.torch is torch  # the CPU workarounds went with the last model
    parameters = sum(p.numel() for p in network().parameters())
    record["state_bytes"] = 4 * parameters * 4 // 2  # shard, gradient, Adam's two moments (fp32, 2 ranks)
    rank = os.environ.get("LOCAL_RANK", "0")
    Path(ARGS.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
