"""Mixed precision with ``DDPFullyShardedStrategy``: FP32 master shards, computation in fp16 or bf16.

The Trainer's ``precision`` flag chooses the strategy's precision plugin (``FullyShardedMixedPrecisionPlugin``):
FairScale keeps the sharded FP32 parameters for the optimizer, gathers full parameters in the low precision for the
forward and backward passes, and (fp16) scales the loss with a sharded grad scaler whose inf/NaN checks agree across
ranks. This script trains a small MLP and prints the dtype its Linear layers computed in.

* On GPUs it uses ``precision="16-mixed"``.
* On CPUs it uses ``precision="bf16-mixed"``; fp16 on CPU is reachable with
  ``plugins=[FullyShardedMixedPrecisionPlugin("16-mixed", "cpu")]`` (Lightning maps the ``"16-mixed"`` flag to bf16
  on CPUs).

Run it::

    python examples/mixed_precision.py     # two CPU processes, or two GPUs if CUDA is available
"""

import torch
from pytorch_lightning import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fairscale.strategies import DDPFullyShardedStrategy


class MLP(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
        self.compute_dtypes: set[torch.dtype] = set()
        self.net[0].register_forward_hook(lambda module, inputs, output: self.compute_dtypes.add(output.dtype))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    data = TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
    model = MLP()
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=2,
        strategy=DDPFullyShardedStrategy(),
        precision="16-mixed" if cuda else "bf16-mixed",
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=16))
    trainer.strategy.unshard_module()  # every rank: the module stays sharded after fit; rank 0 gets the full one
    if trainer.is_global_zero:
        dtypes = sorted(str(d) for d in model.compute_dtypes)
        print(f"OK precision={trainer.precision} computed in {dtypes}; FP32 weights kept: {model.net[0].weight.dtype}")
