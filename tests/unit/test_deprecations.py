"""Workaround 19 (``lightning_fairscale.fsdp.patches.deprecations``): FairScale's calls that torch deprecates raise no
warning a user sees, and the same calls in the user's own code still warn."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.internal import reduce_scatter_bucketer as bucketer_module
from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

from lightning_fairscale.distributed import collectives
from lightning_fairscale.fsdp.patches import cpu_streams, deprecations

from .helpers import Net, batches, shard, step, run_ranks


def _deprecation(w: warnings.WarningMessage) -> bool:
    text = str(w.message)
    return issubclass(w.category, (FutureWarning, DeprecationWarning)) or "TypedStorage is deprecated" in text


def _train_and_call_them_ourselves(rank: int, world_size: int) -> dict[str, list[str]]:
    cpu_streams.install()  # workaround 1: FairScale on a host without CUDA
    torch.storage._set_always_warn_typed_storage_removal(True)  # torch warns once a process otherwise
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")  # every warning, every time: nothing of the process's filters
        model = Net()
        sharded = shard(model, torch.optim.AdamW(model.parameters(), lr=0.1), flatten=True)
        for batch in batches(2):
            step(sharded.root, sharded.optimizer, (batch[0][rank::world_size], batch[1][rank::world_size]))
        ours = [f"{w.category.__name__}: {w.message}" for w in caught if _deprecation(w)]
        del caught[:]
        # The user's own calls of the same functions: torch's warnings, as without this package.
        output = torch.empty(2 * world_size)
        dist._all_gather_base(output, torch.ones(2))
        torch.ones(1).storage()
        users = [f"{w.category.__name__}: {w.message}" for w in caught if _deprecation(w)]
    return {"ours": ours, "users": users}


@pytest.mark.workaround(19)
def test_training_raises_no_deprecation_warning_and_the_users_calls_still_warn(tmp_path: Path) -> None:
    """Two ranks (gloo) train a wrapped model: FSDP's all-gathers, its reduce-scatters, its storage calls; with every
    warning recorded ("always"), none is a deprecation. The user's own ``_all_gather_base`` and ``.storage()`` then
    warn as torch makes them warn."""
    results = run_ranks(_train_and_call_them_ourselves, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["ours"] == [], (rank, result["ours"])
        users = " | ".join(result["users"])
        assert "_all_gather_base" in users and "TypedStorage is deprecated" in users, (rank, users)


@pytest.mark.workaround(19)
def test_fairscale_calls_the_current_collectives() -> None:
    """FairScale's modules see ``_all_gather_base``/``_reduce_scatter_base`` as torch's current functions, and every
    other name of ``torch.distributed`` as torch's own."""
    deprecations.install()
    assert deprecations.is_installed()
    for module in (fsdp_module, bucketer_module):
        view: Any = module.dist
        assert view._all_gather_base is collectives.current_name("all_gather_into_tensor")
        assert view._reduce_scatter_base is collectives.current_name("reduce_scatter_tensor")
        assert view.all_reduce is dist.all_reduce and view.ProcessGroup is dist.ProcessGroup
    if hasattr(dist, "all_gather_single"):  # torch 2.13: the deprecated names are not the ones called
        assert collectives.current_name("_all_gather_base") is dist.all_gather_single
        assert collectives.current_name("all_gather_into_tensor") is dist.all_gather_single


def test_the_storage_filter_is_scoped_to_fairscales_module() -> None:
    """The filter matches torch's message where FairScale's module is the location, nowhere else."""
    deprecations.install()
    message = "TypedStorage is deprecated. It will be removed in the future"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # shadows the filter: the next unit puts it in front again
        assert not deprecations.is_installed()
        deprecations.install()
        for module in ("fairscale.nn.data_parallel.fully_sharded_data_parallel", "my_training", "torch.storage"):
            warnings.warn_explicit(message, UserWarning, "file.py", 1, module=module)
    assert [w.filename for w in caught] == ["file.py", "file.py"]  # the user's module and torch's: not filtered
