"""DDPShardedStrategy (OSS + ShardedDDP) on CPU processes (gloo), against single-process training without a wrapper.

The 2-process cases run one after the other in one launch of ``scenarios/sharded_train.py`` (see its ``CASES``).
``"ddp_sharded_spawn"`` starts its processes itself, from this process: its tests share two fits (:func:`spawned`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint, ModelPruning
from pytorch_lightning.strategies import StrategyRegistry
from scenarios import common
from scenarios.common import (
    BF16_ATOL,
    NUM_SAMPLES,
    OUT_FEATURES,
    assert_adam_close,
    max_difference,
    reference_training,
)
from scenarios.sharded_train import CASES, MATRIX_WEIGHT_DECAY, VECTOR_LR_FACTOR, param_groups

from conftest import TESTS, run_script
from lightning_fairscale.precision.sharded import ShardedMixedPrecisionPlugin
from lightning_fairscale.strategies import DDPShardedStrategy, DDPSpawnShardedStrategy
from lightning_fairscale.strategies._spawned_fit import EndOfFit, SpawnLauncher, writes_optimizer_states
from lightning_fairscale.strategies.sharded import shard_optimizer

ATOL = 1e-5
SCRIPT = TESTS / "scenarios" / "sharded_train.py"
# "resume" reads straight's checkpoint; cases marked "alone" have launches of their own.
TWO_PROCESS_CASES = [name for name in CASES if name != "resume" and not CASES[name].get("alone")] + ["resume"]


def run_cases(workdir: Path, cases: list[str], devices: int = 2) -> dict[str, dict[str, Any]]:
    out = workdir / f"results-{devices}.pt"
    args = ["--out", str(out), "--cases", ",".join(cases), "--devices", str(devices), "--workdir", str(workdir)]
    run_script([str(SCRIPT), *args], cwd=workdir, ranks=devices)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict[str, Any]], Path]:
    workdir = tmp_path_factory.mktemp("sharded")
    return run_cases(workdir, TWO_PROCESS_CASES), workdir


def reference(name: str) -> dict[str, torch.Tensor]:
    """Single-process training on the full batch for case ``name``, with the case's optimizer and features."""
    case = CASES[name]
    kwargs: dict[str, Any] = {"scheduler": case.get("scheduler", False)}
    kwargs["num_samples"] = case.get("samples", NUM_SAMPLES)
    if "clip" in case:
        kwargs["clip"] = case["clip"]
    if "accumulate" in case:
        kwargs["accumulate"] = case["accumulate"]
    if case.get("precision") == "bf16-true":
        kwargs["dtype"] = torch.bfloat16
    with param_groups() if case.get("groups") else contextlib.nullcontext():
        return reference_training(case.get("steps", 3), case["optimizer"], **kwargs)


def assert_sharded(result: dict[str, Any], optimizer: str) -> None:
    assert result["wrapper"] == "ShardedDataParallel"
    # OSS, of a class named after the user's optimizer (what LearningRateMonitor logs: test_sharded_reads.py).
    assert result["is_oss"] and (result["optimizer"], result["shard_optimizer"]) == (optimizer, optimizer)
    assert 0 < result["shard_params"] < result["all_params"] == 16, "rank 0 should own some parameters, not all"
    assert result["unwrapped"], "the strategy should give the plain LightningModule back after fit"


@pytest.mark.parametrize(
    ("name", "optimizer"),
    [("sgd", "SGD"), ("sgd-groups", "SGD"), ("adam-groups-scheduler", "Adam"), ("adamw", "AdamW"), ("buckets", "Adam")],
)
def test_equals_unsharded_training(two_processes: Any, name: str, optimizer: str) -> None:
    result = two_processes[0][name]
    assert_sharded(result, optimizer)
    assert result["global_step"] == 3
    if CASES[name]["optimizer"] == "sgd":
        assert max_difference(result["state_dict"], reference(name)) < ATOL
    else:  # Adam-like: relative to the update (see scenarios.common.ADAM_RTOL)
        assert_adam_close(result["state_dict"], reference(name))


