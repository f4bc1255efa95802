"""Benchmark: the speed of FairScale FSDP on CPU, side by side with the other ways to train the same model (issue 27).

One model, a stack of ``nn.TransformerEncoderLayer`` (4 heads per 256 features, 4x wide feed-forward, no dropout,
batch first) and a final ``LayerNorm``, regresses random targets with Adam in float32 on 2 CPU processes (gloo) with
1 thread each. Five implementations train it with the same data, seed and wrapping (each encoder layer one FSDP
unit, then the root):

* ``ours``: ``Trainer(strategy=DDPFullyShardedStrategy(auto_wrap_policy={nn.TransformerEncoderLayer}))``;
  ``ours-sync``: the same with ``lightning_fairscale.fsdp.patches.prefetch.OVERLAP_ON_CPU = False`` (FairScale's
  synchronous collectives, as before they overlapped on CPU);
* ``fairscale-loop``: a hand-written loop over ``lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel`` (after
  ``cpu_streams.install()``) with the strategy's CPU defaults, Adam over the flat shards;
* ``torch-fsdp-loop``: a hand-written loop over PyTorch's FSDP (``ModuleWrapPolicy``, ``device_id=cpu``);
* ``ours-sgo``: ``ours`` with ``sharding_strategy="SHARD_GRAD_OP"`` (no all-gather in the backward);
* ``ours-mnp``: ``DDPFullyShardedStrategy(min_num_params=100_000)``, issue 35's user: the default size policy makes
  each layer's attention and each of its two feed-forward linears a unit (18 units and the root);
* ``ddp``: ``Trainer(strategy="ddp")``; ``ddp_sharded``: ``Trainer(strategy="ddp_sharded")``.

Every configuration runs in a fresh launch (the ranks' peak memory must not mix), and the launches are interleaved
over ``--rounds`` rounds (round 1: every implementation once, then round 2...), so that a change of load on the
shared machine hits every implementation alike. A launch's step time is the median over ``--steps`` steps after
``--warmup`` steps of the time between consecutive step starts (slowest rank); an implementation's figure is the
median over its rounds. A target's ratio is the median of the rounds' own ratios (:func:`paired_ratio`: the two
launches of a round ran side by side), the ratio of the two figures beside it. Peak memory is each rank's ``VmHWM``
at the last step.

A paired launch per size (``--no-paired`` to skip) runs the engines in ONE launch, each its own model and
Adam, stepped in turn: our FairScale units with overlapped collectives in the backward's two prefetch modes
(``fairscale-post``, the default, and ``fairscale-pre``: ``backward_prefetch="BACKWARD_PRE"``) and without
(``fairscale-sync``), PyTorch's FSDP and PyTorch's ``DistributedDataParallel`` (``ddp``, what ``"ddp"`` wraps,
without the Trainer); and, for the look-ahead (the units that fit in ``bucket_cap_mb`` gathered ahead, in the
forward and in the backward), the default, ``SHARD_GRAD_OP`` (``-sgo``) and smaller units (``-split``:
``min_num_params=100_000``'s 18 in the layers) each beside the same engine gathering the next unit only
(``-one-ahead``); and ``local``, the model alone (each rank trains its own copy, no collective): each engine's
forward, backward and optimizer step against ``local``'s say what its communication and hooks add to the
computation (and what sharding saves: Adam steps a shard). On a machine whose load changes from launch to launch
these ratios are the steadier ones, but not unbiased: an engine that holds more memory (DDP: full gradients and
optimizer state) loses more of its cache to the engines stepped between its steps than in a launch of its own.

The breakdown (``--no-breakdown`` to skip) adds one more launch per implementation (ours, ours-sync, ours-sgo,
FairScale's loop, PyTorch's loop, ``"ddp"``) with timers around the parts of a step (:data:`PART_NOTES`): the
forward and backward (their own time: the computation), the engines' hooks (FairScale's and ours, torch FSDP's, DDP's
Python around the computation), the all-gathers, reduce-scatters and all-reduces (the calls, plus the waits of
asynchronous ones), the storage allocations and frees of the full parameters, ``zero_grad``, the optimizer step, and
"loop": the rest of the step (the Trainer's loop and hooks, or the hand-written loop; data). DDP's own all-reduces
run inside its C++ reducer: their waits are in its backward.

Run it from the project's root (about 45 minutes on 2 busy cores; ``--quick``: one round, the small model, ~3.5 min)::

    .venv/bin/python benchmarks/speed.py                # or: make bench BENCHMARKS=speed
    .venv/bin/python benchmarks/speed.py --quick

``--before SRC`` (the ``src`` folder of an earlier commit, e.g. ``git archive <commit> src | tar -x -C /tmp/before``)
adds ours, ``SHARD_GRAD_OP`` and ``min_num_params`` with that engine (``PYTHONPATH=SRC``) to the rounds and the
breakdown, right after the current ones, and their ratios to the table: the before and after of a change, in one run.

It writes ``benchmarks/results/speed.md``. Targets (issue 35, :data:`TARGETS`), reported in one table with each
round's ratio and never failed: ours (and ``ours-mnp``) at most 1.05x ``"ddp"`` and 1.0x PyTorch's FSDP loop,
``SHARD_GRAD_OP`` at most 1.0x ``"ddp"``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from lightning_fairscale.fsdp.patches import cpu_streams, prefetch
from lightning_fairscale.fsdp.unit import units
from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "results" / "speed.md"
LAUNCH_TIMEOUT_S = 300
LEARNING_RATE = 1e-4
WORLD_SIZE = 2

#: Model sizes by name: (width, layers). ``small`` is the issue's 4.7 M-parameter model.
SIZES: dict[str, tuple[int, int]] = {"small": (256, 6), "large": (512, 6)}
SEQUENCES, TOKENS = 8, 64  # per rank and step

IMPLEMENTATIONS: dict[str, str] = {
    "ours": "`DDPFullyShardedStrategy` (Trainer)",
    "ours-sync": "`DDPFullyShardedStrategy` (Trainer), synchronous collectives",
    "ours-sgo": '`DDPFullyShardedStrategy(sharding_strategy="SHARD_GRAD_OP")` (Trainer)',
    "ours-mnp": "`DDPFullyShardedStrategy(min_num_params=100_000)` (Trainer): the default policy, no wrap class",
    "fairscale-loop": "FairScale FSDP, hand-written loop",
    "torch-fsdp-loop": "PyTorch FSDP, hand-written loop",
    "ddp": 'Lightning `strategy="ddp"` (Trainer)',
    "ddp_sharded": '`strategy="ddp_sharded"` (Trainer)',
    "ours-compiled": "`DDPFullyShardedStrategy` (Trainer), `trainer.fit(torch.compile(model))`",
    "ddp-compiled": 'Lightning `strategy="ddp"` (Trainer), `trainer.fit(torch.compile(model))`',
    "ours-before": "`DDPFullyShardedStrategy` (Trainer), the engine of `--before`",
    "ours-sgo-before": '`DDPFullyShardedStrategy(sharding_strategy="SHARD_GRAD_OP")` (Trainer), engine of `--before`',
    "ours-mnp-before": "`DDPFullyShardedStrategy(min_num_params=100_000)` (Trainer), the engine of `--before`",
}
#: The implementations run with another engine (``--before SRC``: ``PYTHONPATH=SRC``), and the ones they stand for.
BEFORE = {"ours-before": "ours", "ours-sgo-before": "ours-sgo", "ours-mnp-before": "ours-mnp"}
#: The ``torch.compile`` backend of the compiled implementations (``--compile-backend``; inductor: torch's default).
COMPILE_BACKEND = os.environ.get("BENCH_COMPILE_BACKEND", "inductor")
#: Each compiled implementation and the eager one it is compared with.
COMPILED = {"ours-compiled": "ours", "ddp-compiled": "ddp"}
LIGHTNING = (
    "ours", "ours-sync", "ours-sgo", "ours-mnp", "ddp", "ddp_sharded", "ours-compiled", "ddp-compiled", *BEFORE
)
#: The implementations of the breakdown (one timed launch each).
BREAKDOWN_IMPLEMENTATIONS = (
    "ours", "ours-sync", "ours-sgo", "ours-mnp", "fairscale-loop", "torch-fsdp-loop", "ddp", *BEFORE
)
#: Issue 35's targets: each (implementation, the one it is compared with, the largest ratio of step times).
TARGETS = (
    ("ours", "ddp", 1.05), ("ours", "torch-fsdp-loop", 1.0), ("ours-sgo", "ddp", 1.0), ("ours-mnp", "ddp", 1.05)
)

warnings.filterwarnings(
    "ignore",
    message=".*(TypedStorage|_all_gather_base|_reduce_scatter_base|reduce_scatter_tensor|LeafSpec|workers"
    "|number of training batches|FSDP|deprecated|enable_nested_tensor).*",
)


# ----------------------------------------------------------------------------------------------------------------
# The model and the data


class Encoder(LightningModule):
    """``layers`` transformer encoder layers and a final norm; the loops use it as a plain ``nn.Module``."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[encoder_layer(width) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.layers(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return loss(self, batch)

    def configure_optimizers(self) -> Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LEARNING_RATE)


