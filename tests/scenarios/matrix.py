"""One cell of the pairwise feature matrix (``tests/test_matrix.py``): a short training with one level of every factor,
run with our strategy or, as its reference, with Lightning's ``"ddp"`` in the same processes.

A :class:`Cell` names a level of each factor of :data:`tests.test_matrix.FACTORS` (front end, strategy, wrap,
activation checkpointing, compile, precision, optimizer, accumulation, clipping, checkpoint, stage order, model).
The same cell with ``reference=True`` trains the same model on the same global batches with Lightning's (or Fabric's)
``"ddp"``, which replays every level that is not a sharding option: the two runs' results are compared by the test.

Rank 0 writes the result file: ``final`` (the model's full state dict at the end, read from a full checkpoint
file), ``start`` (the same before training), ``losses`` (each training step's loss) and ``metric`` (the test loss
of a new module, ``stages="fit-test-new"``). Every cell trains 4 optimizer steps in all; with a checkpoint, 2 steps,
then a new Trainer (or new Fabric objects) resumes from the file for the other 2. By hand (from the project's root)::

    PYTHONPATH=src python tests/scenarios/matrix.py --config '{"strategy": "grad_op", "compile": "whole"}' --out r.pt
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# transformers: in a folder of its own (the Makefile's `$(VENV)/hf`), last, so that the environment's packages win.
sys.path.append(os.path.join(sys.prefix, "hf"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Dataset, TensorDataset  # noqa: E402

import lightning_fairscale  # noqa: E402,F401  (registers the strategy names)
import scenarios.jobs  # noqa: E402
from scenarios import fabric_train  # noqa: E402
from models import Block  # noqa: E402
from scenarios.common import GLOBAL_BATCH, build_network, dataset  # noqa: E402
from scenarios.config import Config  # noqa: E402
from scenarios.flavor import (  # noqa: E402
    PACKAGE,
    Fabric,
    LightningModule,
    ShardedCheckpointIO,
    Trainer,
    register_strategy_names,
)

register_strategy_names()

STEPS = 4
VOCAB, SEQUENCE = 64, 8


@dataclass(frozen=True)
class Cell(Config):
    """One cell: a level of each factor (``tests/test_matrix.py`` declares them), and which run it is."""

    SCRIPT: ClassVar[str] = "matrix"

    front: str = "trainer"  # trainer, fabric
    strategy: str = "full"  # full (FULL_SHARD), grad_op (SHARD_GRAD_OP), hybrid (device_mesh=(2, 1)), sharded (OSS)
    wrap: str = "layer"  # layer ({Block}), size (min_num_params), manual (wrap() in configure_model), torch-policy
    checkpointing: str = "off"  # off, ours (the strategy's activation_checkpointing), model (the model's own)
    compile: str = "off"  # off, whole (torch.compile of the whole module), inner (the module compiles its layers)
    precision: str = "32-true"  # 32-true, bf16-mixed, bf16-true
    #: sgd (momentum), adamw-groups (decay on matrices only), frozen (Adam, a layer frozen), adafactor (torch's
    #: Adafactor: row and column means of each matrix, so FSDP steps it on the whole path)
    optimizer: str = "sgd"
    #: off, l2 (an L2 penalty over the module's parameters, read outside any unit's forward: in `training_step`, or
    #: after Fabric's forward)
    regulariser: str = "off"
    accumulation: str = "1"  # 1, no_sync (2 micro-batches), sync_each_batch (2, reduced after each)
    clipping: str = "off"  # off, norm
    checkpoint: str = "none"  # none, full, sharded, async (full, written in the background)
    stages: str = "fit"  # fit, validate-fit, fit-with-val, fit-test-new, fit-fit
    model: str = "own"  # own (scenarios' MLP of Blocks), gpt2 (HF tiny GPT-2, tied embeddings)
    reference: bool = False  # train with "ddp" instead (the cell's reference)
    #: Fabric: joint (`fabric.setup(model, optimizer)`), after (`fabric.setup_module`, then the optimizer made inside
    #: our strategy's `unsharded_shapes(model)`, then `fabric.setup_optimizers`), or auto: after for param groups by
    #: shape over layers wrapped by hand, joint otherwise. Not a factor of the matrix.
    fabric_setup: str = "auto"
    devices: int = 2
    work: str = ""  # a folder for the cell's checkpoint files


# ------------------------------------------------------------------------------------------------------------------
# models


class OwnCheckpointedBlock(nn.Module):
    """A Block that checkpoints its own activations (the model's own activation checkpointing)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def own_network(cell: Cell) -> nn.Module:
    net = build_network(2)
    if cell.checkpointing == "model":
        for i, layer in enumerate(net):
            if isinstance(layer, Block):
                net[i] = OwnCheckpointedBlock(layer)
    return net


def gpt2_network(cell: Cell) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    if cell.checkpointing == "model":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def layer_class(cell: Cell) -> type:
    if cell.model == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block
    return Block


def layers_of(net: nn.Module, cell: Cell) -> tuple[nn.Module, list[str]]:
    """The container of the network's repeated layers and their names in it."""
    container = net.transformer.h if cell.model == "gpt2" else net
    kind = layer_class(cell)
    names = [name for name, child in container.named_children() if isinstance(_inner(child), kind)]
    return container, names


def _inner(module: nn.Module) -> nn.Module:
    return module.block if isinstance(module, OwnCheckpointedBlock) else module


def compile_layers(net: nn.Module, cell: Cell) -> None:
    """The module compiles its own repeated layers (``compile="inner"``)."""
    container, names = layers_of(net, cell)
    for name in names:
        container.register_module(name, torch.compile(getattr(container, name), backend="aot_eager"))


def wrap_layers(net: nn.Module, cell: Cell) -> None:
    """Each repeated layer wrapped by hand (``wrap="manual"``): an FSDP unit inside the strategy's wrap context, the
    layer itself elsewhere (``"ddp"``)."""
    from fairscale.nn import wrap

    container, names = layers_of(net, cell)
    for name in names:
        container.register_module(name, wrap(getattr(container, name)))


def token_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    return TensorDataset(torch.randint(0, VOCAB, (16, SEQUENCE), generator=g))


def batch_loss(net: nn.Module, batch: Any, cell: Cell) -> torch.Tensor:
    if cell.model == "gpt2":
        (ids,) = batch
        logits = net(input_ids=ids).logits.float()
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    x, y = batch
    return nn.functional.mse_loss(net(x).float(), y.float())


#: The L2 penalty's weight (``regulariser="l2"``).
L2 = 0.01


def regularised(loss: torch.Tensor, module: nn.Module, cell: Cell) -> torch.Tensor:
    """``loss`` plus the cell's regulariser over ``module``'s parameters, read as the user's code reads them."""
    if cell.regulariser == "l2":
        return loss + L2 * sum(p.float().pow(2).sum() for p in module.parameters())
    return loss


def cell_dataset(cell: Cell) -> Dataset:
    return token_dataset() if cell.model == "gpt2" else dataset(16)


def frozen_name(cell: Cell) -> str:
    return "transformer.wpe.weight" if cell.model == "gpt2" else "0.weight"


def make_optimizer(cell: Cell, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    params = [p for _, p in named]
    if cell.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if cell.optimizer == "adamw-groups":
        decay = [p for _, p in named if p.ndim >= 2]
        rest = [p for _, p in named if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2)
    if cell.optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.Adam(params, lr=1e-2)  # frozen: the frozen layer is left out by its requires_grad


def build_net(cell: Cell) -> nn.Module:
    net = gpt2_network(cell) if cell.model == "gpt2" else own_network(cell)
    if cell.optimizer == "frozen":
        net.get_parameter(frozen_name(cell)).requires_grad_(False)
    if cell.compile == "inner":
        compile_layers(net, cell)
    return net


def clean_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's keys without the prefixes that compiling and checkpointing add."""
    out = {}
    for key, value in state.items():
        for junk in ("_orig_mod.", "block.", "_checkpoint_wrapped_module."):
            key = key.replace(junk, "")
        out[key.removeprefix("net.")] = value.detach().float().clone()
    return out


# ------------------------------------------------------------------------------------------------------------------
# the Trainer


class CellModule(LightningModule):
    def __init__(self, cell: Cell) -> None:
        super().__init__()
        self.cell = cell
        self.net = build_net(cell)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.cell.wrap == "manual" and not getattr(self, "_wrapped", False):
            self._wrapped = True
            wrap_layers(self.net, self.cell)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = regularised(batch_loss(self.net, batch, self.cell), self, self.cell)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", batch_loss(self.net, batch, self.cell), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", batch_loss(self.net, batch, self.cell), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.cell, [(n, p) for n, p in self.named_parameters() if p.requires_grad])

    def _loader(self) -> DataLoader:
        data = cell_dataset(self.cell)
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        per_rank = (4 if self.cell.model == "gpt2" else GLOBAL_BATCH) // world
        return DataLoader(data, batch_size=per_rank, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    val_dataloader = test_dataloader = train_dataloader


def strategy_for(cell: Cell, front: str) -> Any:
    """Our strategy for the cell, or the string ``"ddp"`` for its reference."""
    if cell.reference:
        return "ddp"
    io = ShardedCheckpointIO(async_save=True) if cell.checkpoint == "async" else None
    if front == "trainer":
        from lightning_fairscale.strategies import DDPFullyShardedStrategy, DDPShardedStrategy
    else:
        from lightning_fairscale.fabric import DDPFullyShardedStrategy, DDPShardedStrategy  # type: ignore[assignment]
    common: dict[str, Any] = {"checkpoint_io": io} if io is not None else {}
    if cell.strategy == "sharded":
        return DDPShardedStrategy(sync_each_batch=cell.accumulation == "sync_each_batch", **common)
    options: dict[str, Any] = dict(
        state_dict_type="sharded" if cell.checkpoint == "sharded" else "full",
        sync_each_batch=cell.accumulation == "sync_each_batch",
        **common,
    )
    if cell.wrap == "layer":
        options["auto_wrap_policy"] = {layer_class(cell)}
    elif cell.wrap == "size":
        options["min_num_params"] = 1000
    elif cell.wrap == "torch-policy":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        options["auto_wrap_policy"] = ModuleWrapPolicy({layer_class(cell)})
    else:  # manual: nothing wrapped automatically
        options["min_num_params"] = 10**9
    if cell.checkpointing == "ours":
        options["activation_checkpointing"] = layer_class(cell)
    if cell.strategy == "grad_op":
        options["sharding_strategy"] = "SHARD_GRAD_OP"
    elif cell.strategy == "hybrid":
        options.update(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1))  # 2 replicas of 1 shard
    return DDPFullyShardedStrategy(**options)


def accumulate(cell: Cell) -> int:
    return 1 if cell.accumulation == "1" else 2


def trainer_for(cell: Cell, steps: int, validating: bool = False) -> Any:
    return Trainer(
        accelerator="cpu", devices=cell.devices, strategy=strategy_for(cell, "trainer"), precision=cell.precision,
        max_steps=steps, accumulate_grad_batches=accumulate(cell),
        gradient_clip_val=0.05 if cell.clipping == "norm" else None,
        limit_val_batches=1 if validating else 0, val_check_interval=2 if validating else None,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )


def full_state(trainer: Any, path: Path) -> dict[str, torch.Tensor]:
    """The model's full state dict, through a full checkpoint file (rank 0; empty elsewhere)."""
    strategy = trainer.strategy
    kind = getattr(strategy, "state_dict_type", None)
    if kind is not None:
        strategy.state_dict_type = "full"
    trainer.save_checkpoint(path)
    if kind is not None:
        strategy.state_dict_type = kind
    if hasattr(strategy.checkpoint_io, "wait"):
        strategy.checkpoint_io.wait()
    if trainer.global_rank != 0:
        return {}
    return clean_state(torch.load(path, weights_only=False)["state_dict"])


def fit_target(module: CellModule) -> Any:
    return torch.compile(module, backend="aot_eager") if module.cell.compile == "whole" else module


def run_trainer(cell: Cell, work: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    validating = cell.stages == "fit-with-val"
    module = CellModule(cell)
    result["start"] = clean_state(module.net.state_dict())
    first = STEPS // 2 if cell.checkpoint != "none" else STEPS
    trainer = trainer_for(cell, first, validating)
    if cell.stages == "validate-fit":
        trainer.validate(fit_target(module), verbose=False)
    trainer.fit(fit_target(module))
    losses = list(module.losses)
    if cell.checkpoint != "none":
        path = work / "mid.ckpt"
        trainer.save_checkpoint(path)
        if hasattr(trainer.strategy.checkpoint_io, "wait"):
            trainer.strategy.checkpoint_io.wait()
        module = CellModule(cell)  # a new launch's module and Trainer
        trainer = trainer_for(cell, STEPS, validating)
        trainer.fit(fit_target(module), ckpt_path=path)
        losses += module.losses
    if cell.stages == "fit-fit":  # fit again: a new Trainer and optimizer, the same trained module
        trainer = trainer_for(cell, 2)
        trainer.fit(fit_target(module))
        losses += module.losses[-2 * accumulate(cell):]
    result["final"] = full_state(trainer, work / "final.ckpt")
    if cell.stages == "fit-test-new":
        tested = trainer.test(CellModule(cell), ckpt_path=work / "final.ckpt", verbose=False)
        result["metric"] = tested[0]["test_loss"]
    result["losses"] = losses
    return result


# ------------------------------------------------------------------------------------------------------------------
# Fabric


def fabric_full_state(fabric: Any, model: Any, path: Path) -> dict[str, torch.Tensor]:
    """The model's full state dict through a full checkpoint file (``fabric_train.full_state_dict``), keys cleaned."""
    state = fabric_train.full_state_dict(fabric, model, path)
    return clean_state(state) if fabric.is_global_zero else {}


def fabric_model(fabric: Any, cell: Cell) -> tuple[Any, Any]:
    """The model and its optimizer, made and set up together (``fabric.setup(model, optimizer)``)."""
    with fabric.init_module():
        net = build_net(cell)
        if cell.wrap == "manual":
            wrap_layers(net, cell)
    if cell.compile == "whole":
        net = torch.compile(net, backend="aot_eager")
    # Param groups by shape over layers wrapped by hand: made after `setup_module` (before, over FairScale's flat
    # parameters, our strategy refuses them: see tests/test_unsharded_shapes.py).
    grouped_by_hand = cell.wrap == "manual" and cell.optimizer == "adamw-groups" and cell.strategy != "sharded"
    if cell.fabric_setup == "after" or (cell.fabric_setup == "auto" and grouped_by_hand):
        model = fabric.setup_module(net)
        return model, fabric.setup_optimizers(optimizer_after_setup(fabric, model, cell))
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    return fabric.setup(net, make_optimizer(cell, named))


def optimizer_after_setup(fabric: Any, model: Any, cell: Cell) -> torch.optim.Optimizer:
    """The optimizer made over a set-up model's parameters: inside ``unsharded_shapes`` where the strategy has it (our
    FSDP: its parameters are 1-D shards otherwise), so that ``p.ndim >= 2`` picks the matrices as unsharded."""
    shapes = getattr(fabric.strategy, "unsharded_shapes", None)
    with shapes(model) if shapes is not None else contextlib.nullcontext():
        return make_optimizer(cell, [(n, p) for n, p in model.named_parameters() if p.requires_grad])


def fabric_steps(fabric: Any, model: Any, optimizer: Any, cell: Cell, first: int, last: int,
                 losses: list[float]) -> None:
    data = cell_dataset(cell)
    batches = list(DataLoader(data, batch_size=4 if cell.model == "gpt2" else GLOBAL_BATCH))
    rank, world, micro_batches = fabric.global_rank, fabric.world_size, accumulate(cell)
    for step in range(first, last):
        if cell.stages == "fit-with-val" and step % 2 == 0:
            evaluate(fabric, model, cell, batches[0])
        for micro in range(micro_batches):
            batch = [t[rank::world] for t in batches[(step * micro_batches + micro) % len(batches)]]
            with fabric.no_backward_sync(model, enabled=micro < micro_batches - 1):
                loss = regularised(batch_loss(model, batch, cell), model, cell)
                fabric.backward(loss / micro_batches)
            losses.append(float(loss.detach()))
        if cell.clipping == "norm":
            fabric.clip_gradients(model, optimizer, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()


def evaluate(fabric: Any, model: Any, cell: Cell, batch: Any) -> float:
    model.eval()
    with torch.no_grad():
        loss = batch_loss(model, [t[fabric.global_rank::fabric.world_size] for t in batch], cell)
    model.train()
    return float(fabric.all_reduce(loss, reduce_op="mean"))


def run_fabric(cell: Cell, work: Path) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=cell.devices, strategy=strategy_for(cell, "fabric"),
                    precision=cell.precision)
    fabric.launch()
    result: dict[str, Any] = {"start": clean_state(build_net(cell.replace(compile="off")).state_dict())}
    losses: list[float] = []
    model, optimizer = fabric_model(fabric, cell)
    if cell.stages == "validate-fit":
        data = list(DataLoader(cell_dataset(cell), batch_size=4 if cell.model == "gpt2" else GLOBAL_BATCH))
        evaluate(fabric, model, cell, data[0])
    if cell.checkpoint == "none":
        fabric_steps(fabric, model, optimizer, cell, 0, STEPS, losses)
    else:
        fabric_steps(fabric, model, optimizer, cell, 0, STEPS // 2, losses)
        path = work / "mid.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        if hasattr(fabric.strategy.checkpoint_io, "wait"):
            fabric.strategy.checkpoint_io.wait()
        model, optimizer = fabric_model(fabric, cell)  # new objects, as a new launch makes them
        fabric.load(path, {"model": model, "optimizer": optimizer})
        fabric_steps(fabric, model, optimizer, cell, STEPS // 2, STEPS, losses)
    if cell.stages == "fit-fit":  # a second training with a new optimizer over the same set-up model
        optimizer = fabric.setup_optimizers(optimizer_after_setup(fabric, model, cell))
        fabric_steps(fabric, model, optimizer, cell, 0, 2, losses)
    result["final"] = fabric_full_state(fabric, model, work / "final.ckpt")
    if cell.stages == "fit-test-new":
        tested, _ = fabric_model(fabric, cell)
        fabric.load(work / "final.ckpt", {"model": tested}, strict=False)
        data = list(DataLoader(cell_dataset(cell), batch_size=4 if cell.model == "gpt2" else GLOBAL_BATCH))
        result["metric"] = evaluate(fabric, tested, cell, data[0])
    result["losses"] = losses
    return result


#: The configuration class of this scenario (``scenarios/jobs.py`` runs a job of it in another script's launch).
CONFIG = Cell
RUNNERS: dict[str, Callable[[Cell, Path], dict[str, Any]]] = {"trainer": run_trainer, "fabric": run_fabric}


def main(cell: Cell, out: str) -> None:
    """Train the cell; rank 0 writes the result to ``out``: what it trained, or the error that stopped it.

    A cell's error is recorded, not raised, so that one broken pair does not hide what the other cells show: every
    rank runs the same cell on the same data, so each meets the same error before a collective the other would not
    join (an error that strikes one rank alone leaves the other waiting until the launch's timeout ends it).
    """
    work = Path(cell.work or Path(out).parent) / Path(out).stem
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(7)
    try:
        result = RUNNERS[cell.front](cell, work)
    except Exception as error:  # noqa: BLE001 (recorded for the test, which fails the cell with it)
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    if scenarios.jobs.rank() == 0:
        result["package"] = PACKAGE
        torch.save(result, out)


if __name__ == "__main__":
    scenarios.jobs.main(Cell, main)