def test_stochastic_weight_averaging_gives_the_weights_of_lightnings_ddp(two_processes: Any) -> None:
    """OSS keeps every parameter whole on every rank, so Lightning's SWA callback works as under plain DDP."""
    sharded, ddp = two_processes[0]["swa"], two_processes[0]["swa-ddp"]
    assert_sharded(sharded, "SGD")
    assert ddp["strategy"] == "DDPStrategy"
    assert sharded["global_step"] == ddp["global_step"] == 6
    assert max_difference(sharded["state_dict"], ddp["state_dict"]) < ATOL
    # The average is not the last weights: SWA did something (plain training of the same 6 steps differs).
    assert max_difference(sharded["state_dict"], reference_training(6, "sgd")) > 100 * ATOL


def test_pruning_gives_the_weights_of_lightnings_ddp(two_processes: Any) -> None:
    sharded, ddp = two_processes[0]["pruning"], two_processes[0]["pruning-ddp"]
    assert_sharded(sharded, "SGD")
    assert ddp["strategy"] == "DDPStrategy"
    assert max_difference(sharded["state_dict"], ddp["state_dict"]) < ATOL
    zeros = sum(int((v == 0).sum()) for k, v in sharded["state_dict"].items() if k.endswith("weight"))
    assert zeros > 0.4 * sum(v.numel() for k, v in sharded["state_dict"].items() if k.endswith("weight"))


def test_pruning_with_the_lottery_ticket_reset_is_refused_before_training() -> None:
    """The reset would detach weights from OSS's buffers (training on with stale weights, 0.26 off, silently)."""
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=DDPShardedStrategy(), callbacks=[ModelPruning("l1_unstructured")],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=1,
    )
    model = common.RegressionModel()
    with pytest.raises(MisconfigurationException, match="use_lottery_ticket_hypothesis=False"):
        trainer.fit(model)
    assert trainer.global_step == 0 and not torch.distributed.is_initialized()


def test_param_groups_change_the_result() -> None:
    """The two param groups' hyperparameters matter, so the equality above shows that OSS kept them."""
    assert max_difference(reference("sgd-groups"), reference("sgd")) > 100 * ATOL


def test_lr_scheduler_follows_the_sharded_optimizer(two_processes: Any) -> None:
    # The schedule itself is checked by the equality with the reference (StepLR, every step).
    assert two_processes[0]["adam-groups-scheduler"]["scheduler_warnings"] == []


@pytest.mark.parametrize("name", ["clip-norm", "clip-value", "accumulate", "accumulate-4-each"])
def test_clipping_and_accumulation_equal_unsharded_training(two_processes: Any, name: str) -> None:
    result = two_processes[0][name]
    assert max_difference(result["state_dict"], reference(name)) < ATOL
    assert max_difference(reference(name), reference("sgd")) > 100 * ATOL  # the feature changed the result


@pytest.mark.parametrize(
    ("name", "scaler", "tolerance"), [("bf16", "NoneType", 2e-3), ("fp16", "ShardedGradScaler", 5e-4)]
)
def test_mixed_precision_runs_on_cpu(two_processes: Any, name: str, scaler: str, tolerance: float) -> None:
    result = two_processes[0][name]
    assert (result["precision_plugin"], result["scaler"]) == ("ShardedMixedPrecisionPlugin", scaler)
    assert result["global_step"] == 3
    difference = max_difference(result["state_dict"], reference(name))
    assert 1e-6 < difference < tolerance  # close to FP32 training, but computed in lower precision


@pytest.mark.parametrize("name", ["true-bf16", "true-bf16-clip"])
def test_true_bf16_equals_unsharded_bf16_training(two_processes: Any, name: str) -> None:
    """Parameters, gradients and OSS's state shard in bf16, within one bf16 spacing of the weights of the same
    training unsharded in bf16 (see ``BF16_ATOL``); clipping by the norm of all shards included."""
    result = two_processes[0][name]
    assert result["precision_plugin"] == "ShardedHalfPrecisionPlugin"
    assert result["dtypes"] == {
        "parameters": {"torch.bfloat16"},
        "optimizer_state": {("momentum_buffer", "torch.bfloat16")},
    }
    assert all(value.dtype == torch.bfloat16 for value in result["state_dict"].values())
    assert max_difference(result["state_dict"], reference(name)) <= BF16_ATOL
    assert max_difference(reference("true-bf16"), reference("true-bf16-clip")) > 10 * BF16_ATOL  # the clip bites


