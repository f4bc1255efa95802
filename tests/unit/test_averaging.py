"""Weight averaging over a module's own ``parameters()`` (:mod:`lightning_fairscale.fsdp.state.averaging`), in-process,
and the refusal of ``StochasticWeightAveraging`` under FSDP (issue 47, item 4)."""

from __future__ import annotations

import pytest
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.callbacks import StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.optim.swa_utils import get_ema_avg_fn

from lightning_fairscale.fsdp.state.averaging import ShardAveragedModel, shard_state
from lightning_fairscale.strategies._callbacks import check_callbacks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def test_state_dict_is_the_average_in_the_owners_format_and_leaves_the_module_alone() -> None:
    model = _model()
    average = ShardAveragedModel(model, model.state_dict, avg_fn=get_ema_avg_fn(0.5), use_buffers=True)
    start = shard_state(model)
    average.update_parameters(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update_parameters(model)
    state = average.state_dict()
    # EMA of decay 0.5 over (w, w + 1): w + 0.5, with the owner's keys behind "module."
    assert torch.allclose(state["module.0.weight"], start["0.weight"] + 0.5)
    assert int(state["n_averaged"]) == 2
    assert torch.allclose(model[0].weight, start["0.weight"] + 1.0)  # swapped back


def test_load_state_dict_takes_slices_by_name_and_refuses_other_shapes() -> None:
    model = _model()
    average = ShardAveragedModel(model, model.state_dict)
    state = {f"module.{k}": v + 2 for k, v in shard_state(model).items()} | {"n_averaged": torch.tensor(5)}
    average.load_state_dict(state)
    assert int(average.n_averaged) == 5
    assert torch.equal(next(average.module.parameters()), model[0].weight.detach() + 2)
    state["module.0.weight"] = torch.zeros(7)
    with pytest.raises(RuntimeError, match="0.weight: this rank's slice has shape"):
        average.load_state_dict(state)


def test_copy_holds_what_parameters_gives() -> None:
    """The copy is what ``parameters()`` holds: for a sharded module, this rank's slices (the scenarios measure
    half the model on each of 2 ranks)."""
    model = _model()
    average = ShardAveragedModel(model, model.state_dict)
    assert average.module.numel() == sum(p.numel() for p in model.parameters())


def test_stochastic_weight_averaging_is_refused_naming_weight_averaging() -> None:
    refusal = r"`StochasticWeightAveraging` does not work .*WeightAveraging\(\)"
    with pytest.raises(MisconfigurationException, match=refusal):
        check_callbacks([StochasticWeightAveraging(swa_lrs=0.1)], "DDPFullyShardedStrategy")
    check_callbacks([WeightAveraging()], "DDPFullyShardedStrategy")  # works on the shards: not refused
