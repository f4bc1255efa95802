"""``DDPShardedStrategy`` while the loop changes the model's state between steps (issue 47, items 1-3): validation
inside ``fit`` (eval/train), layers frozen and unfrozen after set-up, manual optimization with two toggled
optimizers; the Trainer's and Fabric's, one after another in the same processes.

Every case is a function of ``(strategy, devices, workdir)``: the tests run them all on 2 processes with
``"ddp_sharded"`` (this script, rank 0 writes ``--out``), and each one again in the test's own process on one device
without any strategy (the unsharded reference, on the full global batch). Each returns the final weights and, where
it has one, the optimizer state a full checkpoint holds (a plain optimizer's, consolidated).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from scenarios import common  # noqa: E402
from scenarios.common import GLOBAL_BATCH, RegressionModelWrapper, build_network, dataset  # noqa: E402
from scenarios.flavor import (  # noqa: E402
    Callback,
    DDPShardedStrategy,
    Fabric,
    FabricDDPShardedStrategy,
    LightningModule,
    ModelCheckpoint,
    Trainer,
    pl,
    register_strategy_names,
    seed_everything,
)

register_strategy_names()
BaseFinetuning = pl.callbacks.BaseFinetuning

#: Which layers of ``build_network()`` are frozen in which epoch (2 steps each): the first (frozen before set-up, as
#: ``BaseFinetuning.freeze_before_training`` does), none, the last.
FREEZE_SCHEDULE: dict[int, tuple[int, ...]] = {0: (0,), 1: (), 2: (3,)}
#: Gradient clipping by norm while freezing: the norm is that of the trainable parameters' gradients of the moment.
FREEZE_CLIP = 0.05
#: The GAN recipe's clipping by norm (``clip_gradients``), of each optimizer's gradients in its own step.
GAN_CLIP = 0.3


#: Gradient buckets small enough that the small parameters share some (``reduce_buffer_size``, in elements).
BUCKETS = 1000


def with_buckets(strategy: Any, fabric: bool = False) -> Any:
    """``strategy``, with small gradient buckets when it is ``"ddp_sharded"``."""
    if strategy != "ddp_sharded":
        return strategy
    return (FabricDDPShardedStrategy if fabric else DDPShardedStrategy)(reduce_buffer_size=BUCKETS)


def _trainer(strategy: Any, devices: int, workdir: Path, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "use_distributed_sampler": False,
        "default_root_dir": workdir,
        **kwargs,
    }
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, **options)


def _result(trainer: Trainer, model: nn.Module, workdir: Path, name: str) -> dict[str, Any]:
    """The weights and the consolidated optimizer states of a full checkpoint saved after ``fit`` (all ranks)."""
    path = workdir / f"{name}-after-fit.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    return {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer_states": checkpoint["optimizer_states"],
        "global_step": trainer.global_step,
    }


# ----------------------------------------------------------------------------------------------------------------
# 1. Validation inside fit


class ValidatingModel(common.RegressionModel):
    """Records how many validation batches ran (so that the case shows that validation happened)."""

    def on_fit_start(self) -> None:
        self.validation_batches = 0

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.validation_batches += 1
        return super().validation_step(batch, batch_idx)


def trainer_validate(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """8 SGD steps (one epoch of 64 samples), validating 2 batches every 2 steps."""
    seed_everything(7)
    model = ValidatingModel(optimizer="sgd", num_samples=64)
    trainer = _trainer(strategy, devices, workdir, max_steps=8, val_check_interval=2, limit_val_batches=2)
    trainer.fit(model)
    return {**_result(trainer, model, workdir, "validate"), "validation_batches": model.validation_batches}


# ----------------------------------------------------------------------------------------------------------------
# 2. Freezing and unfreezing after set-up (gradual unfreezing)


class FreezeSchedule(Callback):
    """At each epoch start, freezes the layers of :data:`FREEZE_SCHEDULE` with Lightning's ``BaseFinetuning``
    helpers and makes the others trainable again; epoch 0's already in ``setup``, before the strategy's."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        net = pl_module.net  # type: ignore[attr-defined]
        BaseFinetuning.freeze([net[index] for index in FREEZE_SCHEDULE[0]], train_bn=True)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        frozen = FREEZE_SCHEDULE[trainer.current_epoch]
        net = pl_module.net  # type: ignore[attr-defined]
        BaseFinetuning.make_trainable([layer for index, layer in enumerate(net) if index not in frozen])
        BaseFinetuning.freeze([net[index] for index in frozen], train_bn=True)


