"""Models, wrapping and training helpers for the in-process unit tests of the engine.

Everything here runs in the test process: FSDP units are built on a single-process gloo group (the
``process_group`` fixture of ``conftest.py``), and the few checks that need several ranks fork them with
:func:`run_ranks` (forked children inherit the imported modules, so a rank starts in milliseconds).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fairscale.nn.data_parallel import FullyShardedDataParallel as FairScaleFSDP
from fairscale.nn.wrap import enable_wrap
from models import Block
from torch import Tensor, nn

from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.engine import finish_wrapping
from lightning_fairscale.fsdp.state.optim import GroupOrder, ParameterLayout, repoint_optimizer
from lightning_fairscale.fsdp.state.optim_state import consolidate_state, load_plain_state
from lightning_fairscale.fsdp.wrapping.policies import auto_wrap_policy, wrap_module
from lightning_fairscale.fsdp.unit.state_names import clean_path

#: Samples per global batch: divisible by the world sizes 1, 2 and 3 the tests use.
GLOBAL_BATCH = 6
IN_FEATURES, WIDTH, OUT_FEATURES = 3, 5, 2


def small_block() -> Block:
    """The unit tests' ``Block``: odd sizes, so that shards get padding at world sizes 2 and 3."""
    return Block(WIDTH, hidden=6, activation=torch.tanh)


class Net(nn.Module):
    """``inp`` -> two ``Block`` -> ``out``: 194 parameters in 14 tensors (``down`` has 35: shards get padding)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN_FEATURES, WIDTH)
        self.blocks = nn.Sequential(small_block(), small_block())
        self.out = nn.Linear(WIDTH, OUT_FEATURES)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.blocks(self.inp(x)))


def batches(steps: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """``steps`` global batches of regression data."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=g), torch.randn(GLOBAL_BATCH, OUT_FEATURES, generator=g))
        for _ in range(steps)
    ]


def fsdp_kwargs(flatten: bool = True, **overrides: Any) -> dict[str, Any]:
    """The FSDP arguments the strategy uses on a CPU run, over the default process group.

    The groups are given, as the strategy gives its own: FairScale's default is a group it caches for the whole
    process, which would outlive the test's process group.
    """
    kwargs: dict[str, Any] = {
        "process_group": dist.group.WORLD,
        "process_group_reduce_scatter": dist.group.WORLD,
        "compute_device": torch.device("cpu"),
        "flatten_parameters": flatten,
        "state_dict_device": torch.device("cpu"),
        "state_dict_on_rank_0_only": True,
        # Small reduce-scatter buckets (the strategy's default is 25 MB): still bucketed, but each flush allocates
        # and zeroes 1 MB instead of 25.
        "bucket_cap_mb": 1,
    }
    kwargs.update(overrides)
    return kwargs


def wrap(
    module: nn.Module,
    policy: Any = None,
    min_num_params: int = 10**9,
    flatten: bool = True,
    own_units: Iterable[nn.Module] = (),
    exclude: Optional[Iterable[type[nn.Module]]] = None,
    force_leaf: Optional[Iterable[type[nn.Module]]] = None,
    **overrides: Any,
) -> FairScaleFSDP:
    """``module`` wrapped as the strategy wraps it: auto wrap by ``policy``, then the root unit."""
    kwargs = fsdp_kwargs(flatten, **overrides)
    chosen = auto_wrap_policy(
        policy, min_num_params, own_units=own_units, root=module, exclude_wrap_modules=exclude,
        force_leaf_modules=force_leaf,
    )
    with enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs):
        return wrap_module(module, chosen, **kwargs)


def unit_paths(root: nn.Module) -> list[str]:
    """The module paths of the FSDP units in ``root``, as the unwrapped module names them (``""``: the root)."""
    units = (path for path, m in root.named_modules() if isinstance(m, FairScaleFSDP))
    return sorted(clean_path(path + ".").rstrip(".") for path in units)


@dataclass
class Sharded:
    """A module and its optimizer after the strategy's setup: wrapped, and the optimizer re-pointed."""

    root: FairScaleFSDP
    optimizer: torch.optim.Optimizer
    layout: ParameterLayout
    orders: GroupOrder

    def consolidate(self) -> dict[str, Any]:
        """The optimizer's state in the layout of a plain optimizer over the unwrapped module (rank 0)."""
        return consolidate_state(self.optimizer, self.layout, self.orders)

    def load(self, full: dict[str, Any]) -> None:
        """Load a plain optimizer's state dict: this rank's part of it."""
        load_plain_state(full, self.optimizer, self.layout, self.orders)


