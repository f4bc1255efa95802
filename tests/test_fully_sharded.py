"""DDPFullyShardedStrategy on 2 CPU processes (gloo), against single-process training without any wrapper."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from scenarios.common import NUM_SAMPLES, OUT_FEATURES, max_difference, reference_training

from conftest import TRAIN_SCRIPT, run_script
from lightning_fairscale.fsdp.wrapping import clean_path

ATOL = 1e-5
Train = Callable[..., dict[str, Any]]


def assert_sharded(result: dict[str, Any], min_units: int) -> None:
    units = result["units"]
    assert len(units) >= min_units, units
    assert all(u["world_size"] == 2 for u in units), units
    assert all("_fsdp_wrapped_module" not in key for key in result["state_dict"]), "wrapper names leaked"


@pytest.mark.parametrize(
    ("policy", "units"),
    [
        ("size", 5),  # min_num_params=1000: each Linear of the blocks, plus the root
        ("blocks", 3),  # each Block, plus the root
        ("callable", 7),  # all six nn.Linear layers, plus the root
    ],
)
def test_auto_wrap_equals_unsharded_training(train: Train, policy: str, units: int) -> None:
    result = train("--policy", policy, "--steps", "3")
    assert_sharded(result, units)
    assert len(result["units"]) == units
    assert max_difference(result["state_dict"], reference_training(3, "adam")) < ATOL


@pytest.mark.parametrize(
    ("args", "paths"),
    [
        # The size policy looks inside every large module; each Linear of the blocks is big enough.
        ((), ["", "net.1.up", "net.1.down", "net.2.up", "net.2.down"]),
        # Force-leaf: auto wrap does not descend into the blocks, so their parameters go to the enclosing unit.
        (("--force-leaf", "Block"), ["", "net"]),
        # Exclude: the Linears never become units, so what holds them does once it is large enough.
        (("--exclude", "Linear"), ["", "net.1", "net.2"]),
        # The same controls apply to a callable policy (here: every Linear), but only when given.
        (("--policy", "callable", "--force-leaf", "Block"), ["", "net.0", "net.3"]),
        (("--policy", "callable", "--exclude", "Sequential", "Block"), ["", "net.0", *[
            f"net.{b}.{layer}" for b in (1, 2) for layer in ("up", "down")], "net.3"]),
    ],
    ids=["size", "size-force-leaf", "size-exclude", "callable-force-leaf", "callable-exclude"],
)
def test_exclude_and_force_leaf_controls_choose_the_units(train: Train, args: tuple[str, ...], paths: list[str]) -> None:
    result = train(*args, "--steps", "2")
    assert sorted(clean_path(u["path"] + ".").rstrip(".") for u in result["units"]) == sorted(paths)
    assert max_difference(result["state_dict"], reference_training(2, "adam")) < ATOL


@pytest.mark.parametrize(
    ("wrap_with", "hook"),
    [("torch", "configure_sharded_model"), ("fairscale", "configure_model"), ("torch", "configure_model")],
)
def test_manual_wrap_equals_unsharded_training(train: Train, wrap_with: str, hook: str) -> None:
    result = train("--model", "manual", "--wrap-with", wrap_with, "--hook", hook, "--optimizer", "sgd")
    assert_sharded(result, 3)  # the two blocks and the root: auto wrap stays off once the user wrapped
    assert len(result["units"]) == 3
    assert max_difference(result["state_dict"], reference_training(4, "sgd")) < ATOL


@pytest.mark.parametrize("params", ["self", "trainer"])
def test_optimizer_from_either_parameter_source_keeps_scheduler(train: Train, params: str) -> None:
    result = train("--params", params, "--optimizer", "adamw", "--scheduler", "--steps", "3")
    assert max_difference(result["state_dict"], reference_training(3, "adamw", scheduler=True)) < ATOL


def test_unflattened_parameters_equal_unsharded_training(train: Train) -> None:
    result = train("--flatten", "0", "--steps", "3")
    assert_sharded(result, 2)
    assert max_difference(result["state_dict"], reference_training(3, "adam")) < ATOL


def test_same_instance_validates_tests_and_predicts_after_fit(train: Train) -> None:
    result = train("--strategy-name", "fsdp_fairscale", "--eval-after", "--steps", "2")
    assert result["strategy"] == "DDPFullyShardedStrategy"
    trained = result["state_dict"]
    assert max_difference(trained, reference_training(2, "adam")) < ATOL
    # The evaluation losses are those of the trained weights on the whole data set.
    from scenarios.common import RegressionModelWrapper, build_network, dataset

    model = RegressionModelWrapper(build_network())
    model.load_state_dict(trained)
    x, y = dataset().tensors
    expected = torch.nn.functional.mse_loss(model(x), y).item()
    assert result["validate"][0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["test"][0]["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["predict"].shape == (NUM_SAMPLES // 2, OUT_FEATURES)  # rank 0's half of the samples


def test_param_groups_work_without_flattening(train: Train) -> None:
    result = train("--params", "split", "--flatten", "0", "--optimizer", "sgd", "--steps", "2")
    expected = reference_training(2, "sgd", params="split")
    assert max_difference(result["state_dict"], expected) < ATOL
    # The groups' own hyperparameters change the result, so the equality shows that each group kept them.
    assert max_difference(expected, reference_training(2, "sgd")) > 100 * ATOL


@pytest.mark.parametrize(
    ("args", "reference"),
    [
        (["--clip-val", "0.05", "--clip-alg", "norm"], {"clip": (0.05, "norm")}),  # the clip value bites
        (["--clip-val", "0.002", "--clip-alg", "value"], {"clip": (0.002, "value")}),
        (["--accumulate", "2", "--samples", "32"], {"accumulate": 2, "num_samples": 32}),
        (["--accumulate", "4", "--samples", "32"], {"accumulate": 4, "num_samples": 32}),
    ],
    ids=["clip-norm", "clip-value", "accumulate-2", "accumulate-4"],
)
def test_clipping_and_accumulation_equal_unsharded_training(
    train: Train, args: list[str], reference: dict[str, Any]
) -> None:
    result = train("--optimizer", "sgd", "--steps", "3", *args)
    accumulate = reference.get("accumulate", 1)
    # Only the micro-batch that steps reduce-scatters gradients; the others run inside FSDP's `no_sync`.
    assert result["grad_sync"] == ([False] * (accumulate - 1) + [True]) * 3
    expected = reference_training(3, "sgd", **reference)
    assert max_difference(result["state_dict"], expected) < ATOL
    assert max_difference(expected, reference_training(3, "sgd")) > 100 * ATOL  # the feature changed the result


@pytest.mark.parametrize(
    ("args", "dtype"),
    [
        (["--precision", "bf16-mixed"], "torch.bfloat16"),
        (["--precision-plugin", "16-mixed"], "torch.float16"),  # Lightning maps the "16-mixed" flag to bf16 on CPU
    ],
    ids=["bf16-mixed", "16-mixed"],
)
def test_mixed_precision_trains_in_the_requested_dtype(train: Train, args: list[str], dtype: str) -> None:
    result = train("--steps", "6", "--samples", "8", *args)
    assert result["compute"] == [(dtype, dtype)]  # full parameters and outputs of an FSDP unit's Linear layer
    losses = result["losses"]
    assert losses[-1] < losses[0] / 5, losses
    # The FP32 master shards come back unwrapped in FP32.
    assert all(v.dtype == torch.float32 for v in result["state_dict"].values())


@pytest.mark.parametrize("precision", ["64-true", "16-true", "bf16-true"])
def test_unsupported_precision_is_refused_clearly(
    train_failing: Callable[..., subprocess.CompletedProcess], precision: str
) -> None:
    proc = train_failing("--precision", precision, "--steps", "1")
    assert "does not support precision" in proc.stderr
    assert "'32-true', '16-mixed', 'bf16-mixed'" in proc.stderr


@pytest.mark.parametrize("args", [["--precision-plugin", "16-mixed"], ["--precision", "bf16-mixed"]], ids=["16", "bf16"])
def test_clip_by_norm_under_mixed_precision_uses_unscaled_gradients(train: Train, args: list[str]) -> None:
    """A scaled fp16 gradient (x 65536) would be clipped to almost nothing; unscaled, it matches FP32 clipping."""
    result = train("--optimizer", "sgd", "--steps", "3", "--clip-val", "0.05", *args)
    assert max_difference(result["state_dict"], reference_training(3, "sgd", clip=(0.05, "norm"))) < 1e-4


def test_cpu_offload_on_a_cpu_run_warns_and_trains_normally(tmp_path: Path) -> None:
    out = tmp_path / "result.pt"
    proc = run_script([str(TRAIN_SCRIPT), "--out", str(out), "--cpu-offload", "--steps", "2"], cwd=tmp_path)
    assert "`DDPFullyShardedStrategy(cpu_offload=True)` has no effect when training on the CPU" in proc.stderr
    result = torch.load(out, weights_only=False)
    assert max_difference(result["state_dict"], reference_training(2, "adam")) < ATOL


def test_unit_summary_and_memory_figures_show_the_sharding(train: Train) -> None:
    result = train("--policy", "blocks", "--steps", "2")
    summary = result["summary"]
    assert summary.splitlines()[0].startswith("3 FSDP units")
    assert "net.1" in summary and "net.2" in summary and "(root)" in summary
    total = sum(v.numel() for v in result["state_dict"].values())
    memory = result["memory"]
    # Each rank holds about half of the parameters (plus padding), and Adam's two moments for them.
    assert total * 4 / 2 <= memory["memory/parameters_bytes"] <= total * 4 / 2 + 3 * 4
    # Memory is counted by storage: gradient shards that were views into FairScale's reduce-scatter bucket would
    # count as the whole 12.5 MiB bucket (fairscale_cpu workaround 8), not as the shards' 18 KiB.
    assert memory["memory/gradients_bytes"] == memory["memory/parameters_bytes"]
    assert 2 * memory["memory/parameters_bytes"] <= memory["memory/optimizer_state_bytes"]
