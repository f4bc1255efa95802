"""The Fabric strategies (``lightning_fairscale.fabric``): Fabric loops on 2 CPU processes against unsharded training,
``fabric.save``/``fabric.load`` in both formats, and checkpoints shared with the Trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.fabric as unified_fabric
import lightning_fabric
import pytest
import torch
from scenarios.common import (
    BF16_ATOL,
    assert_adam_close,
    BLOCK_UNITS_ORDER,
    PARTIAL_GONE,
    PARTIAL_NEW,
    PartialWrapper,
    RegressionModelWrapper,
    after_partial_load,
    build_network,
    materialized_start,
    max_difference,
    reference_training,
)
from scenarios.config import FabricScenario, Kill, Scenario

import lightning_fairscale
import lightning_fairscale.fabric as ours
import lightning_fairscale.lightning.fabric as ours_unified
from conftest import TESTS, Jobs, command, run_jobs, run_script
from lightning_fairscale.plugins.checkpoint_io import META_FILE, shard_file_name
from lightning_fairscale.checkpoint.fabric import Roles, restore
from lightning_fairscale.checkpoint.files import FABRIC_RECORD, FORMAT_KEY
from lightning_fairscale.mixed_precision.grad_scaler import ShardedGradScaler

FABRIC_SCRIPT = TESTS / "scenarios" / "fabric_train.py"
#: SGD's comparisons: every weight within 1e-5 of unsharded training (SGD's step is linear in the gradient). The loop's
#: Adam ones (``reference``: 2 micro-batches a step, clipped) compare the whole update relative to its size
#: (``assert_adam_close``): Adam amplifies the float differences between one batch and two half-batches, to 1.25e-5
#: here and to 1.6e-4 in other summation orders (another CPU's), where 5e-5 on every weight held on one machine only.
ATOL = 1e-5
LOOP = {"accumulate": 2, "clip_norm": 0.05, "samples": 16}  # two micro-batches a step; clipping bites
#: FSDP with each Block its own unit, recomputing its activations in backward.
BLOCKS = {"strategy": "fsdp", "policy": "blocks", "checkpointing": True}


#: AdamW with decay on weights only (param groups that split every unit of the size policy), and frozen weights in
#: units that also train (the first layer's, and a Block's).
FROZEN = ("net.0.weight", "net.1.up.weight")
RECIPE = {"strategy": "fsdp", "policy": "size", "optimizer": "adamw", "params": "split", "freeze": FROZEN}


def reference(steps: int) -> dict[str, torch.Tensor]:
    return reference_training(steps, "adam", accumulate=2, clip=(0.05, "norm"))


def fabric_run(
    folder: Path, config: FabricScenario, package: str = "pytorch_lightning", ranks: int = 2
) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "out.pt"
    run_script(command(config, out, FABRIC_SCRIPT), cwd=folder, package=package, ranks=ranks)
    return torch.load(out, weights_only=False)


#: True half precision: FSDP with Adam (saved at step 2 and resumed, as the "fsdp" job), and with SGD against the
#: unsharded bf16 reference (see ``BF16_ATOL``; the model made in `fabric.init_module()`, each Block wrapped there);
#: sharded DDP with SGD; fp16 with SGD on one batch (the loss falls).
TRUE_HALF = {
    "true-bf16": FabricScenario(**LOOP, **BLOCKS, precision="bf16-true", steps=4, save_at=2),
    "true-bf16-sgd": FabricScenario(
        **LOOP, **BLOCKS, precision="bf16-true", optimizer="sgd", steps=4, init_module=True
    ),
    "true-bf16-ddp-sharded": FabricScenario(
        **LOOP, strategy="sharded", precision="bf16-true", optimizer="sgd", steps=4
    ),
    "true-16": FabricScenario(**BLOCKS, precision="16-true", optimizer="sgd", samples=8, steps=6),
}
MIXED = [
    ("fsdp", "bf16-mixed", "bfloat16"),
    ("ddp_sharded", "bf16-mixed", "bfloat16"),
    ("fsdp", "plugin-16-mixed", "float16"),  # Fabric maps the "16-mixed" flag to bf16 on CPUs
]


#: ``fabric.init_module(empty_init=True)``: auto wrap (each Block a unit; the optimizer made over the meta parameters,
#: then ``fabric.setup(model, optimizer)``), or the Blocks wrapped by hand in the context (optimizer made after).
EMPTY_INIT = {  # name -> the scenario's fields
    "auto": {"strategy": "fsdp", "policy": "blocks"},
    "manual": {"strategy": "fsdp_fairscale", "init_module": True, "setup": "after"},
}
#: A plain state dict of the old model, for `fabric.load_raw` (values no training gives).
RAW = {key: value * 0.5 for key, value in RegressionModelWrapper(build_network()).state_dict().items()}


#: The job of :func:`runs` whose rank 0 is killed (SIGKILL) halfway through a save: the last of the launch.
KILLED = "killed-save-ddp_sharded"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """The loops on 2 processes, in one launch. ``fsdp``: FSDP (each Block a unit, activation checkpointing), 4 steps,
    checkpoints of step 2 in both formats, resumed in the same processes into models set up otherwise (optimizer made
    after `setup_module`; made first, then set up separately). ``mixed-*``: 2 steps in a lower precision. The last
    job's rank 0 is killed while it saves (:data:`KILLED`)."""
    folder = tmp_path_factory.mktemp("fabric")
    (folder / "ck").mkdir()
    torch.save(RAW, folder / "ck" / "raw.pt")
    partial = {"optimizer": "plain_sgd", "partial_from": str(folder / "ck")}
    jobs = {
        "fsdp": FabricScenario(**LOOP, **BLOCKS, steps=4, save_at=2, save_dir=str(folder / "ck"),
                               resume_setup=("after", "separate")),
        **{f"mixed-{s}-{p}": FabricScenario(**LOOP, strategy=s, steps=2, precision=p) for s, p, _ in MIXED},
        "recipe": FabricScenario(**LOOP, **RECIPE, steps=4, save_at=2, save_dir=str(folder / "ck-recipe"),
                                 resume_setup=("separate", "joint")),
        **{f"empty-init-{name}": FabricScenario(**LOOP, **fields, empty_init=True, steps=2)
           for name, fields in EMPTY_INIT.items()},
        # Models whose code changed load the old model's files of the "fsdp" job (and raw.pt), strict=False/True.
        "partial": FabricScenario(**BLOCKS, **partial),
        **{f"partial-strict-{kind}": FabricScenario(**BLOCKS, **partial, partial_kinds=(kind,), strict=True)
           for kind in ("full", "sharded", "raw")},
        "partial-ddp_sharded": FabricScenario(strategy="sharded", **partial, partial_kinds=("full", "raw")),
        **TRUE_HALF,
        # Checkpoints written in the background (both formats), loaded while training goes on.
        "fsdp-async": FabricScenario(**LOOP, **BLOCKS, steps=4, save_at=2, save_dir=str(folder / "ck-async"),
                                     async_save=True),
        "sharded-async": FabricScenario(**LOOP, strategy="sharded", steps=4, save_at=2, async_save=True,
                                        save_dir=str(folder / "ck-async-sharded")),
        **{f"accumulate-{strategy}-{mode}": FabricScenario(
            strategy=strategy, policy="blocks", optimizer="sgd", accumulate=4, samples=32, steps=2,
            sync_each_batch=mode == "each") for strategy in ("fsdp", "sharded") for mode in ("no_sync", "each")},
    }  # fmt: skip
    jobs["true-bf16"] = jobs["true-bf16"].replace(save_dir=str(folder / "ck-bf16"), resume_setup=("after", "separate"))
    # Last, as it ends the launch: rank 0 dies halfway through writing the second last.ckpt.
    jobs[KILLED] = FabricScenario(**LOOP, strategy="ddp_sharded", steps=2, save_last=True,
                                  save_dir=str(folder / "ck-killed"), kill=Kill(2, rank=0))
    failing = [name for name in jobs if name.startswith("partial-strict")]
    return run_jobs(folder, jobs, failing=failing, script=FABRIC_SCRIPT, killed=KILLED)


