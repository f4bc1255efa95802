"""FairScale's FSDP in a training loop written with Fabric (``lightning_fairscale.fabric``).

The loop shards a small model over two processes (``Fabric(strategy="fsdp_fairscale")``, each ``Block`` its own FSDP
unit), trains in mixed precision with gradient accumulation (``fabric.no_backward_sync``) and clipping by the global
norm, and saves a sharded checkpoint half-way (``fabric.save``: every rank writes its own shard). A fresh model and
optimizer then load it (``fabric.load``) and train the second half again: the losses are the same.

The checkpoint is Fabric's (the meta file holds ``"step"``, each shard the model's and the optimizer's part):
``lightning-fairscale-consolidate`` turns it into the one file a full save writes (``torch.load(path)["model"]`` is
the model's full state dict), and ``Trainer.fit(ckpt_path=...)`` resumes from either.

Run it (two CPU processes, or two GPUs if CUDA is available)::

    python examples/fabric_fsdp.py
"""

import torch
from fairscale.nn import FullyShardedDataParallel
from lightning_fabric import Fabric
from torch import nn

import lightning_fairscale  # noqa: F401  (registers "fsdp_fairscale" with Fabric's registry)
from lightning_fairscale.fabric import DDPFullyShardedStrategy

STEPS, ACCUMULATE = 8, 2


class Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def model_and_optimizer(fabric: Fabric) -> tuple:
    torch.manual_seed(0)  # the same initial weights for both runs
    model = nn.Sequential(nn.Linear(16, 64), Block(), Block(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the unwrapped model: re-pointed to the shards
    return fabric.setup(model, optimizer)


def train(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, first: int, checkpoint: str = "") -> list:
    losses = []
    for step in range(first, STEPS):
        for micro in range(ACCUMULATE):
            generator = torch.Generator().manual_seed(micro)  # the same global batches every step; this rank's half:
            x = torch.randn(8, 16, generator=generator)[fabric.global_rank :: fabric.world_size].to(fabric.device)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):  # no reduce-scatter while accumulating
                loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                fabric.backward(loss / ACCUMULATE)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the norm of all shards together
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach()).item())
        fabric.print(f"step {step + 1} loss {losses[-1]:.5f}")
        if checkpoint and step + 1 == STEPS // 2:
            fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step + 1})
    return losses


if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    strategy = DDPFullyShardedStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")  # or "fsdp_fairscale"
    fabric = Fabric(accelerator="cuda" if cuda else "cpu", devices=2, strategy=strategy,
                    precision="16-mixed" if cuda else "bf16-mixed")
    fabric.launch()

    model, optimizer = model_and_optimizer(fabric)
    fabric.print(f"FSDP units: {sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())}")
    first = train(fabric, model, optimizer, 0, checkpoint="fabric-checkpoint")

    model, optimizer = model_and_optimizer(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load("fabric-checkpoint", state)  # every rank reads the slices of the shards it owns
    second = train(fabric, model, optimizer, state["step"])
    assert second == first[STEPS // 2 :], (first, second)
    fabric.print(f"OK resumed at step {state['step']}: the last {len(second)} losses are the same")
