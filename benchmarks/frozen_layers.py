"""Benchmark: what LoRA-style fine-tuning costs per rank under ``DDPFullyShardedStrategy``: a frozen backbone with
small trainable adapters inside the same FSDP units, against the same model fully trainable.

The model is a stack of residual MLP blocks (``Block``: ``x + down(GELU(up(LayerNorm(x))))``, 4x wide hidden
layer) between an input projection and an output head, about 52 M parameters. In every block ``up`` and ``down`` get
a low-rank adapter (LoRA: ``y = W x + b + B A x``, ``A`` of ``rank x in`` and ``B`` of ``out x rank``, ``B`` zero at the
start), about 1% of the parameters. Adam over ``self.parameters()`` (the frozen ones included: they must get no
state), float32, 2 processes. Three configurations, each in fresh launches:

* ``full``: every parameter trainable; one FSDP unit per block (``auto_wrap_policy={LoRABlock}``), the rest in the
  root unit.
* ``lora``: only the adapters trainable, the same units: each block's unit holds its frozen weights and its adapters
  together. Under flattening the optimizer holds views of the original parameters, so only the adapters' elements
  get Adam state. The backward still computes a gradient for the whole flat parameter of a unit that trains
  (frozen elements included, as PyTorch's FSDP with ``use_orig_params=True`` does), so gradient memory does not
  shrink.
* ``lora-own-units``: only the adapters trainable, but each frozen ``nn.Linear`` is a unit of its own
  (``auto_wrap_policy={LoRABlock, nn.Linear}``): a block's unit holds its adapters and its LayerNorm, and FairScale
  computes no gradient for the all-frozen units.

Per rank, from the ``lora`` run on: the bytes of optimizer state, parameters and gradients after an optimizer step
(``trainer.strategy.memory_figures()``), against what they should be from the FSDP layout (FairScale's sharding rule:
a flat parameter of ``n`` elements is cut in ``N`` chunks of ``ceil(n / N)``, the last one padded): Adam state =
8 bytes x the trainable elements in this rank's shards + 4 bytes (``step``) per trainable original parameter this
rank holds a piece of; parameters = 4 bytes x the shards (4Ψ/N plus padding); gradients = 4 bytes x the shards of
every unit that trains. Also the peak resident set of a steady training step above its resting state (``VmHWM``
reset before the step, with glibc's mmap threshold fixed so that freed tensors leave the resident set, see
``benchmarks/activation_checkpointing.py``) and the median step time (a second launch with the default allocator).

Target: in the ``lora`` run, every rank's Adam state within 5% of 8 x (trainable elements) / N plus its ``step``
tensors, i.e. about 1% of the ``full`` run's. A shard is a contiguous range of a unit's flat parameter, so a rank
holds the adapters that happen to fall in its half: the report gives each rank's exact expectation too.

Run it from the project's root (three and a half to five minutes on two CPU cores, depending on their load)::

    .venv/bin/python benchmarks/frozen_layers.py            # or: make bench BENCHMARKS=frozen_layers
    .venv/bin/python benchmarks/frozen_layers.py --width 512 --depth 4

It prints a markdown table and writes it to ``benchmarks/results/frozen_layers.md``; a missed target is reported
(``MISS``), not an error, unless ``--strict`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel as FairScaleFSDP
from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import Block  # noqa: E402

from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "results" / "frozen_layers.md"
MIB = _common.MIB
CONFIGS = ("full", "lora", "lora-own-units")
#: Adam's state per trainable element (``exp_avg`` and ``exp_avg_sq``, float32), and its ``step`` tensor per parameter.
ADAM_BYTES_PER_ELEMENT = 8
STEP_BYTES = 4
#: The target: the ``lora`` run's Adam state on every rank within this of 8 x trainable / N plus its ``step`` tensors.
TARGET_TOLERANCE = 0.05
CONFIG_TIMEOUT_S = 600

_common.quiet_known_warnings()


# ----------------------------------------------------------------------------------------------------------------
# The model


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T``: a linear layer with a low-rank adapter (``A`` random, ``B`` zero at the start).

    The adapter's matrices are parameters of this module, not layers of their own, so that wrapping ``nn.Linear``
    separately puts only the base layer in its unit.
    """

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRABlock(Block):
    """The benchmarks' block (``_common.wide_block``) with a LoRA adapter on ``up`` and on ``down``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__(width, hidden=4 * width)
        self.up = LoRALinear(self.up, rank)  # type: ignore[assignment]
        self.down = LoRALinear(self.down, rank)  # type: ignore[assignment]


class AdaptedStack(LightningModule):
    """An input projection, ``depth`` LoRA blocks, a final norm and a head, regressing a random target.

    With ``frozen`` only the adapters train. The optimizer gets every parameter, frozen ones included, as a user who
    freezes layers after building the optimizer's parameter list would: they must get no state.
    """

    def __init__(self, width: int, depth: int, rank: int, frozen: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[LoRABlock(width, rank) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)
        if frozen:
            for name, param in self.named_parameters():
                param.requires_grad_(name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.stem(x))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def build(config: str, width: int, depth: int, rank: int) -> tuple[AdaptedStack, set[type[nn.Module]]]:
    """The model of ``config`` and its auto-wrap policy."""
    model = AdaptedStack(width, depth, rank, frozen=config != "full")
    policy: set[type[nn.Module]] = {LoRABlock, nn.Linear} if config == "lora-own-units" else {LoRABlock}
    return model, policy


# ----------------------------------------------------------------------------------------------------------------
# What a rank should hold, from the FSDP layout


def expected_figures(root: nn.Module, trainable: dict[tuple[int, str], bool], rank: int, world: int) -> dict[str, int]:
    """The bytes this rank should hold, from FairScale's flat parameters and the original ``requires_grad`` flags.

    Args:
        root: the wrapped model.
        trainable: ``requires_grad`` of every original parameter before wrapping, by ``(id(owner module), name)``
            (FairScale's ``_param_infos`` name each flat parameter's pieces by their owner module and name).
        rank: this rank.
        world: the number of ranks.

    Returns:
        ``trainable_elements`` and ``trainable_views`` in this rank's shards; ``optimizer_state``, ``parameters`` and
        ``gradients`` bytes; ``trainable_total`` and ``elements_total`` of the whole model; ``frozen_units_full``,
        the bytes of the unsharded parameters of the units that do not train.
    """
    out = dict.fromkeys(("trainable_elements", "trainable_views", "parameters", "gradients"), 0)
    out |= {"trainable_total": 0, "elements_total": 0, "frozen_units_full": 0}
    for unit in root.modules():
        if not isinstance(unit, FairScaleFSDP):
            continue
        for flat in unit.params:
            numels = list(flat._param_numels)
            chunk = math.ceil(sum(numels) / world)  # torch.chunk's rule, which FairScale shards with
            lo, hi = rank * chunk, (rank + 1) * chunk
            offset, trains = 0, False
            for (_, owner, name), numel in zip(flat._param_infos, numels):
                held = max(0, min(hi, offset + numel) - max(lo, offset))
                if trainable[(id(owner), name)]:
                    trains = True
                    out["trainable_total"] += numel
                    out["trainable_elements"] += held
                    out["trainable_views"] += held > 0
                out["elements_total"] += numel
                offset += numel
            out["parameters"] += 4 * chunk
            out["gradients"] += 4 * chunk if trains else 0
            out["frozen_units_full"] += 0 if trains else 4 * sum(numels)
    out["optimizer_state"] = ADAM_BYTES_PER_ELEMENT * out["trainable_elements"] + STEP_BYTES * out["trainable_views"]
    return out


# ----------------------------------------------------------------------------------------------------------------
# One configuration (a worker launch: Lightning runs this script again for rank 1)


class StepProbe(Callback):
    """Times every training step and, with ``measure_memory``, its peak resident set above the resting state; counts
    what this rank holds after the last step's optimizer step."""

    def __init__(self, measure_memory: bool, total_steps: int) -> None:
        self.measure_memory = measure_memory
        self.total_steps = total_steps
        self.steps: list[dict[str, float]] = []
        self.figures: dict[str, float] = {}
        self.threads = 0
        self._resting = 0
        self._start = self._cpu_start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.threads = torch.get_num_threads()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        gc.collect()
        self._resting = _common.status_kib("VmRSS") * 1024
        if self.measure_memory:
            _common.reset_peak_rss()
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        seconds, cpu_seconds = time.perf_counter() - self._start, time.process_time() - self._cpu_start
        peak = _common.status_kib("VmHWM") * 1024
        self.steps.append({"seconds": seconds, "cpu_seconds": cpu_seconds, "resting": self._resting, "peak": peak})
        if len(self.steps) == self.total_steps:  # after the optimizer step, before the next zero_grad
            self.figures = trainer.strategy.memory_figures()  # type: ignore[attr-defined]