@pytest.mark.parametrize("strategy", ["fsdp", "sharded"])
def test_accumulation_in_both_modes_equals_unsharded_and_each_batch_holds_the_shard(runs: Jobs, strategy: str) -> None:
    expected = reference_training(2, "sgd", accumulate=4, num_samples=32)
    no_sync, each = runs[f"accumulate-{strategy}-no_sync"], runs[f"accumulate-{strategy}-each"]
    for result in (no_sync, each):
        assert max_difference(result["final"], expected) < ATOL
    # Between micro-batches (3 per step, 2 steps): the full gradient under no_backward_sync; with
    # `sync_each_batch=True` it skips nothing and a rank holds its shard (FSDP's, padded) or its owned gradients.
    full = no_sync["held_gradients"][0]
    assert no_sync["held_gradients"] == [full] * 6
    assert len(set(each["held_gradients"])) == 1
    held = each["held_gradients"][0]
    assert full / 2 <= held <= full / 2 + 8 if strategy == "fsdp" else 0 < held < full


@pytest.fixture(scope="module")
def fsdp_run(runs: Jobs) -> dict[str, Any]:
    return {**runs["fsdp"], "checkpoints": runs.folder / "ck"}


def test_fsdp_loop_equals_unsharded_training(fsdp_run: dict[str, Any]) -> None:
    assert fsdp_run["strategy"] == "lightning_fairscale.fabric.fully_sharded.DDPFullyShardedStrategy"
    assert (fsdp_run["world_size"], fsdp_run["units"]) == (2, 3)  # each Block, plus the root
    assert fsdp_run["block_calls"] == 2 * 2 * 4  # forward and recomputation, 2 micro-batches, 4 steps
    assert all(norm > 0.05 for norm in fsdp_run["norms"])  # every step was clipped
    assert_adam_close(fsdp_run["final"], reference(4))
    # Loaded half-way into fresh models and optimizers, set up in other ways, training continues exactly.
    assert max_difference(fsdp_run["resumed"]["full"], fsdp_run["final"]) == 0.0
    assert max_difference(fsdp_run["resumed"]["sharded"], fsdp_run["final"]) == 0.0


