"""Docs example "customize the strategy": ``DDPFullyShardedStrategy(cpu_offload=True)`` passed to the Trainer.

From the original extension's documentation page. With CUDA, ``cpu_offload=True`` keeps the FP32 parameter shards
(and, by default, the gradient shards) in CPU memory between uses. When training on the CPU the parameters are in
CPU memory already: the strategy warns that the setting has no effect, ignores it, and trains as usual.

The doc's snippet only builds the Trainer; this script also fits a BoringModel for a few steps.
Differences from the doc, so the example runs anywhere: ``devices=2`` instead of 4, ``max_steps=4``, and
``accelerator="cpu"`` on a machine without CUDA.

Run it (it writes ``lightning_logs/`` into the current folder)::

    python examples/docs_cpu_offload.py     # two CPU processes (warns), or two GPUs if CUDA is available
"""

import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_fairscale.strategies import DDPFullyShardedStrategy

if __name__ == "__main__":
    native_fsdp = DDPFullyShardedStrategy(cpu_offload=True)
    trainer = Trainer(
        strategy=native_fsdp, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=2, max_steps=4
    )
    trainer.fit(BoringModel())
    if trainer.is_global_zero:
        print(f"OK cpu_offload={native_fsdp.cpu_offload} global_step={trainer.global_step}", flush=True)
