"""``DDPShardedStrategy`` training cases, run one after the other in the same processes.

Lightning's launcher starts the other ranks once, for the first Trainer; the later Trainers reuse the process group.
Rank 0 writes ``--out`` (torch.save): for each case, the trained module's state dict (after the strategy unwrapped
it), how the optimizer was sharded, the warnings the LR scheduler raised and what evaluation after ``fit`` returned.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lightning_fairscale  # noqa: E402,F401  (registers the strategy names)
from scenarios import common  # noqa: E402
from scenarios.train import KillDuringSave  # noqa: E402
from scenarios.flavor import (  # noqa: E402  (pytorch_lightning or lightning, as the test chose)
    Callback,
    DDPShardedStrategy,
    LightningModule,
    ModelCheckpoint,
    ModelPruning,
    ShardedMixedPrecisionPlugin,
    StochasticWeightAveraging,
    Trainer,
    seed_everything,
)

#: Two param groups with different hyperparameters: matrices with weight decay, vectors (biases, norms) without and
#: at half the learning rate.
MATRIX_WEIGHT_DECAY = 0.1
VECTOR_LR_FACTOR = 0.5

RESUME = {"optimizer": "adam", "groups": True, "scheduler": True, "samples": 8, "steps": 4}
CASES: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd"},
    "sgd-groups": {"optimizer": "sgd", "groups": True},
    "adam-groups-scheduler": {"optimizer": "adam", "groups": True, "scheduler": True},
    "adamw": {"optimizer": "adamw"},  # its `defaults` hold an entry its constructor does not take
    "clip-norm": {"optimizer": "sgd", "clip": (0.05, "norm")},  # the clip value bites
    "clip-value": {"optimizer": "sgd", "clip": (0.002, "value")},
    "accumulate": {"optimizer": "sgd", "accumulate": 2, "samples": 32},
    # Every micro-batch reduces to the owners, who set their reduced gradients aside during each backward.
    "accumulate-4-each": {"optimizer": "sgd", "accumulate": 4, "samples": 32, "strategy": {"sync_each_batch": True}},
    "buckets": {"optimizer": "adam", "strategy": {"reduce_buffer_size": 1000}},  # small gradients share buckets
    "bf16": {"optimizer": "sgd", "precision": "bf16-mixed"},
    "fp16": {"optimizer": "sgd", "plugin": "16-mixed"},  # the sharded grad scaler, on CPU
    "true-bf16": {"optimizer": "sgd", "precision": "bf16-true", "steps": 4},
    "true-bf16-clip": {"optimizer": "sgd", "precision": "bf16-true", "steps": 4, "clip": (0.05, "norm")},
    # Four steps with a checkpoint after each (one epoch is one step), then a resume from the second.
    "straight": {**RESUME, "checkpoints": True, "save_after_fit": True},
    "resume": {**RESUME, "resume_from": "checkpoints/epoch=1-step=2.ckpt"},
    # As "straight", saving "last.ckpt" after each step; run alone, with --kill-during-save (the run dies).
    "killed-save": {**RESUME, "checkpoints": "last", "alone": True},
    "eval-after-fit": {"optimizer": "adam", "steps": 2, "eval_after": True},
    # Lightning's StochasticWeightAveraging over 3 epochs of 2 steps, and the same under Lightning's own "ddp".
    "swa": {"optimizer": "sgd", "steps": -1, "epochs": 3, "swa": True},
    "swa-ddp": {"optimizer": "sgd", "steps": -1, "epochs": 3, "swa": True, "ddp": True},
    # Lightning's ModelPruning (half the weights by magnitude after each epoch), without its lottery-ticket reset.
    "pruning": {"optimizer": "sgd", "steps": -1, "epochs": 3, "pruning": True},
    "pruning-ddp": {"optimizer": "sgd", "steps": -1, "epochs": 3, "pruning": True, "ddp": True},
}


def with_param_groups(make: Callable[[str, Any], torch.optim.Optimizer]) -> Callable[..., torch.optim.Optimizer]:
    """``make`` (``common.make_optimizer``), building two param groups with different hyperparameters."""

    def make_with_groups(name: str, params: Any) -> torch.optim.Optimizer:
        params = list(params)
        matrices = [p for p in params if p.ndim > 1]
        vectors = [p for p in params if p.ndim <= 1]
        groups = [{"params": matrices, "weight_decay": MATRIX_WEIGHT_DECAY}, {"params": vectors, "weight_decay": 0.0}]
        optimizer = make(name, groups)
        optimizer.param_groups[1]["lr"] = optimizer.defaults["lr"] * VECTOR_LR_FACTOR
        return optimizer

    return make_with_groups


@contextlib.contextmanager
def param_groups() -> Iterator[None]:
    """While active, ``RegressionModel`` and ``reference_training`` make optimizers with two param groups."""
    original = common.make_optimizer
    common.make_optimizer = with_param_groups(original)
    try:
        yield
    finally:
        common.make_optimizer = original


class Record(Callback):
    """Records, on rank 0, what the strategy set up for training and for evaluation."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (optimizer,) = trainer.strategy.optimizers
        shard = getattr(optimizer, "optim", optimizer)  # OSS's optimizer of this rank's shard
        self.info.update(
            wrapper=type(trainer.strategy.model).__name__,
            optimizer=type(optimizer).__name__,
            is_oss=type(optimizer).__mro__[1].__name__ == "OSS",  # a subclass named after the user's optimizer
            shard_optimizer=type(shard).__name__,
            shard_params=sum(len(g["params"]) for g in shard.param_groups),
            all_params=sum(len(g["params"]) for g in optimizer.param_groups),
            precision_plugin=type(trainer.precision_plugin).__name__,
            scaler=type(getattr(trainer.precision_plugin, "scaler", None)).__name__,
        )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (optimizer,) = trainer.strategy.optimizers
        shard = getattr(optimizer, "optim", optimizer)
        self.info["dtypes"] = {
            "parameters": {str(p.dtype) for p in pl_module.parameters()},
            "optimizer_state": {(k, str(v.dtype)) for state in shard.state.values() for k, v in state.items()},
        }

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.info["eval_wrapper"] = type(trainer.strategy.model).__name__