def run_worker(config: str, measure_memory: bool, args: argparse.Namespace, out_dir: Path) -> None:
    """Train ``args.warmup + args.steps`` steps of ``config``; each rank writes ``rank<N>.json`` to ``out_dir``."""
    seed_everything(0, workers=True, verbose=False)
    model, policy = build(config, args.width, args.depth, args.rank)
    trainable = {
        (id(owner), name): param.requires_grad for owner in model.modules() for name, param in owner._parameters.items()
    }
    total_steps = args.warmup + args.steps
    probe = StepProbe(measure_memory, total_steps)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPFullyShardedStrategy(auto_wrap_policy=policy),
        max_steps=total_steps,
        callbacks=[probe],
        **_common.QUIET_TRAINER,
    )
    rows = args.batch * trainer.world_size * total_steps
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(*(torch.randn(rows, args.width, generator=generator) for _ in range(2)))
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    assert trainer.strategy.model is not None
    expected = expected_figures(trainer.strategy.model, trainable, trainer.global_rank, trainer.world_size)
    result = {
        "config": config,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "threads": probe.threads,
        "process_peak": _common.status_kib("VmHWM") * 1024,
        "figures": probe.figures,
        "expected": expected,
        "steps": probe.steps[args.warmup :],
    }
    _common.write_rank_result(out_dir, trainer.global_rank, result)
    dist.barrier()  # every rank's file is written before rank 0 (the process the parent waits for) returns
    dist.destroy_process_group()  # left open, gloo's threads occasionally abort the process at exit


