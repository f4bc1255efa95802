"""A training scenario with the Trainer, run as its own script, so Lightning's launcher can start one process per rank.

What it trains is a ``scenarios.config.Scenario``. Rank 0 writes the result file (torch.save): the trained module's
state dict (after the strategy unwrapped it), the FSDP units seen during training, and whatever the evaluation stages
returned. The tests run ``train.py --jobs FILE``: several scenarios one after another in the same processes
(``scenarios/jobs.py``, written by ``conftest.run_jobs``). By hand, for debugging (from the project's root)::

    PYTHONPATH=src python tests/scenarios/train.py --config '{"policy": "blocks", "steps": 2}' --out result.pt
    PYTHONPATH=src python tests/scenarios/train.py --job test_fully_sharded:policy-blocks

(``--job``: a job of a test module's ``JOBS``). Set ``TEST_LIGHTNING_PACKAGE=lightning`` to run with the unified
``lightning`` package (``scenarios/flavor.py``).
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.distributed.fsdp.wrap import (  # noqa: E402
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import lightning_fairscale  # noqa: E402,F401  (registers the strategy names)
from lightning_fairscale.fsdp.unit.units import fsdp_instances  # noqa: E402
import scenarios.jobs  # noqa: E402
from scenarios.config import Scenario  # noqa: E402
from scenarios.common import (  # noqa: E402
    IN_FEATURES,
    Block,
    CountTrainBatches,
    LazyModel,
    ManualWrapModel,
    GLOBAL_BATCH,
    PartialModel,
    RegressionModel,
    dataset,
    die_while_saving,
)
from scenarios.flavor import (  # noqa: E402  (pytorch_lightning or lightning, as the test chose)
    PACKAGE,
    AsyncCheckpointIO,
    Callback,
    DeviceStatsMonitor,
    Logger,
    ShardedCheckpointIO,
    ThroughputMonitor,
    DDPFullyShardedStrategy,
    LightningModule,
    FullyShardedMixedPrecisionPlugin,
    ModelCheckpoint,
    ModelPruning,
    ModelSummary as PlainModelSummary,
    OnExceptionCheckpoint,
    StochasticWeightAveraging,
    Trainer,
    seed_everything,
)


LAYER_CLASSES = {"Block": Block, "Linear": torch.nn.Linear, "Sequential": torch.nn.Sequential}


def layer_classes(names: Optional[list[str]]) -> Optional[set[type]]:
    return None if names is None else {LAYER_CLASSES[name] for name in names}


class KillDuringSave(Callback):
    """Kills this process (SIGKILL) halfway through writing its n-th checkpoint file: a crash no code can clean up.
    With ``how="enospc"`` the write fails as on a full disk instead (``scenarios.common.die_while_saving``)."""

    def __init__(self, nth: int, rank: int, how: str) -> None:
        self.nth, self.rank, self.how = nth, rank, how

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.global_rank == self.rank:
            die_while_saving(self.nth, self.how)


class LoseRank(Callback):
    """Sends SIGKILL (a crash) or SIGSTOP (a hang) to this process at the start of a given training step, after
    printing ``lost rank R at T`` (``T``: ``time.time()``), from which the test measures how quickly the run ends."""

    def __init__(self, rank: int, step: int, how: str) -> None:
        self.rank, self.step, self.signal = rank, step, getattr(signal, f"SIG{how}")

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            print(f"lost rank {self.rank} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), self.signal)


class UserError(RuntimeError):
    """What :class:`RaiseInStep` raises: the user's own exception, which must reach the caller unchanged."""


