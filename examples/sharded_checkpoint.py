"""Sharded checkpoints, then offline consolidation into one full checkpoint.

``DDPFullyShardedStrategy(state_dict_type="sharded")`` makes every rank write its own shard of each checkpoint, in
parallel; no rank gathers the full model. Each checkpoint is a directory (``meta.pt`` plus one file per rank), written
atomically. The script then:

1. resumes training from the last sharded checkpoint (same number of processes: exact), and
2. on rank 0, consolidates it into one full checkpoint with the same code as the console script
   ``lightning-fairscale-consolidate SRC_DIR OUT.ckpt``, and loads that with ``BoringModel.load_from_checkpoint``
   (no processes, no FairScale needed for that step).

Run it (it writes ``sharded_checkpoints/`` into the current folder)::

    python examples/sharded_checkpoint.py     # two CPU processes, or two GPUs if CUDA is available
"""

from pathlib import Path

import torch
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_fairscale.consolidate import main as consolidate
from lightning_fairscale.strategies import DDPFullyShardedStrategy


def trainer(max_steps: int) -> Trainer:
    return Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        strategy=DDPFullyShardedStrategy(state_dict_type="sharded"),
        max_steps=max_steps,
        limit_train_batches=4,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath="sharded_checkpoints", save_last=True)],
        logger=False,
        enable_progress_bar=False,
    )


if __name__ == "__main__":
    first = trainer(max_steps=8)
    first.fit(BoringModel())
    last = Path("sharded_checkpoints") / "last.ckpt"
    if first.is_global_zero:
        print(f"sharded checkpoint {last}: {sorted(p.name for p in last.iterdir())}", flush=True)

    resumed = trainer(max_steps=12)
    resumed.fit(BoringModel(), ckpt_path=last)  # every rank reads its own shard

    if resumed.is_global_zero:
        consolidate([str(last), "last-full.ckpt"])  # = `lightning-fairscale-consolidate ...`
        model = BoringModel.load_from_checkpoint("last-full.ckpt")
        print(f"OK resumed to global_step={resumed.global_step}; consolidated {type(model).__name__}", flush=True)