def run_case(
    name: str, case: dict[str, Any], devices: int, workdir: Path, accelerator: str = "cpu", kill_during_save: int = 0
) -> dict[str, Any]:
    seed_everything(7, workers=True)
    steps = case.get("steps", 3)
    model = common.RegressionModel(
        optimizer=case["optimizer"], scheduler=case.get("scheduler", False), num_samples=case.get("samples", 16)
    )
    record = Record()
    callbacks: list[Callback] = [record]
    if case.get("checkpoints") == "last":
        callbacks.append(
            ModelCheckpoint(dirpath=workdir / "last", filename="last", enable_version_counter=False, every_n_epochs=1)
        )
    elif case.get("checkpoints"):
        callbacks.append(
            ModelCheckpoint(dirpath=workdir / "checkpoints", filename="{epoch}-{step}", every_n_epochs=1, save_top_k=-1)
        )
    if kill_during_save:
        callbacks.append(KillDuringSave(kill_during_save, rank=0, how="kill"))
    if case.get("swa"):
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1))
    if case.get("pruning"):
        callbacks.append(ModelPruning("l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=False))
    clip_val, clip_algorithm = case.get("clip", (None, None))
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy="ddp" if case.get("ddp") else DDPShardedStrategy(**case.get("strategy", {})),
        max_steps=steps,
        max_epochs=case.get("epochs"),
        precision=None if "plugin" in case else case.get("precision", "32-true"),
        plugins=(
            [ShardedMixedPrecisionPlugin(case["plugin"], "cuda" if accelerator == "gpu" else "cpu")]
            if "plugin" in case
            else None
        ),
        accumulate_grad_batches=case.get("accumulate", 1),
        gradient_clip_val=clip_val,
        gradient_clip_algorithm=clip_algorithm,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(case.get("checkpoints")),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1.0 if case.get("eval_after") else 0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=workdir,
    )
    groups = param_groups() if case.get("groups") else contextlib.nullcontext()
    resume_from = case.get("resume_from")
    with groups, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=workdir / resume_from if resume_from else None)
        if case.get("save_after_fit"):
            trainer.save_checkpoint(workdir / f"{name}-after-fit.ckpt")
    result: dict[str, Any] = {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "global_step": trainer.global_step,
        "strategy": type(trainer.strategy).__name__,
        "unwrapped": trainer.strategy.model is model,
        "scheduler_warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
        **record.info,
    }
    if case.get("eval_after"):
        result["validate"] = trainer.validate(model, verbose=False)
        result["test"] = trainer.test(model, verbose=False)
        result["predict"] = torch.cat(trainer.predict(model))
        result["eval_wrapper"] = record.info["eval_wrapper"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="comma-separated names from CASES")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--workdir", default=".", help="checkpoints are written and read here")
    parser.add_argument("--kill-during-save", type=int, default=0, help="SIGKILL rank 0 halfway through its n-th file")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    results = {
        name: run_case(name, CASES[name], args.devices, workdir, args.accelerator, args.kill_during_save)
        for name in args.cases.split(",")
    }
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, args.out)
    torch.distributed.destroy_process_group()  # a clean exit for the threads of gloo


if __name__ == "__main__":
    main()