class RaiseInStep(Callback):
    """The user's code raises :class:`UserError` in training step ``step`` (``trainer.global_step``), on ``rank``
    (``None``: every rank), at ``where``: "forward" (a forward pre-hook of the network's third layer, the second
    Block: the forward is half done, units gathered), "step" (a forward hook of the LightningModule: training_step
    after the model's forward, as a NaN guard on the output), "backward" (a gradient hook on the first Block's
    output: the backward is half done), "optimizer" (``on_before_optimizer_step``: after the backward)."""

    def __init__(self, step: int, where: str, rank: Optional[int]) -> None:
        assert where in ("forward", "step", "backward", "optimizer"), where
        self.step, self.where, self.rank = step, where, rank
        self.armed = False

    def _raise(self, *_: Any) -> None:
        if self.armed:
            self.armed = False
            raise UserError(f"NaN guard: not finite in step {self.step} ({self.where})")

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.where == "forward":
            pl_module.net[2].register_forward_pre_hook(self._raise)
        elif self.where == "step":
            pl_module.register_forward_hook(self._raise)
        elif self.where == "backward":

            def on_output(module: Any, inputs: Any, output: torch.Tensor) -> None:
                if self.armed and output.requires_grad:
                    output.register_hook(self._raise)

            pl_module.net[1].register_forward_hook(on_output)

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.armed = trainer.global_step == self.step and self.rank in (None, trainer.global_rank)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.where == "optimizer":
            self._raise()


def start_together(strategy: Any, processes: int, out: str) -> None:
    """Holds the ``processes`` ranks of this node before the rendezvous until all have got there (files
    ``OUT.started-rankR``, ``R`` the local rank).

    The strategy's ``timeout`` bounds the rendezvous too, not only the collectives. Rank 0 starts the other ranks
    (Lightning's launcher) only when its own fit begins, so they reach the rendezvous a whole start-up (imports)
    later: on a loaded machine that alone can outlast a short ``timeout``, and the run fails to connect before any
    rank is lost. Started together, the ranks only wait for each other as long as connecting takes.
    """
    setup_distributed = strategy.setup_distributed

    def together() -> None:
        Path(f"{out}.started-rank{strategy.cluster_environment.local_rank()}").touch()
        deadline = time.monotonic() + 600  # a guard against a rank that never starts; the test's own limit is lower
        while time.monotonic() < deadline and not all(
            Path(f"{out}.started-rank{rank}").exists() for rank in range(processes)
        ):
            time.sleep(0.1)
        setup_distributed()

    strategy.setup_distributed = together


class RecordUnits(Callback):
    """Records, on rank 0, how the model was sharded while training."""

    def __init__(self) -> None:
        self.units: list[dict[str, Any]] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        self.replica_start = _replica_bytes(trainer)
        self.units = [
            {"path": name, "local_numel": sum(p.numel() for p in m.params), "world_size": m.world_size}
            for name, m in trainer.strategy.model.named_modules()
            if isinstance(m, FullyShardedDataParallel)
        ]
        from lightning_fairscale.fsdp.wrapping.summary import unit_summary

        self.summary = unit_summary(trainer.strategy.model)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.memory = getattr(trainer.strategy, "memory_figures", dict)()
        # Under hybrid sharding: the bytes this rank all-reduced across the replicas (the inter-node traffic).
        if self.replica_start is not None:
            self.replica_bytes = _replica_bytes(trainer) - self.replica_start


def _replica_bytes(trainer: Trainer) -> Optional[int]:
    """Under hybrid sharding, the bytes this process has all-reduced over its replica group so far; else ``None``."""
    from lightning_fairscale.distributed import collectives

    groups = getattr(trainer.strategy, "_groups", None)
    replicas = groups.replica if groups is not None else None
    return None if replicas is None else collectives.all_reduced_bytes(replicas)


class RecordGroups(Callback):
    """Records the strategy's process groups as every stage starts (they are made before the ``setup`` hook)."""

    def __init__(self) -> None:
        self.stages: list[tuple[Any, ...]] = []

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        groups = getattr(strategy, "_groups", None)  # FSDP's (sharded DDP uses the default group)
        if groups is not None:
            self.stages.append((groups.all_gather, groups.reduce_scatter, groups.replica))

    def alive(self) -> list[bool]:
        """For each group of the first stage, whether torch still knows it (it was not destroyed)."""
        return [_group_alive(group) for group in self.stages[0] if group is not None] if self.stages else []