def shard(
    module: nn.Module, optimizer: torch.optim.Optimizer, policy: Any = None, flatten: bool = True, **kwargs: Any
) -> Sharded:
    """What ``DDPFullyShardedStrategy.setup`` does: record the layout, wrap, re-point the optimizer."""
    layout = ParameterLayout.before_wrapping(module)
    root = wrap(module, policy=policy, flatten=flatten, **kwargs)
    layout.after_wrapping(root)
    finish_wrapping(root, layout)
    orders = repoint_optimizer(optimizer, layout)
    layout.forget_originals()
    return Sharded(root, optimizer, layout, orders)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]) -> None:
    """One optimizer step on the mean squared error of ``batch``."""
    x, y = batch
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """A run of one process in this one (a Trainer on one CPU process: a gloo group of one rank); its process group
    and the environment variables it set are gone after."""
    environ = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


@contextlib.contextmanager
def fabric_on_one_process(strategy: Any, **fabric_kwargs: Any) -> Iterator[Any]:
    """``Fabric(accelerator="cpu", devices=1, strategy=strategy, **fabric_kwargs)``, launched: one process of a gloo
    group in this process; the group and the environment variables it set are gone after."""
    from lightning_fabric import Fabric

    environ = dict(os.environ)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, **fabric_kwargs)
    fabric.launch()
    try:
        yield fabric
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def mixed_precision_reference(
    dtype: torch.dtype, steps: int, accumulate: int = 1, sum_in_half: bool = False
) -> dict[str, Tensor]:
    """``Net()`` after ``steps`` SGD steps (lr 0.1) of mixed precision without sharding, each over ``accumulate`` of
    :func:`batches`: each batch's gradients computed by a copy of the model in ``dtype`` (on inputs in ``dtype``),
    summed in fp32 (as a reduction after every micro-batch does), or with ``sum_in_half`` in ``dtype`` (as
    accumulating in ``no_sync`` does), and applied in fp32."""
    reference = Net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = batches(steps * accumulate)
    for step in range(steps):
        half = copy.deepcopy(reference).to(dtype)
        for x, y in data[step * accumulate : (step + 1) * accumulate]:
            if not sum_in_half:
                half.zero_grad()
            nn.functional.mse_loss(half(x.to(dtype)).float(), y).backward()
            for param, computed in zip(reference.parameters(), half.parameters()):
                grad = computed.grad.float()
                param.grad = grad if param.grad is None or sum_in_half else param.grad + grad
        optimizer.step()
        optimizer.zero_grad()
    return reference.state_dict()


def param_groups(module: Net, flatten: bool) -> list[dict[str, Any]]:
    """Two param groups with different hyperparameters, each listing its parameters in an unusual order.

    With ``flatten=True`` a group must hold whole FSDP units, so the groups are "input/output layers" and "blocks":
    with the policy ``{nn.Linear}`` (every Linear a unit, the root holds the LayerNorms) or ``{Block}`` (the root
    holds ``inp`` and ``out``). Without flattening, weights and biases can be split.
    """
    if flatten:
        outer = [*module.out.parameters(), *module.inp.parameters()]
        inner = list(reversed(list(module.blocks.parameters())))
        return [{"params": outer, "lr": 0.05}, {"params": inner, "lr": 0.02, "weight_decay": 0.1}]
    named = list(module.named_parameters())
    weights = [p for n, p in reversed(named) if n.endswith("weight")]
    biases = [p for n, p in named if n.endswith("bias")]
    return [{"params": weights, "lr": 0.05, "weight_decay": 0.1}, {"params": biases, "lr": 0.02}]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def assert_optimizer_states_equal(actual: dict[str, Any], expected: dict[str, Any], atol: float = 1e-6) -> None:
    """Two ``optimizer.state_dict()`` results hold the same param groups and (within ``atol``) the same state."""
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        assert sorted(actual["state"][index]) == sorted(state), index
        for key, value in state.items():
            got = actual["state"][index][key]
            if isinstance(value, Tensor):
                assert got.shape == value.shape, (index, key, got.shape, value.shape)
                torch.testing.assert_close(got, value, atol=atol, rtol=0, msg=f"state {index} {key!r}")
            else:
                assert got == value, (index, key)


