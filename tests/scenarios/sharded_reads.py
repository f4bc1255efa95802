"""``DDPShardedStrategy`` where the user's code reads whole tensors outside the forward (issue 53, items 2, 4, 6, 7;
issue 54, item 3): the user's own ``clip_grad_norm_``, optimizers that read whole tensors (Adafactor, Muon, a LARS
of the user's), LBFGS, and what callbacks and loggers see (norms, optimizer names); Trainer and Fabric, one after
another in the same processes.

Every case is a function of ``(strategy, devices, workdir)``: the tests run them all on 2 processes (this script,
each rank writes ``--out`` with its rank appended), each sharded case with ``"ddp_sharded"`` and the ``*-ddp`` cases
with Lightning's ``"ddp"``, and the sharded ones again in the test's own process on one device without any strategy
(the unsharded reference, on the full global batch). The model and data are float64, so that the comparisons after
Adam-like steps hold on any CPU: the two trainings differ only by the order in which the gradient is summed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils import clip_grad_norm_  # noqa: E402  (bound before any strategy exists, as user code does)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from scenarios.flavor import (  # noqa: E402
    Callback,
    DDPShardedStrategy,
    Fabric,
    FabricDDPShardedStrategy,
    LightningModule,
    Trainer,
    pl,
    register_strategy_names,
    seed_everything,
)

register_strategy_names()
LearningRateMonitor = pl.callbacks.LearningRateMonitor
Logger = pl.loggers.Logger

GLOBAL_BATCH, SAMPLES, STEPS = 8, 16, 4
#: The user's clipping in ``on_before_optimizer_step`` (it bites: every step's norm is larger).
CLIP = 0.05
#: Small gradient buckets (elements): the small parameters' gradients share buckets.
BUCKETS = 200


def network() -> nn.Module:
    torch.manual_seed(3)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    return nn.Sequential(*layers).double()


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=g).double(), torch.randn(SAMPLES, 4, generator=g).double())


class LARS(torch.optim.Optimizer):
    """A LARS as SimCLR-style code writes it: per tensor, the update scaled by ``eta * ||w|| / ||g + wd * w||``."""

    def __init__(self, params: Any, lr: float = 1.0, momentum: float = 0.9, weight_decay: float = 1e-4,
                 eta: float = 0.02) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad.add(p, alpha=group["weight_decay"])
                trust = group["eta"] * p.norm() / update.norm()
                update.mul_(trust)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = update.clone()
                else:
                    state["mu"].mul_(group["momentum"]).add_(update)
                p.add_(state["mu"], alpha=-group["lr"])
        return loss


def make_optimizers(name: str, module: nn.Module) -> list[torch.optim.Optimizer]:
    params = list(module.parameters())
    if name == "sgd":
        return [torch.optim.SGD(params, lr=0.1, momentum=0.9)]
    if name == "adam":
        return [torch.optim.Adam(params, lr=1e-2)]
    if name == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)]
    if name == "lars":
        return [LARS(params)]
    if name == "lbfgs":
        return [torch.optim.LBFGS(params, lr=0.5, max_iter=4)]
    if name == "muon":  # the usual recipe: Muon on the matrices, AdamW on the rest
        matrices = [p for p in params if p.ndim == 2]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-2)]
    raise ValueError(name)


class ReadsModel(LightningModule):
    """Trains :func:`network` with the optimizers ``optimizer`` names (several: manual optimization); ``clip``: the
    user's own ``clip_grad_norm_(self.parameters(), clip)`` in ``on_before_optimizer_step``, whose returned norms
    are kept in :attr:`norms`."""

    def __init__(
        self, optimizer: str = "sgd", clip: Optional[float] = None, scheduler: bool = False, norm_type: float = 2.0,
        penalty: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.penalty = penalty
        self.net = network()
        self.optimizer_name, self.clip, self.scheduler, self.norm_type = optimizer, clip, scheduler, norm_type
        self.automatic_optimization = optimizer != "muon"
        self.norms: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.penalty:  # an explicit L2 penalty, and an orthogonality penalty on a matrix
            weight = self.net[2].weight
            loss = loss + 0.05 * sum(p.pow(2).sum() for p in self.parameters())
            loss = loss + 0.01 * ((weight.t() @ weight - torch.eye(16, dtype=weight.dtype)) ** 2).sum()
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        return None

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.clip is not None:
            self.norms.append(float(clip_grad_norm_(self.parameters(), self.clip, norm_type=self.norm_type)))

    def configure_optimizers(self) -> Any:
        optimizers = make_optimizers(self.optimizer_name, self)
        if self.scheduler:
            (optimizer,) = optimizers
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        return optimizers

    def train_dataloader(self) -> DataLoader:
        # Rank r sees samples r, r + W, ... of each global batch: the global batches are the reference's.
        world_size, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(dataset(), num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size, sampler=sampler)


class Reads(Callback):
    """What a callback reads after each step (``on_train_batch_end``), on every rank: a weight's norm, the norm of
    all gradients with torch's ``get_total_norm``, and which gradients this rank holds."""

    def __init__(self) -> None:
        self.weight_norms: list[float] = []
        self.grad_norms: list[float] = []
        self.present: list[list[bool]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        params = list(pl_module.parameters())
        self.weight_norms.append(float(pl_module.net[2].weight.detach().norm()))
        grads = [p.grad for p in params if p.grad is not None]
        self.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        self.present.append([p.grad is not None for p in params])


class Names(Logger):
    """A logger that keeps the names of the metrics logged."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    @property
    def name(self) -> str:
        return "names"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.names.update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Survey(Callback):
    """What a callback sees of the optimizers when training starts and after the last step."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        (optimizer,) = trainer.optimizers
        (config,) = trainer.lr_scheduler_configs
        self.seen.update(
            optimizer=type(optimizer).__name__,
            is_users_class=isinstance(optimizer, torch.optim.SGD),
            scheduler_optimizer=type(config.scheduler.optimizer).__name__,
            scheduler_optimizer_is_trainers=config.scheduler.optimizer is optimizer,
            param_groups=[sorted(group) for group in optimizer.param_groups],
            group_sizes=[len(group["params"]) for group in optimizer.param_groups],
            defaults=sorted(optimizer.defaults),
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        (optimizer,) = trainer.optimizers
        self.seen["lr"] = [group["lr"] for group in optimizer.param_groups]
        self.seen["state_entries"] = len(optimizer.state)
        try:
            self.seen["state_dict"] = sorted(optimizer.state_dict())
        except RuntimeError as error:
            self.seen["state_dict"] = f"RuntimeError: {error}"


def _trainer(strategy: Any, devices: int, workdir: Path, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "use_distributed_sampler": False,
        "default_root_dir": workdir,
        "max_steps": STEPS,
        **kwargs,
    }
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, **options)


def _strategy(strategy: Any, **kwargs: Any) -> Any:
    return DDPShardedStrategy(**kwargs) if strategy == "ddp_sharded" else strategy


def _fit(strategy: Any, devices: int, workdir: Path, optimizer: str, clip: Optional[float] = None,
         norm_type: float = 2.0, accumulate: int = 1, penalty: bool = False,
         **strategy_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    seed_everything(7)
    model, reads = ReadsModel(optimizer, clip, norm_type=norm_type, penalty=penalty), Reads()
    trainer = _trainer(
        _strategy(strategy, **strategy_kwargs), devices, workdir, callbacks=[reads], accumulate_grad_batches=accumulate
    )
    error = None
    try:
        trainer.fit(model)
    except Exception as caught:  # a refusal, before any collective: every rank raises it
        error = f"{type(caught).__name__}: {caught}"
    return {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "global_step": trainer.global_step,
        "error": error,
        "norms": model.norms,
        "weight_norms": reads.weight_norms,
        "grad_norms": reads.grad_norms,
        "present": reads.present,
    }


def trainer_clip(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """4 SGD steps, the user clipping by norm in ``on_before_optimizer_step`` (torch's function, bound early)."""
    return _fit(strategy, devices, workdir, "sgd", CLIP)


def trainer_clip_buckets(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """:func:`trainer_clip` with small gradient buckets (the small gradients are views into a bucket)."""
    return _fit(strategy, devices, workdir, "sgd", CLIP, reduce_buffer_size=BUCKETS)


def trainer_clip_inf(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """:func:`trainer_clip` by the largest element (``norm_type="inf"``): a maximum over the ranks."""
    return _fit(strategy, devices, workdir, "sgd", CLIP / 4, norm_type=float("inf"))


def trainer_clip_accumulate(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """:func:`trainer_clip` accumulating 2 micro-batches (the first under ``no_sync``: every rank its own)."""
    return _fit(strategy, devices, workdir, "sgd", CLIP, accumulate=2)


def trainer_sgd(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """4 SGD steps, nothing else: the plainest form."""
    return _fit(strategy, devices, workdir, "sgd")


def trainer_penalties(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """4 SGD steps with an L2 penalty over ``self.parameters()`` and an orthogonality penalty in ``training_step``."""
    return _fit(strategy, devices, workdir, "sgd", penalty=True)


def trainer_adafactor(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    return _fit(strategy, devices, workdir, "adafactor")


def trainer_lars(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    return _fit(strategy, devices, workdir, "lars")


def trainer_muon(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """Muon on the matrices and AdamW on the rest: two optimizers, manual optimization."""
    return _fit(strategy, devices, workdir, "muon")


def trainer_lbfgs(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """LBFGS (``max_iter=4``) with automatic optimization: Lightning passes the closure."""
    return _fit(strategy, devices, workdir, "lbfgs")


def trainer_survey(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """SGD with a StepLR schedule, ``LearningRateMonitor`` logging: the names logged and what callbacks see."""
    seed_everything(7)
    model, survey, logger = ReadsModel("sgd", scheduler=True), Survey(), Names()
    trainer = _trainer(
        _strategy(strategy), devices, workdir, logger=logger, log_every_n_steps=1,
        callbacks=[survey, LearningRateMonitor(logging_interval="step")],
    )  # fmt: skip
    trainer.fit(model)
    return {**survey.seen, "logged": sorted(logger.names)}


def trainer_tuner(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """Lightning's learning-rate finder (``Tuner.lr_find``, 8 trials) and the model summary of the fit after it."""
    from scenarios.flavor import pl as lightning

    seed_everything(7)
    model = ReadsModel("sgd")
    trainer = _trainer(_strategy(strategy), devices, workdir, enable_model_summary=True)
    finder = lightning.tuner.Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=1.0, num_training=8, update_attr=False)
    summary = lightning.utilities.model_summary.ModelSummary(model, max_depth=2)
    return {
        "lrs": finder.results["lr"],
        "losses": finder.results["loss"],
        "suggestion": finder.suggestion(skip_begin=1, skip_end=1),
        "summary": str(summary),
    }


def fabric_clip(strategy: Any, devices: int, workdir: Path, optimizer: str = "sgd") -> dict[str, Any]:
    """Fabric: 4 steps, the user calling torch's ``clip_grad_norm_`` before ``optimizer.step()``; on every rank,
    the norm of all gradients after each step (torch's ``get_total_norm``)."""
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=_fabric_strategy(strategy))
    fabric.launch()
    seed_everything(7)
    module = network()
    (optimizer_,) = make_optimizers(optimizer, module)
    result: dict[str, Any] = {"norms": [], "grad_norms": [], "error": None}
    try:
        model, optimizer_ = fabric.setup(module, optimizer_)
    except Exception as caught:  # a refusal
        result["error"] = f"{type(caught).__name__}: {caught}"
        return result
    batches = list(DataLoader(dataset(), batch_size=GLOBAL_BATCH))
    rank, world = fabric.global_rank, fabric.world_size
    for step in range(STEPS):
        x, y = batches[step % len(batches)]

        def closure() -> torch.Tensor:
            optimizer_.zero_grad()
            loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
            fabric.backward(loss)
            return loss

        if optimizer == "lbfgs":  # it evaluates the model itself
            optimizer_.step(closure)
            continue
        closure()
        result["norms"].append(float(clip_grad_norm_(model.parameters(), CLIP)))
        optimizer_.step()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        result["grad_norms"].append(float(torch.nn.utils.get_total_norm(grads)))
        optimizer_.zero_grad()
    # Under the LightningModule's names (``net.``), to compare with the Trainer's cases.
    result["state_dict"] = {f"net.{k}": v.detach().clone() for k, v in module.state_dict().items()}
    return result


def _fabric_strategy(strategy: Any) -> Any:
    return FabricDDPShardedStrategy() if strategy == "ddp_sharded" else strategy


def fabric_lbfgs(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    return fabric_clip(strategy, devices, workdir, optimizer="lbfgs")


CASES: dict[str, Callable[[Any, int, Path], dict[str, Any]]] = {
    "sgd": trainer_sgd,
    "clip": trainer_clip,
    "clip-buckets": trainer_clip_buckets,
    "clip-inf": trainer_clip_inf,
    "clip-accumulate": trainer_clip_accumulate,
    "penalties": trainer_penalties,
    "adafactor": trainer_adafactor,
    "lars": trainer_lars,
    "muon": trainer_muon,
    "lbfgs": trainer_lbfgs,
    "survey": trainer_survey,
    "tuner": trainer_tuner,
    "fabric-clip": fabric_clip,
    "fabric-lbfgs": fabric_lbfgs,
}
#: The cases that also run under Lightning's ``"ddp"`` in the same launch (named ``<case>-ddp``).
DDP_CASES = ["clip", "survey", "tuner", "fabric-clip"]


def run(name: str, strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """Case ``name`` with ``strategy`` on ``devices`` CPU processes (the reference: ``"auto"`` on one)."""
    return CASES[name](strategy, devices, workdir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="each rank writes <out>.rank<r>")
    parser.add_argument("--cases", required=True, help="comma-separated names from CASES; <name>-ddp: with 'ddp'")
    parser.add_argument("--workdir", default=".")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    results: dict[str, Any] = {}
    for name in args.cases.split(","):
        base, ddp = name.removesuffix("-ddp"), name.endswith("-ddp")
        results[name] = run(base, "ddp" if ddp else "ddp_sharded", 2, workdir)
    torch.save(results, f"{args.out}.rank{torch.distributed.get_rank()}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