def _group_alive(group: Any) -> bool:
    try:
        torch.distributed.get_backend(group)
    except ValueError:
        return False
    return True


class RecordSummary(Callback):
    """Records each rank's ``FullyShardedSummary`` of the whole model (every rank builds one: the example input, if
    any, runs through the root unit on all ranks); rank 0 keeps them all."""

    def __init__(self) -> None:
        self.summaries: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        from scenarios.flavor import OURS

        summaries = importlib.import_module(f"{OURS}.callbacks.model_summary")
        summary = summaries.FullyShardedSummary(pl_module, max_depth=-1)
        mine = {
            "names": summary.layer_names,
            "types": summary.layer_types,
            "params": summary.param_nums,
            "shard": [layer.shard_parameters for layer in summary._layer_summary.values()],
            "in_sizes": summary.in_sizes,
            "out_sizes": summary.out_sizes,
            "flops": {k: sum(v.values()) for k, v in summary.flop_counts.items()},
            "total": summary.total_parameters,
            "trainable": summary.trainable_parameters,
            "total_shard": summary.shard_parameters,
            "modes": summary.total_training_modes,
        }
        self.summaries = [{} for _ in range(trainer.world_size)]
        torch.distributed.all_gather_object(self.summaries, mine)


class RecordLoaded(Callback):
    """Records, on rank 0, the model's full state dict as training starts: what the checkpoint loaded."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        from lightning_fairscale.fsdp.engine import wrapped_model

        model = trainer.strategy.model
        if isinstance(model, FullyShardedDataParallel):  # gathered unit by unit, kept on rank 0
            state = wrapped_model(model).state_dict(sharded=False, is_global_zero=trainer.is_global_zero)
        else:
            state = pl_module.state_dict()
        self.state = {k: v.detach().clone() for k, v in state.items()}


class RecordTraining(Callback):
    """Records, on rank 0, each step's loss and the dtypes a block's Linear layer computes with."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.compute: set[tuple[str, str]] = set()
        self.block_linear_calls = 0
        self.grad_sync: list[bool] = []
        self.held_gradients: list[int] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        def probe(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
            self.compute.add((str(module.weight.dtype), str(output.dtype)))
            if module.training:
                self.block_linear_calls += 1

        # The Linear layer itself, inside its FSDP unit (a hook on the unit would run after the unit's forward,
        # when the module holds its original parameters again, the shards).
        layer = pl_module.net[1].up
        while not isinstance(layer, torch.nn.Linear):
            layer = layer.module
        layer.register_forward_hook(probe)

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        # Whether this micro-batch's backward reduce-scatters gradients (False inside FSDP's `no_sync`).
        self.grad_sync.append(bool(getattr(trainer.strategy.model, "_require_backward_grad_sync", True)))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        # After every micro-batch: the elements of gradient FSDP holds (full under no_sync, shards otherwise).
        units = list(fsdp_instances(trainer.strategy.model))
        self.held_gradients.append(sum(p.grad.numel() for u in units for p in u.params if p.grad is not None))
        # After the optimizer step: what the shards, their gradients and the optimizer state are held in.
        params = list(trainer.strategy.model.parameters())
        self.dtypes = {
            "parameters": {str(p.dtype) for p in params},
            "gradients": {str(p.grad.dtype) for p in params if p.grad is not None},
            "optimizer_state": {
                (key, str(value.dtype))
                for optimizer in trainer.optimizers
                for state in optimizer.state.values()
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            },
        }


class RecordMetrics(Logger):
    """A logger that keeps what it is given (the ThroughputMonitor's and DeviceStatsMonitor's metrics), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "record"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.metrics.append(dict(metrics))


def measure_flops_on_meta(config: Scenario, model: Any) -> None:
    """Lightning's recipe (ThroughputMonitor's docs): the FLOPs of a training step (forward and backward) of the
    same model built on the meta device, whatever the strategy does to ``model`` later."""
    from lightning_fabric.utilities.throughput import measure_flops

    from scenarios.common import GLOBAL_BATCH

    with torch.device("meta"):
        meta = build_model(config)
        x = torch.randn(GLOBAL_BATCH // config.devices, IN_FEATURES)
    model.flops_per_batch = measure_flops(meta, lambda: meta(x), loss_fn=torch.Tensor.sum)


def checkpoint_io(config: Scenario) -> Any:
    if config.async_save == "option":
        return ShardedCheckpointIO(async_save=True)
    if config.async_save == "lightning":
        return AsyncCheckpointIO(ShardedCheckpointIO())
    return None


class OldHookModel(ManualWrapModel):
    """Wraps its blocks in Lightning 1.x's ``configure_sharded_model`` instead of ``configure_model``."""

    configure_model = LightningModule.configure_model  # not overridden, as Lightning sees it
    configure_sharded_model = ManualWrapModel._wrap_blocks


