"""A training scenario run as its own script, so Lightning's launcher can start one process per rank.

Rank 0 writes ``--out`` (torch.save): the trained module's state dict (after the strategy unwrapped it), the FSDP
units seen during training, and whatever the evaluation stages returned. ``train.py --jobs FILE`` runs several such
command lines one after another in the same processes (``scenarios/jobs.py``).
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import io
import os
import signal
import sys
from datetime import timedelta
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.distributed.fsdp.wrap import (  # noqa: E402
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import lightning_fairscale  # noqa: E402,F401  (registers the strategy names)
from scenarios.jobs import run_jobs  # noqa: E402
from scenarios.common import (  # noqa: E402
    IN_FEATURES,
    Block,
    CountTrainBatches,
    LazyModel,
    ManualWrapModel,
    PartialModel,
    RegressionModel,
)
from scenarios.flavor import (  # noqa: E402  (pytorch_lightning or lightning, as the test chose)
    PACKAGE,
    Callback,
    DDPFullyShardedStrategy,
    LightningModule,
    FullyShardedMixedPrecisionPlugin,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
    Trainer,
    seed_everything,
)


LAYER_CLASSES = {"Block": Block, "Linear": torch.nn.Linear, "Sequential": torch.nn.Sequential}


def layer_classes(names: Optional[list[str]]) -> Optional[set[type]]:
    return None if names is None else {LAYER_CLASSES[name] for name in names}


class KillDuringSave(Callback):
    """Kills this process (SIGKILL) halfway through writing its n-th checkpoint file: a crash no code can clean up.
    With ``how="enospc"`` the write fails as on a full disk instead."""

    def __init__(self, nth: int, rank: int, how: str) -> None:
        self.nth, self.rank, self.how = nth, rank, how

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        real_save, calls = torch.save, [0]

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(f, io.BytesIO):  # no file: tensors pickled for a collective (OSS's state consolidation)
                return real_save(obj, f, *args, **kwargs)
            calls[0] += 1
            if calls[0] < self.nth or not hasattr(f, "write"):
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            if self.how == "enospc":  # what a full disk does to the writer
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = save


class LoseRank(Callback):
    """Sends SIGKILL (a crash) or SIGSTOP (a hang) to this process at the start of a given training step."""

    def __init__(self, rank: int, step: int, how: str) -> None:
        self.rank, self.step, self.signal = rank, step, getattr(signal, f"SIG{how}")

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), self.signal)


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
        from lightning_fairscale.fsdp.summary import unit_summary

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
        groups = strategy._groups
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

        summary = importlib.import_module(f"{OURS}.callbacks.model_summary").FullyShardedSummary(pl_module, max_depth=-1)
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

        from lightning_fairscale.fsdp.engine import module_state_dict

        model = trainer.strategy.model
        if isinstance(model, FullyShardedDataParallel):  # gathered unit by unit, kept on rank 0
            state = module_state_dict(model, sharded=False, is_global_zero=trainer.is_global_zero)
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

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        def probe(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
            self.compute.add((str(module.weight.dtype), str(output.dtype)))
            if module.training:
                self.block_linear_calls += 1

        pl_module.net[1].up.register_forward_hook(probe)

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        # Whether this micro-batch's backward reduce-scatters gradients (False inside FSDP's `no_sync`).
        self.grad_sync.append(bool(getattr(trainer.strategy.model, "_require_backward_grad_sync", True)))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
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


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="regression", choices=["regression", "manual", "lazy", "partial"],
                   help="partial: the network of scenarios.common.PartialWrapper (a layer gone, one added)")
    p.add_argument("--strict-loading", type=int, default=1, help="0: LightningModule.strict_loading = False")
    p.add_argument("--record-loaded", action="store_true", help="the full state dict as training starts")
    p.add_argument("--model-on-gpu", action="store_true", help="move the model to the GPU before `fit`")
    p.add_argument("--wrap-with", default="torch", choices=["torch", "fairscale"])
    p.add_argument("--hook", default="configure_model", choices=["configure_model", "configure_sharded_model"])
    p.add_argument(
        "--policy",
        default="size",
        choices=["size", "blocks", "callable", "torch-transformer", "torch-module", "torch-size"],
        help="torch-*: the policies of Lightning's FSDPStrategy (torch-size takes --min-num-params, not the strategy)",
    )
    p.add_argument("--exclude", nargs="*", default=None, choices=list(LAYER_CLASSES))
    p.add_argument("--force-leaf", nargs="*", default=None, choices=list(LAYER_CLASSES))
    p.add_argument("--min-num-params", type=int, default=1000)
    p.add_argument("--strategy-name", default="")
    p.add_argument("--flatten", type=int, default=1)
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every Block")
    p.add_argument("--checkpointing-offload", action="store_true")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--samples", type=int, default=16, help="8 makes every epoch one step (exact resume in Lightning)")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--params", default="self", choices=["self", "trainer", "stray", "split"])
    p.add_argument("--scheduler", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip-val", type=float, default=None)
    p.add_argument("--clip-alg", default="norm")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--precision-plugin", default=None, help="pass FullyShardedMixedPrecisionPlugin(this, 'cpu')")
    p.add_argument("--save-ckpt", default=None)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--eval-after", action="store_true")
    p.add_argument("--validate-only", action="store_true", help="trainer.validate instead of fit: no optimizer exists")
    p.add_argument("--save-ckpt-after-eval", default=None, help="trainer.save_checkpoint after the --eval-after stages")
    p.add_argument("--checkpoint-dir", default=None, help="ModelCheckpoint saving every epoch into this folder")
    p.add_argument("--save-top-k", type=int, default=-1, help="keep this many of the ModelCheckpoint's (by step)")
    p.add_argument("--save-last", action="store_true", help="the ModelCheckpoint overwrites last.ckpt")
    p.add_argument("--state-dict-type", default="full", choices=["full", "sharded"])
    p.add_argument("--lightning-1x-optimizer-state", default="error", choices=["error", "reset"])
    p.add_argument("--kill-during-save", type=int, default=0, help="SIGKILL this rank halfway through its n-th file")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--kill-how", default="kill", choices=["kill", "enospc"])
    p.add_argument("--timeout", type=float, default=None, help="the strategy's collective timeout in seconds")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--sharding-strategy", default=None, help="the strategy's sharding_strategy")
    p.add_argument("--device-mesh", type=int, nargs=2, default=None, help="(replicas, shard_size)")
    p.add_argument("--depth", type=int, default=2, help="number of Blocks of the regression model")
    p.add_argument("--freeze", nargs="*", default=(), help="freeze these parameters (by name) before training")
    p.add_argument("--compute-dtype", default=None, choices=["float16", "bfloat16"])
    p.add_argument("--move-grads-to-cpu", type=int, default=None)
    p.add_argument("--lose-rank", type=int, default=None, help="this rank is lost at --lose-at-step")
    p.add_argument("--lose-at-step", type=int, default=3)
    p.add_argument("--model-summary", action="store_true", help="the Trainer's model summary, and each rank's record")
    p.add_argument("--example-input", action="store_true", help="give the model an example_input_array")
    p.add_argument("--callback", default=None, choices=["swa", "pruning"], help="add Lightning's SWA or ModelPruning")
    p.add_argument("--lose-how", default="KILL", choices=["KILL", "STOP"], help="killed, or stuck (SIGSTOP)")
    p.add_argument("--init", default="eager", choices=["eager", "empty", "meta"],
                   help="build the model eagerly, under trainer.init_module(empty_init=True), or on the meta device")
    p.add_argument("--init-seed-per-rank", action="store_true", help="each rank seeds the sharding-time init apart")
    p.add_argument("--uninitializable", action="store_true", help="a Block holds a buffer nothing can initialise")
    return p.parse_args(argv)


class OldHookModel(ManualWrapModel):
    """Wraps its blocks in Lightning 1.x's ``configure_sharded_model`` instead of ``configure_model``."""

    configure_model = LightningModule.configure_model  # not overridden, as Lightning sees it
    configure_sharded_model = ManualWrapModel._wrap_blocks


