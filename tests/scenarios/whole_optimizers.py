"""Optimizers that read whole tensors under ``DDPFullyShardedStrategy`` (Trainer) and ``"fsdp_fairscale"`` (Fabric),
each with its unsharded reference computed in the same process.

What it runs is a ``scenarios.config.WholeOptimizers``: ``torch.optim.Adafactor`` over ``self.parameters()``; Muon
on the 2-D weights with AdamW on the rest (the usual recipe: two optimizers, the Trainer's manual optimization); a
LARS of the user's own (:class:`LARS`, a subclass of ``torch.optim.Optimizer``: a trust ratio per tensor); LBFGS
(refused before the first step); Adam (the element-wise path). The model is ``build_network()`` (FP32: FairScale
refuses float64 parameters), auto-wrapped by ``{Block}`` (and ``nn.Linear`` under manual optimization, whose backward
runs inside the root's forward). Muon's reference sums each gradient in the sharded run's order
(:func:`ranks_backward`), which its bfloat16 orthogonalisation needs on every CPU (:func:`shares_the_ranks_order`).

Rank 0 writes ``{"final": state dict after all steps, "reference": the unsharded training's, "initial": the
weights before training, "paths": each optimizer's path}``. By hand (from the project's root)::

    PYTHONPATH=src python tests/scenarios/whole_optimizers.py --config '{"optimizer": "lars", "devices": 1}' --out r.pt
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import scenarios.jobs  # noqa: E402
from scenarios.common import GLOBAL_BATCH, Block, build_network, dataset  # noqa: E402
from scenarios.config import WholeOptimizers  # noqa: E402
from scenarios.flavor import DDPFullyShardedStrategy, Fabric, LightningModule, Trainer, pl  # noqa: E402
from scenarios.flavor import register_strategy_names  # noqa: E402

register_strategy_names()

CONFIG = WholeOptimizers


class LARS(torch.optim.Optimizer):
    """LARS as SimCLR-style code writes it: SGD with momentum, each tensor's step scaled by its trust ratio
    ``eta * ||w|| / ||g + wd * w||``: not element-wise, and no class the strategy knows."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4,
                 eta: float = 0.02) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=group["weight_decay"])
                w_norm, d_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d)
                positive = (w_norm > 0) & (d_norm > 0)
                trust = torch.where(positive, group["eta"] * w_norm / d_norm, torch.ones_like(w_norm))
                d = d.mul(trust)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = d.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(d)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
        return loss


