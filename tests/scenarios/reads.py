"""What user code reads outside a unit's forward under ``DDPFullyShardedStrategy`` (Trainer) and ``"fsdp_fairscale"``
(Fabric), each against the same training unsharded in this process (:class:`scenarios.config.Reads`):

* ``penalty``: ``loss + 0.05 * sum(p.pow(2).sum() for p in self.parameters())`` plus an orthogonality penalty
  ``((W.t() @ W - I) ** 2).sum()`` on a matrix of another unit (``net.2.up.weight``), in ``training_step`` (inside the
  root unit's forward) or, with Fabric, after ``model(x)`` (outside every forward); SGD;
* ``clip``: ``torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)`` in ``on_before_optimizer_step`` (Fabric:
  after ``fabric.backward``);
* ``log``: a callback's ``pl_module.net[2].up.weight.norm()`` and its gradient's norm in ``on_train_batch_end``, on
  every rank;
* ``accumulate``: micro-batches per step (the Trainer's ``accumulate_grad_batches``: all but the last under
  ``no_sync``), the penalty in each;
* ``one_rank``: the same read under ``if trainer.is_global_zero:``: the error it ends in on rank 0, and how long.

Rank 0 writes ``{"final", "reference", "norms": [each rank's], "expected_norms", "one_rank"}``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import scenarios.jobs  # noqa: E402
from scenarios.common import GLOBAL_BATCH, Block, RegressionModel, RegressionModelWrapper, build_network, dataset  # noqa: E402
from scenarios.config import Reads  # noqa: E402
from scenarios.flavor import Callback, DDPFullyShardedStrategy, Fabric, Trainer, register_strategy_names  # noqa: E402

register_strategy_names()

CONFIG = Reads
PENALTY, CLIP = 0.05, 0.05


def penalty(module: nn.Module) -> torch.Tensor:
    weight = module.net[2].up.weight
    eye = torch.eye(weight.shape[1])
    orthogonality = ((weight.t() @ weight - eye) ** 2).sum()
    return PENALTY * sum(p.pow(2).sum() for p in module.parameters()) + 0.001 * orthogonality


def norms(module: nn.Module) -> tuple[float, float]:
    weight = module.net[2].up.weight
    return weight.norm().item(), weight.grad.norm().item()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def reference(config: Reads) -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    """The same training unsharded, on whole global batches; the norms the callback reads after each step."""
    model = RegressionModelWrapper(build_network())
    optimizer = sgd(model.parameters())
    batches = list(DataLoader(dataset(), batch_size=GLOBAL_BATCH))
    logged = []
    for step in range(config.steps):
        optimizer.zero_grad()
        for micro in range(config.accumulate):  # Lightning divides each micro-batch's loss by their number
            x, y = batches[(step * config.accumulate + micro) % len(batches)]
            loss = nn.functional.mse_loss(model(x), y)
            ((loss + penalty(model) if config.case == "penalty" else loss) / config.accumulate).backward()
        if config.case == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        logged.append(norms(model))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, logged


class Model(RegressionModel):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        return loss + penalty(self) if self.case == "penalty" else loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.case == "clip":
            torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)

    def configure_optimizers(self) -> Any:
        return sgd(self.parameters())


class LogNorms(Callback):
    def __init__(self, one_rank: bool) -> None:
        self.one_rank, self.logged, self.error = one_rank, [], None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if not self.one_rank:
            self.logged.append(norms(pl_module))
        elif trainer.is_global_zero and self.error is None:
            started = time.monotonic()
            try:
                pl_module.net[2].up.weight.norm()
            except RuntimeError as error:  # the other rank made no read: both go on in step
                self.error = (str(error), time.monotonic() - started)


def run_trainer(config: Reads) -> tuple[nn.Module, LogNorms]:
    callback = LogNorms(config.case == "one_rank")
    model = Model(config.case)
    trainer = Trainer(
        accelerator="cpu", devices=config.devices, strategy=DDPFullyShardedStrategy(auto_wrap_policy={Block}),
        max_steps=config.steps, accumulate_grad_batches=config.accumulate, callbacks=[callback], logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    trainer.strategy.unshard_module()
    return model, callback


def run_fabric(fabric: Any, fields: dict[str, Any], out: str) -> None:
    config = Reads.from_json(fields)
    module = RegressionModelWrapper(build_network())
    model, optimizer = fabric.setup(module, sgd(module.parameters()))
    batches = list(DataLoader(dataset(), batch_size=GLOBAL_BATCH))
    rank, world = fabric.global_rank, fabric.world_size
    logged = []
    for step in range(config.steps):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
        fabric.backward(loss + penalty(model) if config.case == "penalty" else loss)
        if config.case == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        logged.append(norms(model))
    finish(config, full_state(fabric, model, out), logged, None, out)


def full_state(fabric: Any, model: Any, out: str) -> dict[str, torch.Tensor]:
    path = os.path.join(os.path.dirname(out), "reads-final.ckpt")
    fabric.strategy.state_dict_type = "full"
    fabric.save(path, {"model": model})
    if not fabric.is_global_zero:
        return {}
    return {k: v.clone() for k, v in torch.load(path, weights_only=True)["model"].items()}


def finish(config: Reads, final: dict[str, torch.Tensor], logged: list[Any], error: Any, out: str) -> None:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, logged)
    if dist.get_rank() == 0:
        expected_final, expected_norms = reference(config)
        torch.save({"final": final, "reference": expected_final, "norms": every, "expected_norms": expected_norms,
                    "one_rank": error}, out)


def main(config: Reads, out: str) -> None:
    torch.manual_seed(7)
    if config.front == "fabric":
        from scenarios.flavor import FabricDDPFullyShardedStrategy

        strategy = FabricDDPFullyShardedStrategy(auto_wrap_policy={Block})
        Fabric(accelerator="cpu", devices=config.devices, strategy=strategy).launch(run_fabric, config.to_json(), out)
        return
    model, callback = run_trainer(config)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()} if dist.get_rank() == 0 else {}
    finish(config, final, callback.logged, callback.error, out)


if __name__ == "__main__":
    scenarios.jobs.main(Reads, main)
