"""Demo: train a small transformer language model with FairScale's Fully Sharded Data Parallel under Lightning.

What it shows:

* ``DDPFullyShardedStrategy(auto_wrap_policy={Block})`` makes every transformer block its own FSDP unit (the
  embeddings and the LM head go into the root unit), with no change to the LightningModule.
* The parameters really are sharded: at the start of training every rank prints the bytes of the parameter shards
  it holds (``trainer.strategy.model.parameters()``), about half of the unsharded model's size with two processes.
* Training works: the loss of a synthetic next-token task (each sequence counts up modulo the vocabulary with a
  step of 1, 2 or 3, which the model has to infer from the context) goes down over ~30 optimizer steps.

How to run it (from the project's root)::

    make demo                          # or: .venv/bin/python examples/demo.py
    python examples/demo.py --steps 60 # train longer

Without a GPU it runs two processes on the CPU (gloo), in well under a minute on two cores. With GPUs it uses one
process per GPU (at most two, NCCL); nothing else changes. Lightning's launcher starts the second process by running
this script again, so run it as a script, not from a notebook.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from typing import Any

import torch
from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fairscale import local_slice
from lightning_fairscale.strategies import DDPFullyShardedStrategy

VOCAB, SEQ_LEN, WIDTH, HEADS, DEPTH = 64, 32, 64, 4, 3
BATCH_SIZE = 16  # per process
STEPS_SET = (1, 2, 3)  # the possible steps k of a sequence

# Lightning 2.6's own call of a torch 2.13 deprecation (its CombinedLoader, in every Trainer run, whatever the
# strategy): filtered where it is raised only. lightning-fairscale's and FairScale's calls raise no deprecation warning.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", module=r"pytorch_lightning\.")


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each with a residual connection."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(LightningModule):
    """Token and position embeddings, ``DEPTH`` blocks, a final norm and an LM head."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Embedding(SEQ_LEN, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        # Measured here, before the strategy shards anything.
        self.full_param_bytes = sum(p.numel() * p.element_size() for p in self.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        return self.head(self.norm(self.blocks(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def make_dataset(num_sequences: int, seed: int = 0) -> TensorDataset:
    """Sequences ``s, s+k, s+2k, ...`` (mod VOCAB) with a random start ``s`` and a random step ``k`` in STEPS_SET."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (num_sequences, 1), generator=g)
    step = torch.tensor(STEPS_SET)[torch.randint(0, len(STEPS_SET), (num_sequences, 1), generator=g)]
    tokens = (start + step * torch.arange(SEQ_LEN + 1)) % VOCAB
    return TensorDataset(tokens)


class ReportShards(Callback):
    """On each rank: the bytes of the parameter shards it holds, compared with the unsharded model."""

    def on_train_start(self, trainer: Trainer, pl_module: TinyLM) -> None:
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        # Outside the forward a parameter reads as the whole tensor (its shape, its norm...): `local_slice` is the part
        # this rank holds.
        local = sum(local_slice(p).numel() * p.element_size() for p in trainer.strategy.model.parameters())
        full = pl_module.full_param_bytes
        units = sum(isinstance(m, FullyShardedDataParallel) for m in trainer.strategy.model.modules())
        line = (
            f"[rank {trainer.global_rank}/{trainer.world_size}] FSDP units: {units}; local parameter shards:"
            f" {local} bytes, unsharded model: {full} bytes ({local / full:.1%})"
        )
        # One write per line: both ranks print to the same terminal, and `print` may write the newline separately.
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class PrintLoss(Callback):
    """Prints rank 0's training loss every ``every`` steps and at the last step."""

    def __init__(self, every: int = 5) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step  # optimizer steps done, this one included
        if trainer.is_global_zero and (step == 1 or step % self.every == 0 or step == trainer.max_steps):
            print(f"step {step:3d}  loss {outputs['loss'].item():.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--devices", type=int, default=2, help="processes (capped by the number of GPUs on GPUs)")
    args = parser.parse_args()

    seed_everything(42, workers=True)
    if torch.cuda.is_available():
        accelerator, devices = "gpu", min(args.devices, torch.cuda.device_count())
    else:
        accelerator, devices = "cpu", args.devices

    model = TinyLM()
    data = make_dataset(num_sequences=args.steps * BATCH_SIZE * devices)
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=DDPFullyShardedStrategy(auto_wrap_policy={Block}),
        max_steps=args.steps,
        callbacks=[ReportShards(), PrintLoss()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if trainer.is_global_zero:
        print(
            f"Training a {DEPTH}-block transformer ({model.full_param_bytes} bytes of parameters) on {devices}"
            f" {accelerator.upper()} process(es); loss at the start ~ ln({VOCAB}) = {math.log(VOCAB):.2f}",
            flush=True,
        )
    trainer.fit(model, DataLoader(data, batch_size=BATCH_SIZE, shuffle=True))
    if trainer.is_global_zero:
        print("done", flush=True)


if __name__ == "__main__":
    main()
