"""Lightning's ``WeightAveraging`` (EMA or SWA) under our strategies and Lightning's own ``"ddp"``, as a scenario.

One job trains ``RegressionModel`` (SGD with momentum, one step per epoch, so every epoch-end checkpoint resumes
exactly) with a ``WeightAveraging`` callback, optionally validating every ``val_every`` epochs (the callback swaps
the averaged weights in for validation and back after it) and writing a checkpoint after every epoch. Rank 0 writes
the result: the full state dict at the end of ``fit`` (the averaged weights, as the callback leaves them), the
averaging count, each rank's number of averaged elements, and each full checkpoint's contents. The tests run
``averaging.py --jobs FILE`` (``conftest.run_jobs(script=...)``)::

    PYTHONPATH=src python tests/scenarios/averaging.py --config '{"strategy": "fsdp"}' --out result.pt
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn  # noqa: E402

import lightning_fairscale  # noqa: E402,F401  (registers the strategy names)
from lightning_fairscale.fsdp.state.sharded_checkpoint import consolidate  # noqa: E402
import scenarios.jobs  # noqa: E402
from scenarios import common  # noqa: E402
from scenarios.config import Config  # noqa: E402
from scenarios.flavor import (  # noqa: E402
    DDPFullyShardedStrategy,
    DDPShardedStrategy,
    Fabric,
    FabricDDPFullyShardedStrategy,
    ModelCheckpoint,
    Trainer,
    pl,
    seed_everything,
)


@dataclass(frozen=True)
class AveragingScenario(Config):
    """One training with a ``WeightAveraging`` callback: 6 SGD steps on 2 processes under ``DDPFullyShardedStrategy``
    with an EMA of decay 0.9."""

    SCRIPT: ClassVar[str] = "averaging"

    strategy: str = "fsdp"  # fsdp, ddp_sharded, ddp, auto (one device, no strategy)
    accelerator: str = "cpu"
    devices: int = 2
    precision: str = "32-true"
    #: ema: get_ema_avg_fn(0.9); swa: WeightAveraging's default (the equal-weight average); none: no averaging
    average: str = "ema"
    batch_norm: bool = False  # the network ends with a BatchNorm1d: buffers averaged too (use_buffers)
    steps: int = 6  # epochs of one step each
    val_every: int = 0  # validate every this many epochs (0: never)
    state_dict_type: str = "full"
    checkpoint_dir: Optional[str] = None  # a checkpoint after every epoch, kept
    ckpt_path: Optional[str] = None  # fit(ckpt_path=...)
    save_ckpt: Optional[str] = None  # trainer.save_checkpoint after fit
    fit_again: bool = False  # a second fit of the (still sharded) module, with a new callback: refused
    #: Fabric's loop instead of the Trainer: "averaged_model" (FSDP: the strategy's average of the shards; ddp:
    #: AveragedModel made before set-up), or "copy": AveragedModel(model) after set-up
    fabric: str = ""


CONFIG = AveragingScenario


class BatchNormModel(common.RegressionModel):
    """``RegressionModel`` whose network ends with a ``BatchNorm1d``: running statistics and a batch counter."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(*self.net, nn.BatchNorm1d(common.OUT_FEATURES))


def strategy(config: AveragingScenario) -> Any:
    if config.strategy == "fsdp":
        return DDPFullyShardedStrategy(min_num_params=1000, state_dict_type=config.state_dict_type)
    if config.strategy == "ddp_sharded":
        return DDPShardedStrategy()
    return config.strategy


def averaging(config: AveragingScenario) -> Any:
    if config.average == "none":  # a Callback that does nothing: the training without averaging
        return pl.callbacks.Callback()
    if config.average == "ema":
        return pl.callbacks.WeightAveraging(avg_fn=get_ema_avg_fn(0.9))
    return pl.callbacks.WeightAveraging()


def avg_fn(config: AveragingScenario) -> Any:
    return get_ema_avg_fn(0.9) if config.average == "ema" else None