# ----------------------------------------------------------------------------------------------------------------
# The parent: two launches per configuration, then the report


@dataclasses.dataclass
class ConfigResult:
    """One configuration, per rank: ``ranks`` from the memory launch, ``timed`` from the timing launch."""

    name: str
    ranks: list[dict[str, Any]]
    timed: list[dict[str, Any]]

    def figure(self, rank: int, key: str) -> float:
        return self.ranks[rank]["figures"][f"memory/{key}_bytes"]

    def expected(self, rank: int, key: str) -> int:
        return self.ranks[rank]["expected"][key]

    def peak_above_resting(self, rank: int) -> int:
        return int(statistics.median(s["peak"] - s["resting"] for s in self.ranks[rank]["steps"]))

    def resting(self, rank: int) -> int:
        return int(statistics.median(s["resting"] for s in self.ranks[rank]["steps"]))

    @property
    def step_seconds(self) -> float:
        return max(statistics.median(s["seconds"] for s in rank["steps"]) for rank in self.timed)

    @property
    def cpu_seconds(self) -> float:
        return max(statistics.median(s["cpu_seconds"] for s in rank["steps"]) for rank in self.timed)


def launch(config: str, mode: str, argv: list[str], work: Path) -> list[dict[str, Any]]:
    """One fresh 2-process launch of ``config``; ``mode`` is ``"memory"`` (fixed mmap threshold) or ``"time"``."""
    env = dict(os.environ)
    if mode == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(_common.MALLOC_MMAP_THRESHOLD)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes on any machine: the figures are comparable
    started = time.perf_counter()
    worker = [*argv, "--worker", config, "--mode", mode]
    ranks = _common.launch(Path(__file__).resolve(), worker, work / f"{config}-{mode}", CONFIG_TIMEOUT_S, env)
    print(f"  {config} ({mode}): done in {time.perf_counter() - started:.0f} s", flush=True)
    if len(ranks) != ranks[0]["world_size"]:
        raise RuntimeError(f"configuration {config!r}: {len(ranks)} of {ranks[0]['world_size']} ranks reported")
    return ranks


