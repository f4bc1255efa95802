"""DDPFullyShardedStrategy on 2 CPU processes (gloo), against single-process training without any wrapper.

Every training of this module runs in one launch (``conftest.run_jobs``): :data:`JOBS` lists them by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scenarios.common import (
    assert_adam_close,
    BF16_ATOL,
    BLOCK_UNITS_ORDER,
    LINEAR_UNITS_ORDER,
    NUM_SAMPLES,
    OUT_FEATURES,
    RegressionModelWrapper,
    build_network,
    materialized_start,
    max_difference,
    reference_training,
)
from scenarios.config import Scenario

from conftest import Jobs, run_jobs
from lightning_fairscale.fsdp.unit.state_names import clean_path

ATOL = 1e-5

POLICIES = {"size": 5, "blocks": 3, "callable": 7}  # policy -> FSDP units
CONTROLS = {  # name -> (the scenario's fields, the FSDP units expected)
    # The size policy looks inside every large module; each Linear of the blocks is big enough.
    "size": ({}, ["", "net.1.up", "net.1.down", "net.2.up", "net.2.down"]),
    # Force-leaf: auto wrap does not descend into the blocks, so their parameters go to the enclosing unit.
    "size-force-leaf": ({"force_leaf": ("Block",)}, ["", "net"]),
    # Exclude: the Linears never become units, so what holds them does once it is large enough.
    "size-exclude": ({"exclude": ("Linear",)}, ["", "net.1", "net.2"]),
    # The same controls apply to a callable policy (here: every Linear), but only when given.
    "callable-force-leaf": ({"policy": "callable", "force_leaf": ("Block",)}, ["", "net.0", "net.3"]),
    "callable-exclude": (
        {"policy": "callable", "exclude": ("Sequential", "Block")},
        ["", "net.0", *[f"net.{b}.{layer}" for b in (1, 2) for layer in ("up", "down")], "net.3"],
    ),
}
#: The policies of Lightning's FSDPStrategy (torch's), and the units each makes: those of the equivalent ours.
TORCH_POLICIES = {
    "torch-transformer": ["", "net.1", "net.2"],  # partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    "torch-module": ["", "net.1", "net.2"],  # ModuleWrapPolicy({Block})
    "torch-size": CONTROLS["size"][1],  # partial(size_based_auto_wrap_policy, min_num_params=1000)
}
MANUAL = [("torch", "configure_sharded_model"), ("fairscale", "configure_model"), ("torch", "configure_model")]
CLIP_AND_ACCUMULATE = {  # name -> (the scenario's fields, reference_training's)
    "clip-norm": ({"clip": (0.05, "norm")}, {"clip": (0.05, "norm")}),  # the clip value bites
    "clip-value": ({"clip": (0.002, "value")}, {"clip": (0.002, "value")}),
    "accumulate-2": ({"accumulate": 2, "samples": 32}, {"accumulate": 2, "num_samples": 32}),
    "accumulate-4": ({"accumulate": 4, "samples": 32}, {"accumulate": 4, "num_samples": 32}),
    # Every micro-batch reduce-scatters, FairScale adds each shard to the one held (`sync_each_batch=True`).
    "accumulate-4-each": (
        {"accumulate": 4, "samples": 32, "sync_each_batch": True}, {"accumulate": 4, "num_samples": 32}
    ),
    # The CPU overlap's other backward modes and SHARD_GRAD_OP's units (which keep their full parameters), with
    # accumulation (no reduce-scatter in `no_sync`) and clipping
    **{
        f"prefetch-{name}": (
            {"accumulate": 2, "samples": 32, "clip": (0.05, "norm"), **fields},
            {"accumulate": 2, "num_samples": 32, "clip": (0.05, "norm")},
        )
        for name, fields in {
            "pre": {"backward_prefetch": "BACKWARD_PRE"},
            "none": {"backward_prefetch": "none"},
            "zero2": {"sharding_strategy": "SHARD_GRAD_OP"},
        }.items()
    },
}
MIXED = {  # Lightning maps the "16-mixed" flag to bf16 on CPU: the fp16 case passes the plugin itself
    "bf16-mixed": ({"precision": "bf16-mixed"}, "torch.bfloat16"),
    "16-mixed": ({"precision_plugin": "16-mixed"}, "torch.float16"),
}
CLIP_MIXED = {"16": {"precision_plugin": "16-mixed"}, "bf16": {"precision": "bf16-mixed"}}
#: Param groups that split units and frozen weights inside units that train, under fp16 loss scaling (unscaled
#: gradients of the trainable parameters only are clipped) and activation checkpointing.
FROZEN = ("net.0.weight", "net.1.up.weight")
RECIPE_MIXED = Scenario(params="split", freeze=FROZEN, checkpointing=True, optimizer="sgd", steps=3,
                        clip=(0.05, "norm"), precision_plugin="16-mixed")  # fmt: skip
UNSUPPORTED = ["64-true"]
#: Models built without memory, initialised unit by unit as they are sharded: (scenario, then the reference's steps,
#: optimizer, and order in which its modules are initialised). The meta-device runs seed each rank apart: every rank
#: must still get rank 0's weights.
META: dict[str, tuple[Scenario, int, str, list[str]]] = {
    "empty-init": (Scenario(init="empty", policy="blocks", steps=3), 3, "adam", BLOCK_UNITS_ORDER),
    "device": (Scenario(init="meta", init_seed_per_rank=True, steps=3), 3, "adam", LINEAR_UNITS_ORDER),
    "manual": (Scenario(init="meta", init_seed_per_rank=True, model="manual", optimizer="sgd"), 4, "sgd",
               BLOCK_UNITS_ORDER),
    "unflattened": (Scenario(init="empty", flatten=False, policy="blocks", steps=2), 2, "adam", BLOCK_UNITS_ORDER),
}  # fmt: skip
#: True half precision with Adam on one batch (8 samples: the loss falls, and Lightning resumes exactly), also saved
#: after 2 steps in either format and resumed from there.
TRUE_BF16 = Scenario(precision="bf16-true", samples=8)
CHECKPOINT_KINDS = ("full", "sharded")
#: A root unit whose parameters are all frozen (the input and output layers, as the embeddings and head of a LoRA
#: fine-tuning), with trainable blocks.
FROZEN_ROOT = ("net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias")

JOBS: dict[str, Scenario] = {
    **{f"policy-{policy}": Scenario(policy=policy, steps=3) for policy in POLICIES},
    **{f"controls-{name}": Scenario(**fields, steps=2) for name, (fields, _) in CONTROLS.items()},
    **{f"policy-{policy}": Scenario(policy=policy, steps=3) for policy in TORCH_POLICIES},
    **{f"manual-{w}-{h}": Scenario(model="manual", wrap_with=w, hook=h, optimizer="sgd") for w, h in MANUAL},
    **{f"params-{p}": Scenario(params=p, optimizer="adamw", scheduler=True, steps=3) for p in ("self", "trainer")},
    "unflattened": Scenario(flatten=False, steps=3),
    "eval-after": Scenario(strategy_name="fsdp_fairscale", eval_after=True, steps=2),
    "groups-unflattened": Scenario(params="split", flatten=False, optimizer="sgd", steps=2),
    **{f"clip-accumulate-{n}": Scenario(optimizer="sgd", steps=3, **f) for n, (f, _) in CLIP_AND_ACCUMULATE.items()},
    **{f"mixed-{name}": Scenario(steps=6, samples=8, **fields) for name, (fields, _) in MIXED.items()},
    **{f"clip-mixed-{n}": Scenario(optimizer="sgd", steps=3, clip=(0.05, "norm"), **f) for n, f in CLIP_MIXED.items()},
    **{f"unsupported-{precision}": Scenario(precision=precision, steps=1) for precision in UNSUPPORTED},
    "true-bf16": TRUE_BF16.replace(steps=4),
    # Saved into the launch's folder (its working directory), then resumed.
    **{f"true-bf16-half-{k}": TRUE_BF16.replace(state_dict_type=k, steps=2, save_ckpt=f"bf16-{k}.ckpt")
       for k in CHECKPOINT_KINDS},
    **{f"true-bf16-resumed-{k}": TRUE_BF16.replace(state_dict_type=k, steps=4, ckpt_path=f"bf16-{k}.ckpt")
       for k in CHECKPOINT_KINDS},
    # A checkpoint of one precision resumed in the other (the bf16 one from above).
    "32-half": Scenario(samples=8, steps=2, save_ckpt="fp32-full.ckpt"),
    "true-bf16-from-32": TRUE_BF16.replace(steps=4, ckpt_path="fp32-full.ckpt"),
    "32-from-true-bf16": Scenario(samples=8, steps=4, ckpt_path="bf16-full.ckpt"),
    "true-bf16-sgd": Scenario(precision="bf16-true", optimizer="sgd", steps=4),
    "true-bf16-sgd-clip": Scenario(precision="bf16-true", optimizer="sgd", steps=4, clip=(0.05, "norm")),
    "true-16": Scenario(precision="16-true", optimizer="sgd", samples=8, steps=6),
    "true-bf16-lazy": Scenario(precision="bf16-true", model="lazy", optimizer="sgd", steps=4),
    "cpu-offload": Scenario(cpu_offload=True, steps=2),
    "recipe-mixed": RECIPE_MIXED,
    "summary": Scenario(policy="blocks", steps=2),
    **{f"meta-{name}": scenario for name, (scenario, *_) in META.items()},
    "meta-uninitializable": Scenario(init="meta", uninitializable=True, steps=1),
    "frozen-root": Scenario(policy="blocks", freeze=FROZEN_ROOT, steps=2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    failing = [f"unsupported-{precision}" for precision in UNSUPPORTED] + ["meta-uninitializable"]
    return run_jobs(tmp_path_factory.mktemp("fully_sharded"), JOBS, failing=failing)


def assert_sharded(result: dict[str, Any], min_units: int) -> None:
    units = result["units"]
    assert len(units) >= min_units, units
    assert all(u["world_size"] == 2 for u in units), units
    assert all("_fsdp_wrapped_module" not in key for key in result["state_dict"]), "wrapper names leaked"


# size (min_num_params=1000): each Linear of the blocks, plus the root; blocks: each Block, plus the root;
# callable: all six nn.Linear layers, plus the root.
@pytest.mark.parametrize(("policy", "units"), POLICIES.items())
def test_auto_wrap_equals_unsharded_training(runs: Jobs, policy: str, units: int) -> None:
    result = runs[f"policy-{policy}"]
    assert_sharded(result, units)
    assert len(result["units"]) == units
    assert_adam_close(result["state_dict"], reference_training(3, "adam"))


@pytest.mark.parametrize("policy", TORCH_POLICIES)
def test_lightning_fsdp_strategy_policies_make_the_same_units_and_train_the_same(runs: Jobs, policy: str) -> None:
    result = runs[f"policy-{policy}"]
    assert_sharded(result, len(TORCH_POLICIES[policy]))
    assert sorted(clean_path(u["path"] + ".").rstrip(".") for u in result["units"]) == sorted(TORCH_POLICIES[policy])
    assert_adam_close(result["state_dict"], reference_training(3, "adam"))


@pytest.mark.parametrize("name", CONTROLS)
def test_exclude_and_force_leaf_controls_choose_the_units(runs: Jobs, name: str) -> None:
    result, paths = runs[f"controls-{name}"], CONTROLS[name][1]
    assert sorted(clean_path(u["path"] + ".").rstrip(".") for u in result["units"]) == sorted(paths)
    assert_adam_close(result["state_dict"], reference_training(2, "adam"))


@pytest.mark.parametrize(("wrap_with", "hook"), MANUAL)
def test_manual_wrap_equals_unsharded_training(runs: Jobs, wrap_with: str, hook: str) -> None:
    result = runs[f"manual-{wrap_with}-{hook}"]
    assert_sharded(result, 3)  # the two blocks and the root: auto wrap stays off once the user wrapped
    assert len(result["units"]) == 3
    assert max_difference(result["state_dict"], reference_training(4, "sgd")) < ATOL


@pytest.mark.parametrize("params", ["self", "trainer"])
def test_optimizer_from_either_parameter_source_keeps_scheduler(runs: Jobs, params: str) -> None:
    result = runs[f"params-{params}"]
    assert_adam_close(result["state_dict"], reference_training(3, "adamw", scheduler=True))


def test_unflattened_parameters_equal_unsharded_training(runs: Jobs) -> None:
    result = runs["unflattened"]
    assert_sharded(result, 2)
    assert_adam_close(result["state_dict"], reference_training(3, "adam"))


def test_same_instance_validates_tests_and_predicts_after_fit(runs: Jobs) -> None:
    result = runs["eval-after"]
    assert result["strategy"] == "DDPFullyShardedStrategy"
    trained = result["state_dict"]
    assert_adam_close(trained, reference_training(2, "adam"))
    # The evaluation losses are those of the trained weights on the whole data set.
    from scenarios.common import RegressionModelWrapper, build_network, dataset

    model = RegressionModelWrapper(build_network())
    model.load_state_dict(trained)
    x, y = dataset().tensors
    expected = torch.nn.functional.mse_loss(model(x), y).item()
    assert result["validate"][0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["test"][0]["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["predict"].shape == (NUM_SAMPLES // 2, OUT_FEATURES)  # rank 0's half of the samples


def test_param_groups_work_without_flattening(runs: Jobs) -> None:
    result = runs["groups-unflattened"]
    expected = reference_training(2, "sgd", params="split")
    assert max_difference(result["state_dict"], expected) < ATOL
    # The groups' own hyperparameters change the result, so the equality shows that each group kept them.
    assert max_difference(expected, reference_training(2, "sgd")) > 100 * ATOL


@pytest.mark.parametrize("name", CLIP_AND_ACCUMULATE)
def test_clipping_and_accumulation_equal_unsharded_training(runs: Jobs, name: str) -> None:
    result, reference = runs[f"clip-accumulate-{name}"], CLIP_AND_ACCUMULATE[name][1]
    accumulate = reference.get("accumulate", 1)
    # Only the micro-batch that steps reduce-scatters gradients; the others run inside FSDP's `no_sync`, unless
    # `sync_each_batch=True`.
    each = CLIP_AND_ACCUMULATE[name][0].get("sync_each_batch", False)
    assert result["grad_sync"] == ([each] * (accumulate - 1) + [True]) * 3
    expected = reference_training(3, "sgd", **reference)
    assert max_difference(result["state_dict"], expected) < ATOL
    assert max_difference(expected, reference_training(3, "sgd")) > 100 * ATOL  # the feature changed the result


def test_between_micro_batches_a_rank_holds_its_full_gradient_under_no_sync_and_its_shard_with_sync_each_batch(
    runs: Jobs,
) -> None:
    no_sync, each = runs["clip-accumulate-accumulate-4"], runs["clip-accumulate-accumulate-4-each"]
    full = no_sync["held_gradients"][0]
    # After the 1st to 3rd micro-batch of each step: the whole flat gradient of every unit under no_sync; about
    # half of it (this rank's shards, padded) when each micro-batch reduce-scatters. After the 4th: the shards.
    assert no_sync["held_gradients"][:3] == [full] * 3 and full > 0
    assert len(set(each["held_gradients"])) == 1
    assert full / 2 <= each["held_gradients"][0] <= full / 2 + 8
    assert no_sync["held_gradients"][3] == each["held_gradients"][3]


@pytest.mark.parametrize("name", MIXED)
def test_mixed_precision_trains_in_the_requested_dtype(runs: Jobs, name: str) -> None:
    result, dtype = runs[f"mixed-{name}"], MIXED[name][1]
    assert result["compute"] == [(dtype, dtype)]  # full parameters and outputs of an FSDP unit's Linear layer
    losses = result["losses"]
    assert losses[-1] < losses[0] / 5, losses
    # The FP32 master shards come back unwrapped in FP32.
    assert all(v.dtype == torch.float32 for v in result["state_dict"].values())


def test_param_groups_and_frozen_weights_under_fp16_and_checkpointing(runs: Jobs) -> None:
    result = runs["recipe-mixed"]
    expected = reference_training(3, "sgd", clip=(0.05, "norm"), freeze=FROZEN, params="split")
    assert max_difference(result["state_dict"], expected) < 1e-4
    initial = reference_training(0, "sgd")
    assert all(torch.equal(result["state_dict"][name], initial[name]) for name in FROZEN)


def test_a_frozen_root_unit_trains_and_unshards_after_fit(runs: Jobs) -> None:
    """The frozen root's full parameters, gathered for the backward, used to stay gathered: ``unshard_module`` (and a
    full checkpoint) then failed in FairScale's ``summon_full_params`` (``AssertionError: 0 vs. 1``)."""
    result = runs["frozen-root"]
    assert_adam_close(result["state_dict"], reference_training(2, "adam", freeze=FROZEN_ROOT))
    initial = reference_training(0, "adam")
    assert all(torch.equal(result["state_dict"][name], initial[name]) for name in FROZEN_ROOT)