def encoder_layer(width: int) -> nn.TransformerEncoderLayer:
    """One layer: ``width // 64`` heads, 4x wide feed-forward, no dropout (the same work in every step)."""
    return nn.TransformerEncoderLayer(width, width // 64, 4 * width, dropout=0.0, batch_first=True)


def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def data_loader(width: int, steps: int) -> DataLoader:
    """``steps`` batches of ``SEQUENCES x TOKENS x width`` random inputs and targets, alike on every rank and run."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(steps * SEQUENCES, TOKENS, width, generator=generator)
    y = torch.randn(steps * SEQUENCES, TOKENS, width, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=SEQUENCES, shuffle=False)


# ----------------------------------------------------------------------------------------------------------------
# The breakdown's timers (in the workers, only with --breakdown)


class Timers:
    """Exclusive wall time per part of a step: a timed section nested in another is not counted in the outer one."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, time of timed children]
        self.enabled = False

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[0]
            self.totals[name] = self.totals.get(name, 0.0) + elapsed - frame[1]
            if self._stack:
                self._stack[-1][1] += elapsed

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.section(name):
                result = fn(*args, **kwargs)
            if kwargs.get("async_op") and result is not None:
                return _TimedWork(result, self, name)
            return result

        return timed


class _TimedWork:
    """An asynchronous collective's handle whose ``wait`` is timed under the collective's name."""

    def __init__(self, work: Any, timers: Timers, name: str) -> None:
        self._work, self._timers, self._name = work, timers, name

    def wait(self, *args: Any) -> Any:
        with self._timers.section(self._name):
            return self._work.wait(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


TIMERS = Timers()

#: Where the engines' collectives and storage calls are looked up (module, attribute, part).
_TIMED: list[tuple[str, str, str]] = [
    ("torch.distributed", "all_gather_into_tensor", "all-gather"),
    ("torch.distributed", "_all_gather_base", "all-gather"),
    ("torch.distributed", "all_gather", "all-gather"),
    ("torch.distributed", "all_gather_single", "all-gather"),
    ("torch.distributed", "reduce_scatter", "reduce-scatter"),
    ("torch.distributed", "reduce_scatter_tensor", "reduce-scatter"),
    ("torch.distributed", "_reduce_scatter_base", "reduce-scatter"),
    ("torch.distributed", "reduce_scatter_single", "reduce-scatter"),
    ("torch.distributed", "all_reduce", "all-reduce"),
    ("fairscale.nn.data_parallel.fully_sharded_data_parallel", "alloc_storage_", "alloc/free"),
    ("fairscale.nn.data_parallel.fully_sharded_data_parallel", "free_storage_", "alloc/free"),
    ("torch.distributed.fsdp._flat_param", "_alloc_storage", "alloc/free"),
    ("torch.distributed.fsdp._flat_param", "_free_storage", "alloc/free"),
    ("lightning_fairscale.fsdp.patches.prefetch", "_alloc_storage", "alloc/free"),
    ("lightning_fairscale.fsdp.patches.prefetch", "_free_storage", "alloc/free"),
]
#: The engines' hooks (their Python work around the computation: FairScale's and ours, torch FSDP's, DDP's), timed as
#: one part: (module, class or ``None`` for a module function, attribute).
_HOOKS: list[tuple[str, Optional[str], str]] = [
    *(
        ("fairscale.nn.data_parallel.fully_sharded_data_parallel", "FullyShardedDataParallel", name)
        for name in ("_lazy_init", "_rebuild_full_params", "_use_full_params", "_free_full_params",
                     "_use_fp32_param_shard", "_free_fp16_param_shard", "_register_pre_backward_hooks",
                     "_register_post_backward_hooks", "_post_backward_hook", "_post_reduction_hook",
                     "_queue_wait_for_post_backward", "_wait_for_post_backward", "_prep_grads_for_backward",
                     "_wait_for_previous_optim_step", "_cast_buffers")
    ),
    *(
        ("lightning_fairscale.fsdp.unit.units", "FullyShardedDataParallel", name)
        for name in ("_rebuild_full_params", "_use_full_params", "_free_full_params", "_post_backward_hook",
                     "_prep_grads_for_backward", "_finish_backward", "_queue_wait_for_post_backward",
                     "_post_reduction_hook")
    ),
    *(("lightning_fairscale.fsdp.unit.original_params", None, name) for name in ("before_forward", "show", "_hide")),
    *(("lightning_fairscale.fsdp.patches.prefetch", "Prefetcher", name)
      for name in ("forward_started", "forward_ended", "rebuild", "after_post_backward", "settle")),
    *((module, "AsyncReduceScatter", name)  # in `prefetch` before it had a module of its own (an engine of `--before`)
      for module in ("lightning_fairscale.fsdp.patches.reduce_scatter", "lightning_fairscale.fsdp.patches.prefetch")
      for name in ("reduce_scatter_async", "settle", "flush")),
    *(
        ("torch.distributed.fsdp._runtime_utils", None, name)
        for name in ("_pre_forward", "_post_forward", "_root_pre_forward", "_pre_backward_hook",
                     "_post_backward_hook", "_post_backward_final_callback")
    ),
    *(("torch.distributed.fsdp.fully_sharded_data_parallel", None, name)
      for name in ("_pre_forward", "_post_forward", "_root_pre_forward")),
    *(("torch.nn.parallel.distributed", "DistributedDataParallel", name)
      for name in ("_pre_forward", "_post_forward")),
]
PARTS = ("forward", "backward", "hooks", "all-gather", "reduce-scatter", "all-reduce", "alloc/free", "zero_grad",
         "optimizer", "loop")
#: What each part holds, for the report.
PART_NOTES = {
    "forward": "the forward's own time: the layers' computation (the loss included)",
    "backward": "the backward's own time: the layers' gradients, and under DDP the waits for its all-reduces (gloo,"
                " inside DDP's C++ reducer: not timed apart)",
    "hooks": "the engine's Python work around the computation: FairScale's and ours (workarounds 16 and 17),"
             " torch FSDP's pre/post forward and backward hooks, DDP's pre/post forward",
    "all-gather": "all-gather calls, and the waits of asynchronous ones",
    "reduce-scatter": "reduce-scatter calls, and the waits of asynchronous ones",
    "all-reduce": "all-reduce calls from Python (DDP's own are in the backward)",
    "alloc/free": "allocating and freeing the full parameters' storage",
    "zero_grad": "`optimizer.zero_grad`",
    "optimizer": "`Adam.step`",
    "loop": "the rest of the step: the Trainer's loop and hooks (or the hand-written loop), data, timers",
}


def install_timers() -> None:
    """Time the parts of a step in this process (see :class:`Timers`); starts disabled."""
    import importlib

    for module_name, attribute, part in _TIMED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attribute):
            setattr(module, attribute, TIMERS.wrap(part, getattr(module, attribute)))
    timed: set[tuple[int, str]] = set()  # a class that two modules name (one imports it from the other): timed once
    for module_name, class_name, attribute in _HOOKS:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(owner, class_name, None) if class_name else owner
        if owner is not None and attribute in vars(owner) and (id(owner), attribute) not in timed:
            timed.add((id(owner), attribute))
            setattr(owner, attribute, TIMERS.wrap("hooks", getattr(owner, attribute)))
    # The exchanges that replace gloo's all-gathers and reduce-scatters on CPU: their start and their wait (an engine
    # of `--before` may have none).
    try:
        from lightning_fairscale.distributed import exchanges
    except ImportError:
        exchanges = None
    if exchanges is not None:
        for kind, part in (("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter")):
            setattr(exchanges, kind, TIMERS.wrap(part, getattr(exchanges, kind)))
        exchange_wait = exchanges.Exchange.wait

        def timed_wait(self: Any) -> bool:
            with TIMERS.section("all-gather" if self.kind == "all_gather" else "reduce-scatter"):
                return exchange_wait(self)

        exchanges.Exchange.wait = timed_wait  # type: ignore[method-assign]
    original_backward = torch.Tensor.backward
    torch.Tensor.backward = TIMERS.wrap("backward", original_backward)  # type: ignore[method-assign]
    torch.optim.Adam.step = TIMERS.wrap("optimizer", torch.optim.Adam.step)  # type: ignore[method-assign]
    torch.optim.Optimizer.zero_grad = TIMERS.wrap("zero_grad", torch.optim.Optimizer.zero_grad)  # type: ignore
    # The Trainer's forward: the strategy calls the wrapped model (the engine's hooks, then `training_step`).
    from pytorch_lightning.strategies import Strategy

    Strategy.training_step = TIMERS.wrap("forward", Strategy.training_step)  # type: ignore[method-assign]


# ----------------------------------------------------------------------------------------------------------------
# The workers


class StepMarks:
    """Step starts of this rank, and what it reports."""

    def __init__(self, total_steps: int, warmup: int) -> None:
        self.starts: list[float] = []
        self.faults: list[int] = []  # minor page faults so far (first touches of fresh memory)
        self.total_steps = total_steps
        self.warmup = warmup
        self.peak_rss = 0

    def start(self) -> None:
        self.starts.append(time.perf_counter())
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        # Timers run over the measured steps only (the step after the last one only closes its interval).
        TIMERS.enabled = self.warmup < len(self.starts) <= self.total_steps - 1
        if len(self.starts) == self.total_steps:
            self.peak_rss = _common.status_kib("VmHWM") * 1024

    def result(self, impl: str, rank: int, numel: int) -> dict[str, Any]:
        return {"impl": impl, "rank": rank, "numel": numel, "starts": self.starts, "peak_rss": self.peak_rss,
                "timers": TIMERS.totals, "faults": self.faults}


class _Probe(Callback):
    def __init__(self, marks: StepMarks) -> None:
        self.marks = marks

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.marks.start()


class _TimedEncoder(Encoder):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        with TIMERS.section("forward"):
            return super().training_step(batch, batch_idx)


def run_lightning(impl: str, width: int, layers: int, total_steps: int, warmup: int, out: Path) -> None:
    impl = BEFORE.get(impl, impl)  # the engine is the one on PYTHONPATH
    torch.manual_seed(0)
    compiled = impl in COMPILED
    # A compiled model has no timers in its step (dynamo would break its graph at them under "ddp").
    model = Encoder(width, layers) if compiled else _TimedEncoder(width, layers)
    numel = sum(p.numel() for p in model.parameters())
    if impl == "ours-sync":  # as before the collectives overlapped on CPU
        prefetch.OVERLAP_ON_CPU = False
    fsdp = impl.startswith("ours")
    sharding = "SHARD_GRAD_OP" if impl == "ours-sgo" else "FULL_SHARD"
    strategy: Any = (
        DDPFullyShardedStrategy(auto_wrap_policy={nn.TransformerEncoderLayer}, sharding_strategy=sharding)
        if fsdp
        else COMPILED.get(impl, impl)
    )
    if impl == "ours-mnp":  # as the user wrote it: the size policy finds the units itself
        strategy = DDPFullyShardedStrategy(min_num_params=100_000)
    marks = StepMarks(total_steps, warmup)
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        max_steps=total_steps,
        callbacks=[_Probe(marks)],
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    trainer.fit(torch.compile(model, backend=COMPILE_BACKEND) if compiled else model, data_loader(width, total_steps))
    _common.write_rank_result(out, trainer.global_rank, marks.result(impl, trainer.global_rank, numel))
    dist.barrier()


def wrap_fairscale(
    model: Encoder, backward_prefetch: Optional[str] = "BACKWARD_POST", split: bool = False, **overrides: Any
) -> nn.Module:
    """Our FairScale unit class with the strategy's CPU defaults (``overrides`` replace them): each encoder layer a
    unit, then the root (whose ``backward_prefetch`` applies). With ``split``, also each layer's attention and its two
    feed-forward linears inside it: the 18 units of ``min_num_params=100_000`` (``ours-mnp``), and the layers."""
    cpu_streams.install()
    kwargs = {**_common.STRATEGY_CPU_UNIT_KWARGS, **overrides}
    for index, layer in enumerate(model.layers):
        if split:
            for name in ("self_attn", "linear1", "linear2"):
                setattr(layer, name, units.FullyShardedDataParallel(getattr(layer, name), **kwargs))
        model.layers[index] = units.FullyShardedDataParallel(layer, **kwargs)
    return units.FullyShardedDataParallel(model, **kwargs, backward_prefetch=backward_prefetch)


def wrap_torch_fsdp(model: Encoder) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({nn.TransformerEncoderLayer})
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))