@pytest.mark.parametrize("devices", [2, 1])
def test_resume_is_exact(two_processes: Any, devices: int) -> None:
    results, workdir = two_processes
    resumed = results["resume"] if devices == 2 else run_cases(workdir, ["resume"], devices=1)["resume"]
    assert resumed["global_step"] == 4
    if devices == 2:
        assert max_difference(resumed["state_dict"], results["straight"]["state_dict"]) == 0.0
    else:  # one process sums the gradient in another order, and these are Adam's steps (ADAM_RTOL)
        assert_adam_close(resumed["state_dict"], results["straight"]["state_dict"], what="resumed on one process")


def test_checkpoint_holds_a_plain_optimizer_state(two_processes: Any) -> None:
    results, workdir = two_processes
    # `weights_only=True` unpickles no classes but PyTorch's and builtins: no FairScale object is in the file.
    checkpoint = torch.load(workdir / "checkpoints" / "epoch=1-step=2.ckpt", weights_only=True)
    model = common.RegressionModel()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in checkpoint["state_dict"].items()} == shapes
    (state,) = checkpoint["optimizer_states"]
    matrices, vectors = state["param_groups"]
    assert matrices["weight_decay"] == MATRIX_WEIGHT_DECAY and vectors["weight_decay"] == 0.0
    assert matrices["lr"] == pytest.approx(0.01 * 0.7**2)
    assert vectors["lr"] == pytest.approx(0.01 * VECTOR_LR_FACTOR * 0.7**2)
    with param_groups():
        plain = common.make_optimizer("adam", model.parameters())
    parameters = [p for group in plain.param_groups for p in group["params"]]  # the order of the state's indices
    assert matrices["params"] + vectors["params"] == list(range(len(parameters)))
    assert sorted(state["state"]) == list(range(len(parameters)))  # an entry for every parameter
    for index, parameter in enumerate(parameters):
        assert state["state"][index]["exp_avg"].shape == parameter.shape
        assert float(state["state"][index]["step"]) == 2.0
    plain.load_state_dict(state)  # a plain torch optimizer takes it as it is

    after_fit = torch.load(workdir / "straight-after-fit.ckpt", weights_only=True)
    assert max_difference(after_fit["state_dict"], results["straight"]["state_dict"]) == 0.0
    assert {float(s["step"]) for s in after_fit["optimizer_states"][0]["state"].values()} == {4.0}


def test_a_save_killed_halfway_keeps_the_previous_checkpoint(two_processes: Any) -> None:
    """Rank 0 is SIGKILLed halfway through writing the second last.ckpt: the first one (step 1) stays whole.

    The strategy's default CheckpointIO, ``ShardedCheckpointIO``, writes a hidden ``.last.ckpt.partial`` beside the
    target, flushes it to disk and renames it into place. (Lightning's own ``TorchCheckpointIO`` serializes into
    memory first, which this kill does not reach: the run would finish and the test fail.)
    """
    _, workdir = two_processes
    args = ["--out", str(workdir / "unused.pt"), "--cases", "killed-save", "--workdir", str(workdir)]
    proc = run_script([str(SCRIPT), *args, "--kill-during-save", "2"], cwd=workdir, expect_ok=False)
    assert proc.returncode != 0
    folder = workdir / "last"
    # Killed while writing the new file beside the target, which is untouched.
    assert sorted(p.name for p in folder.iterdir()) == [".last.ckpt.partial", "last.ckpt"]
    last = torch.load(folder / "last.ckpt", weights_only=True)
    assert last["global_step"] == 1
    # The same run without the kill saved the same step-1 checkpoint: "straight" (one file per epoch). It ran in
    # another process, after other cases: CPU kernels may sum in another order there (memory alignment), so the two
    # agree to float rounding (measured: up to 4.7e-10), while a step-2 file differs by a whole update (~1e-2). Adam's
    # first step amplifies a rounding in a gradient at its eps's scale: the update relative to its size (ADAM_RTOL);
    # its first moment is linear in the gradient: within 1e-7.
    first = torch.load(workdir / "checkpoints" / "epoch=0-step=1.ckpt", weights_only=True)
    assert_adam_close(last["state_dict"], first["state_dict"])
    (state,), (expected,) = last["optimizer_states"], first["optimizer_states"]
    for i in expected["state"]:
        assert torch.allclose(state["state"][i]["exp_avg"], expected["state"][i]["exp_avg"], rtol=0, atol=1e-7)