def trainer_freeze(strategy: Any, devices: int, workdir: Path, resume: bool = False) -> dict[str, Any]:
    """3 epochs of 2 Adam steps over all parameters, the layers frozen as :data:`FREEZE_SCHEDULE` says; a full
    checkpoint after every epoch. ``resume``: from the checkpoint of epoch 1 (written while layer 0 was frozen)."""
    seed_everything(7)
    workdir.mkdir(parents=True, exist_ok=True)
    model = common.RegressionModel(optimizer="adam")
    folder = workdir / "freeze-checkpoints"
    callbacks = [FreezeSchedule()]
    if not resume:
        callbacks.append(ModelCheckpoint(dirpath=folder, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    trainer = _trainer(
        strategy, devices, workdir, max_epochs=3, limit_val_batches=0, callbacks=callbacks,
        enable_checkpointing=not resume, gradient_clip_val=FREEZE_CLIP,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=folder / "epoch=1.ckpt" if resume else None)
    return _result(trainer, model, workdir, "freeze-resumed" if resume else "freeze")


def trainer_freeze_resume(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    return trainer_freeze(strategy, devices, workdir, resume=True)


def trainer_freeze_buckets(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    return trainer_freeze(with_buckets(strategy), devices, workdir / "buckets")


# ----------------------------------------------------------------------------------------------------------------
# 3. Manual optimization with two optimizers (Lightning's GAN example)


def gan_networks() -> tuple[nn.Module, nn.Module]:
    """A generator (the first layer and Block of ``build_network()``) and a discriminator (the rest)."""
    net = build_network()
    return nn.Sequential(net[0], net[1]), nn.Sequential(net[2], net[3])


def gan_optimizers(generator: nn.Module, discriminator: nn.Module) -> tuple[torch.optim.Optimizer, ...]:
    return torch.optim.Adam(generator.parameters(), lr=1e-2), torch.optim.SGD(
        discriminator.parameters(), lr=0.05, momentum=0.9
    )


def gan_losses(
    generator: Callable[[torch.Tensor], torch.Tensor], discriminator: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[Callable[[Any], torch.Tensor], Callable[[Any], torch.Tensor]]:
    """The two losses of a batch: the generator's (through the discriminator, towards the targets) and the
    discriminator's (on the generator's output detached, towards the negated targets)."""

    def generator_loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(discriminator(generator(x)), y)

    def discriminator_loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(discriminator(generator(x).detach()), -y)

    return generator_loss, discriminator_loss


class GANModel(LightningModule):
    """Lightning's GAN recipe: ``automatic_optimization = False``, each optimizer toggled for its own step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = gan_networks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.discriminator(self.generator(x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        generator_loss, discriminator_loss = gan_losses(self.generator, self.discriminator)
        for optimizer, loss_of in zip(self.optimizers(), (generator_loss, discriminator_loss)):
            self.toggle_optimizer(optimizer)
            loss = loss_of(batch)
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=GAN_CLIP, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self) -> Any:
        return list(gan_optimizers(self.generator, self.discriminator))

    def train_dataloader(self) -> DataLoader:
        data = dataset()
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(data, batch_size=GLOBAL_BATCH // self.trainer.world_size, sampler=sampler)


def trainer_gan(strategy: Any, devices: int, workdir: Path, resume: bool = False) -> dict[str, Any]:
    """3 epochs of 2 steps; full checkpoints each epoch. ``resume``: from epoch 1's checkpoint."""
    seed_everything(7)
    workdir.mkdir(parents=True, exist_ok=True)
    model = GANModel()
    folder = workdir / "gan-checkpoints"
    callbacks = [] if resume else [ModelCheckpoint(dirpath=folder, filename="{epoch}", every_n_epochs=1, save_top_k=-1)]
    trainer = _trainer(
        strategy, devices, workdir, max_epochs=3, limit_val_batches=0, callbacks=callbacks,
        enable_checkpointing=not resume,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=folder / "epoch=1.ckpt" if resume else None)
    return _result(trainer, model, workdir, "gan-resumed" if resume else "gan")


def trainer_gan_resume(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    return trainer_gan(strategy, devices, workdir, resume=True)


def trainer_gan_buckets(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """As ``gan``, the small gradients of both networks sharing buckets (one per rank)."""
    return trainer_gan(with_buckets(strategy), devices, workdir / "buckets")


# ----------------------------------------------------------------------------------------------------------------
# Fabric: the same three, in loops written by hand


def _fabric(strategy: Any, devices: int) -> Any:
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    return fabric


def _batches(fabric: Any, num_samples: int) -> list[Any]:
    """This rank's slice of each global batch, as the Trainer's loader gives it."""
    data = dataset(num_samples)
    sampler = DistributedSampler(data, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=False)
    return list(DataLoader(data, batch_size=GLOBAL_BATCH // fabric.world_size, sampler=sampler))


def _fabric_result(fabric: Any, state: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    path = workdir / f"{name}.ckpt"
    fabric.save(path, state)
    fabric.barrier()
    checkpoint = torch.load(path, weights_only=True)
    return {key: value for key, value in checkpoint.items()}


def fabric_validate(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """8 SGD steps; every 2 steps, ``model.eval()``, a forward pass on a validation batch, ``model.train()``."""
    fabric = _fabric(strategy, devices)
    model = RegressionModelWrapper(build_network())
    model, optimizer = fabric.setup(model, common.make_optimizer("sgd", model.parameters()))
    batches = _batches(fabric, 64)
    losses = []
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 1:
            model.eval()
            with torch.no_grad():
                losses.append(fabric.all_reduce(nn.functional.mse_loss(model(x), y), reduce_op="mean").item())
            model.train()
    result = _fabric_result(fabric, {"model": model, "optimizer": optimizer}, workdir, "fabric-validate")
    return {**result, "validation_losses": losses}


def fabric_eval_mode(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """6 SGD steps, the middle two with the model in eval mode (as when fine-tuning with frozen normalization
    statistics): eval mode changes what the layers compute, not what is trained."""
    fabric = _fabric(strategy, devices)
    model = RegressionModelWrapper(build_network())
    model, optimizer = fabric.setup(model, common.make_optimizer("sgd", model.parameters()))
    for step, (x, y) in enumerate(_batches(fabric, 48)):
        model.train(step not in (2, 3))
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return _fabric_result(fabric, {"model": model, "optimizer": optimizer}, workdir, "fabric-eval-mode")


def fabric_freeze(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """Adam over all parameters for 3 "epochs" of 2 steps, the layers frozen inside the loop as
    :data:`FREEZE_SCHEDULE` says; a checkpoint after the second epoch, loaded by a fresh model and optimizer that
    train the last epoch (``resumed``)."""
    fabric = _fabric(strategy, devices)

    def train(model: Any, optimizer: Any, epochs: range) -> None:
        net = model.module.net if hasattr(model, "module") else model.net
        for epoch in epochs:
            for index, layer in enumerate(net):
                layer.requires_grad_(index not in FREEZE_SCHEDULE[epoch])
            for x, y in batches:
                fabric.backward(nn.functional.mse_loss(model(x), y))
                fabric.clip_gradients(model, optimizer, max_norm=FREEZE_CLIP)
                optimizer.step()
                optimizer.zero_grad()

    def set_up() -> tuple[Any, Any]:
        model = RegressionModelWrapper(build_network())
        for index in FREEZE_SCHEDULE[0]:  # before set-up
            model.net[index].requires_grad_(False)
        return fabric.setup(model, common.make_optimizer("adam", model.parameters()))

    batches = _batches(fabric, 16)
    model, optimizer = set_up()
    train(model, optimizer, range(2))
    fabric.save(workdir / "fabric-freeze-epoch-1.ckpt", {"model": model, "optimizer": optimizer})
    train(model, optimizer, range(2, 3))
    result = _fabric_result(fabric, {"model": model, "optimizer": optimizer}, workdir, "fabric-freeze")
    fresh, fresh_optimizer = set_up()
    fabric.load(workdir / "fabric-freeze-epoch-1.ckpt", {"model": fresh, "optimizer": fresh_optimizer})
    train(fresh, fresh_optimizer, range(2, 3))
    resumed = _fabric_result(fabric, {"model": fresh, "optimizer": fresh_optimizer}, workdir, "fabric-freeze-resumed")
    return {**result, "resumed": resumed}


def fabric_gan(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """The GAN recipe with two set-up modules, each with its optimizer: 6 steps, the other module's parameters
    frozen during each optimizer's step (as ``toggle_optimizer`` does), gradients clipped by norm."""
    fabric = _fabric(strategy, devices)
    plain_generator, plain_discriminator = gan_networks()
    plain_optimizers = gan_optimizers(plain_generator, plain_discriminator)
    generator, generator_optimizer = fabric.setup(plain_generator, plain_optimizers[0])
    discriminator, discriminator_optimizer = fabric.setup(plain_discriminator, plain_optimizers[1])
    steps = (
        (generator, discriminator, generator_optimizer),
        (discriminator, generator, discriminator_optimizer),
    )
    generator_loss, discriminator_loss = gan_losses(generator, discriminator)
    for batch in _batches(fabric, 16) * 3:
        for (own, other, optimizer), loss_of in zip(steps, (generator_loss, discriminator_loss)):
            other.requires_grad_(False)
            fabric.backward(loss_of(batch))
            fabric.clip_gradients(own, optimizer, max_norm=GAN_CLIP)
            optimizer.step()
            optimizer.zero_grad()
            other.requires_grad_(True)
    # A checkpoint holds one model set up with the strategy (and its optimizers): one file each.
    saved_generator = _fabric_result(
        fabric, {"generator": generator, "generator_optimizer": generator_optimizer}, workdir, "fabric-gan-generator"
    )
    saved_discriminator = _fabric_result(
        fabric, {"discriminator": discriminator, "discriminator_optimizer": discriminator_optimizer}, workdir,
        "fabric-gan-discriminator",
    )  # fmt: skip
    return {**saved_generator, **saved_discriminator}


CASES: dict[str, Callable[[Any, int, Path], dict[str, Any]]] = {
    "validate": trainer_validate,
    "freeze": trainer_freeze,
    "freeze-resume": trainer_freeze_resume,
    "freeze-buckets": trainer_freeze_buckets,
    "gan": trainer_gan,
    "gan-resume": trainer_gan_resume,
    "gan-buckets": trainer_gan_buckets,
    "fabric-validate": fabric_validate,
    "fabric-eval-mode": fabric_eval_mode,
    "fabric-freeze": fabric_freeze,
    "fabric-gan": fabric_gan,
}


def run(name: str, strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """Case ``name`` with ``strategy`` on ``devices`` CPU processes (the reference: ``"auto"`` on one)."""
    return CASES[name](strategy, devices, workdir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="comma-separated names from CASES")
    parser.add_argument("--workdir", default=".")
    parser.add_argument(
        "--record-errors", action="store_true",
        help="record a case's error as its result and go on (debugging; an error on one rank only hangs the other)",
    )  # fmt: skip
    args = parser.parse_args()
    workdir = Path(args.workdir)
    results: dict[str, Any] = {}
    for name in args.cases.split(","):
        try:
            results[name] = run(name, "ddp_sharded", 2, workdir)
        except Exception as error:
            if not args.record_errors:
                raise
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"case {name}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