def fabric_main(config: AveragingScenario, out: str) -> None:
    """Fabric's loop: the same steps and data, the average updated after each one; rank 0 records the average's
    full state dict, the model's own weights, the average's output on a batch, and a state dict round trip."""
    strategy = FabricDDPFullyShardedStrategy(min_num_params=1000) if config.strategy == "fsdp" else config.strategy
    fabric = Fabric(accelerator="cpu", devices=config.devices, strategy=strategy)
    fabric.launch()
    seed_everything(7)
    net = common.build_network()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    average: Any = None
    if config.strategy != "fsdp":
        average = AveragedModel(net, avg_fn=avg_fn(config), use_buffers=True)
    model, optimizer = fabric.setup(net, optimizer)
    if config.fabric == "copy":
        average = AveragedModel(model, avg_fn=avg_fn(config), use_buffers=True)  # fails under FSDP, with what to do
    elif config.strategy == "fsdp":
        average = fabric.strategy.averaged_model(model, avg_fn=avg_fn(config), use_buffers=True)
    x, y = common.dataset(8).tensors
    rank, world = fabric.global_rank, fabric.world_size
    for _ in range(config.steps):
        loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        average.update_parameters(model)
    result: dict[str, Any] = {"n_averaged": int(average.n_averaged)}
    with torch.no_grad():
        if config.strategy == "fsdp":
            with average.swapped_in():
                result["output"] = model(x)
            state = average.state_dict()  # full, on rank 0
            result["averaged"] = {k[len("module."):]: v for k, v in state.items() if k.startswith("module.")}
            result["current"] = fabric.strategy.get_module_state_dict(model._forward_module)  # the root unit
            # Saved beside the model as the guide shows, then loaded back into a fresh average of the shards (every
            # rank reads its slices of the full state dict).
            path = Path(out).with_suffix(".fabric.ckpt")
            fabric.save(path, {"model": model, "ema": state})
            again = fabric.strategy.averaged_model(model, avg_fn=avg_fn(config), use_buffers=True)
            remainder = fabric.load(path, {"model": model}, weights_only=False)
            again.load_state_dict(remainder["ema"])
            result["round_trip"] = again.state_dict()
            result["averaged_numel"] = fabric.all_gather(torch.tensor(average.module.numel())).tolist()
        else:
            result["output"] = average(x)
            result["averaged"] = average.module.state_dict()
            result["current"] = net.state_dict()
    if fabric.is_global_zero:
        torch.save(result, out)


def main(config: AveragingScenario, out: str) -> None:
    if config.fabric:
        fabric_main(config, out)
        return
    seed_everything(7)
    model_class = BatchNormModel if config.batch_norm else common.RegressionModel
    model = model_class(optimizer="sgd", num_samples=8)
    callback = averaging(config)
    callbacks: list[Any] = [callback]
    if config.checkpoint_dir:
        callbacks.append(
            ModelCheckpoint(dirpath=config.checkpoint_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
        )
    trainer = Trainer(
        accelerator=config.accelerator, devices=config.devices, strategy=strategy(config), max_epochs=config.steps,
        precision=config.precision,
        callbacks=callbacks, logger=False, enable_checkpointing=bool(config.checkpoint_dir),
        enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1 if config.val_every else 0, check_val_every_n_epoch=config.val_every or 1,
        num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=config.ckpt_path)
    if config.fit_again:
        again = Trainer(
            accelerator=config.accelerator, devices=config.devices, strategy=strategy(config), max_epochs=1,
            callbacks=[averaging(config)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False,
        )  # fmt: skip
        again.fit(model)
    average = getattr(callback, "_average_model", None)
    averaged_numel = sum(p.numel() for p in average.module.parameters()) if average is not None else 0
    numels: list[Any] = [averaged_numel] * trainer.world_size
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(numels, averaged_numel)
    result: dict[str, Any] = {
        "n_averaged": int(average.n_averaged) if average is not None else 0,
        "latest_update_step": getattr(callback, "_latest_update_step", None),
        "averaged_numel": numels,
        "global_step": trainer.global_step,
    }
    if config.save_ckpt:
        trainer.save_checkpoint(config.save_ckpt)
    if hasattr(trainer.strategy, "unshard_module"):
        trainer.strategy.unshard_module()
    result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["model_numel"] = sum(p.numel() for p in model.parameters())
    if trainer.global_rank == 0:
        checkpoints = sorted(Path(config.checkpoint_dir).glob("*.ckpt")) if config.checkpoint_dir else []
        if config.save_ckpt:
            checkpoints.append(Path(config.save_ckpt))
        # A sharded checkpoint directory as the full checkpoint it is equivalent to (lightning-fairscale-consolidate).
        result["checkpoints"] = {
            path.name: torch.load(path, weights_only=False) if path.is_file() else consolidate(path)
            for path in checkpoints
        }
        torch.save(result, out)


if __name__ == "__main__":
    scenarios.jobs.main(AveragingScenario, main)
