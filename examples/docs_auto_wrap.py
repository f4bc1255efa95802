"""Docs example "Auto Wrapping": a BoringModel trained with ``DDPFullyShardedStrategy()`` and no other change.

From the original extension's documentation page. The strategy wraps the model in FSDP units by itself (here, with
the default ``min_num_params=1e8``, the tiny BoringModel becomes a single root unit whose parameters are sharded over
the processes). ``configure_optimizers`` may use ``self.parameters()``, as BoringModel does: the strategy re-points the
optimizer to the sharded parameters, so the doc's advice to use ``self.trainer.model.parameters()`` is optional here.

Differences from the doc, so the example runs anywhere: ``devices=2`` instead of 4, ``max_steps=4``, and
``accelerator="cpu"`` on a machine without CUDA. ``precision=16`` stays as in the doc: on GPUs it is fp16 mixed
precision; on CPUs Lightning runs it as ``"bf16-mixed"`` (and says so), since CPU autocast has no fp16 AMP.

Run it (it writes ``lightning_logs/`` into the current folder)::

    python examples/docs_auto_wrap.py       # two CPU processes, or two GPUs if CUDA is available
"""

import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_fairscale.strategies import DDPFullyShardedStrategy

if __name__ == "__main__":
    model = BoringModel()
    trainer = Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        strategy=DDPFullyShardedStrategy(),
        precision=16,
        max_steps=4,
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        print(f"OK strategy={type(trainer.strategy).__name__} global_step={trainer.global_step}", flush=True)