def test_evaluation_after_fit_runs_unwrapped(two_processes: Any) -> None:
    result = two_processes[0]["eval-after-fit"]
    assert result["eval_wrapper"] == "RegressionModel"
    model = common.RegressionModelWrapper(common.build_network())
    model.load_state_dict(result["state_dict"])
    x, y = common.dataset().tensors
    expected = torch.nn.functional.mse_loss(model(x), y).item()
    assert result["validate"][0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["test"][0]["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["predict"].shape == (NUM_SAMPLES // 2, OUT_FEATURES)  # rank 0's half of the samples


@contextlib.contextmanager
def environment_restored() -> Iterator[None]:
    """The spawn launcher sets ``MASTER_PORT`` in this process; later tests must not inherit it."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


#: One step per epoch (every step sees the same global batch): Lightning resumes a checkpoint written after `fit`
#: stopped at the end of an epoch by starting a new epoch at the saved batch index, so with several steps per epoch
#: the resumed steps would see other batches than the uninterrupted run's, under any strategy.
SPAWN_SAMPLES = 8


def spawn_trainer(root: Path, steps: int, checkpoints: bool, strategy: Any = "ddp_sharded_spawn") -> Trainer:
    callbacks: list[Any] = [common.CountTrainBatches()]
    if checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}"))
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2 if strategy == "ddp_sharded_spawn" else 1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=root,
    )


def spawn_model() -> common.RegressionModel:
    return common.RegressionModel(optimizer="adam", scheduler=True, num_samples=SPAWN_SAMPLES)


def spawn_reference(steps: int, start: Any = None) -> dict[str, torch.Tensor]:
    return reference_training(steps, "adam", scheduler=True, num_samples=SPAWN_SAMPLES, start=start)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two fits with ``"ddp_sharded_spawn"`` (2 processes each), each followed by ``trainer.save_checkpoint`` in this,
    the launching process: 2 steps with Lightning's checkpointing on ("full.ckpt"), then a resume from that file to
    step 4 with checkpointing off ("no-optimizer-state.ckpt", and the warnings of that save)."""
    root = tmp_path_factory.mktemp("spawn")
    result: dict[str, Any] = {"root": root}
    with environment_restored():
        first = spawn_trainer(root, steps=2, checkpoints=True)
        assert isinstance(first.strategy, DDPSpawnShardedStrategy)
        model = spawn_model()
        first.fit(model)
        assert first.state.finished
        result["fitted"] = {k: v.clone() for k, v in model.state_dict().items()}
        first.save_checkpoint(root / "full.ckpt")
        first.save_checkpoint(root / "weights.ckpt", weights_only=True)

        resumed = spawn_trainer(root, steps=4, checkpoints=False)
        model = spawn_model()
        resumed.fit(model, ckpt_path=root / "full.ckpt")
        result["resumed"] = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.warns(UserWarning) as caught:
            resumed.save_checkpoint(root / "no-optimizer-state.ckpt")
        result["save_warnings"] = [str(w.message) for w in caught]
    return result


def test_spawn_strategy_trains_in_process(spawned: dict[str, Any]) -> None:
    assert_adam_close(spawned["fitted"], spawn_reference(2))  # rank 0's weights came back


def test_spawn_fit_checkpoint_of_the_launching_process_is_complete(spawned: dict[str, Any]) -> None:
    """The launching process's Trainer never trained, yet its checkpoint holds rank 0's training state at the end
    of fit: the same optimizer and scheduler states as the checkpoint the run wrote at its last step."""
    saved = torch.load(spawned["root"] / "full.ckpt", weights_only=True)
    during = torch.load(spawned["root"] / "checkpoints" / "step=2.ckpt", weights_only=True)
    assert max_difference(saved["state_dict"], spawned["fitted"]) == 0.0
    assert saved["global_step"] == 2 and saved["loops"]["fit_loop"]["epoch_progress"]["total"]["completed"] == 2
    assert saved["callbacks"]["CountTrainBatches"] == {"batches": 2}
    (state,), (expected,) = saved["optimizer_states"], during["optimizer_states"]
    assert sorted(state["state"]) == list(range(16))  # every parameter's, not rank 0's shard only
    for index, entry in expected["state"].items():
        assert {k: float((v - state["state"][index][k]).abs().max()) for k, v in entry.items()} == dict.fromkeys(
            entry, 0.0
        )
    assert saved["lr_schedulers"] == during["lr_schedulers"] and saved["lr_schedulers"][0]["last_epoch"] == 2

    weights_only = torch.load(spawned["root"] / "weights.ckpt", weights_only=True)
    assert "optimizer_states" not in weights_only and weights_only["global_step"] == 2  # the progress only


def test_spawn_fit_checkpoint_of_the_launching_process_resumes_exactly(spawned: dict[str, Any]) -> None:
    uninterrupted = spawn_reference(4)
    assert_adam_close(spawned["resumed"], uninterrupted)
    # A resume with a fresh optimizer state (what Lightning's own "ddp_spawn" does with such a file) ends elsewhere.
    assert max_difference(spawn_reference(2, start=spawn_reference(2)), uninterrupted) > 100 * ATOL


def test_spawn_fit_without_checkpoints_gathers_no_optimizer_state(spawned: dict[str, Any]) -> None:
    """No checkpoint of the resumed run held the optimizer state, so its ranks did not gather it at the end of fit:
    the launching process's checkpoint says so, and holds the weights and the progress."""
    (warning,) = [w for w in spawned["save_warnings"] if "no optimizer state" in w]
    assert "DDPSpawnShardedStrategy" in warning and "enable_checkpointing=True" in warning
    saved = torch.load(spawned["root"] / "no-optimizer-state.ckpt", weights_only=True)
    assert (saved["optimizer_states"], saved["lr_schedulers"]) == ([], [])
    assert saved["global_step"] == 4 and saved["callbacks"]["CountTrainBatches"] == {"batches": 4}
    assert max_difference(saved["state_dict"], spawned["resumed"]) == 0.0


def test_a_checkpoint_without_optimizer_state_resumes_with_a_fresh_one(spawned: dict[str, Any]) -> None:
    """Resumed (in this process, one rank) with a warning instead of an error: training goes on from step 4 with the
    checkpoint's weights, a fresh Adam and a fresh LR schedule."""
    path = spawned["root"] / "no-optimizer-state.ckpt"
    with environment_restored():
        trainer = spawn_trainer(spawned["root"] / "one-rank", steps=6, checkpoints=False, strategy=DDPShardedStrategy())
        model = spawn_model()
        try:
            with pytest.warns(UserWarning, match="holds no optimizer state.*fresh optimizer state"):
                trainer.fit(model, ckpt_path=path)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    assert trainer.global_step == 6
    start = torch.load(path, weights_only=True)["state_dict"]
    # One process sums the gradient in another order, and a fresh Adam's first step is its most sensitive one.
    assert_adam_close(model.state_dict(), spawn_reference(2, start=start), start)
    assert max_difference(model.state_dict(), spawn_reference(6)) > 100 * ATOL  # not the uninterrupted training


@pytest.mark.parametrize(
    ("kwargs", "gathers"),
    [
        ({}, True),  # Lightning's default ModelCheckpoint
        ({"enable_checkpointing": False}, False),
        ({"callbacks": [ModelCheckpoint(save_weights_only=True)]}, False),
    ],
)
def test_a_spawned_fit_gathers_the_optimizer_state_at_its_end_only_if_its_checkpoints_do(
    kwargs: dict[str, Any], gathers: bool
) -> None:
    trainer = Trainer(strategy="ddp_sharded_spawn", accelerator="cpu", devices=2, logger=False, **kwargs)
    assert writes_optimizer_states(trainer) is gathers


@pytest.mark.parametrize("strategy", ["ddp_sharded_spawn", DDPShardedStrategy(start_method="fork")])
def test_processes_started_after_fit_get_no_end_of_fit_state(strategy: Any) -> None:
    """``validate`` or ``test`` after a spawned ``fit`` pickle the launcher into new processes: without the state."""
    launcher = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False).strategy.launcher
    assert isinstance(launcher, SpawnLauncher)
    launcher.end_of_fit = EndOfFit({"global_step": 2}, optimizer_state_left_out=False)
    assert pickle.loads(pickle.dumps(launcher)).end_of_fit is None
    assert launcher.end_of_fit is not None


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("ddp_sharded", DDPShardedStrategy),
        ("ddp_sharded_find_unused_parameters_false", DDPShardedStrategy),
        ("ddp_sharded_spawn", DDPSpawnShardedStrategy),
    ],
)
def test_registry_names_select_the_strategy(name: str, cls: type) -> None:
    # Not `name in StrategyRegistry`, which the Trainer below checks by itself: what the name selects, and with which
    # arguments, registered by `register_strategies` on any registry, twice without an "already present" error.
    fresh = _StrategyRegistry()
    for _ in range(2):
        cls.register_strategies(fresh)
    assert fresh[name]["strategy"] is cls and fresh[name]["init_params"] == {"find_unused_parameters": False}
    assert StrategyRegistry[name]["strategy"] is cls  # done by `import lightning_fairscale`
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is cls
    assert trainer.strategy._start_method == ("spawn" if "spawn" in name else "popen")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"find_unused_parameters": True}, ValueError, "ddp_find_unused_parameters_true"),
        ({"reduce_buffer_size": -1}, ValueError, "reduce_buffer_size"),
        ({"reduce_buffer_size": "8M"}, ValueError, "reduce_buffer_size"),
        ({"sharded_optimizer": None}, TypeError, "configure_optimizers"),
        ({"process_group": None}, TypeError, "process group"),
        ({"ddp_comm_hook": print}, TypeError, "unexpected argument `ddp_comm_hook`.*reduce_buffer_size"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DDPShardedStrategy(**kwargs)


def test_lightnings_own_defaults_through_kwargs_are_accepted() -> None:
    """LightningCLI passes ``DDPStrategy``'s own arguments at their defaults through ``**kwargs``: nothing chosen,
    nothing lost; another value is refused (above)."""
    strategy = DDPShardedStrategy(ddp_comm_hook=None, ddp_comm_state=None, model_averaging_period=None)
    assert strategy.config.fairscale_kwargs == {}


def test_multi_node_defaults_bucket_gradients_and_broadcast_fp16() -> None:
    strategy = DDPShardedStrategy()
    assert (strategy.reduce_buffer_size, strategy.broadcast_fp16) == (0, False)
    strategy.num_nodes = 2
    assert (strategy.reduce_buffer_size, strategy.broadcast_fp16) == (2**23, False)
    strategy.precision_plugin = ShardedMixedPrecisionPlugin("16-mixed", "cpu")
    assert strategy.broadcast_fp16
    explicit = DDPShardedStrategy(reduce_buffer_size=0)
    explicit.num_nodes = 2
    assert explicit.sharded_ddp_kwargs() == {"reduce_buffer_size": 0}


def test_spawn_strategy_refuses_popen() -> None:
    with pytest.raises(ValueError, match="DDPShardedStrategy"):
        DDPSpawnShardedStrategy(start_method="popen")


def test_unsupported_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="'32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true'"):
        Trainer(strategy="ddp_sharded", accelerator="cpu", devices=2, precision="64-true", logger=False)


def test_plain_grad_scaler_is_refused() -> None:
    with pytest.raises(TypeError, match="sharded grad scaler"):
        ShardedMixedPrecisionPlugin("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


class NeedsAModel(torch.optim.SGD):
    def __init__(self, params: Any, model: torch.nn.Module, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)


def test_optimizer_that_cannot_be_rebuilt_is_refused() -> None:
    network = common.build_network()
    with pytest.raises(TypeError, match="cannot shard NeedsAModel.*fairscale.optim.OSS"):
        shard_optimizer(NeedsAModel(network.parameters(), network))  # refused before any collective call


def test_checkpoint_with_other_optimizers_is_refused() -> None:
    strategy = DDPShardedStrategy()
    strategy.optimizers = [torch.optim.SGD(common.build_network().parameters(), lr=0.1)]
    with pytest.raises(ValueError, match="holds 2 optimizer states"):
        strategy.load_optimizer_state_dict({"optimizer_states": [{}, {}]})