@pytest.mark.parametrize("precision", UNSUPPORTED)
def test_unsupported_precision_is_refused_clearly(runs: Jobs, precision: str) -> None:
    for error in runs.errors(f"unsupported-{precision}"):  # every rank refuses it, before training
        assert "does not support precision" in error["message"]
        assert "'32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true'" in error["message"]
        assert error["trained_batches"] in (0, None)


def _floating_dtypes(value: Any, key: str = "") -> set[tuple[str, torch.dtype]]:
    """(last key, dtype) of every floating point tensor in a checkpoint, however nested."""
    if isinstance(value, torch.Tensor):
        return {(key, value.dtype)} if value.is_floating_point() else set()
    if isinstance(value, dict):
        return set().union(*(_floating_dtypes(v, str(k)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return set().union(*(_floating_dtypes(v, key) for v in value))
    return set()


def test_true_bf16_holds_everything_in_bf16_in_half_the_memory(runs: Jobs) -> None:
    result = runs["true-bf16"]
    assert result["compute"] == [("torch.bfloat16", "torch.bfloat16")]  # no FP32 master copy, no cast
    bf16 = {"torch.bfloat16"}
    dtypes = result["dtypes"]
    assert dtypes["parameters"] == dtypes["gradients"] == bf16
    # Adam's moments in bf16; only its step counters stay FP32 scalars.
    assert dtypes["optimizer_state"] == {("exp_avg", "torch.bfloat16"), ("exp_avg_sq", "torch.bfloat16"),
                                         ("step", "torch.float32")}
    assert all(v.dtype == torch.bfloat16 for v in result["state_dict"].values())
    losses = result["losses"]
    assert losses[-1] < losses[0] / 2, losses
    # The same model, units and optimizer in "32-true": each rank holds half the bytes of parameters, gradients and
    # Adam's moments; the step counters (4 bytes each, one per original parameter this rank holds a view of) do not
    # shrink: 2 x half - full is their bytes exactly.
    full, half = runs["policy-size"]["memory"], result["memory"]
    assert len(result["units"]) == len(runs["policy-size"]["units"]) == 5
    assert half["memory/parameters_bytes"] == full["memory/parameters_bytes"] / 2
    assert half["memory/gradients_bytes"] == full["memory/gradients_bytes"] / 2
    counters = 2 * half["memory/optimizer_state_bytes"] - full["memory/optimizer_state_bytes"]
    assert counters % 4 == 0 and 0 < counters <= 4 * len(reference_training(0)), counters


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_true_bf16_checkpoints_hold_bf16_and_resume_exactly(runs: Jobs, kind: str) -> None:
    path = runs.folder / f"bf16-{kind}.ckpt"
    files = sorted(path.iterdir()) if kind == "sharded" else [path]
    dtypes = set().union(*(_floating_dtypes(torch.load(f, weights_only=False)) for f in files))
    assert {dtype for key, dtype in dtypes if key != "step"} == {torch.bfloat16}, dtypes
    assert {key for key, _ in dtypes} >= {"exp_avg", "exp_avg_sq"}
    resumed, uninterrupted = runs[f"true-bf16-resumed-{kind}"], runs["true-bf16"]
    assert resumed["global_step"] == 4
    assert all(v.dtype == torch.bfloat16 for v in resumed["state_dict"].values())
    assert max_difference(resumed["state_dict"], uninterrupted["state_dict"]) == 0.0


@pytest.mark.parametrize(
    ("name", "dtype"), [("true-bf16-from-32", "torch.bfloat16"), ("32-from-true-bf16", "torch.float32")]
)
def test_a_checkpoint_resumes_in_the_other_precision(runs: Jobs, name: str, dtype: str) -> None:
    """The checkpoint's weights and Adam moments take the run's dtype (rounded to bf16, or widened to FP32)."""
    result = runs[name]
    assert result["global_step"] == 4 and len(result["losses"]) == 2
    assert result["dtypes"]["parameters"] == result["dtypes"]["gradients"] == {dtype}
    assert result["dtypes"]["optimizer_state"] == {("exp_avg", dtype), ("exp_avg_sq", dtype), ("step", "torch.float32")}
    # Training goes on from the checkpoint's weights, not from fresh ones: the loss continues the uninterrupted run's.
    uninterrupted = runs["true-bf16"]["losses"]
    assert result["losses"][0] == pytest.approx(uninterrupted[2], rel=0.05)


def test_true_bf16_configure_model_creates_bf16_parameters(runs: Jobs) -> None:
    """``configure_model`` runs in the strategy's ``tensor_init_context``: the layers are made in bf16 (as by
    Lightning's ``HalfPrecision``: no FP32 copy of the model ever exists), and train as unsharded ones made so."""
    result = runs["true-bf16-lazy"]
    assert result["created"] == {"torch.bfloat16"}
    assert result["dtypes"]["parameters"] == result["dtypes"]["gradients"] == {"torch.bfloat16"}
    expected = reference_training(4, "sgd", dtype=torch.bfloat16, made_in_dtype=True)
    assert max_difference(result["state_dict"], expected) <= BF16_ATOL
    # Made in bf16, the random weights are not FP32 ones rounded: another training.
    assert max_difference(expected, reference_training(4, "sgd", dtype=torch.bfloat16)) > 10 * BF16_ATOL


@pytest.mark.parametrize("clip", [False, True])
def test_true_bf16_equals_unsharded_bf16_training(runs: Jobs, clip: bool) -> None:
    """Against the same training unsharded, in bf16 (the model and the batches converted, as Lightning's
    ``HalfPrecision`` does): within one bf16 spacing of the weights (see :data:`BF16_ATOL`)."""
    result = runs["true-bf16-sgd-clip" if clip else "true-bf16-sgd"]
    clipping: dict[str, Any] = {"clip": (0.05, "norm")} if clip else {}
    expected = reference_training(4, "sgd", dtype=torch.bfloat16, **clipping)
    assert max_difference(result["state_dict"], expected) <= BF16_ATOL
    if clip:  # the clip value bites
        assert max_difference(expected, reference_training(4, "sgd", dtype=torch.bfloat16)) > 10 * BF16_ATOL
    else:  # the tolerance tells bf16 from fp32 training
        assert max_difference(expected, reference_training(4, "sgd")) > 2 * BF16_ATOL


def test_true_fp16_trains_in_fp16(runs: Jobs) -> None:
    result = runs["true-16"]
    fp16 = {"torch.float16"}
    assert result["compute"] == [("torch.float16", "torch.float16")]
    assert result["dtypes"]["parameters"] == result["dtypes"]["gradients"] == fp16
    assert result["dtypes"]["optimizer_state"] == {("momentum_buffer", "torch.float16")}
    assert all(v.dtype == torch.float16 for v in result["state_dict"].values())
    losses = result["losses"]
    assert losses[-1] < losses[0] / 2, losses


@pytest.mark.parametrize("name", CLIP_MIXED)
def test_clip_by_norm_under_mixed_precision_uses_unscaled_gradients(runs: Jobs, name: str) -> None:
    """A scaled fp16 gradient (x 65536) would be clipped to almost nothing; unscaled, it matches FP32 clipping."""
    result = runs[f"clip-mixed-{name}"]
    assert max_difference(result["state_dict"], reference_training(3, "sgd", clip=(0.05, "norm"))) < 1e-4


def test_cpu_offload_on_a_cpu_run_warns_and_trains_normally(runs: Jobs) -> None:
    warning = "`DDPFullyShardedStrategy(cpu_offload=True)` has no effect when training on the CPU"
    assert warning in runs.stderr("cpu-offload")
    assert warning not in runs.stderr("summary")  # only when asked for
    result = runs["cpu-offload"]
    assert_adam_close(result["state_dict"], reference_training(2, "adam"))


def test_unit_summary_and_memory_figures_show_the_sharding(runs: Jobs) -> None:
    result = runs["summary"]
    summary = result["summary"]
    assert summary.splitlines()[0].startswith("3 FSDP units")
    assert "net.1" in summary and "net.2" in summary and "(root)" in summary
    total = sum(v.numel() for v in result["state_dict"].values())
    memory = result["memory"]
    # Each rank holds about half of the parameters (plus padding), and Adam's two moments for them.
    assert total * 4 / 2 <= memory["memory/parameters_bytes"] <= total * 4 / 2 + 3 * 4
    # Memory is counted by storage: a gradient shard that were a view into a reduce-scatter bucket would count as
    # the whole 12.5 MiB bucket, not as the shard's 18 KiB (on CPU the overlapping reducer of workaround 16 makes
    # compact shards; workaround 8's own test is in tests/unit/test_workarounds.py).
    assert memory["memory/gradients_bytes"] == memory["memory/parameters_bytes"]
    assert 2 * memory["memory/parameters_bytes"] <= memory["memory/optimizer_state_bytes"]


@pytest.mark.parametrize("name", META)
def test_model_built_without_memory_is_initialised_as_sharded_and_trains_exactly(runs: Jobs, name: str) -> None:
    """Built on the meta device (``trainer.init_module(empty_init=True)``, ``torch.device("meta")``; auto or manual
    wrap), each unit is materialised and initialised by ``reset_parameters()`` just before it is sharded. The
    reference starts from the weights those calls give in the same order on one process, then trains unsharded."""
    result = runs[f"meta-{name}"]
    _, steps, optimizer, order = META[name]
    start = materialized_start(order)
    assert_sharded(result, 3)
    expected = reference_training(steps, optimizer, start=start)
    if optimizer == "sgd":
        assert max_difference(result["state_dict"], expected) < ATOL
    else:  # Adam-like: relative to the update (see scenarios.common.ADAM_RTOL)
        assert_adam_close(result["state_dict"], expected, start)
    eager = RegressionModelWrapper(build_network()).state_dict()  # the same seed, initialised in another order
    assert max_difference(start, eager) > 0.1


def test_model_built_without_memory_that_cannot_be_initialised_fails_early(runs: Jobs) -> None:
    for error in runs.errors("meta-uninitializable"):  # on every rank, before training: no rank waits for another
        assert "`net.1` (Block) holds `scale` on the meta device and has no `reset_parameters()`" in error["message"]
        assert "param_init_fn" in error["message"]
        assert error["trained_batches"] in (0, None)
