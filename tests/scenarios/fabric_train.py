"""A training loop written with Fabric, run as its own script so that Fabric's launcher can start one process per rank.

The loop does what ``common.reference_training`` does on one process (micro-batches, accumulation, clipping, Adam),
with each rank computing on its slice of the global batch, as a ``scenarios.config.FabricScenario`` says. Rank 0
writes the result file (torch.save) with:

* ``final``: the model's full state dict after ``steps`` optimizer steps (``torch.load(path)["model"]`` of a full
  ``fabric.save(path, {"model": model})``);
* ``norms``: the gradient norms ``fabric.clip_gradients`` returned;
* with ``save_at=K, save_dir=D``: checkpoints of step K in ``D`` (``full.ckpt``, and ``sharded.ckpt`` for FSDP),
  and ``resumed``: for each, the final state dict of a fresh model and optimizer (set up as ``resume_setup`` says)
  that loaded it in this process and trained the remaining steps;
* with ``save_last=True, save_dir=D``: ``D/last.ckpt`` saved after every step, each save replacing the last (with
  ``kill``, a rank dies halfway through writing one: see ``common.die_while_saving``);
* with ``load=PATH``: the loop starts from that checkpoint (Fabric's or the Trainer's) at step ``load_step``;
* with ``partial_from=DIR`` (and nothing else): ``partial``, models whose code changed loaded from DIR's files.

The tests run ``fabric_train.py --jobs FILE``: several loops one after another in the same processes
(``scenarios/jobs.py``). By hand, for debugging (from the project's root)::

    PYTHONPATH=src python tests/scenarios/fabric_train.py --config '{"strategy": "fsdp", "steps": 2}' --out result.pt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from fairscale.nn.data_parallel import FullyShardedDataParallel  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_fairscale import local_slice  # noqa: E402
from lightning_fairscale.distributed import collectives  # noqa: E402
from lightning_fairscale.fsdp.unit.units import fsdp_instances  # noqa: E402
from scenarios.common import (  # noqa: E402
    GLOBAL_BATCH,
    Block,
    PartialWrapper,
    RegressionModelWrapper,
    build_network,
    dataset,
    die_while_saving,
    make_optimizer,
    split_param_groups,
)
from scenarios.flavor import PACKAGE, Fabric, register_strategy_names  # noqa: E402
import scenarios.jobs  # noqa: E402
from scenarios.config import FabricScenario  # noqa: E402

register_strategy_names()  # `--strategy fsdp_fairscale`: a name in the registry of the chosen package's Fabric


def make_strategy(config: FabricScenario) -> Any:
    from scenarios.flavor import ShardedCheckpointIO

    io = {"checkpoint_io": ShardedCheckpointIO(async_save=True)} if config.async_save else {}
    if config.strategy == "fsdp":
        from scenarios.flavor import FabricDDPFullyShardedStrategy

        return FabricDDPFullyShardedStrategy(
            auto_wrap_policy={Block} if config.policy == "blocks" else None,
            min_num_params=1000,
            activation_checkpointing=Block if config.checkpointing else None,
            **({"sharding_strategy": config.sharding_strategy} if config.sharding_strategy else {}),
            **io,
            sync_each_batch=config.sync_each_batch,
        )
    if config.strategy == "sharded":
        from scenarios.flavor import FabricDDPShardedStrategy

        return FabricDDPShardedStrategy(**io, sync_each_batch=config.sync_each_batch)
    return config.strategy  # a registry name


def set_up(fabric: Any, how: str, config: FabricScenario, partial: bool = False) -> tuple[Any, Any]:
    """A fresh model (``PartialWrapper`` with ``partial``) and optimizer (the same initial weights every time), set
    up as ``how`` says."""
    optimizer_name, init_module, empty_init = config.optimizer, config.init_module, config.empty_init
    if partial:
        model = PartialWrapper()
    elif init_module:
        from fairscale.nn import wrap

        with fabric.init_module(empty_init=empty_init):  # manual wrap: each Block becomes an FSDP unit right here
            network = build_network()
            set_up.created = {str(p.dtype) for p in network.parameters()}  # type: ignore[attr-defined]
            for index, layer in enumerate(network):
                if isinstance(layer, Block):
                    network[index] = wrap(layer)
        model = RegressionModelWrapper(network)
    elif empty_init:
        with fabric.init_module(empty_init=True):
            model = RegressionModelWrapper(build_network())
    else:
        model = RegressionModelWrapper(build_network())
    for name in config.freeze:
        model.get_parameter(name).requires_grad_(False)
    params = split_param_groups(model) if config.params == "split" else model.parameters()
    if how == "joint":
        return fabric.setup(model, make_optimizer(optimizer_name, params))
    if how == "separate":
        optimizer = make_optimizer(optimizer_name, params)
        return fabric.setup_module(model), fabric.setup_optimizers(optimizer)
    model = fabric.setup_module(model)
    return model, fabric.setup_optimizers(make_optimizer(optimizer_name, model.parameters()))


def held_gradients(model: Any) -> int:
    """Elements of gradient the model holds between micro-batches: FSDP's flat parameters' (full under
    ``no_sync``, shards otherwise), else the parameters' own (sharded DDP: its owners' only, once reduced)."""
    units = list(fsdp_instances(model))
    if units:
        return sum(p.grad.numel() for unit in units for p in unit.params if p.grad is not None)
    return sum(p.grad.numel() for p in model.parameters() if p.grad is not None)


class UserError(RuntimeError):
    """The user's own error (``fail_at``), which the loop catches."""