def run_loop(impl: str, width: int, layers: int, total_steps: int, warmup: int, out: Path) -> None:
    rank, children = _common.start_ranks(WORLD_SIZE)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = Encoder(width, layers)
    numel = sum(p.numel() for p in model.parameters())
    wrapped = wrap_fairscale(model) if impl == "fairscale-loop" else wrap_torch_fsdp(model)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=LEARNING_RATE)
    marks = StepMarks(total_steps, warmup)
    dist.barrier()
    for batch in data_loader(width, total_steps):
        marks.start()
        optimizer.zero_grad(set_to_none=True)
        with TIMERS.section("forward"):
            value = loss(wrapped, batch)
        value.backward()
        optimizer.step()
    _common.write_rank_result(out, rank, marks.result(impl, rank, numel))
    dist.barrier()
    dist.destroy_process_group()
    _common.join_ranks(children)


#: The engines of the paired launch, by name: how each is built. ``-one-ahead``: the forward and the backward gather
#: the next unit only, as before issue 35's second round (``Prefetcher.ahead_budget = 0``), against what fits in
#: ``bucket_cap_mb``; ``sgo``: ``SHARD_GRAD_OP``; ``split``: the 18 units of ``min_num_params=100_000`` inside the 6
#: layers' units; ``ddp``: ``DistributedDataParallel`` (no sharding); ``local``: the model alone, each rank training
#: its own copy without a collective (the computation that every engine adds its communication and hooks to).
ENGINES = (
    "fairscale-post", "fairscale-post-one-ahead", "fairscale-sgo", "fairscale-sgo-one-ahead", "fairscale-split",
    "fairscale-split-one-ahead", "fairscale-pre", "fairscale-sync", "torch-fsdp", "ddp", "local",
)  # fmt: skip
#: The paired launch's engines compared with ``ddp``'s step time, and with ``local``'s, phase by phase.
AGAINST_DDP = ("fairscale-post", "fairscale-sgo", "fairscale-split", "torch-fsdp")
#: The phases of a step that the paired launch times apart (``optimizer``: ``zero_grad`` and ``step``).
PHASES = ("forward", "backward", "optimizer")
#: Where the paired launch's step time went, by thread: CPU time of the main thread (computation, hooks, posting
#: messages, copies), of the other threads (gloo's: no other thread runs here; they move the messages), and the wall
#: time less the CPU time of all threads (waiting, for the peer or for a core, net of threads running at once on the
#: 2 cores: it can be negative).
CPU_PARTS = ("main thread CPU", "other threads CPU", "wall less CPU")


