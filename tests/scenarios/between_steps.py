"""Loops that change the model's state between steps, under ``DDPFullyShardedStrategy`` (Trainer) and
``"fsdp_fairscale"`` (Fabric), each with its unsharded reference computed in the same process.

What it runs is a ``scenarios.config.BetweenSteps``:

* ``case="freeze"``, the gradual-unfreezing recipe: at each epoch's start (two steps) layers are frozen and
  unfrozen (Lightning's ``BaseFinetuning.freeze`` / ``make_trainable`` from a callback; Fabric: the same calls in
  the loop), one Adam over all parameters. The schedule (:data:`SCHEDULE`) freezes a whole unit (a Block), a part of
  a unit that also trains (a Block's ``up``, the root's first layer) and the root's last layer.
* ``case="gan"``, two optimizers: a generator and a discriminator, each an FSDP unit; one forward of the generator
  per batch used by both losses; the discriminator's step first (its loss on the generator's output detached or,
  with ``detach=False``, not: its backward then reaches the generator, whose graph it keeps for the generator's
  step), then the generator's. Trainer: manual optimization with ``toggle_optimizer``, ``manual_backward``,
  ``clip_gradients``; Fabric: two set-up modules, the other module's parameters frozen during each step.

Rank 0 writes ``{"final": state dict after all steps, "reference": the unsharded training's, "start": the weights
both start from}`` (``final`` after a save at ``save_at`` and a resume in a fresh model, if set). By hand (from the
project's root)::

    PYTHONPATH=src python tests/scenarios/between_steps.py --config '{"case": "gan", "devices": 1}' --out r.pt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import scenarios.jobs  # noqa: E402
from scenarios.common import (  # noqa: E402
    GLOBAL_BATCH,
    Block,
    RegressionModel,
    RegressionModelWrapper,
    build_network,
    dataset,
)
from scenarios.config import BetweenSteps  # noqa: E402
from scenarios.flavor import (  # noqa: E402
    Callback,
    DDPFullyShardedStrategy,
    Fabric,
    LightningModule,
    Trainer,
    pl,
    register_strategy_names,
)

register_strategy_names()

CONFIG = BetweenSteps

#: freeze: for each epoch (two steps), the parameters frozen during it (every other parameter trains).
SCHEDULE = [
    ("net.0.weight", "net.1"),  # a part of the root unit; a whole Block unit
    ("net.2.up",),  # a part of a Block unit
    ("net.3",),  # a part of the root unit
    (),
]
STEPS_PER_EPOCH = 2
LATENT, FEATURES, WIDTH = 8, 16, 32


def frozen_in(epoch: int) -> tuple[str, ...]:
    return SCHEDULE[min(epoch, len(SCHEDULE) - 1)]


def apply_schedule(root: nn.Module, epoch: int) -> None:
    """Lightning's recipe: everything trainable, then this epoch's layers frozen (``root`` holds ``net``)."""
    finetuning = pl.callbacks.BaseFinetuning
    finetuning.make_trainable(root.net)
    for name in frozen_in(epoch):
        target = root.get_submodule(name) if not name.endswith(("weight", "bias")) else None
        if target is not None:
            finetuning.freeze(target)
        else:
            root.get_parameter(name).requires_grad_(False)


# ------------------------------------------------------------------------------------------------------------------
# The models


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(LATENT, WIDTH), nn.GELU(), nn.Linear(WIDTH, FEATURES))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.body(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def gan_networks() -> tuple[Generator, Discriminator]:
    torch.manual_seed(4321)
    return Generator(), Discriminator()


def gan_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(16, FEATURES, generator=g), torch.randn(16, LATENT, generator=g))


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def gan_losses_d(d: nn.Module, x: torch.Tensor, fake: torch.Tensor, detach: bool) -> torch.Tensor:
    return (bce(d(x), 1.0) + bce(d(fake.detach() if detach else fake), 0.0)) / 2


def set_trainable(module: nn.Module, trainable: bool) -> None:
    for param in module.parameters():
        param.requires_grad_(trainable)


# ------------------------------------------------------------------------------------------------------------------
# The unsharded references (one process, the whole global batch)


def clip(params: Any, value: Optional[float]) -> None:
    if value is not None:
        torch.nn.utils.clip_grad_norm_(list(params), value)


def freeze_reference(config: BetweenSteps) -> dict[str, torch.Tensor]:
    model = RegressionModelWrapper(build_network())
    optimizer = adam(model.parameters())
    batches = list(DataLoader(dataset(), batch_size=GLOBAL_BATCH))
    for step in range(config.steps):
        if step % STEPS_PER_EPOCH == 0:
            apply_schedule(model, step // STEPS_PER_EPOCH)
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        clip(model.parameters(), config.clip)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def gan_step(g: nn.Module, d: nn.Module, g_opt: Any, d_opt: Any, x: torch.Tensor, z: torch.Tensor,
             config: BetweenSteps, backward: Any, clip_fn: Any, toggle: Any, untoggle: Any) -> None:
    """One batch of the GAN recipe: the discriminator's step, then the generator's, over one generator forward."""
    fake = g(z)
    toggle(d_opt)
    d_loss = gan_losses_d(d, x, fake, config.detach)
    backward(d_loss, retain_graph=not config.detach)
    clip_fn(d_opt)
    d_opt.step()
    d_opt.zero_grad()
    untoggle(d_opt)
    toggle(g_opt)
    g_loss = bce(d(fake), 1.0)
    backward(g_loss)
    clip_fn(g_opt)
    g_opt.step()
    g_opt.zero_grad()
    untoggle(g_opt)


def gan_reference(config: BetweenSteps) -> dict[str, torch.Tensor]:
    g, d = gan_networks()
    model = nn.ModuleDict({"generator": g, "discriminator": d})
    g_opt, d_opt = adam(g.parameters()), adam(d.parameters())
    others = {id(g_opt): d, id(d_opt): g}
    batches = list(DataLoader(gan_dataset(), batch_size=GLOBAL_BATCH))
    for step in range(config.steps):
        x, z = batches[step % len(batches)]
        gan_step(
            g, d, g_opt, d_opt, x, z, config,
            backward=lambda loss, **kw: loss.backward(**kw),
            clip_fn=lambda opt: clip((p for group in opt.param_groups for p in group["params"]), config.clip),
            toggle=lambda opt: set_trainable(others[id(opt)], False),
            untoggle=lambda opt: set_trainable(others[id(opt)], True),
        )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------------------------
# The Trainer


class FreezeSchedule(Callback):
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        apply_schedule(pl_module, trainer.current_epoch)


class GanModel(LightningModule):
    def __init__(self, detach: bool = True, clip: Optional[float] = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.detach, self.clip = detach, clip
        self.generator, self.discriminator = gan_networks()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, z = batch
        g_opt, d_opt = self.optimizers()

        def clip_fn(opt: Any) -> None:
            if self.clip is not None:
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")

        gan_step(
            self.generator, self.discriminator, g_opt, d_opt, x, z,
            BetweenSteps(detach=self.detach), self.manual_backward, clip_fn, self.toggle_optimizer,
            self.untoggle_optimizer,
        )

    def configure_optimizers(self) -> Any:
        return [adam(self.generator.parameters()), adam(self.discriminator.parameters())]

    def train_dataloader(self) -> DataLoader:
        data = gan_dataset()
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // self.trainer.world_size, sampler=sampler)


def trainer_fit(config: BetweenSteps, max_steps: int, ckpt_path: Optional[str] = None,
                save: Optional[str] = None) -> dict[str, torch.Tensor]:
    """``fit`` for ``max_steps`` (batches of the gan case), from ``ckpt_path`` if given; with ``save`` (a folder), a
    checkpoint at every epoch's end there (``epoch=N.ckpt``: Lightning resumes exactly from an epoch's end)."""
    gan = config.case == "gan"
    if gan:
        model: Any = GanModel(config.detach, config.clip)
        policy: Any = {Generator, Discriminator}
    else:
        model = RegressionModel()
        if config.setup_frozen:
            apply_schedule(model, 0)
        policy = {Block}
    strategy: Any = DDPFullyShardedStrategy(auto_wrap_policy=policy, state_dict_type=config.state_dict_type)
    if config.strategy == "ddp":
        strategy = pl.strategies.DDPStrategy(find_unused_parameters=True)
    trainer = Trainer(
        accelerator="cpu", devices=config.devices, strategy=strategy,
        max_steps=2 * max_steps if gan else max_steps,  # manual optimization: each optimizer's step counts
        callbacks=([] if gan else [FreezeSchedule()]) + ([
            pl.callbacks.ModelCheckpoint(dirpath=save, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        ] if save else []),
        gradient_clip_val=None if gan else config.clip,
        logger=False, enable_checkpointing=bool(save), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if hasattr(trainer.strategy, "unshard_module"):
        trainer.strategy.unshard_module()
    if not trainer.is_global_zero:
        return {}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_trainer(config: BetweenSteps, work: Path) -> dict[str, torch.Tensor]:
    if config.save_at is None:
        return trainer_fit(config, config.steps)
    per_epoch = STEPS_PER_EPOCH if config.case == "freeze" else len(gan_dataset()) // GLOBAL_BATCH
    assert config.save_at % per_epoch == 0, "the Trainer resumes exactly from an epoch's end"
    trainer_fit(config, config.steps, save=str(work / "epochs"))
    path = work / "epochs" / f"epoch={config.save_at // per_epoch - 1}.ckpt"
    return trainer_fit(config, config.steps, ckpt_path=str(path))


# ------------------------------------------------------------------------------------------------------------------
# Fabric


def fabric_freeze(fabric: Any, config: BetweenSteps, work: Path) -> dict[str, torch.Tensor]:
    def set_up() -> tuple[Any, Any]:
        model = RegressionModelWrapper(build_network())
        if config.setup_frozen:
            apply_schedule(model, 0)
        return fabric.setup(model, adam(model.parameters()))

    def train(model: Any, optimizer: Any, first: int, last: int) -> None:
        batches = list(DataLoader(dataset(), batch_size=GLOBAL_BATCH))
        rank, world = fabric.global_rank, fabric.world_size
        for step in range(first, last):
            if step % STEPS_PER_EPOCH == 0:
                apply_schedule(model, step // STEPS_PER_EPOCH)
            x, y = batches[step % len(batches)]
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x[rank::world]), y[rank::world]))
            if config.clip is not None:
                fabric.clip_gradients(model, optimizer, max_norm=config.clip)
            optimizer.step()

    model, optimizer = set_up()
    if config.save_at is None:
        train(model, optimizer, 0, config.steps)
    else:
        train(model, optimizer, 0, config.save_at)
        path = work / "between-fabric.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        model, optimizer = set_up()
        apply_schedule(model, config.save_at // STEPS_PER_EPOCH)  # as the loop left it (the resumed step sets it)
        fabric.load(path, {"model": model, "optimizer": optimizer})
        train(model, optimizer, config.save_at, config.steps)
    return full_state(fabric, {"": model}, work)


def fabric_gan(fabric: Any, config: BetweenSteps, work: Path) -> dict[str, torch.Tensor]:
    def set_up() -> tuple[Any, Any, Any, Any]:
        g, d = gan_networks()
        g, g_opt = fabric.setup(g, adam(g.parameters()))
        d, d_opt = fabric.setup(d, adam(d.parameters()))
        return g, d, g_opt, d_opt

    def train(g: Any, d: Any, g_opt: Any, d_opt: Any, first: int, last: int) -> None:
        others = {id(g_opt): d, id(d_opt): g}
        models = {id(g_opt): g, id(d_opt): d}
        batches = list(DataLoader(gan_dataset(), batch_size=GLOBAL_BATCH))
        rank, world = fabric.global_rank, fabric.world_size
        for step in range(first, last):
            x, z = batches[step % len(batches)]
            gan_step(
                g, d, g_opt, d_opt, x[rank::world], z[rank::world], config,
                backward=lambda loss, **kw: fabric.backward(loss, **kw),
                clip_fn=lambda opt: None if config.clip is None else fabric.clip_gradients(
                    models[id(opt)], opt, max_norm=config.clip
                ),
                toggle=lambda opt: set_trainable(others[id(opt)], False),
                untoggle=lambda opt: set_trainable(others[id(opt)], True),
            )

    g, d, g_opt, d_opt = set_up()
    if config.save_at is None:
        train(g, d, g_opt, d_opt, 0, config.steps)
    else:
        train(g, d, g_opt, d_opt, 0, config.save_at)
        # One model (with its optimizer) per checkpoint file.
        fabric.save(work / "between-g.ckpt", {"model": g, "optimizer": g_opt})
        fabric.save(work / "between-d.ckpt", {"model": d, "optimizer": d_opt})
        g, d, g_opt, d_opt = set_up()
        fabric.load(work / "between-g.ckpt", {"model": g, "optimizer": g_opt})
        fabric.load(work / "between-d.ckpt", {"model": d, "optimizer": d_opt})
        train(g, d, g_opt, d_opt, config.save_at, config.steps)
    return full_state(fabric, {"generator.": g, "discriminator.": d}, work)


def full_state(fabric: Any, models: dict[str, Any], work: Path) -> dict[str, torch.Tensor]:
    """The models' full state dicts (keys prefixed), through a full checkpoint file each; rank 0's (empty
    elsewhere)."""
    strategy = fabric.strategy
    kind = strategy.state_dict_type
    strategy.state_dict_type = "full"
    state = {}
    for index, (prefix, model) in enumerate(models.items()):
        path = work / f"between-final-{index}.ckpt"
        fabric.save(path, {"model": model})
        if fabric.is_global_zero:
            saved = torch.load(path, weights_only=True)["model"]
            state.update({prefix + k: v.clone() for k, v in saved.items()})
    strategy.state_dict_type = kind
    return state


def run_fabric(fabric: Any, fields: dict[str, Any], out: str) -> None:
    config = BetweenSteps.from_json(fields)
    work = Path(config.save_dir or Path(out).parent)
    final = (fabric_gan if config.case == "gan" else fabric_freeze)(fabric, config, work)
    if fabric.is_global_zero:
        torch.save({"final": final, "reference": reference(config), "start": reference(config.replace(steps=0))}, out)


def reference(config: BetweenSteps) -> dict[str, torch.Tensor]:
    return gan_reference(config) if config.case == "gan" else freeze_reference(config)


def main(config: BetweenSteps, out: str) -> None:
    """Run ``config``; rank 0 writes the result to ``out``."""
    torch.manual_seed(7)
    work = Path(config.save_dir or Path(out).parent)
    work.mkdir(parents=True, exist_ok=True)
    if config.front == "fabric":
        from scenarios.flavor import FabricDDPFullyShardedStrategy

        policy = {Block} if config.case == "freeze" else None
        strategy = FabricDDPFullyShardedStrategy(auto_wrap_policy=policy, state_dict_type=config.state_dict_type)
        fabric = Fabric(accelerator="cpu", devices=config.devices, strategy=strategy)
        fabric.launch(run_fabric, config.to_json(), out)
        return
    final = run_trainer(config, work)
    if final:  # rank 0's
        torch.save({"final": final, "reference": reference(config), "start": reference(config.replace(steps=0))}, out)


if __name__ == "__main__":
    scenarios.jobs.main(BetweenSteps, main)