def test_a_filtered_sharded_checkpoint_loads_what_it_kept(fsdp_run: dict[str, Any]) -> None:
    """Issue 48 item 3c on 2 processes: `fabric.save(..., filter={"model": ...})` of a sharded model writes the keys
    kept (the first block's), and a fresh model loading it with `strict=False` takes exactly those; its other
    entries keep their initial values."""
    full = torch.load(fsdp_run["checkpoints"] / "full.ckpt", weights_only=True)["model"]
    kept = sorted(key for key in full if key.startswith("net.1."))
    meta = torch.load(fsdp_run["checkpoints"] / "filtered.ckpt" / META_FILE, weights_only=True)
    assert kept and sorted(meta[FORMAT_KEY][FABRIC_RECORD]["kept"]) == kept
    loaded, initial = fsdp_run["filtered_loaded"], reference_training(0)
    assert max_difference({k: loaded[k] for k in kept}, {k: full[k] for k in kept}) == 0.0
    rest = [key for key in full if key not in kept]
    assert max_difference({k: loaded[k] for k in rest}, {k: initial[k] for k in rest}) == 0.0
    assert max_difference({k: full[k] for k in kept}, {k: initial[k] for k in kept}) > 1e-3  # it did train


def test_the_recipe_equals_unsharded_training_and_resumes_exactly(runs: Jobs) -> None:
    result = runs["recipe"]
    expected = reference_training(4, "adamw", accumulate=2, clip=(0.05, "norm"), freeze=FROZEN, params="split")
    assert_adam_close(result["final"], expected)
    initial = reference_training(0)
    assert all(torch.equal(result["final"][name], initial[name]) for name in FROZEN)
    assert max_difference(result["resumed"]["full"], result["final"]) == 0.0
    assert max_difference(result["resumed"]["sharded"], result["final"]) == 0.0


@pytest.mark.parametrize("name", ["fsdp-async", "sharded-async"])
def test_checkpoints_written_in_the_background_resume_exactly(runs: Jobs, name: str) -> None:
    result = runs[name]
    assert_adam_close(result["final"], reference(4))
    assert all(max_difference(resumed, result["final"]) == 0.0 for resumed in result["resumed"].values())
    assert sorted(result["resumed"]) == (["full", "sharded"] if name == "fsdp-async" else ["full"])