def run_engines(width: int, layers: int, total_steps: int, out: Path) -> None:
    """One launch, the engines of :data:`ENGINES` (our FairScale units in both prefetch modes, with the look-ahead
    and without, under SHARD_GRAD_OP, in smaller units, and without overlap; PyTorch's FSDP; DDP; the model alone),
    each its own model and Adam, timed by phase (:data:`PHASES`), stepped in turn (the order rotates every step):
    the same load on the machine hits them alike, which separate launches on a busy machine cannot ensure."""
    rank, children = _common.start_ranks(WORLD_SIZE)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    engines = {}
    for name in ENGINES:
        torch.manual_seed(0)
        model = Encoder(width, layers)
        if name == "torch-fsdp":
            wrapped = wrap_torch_fsdp(model)
        elif name == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
        elif name == "local":
            wrapped = model
        else:  # the backward's prefetch mode: post (the default), pre, or none for the synchronous one
            wrapped = wrap_fairscale(
                model, "BACKWARD_PRE" if name == "fairscale-pre" else "BACKWARD_POST", split="-split" in name,
                reshard_after_forward="-sgo" not in name,
            )
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=LEARNING_RATE)
        # Read at the root's first forward: one step now, with this engine's setting.
        prefetch.OVERLAP_ON_CPU = name != "fairscale-sync"
        batches = list(data_loader(width, total_steps))
        optimizer.zero_grad(set_to_none=True)
        loss(wrapped, batches[0]).backward()
        optimizer.step()
        if name.endswith("-one-ahead"):
            wrapped._prefetcher.ahead_budget = 0
        engines[name] = (wrapped, optimizer)
    prefetch.OVERLAP_ON_CPU = True
    times: dict[str, list[float]] = {name: [] for name in ENGINES}
    phases: dict[str, list[list[float]]] = {name: [] for name in ENGINES}
    cpu: dict[str, list[list[float]]] = {name: [] for name in ENGINES}
    for index, batch in enumerate(data_loader(width, total_steps)):
        for turn in range(len(ENGINES)):
            name = ENGINES[(index + turn) % len(ENGINES)]
            wrapped, optimizer = engines[name]
            dist.barrier()
            thread_cpu, process_cpu = time.thread_time(), time.process_time()
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            zeroed = time.perf_counter()
            value = loss(wrapped, batch)
            forward_ended = time.perf_counter()
            value.backward()
            backward_ended = time.perf_counter()
            optimizer.step()
            ended = time.perf_counter()
            thread_cpu, process_cpu = time.thread_time() - thread_cpu, time.process_time() - process_cpu
            times[name].append(ended - started)
            # The step's CPU time: this (the main) thread's, and the other threads' (gloo's own); and the wall time
            # less both (waiting, net of threads that ran at once: :data:`CPU_PARTS`).
            cpu[name].append([thread_cpu, process_cpu - thread_cpu, ended - started - process_cpu])
            optimizer_time = zeroed - started + ended - backward_ended
            phases[name].append([forward_ended - zeroed, backward_ended - forward_ended, optimizer_time])
    _common.write_rank_result(out, rank, {"rank": rank, "times": times, "phases": phases, "cpu": cpu})
    dist.barrier()
    dist.destroy_process_group()
    _common.join_ranks(children)


