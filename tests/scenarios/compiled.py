"""``torch.compile`` under the sharded strategies (issue 34), as a user writes it, on 2 CPU processes, against plain
eager training of the same model on one process (computed in this script with torch only).

Each job is a :class:`CompileJob`; ``tests/test_compile.py`` runs them all in one launch (``conftest.run_jobs``) and
checks what rank 0 saved. ``form`` says where the user compiles:

* ``"whole"``: ``trainer.fit(torch.compile(model))`` (Fabric: ``fabric.setup(torch.compile(model), optimizer)``);
* ``"init"``: the LightningModule compiles its blocks in ``__init__`` (``torch.compile(Block())``);
* ``"configure_model"``: it compiles them in ``configure_model``;
* ``"net"``: it compiles its whole net in ``__init__`` (``self.net = torch.compile(Net())``);
* ``"none"``: no compile (the eager run a compiled one is compared with, where the reference is not plain fp32).

A Trainer job trains ``steps`` optimizer steps, saves full and sharded checkpoints, resumes each in a new Trainer for
``more_steps`` more, and records the trained weights of every run (full checkpoints) and the checkpoint's keys. By
hand (from the project's root)::

    PYTHONPATH=src python tests/scenarios/compiled.py --config '{"backend": "inductor"}' --out r.pt
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_fairscale  # noqa: E402,F401  (registers the strategy names)
import scenarios.jobs  # noqa: E402
from models import Block  # noqa: E402
from scenarios.config import Config  # noqa: E402
from scenarios.flavor import LightningModule, Trainer  # noqa: E402

IN, WIDTH, OUT = 8, 32, 4
#: Samples per rank and step: one epoch is one optimizer step (``accumulate`` micro-batches of ``BATCH`` samples a
#: rank), so that a resume from a checkpoint saved at an epoch's end continues exactly.
BATCH = 2
LR = 0.01


@dataclass(frozen=True)
class CompileJob(Config):
    """One job of this script."""

    SCRIPT: ClassVar[str] = "compiled"

    front: str = "trainer"  # "trainer" or "fabric"
    strategy: str = "fsdp_fairscale"  # or "ddp_sharded" (the Trainer's)
    form: str = "whole"  # "whole", "init", "configure_model", "none"
    backend: str = "aot_eager"
    devices: int = 2
    steps: int = 2
    more_steps: int = 1  # 0: no checkpoints, no resume
    accumulate: int = 2
    clip: Optional[float] = 1.0
    precision: str = "32-true"
    activation_checkpointing: bool = True
    sharding: str = "FULL_SHARD"  # or "HYBRID_SHARD": 2 replicas of one shard (device_mesh=(2, 1))
    optimizer: str = "adamw"  # or "sgd"
    #: Validate after every step (an epoch) on a batch of another size: the compiled layers compile again, in
    #: eval mode and for that size, with the gradients of the step before held (issue 48, workaround 26).
    validate: bool = False


class Net(nn.Module):
    """``inp`` -> two ``Block`` -> ``out``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH), Block(WIDTH)])
        self.out = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def data(config: CompileJob) -> TensorDataset:
    """One global batch of every micro-batch of a step: ``accumulate * BATCH * devices`` samples."""
    g = torch.Generator().manual_seed(7)
    n = config.accumulate * BATCH * config.devices
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))


#: The validation batch (every rank validates on all of it): 3 samples, another size than a training batch.
VAL_SAMPLES = 3


def val_data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(VAL_SAMPLES, IN, generator=g), torch.randn(VAL_SAMPLES, OUT, generator=g))


def make_optimizer(config: CompileJob, params: Any) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR)


def compile_blocks(net: Net, backend: str) -> None:
    for i, block in enumerate(net.blocks):
        net.blocks[i] = torch.compile(block, backend=backend)


class Regression(LightningModule):
    def __init__(self, config: CompileJob) -> None:
        super().__init__()
        self.config = config
        self.net = Net()
        if config.form == "init":
            compile_blocks(self.net, config.backend)
        if config.form == "net":
            self.net = torch.compile(self.net, backend=config.backend)
        #: This rank's validation loss after each step (the whole validation batch: the same on every rank).
        self.val_losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.config.form == "configure_model" and isinstance(self.net.blocks[0], Block):  # once
            compile_blocks(self.net, self.config.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(nn.functional.mse_loss(self(x), y).detach().clone())

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.config, self.parameters())

    def train_dataloader(self) -> DataLoader:
        dataset = data(self.config)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        part = torch.utils.data.Subset(dataset, list(range(rank, len(dataset), world)))
        return DataLoader(part, batch_size=BATCH, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(val_data(), batch_size=VAL_SAMPLES, shuffle=False)


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def reference(
    config: CompileJob, steps: int, val_losses: Optional[list[torch.Tensor]] = None
) -> dict[str, torch.Tensor]:
    """Eager fp32 training on one process: each step on the whole global batch (the mean over equal micro-batches
    of equal ranks), clipped as the Trainer clips; the validation loss after each step goes to ``val_losses``."""
    net = Net()
    optimizer = make_optimizer(config, net.parameters())
    x, y = data(config).tensors
    for _ in range(steps):
        nn.functional.mse_loss(net(x), y).backward()
        if config.clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), config.clip)
        optimizer.step()
        optimizer.zero_grad()
        if val_losses is not None:
            with torch.no_grad():
                val_losses.append(nn.functional.mse_loss(net(val_data().tensors[0]), val_data().tensors[1]))
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def make_strategy(config: CompileJob, state_dict_type: str = "full") -> Any:
    from scenarios.flavor import DDPFullyShardedStrategy, DDPShardedStrategy

    if config.strategy == "ddp_sharded":
        return DDPShardedStrategy()
    options: dict[str, Any] = {"activation_checkpointing": Block} if config.activation_checkpointing else {}
    if config.sharding == "HYBRID_SHARD":
        options.update(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1))
    return DDPFullyShardedStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type, **options)