def build_model(args: argparse.Namespace) -> Any:
    common: dict[str, Any] = dict(
        optimizer=args.optimizer, params=args.params, scheduler=args.scheduler, num_samples=args.samples
    )
    if args.init != "eager":  # initialised when sharded, from this seed (see `RegressionModel.setup`)
        common.update(init_seed=1234, init_seed_per_rank=args.init_seed_per_rank)
    if args.model == "manual":
        model_class = OldHookModel if args.hook == "configure_sharded_model" else ManualWrapModel
        model = model_class(wrap_with=args.wrap_with, **common)
    elif args.model == "lazy":  # the network is built in `configure_model`
        model = LazyModel(depth=args.depth, **common)
    elif args.model == "partial":
        model = PartialModel(**common)
    else:
        model = RegressionModel(depth=args.depth, **common)
    if args.uninitializable:  # a Block has no `reset_parameters()`: a buffer of its own cannot be initialised
        model.net[1].register_buffer("scale", torch.ones(3))
    model.strict_loading = bool(args.strict_loading)
    if args.model_on_gpu:
        model.cuda()
    if args.example_input:
        model.example_input_array = torch.zeros(2, IN_FEATURES)
    for name in args.freeze:
        model.get_parameter(name).requires_grad_(False)
    return model


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse(argv)
    seed_everything(7, workers=True)
    model = build_model(args) if args.init == "eager" else None
    policy: Any = None
    if args.policy == "blocks":
        policy = {Block}
    elif args.policy == "callable":

        def policy(module: Any, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
            return True if recurse else isinstance(module, torch.nn.Linear)

    elif args.policy == "torch-transformer":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    elif args.policy == "torch-module":
        policy = ModuleWrapPolicy({Block})
    elif args.policy == "torch-size":
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=args.min_num_params)
    # With torch's size policy the strategy keeps its own threshold's default, as a Lightning user's code would.
    size = {} if args.policy == "torch-size" else {"min_num_params": args.min_num_params}
    strategy: Any = args.strategy_name or DDPFullyShardedStrategy(
        **size,
        auto_wrap_policy=policy,
        exclude_wrap_modules=layer_classes(args.exclude),
        force_leaf_modules=layer_classes(args.force_leaf),
        flatten_parameters=bool(args.flatten),
        cpu_offload=args.cpu_offload,
        activation_checkpointing=Block if args.checkpointing else None,
        activation_checkpointing_offload=args.checkpointing_offload,
        state_dict_type=args.state_dict_type,
        lightning_1x_optimizer_state=args.lightning_1x_optimizer_state,
        compute_dtype=getattr(torch, args.compute_dtype) if args.compute_dtype else None,
        move_grads_to_cpu=None if args.move_grads_to_cpu is None else bool(args.move_grads_to_cpu),
        **({"timeout": timedelta(seconds=args.timeout)} if args.timeout else {}),
        **({"sharding_strategy": args.sharding_strategy} if args.sharding_strategy else {}),
        **({"device_mesh": tuple(args.device_mesh)} if args.device_mesh else {}),
    )
    recorder = RecordUnits()
    groups = RecordGroups()
    training = RecordTraining()
    counter = CountTrainBatches()
    callbacks: list[Callback] = [recorder, training, counter, groups]
    summaries = RecordSummary()
    if args.model_summary:
        callbacks.append(summaries)
    loaded = RecordLoaded()
    if args.record_loaded:
        callbacks.append(loaded)
    if args.lose_rank is not None:
        callbacks.append(LoseRank(args.lose_rank, args.lose_at_step, args.lose_how))
    if args.callback:
        callbacks.append(
            StochasticWeightAveraging(swa_lrs=0.01) if args.callback == "swa" else ModelPruning("l1_unstructured")
        )
    if args.kill_during_save:
        callbacks.append(KillDuringSave(args.kill_during_save, args.kill_rank, args.kill_how))
    if args.checkpoint_dir:
        # --save-last: one checkpoint "last.ckpt", overwritten at every epoch end.
        name = dict(filename="last", enable_version_counter=False) if args.save_last else dict(filename="{epoch}-{step}")
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.checkpoint_dir, every_n_epochs=1, monitor="step", mode="max", save_top_k=args.save_top_k,
                **name,
            )
        )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        precision=None if args.precision_plugin else args.precision,
        plugins=[FullyShardedMixedPrecisionPlugin(args.precision_plugin, args.accelerator)] if args.precision_plugin else None,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip_val,
        gradient_clip_algorithm=args.clip_alg if args.clip_val is not None else None,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.checkpoint_dir),
        enable_progress_bar=False,
        enable_model_summary=args.model_summary,
        limit_val_batches=1.0 if args.eval_after else 0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    print(f"rank={trainer.global_rank} cluster={type(trainer.strategy.cluster_environment).__name__}", flush=True)
    if args.init == "empty":
        with trainer.init_module(empty_init=True):
            model = build_model(args)
    elif args.init == "meta":
        with torch.device("meta"):
            model = build_model(args)
    try:
        if args.validate_only:
            trainer.validate(model, verbose=False)
        else:
            trainer.fit(model, ckpt_path=args.ckpt_path)
    except Exception as error:
        error.trained_batches = len(training.losses)  # type: ignore[attr-defined]  (read by scenarios/jobs.py)
        raise
    if args.save_ckpt:
        trainer.save_checkpoint(args.save_ckpt)
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
        "dtypes": getattr(training, "dtypes", {}),
        "created": getattr(model, "created", None),
        "summaries": summaries.summaries,
        "loaded": loaded.state,
    }
    if args.eval_after:
        result["validate"] = trainer.validate(model, verbose=False)
        result["test"] = trainer.test(model, verbose=False)
        predictions = trainer.predict(model)
        result["predict"] = torch.cat(predictions) if predictions else None
        if args.save_ckpt_after_eval:
            trainer.save_checkpoint(args.save_ckpt_after_eval)
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
        torch.save(result, args.out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--jobs"]:
        run_jobs(sys.argv[2], main)
    else:
        main()
