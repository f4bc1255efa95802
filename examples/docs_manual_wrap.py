"""Docs example "Manual Wrapping": ``torch.distributed.fsdp.wrap.wrap`` inside ``configure_sharded_model``.

From the original extension's documentation page: ``MyModel`` is the doc's model, unchanged (its
``configure_sharded_model`` wraps ``linear_layer`` and each layer of ``block`` in its own FSDP unit, and its
``configure_optimizers`` uses ``self.model.parameters()``). Only what the doc leaves out is added: ``forward``,
``training_step`` and ``train_dataloader``. Outside ``DDPFullyShardedStrategy`` (for example a plain single-process
Trainer) ``wrap`` is a no-op, so the same model trains without FSDP.

The script prints how many FSDP units the model had during training: one for ``linear_layer``, one for each of the
two layers of ``block``, and the root unit the strategy adds for everything else.

Differences from the doc, so the example runs anywhere: ``devices=2`` instead of 4, ``max_steps=4``, and
``accelerator="cpu"`` on a machine without CUDA. ``precision=16`` stays as in the doc: on GPUs it is fp16 mixed
precision; on CPUs Lightning runs it as ``"bf16-mixed"`` (and says so), since CPU autocast has no fp16 AMP.

Run it (it writes ``lightning_logs/`` into the current folder)::

    python examples/docs_manual_wrap.py     # two CPU processes, or two GPUs if CUDA is available
"""

import torch
import torch.nn as nn  # noqa: PLR0402  (as in the doc)
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.demos.boring_classes import RandomDataset
from torch.distributed.fsdp.wrap import wrap
from torch.utils.data import DataLoader

from lightning_fairscale.strategies import DDPFullyShardedStrategy


class MyModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.linear_layer = nn.Linear(32, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))

    def configure_sharded_model(self):
        # modules are sharded across processes
        # as soon as they are wrapped with `wrap`.
        # During the forward/backward passes, weights get synced across processes
        # and de-allocated once computation is complete, saving memory.

        # Wraps the layer in a Fully Sharded Wrapper automatically
        linear_layer = wrap(self.linear_layer)

        for i, layer in enumerate(self.block):
            self.block[i] = wrap(layer)

        self.model = nn.Sequential(linear_layer, nn.ReLU(), self.block)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())

    # --- not in the doc: what a LightningModule needs to train ---------------------------------------------------

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        out = self(batch)
        return nn.functional.mse_loss(out, torch.ones_like(out))

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=2)


class CountUnits(Callback):
    """Counts the FairScale FSDP units of the model being trained."""

    units = 0

    def on_train_start(self, trainer, pl_module):
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        self.units = sum(isinstance(m, FullyShardedDataParallel) for m in trainer.strategy.model.modules())


if __name__ == "__main__":
    counter = CountUnits()
    model = MyModel()
    trainer = Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        strategy=DDPFullyShardedStrategy(),
        precision=16,
        max_steps=4,
        callbacks=[counter],
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        print(f"OK fsdp_units={counter.units} global_step={trainer.global_step}", flush=True)