def build_model(config: Scenario) -> Any:
    common: dict[str, Any] = dict(
        optimizer=config.optimizer, params=config.params, scheduler=config.scheduler, num_samples=config.samples
    )
    if config.init != "eager":  # initialised when sharded, from this seed (see `RegressionModel.setup`)
        common.update(init_seed=1234, init_seed_per_rank=config.init_seed_per_rank)
    if config.model == "manual":
        model_class = OldHookModel if config.hook == "configure_sharded_model" else ManualWrapModel
        model = model_class(wrap_with=config.wrap_with, **common)
    elif config.model == "lazy":  # the network is built in `configure_model`
        model = LazyModel(depth=config.depth, **common)
    elif config.model == "partial":
        model = PartialModel(**common)
    else:
        model = RegressionModel(depth=config.depth, **common)
    if config.uninitializable:  # a Block has no `reset_parameters()`: a buffer of its own cannot be initialised
        model.net[1].register_buffer("scale", torch.ones(3))
    model.strict_loading = config.strict_loading
    if config.model_on_gpu:
        model.cuda()
    if config.example_input:
        model.example_input_array = torch.zeros(2, IN_FEATURES)
    for name in config.freeze:
        model.get_parameter(name).requires_grad_(False)
    return model


def stages_with_new_modules(config: Scenario, trainer: Any) -> tuple[dict[str, Any], Any]:
    """After ``fit``: ``test`` and ``validate`` of new modules from the best checkpoint, their metrics and those of
    the best checkpoint computed unsharded (rank 0, on the whole data set: every batch has one size), then ``fit`` of
    a new module for one more epoch (its own, fresh optimizer), returned."""
    best = trainer.checkpoint_callback.best_model_path
    found: dict[str, Any] = {
        "best": best,
        "test_new": trainer.test(build_model(config), ckpt_path="best", verbose=False),
        "validate_new": trainer.validate(build_model(config), ckpt_path=best, verbose=False),
    }
    if trainer.global_rank == 0:
        if Path(best).is_dir():  # a sharded checkpoint: consolidated into the full one
            from lightning_fairscale.fsdp.state.sharded_checkpoint import consolidate

            state_dict = consolidate(best)["state_dict"]
        else:
            state_dict = torch.load(best, weights_only=False)["state_dict"]
        plain = build_model(config)
        plain.load_state_dict(state_dict)
        x, y = dataset(config.samples).tensors
        with torch.no_grad():
            found["best_loss_unsharded"] = torch.nn.functional.mse_loss(plain(x), y).item()
    refit = build_model(config)
    trainer.fit_loop.epoch_loop.max_steps = config.steps + config.samples // GLOBAL_BATCH  # one more epoch
    trainer.fit(refit)
    found["refit_steps"] = trainer.global_step
    return found, refit


#: The configuration class of this scenario (``scenarios/jobs.py`` runs a job of it in another script's launch).
CONFIG = Scenario