def launch_engines(size: str, args: argparse.Namespace, work: Path) -> dict[str, dict[str, float]]:
    """The paired launch of :func:`run_engines`: each engine's median step time (``"step"``) and the medians of its
    :data:`PHASES` and :data:`CPU_PARTS`, on its slowest rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    worker = ["--worker=engines", f"--size={size}", f"--warmup={args.warmup}", f"--steps={args.paired_steps}"]
    ranks = _common.launch(Path(__file__).resolve(), worker, work / f"engines-{size}", LAUNCH_TIMEOUT_S, env)
    result = {}
    for name in ENGINES:
        steps = [statistics.median(r["times"][name][args.warmup :]) for r in ranks]
        slowest = ranks[steps.index(max(steps))]
        measured = slowest["phases"][name][args.warmup :]
        result[name] = {"step": max(steps)}
        result[name].update((phase, statistics.median(p[i] for p in measured)) for i, phase in enumerate(PHASES))
        used = slowest["cpu"][name][args.warmup :]
        result[name].update((part, statistics.median(u[i] for u in used)) for i, part in enumerate(CPU_PARTS))
    return result


# ----------------------------------------------------------------------------------------------------------------
# The parent


def launch(impl: str, size: str, args: argparse.Namespace, work: Path, tag: str, breakdown: bool) -> dict[str, Any]:
    """One fresh launch of ``impl`` on ``size``: its step time (median, slowest rank), peaks, timers per step."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if impl in BEFORE:
        env["PYTHONPATH"] = str(args.before)
    worker = [f"--worker={impl}", f"--size={size}", f"--warmup={args.warmup}", f"--steps={args.steps}"]
    if breakdown:
        worker.append("--breakdown")
    ranks = _common.launch(Path(__file__).resolve(), worker, work / f"{impl}-{size}-{tag}", LAUNCH_TIMEOUT_S, env)
    measured = range(args.warmup, args.warmup + args.steps)
    periods = [[r["starts"][i + 1] - r["starts"][i] for i in measured] for r in ranks]
    step = max(statistics.median(p) for p in periods)
    # Timers: per step, the slowest rank's (the one whose step time is reported).
    slowest = max(range(len(ranks)), key=lambda i: statistics.median(periods[i]))
    timers = {k: v / args.steps for k, v in ranks[slowest]["timers"].items()}
    if breakdown:
        timers["loop"] = max(0.0, sum(periods[slowest]) / args.steps - sum(timers.values()))
        timers["step"] = sum(periods[slowest]) / args.steps
        faults = ranks[slowest]["faults"]
        timers["faults"] = statistics.median(faults[i + 1] - faults[i] for i in measured)
    # The first step's excess over a measured one: set-up of the first step (compiling, for a compiled model).
    first = max(r["starts"][1] - r["starts"][0] for r in ranks) - step
    return {"step": step, "peak_rss": [r["peak_rss"] for r in ranks], "numel": ranks[0]["numel"], "timers": timers,
            "first_step_excess": first}


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def report(results: dict[str, dict[str, list[dict[str, Any]]]], breakdowns: dict[str, dict[str, dict]],
           paired: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace, loads: list[str],
           seconds: float) -> str:
    lines = [
        "# Speed: FairScale FSDP on CPU against PyTorch's FSDP and DDP",
        "",
        f"- Machine: {_common.machine()}; {WORLD_SIZE} CPU ranks (gloo) x 1 thread",
        f"- Versions: {_common.versions()}",
        f"- Model: `nn.TransformerEncoderLayer` x layers (width/64 heads, 4x feed-forward, no dropout) + `LayerNorm`;"
        f" float32; Adam; each layer one FSDP unit, then the root; batch {SEQUENCES} x {TOKENS} tokens per rank",
        f"- Steps: {args.warmup} warm-up, median of {args.steps} (time between step starts, slowest rank) per launch;"
        f" {args.rounds} interleaved round(s) of fresh launches; the figure is the median over rounds",
        f"- Load average (1, 5, 15 min) seen while measuring: {'; '.join(loads)}; wall time {seconds:.0f} s",
        "",
    ]
    lines += _ratio_lines(results)
    for size, by_impl in results.items():
        width, layers = SIZES[size]
        by_impl = {impl: runs for impl, runs in by_impl.items() if runs}  # none with --rounds 0
        if not by_impl or "ours" not in by_impl:
            lines += [f"## {size.capitalize()} ({layers} layers, width {width})", ""]
            lines += _paired_lines(size, paired, args)
            continue
        numel = next(iter(by_impl.values()))[0]["numel"]
        medians = {impl: statistics.median(r["step"] for r in runs) for impl, runs in by_impl.items()}
        ours = medians["ours"]
        lines += [
            f"## {size.capitalize()}: {numel / 1e6:.1f} M parameters ({layers} layers, width {width})",
            "",
            "| Implementation | Step time (s) | Rounds (s) | Ours vs. it | Peak RSS per rank (MiB) |",
            "| --- | ---: | --- | ---: | --- |",
        ]
        for impl, runs in by_impl.items():
            rounds = ", ".join(f"{r['step']:.3f}" for r in runs)
            peak = max(max(r["peak_rss"]) for r in runs)
            ranks_peak = " / ".join(f"{p / _common.MIB:,.0f}" for p in runs[-1]["peak_rss"])
            ratio = "(reference)" if impl == "ours" else f"{ours / medians[impl]:.3f}x"
            lines.append(f"| {IMPLEMENTATIONS[impl]} | {medians[impl]:.3f} | {rounds} | {ratio} | {ranks_peak}"
                         f" (max {peak / _common.MIB:,.0f}) |")
        lines.append("")
        targets = [
            f"{impl} / {other} = {ratio:.3f}x, the median of the rounds' ratios (target <= {limit:.2f}x:"
            f" {'PASS' if ratio <= limit else 'MISS'})"
            for impl, other, limit in TARGETS
            if impl in medians and other in medians
            for ratio in [paired_ratio(by_impl[impl], by_impl[other])]
        ]
        if "ours-sync" in medians:
            targets.append(f"ours / ours with synchronous collectives = {ours / medians['ours-sync']:.3f}x")
        for compiled, eager in COMPILED.items():
            if compiled in medians and eager in medians:
                setup = statistics.median(r["first_step_excess"] for r in by_impl[compiled])
                setup_eager = statistics.median(r["first_step_excess"] for r in by_impl[eager])
                targets.append(
                    f"{compiled} ({args.compile_backend}) / {eager} = {medians[compiled] / medians[eager]:.3f}x;"
                    f" compile time (first step's excess over a step, compiled minus eager) ="
                    f" {setup - setup_eager:.1f} s"
                )
        if "ddp_sharded" in medians and "ddp" in medians:
            targets.append(f"ddp_sharded / ddp = {medians['ddp_sharded'] / medians['ddp']:.3f}x")
        lines += [f"- {t}" for t in targets] + [""]
        lines += _paired_lines(size, paired, args)
        if size in breakdowns:
            lines += [
                f"### Where a step's time goes ({size}; ms per step, slowest rank, one launch each with timers)",
                "",
                "| Part | " + " | ".join(IMPLEMENTATIONS[i] for i in breakdowns[size]) + " |",
                "| --- |" + " ---: |" * len(breakdowns[size]),
            ]
            for part in (*PARTS, "step"):
                cells = [f"{t.get(part, 0.0) * 1000:.1f}" for t in breakdowns[size].values()]
                lines.append(f"| {part} | " + " | ".join(cells) + " |")
            cells = [f"{t.get('faults', 0):,.0f}" for t in breakdowns[size].values()]
            lines.append("| minor page faults per step (count) | " + " | ".join(cells) + " |")
            lines.append("")
    lines += [
        "The parts of the breakdown (exclusive times: a timed part inside another counts in the inner one only):",
        "",
        *(f"- {part}: {note}" for part, note in PART_NOTES.items()),
        "",
        "Timers cost a little time of their own (in the parts they wrap). Minor page faults: first touches of memory"
        " fresh from the kernel (freed full parameters and gradients, allocated again).",
        "",
        "Regenerate with `.venv/bin/python benchmarks/speed.py` (`--quick` to check that it runs).",
    ]
    return "\n".join(lines) + "\n"


