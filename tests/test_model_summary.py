"""What a user sees of the sharded model: the Trainer's model summary and the strategy's FSDP unit summary."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from pytorch_lightning.utilities.model_summary import ModelSummary, get_human_readable_count
from scenarios.common import IN_FEATURES, Block, RegressionModel
from scenarios.config import Scenario
from torch import nn

from conftest import command, run_script
from lightning_fairscale.callbacks.model_summary import FullyShardedSummary, ParameterCounts, user_modules


@pytest.mark.parametrize(
    ("flatten", "package"),
    [(True, "pytorch_lightning"), (False, "lightning")],
    ids=["flat-pl", "unflattened-lightning"],
)
def test_summaries_show_the_full_model_and_each_ranks_shard(tmp_path: Path, flatten: bool, package: str) -> None:
    """2 processes, every Block its own unit: the Trainer's summary is the unsharded model's, plus each rank's shard;
    the unit summary is logged once, where Lightning's messages go, with no logging set up by the script."""
    out = tmp_path / "result.pt"
    config = Scenario(steps=1, policy="blocks", flatten=flatten, model_summary=True, example_input=True)
    proc = run_script(command(config, out), cwd=tmp_path, package=package, ranks=2)
    result = torch.load(out, weights_only=False)

    unsharded = RegressionModel()
    unsharded.example_input_array = torch.zeros(2, IN_FEATURES)
    reference = ModelSummary(unsharded, max_depth=-1)
    total = sum(p.numel() for p in unsharded.parameters())
    assert reference.total_parameters == total
    summaries = result["summaries"]
    assert len(summaries) == 2
    for summary in summaries:
        assert summary["names"] == reference.layer_names
        assert summary["types"] == reference.layer_types
        assert summary["params"] == reference.param_nums
        assert summary["in_sizes"] == reference.in_sizes and summary["out_sizes"] == reference.out_sizes
        assert summary["total"] == summary["trainable"] == total
        assert summary["modes"] == reference.total_training_modes
        assert summary["flops"] == {k: sum(v.values()) for k, v in reference.flop_counts.items()}
        assert sum(summary["flops"].values()) > 0
    # Every parameter element lies on exactly one rank (padding not counted), so the shards add up to the layers.
    shards = [summary["shard"] for summary in summaries]
    assert [a + b for a, b in zip(*shards)] == reference.param_nums
    assert sum(s["total_shard"] for s in summaries) == total
    blocks = [i for i, kind in enumerate(reference.layer_types) if kind == "Block"]
    assert all(0 < shards[0][i] < reference.param_nums[i] for i in blocks)  # a unit is split across the ranks

    output = proc.stdout + proc.stderr  # every rank's
    # The Trainer's ModelSummary callback (rank 0): the full model and rank 0's column.
    assert output.count(f"{get_human_readable_count(total):<10}Total params") == 1, output[-4000:]
    assert output.count("| Params per Device |") == 1
    # The unit summary: logged by rank 0 only, once.
    assert output.count(f"DDPFullyShardedStrategy: 3 FSDP units, {total:,} parameters") == 1, output[-4000:]


def test_outside_fsdp_the_summary_equals_lightnings() -> None:
    model = RegressionModel()
    model.example_input_array = torch.zeros(2, IN_FEATURES)
    ours, lightning = FullyShardedSummary(model, max_depth=2), ModelSummary(model, max_depth=2)
    data = dict(ours._get_summary_data())
    assert data.pop("Params per Device") == data["Params"]  # one process holds everything
    assert data == dict(lightning._get_summary_data())
    assert ours.total_parameters == lightning.total_parameters
    assert ours.total_training_modes == lightning.total_training_modes


def test_the_rich_summary_shows_every_column_under_its_header() -> None:
    """Lightning's ``RichModelSummary`` lays out the columns it knows: the per-rank one is among them."""
    pytest.importorskip("rich")
    from rich.console import Console
    from pytorch_lightning.callbacks import RichModelSummary

    model = RegressionModel()
    summary = FullyShardedSummary(model, max_depth=1)
    data = summary._get_summary_data()
    console = Console(width=200, record=True)
    with mock.patch("rich.get_console", return_value=console):
        RichModelSummary.summarize(data, summary.total_parameters, summary.trainable_parameters,
                                   summary.model_size, summary.total_training_modes, summary.total_flops)
    header = next(line for line in console.export_text().splitlines() if "Name" in line)
    assert [cell.strip() for cell in header.strip("┃ ").split("┃")][:5] == [
        "Name", "Type", "Params", "Params per Device", "Mode"
    ]


def test_counts_follow_shared_parameters_to_every_owner() -> None:
    """A tied weight counts once in the model and in each layer that holds it, as ``module.parameters()`` does."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    counts = ParameterCounts(model)
    assert counts.of(model) == (24, 24, 24)
    assert counts.of(model[1]) == (20, 20, 20)
    assert [name for name, _ in user_modules(nn.Sequential(Block()))] == ["0", "0.norm", "0.up", "0.down"]