def main(config: Scenario, out: str) -> None:
    """Train as ``config`` says; rank 0 writes the result to ``out``."""
    seed_everything(7, workers=True)
    model = build_model(config) if config.init == "eager" else None
    policy: Any = None
    if config.policy == "blocks":
        policy = {Block}
    elif config.policy == "callable":

        def policy(module: Any, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
            return True if recurse else isinstance(module, torch.nn.Linear)

    elif config.policy == "torch-transformer":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    elif config.policy == "torch-module":
        policy = ModuleWrapPolicy({Block})
    elif config.policy == "torch-size":
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=config.min_num_params)
    # With torch's size policy the strategy keeps its own threshold's default, as a Lightning user's code would.
    size = {} if config.policy == "torch-size" else {"min_num_params": config.min_num_params}
    strategy: Any = config.strategy_name or DDPFullyShardedStrategy(
        **size,
        auto_wrap_policy=policy,
        exclude_wrap_modules=layer_classes(config.exclude),
        force_leaf_modules=layer_classes(config.force_leaf),
        flatten_parameters=config.flatten,
        cpu_offload=config.cpu_offload,
        activation_checkpointing=Block if config.checkpointing else None,
        activation_checkpointing_offload=config.checkpointing_offload,
        state_dict_type=config.state_dict_type,
        checkpoint_io=checkpoint_io(config),
        lightning_1x_optimizer_state=config.lightning_1x_optimizer_state,
        compute_dtype=getattr(torch, config.compute_dtype) if config.compute_dtype else None,
        move_grads_to_cpu=config.move_grads_to_cpu,
        sync_each_batch=config.sync_each_batch,
        **({"timeout": timedelta(seconds=config.timeout)} if config.timeout else {}),
        **({"sharding_strategy": config.sharding_strategy} if config.sharding_strategy else {}),
        **({"device_mesh": tuple(config.device_mesh)} if config.device_mesh else {}),
        **({"backward_prefetch": None if config.backward_prefetch == "none" else config.backward_prefetch}
           if config.backward_prefetch else {}),
    )
    recorder = RecordUnits()
    groups = RecordGroups()
    training = RecordTraining()
    counter = CountTrainBatches()
    callbacks: list[Callback] = [recorder, training, counter, groups]
    summaries = RecordSummary()
    if config.model_summary:
        # Lightning's plain ModelSummary, whose text the test reads (its default is RichModelSummary where `rich`
        # is installed); the rich one's layout has a unit test.
        callbacks += [summaries, PlainModelSummary(max_depth=1)]
    loaded = RecordLoaded()
    if config.record_loaded:
        callbacks.append(loaded)
    if config.lose is not None:
        callbacks.append(LoseRank(config.lose.rank, config.lose.step, config.lose.how))
        start_together(strategy, config.devices, out)
    if config.callback:
        callbacks.append(
            StochasticWeightAveraging(swa_lrs=0.01) if config.callback == "swa" else ModelPruning("l1_unstructured")
        )
    metrics = RecordMetrics()
    if config.throughput:
        callbacks += [ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2),
                      DeviceStatsMonitor()]
    if config.fail_at is not None:
        callbacks.append(RaiseInStep(config.fail_at[0], config.fail_at[1], config.fail_rank))
    if config.on_exception_dir is not None:
        callbacks.append(OnExceptionCheckpoint(config.on_exception_dir))
    if config.kill is not None:
        callbacks.append(KillDuringSave(config.kill.nth, config.kill.rank, config.kill.how))
    if config.new_modules:
        callbacks.append(
            ModelCheckpoint(dirpath=config.checkpoint_dir, monitor="val_loss", save_top_k=2, save_last=True)
        )
    elif config.checkpoint_dir:
        # save_last: one checkpoint "last.ckpt", overwritten at every epoch end.
        name = (
            dict(filename="last", enable_version_counter=False) if config.save_last else dict(filename="{epoch}-{step}")
        )
        callbacks.append(
            ModelCheckpoint(
                dirpath=config.checkpoint_dir, every_n_epochs=1, monitor="step", mode="max",
                save_top_k=config.save_top_k, **name,
            )
        )
    trainer = Trainer(
        accelerator=config.accelerator,
        devices=config.devices,
        num_nodes=config.num_nodes,
        strategy=strategy,
        max_steps=config.steps,
        precision=None if config.precision_plugin else config.precision,
        plugins=(
            [FullyShardedMixedPrecisionPlugin(config.precision_plugin, config.accelerator)]
            if config.precision_plugin
            else None
        ),
        accumulate_grad_batches=config.accumulate,
        gradient_clip_val=config.clip[0] if config.clip else None,
        gradient_clip_algorithm=config.clip[1] if config.clip else None,
        callbacks=callbacks,
        logger=metrics if config.throughput else False,
        log_every_n_steps=1,
        enable_checkpointing=bool(config.checkpoint_dir or config.on_exception_dir),
        enable_progress_bar=False,
        enable_model_summary=config.model_summary,
        limit_val_batches=1.0 if config.eval_after or config.new_modules else 0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    print(f"rank={trainer.global_rank} cluster={type(trainer.strategy.cluster_environment).__name__}", flush=True)
    if config.init == "empty":
        with trainer.init_module(empty_init=True):
            model = build_model(config)
    elif config.init == "meta":
        with torch.device("meta"):
            model = build_model(config)
    if config.throughput:
        measure_flops_on_meta(config, model)
    try:
        if config.validate_only:
            trainer.validate(model, verbose=False)
        else:
            trainer.fit(model, ckpt_path=config.ckpt_path)
    except Exception as error:
        error.trained_batches = len(training.losses)  # type: ignore[attr-defined]  (read by scenarios/jobs.py)
        raise
    if config.save_ckpt:
        trainer.save_checkpoint(config.save_ckpt)
    result: dict[str, Any] = {
        "units": recorder.units,
        "summary": getattr(recorder, "summary", ""),
        "memory": getattr(recorder, "memory", {}),
        "replica_bytes": getattr(recorder, "replica_bytes", None),
        "strategy": type(trainer.strategy).__name__,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "batches_counted": counter.batches,
        "lr": [group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups],
        "package": PACKAGE,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "cluster": type(trainer.strategy.cluster_environment).__name__,
        "losses": training.losses,
        "compute": sorted(training.compute),
        "block_linear_calls": training.block_linear_calls,
        "grad_sync": training.grad_sync,
        "held_gradients": training.held_gradients,
        "dtypes": getattr(training, "dtypes", {}),
        "created": getattr(model, "created", None),
        "summaries": summaries.summaries,
        "loaded": loaded.state,
        "metrics": metrics.metrics,
        "flops_per_batch": getattr(model, "flops_per_batch", None),
    }
    if config.new_modules:
        found, model = stages_with_new_modules(config, trainer)  # `model`: the last fit's, recorded below
        result.update(found)
    if config.eval_after:
        result["validate"] = trainer.validate(model, verbose=False)
        result["test"] = trainer.test(model, verbose=False)
        predictions = trainer.predict(model)
        result["predict"] = torch.cat(predictions) if predictions else None
        if config.save_ckpt_after_eval:
            trainer.save_checkpoint(config.save_ckpt_after_eval)
    # The module stays sharded after `fit` (and over its process groups); the full one is an explicit call (rank 0
    # gets it), which ends the groups.
    alive_before_unshard = groups.alive()
    if hasattr(trainer.strategy, "unshard_module"):
        trainer.strategy.unshard_module()
    result["groups"] = {
        "stages": len(groups.stages),
        "reused": all(len(stage) == len(groups.stages[0]) and all(a is b for a, b in zip(stage, groups.stages[0]))
                      for stage in groups.stages),
        "alive_before_unshard": alive_before_unshard,
        "alive_after_unshard": groups.alive(),
    }  # fmt: skip
    result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    scenarios.jobs.main(Scenario, main)