class Failure:
    """Raises :class:`UserError` where ``FabricScenario.fail_at`` says, while :attr:`armed`."""

    def __init__(self, model: Any, where: str) -> None:
        self.armed = False
        network = model.net  # through Fabric's wrapper and the root unit: the user's network
        if where == "forward":
            network[2].register_forward_pre_hook(self.fail)
        else:

            def on_output(module: Any, inputs: Any, output: torch.Tensor) -> None:
                if self.armed and output.requires_grad:
                    output.register_hook(self.fail)

            network[1].register_forward_hook(on_output)

    def fail(self, *_: Any) -> None:
        if self.armed:
            self.armed = False
            raise UserError("NaN guard")


def train(fabric: Any, model: Any, optimizer: Any, config: FabricScenario, first: int, last: int,
          save: Optional[Any] = None, record: Optional[dict[str, Any]] = None) -> list[float]:
    """Optimizer steps ``first`` (0-based) to ``last`` (excluded) on the global batches ``reference_training`` uses;
    ``save(step)`` after step ``config.save_at``. Returns the gradient norms ``fabric.clip_gradients`` gave. ``record``
    gets each step's loss (``"losses"``) and the dtypes of the gradients (``"gradients"``)."""
    batches = list(DataLoader(dataset(config.samples), batch_size=GLOBAL_BATCH))
    rank, world = fabric.global_rank, fabric.world_size
    norms = []
    failure = Failure(model, config.fail_at[1]) if config.fail_at is not None and save is not None else None
    for step in range(first, last):
        if failure is not None:
            failure.armed = step == config.fail_at[0]  # type: ignore[index]
        try:
            for micro in range(config.accumulate):
                x, y = batches[(step * config.accumulate + micro) % len(batches)]
                x, y = x[rank::world], y[rank::world]  # this rank's slice of the global batch
                with fabric.no_backward_sync(model, enabled=micro < config.accumulate - 1):
                    loss = nn.functional.mse_loss(model(x), y) / config.accumulate
                    fabric.backward(loss)
                if record is not None and micro < config.accumulate - 1:
                    record.setdefault("held_gradients", []).append(held_gradients(model))
        except UserError:  # the user's loop skips the step, after saving what the last completed one left
            assert save is not None
            save(step)
            optimizer.zero_grad()
            continue
        if record is not None:
            record.setdefault("losses", []).append(float(loss) * config.accumulate)  # the last micro-batch's
            record["gradients"] = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        if config.clip_norm is not None:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=config.clip_norm)))
        if config.clip_val is not None:
            fabric.clip_gradients(model, optimizer, clip_val=config.clip_val)
        optimizer.step()
        optimizer.zero_grad()
        if save is not None and config.fail_at is None and (step + 1 == config.save_at or config.save_last):
            save(step + 1)
    return norms