def round_ratios(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[float]:
    """The rounds' own ratios of step times: round i's launch over round i's."""
    return [a["step"] / b["step"] for a, b in zip(mine, theirs, strict=True)]


def paired_ratio(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float:
    """The median of :func:`round_ratios`: the two launches of a round ran side by side, so what slowed the machine
    for a while slowed both, and their ratio keeps little of it.

    Example:
        >>> paired_ratio([{"step": 1.1}, {"step": 2.0}, {"step": 1.0}], [{"step": 1.0}, {"step": 2.0}, {"step": 0.8}])
        1.1
    """
    return statistics.median(round_ratios(mine, theirs))


def _ratio_lines(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """One table of the targets' ratios (issue 35), each with its rounds' ratios (round i over round i)."""
    rows = []
    pairs: list[tuple[str, str, Optional[float]]] = [*TARGETS]
    pairs += [(current, before, None) for before, current in BEFORE.items()]  # what changed since --before
    for size, by_impl in results.items():
        for impl, other, limit in pairs:
            mine, theirs = by_impl.get(impl), by_impl.get(other)
            if not mine or not theirs:
                continue
            median = paired_ratio(mine, theirs)
            of_medians = statistics.median(r["step"] for r in mine) / statistics.median(r["step"] for r in theirs)
            rounds = ", ".join(f"{ratio:.3f}" for ratio in round_ratios(mine, theirs))
            target = "--" if limit is None else f"<= {limit:.2f}x"
            verdict = "" if limit is None else "PASS" if median <= limit else "MISS"
            rows.append(f"| {size} | {impl} / {other} | {median:.3f}x | {rounds} | {of_medians:.3f}x | {target}"
                        f" | {verdict} |")
    if not rows:
        return []
    return [
        "## Ratios (issue 35's targets)",
        "",
        "Step time over step time. The verdict is on the median of the rounds' own ratios (round i's launch over round"
        " i's, launched side by side: a slow spell of the machine slows both); the ratio of the two step times in the"
        " tables below (the median over each one's rounds) beside it.",
        "",
        "| Size | Ratio | Median of the rounds' ratios | Rounds | Ratio of the medians | Target | |",
        "| --- | --- | ---: | --- | ---: | ---: | --- |",
        *rows,
        "",
    ]


def _paired_lines(size: str, paired: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> list[str]:
    if size not in paired:
        return []
    times = {name: figures["step"] for name, figures in paired[size].items()}
    lines = [
        f"### The engines in one launch, stepped in turn ({size}; median of {args.paired_steps} steps each)",
        "",
        "| Engine | Step time (s) | vs. PyTorch FSDP |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {t:.3f} | {t / times['torch-fsdp']:.3f}x |" for name, t in times.items()]
    pairs = [(name, f"{name}-one-ahead") for name in times if f"{name}-one-ahead" in times]
    if pairs:
        title = "The look-ahead (what fits in `bucket_cap_mb`, forward and backward) against the next unit only:"
        lines += ["", title, ""]
        lines += [f"- {name} / {other} = {times[name] / times[other]:.3f}x" for name, other in pairs]
    if "ddp" in times:
        lines += ["", "Against `DistributedDataParallel` in the same launch (no Trainer):", ""]
        lines += [f"- {name} / ddp = {times[name] / times['ddp']:.3f}x" for name in AGAINST_DDP if name in times]
    if "local" in times:
        lines += ["", *_added_lines(paired[size])]
    return lines + [""]


def _added_lines(figures: dict[str, dict[str, float]]) -> list[str]:
    """What each engine of the paired launch adds to ``local``'s computation (ms per step, phase by phase)."""
    local = figures["local"]
    parts = (*PHASES, "step", *(p for p in CPU_PARTS if p in local))
    lines = [
        "What each engine adds to the computation alone (`local`: each rank trains its own copy, no collective), in"
        " ms per step (median of each part on the engine's slowest rank, so the parts need not add up to the step;"
        " `optimizer`: `step` and `zero_grad`, less for a sharded engine: Adam steps a shard). The step by thread:"
        " its main thread's CPU time, its other threads' (gloo's, which move the messages), and the wall time less"
        " the CPU time of all threads (the rank waiting, for the peer or for a core, net of its threads running at"
        " once: it can be negative): with 2 ranks on 2 cores a step is CPU-bound, so CPU time that any thread adds"
        " is step time.",
        "",
        "| Engine | " + " | ".join(parts) + " |",
        "| --- | " + " | ".join("---:" for _ in parts) + " |",
        "| local (its own time) | " + " | ".join(f"{local[p] * 1e3:.1f}" for p in parts) + " |",
    ]
    for name in (*AGAINST_DDP, "ddp"):
        if name in figures:
            added = [f"{(figures[name][p] - local[p]) * 1e3:+.1f}" for p in parts]
            lines.append(f"| {name} | " + " | ".join(added) + " |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    current = [impl for impl in IMPLEMENTATIONS if impl not in BEFORE]
    parser.add_argument("--impls", nargs="+", choices=list(IMPLEMENTATIONS), default=current)
    parser.add_argument("--before", type=Path, help="the src folder of an earlier engine (git archive): adds ours,"
                        " ours-sgo and ours-mnp with it (ours-before, ...) to the rounds and the breakdown")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the timed launches")
    parser.add_argument("--quick", action="store_true", help="one round, the small model, few steps")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--compile-backend", default=COMPILE_BACKEND, help="torch.compile backend of the *-compiled")
    parser.add_argument("--paired-steps", type=int, default=20, help="measured steps of the paired engines launch")
    parser.add_argument("--no-paired", dest="paired", action="store_false", help="skip the paired engines launch")
    parser.add_argument("--worker", choices=[*IMPLEMENTATIONS, "engines"], help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=list(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", dest="breakdown_worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.sizes, args.warmup, args.steps, args.paired_steps = 1, ["small"], 2, 4, 4
        if args.output == OUTPUT:
            args.output = Path(tempfile.gettempdir()) / "speed-quick.md"
    if args.before and not args.worker:
        args.before = args.before.resolve()
        for before, current in BEFORE.items():  # each right after the one it stands for
            if before not in args.impls and current in args.impls:
                args.impls.insert(args.impls.index(current) + 1, before)
    args.impls = [i for i in args.impls if i not in BEFORE or args.before]
    total_steps = args.warmup + args.steps + 1
    os.environ["BENCH_COMPILE_BACKEND"] = args.compile_backend  # the workers read it (they inherit the environment)

    if args.worker:
        _common.quiet_known_warnings()
        if args.breakdown_worker:
            install_timers()
        width, layers = SIZES[args.size]
        if args.worker == "engines":
            run_engines(width, layers, args.warmup + args.paired_steps, args.out)
            return 0
        run = run_lightning if args.worker in LIGHTNING else run_loop
        run(args.worker, width, layers, total_steps, args.warmup, args.out)
        return 0

    started = time.perf_counter()
    loads = [f"before {loadavg()}"]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {i: [] for i in args.impls} for s in args.sizes}
    breakdowns: dict[str, dict[str, dict]] = {}
    paired: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as scratch:
        work = Path(scratch)
        for size in args.sizes:
            if args.paired:
                paired[size] = launch_engines(size, args, work)
                steps = {name: round(figures["step"], 4) for name, figures in paired[size].items()}
                print(f"  {size} paired engines: {steps} (load {loadavg()})", flush=True)
            for round_index in range(args.rounds):
                for impl in args.impls:
                    result = launch(impl, size, args, work, f"r{round_index}", breakdown=False)
                    results[size][impl].append(result)
                    print(f"  {size} round {round_index + 1} {impl}: {result['step']:.3f} s"
                          f" (load {loadavg()})", flush=True)
                loads.append(f"{size} round {round_index + 1}: {loadavg()}")
            if args.breakdown:
                breakdowns[size] = {}
                for impl in (i for i in BREAKDOWN_IMPLEMENTATIONS if i in args.impls):
                    breakdowns[size][impl] = launch(impl, size, args, work, "timed", breakdown=True)["timers"]
                    print(f"  {size} breakdown {impl}: done", flush=True)
    text = report(results, breakdowns, paired, args, loads, time.perf_counter() - started)
    _common.publish(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