def _kib(value: float) -> str:
    return f"{value / 1024:,.1f}"


def _per_rank(values: list[str]) -> str:
    return " / ".join(values)


def report(args: argparse.Namespace, results: dict[str, ConfigResult], conditions: str) -> tuple[str, bool]:
    """The markdown report, and whether the target was met; ``conditions``: the machine's load during the run."""
    full, lora = results["full"], results["lora"]
    first = full.ranks[0]
    world = first["world_size"]
    ranks = range(world)
    total = first["expected"]["elements_total"]
    trainable = lora.ranks[0]["expected"]["trainable_total"]
    lines = [
        "# Frozen layers (LoRA-style fine-tuning): memory and step time per rank",
        "",
        f"- Machine: {_common.machine()}; {world} CPU processes (gloo), {first['threads']} thread(s) each",
        f"- Versions: {_common.versions()}",
        f"- Conditions: {conditions}",
        f"- Model: {args.depth} residual MLP blocks of width {args.width} (hidden {4 * args.width}) between an input"
        f" projection and a head, a rank-{args.rank} LoRA adapter on both linear layers of every block:"
        f" Ψ = {total / 1e6:.2f} M parameters, {trainable:,} of them in adapters ({trainable / total:.2%})",
        f"- Batch per process: {args.batch} rows; float32; `torch.optim.Adam(self.parameters())`, frozen ones"
        " included",
        f"- Steps: {args.warmup} warm-up, then {args.steps} measured; each configuration in two fresh launches"
        " (memory with a fixed mmap threshold, time with the default allocator)",
        "- Held bytes: `trainer.strategy.memory_figures()` after the last optimizer step; expected from the FSDP"
        " layout (FairScale's shards, padding included)",
        "- Peak step memory: `VmHWM` after the step (reset before it) minus `VmRSS` before it, median over the"
        " measured steps; resting = that `VmRSS`",
        "- Step time: median over the measured steps, slowest rank, wall time and the process's CPU time (which"
        " depends much less on other programs using the cores); process peak: `VmHWM` of the whole timing launch",
        "- Configurations: `full` (everything trainable, one unit per block), `lora` (only the adapters trainable,"
        " the same units: frozen weights and adapters share each block's unit), `lora-own-units` (only the adapters"
        " trainable, every frozen `nn.Linear` a unit of its own: a block's unit holds its adapters and its LayerNorm)",
        "",
        "Per rank (`rank 0 / rank 1`), MiB:",
        "",
        "| Configuration | Adam state | Expected | Parameters | Expected | Gradients | Expected"
        " | Peak step above resting | Resting RSS | Median step (s) | CPU s / step | Process peak |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results.values():
        lines.append(
            f"| {result.name}"
            f" | {_per_rank([_common.mib(result.figure(r, 'optimizer_state')) for r in ranks])}"
            f" | {_per_rank([_common.mib(result.expected(r, 'optimizer_state')) for r in ranks])}"
            f" | {_per_rank([_common.mib(result.figure(r, 'parameters')) for r in ranks])}"
            f" | {_per_rank([_common.mib(result.expected(r, 'parameters')) for r in ranks])}"
            f" | {_per_rank([_common.mib(result.figure(r, 'gradients')) for r in ranks])}"
            f" | {_per_rank([_common.mib(result.expected(r, 'gradients')) for r in ranks])}"
            f" | {_per_rank([_common.mib(result.peak_above_resting(r)) for r in ranks])}"
            f" | {_per_rank([_common.mib(result.resting(r)) for r in ranks])}"
            f" | {result.step_seconds:.3f} | {result.cpu_seconds:.3f}"
            f" | {_per_rank([_common.mib(rank['process_peak']) for rank in result.timed])} |"
        )
    # The target: Adam state of the lora run against 8 x trainable / N plus the rank's step tensors.
    adam = ADAM_BYTES_PER_ELEMENT * trainable / world
    formula = [adam + STEP_BYTES * lora.expected(r, "trainable_views") for r in ranks]
    measured = [lora.figure(r, "optimizer_state") for r in ranks]
    exact = [lora.expected(r, "optimizer_state") for r in ranks]
    vs_formula = [m / f - 1 for m, f in zip(measured, formula)]
    vs_exact = [m / e - 1 for m, e in zip(measured, exact)]
    mean_vs_formula = sum(measured) / sum(formula) - 1
    target_ok = all(abs(d) <= TARGET_TOLERANCE for d in vs_formula)
    exact_ok = all(abs(d) <= TARGET_TOLERANCE for d in vs_exact)
    share = sum(measured) / sum(full.figure(r, "optimizer_state") for r in ranks)
    lines += [
        "",
        "| Target (`lora`) | Expected (KiB per rank) | Measured (KiB per rank) | Deviation | Result |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| Adam state within {TARGET_TOLERANCE:.0%} of 8 B x trainable / N + 4 B per `step` tensor"
        f" | {_per_rank([_kib(f) for f in formula])} | {_per_rank([_kib(m) for m in measured])}"
        f" | {_per_rank([f'{d:+.1%}' for d in vs_formula])} (mean of ranks {mean_vs_formula:+.1%})"
        f" | {_common.verdict(target_ok)} |",
        f"| Adam state within {TARGET_TOLERANCE:.0%} of 8 B x the trainable elements of this rank's shards"
        f" + 4 B per `step` tensor | {_per_rank([_kib(e) for e in exact])} | {_per_rank([_kib(m) for m in measured])}"
        f" | {_per_rank([f'{d:+.1%}' for d in vs_exact])} | {_common.verdict(exact_ok)} |",
        "",
        f"Adam state of `lora` against `full`: {share:.2%} (adapters: {trainable / total:.2%} of the parameters).",
        "",
    ]
    lines += notes(results, trainable)
    lines += ["", "Regenerate with `make bench BENCHMARKS=frozen_layers` or"
              " `.venv/bin/python benchmarks/frozen_layers.py`."]
    return "\n".join(lines) + "\n", target_ok


def notes(results: dict[str, ConfigResult], trainable: int) -> list[str]:
    """What the numbers say: gradients, resting memory, the all-frozen units' step peak, the adapters' split."""
    full, lora = results["full"], results["lora"]
    ranks = range(len(full.ranks))

    def mib(result: ConfigResult, key: str) -> str:
        return _per_rank([_common.mib(result.figure(r, key)) for r in ranks])

    rest_saved = [full.resting(r) - lora.resting(r) for r in ranks]
    held = [lora.ranks[r]["expected"]["trainable_elements"] for r in ranks]
    lines = [
        f"Gradients: `lora` holds {mib(lora, 'gradients')} MiB of gradients per rank, as much as `full`"
        f" ({mib(full, 'gradients')} MiB) less its all-frozen root unit: the backward computes the gradient of a"
        " unit's whole flat parameter, frozen elements included (as PyTorch's FSDP with `use_orig_params=True` does),"
        " and reduce-scatters it; only the adapters' slices of it reach the optimizer. So a step of `lora` costs"
        f" about what a step of `full` costs, less Adam's update: {lora.step_seconds / full.step_seconds:.2f}x its"
        f" time here (CPU time {lora.cpu_seconds / full.cpu_seconds:.2f}x).",
        "",
        "Resting memory (before a step): `lora` is"
        f" {_per_rank([_common.mib(d) for d in rest_saved])} MiB below `full`, the"
        f" Adam state it does not hold ({mib(full, 'optimizer_state')} MiB in `full`).",
    ]
    if "lora-own-units" in results:
        own = results["lora-own-units"]
        frozen_full = own.ranks[0]["expected"]["frozen_units_full"]
        rest_own = [lora.resting(r) - own.resting(r) for r in ranks]
        lines[-1] += (
            f" `lora-own-units` is another {_per_rank([_common.mib(d) for d in rest_own])} MiB below `lora`: FairScale"
            f" computes no gradient for units that do not train, so it holds {mib(own, 'gradients')} MiB of"
            " gradients per rank (the adapters' and the LayerNorms' shards), and its step is"
            f" {own.step_seconds / full.step_seconds:.2f}x the time of `full`'s (CPU time"
            f" {own.cpu_seconds / full.cpu_seconds:.2f}x): no weight gradients for the frozen layers, nothing to"
            " reduce-scatter for them."
        )
        lines += [
            "",
            "Peak of a step above resting: `lora-own-units`"
            f" {_per_rank([_common.mib(own.peak_above_resting(r)) for r in ranks])} MiB,"
            f" `lora` {_per_rank([_common.mib(lora.peak_above_resting(r)) for r in ranks])} MiB. FairScale gathers a"
            " unit again for the backward (its input's gradient needs the weights) and frees it in the post-backward"
            " hook of its parameters, which never fires for parameters that do not require gradients: a frozen unit"
            " is freed only at the end of the whole backward, so at that point a rank holds every frozen unit"
            f" unsharded at once, {_common.mib(frozen_full)} MiB of parameters in `lora-own-units`. Units that mix"
            " frozen and trainable parameters are freed one by one as their gradients are reduced.",
        ]
    lines += [
        "",
        "Split of the adapters: a shard is a contiguous range of each unit's flat parameter, so a rank holds the"
        f" adapter elements that fall in its range: {_per_rank([f'{h:,}' for h in held])} of the {trainable:,}"
        " trainable elements here. The total over the ranks is exact; a rank's share depends on where the adapters"
        " sit in the unit's parameter order.",
    ]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark (or, with ``--worker``, one configuration's training). Returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024, help="model width")
    parser.add_argument("--depth", type=int, default=6, help="number of blocks")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    parser.add_argument("--batch", type=int, default=32, help="rows per process and step")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the markdown report")
    parser.add_argument("--strict", action="store_true", help="exit with code 1 when the target is missed")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["memory", "time"], default="memory", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(args.worker, args.mode == "memory", args, args.out)
        return 0
    if not Path("/proc/self/clear_refs").exists():
        print("Measuring memory needs Linux's /proc/self/clear_refs (to reset the peak resident set).")
        return 1
    sizes = [f"--{name}={getattr(args, name)}" for name in ("width", "depth", "rank", "batch", "warmup", "steps")]
    print(f"Frozen layers benchmark: {', '.join(CONFIGS)}", flush=True)
    results: dict[str, ConfigResult] = {}
    started, conditions = time.perf_counter(), f"before: {_common.load_average()}"
    with tempfile.TemporaryDirectory(prefix="bench-frozen-") as work:
        for config in CONFIGS:
            memory = launch(config, "memory", sizes, Path(work))
            timed = launch(config, "time", sizes, Path(work))
            results[config] = ConfigResult(config, memory, timed)
    wall = time.perf_counter() - started
    conditions += f"; after: {_common.load_average()}; wall time of the whole benchmark {wall:.0f} s"
    text, met = report(args, results, conditions)
    _common.publish(text, args.output)
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