def full_state_dict(fabric: Any, model: Any, path: Path) -> dict[str, torch.Tensor]:
    """The model's full state dict, through a full checkpoint file (rank 0; empty elsewhere)."""
    strategy = fabric.strategy
    kind = getattr(strategy, "state_dict_type", None)
    if kind is not None:
        strategy.state_dict_type = "full"
    fabric.save(path, {"model": model})
    if kind is not None:
        strategy.state_dict_type = kind
    if hasattr(strategy.checkpoint_io, "wait"):  # a file written in the background is read once it is in place
        strategy.checkpoint_io.wait()
    if not fabric.is_global_zero:
        return {}
    return {k: v.clone() for k, v in torch.load(path, weights_only=True)["model"].items()}


#: How ``partial_loads`` loads each kind of file: ``fabric.load`` a checkpoint, or ``fabric.load_raw`` into the model.
PARTIAL_FILES = {"full": "full.ckpt", "sharded": "sharded.ckpt", "raw": "raw.pt", "raw-sharded": "sharded.ckpt"}


def partial_loads(fabric: Any, config: FabricScenario, work: Path) -> dict[str, Any]:
    """For each of ``config.partial_kinds``, a fresh ``PartialWrapper`` (the saved model's code changed) loads the
    old model's file with ``strict=config.strict``, then trains a step: the full state dicts after each."""
    result: dict[str, Any] = {}
    for kind in config.partial_kinds:
        model, optimizer = set_up(fabric, "joint", config, partial=True)
        path = Path(config.partial_from) / PARTIAL_FILES[kind]
        if kind.startswith("raw"):
            fabric.load_raw(path, model, strict=config.strict)
        else:
            fabric.load(path, {"model": model}, strict=config.strict)
        loaded = full_state_dict(fabric, model, work / f"partial-{kind}-loaded.ckpt")
        train(fabric, model, optimizer, config, 0, 1)
        result[kind] = {"loaded": loaded, "trained": full_state_dict(fabric, model, work / f"partial-{kind}.ckpt")}
    return result


#: The configuration class of this scenario (``scenarios/jobs.py`` runs a job of it in another script's launch).
CONFIG = FabricScenario


def main(config: FabricScenario, out: str) -> None:
    """Run the loop ``config`` describes; rank 0 writes the result to ``out``."""
    if config.precision == "plugin-16-mixed":  # Fabric maps the "16-mixed" flag to bf16 on CPUs; a plugin keeps fp16
        from lightning_fabric.plugins import MixedPrecision

        precision: dict[str, Any] = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    else:
        precision = {"precision": config.precision}
    fabric = Fabric(
        accelerator="cpu", devices=config.devices, num_nodes=config.num_nodes, strategy=make_strategy(config),
        **precision,
    )
    # A function: `spawn` strategies need one. The configuration goes as JSON: Fabric's spawn launcher refuses
    # frozen dataclasses among the arguments (`apply_to_collection`).
    fabric.launch(run, config.to_json(), out)


