"""Docs example "Activation Checkpointing": ``DDPFullyShardedStrategy(activation_checkpointing=MyTransformerBlock)``.

From the original extension's documentation page. With activation checkpointing the activations inside each
``MyTransformerBlock`` are not kept for the backward pass: the block's forward runs again during backward to recompute
them, trading compute for memory. The script checks exactly that: it counts the calls of ``MyTransformerBlock.forward``
during training and fails unless the blocks ran more than once per training step (forward + recomputation).

NOTE: the ``activation_checkpointing`` argument is not implemented yet (issue 4); today the strategy rejects it and
this script exits with an error. Its test is marked as an expected failure (strict), so it flags when it starts to
work.

Differences from the doc, so the example runs anywhere: ``devices=2`` instead of 4, ``max_steps=4``, and
``accelerator="cpu"`` on a machine without CUDA.

Run it (it writes ``lightning_logs/`` into the current folder)::

    python examples/docs_activation_checkpointing.py   # two CPU processes, or two GPUs if CUDA is available
"""

import sys

import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel
from torch import nn

from lightning_fairscale.strategies import DDPFullyShardedStrategy

DEPTH = 2


class MyTransformerBlock(nn.Module):
    """A pre-norm transformer block (self-attention + MLP); counts how often its forward runs."""

    calls = 0

    def __init__(self, width=8, heads=2):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        type(self).calls += 1
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MyModel(BoringModel):
    """BoringModel's data and loss, with transformer blocks before its linear layer."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[MyTransformerBlock() for _ in range(DEPTH)])

    def forward(self, x):
        # BoringModel's samples are vectors of 32 features: read each one as a sequence of 4 tokens of width 8.
        tokens = x.reshape(x.shape[0], 4, 8)
        return self.layer(self.blocks(tokens).reshape(x.shape[0], 32))


if __name__ == "__main__":
    fsdp = DDPFullyShardedStrategy(
        activation_checkpointing=MyTransformerBlock,  # or pass a list with multiple types
    )
    trainer = Trainer(
        strategy=fsdp,
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        max_steps=4,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(MyModel())
    steps = trainer.global_step
    calls = MyTransformerBlock.calls
    sys.stdout.write(f"rank {trainer.global_rank}: {calls} block forward calls in {steps} steps ({DEPTH} blocks)\n")
    sys.stdout.flush()
    if calls <= steps * DEPTH:
        raise SystemExit("activation checkpointing did not recompute the blocks' forward in the backward pass")
    if trainer.is_global_zero:
        print(f"OK global_step={steps} block_calls={calls}", flush=True)
