"""Sharded DDP (ZeRO stage 2): ``Trainer(strategy="ddp_sharded")``.

``DDPShardedStrategy`` keeps the whole model on every rank, like DDP, but shards the optimizer state (FairScale's
``OSS``) and reduces each gradient to the rank that owns it (``ShardedDataParallel``). Use it when the optimizer
state, not the parameters, is what does not fit; use ``DDPFullyShardedStrategy`` to shard the parameters too.
Checkpoints are ordinary full files: the optimizer state is consolidated on rank 0 when saving.

This script trains a BoringModel and prints, per rank, how many of the parameters' optimizer states the rank owns.

Run it::

    python examples/sharded_ddp.py     # two CPU processes, or two GPUs if CUDA is available
"""

import torch
from fairscale.optim import OSS
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.demos.boring_classes import BoringModel

import lightning_fairscale  # noqa: F401  (registers "ddp_sharded")


class ReportShards(Callback):
    def on_train_end(self, trainer, pl_module):
        # FairScale's OSS, wrapping the optimizer of configure_optimizers; its class is named after yours ("SGD"), so
        # loggers (LearningRateMonitor's "lr-SGD") see your optimizer's name.
        optimizer = trainer.strategy.optimizers[0]
        owned = sum(len(group["params"]) for group in optimizer.optim.param_groups)
        total = len(list(pl_module.parameters()))
        name = "OSS" if isinstance(optimizer, OSS) else type(optimizer).__name__
        print(f"rank {trainer.global_rank}: {name} updates {owned} of {total} parameters", flush=True)


if __name__ == "__main__":
    trainer = Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        strategy="ddp_sharded",
        max_steps=4,
        callbacks=[ReportShards()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(BoringModel())
    if trainer.is_global_zero:
        print(f"OK strategy={type(trainer.strategy).__name__} global_step={trainer.global_step}", flush=True)
