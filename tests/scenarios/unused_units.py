"""Units whose forward does not run in a step, under ``DDPFullyShardedStrategy`` (Trainer), ``"fsdp_fairscale"``
(Fabric) or ``"ddp_sharded"``, each with its unsharded reference computed in the same process.

What it runs is a ``scenarios.config.UnusedUnits``. The network (:class:`Net`): an input layer, two Blocks, an
output layer, and an auxiliary head (:class:`AuxHead`) that only ``predict_step`` uses. The cases:

* ``aux``: the head is a unit of its own (``auto_wrap_policy={Block, AuxHead}``) and no training forward runs it;
* ``size``: units cut by the size policy (``min_num_params=3000``: each Block, the head), the second Block and the
  head skipped by every training forward;
* ``alternate``: the second Block runs in every other batch (with ``accumulate=2``: in the accumulating one, not in
  the synchronising one);
* ``diverge``: the second Block runs on rank 0 only; the job must fail on every rank, naming it.

AdamW with weight decay: a parameter given a zero gradient instead of none would decay (and its moments would move
it), so only an optimizer that skips the unused units matches. Its ``eps=1e-3`` keeps the update a smooth function of
the gradient (Adam's default ``1e-8`` moves an element whose gradient is rounding noise by a whole ``lr``, in a
direction the summation order decides), so that sharded and unsharded training agree to 1e-5 on any CPU.

Rank 0 writes ``{"final": state dict after all steps, "reference": the unsharded training's}`` (``final`` after a
save at ``save_at`` and a resume in a fresh model, if set). By hand (from the project's root)::

    PYTHONPATH=src python tests/scenarios/unused_units.py --config '{"case": "alternate", "devices": 1}' --out r.pt
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import scenarios.jobs  # noqa: E402
from scenarios.common import GLOBAL_BATCH, HIDDEN, IN_FEATURES, OUT_FEATURES, Block, dataset  # noqa: E402
from scenarios.config import UnusedUnits  # noqa: E402
from scenarios.flavor import DDPFullyShardedStrategy, Fabric, LightningModule, Trainer, pl  # noqa: E402
from scenarios.flavor import register_strategy_names  # noqa: E402

register_strategy_names()

CONFIG = UnusedUnits


class AuxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.body(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.b1, self.b2 = Block(HIDDEN), Block(HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)
        self.aux = AuxHead()

    def forward(self, x: torch.Tensor, second: bool = True) -> torch.Tensor:
        h = self.b1(self.inp(x))
        return self.out(self.b2(h) if second else h)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.aux(self.b1(self.inp(x)))


def runs_second(config: UnusedUnits, batch: int, rank: int = 0) -> bool:
    """Whether the second Block runs in batch number ``batch`` (counted over the whole training) on ``rank``."""
    if config.case == "size":
        return False
    if config.case == "alternate":
        return batch % 2 == 0
    if config.case == "diverge":
        return rank == 0
    return True


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)


def batches(config: UnusedUnits) -> list[Any]:
    """One optimizer step's batches (an epoch is one step: the Trainer resumes exactly from an epoch's end)."""
    return list(DataLoader(dataset(GLOBAL_BATCH * config.accumulate), batch_size=GLOBAL_BATCH))


def reference(config: UnusedUnits) -> dict[str, torch.Tensor]:
    """The unsharded training: one process, the whole global batch."""
    net = Net()
    opt = optimizer(net.parameters())
    for step in range(config.steps):
        for micro, (x, y) in enumerate(batches(config)):
            second = runs_second(config, step * config.accumulate + micro)
            (nn.functional.mse_loss(net(x, second), y) / config.accumulate).backward()
        if config.clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), config.clip)
        opt.step()
        opt.zero_grad()
    final = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if config.case == "aux" and config.front == "trainer":  # what the Trainer's predict_step gives on rank 0
        with torch.no_grad():
            final["predicted"] = net.predict(dataset(GLOBAL_BATCH * config.accumulate).tensors[0][0:GLOBAL_BATCH:2])
    return final


def strategy_for(config: UnusedUnits, fabric: bool = False) -> Any:
    if config.strategy == "ddp":
        return pl.strategies.DDPStrategy(find_unused_parameters=True)
    if config.strategy == "ddp_sharded":
        return "ddp_sharded"
    policy = {"auto_wrap_policy": {Block, AuxHead}} if config.case != "size" else {"min_num_params": 3000}
    options = {
        **policy,
        "state_dict_type": config.state_dict_type,
        "activation_checkpointing": Block if config.checkpointing else None,
        **({"sharding_strategy": config.sharding_strategy} if config.sharding_strategy else {}),
        **({"device_mesh": tuple(config.device_mesh)} if config.device_mesh else {}),
        # A hang would end at this collective timeout, with a transport error that names no unit.
        **({"timeout": timedelta(seconds=20)} if config.case == "diverge" else {}),
    }
    if fabric:
        from scenarios.flavor import FabricDDPFullyShardedStrategy

        return FabricDDPFullyShardedStrategy(**options)
    return DDPFullyShardedStrategy(**options)


# ------------------------------------------------------------------------------------------------------------------
# The Trainer


class Model(LightningModule):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = UnusedUnits.from_json(config)
        self.net = Net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        number = self.global_step * self.config.accumulate + batch_idx % self.config.accumulate
        return nn.functional.mse_loss(self.net(x, runs_second(self.config, number, self.global_rank)), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net.predict(batch[0])

    def configure_optimizers(self) -> Any:
        return optimizer(self.parameters())

    def train_dataloader(self) -> DataLoader:
        data = dataset(GLOBAL_BATCH * self.config.accumulate)
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // self.trainer.world_size, sampler=sampler)


def trainer_fit(config: UnusedUnits, ckpt_path: Optional[str] = None, save: Optional[str] = None) -> dict[str, Any]:
    """``fit`` for ``config.steps`` steps, from ``ckpt_path`` if given; with ``save`` (a folder), a checkpoint at every
    epoch's end (one step) there."""
    model = Model(config.to_json())
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=save, filename="{epoch}", save_top_k=-1)] if save else []
    trainer = Trainer(
        accelerator="cpu", devices=config.devices, strategy=strategy_for(config), max_steps=config.steps,
        accumulate_grad_batches=config.accumulate, gradient_clip_val=config.clip, callbacks=callbacks,
        logger=False, enable_checkpointing=bool(save), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    # The head's first forward, after training: rank 0's share of one global batch (samples 0, 2, ...).
    predicted = trainer.predict(model, dataloaders=model.train_dataloader())[0] if config.case == "aux" else None
    if hasattr(trainer.strategy, "unshard_module"):
        trainer.strategy.unshard_module()
    if not trainer.is_global_zero:
        return {}
    final = {k: v.detach().clone() for k, v in model.net.state_dict().items()}
    return {**final, "predicted": predicted} if predicted is not None else final


def run_trainer(config: UnusedUnits, work: Path) -> dict[str, Any]:
    if config.save_at is None:
        return trainer_fit(config)
    trainer_fit(config, save=str(work / "epochs"))
    return trainer_fit(config, ckpt_path=str(work / "epochs" / f"epoch={config.save_at - 1}.ckpt"))


# ------------------------------------------------------------------------------------------------------------------
# Fabric


def run_fabric(fabric: Any, fields: dict[str, Any], out: str) -> None:
    config = UnusedUnits.from_json(fields)
    work = Path(config.save_dir or Path(out).parent)
    rank, world = fabric.global_rank, fabric.world_size

    def set_up() -> tuple[Any, Any]:
        net = Net()
        return fabric.setup(net, optimizer(net.parameters()))

    def train(model: Any, opt: Any, first: int, last: int) -> None:
        for step in range(first, last):
            for micro, (x, y) in enumerate(batches(config)):
                second = runs_second(config, step * config.accumulate + micro, rank)
                with fabric.no_backward_sync(model, enabled=micro < config.accumulate - 1):
                    loss = nn.functional.mse_loss(model(x[rank::world], second), y[rank::world])
                    fabric.backward(loss / config.accumulate)
            if config.clip is not None:
                fabric.clip_gradients(model, opt, max_norm=config.clip)
            opt.step()
            opt.zero_grad()

    model, opt = set_up()
    train(model, opt, 0, config.save_at or config.steps)
    if config.save_at is not None:
        fabric.save(work / "unused.ckpt", {"model": model, "optimizer": opt})
        model, opt = set_up()
        fabric.load(work / "unused.ckpt", {"model": model, "optimizer": opt})
        train(model, opt, config.save_at, config.steps)
    strategy = fabric.strategy
    if hasattr(strategy, "state_dict_type"):
        strategy.state_dict_type = "full"
    fabric.save(work / "unused-final.ckpt", {"model": model})
    if fabric.is_global_zero:
        final = torch.load(work / "unused-final.ckpt", weights_only=True)["model"]
        torch.save({"final": final, "reference": reference(config)}, out)


def main(config: UnusedUnits, out: str) -> None:
    """Run ``config``; rank 0 writes the result to ``out``."""
    work = Path(config.save_dir or Path(out).parent)
    work.mkdir(parents=True, exist_ok=True)
    if config.front == "fabric":
        fabric = Fabric(accelerator="cpu", devices=config.devices, strategy=strategy_for(config, fabric=True))
        fabric.launch(run_fabric, config.to_json(), out)
        return
    final = run_trainer(config, work)
    if final:  # rank 0's
        torch.save({"final": final, "reference": reference(config)}, out)


if __name__ == "__main__":
    scenarios.jobs.main(UnusedUnits, main)