def run(fabric: Any, fields: dict[str, Any], out: str) -> None:
    config = FabricScenario.from_json(fields)
    work = Path(config.save_dir or Path(out).parent)
    work.mkdir(parents=True, exist_ok=True)
    if config.partial_from:
        partial = partial_loads(fabric, config, work)
        if fabric.is_global_zero:
            torch.save({"partial": partial, "strategy": type(fabric.strategy).__name__}, out)
        return
    model, optimizer = set_up(fabric, config.setup, config)
    if config.kill is not None and fabric.global_rank == config.kill.rank:
        die_while_saving(config.kill.nth, config.kill.how)
    result: dict[str, Any] = {
        "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
        "package": PACKAGE,
        "world_size": fabric.world_size,
        "cluster": type(getattr(fabric.strategy, "cluster_environment", None)).__name__,
        "units": sum(isinstance(m, FullyShardedDataParallel) for m in model.modules()),
        "created": getattr(set_up, "created", None),  # the parameters' dtypes as `fabric.init_module()` made them
        "compute": set(),  # (weight dtype, output dtype) of a Block's Linear while training
        "block_calls": 0,
    }

    def probe(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        result["compute"].add((str(module.weight.dtype), str(output.dtype)))
        result["block_calls"] += 1

    block = next(m for m in model.modules() if isinstance(m, Block))
    handle = block.up.register_forward_hook(probe)
    if config.load:
        state = {"model": model, "optimizer": optimizer}
        remainder = fabric.load(config.load, state, weights_only=False)
        result["remainder"] = sorted(remainder)

    def save(step: int) -> None:
        state = {"model": model, "optimizer": optimizer, "step": step}
        if config.save_last:
            fabric.save(work / "last.ckpt", state)
            return
        fabric.save(work / "full.ckpt", state)
        kind = getattr(fabric.strategy, "state_dict_type", None)
        if kind is not None:  # FSDP: the same strategy writes the sharded format too
            fabric.strategy.state_dict_type = "sharded"
            fabric.save(work / "sharded.ckpt", state)
            if not config.async_save:  # filtered as Lightning filters: the first block's keys (issue 48 item 3c)
                fabric.save(work / "filtered.ckpt", state, filter={"model": lambda key, _: key.startswith("net.1.")})
            fabric.strategy.state_dict_type = kind

    groups = getattr(fabric.strategy, "_groups", None)
    replicas = None if groups is None else groups.replica
    replica_start = collectives.all_reduced_bytes(replicas)
    result["norms"] = train(fabric, model, optimizer, config, config.load_step, config.steps, save=save, record=result)
    if replicas is not None:  # hybrid sharding: the bytes all-reduced across the replicas, and this rank's shards
        result["replica_bytes"] = collectives.all_reduced_bytes(replicas) - replica_start
        # This rank's elements: `p.numel()` outside the forward is the whole parameter's, as unsharded.
        result["shard_bytes"] = sum(local_slice(p).numel() * p.element_size() for p in model.parameters())
        # A read outside the forward reduces over the shard group only (over the replicas too, it would be twice
        # the whole model's).
        with torch.no_grad():
            result["l2_outside_forward"] = sum(p.pow(2).sum() for p in model.parameters()).item()
    handle.remove()
    if hasattr(fabric.strategy, "memory_figures"):
        result["memory"] = fabric.strategy.memory_figures(model, [optimizer])
    result["parameters"] = {str(p.dtype) for p in model.parameters()}
    shard = getattr(optimizer, "optimizer", optimizer)  # under Fabric's wrapper
    shard = getattr(shard, "optim", shard)  # OSS's optimizer of this rank's share
    result["optimizer_state"] = {
        (key, str(value.dtype)) for state in shard.state.values() for key, value in state.items()
    }
    result["final"] = full_state_dict(fabric, model, work / "final.ckpt")
    if config.save_at:
        result["resumed"] = {}
        setups = config.resume_setup or ("joint", "joint")
        kinds = ["full", "sharded"] if getattr(fabric.strategy, "state_dict_type", None) else ["full"]
        for kind, how in zip(kinds, setups):
            fresh, fresh_optimizer = set_up(fabric, how, config)
            state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
            remainder = fabric.load(work / f"{kind}.ckpt", state)
            assert state["step"] == config.save_at and not remainder, (state["step"], remainder)
            train(fabric, fresh, fresh_optimizer, config, config.save_at, config.steps)
            result["resumed"][kind] = full_state_dict(fabric, fresh, work / f"resumed-{kind}.ckpt")
        if "sharded" in kinds and not config.async_save:  # a fresh model takes the filtered checkpoint's keys
            fresh, _ = set_up(fabric, "joint", config)
            fabric.load(work / "filtered.ckpt", {"model": fresh}, strict=False)
            result["filtered_loaded"] = full_state_dict(fabric, fresh, work / "filtered-loaded.ckpt")
    if fabric.is_global_zero:
        torch.save(result, out)


if __name__ == "__main__":
    scenarios.jobs.main(FabricScenario, main)