def assert_tensors_equal(actual: dict[str, Tensor], expected: dict[str, Tensor], atol: float = 1e-6) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].shape == value.shape, key
        torch.testing.assert_close(actual[key], value, atol=atol, rtol=0, msg=key)


def parameters_of(module: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ----------------------------------------------------------------------------------------------------------------
# Several ranks


def fairscale_chunk(tensor: Tensor, rank: int, world_size: int) -> tuple[Tensor, int]:
    """``rank``'s shard of ``tensor`` and its padding, by FairScale's rule."""
    chunks = list(torch.flatten(tensor).chunk(world_size))
    chunks += [chunks[0].new_empty(0)] * (world_size - len(chunks))
    padding = chunks[0].numel() - chunks[rank].numel()
    return nn.functional.pad(chunks[rank], [0, padding]), padding


def _numels(metadata: dict[str, Any], layout: dict[str, Any]) -> list[int]:
    """The number of real elements of each managed parameter of an optimizer layout."""
    units = metadata["param_metadata"]
    return [sum(list(units[u]["params"].values())[i]["numels"]) for u, i in layout["params"]]


def _split_views(
    state: dict[str, Any], layout: dict[str, Any], rank: int, world_size: int, numels: list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``rank``'s optimizer state and layout from one rank's (whose views cover whole original parameters): each
    view cut to ``rank``'s shard, by FairScale's rule, and numbered in the same order, group by group."""
    views, entries, groups = [], {}, []
    for group in state["param_groups"]:
        indices = []
        for j in group["params"]:
            m, piece, start, stop = layout["views"][j]
            size = -(-numels[m] // world_size)
            first = min(rank * size, numels[m])
            last = min(first + size, numels[m])
            lo, hi = max(start, first), min(stop, last)
            if lo >= hi:  # every rank holds a view of every original parameter, empty outside its shard
                lo = hi = max(min(lo, last), first)
            if j in state["state"] and lo < hi:
                entries[len(views)] = {
                    k: v[lo - start : hi - start] if isinstance(v, Tensor) and v.dim() else v
                    for k, v in state["state"][j].items()
                }
            indices.append(len(views))
            views.append((m, piece, lo - first, hi - first))
        groups.append({**group, "params": indices})
    return {"state": entries, "param_groups": groups}, {**layout, "views": views}


def split_by_hand(shard_: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """The shards ``world_size`` ranks would have saved, from the shard of one rank (which holds everything)."""
    shards = []
    for rank in range(world_size):
        metadata = copy.deepcopy(shard_["shard_metadata"])
        state_dict = {name: shard_["state_dict"][name] for name in metadata["buffer_names"]}
        for unit in metadata["param_metadata"]:
            for name, info in unit["params"].items():
                key = f"{unit['fsdp_path']}.{name}" if unit["fsdp_path"] else name
                state_dict[key], info["padding"] = fairscale_chunk(shard_["state_dict"][key], rank, world_size)
        split = [_split_views(state, layout, rank, world_size, _numels(shard_["shard_metadata"], layout))
                 for state, layout in zip(shard_["optimizer_states"], shard_["optimizer_layouts"])]
        optimizer_states = [state for state, _ in split]
        layouts = [layout for _, layout in split]
        shards.append(
            {
                **shard_,
                "state_dict": state_dict,
                "shard_metadata": metadata,
                "optimizer_states": optimizer_states,
                "optimizer_layouts": layouts,
                "world_size": world_size,
            }
        )
    return shards




def run_ranks(fn: Callable[..., Any], world_size: int, directory: Path, *args: Any, timeout: float = 60) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks of a gloo group; their return values.

    Forking (not spawning) keeps a run well under a second: the children share the imported modules. Each child
    uses one thread, as forked children must (OpenMP is not fork-safe).
    """
    # Garbage of earlier tests (process groups among it) must not be collected in a child, where the threads and
    # sockets it refers to do not exist: that crashed a rank (SIGSEGV) once a rank made garbage enough to collect.
    gc.collect()
    context = mp.start_processes(
        _rank_main, args=(fn, world_size, str(directory), args), nprocs=world_size, join=False, start_method="fork"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world_size} ranks did not finish within {timeout} s")
    return [torch.load(directory / f"rank-{rank}.pt", weights_only=False) for rank in range(world_size)]


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, directory: str, args: Sequence[Any]) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(directory, f"rank-{rank}.pt"))
    finally:
        dist.destroy_process_group()