class RaisingLARS(LARS):
    """A LARS whose step raises when it sees the last layer's weight whole: only on that parameter's owner rank."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.shape == (4, 32):
                    raise ValueError("the user's step refused the 4x32 weight")
        return super().step(closure)


def dtype_of(config: WholeOptimizers) -> torch.dtype:
    return {"bf16-true": torch.bfloat16}.get(config.precision, torch.float32)


def network(config: WholeOptimizers) -> nn.Module:
    net = build_network().to(dtype_of(config))
    if config.frozen:
        net[0].requires_grad_(False)
    return net


def data(config: WholeOptimizers) -> TensorDataset:
    x, y = dataset().tensors
    return TensorDataset(x.to(dtype_of(config)), y.to(dtype_of(config)))


def make_optimizers(config: WholeOptimizers, module: nn.Module) -> list[torch.optim.Optimizer]:
    named = list(module.named_parameters())
    params: Any = [p for _, p in named]
    if config.groups:
        params = [
            {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.endswith("weight")], "lr": 0.004, "weight_decay": 0.0},
        ]
    kind = config.optimizer
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=0.01)]
    if kind == "lars":
        return [LARS(params)]
    if kind == "lars-raises":
        # A LARS made first: torch then hooks LARS.step too, so RaisingLARS's `super().step()` nests the hooks.
        LARS([nn.Parameter(torch.zeros(1))])
        return [RaisingLARS(params)]
    if kind == "adam":
        return [torch.optim.Adam(params, lr=0.01)]
    if kind == "lbfgs":
        return [torch.optim.LBFGS(params, lr=0.1, max_iter=4)]
    if kind == "muon":
        matrices = [p for _, p in named if p.ndim >= 2]
        return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01),
                torch.optim.AdamW([p for _, p in named if p.ndim < 2], lr=0.01, weight_decay=0.01)]
    raise ValueError(kind)


def two_stages(config: WholeOptimizers) -> int:
    return 2 if config.stages == "fit-fit" else 1


def clip(optimizer: torch.optim.Optimizer, value: Optional[float]) -> None:
    if value is not None:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], value)


# ------------------------------------------------------------------------------------------------------------------
# The unsharded reference (one process, the whole global batch)


def shares_the_ranks_order(config: WholeOptimizers) -> bool:
    """Whether the reference sums each gradient in the sharded run's order (:func:`ranks_backward`): for Muon, whose
    orthogonalisation rounds its input to bfloat16 and then multiplies the smallest singular values by up to
    ``3.4445**5`` (~490: the slope at zero of its 5 Newton-Schulz steps), so that trainings whose gradients are a
    float32 rounding apart end 0.1 of the update apart (``test_whole_optimizers.py`` says more)."""
    return config.optimizer == "muon" and config.devices > 1


def ranks_backward(config: WholeOptimizers, model: nn.Module, batches: list[Any], step: int) -> None:
    """The gradients of step ``step`` summed in the order of the sharded run of ``config.devices`` processes: each
    rank's gradient of its own part of every batch (the ``rank::world`` rows, as both fronts give them: the
    Trainer's ``DistributedSampler``, Fabric's slicing), accumulated over the micro-batches, then the ranks' gradients
    added in rank order, each already divided by the number of ranks (FairScale divides before its reduce-scatter;
    dividing the loss instead divides every gradient by the same power of 2: the same bits). For 2 ranks that is the
    sharded run's reduction exactly (one addition, which commutes); the per-rank forward and backward run the same
    kernels on the same shapes as the ranks do, so that on any CPU both sides get the same bits."""
    world = config.devices
    params = [p for p in model.parameters() if p.requires_grad]
    total: list[Optional[torch.Tensor]] = [None] * len(params)
    for rank in range(world):
        for p in params:
            p.grad = None
        for micro in range(config.accumulate):
            x, y = batches[(step * config.accumulate + micro) % len(batches)]
            x, y = x[rank::world].to(next(model.parameters()).dtype), y[rank::world]
            loss = nn.functional.mse_loss(model(x), y.to(x.dtype)) / (config.accumulate * world)
            loss.backward()
        total = [t if p.grad is None else p.grad if t is None else t + p.grad for t, p in zip(total, params)]
    for p, grad in zip(params, total):
        p.grad = grad


def reference(config: WholeOptimizers, states_at: Optional[list[Any]] = None) -> dict[str, torch.Tensor]:
    """The unsharded training's weights; with ``states_at`` (a list), its optimizers' state dicts after ``save_at``
    steps are appended to it."""
    model = network(config)
    master = model
    if config.precision == "bf16-mixed":  # FairScale's: FP32 master weights, forward and backward in a bf16 copy
        model = copy.deepcopy(master).to(torch.bfloat16)
    batches = list(DataLoader(data(config), batch_size=GLOBAL_BATCH))
    for _ in range(two_stages(config)):
        optimizers = make_optimizers(config, master)
        for step in range(config.steps):
            for optimizer in optimizers:
                optimizer.zero_grad()
            if shares_the_ranks_order(config):
                ranks_backward(config, model, batches, step)
            else:
                for micro in range(config.accumulate):
                    x, y = batches[(step * config.accumulate + micro) % len(batches)]
                    x = x.to(next(model.parameters()).dtype)
                    loss = nn.functional.mse_loss(model(x), y.to(x.dtype)) / config.accumulate
                    loss.backward()
            if model is not master:
                for p, q in zip(master.parameters(), model.parameters()):
                    if q.grad is not None:
                        p.grad = q.grad.float() if p.grad is None else p.grad + q.grad.float()
                        q.grad = None
            for optimizer in optimizers:
                clip(optimizer, config.clip)
                optimizer.step()
            if states_at is not None and step + 1 == config.save_at:
                states_at.extend(copy.deepcopy(optimizer.state_dict()) for optimizer in optimizers)
            if model is not master:
                with torch.no_grad():
                    for p, q in zip(master.parameters(), model.parameters()):
                        q.copy_(p)
    return {k: v.detach().clone() for k, v in master.state_dict().items()}


# ------------------------------------------------------------------------------------------------------------------
# The Trainer


class WholeModel(LightningModule):
    def __init__(self, config: WholeOptimizers) -> None:
        super().__init__()
        self.config = config
        self.net = network(config)
        self.automatic_optimization = not (config.manual or config.optimizer == "muon")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.manual_backward(loss / self.config.accumulate)
        if (batch_idx + 1) % self.config.accumulate == 0:
            for optimizer in optimizers:
                if self.config.clip is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=self.config.clip, gradient_clip_algorithm="norm")
                optimizer.step()
                optimizer.zero_grad()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.net(batch[0])

    def configure_optimizers(self) -> Any:
        optimizers = make_optimizers(self.config, self)
        self.made = optimizers
        return optimizers if len(optimizers) > 1 else optimizers[0]

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(data(self.config), world, rank, shuffle=False)
        return DataLoader(data(self.config), batch_size=GLOBAL_BATCH // world, sampler=sampler)

    val_dataloader = train_dataloader


def strategy_for(config: WholeOptimizers, fabric: bool = False) -> Any:
    if config.strategy == "ddp":
        return "ddp"
    # Manual optimization backwards inside the root's forward: every layer in a unit below the root.
    policy = {Block, nn.Linear} if config.manual or config.optimizer == "muon" else {Block}
    options = {"auto_wrap_policy": policy, "state_dict_type": config.state_dict_type}
    if config.optimizer_path != "auto":
        options["optimizer_path"] = config.optimizer_path
    if fabric:
        from scenarios.flavor import FabricDDPFullyShardedStrategy

        return FabricDDPFullyShardedStrategy(**options)
    return DDPFullyShardedStrategy(**options)


def paths_of(strategy: Any, optimizers: list[Any]) -> list[str]:
    """The path each optimizer steps on (``[]`` under another strategy, or before paths existed)."""
    sharded = getattr(strategy, "_sharded", None)
    models = getattr(strategy, "_set_up", None)
    found = [sharded] * len(optimizers) if sharded is not None else [
        models.model_of(o) if models.holds(o) else None for o in optimizers] if models is not None else []
    return [model.path(o) for model, o in zip(found, optimizers) if hasattr(model, "path")]


def trainer_fit(config: WholeOptimizers, model: WholeModel, ckpt_path: Optional[str] = None,
                save: Optional[str] = None, validate: bool = False) -> Any:
    steps_per_epoch = len(data(config)) // GLOBAL_BATCH // config.accumulate
    trainer = Trainer(
        accelerator="cpu", devices=config.devices, strategy=strategy_for(config),
        precision="32-true" if config.precision == "32-true" else config.precision,
        max_steps=config.steps * (2 if config.optimizer == "muon" else 1),
        accumulate_grad_batches=config.accumulate if model.automatic_optimization else 1,
        gradient_clip_val=config.clip if model.automatic_optimization else None,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=save, filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                                                save_on_train_epoch_end=True)] if save else [],
        logger=False, enable_checkpointing=bool(save), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1, num_sanity_val_steps=0, use_distributed_sampler=False, check_val_every_n_epoch=100,
    )
    assert steps_per_epoch >= 1
    if validate:
        trainer.validate(model)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def run_trainer(config: WholeOptimizers, work: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    model = WholeModel(config)
    if config.save_at is not None:
        trainer_fit(config, model, save=str(work / "epochs"))
        model = WholeModel(config)
        per_epoch = len(data(config)) // GLOBAL_BATCH
        path = work / "epochs" / f"epoch={config.save_at // per_epoch - 1}.ckpt"
        trainer = trainer_fit(config, model, ckpt_path=str(path))
    else:
        trainer = trainer_fit(config, model, validate=config.stages == "validate-fit")
        if config.stages == "fit-fit":
            trainer = trainer_fit(config, model)
    paths = paths_of(trainer.strategy, [getattr(o, "optimizer", o) for o in trainer.optimizers])
    if hasattr(trainer.strategy, "unshard_module"):
        trainer.strategy.unshard_module()
    if not trainer.is_global_zero:
        return {}, paths
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}, paths


# ------------------------------------------------------------------------------------------------------------------
# Fabric


def run_fabric(fabric: Any, fields: dict[str, Any], out: str) -> None:
    config = WholeOptimizers.from_json(fields)
    work = Path(config.save_dir or Path(out).parent)
    rank, world = fabric.global_rank, fabric.world_size
    batches = list(DataLoader(data(config), batch_size=GLOBAL_BATCH))

    def set_up() -> tuple[Any, list[Any]]:
        net = network(config)
        model, *optimizers = fabric.setup(net, *make_optimizers(config, net))
        return model, optimizers

    def train(model: Any, optimizers: list[Any], first: int, last: int) -> None:
        for step in range(first, last):
            for optimizer in optimizers:
                optimizer.zero_grad()
            for micro in range(config.accumulate):
                x, y = batches[(step * config.accumulate + micro) % len(batches)]
                with fabric.no_backward_sync(model, enabled=micro < config.accumulate - 1):
                    loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world]) / config.accumulate
                    fabric.backward(loss)
            for optimizer in optimizers:
                if config.clip is not None:
                    fabric.clip_gradients(model, optimizer, max_norm=config.clip)
                optimizer.step()

    def state(model: Any, optimizers: list[Any]) -> dict[str, Any]:
        return {"model": model, **{f"optimizer{i}": o for i, o in enumerate(optimizers)}}

    model, optimizers = set_up()
    checkpoint_states: list[Any] = []
    if config.load_from is not None:
        fabric.load(config.load_from, state(model, optimizers))
        train(model, optimizers, config.save_at or 0, config.steps)
    elif config.save_at is None:
        train(model, optimizers, 0, config.steps)
    else:
        train(model, optimizers, 0, config.save_at)
        path = work / f"whole-{config.state_dict_type}.ckpt"
        fabric.save(path, state(model, optimizers))
        if config.steps == config.save_at:
            return  # a checkpoint for another launch (another number of processes) to resume
        if fabric.is_global_zero:  # the plain optimizers' states the checkpoint holds (offline consolidation)
            from lightning_fairscale.fsdp.state.sharded_checkpoint import consolidate

            saved = consolidate(path) if path.is_dir() else torch.load(path, weights_only=False)
            checkpoint_states = [saved[f"optimizer{i}"] for i in range(len(optimizers))]
        model, optimizers = set_up()
        fabric.load(path, state(model, optimizers))
        train(model, optimizers, config.save_at, config.steps)
    paths = paths_of(fabric.strategy, [getattr(o, "optimizer", o) for o in optimizers])
    strategy = fabric.strategy
    strategy.state_dict_type = "full"
    final_path = work / "whole-final.ckpt"
    fabric.save(final_path, {"model": model})
    if fabric.is_global_zero:
        final = {k: v.clone() for k, v in torch.load(final_path, weights_only=True)["model"].items()}
        states: list[Any] = []
        torch.save({"final": final, "reference": reference(config, states), "initial": initial(config),
                    "paths": paths, "checkpoint_states": checkpoint_states, "reference_states": states}, out)


def initial(config: WholeOptimizers) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in network(config).state_dict().items()}


def main(config: WholeOptimizers, out: str) -> None:
    """Run ``config``; rank 0 writes the result to ``out``."""
    torch.manual_seed(7)
    work = Path(config.save_dir or Path(out).parent)
    work.mkdir(parents=True, exist_ok=True)
    if config.front == "fabric":
        precision = "32-true" if config.precision == "32-true" else config.precision
        fabric = Fabric(accelerator="cpu", devices=config.devices, strategy=strategy_for(config, fabric=True),
                        precision=precision)
        fabric.launch(run_fabric, config.to_json(), out)
        return
    final, paths = run_trainer(config, work)
    if final:  # rank 0's
        torch.save({"final": final, "reference": reference(config), "initial": initial(config), "paths": paths}, out)


if __name__ == "__main__":
    scenarios.jobs.main(WholeOptimizers, main)