@pytest.mark.parametrize("name", EMPTY_INIT)
def test_model_built_in_empty_init_is_initialised_as_sharded_and_trains_exactly(runs: Jobs, name: str) -> None:
    """Each unit is materialised and initialised (``reset_parameters()``) when it is sharded: the Blocks first, then
    the root's layers. The reference starts from the weights that gives on one process."""
    result = runs[f"empty-init-{name}"]
    assert (result["world_size"], result["units"]) == (2, 3)
    start = materialized_start(BLOCK_UNITS_ORDER)
    expected = reference_training(2, "adam", accumulate=2, clip=(0.05, "norm"), start=start)
    assert_adam_close(result["final"], expected, start)
    assert max_difference(start, RegressionModelWrapper(build_network()).state_dict()) > 0.1  # not the eager init


def test_fabric_checkpoints_hold_the_states_under_their_keys(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    """As Lightning's Fabric writes them: `torch.load(path)["model"]` is the full state dict."""
    full = torch.load(fsdp_run["checkpoints"] / "full.ckpt", weights_only=True)
    assert list(full) == ["model", "optimizer", "step"] and full["step"] == 2
    plain = RegressionModelWrapper(build_network())
    assert set(full["model"]) == set(plain.state_dict())  # the unwrapped module's keys
    assert_adam_close(full["model"], reference(2))  # gathered whole: unsharded training's step 2
    # A plain Adam's state over `model.parameters()`, in that order.
    assert full["optimizer"]["param_groups"][0]["params"] == list(range(len(list(plain.parameters()))))
    assert [entry["exp_avg"].shape for entry in full["optimizer"]["state"].values()] == [
        p.shape for p in plain.parameters()
    ]
    sharded = fsdp_run["checkpoints"] / "sharded.ckpt"
    assert sorted(p.name for p in sharded.iterdir()) == [META_FILE, shard_file_name(0, 2), shard_file_name(1, 2)]
    meta = torch.load(sharded / META_FILE, weights_only=True)  # the state's other entries, and which were which
    assert sorted(meta) == [FORMAT_KEY, "step"] and meta["step"] == 2
    assert meta[FORMAT_KEY][FABRIC_RECORD] == {"model": "model", "optimizers": ["optimizer"]}
    # The consolidation tool turns the sharded checkpoint into the full one, bit for bit, in Fabric's layout.
    tool = Path(sys.executable).parent / "lightning-fairscale-consolidate"
    subprocess.run([str(tool), str(sharded), str(tmp_path / "c.ckpt")], check=True, capture_output=True, timeout=120)
    consolidated = torch.load(tmp_path / "c.ckpt", weights_only=True)
    assert consolidated.keys() == full.keys()
    assert max_difference(consolidated["model"], full["model"]) == 0.0
    for index, entry in full["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(consolidated["optimizer"]["state"][index][key]), value)


def _assert_partial_loads(result: dict[str, Any], saved: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each model whose code changed took the shared entries of the file it loaded (``saved``, by kind), kept its new
    layer as initialized, and trains from there as plain training does."""
    assert sorted(result["partial"]) == sorted(saved)
    for kind, states in result["partial"].items():
        assert max_difference(states["loaded"], after_partial_load(saved[kind])) == 0.0, kind
        expected = reference_training(1, "plain_sgd", start=states["loaded"], model=PartialWrapper())
        assert max_difference(states["trained"], expected) < 1e-5, kind
        assert max_difference(states["trained"], states["loaded"]) > 1e-3, kind


def test_a_changed_model_loads_partially_with_strict_false(runs: Jobs, fsdp_run: dict[str, Any]) -> None:
    """`fabric.load(path, {"model": model}, strict=False)` of a full and a sharded checkpoint, `fabric.load_raw` of
    a plain state dict and of a sharded checkpoint, into a model with a layer more and one less."""
    full = torch.load(fsdp_run["checkpoints"] / "full.ckpt", weights_only=True)["model"]  # = sharded.ckpt's
    _assert_partial_loads(runs["partial"], {"full": full, "sharded": full, "raw": RAW, "raw-sharded": full})
    output = runs.output("partial")  # the warning names what did not fit (once: Python shows a warning once)
    assert "strict loading off" in output and all(key in output for key in [*PARTIAL_NEW, *PARTIAL_GONE])
    for kind in ("full", "sharded", "raw"):
        for error in runs.errors(f"partial-strict-{kind}"):
            message = error["message"]
            assert "missing keys [extra.weight, extra.bias]" in message, error["traceback"][-3000:]
            assert "unexpected keys [net.1.norm.weight, net.1.norm.bias]" in message
            assert "pass `strict=False`" in message


def test_a_sharded_ddp_save_killed_midway_keeps_the_previous_checkpoint(runs: Jobs) -> None:
    """`Fabric(strategy="ddp_sharded")` saves last.ckpt after every step; rank 0 is SIGKILLed halfway through writing
    the second: the first (step 1) stays whole at that path and loads.

    The strategy's default CheckpointIO, ``ShardedCheckpointIO``, writes a hidden ``.last.ckpt.partial`` beside the
    target, flushes it to disk and renames it into place. (Lightning's ``TorchCheckpointIO`` serializes into memory
    first, which this kill does not reach: the launch would finish and the test fail.)
    """
    assert runs.proc.returncode != 0 and not (runs.folder / f"{KILLED}.pt").exists(), runs.output(KILLED)[-3000:]
    folder = runs.folder / "ck-killed"
    # Killed while writing the new file beside the target, which is untouched.
    assert sorted(p.name for p in folder.iterdir()) == [".last.ckpt.partial", "last.ckpt"]
    last = torch.load(folder / "last.ckpt", weights_only=True)
    assert list(last) == ["model", "optimizer", "step"] and last["step"] == 1
    assert_adam_close(last["model"], reference(1))
    assert {float(entry["step"]) for entry in last["optimizer"]["state"].values()} == {1.0}
    assert len(last["optimizer"]["state"]) == len(list(build_network().parameters()))  # consolidated: every one


def test_sharded_ddp_loads_partially_as_fabrics_ddp(runs: Jobs, fsdp_run: dict[str, Any]) -> None:
    full = torch.load(fsdp_run["checkpoints"] / "full.ckpt", weights_only=True)["model"]
    result = runs["partial-ddp_sharded"]
    assert result["strategy"] == "DDPShardedStrategy"
    _assert_partial_loads(result, {"full": full, "raw": RAW})


def test_sharded_checkpoint_resumes_on_another_number_of_processes(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    sharded = fsdp_run["checkpoints"] / "sharded.ckpt"
    result = fabric_run(
        tmp_path, FabricScenario(**LOOP, **BLOCKS, devices=1, load=str(sharded), load_step=2, steps=4), ranks=1
    )
    assert result["world_size"] == 1
    assert_adam_close(result["final"], reference(4))
    assert_adam_close(result["final"], fsdp_run["final"])


def test_checkpoints_go_from_fabric_to_the_trainer_and_back(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    """Fabric's checkpoints of step 2 resume in the Trainer (2 more steps; its step counter starts anew: the files
    have no loop state): the full one into other units and into `"ddp_sharded"`, the sharded one into the same units
    (sharded checkpoints need them). The Trainer's checkpoints of step 4, full and sharded, then resume in Fabric (2
    more; the full one with the strategy chosen by its registry name and the model built in `fabric.init_module()`,
    Blocks wrapped there). The Trainer's rest (loops, hyperparameters...) comes back from `fabric.load`."""
    saved, trainer_ckpts = fsdp_run["checkpoints"], tmp_path / "trainer-ck"
    steps = Scenario(steps=2, accumulate=2, clip=(0.05, "norm"))
    trainer = run_jobs(tmp_path / "trainer", {
        "full": steps.replace(ckpt_path=str(saved / "full.ckpt"), checkpoint_dir=str(trainer_ckpts / "full")),
        "sharded": steps.replace(ckpt_path=str(saved / "sharded.ckpt"), policy="blocks", checkpointing=True,
                                 state_dict_type="sharded", checkpoint_dir=str(trainer_ckpts / "sharded")),
        "ddp_sharded": steps.replace(ckpt_path=str(saved / "full.ckpt"), strategy_name="ddp_sharded"),
    })  # fmt: skip
    assert trainer["ddp_sharded"]["strategy"] == "DDPShardedStrategy"
    for kind in ("full", "sharded", "ddp_sharded"):
        assert trainer[kind]["global_step"] == 2, kind
        assert_adam_close(trainer[kind]["state_dict"], reference(4), what=kind)
    resume = FabricScenario(**LOOP, load_step=4, steps=6)
    fabric = run_jobs(tmp_path / "fabric", {
        "full": resume.replace(load=str(trainer_ckpts / "full" / "epoch=1-step=2.ckpt"), strategy="fsdp_fairscale",
                               init_module=True),
        "sharded": resume.replace(load=str(trainer_ckpts / "sharded" / "epoch=1-step=2.ckpt"), **BLOCKS),
    }, script=FABRIC_SCRIPT)  # fmt: skip
    assert fabric["full"]["strategy"] == "lightning_fairscale.fabric.fully_sharded.DDPFullyShardedStrategy"
    for kind in ("full", "sharded"):
        result = fabric[kind]
        assert result["units"] == 3, kind  # each Block, and the root
        assert_adam_close(result["final"], reference(6), what=kind)
        assert {"loops", "global_step", "hyper_parameters"} <= set(result["remainder"]), kind


def test_sharded_ddp_loop_with_lightning_fabric(tmp_path: Path) -> None:
    """`lightning.fabric.Fabric(strategy="ddp_sharded")`: the unified package's classes, the same checkpoints."""
    folder = tmp_path / "ck"
    result = fabric_run(
        tmp_path, FabricScenario(**LOOP, strategy="ddp_sharded", steps=4, save_at=2, save_dir=str(folder)),
        package="lightning",
    )
    assert result["strategy"] == "lightning_fairscale.lightning.fabric.sharded.DDPShardedStrategy"
    assert all(norm > 0.05 for norm in result["norms"])
    assert_adam_close(result["final"], reference(4))
    assert max_difference(result["resumed"]["full"], result["final"]) == 0.0
    full = torch.load(folder / "full.ckpt", weights_only=True)  # Fabric's keys: the model's full state dict
    assert list(full) == ["model", "optimizer", "step"]
    assert set(full["model"]) == set(RegressionModelWrapper(build_network()).state_dict())
    assert_adam_close(full["model"], reference(2))
    assert len(full["optimizer"]["state"]) == 16  # consolidated: every parameter's state


def test_sharded_ddp_spawn_loop_clipping_by_value(tmp_path: Path) -> None:
    """`"ddp_sharded_spawn"`: the strategy is pickled into processes started by multiprocessing."""
    # SGD, as the Trainer's test of clipping by value: Adam would magnify the float differences at the clip bound.
    result = fabric_run(
        tmp_path,
        FabricScenario(accumulate=2, clip_val=0.002, strategy="ddp_sharded_spawn", steps=2, optimizer="sgd"),
        ranks=1,
    )
    assert result["strategy"] == "lightning_fairscale.fabric.sharded.DDPSpawnShardedStrategy"
    expected = reference_training(2, "sgd", accumulate=2, clip=(0.002, "value"))
    assert max_difference(result["final"], expected) < 1e-5
    assert max_difference(expected, reference_training(2, "sgd", accumulate=2)) > 100 * 1e-5  # the clip value bites


@pytest.mark.parametrize(("strategy", "precision", "dtype"), MIXED)
def test_mixed_precision_computes_in_the_low_precision(
    runs: Jobs, fsdp_run: dict[str, Any], strategy: str, precision: str, dtype: str
) -> None:
    result = runs[f"mixed-{strategy}-{precision}"]
    # FSDP gathers low-precision copies of its FP32 shards; sharded DDP keeps FP32 weights and autocasts.
    weights = f"torch.{dtype}" if strategy == "fsdp" else "torch.float32"
    assert result["compute"] == {(weights, f"torch.{dtype}")}
    # Clipping sees unscaled gradients: the first step's norm is FP32 training's, not 65536 times it (fp16).
    assert abs(result["norms"][0] - fsdp_run["norms"][0]) < 0.05 * fsdp_run["norms"][0]
    assert all(value.dtype == torch.float32 for value in result["final"].values())  # FP32 master weights
    # Adam moves almost every weight by ~lr a step, and low precision flips the sign of some tiny gradients: the
    # result differs from FP32 training by far less than training moved the weights, on average.
    expected, initial = reference(2), RegressionModelWrapper(build_network()).state_dict()
    assert _mean_difference(result["final"], expected) < 0.1 * _mean_difference(initial, expected)


def test_true_bf16_fsdp_loop_holds_bf16_in_half_the_memory(runs: Jobs, fsdp_run: dict[str, Any]) -> None:
    result = runs["true-bf16"]
    assert result["compute"] == {("torch.bfloat16", "torch.bfloat16")}
    assert result["parameters"] == result["gradients"] == {"torch.bfloat16"}
    assert result["optimizer_state"] == {("exp_avg", "torch.bfloat16"), ("exp_avg_sq", "torch.bfloat16"),
                                         ("step", "torch.float32")}
    assert result["losses"][-1] < result["losses"][0] / 2, result["losses"]
    # The "fsdp" job trains the same model, units and Adam in "32-true": half the bytes, but for Adam's step counters
    # (one 4-byte scalar per original parameter this rank holds a view of): 2 x half - full is their bytes exactly.
    full, half = fsdp_run["memory"], result["memory"]
    assert half["memory/parameters_bytes"] == full["memory/parameters_bytes"] / 2
    counters = 2 * half["memory/optimizer_state_bytes"] - full["memory/optimizer_state_bytes"]
    assert counters % 4 == 0 and 0 < counters <= 4 * len(list(build_network().parameters())), counters
    # Checkpoints of step 2 in both formats hold bf16 tensors, and resume exactly.
    checkpoints = runs.folder / "ck-bf16"
    full_checkpoint = torch.load(checkpoints / "full.ckpt", weights_only=True)
    assert {v.dtype for v in full_checkpoint["model"].values()} == {torch.bfloat16}
    moments = [v for state in full_checkpoint["optimizer"]["state"].values() for k, v in state.items() if k != "step"]
    assert moments and {v.dtype for v in moments} == {torch.bfloat16}
    for path in (checkpoints / "sharded.ckpt").iterdir():
        shard = torch.load(path, weights_only=False)
        assert {v.dtype for v in shard.get("state_dict", {}).values()} <= {torch.bfloat16}, path
    assert all(v.dtype == torch.bfloat16 for v in result["final"].values())
    assert max_difference(result["resumed"]["full"], result["final"]) == 0.0
    assert max_difference(result["resumed"]["sharded"], result["final"]) == 0.0


@pytest.mark.parametrize("name", ["true-bf16-sgd", "true-bf16-ddp-sharded"])
def test_true_bf16_loop_equals_unsharded_bf16_training(runs: Jobs, name: str) -> None:
    """Within one bf16 spacing of the weights (``BF16_ATOL``) of the loop unsharded in bf16: the model and its input
    in bf16, its output back in FP32 for the loss (Fabric's ``HalfPrecision``), clipped by the norm of all shards."""
    result = runs[name]
    assert result["parameters"] == result["gradients"] == {"torch.bfloat16"}
    assert result["optimizer_state"] == {("momentum_buffer", "torch.bfloat16")}
    if name == "true-bf16-sgd":  # `fabric.init_module()` made the layers in bf16, and their Blocks units
        assert (result["created"], result["units"]) == ({"torch.bfloat16"}, 3)
    expected = reference_training(4, "sgd", accumulate=2, clip=(0.05, "norm"), dtype=torch.bfloat16,
                                  output_to_fp32=True, made_in_dtype=name == "true-bf16-sgd")
    assert max_difference(result["final"], expected) <= BF16_ATOL


def test_true_fp16_fsdp_loop_trains_in_fp16(runs: Jobs) -> None:
    result = runs["true-16"]
    assert result["compute"] == {("torch.float16", "torch.float16")}
    assert result["parameters"] == result["gradients"] == {"torch.float16"}
    assert result["optimizer_state"] == {("momentum_buffer", "torch.float16")}
    assert all(v.dtype == torch.float16 for v in result["final"].values())
    assert result["losses"][-1] < result["losses"][0] / 2, result["losses"]


def _mean_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return torch.cat([(a[key].float() - b[key].float()).abs().flatten() for key in b]).mean().item()


# ------------------------------------------------------------------------------------------------------------------
# Without processes


NAMES = {
    "fsdp_fairscale": "DDPFullyShardedStrategy",
    "ddp_fully_sharded": "DDPFullyShardedStrategy",
    "ddp_sharded": "DDPShardedStrategy",
    "ddp_sharded_spawn": "DDPSpawnShardedStrategy",
}


@pytest.mark.parametrize("package", ["lightning_fabric", "lightning"])
@pytest.mark.parametrize("name", list(NAMES))
def test_registry_names_reach_either_fabric(package: str, name: str) -> None:
    packages = {
        "lightning_fabric": (lightning_fabric, ours, lightning_fairscale),
        "lightning": (unified_fabric, ours_unified, lightning_fairscale.lightning),
    }
    fabric_module, classes, package_classes = packages[package]
    fabric = fabric_module.Fabric(accelerator="cpu", devices=2, strategy=name)
    assert type(fabric.strategy) is getattr(classes, NAMES[name])
    assert type(fabric.strategy.checkpoint_io) is package_classes.ShardedCheckpointIO  # atomic saves by default
    assert fabric_module.strategies.STRATEGY_REGISTRY["fsdp"]["strategy"] is fabric_module.strategies.FSDPStrategy


def test_constructor_takes_the_trainers_arguments_and_checks_them() -> None:
    strategy = ours.DDPFullyShardedStrategy(min_num_params=1e6, cpu_offload=True, verbose=True)
    assert (strategy.min_num_params, strategy.cpu_offload) == (1_000_000, True)
    assert strategy.config.fairscale_kwargs == {"verbose": True}
    with pytest.raises(TypeError, match="unexpected argument `not_an_argument`"):
        ours.DDPFullyShardedStrategy(not_an_argument=1)
    with pytest.raises(ValueError, match="ddp_find_unused_parameters_true"):
        ours.DDPShardedStrategy(find_unused_parameters=True)


def test_precision_flags() -> None:
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy="fsdp_fairscale", precision="bf16-mixed")
    assert fabric.strategy.fsdp_kwargs()["mixed_precision"] and fabric.strategy.fsdp_kwargs()["compute_dtype"] is (
        torch.bfloat16
    )
    fp16 = lightning_fabric.plugins.MixedPrecision("16-mixed", "cpu")
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy="ddp_sharded", plugins=[fp16])
    assert isinstance(fabric.strategy.precision.scaler, ShardedGradScaler)  # inf checks agree across ranks
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy="fsdp_fairscale", precision="bf16-true")
    assert isinstance(fabric.strategy.precision, lightning_fabric.plugins.HalfPrecision)
    kwargs = fabric.strategy.fsdp_kwargs()
    assert (kwargs["mixed_precision"], kwargs["compute_dtype"]) == (False, torch.bfloat16)  # FSDP holds bf16
    with pytest.raises(ValueError, match="'32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true'"):
        lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy="fsdp_fairscale", precision="64-true")


def test_a_trainer_checkpoint_maps_by_position_and_names_its_rest() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saved = {"state_dict": {k: v + 1 for k, v in model.state_dict().items()}, "optimizer_states": [
        optimizer.state_dict()], "lr_schedulers": [], "global_step": 7, "loops": {}, "pytorch-lightning_version": "2.6"}
    state = {"model": model, "opt": optimizer, "global_step": 0}
    rest, loads = restore(saved, state, Roles.of(state, lambda m: False), True)
    assert [(obj, id(value)) for obj, value in loads] == [
        (model, id(saved["state_dict"])), (optimizer, id(saved["optimizer_states"][0]))]
    assert state["global_step"] == 7 and rest == {"loops": {}, "pytorch-lightning_version": "2.6"}
    with pytest.raises(KeyError, match="strict=False"):
        restore(saved, {**state, "epoch": 1}, Roles.of(state, lambda m: False), True, loaded=True)