def fit(config: CompileJob, steps: int, ckpt_path: Optional[str] = None, state_dict_type: str = "full") -> Any:
    module = Regression(config)
    trainer = Trainer(
        accelerator="cpu", devices=config.devices, strategy=make_strategy(config, state_dict_type),
        precision=config.precision, max_steps=steps, accumulate_grad_batches=config.accumulate,
        gradient_clip_val=config.clip, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1 if config.validate else 0,
        use_distributed_sampler=False,
    )  # fmt: skip
    given = torch.compile(module, backend=config.backend) if config.form == "whole" else module
    trainer.fit(given, ckpt_path=ckpt_path)
    return trainer


def full_weights(trainer: Any, path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's weights and every key of a full checkpoint of ``trainer`` (rank 0; empty elsewhere)."""
    if hasattr(trainer.strategy, "state_dict_type"):
        trainer.strategy.state_dict_type = "full"
    trainer.save_checkpoint(path)
    torch.distributed.barrier()
    if rank() != 0:
        return {}, []
    state = torch.load(path, weights_only=False)["state_dict"]
    return {k: v.float().clone() for k, v in state.items()}, sorted(state)


def compiled_layers(module: nn.Module) -> list[str]:
    """The layers of ``module`` whose ``forward`` the strategy compiled (its regions)."""
    from lightning_fairscale.fsdp.wrapping.compile import is_compiled

    return sorted(name for name, layer in module.named_modules() if is_compiled(layer))


def trainer_job(config: CompileJob, work: Path, result: dict[str, Any]) -> None:
    trainer = fit(config, config.steps)
    result["compiled"] = compiled_layers(trainer.lightning_module)
    result["val_losses"] = [float(v) for v in trainer.lightning_module.val_losses]
    result["trained"], result["keys"] = full_weights(trainer, work / "trained.ckpt")
    if rank() == 0:
        plain = Regression(config.replace(form="none"))  # a full checkpoint loads into the uncompiled module
        plain.load_state_dict(torch.load(work / "trained.ckpt", weights_only=False)["state_dict"])
        result["loads_uncompiled"] = True
        reference_val: list[torch.Tensor] = []
        result["reference"] = reference(config, config.steps, reference_val)
        result["reference_val"] = [float(v) for v in reference_val] if config.validate else []
        result["reference_more"] = reference(config, config.steps + config.more_steps)
    if not config.more_steps or config.strategy != "fsdp_fairscale":
        return
    trainer.strategy.state_dict_type = "sharded"
    trainer.save_checkpoint(work / "trained-sharded.ckpt")
    for kind, path in (("full", "trained.ckpt"), ("sharded", "trained-sharded.ckpt")):
        resumed = fit(config, config.steps + config.more_steps, ckpt_path=str(work / path), state_dict_type=kind)
        result[f"resumed_{kind}"], _ = full_weights(resumed, work / f"resumed-{kind}.ckpt")


def fabric_job(config: CompileJob, work: Path, result: dict[str, Any]) -> None:
    from scenarios.flavor import Fabric, FabricDDPFullyShardedStrategy

    strategy = FabricDDPFullyShardedStrategy(auto_wrap_policy={Block}, activation_checkpointing=Block)
    fabric = Fabric(accelerator="cpu", devices=config.devices, strategy=strategy, precision=config.precision)
    fabric.launch(fabric_run, config.to_json(), str(work), result)


def fabric_run(fabric: Any, fields: dict[str, Any], work_dir: str, result: dict[str, Any]) -> None:
    config = CompileJob.from_json(fields)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    model, optimizer = fabric.setup(torch.compile(net, backend=config.backend), optimizer)
    # Fabric hands the compile's options to no strategy: the strategy reads them (`_compat.fabric_compile_options`).
    result["compiled"] = compiled_layers(net)
    x, y = (t[fabric.global_rank :: fabric.world_size] for t in data(config).tensors)
    for _ in range(config.steps):  # every micro-batch of the global batch in one (no accumulation)
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        if config.clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=config.clip)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(Path(work_dir) / "fabric.ckpt", {"model": model})
    fabric.barrier()
    if fabric.is_global_zero:
        state = torch.load(Path(work_dir) / "fabric.ckpt", weights_only=False)["model"]
        result["trained"] = {f"net.{k}": v.float().clone() for k, v in state.items()}
        result["keys"] = sorted(state)
        result["reference"] = reference(config, config.steps)


def main(config: CompileJob, out: str) -> None:
    """Run the job; rank 0 writes the result to ``out`` (``error``: each failing rank's traceback)."""
    work = Path(out).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"job": config.to_json(), "error": None}
    error = None
    try:
        (fabric_job if config.front == "fabric" else trainer_job)(config, work, result)
    except Exception:
        error = traceback.format_exc()
        print(f"[rank {rank()}] job failed:\n{error}", file=sys.stderr, flush=True)
    errors = [error]
    if torch.distributed.is_initialized():
        errors = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(errors, error)
    result["error"] = {r: e for r, e in enumerate(errors) if e is not None} or None
    if rank() == 0:
        torch.save(result, out)


#: The configuration class of this scenario (``scenarios/jobs.py``).
CONFIG = CompileJob

if __name__ == "__main__":
    scenarios.jobs.main(CompileJob, main)
