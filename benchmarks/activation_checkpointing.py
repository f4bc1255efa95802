"""Benchmark: the memory saved and the time paid by activation checkpointing under ``DDPFullyShardedStrategy``.

The model is a deep stack of residual MLP blocks (``Block``: ``x + down(GELU(up(LayerNorm(x))))`` with a 4x wide
hidden layer), trained on a large batch of short "sequences", so that the activations autograd keeps for the backward
pass dominate the memory of a step: per block it keeps about ``10 * tokens * width`` floats (the block input, the
LayerNorm output, the wide ``up`` output and the wide GELU output), while the parameters are small. With
``activation_checkpointing=Block`` only each block's input is kept; the block runs its forward again in the backward
pass to rebuild the rest.

Each configuration (no checkpointing, checkpointing, and on CUDA checkpointing with offload) trains the same model
through the real Lightning ``Trainer`` with ``DDPFullyShardedStrategy(auto_wrap_policy={Block})`` on two processes
(two CPU processes with gloo, or up to two GPUs), in fresh launches of its own, so that memory high-water marks and
allocator state never mix between configurations. A callback measures every training step (``on_train_batch_start``
to ``on_train_batch_end``: forward, backward, optimizer step); the first steps are warm-up (they allocate the
optimizer state and warm up the kernels) and are not counted.

* Peak step memory: on the CPU the kernel's resident-set high-water mark of the process is reset before the step
  (writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM``), the resident set (``VmRSS``) at that point is the
  resting state, and ``VmHWM`` after the step minus that resting state is the peak step memory. On CUDA the same
  with ``torch.cuda.reset_peak_memory_stats`` and ``max_memory_allocated``. It is mostly activations, but it also
  counts whatever else lives only during a step: gradients of activations and parameters in backward, full
  parameters gathered by FSDP. Those are the same with and without checkpointing, so they make the measured
  reduction a little smaller than the reduction of activations alone.
* Step time: the median over the measured steps, of wall time; and of the process's CPU time, which depends much
  less on other programs using the cores, as a check of the wall-time ratio.

On the CPU each configuration runs twice. The memory launch runs with ``MALLOC_MMAP_THRESHOLD_`` fixed: by default
glibc raises its mmap threshold after the first large ``free`` and from then on keeps freed tensors in its heap, so
the resident set stops going down after the warm-up steps (it settles at its peak) and "peak above resting" would
measure nothing. But with the fixed threshold every step maps fresh pages for its activations, and the page faults
make steps about 45% slower on our machine; so step times come from a second launch with the default allocator,
which also gives the whole process's peak resident set, as a user would see it.

Run it from the project's root (one to two and a half minutes on two CPU cores, depending on the machine)::

    .venv/bin/python benchmarks/activation_checkpointing.py            # or: make bench
    .venv/bin/python benchmarks/activation_checkpointing.py --depth 24 --batch 64

It prints a markdown table and writes it to ``benchmarks/results/activation_checkpointing.md``. Targets: at least
40% less peak step memory for at most 40% more step time; a missed target is reported (``MISS``), not an error,
unless ``--strict`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import Block  # noqa: E402

from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "results" / "activation_checkpointing.md"
MIB = _common.MIB

#: The configurations, by name: the strategy's activation-checkpointing arguments for each.
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "checkpointing": {"activation_checkpointing": "Block"},
    "checkpointing+offload": {"activation_checkpointing": "Block", "activation_checkpointing_offload": True},
}
#: The targets: the least reduction of peak step memory, and the largest step-time ratio.
TARGET_MEMORY_REDUCTION = 0.40
TARGET_TIME_RATIO = 1.40
#: A configuration whose launch takes longer than this has hung (a rank waiting for a dead peer, say).
CONFIG_TIMEOUT_S = 900

_common.quiet_known_warnings()


# ----------------------------------------------------------------------------------------------------------------
# The model


class DeepResidualMLP(LightningModule):
    """An input projection, ``depth`` blocks, a final norm and an output projection, regressing a random target.

    The loss is irrelevant to the benchmark; what matters is that every block is in the autograd graph. The input
    projection also makes the first block's input require gradients, as in a real network.
    """

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[_common.wide_block(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class RandomSequences(Dataset):
    """``length`` pairs of random ``(seq, width)`` tensors, generated on access from the index (no stored data)."""

    def __init__(self, length: int, seq: int, width: int) -> None:
        self.length, self.seq, self.width = length, seq, width

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(2, self.seq, self.width, generator=generator).unbind(0)


# ----------------------------------------------------------------------------------------------------------------
# Measuring


@dataclasses.dataclass
class StepRecord:
    """One training step of one rank.

    Attributes:
        seconds: wall time from ``on_train_batch_start`` to ``on_train_batch_end``.
        cpu_seconds: CPU time of the process (all its threads) over the same span; it changes much less than wall
            time when other programs compete for the cores, so it cross-checks the wall-time ratio.
        resting_bytes: memory in use before the step (``VmRSS``, or CUDA memory allocated).
        peak_bytes: the highest memory in use during the step (``VmHWM``, or CUDA max memory allocated).
    """

    seconds: float
    cpu_seconds: float
    resting_bytes: int
    peak_bytes: int


class StepProbe(Callback):
    """Measures the time, and with ``measure_memory`` the peak memory, of every training step of this rank.

    Args:
        measure_memory: reset the peak-memory counter before each step and read it after (see the module docstring).
            Without it the steps are only timed, and ``process_peak_bytes`` is the peak of the whole run.
    """

    def __init__(self, measure_memory: bool) -> None:
        self.measure_memory = measure_memory
        self.records: list[StepRecord] = []
        self.threads = 0
        self.process_peak_bytes: Optional[int] = None
        self._cuda = False
        self._resting = 0
        self._start = 0.0
        self._cpu_start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._cuda = pl_module.device.type == "cuda"
        self.threads = torch.get_num_threads()  # after Lightning's own thread setting for multi-process runs

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        gc.collect()  # garbage of the previous step must not count as resting memory; outside the timed window
        if self._cuda:
            torch.cuda.synchronize()
            self._resting = torch.cuda.memory_allocated()
            if self.measure_memory:
                torch.cuda.reset_peak_memory_stats()
        else:
            self._resting = _common.status_kib("VmRSS") * 1024
            if self.measure_memory:
                _common.reset_peak_rss()
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._start
        cpu_seconds = time.process_time() - self._cpu_start
        peak = torch.cuda.max_memory_allocated() if self._cuda else _common.status_kib("VmHWM") * 1024
        self.records.append(StepRecord(seconds, cpu_seconds, self._resting, peak))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.measure_memory and not self._cuda:
            self.process_peak_bytes = _common.status_kib("VmHWM") * 1024  # never reset: the peak of the whole process


@dataclasses.dataclass(frozen=True)
class Setup:
    """The benchmark's sizes.

    Attributes:
        depth: number of blocks.
        width: model width (the hidden layer of a block is 4x as wide).
        batch: sequences per process and step.
        seq: tokens per sequence.
        warmup: unmeasured steps first.
        steps: measured steps.
    """

    depth: int
    width: int
    batch: int
    seq: int
    warmup: int
    steps: int

    @property
    def tokens(self) -> int:
        """Tokens per process and step."""
        return self.batch * self.seq

    def saved_activation_bytes(self, checkpointing: bool) -> int:
        """What autograd keeps of the blocks for backward, per process, from the model's structure (float32).

        Without checkpointing each block keeps its input, the LayerNorm output, and the ``up`` and GELU outputs
        (4x wide each): 10 ``tokens x width`` tensors. With checkpointing each block keeps its input, and one block
        at a time rebuilds its 10 in backward. Transients (gradients...) are not included.
        """
        one = self.tokens * self.width * 4
        return (self.depth + 10) * one if checkpointing else 10 * self.depth * one


# ----------------------------------------------------------------------------------------------------------------
# One configuration (a worker launch: Lightning runs this script again for rank 1)


def run_worker(config: str, measure_memory: bool, setup: Setup, out_dir: Path) -> None:
    """Train ``setup.warmup + setup.steps`` steps with ``config``; each rank writes ``rank<N>.json`` to ``out_dir``.

    Args:
        config: a key of ``CONFIGS``.
        measure_memory: measure each step's peak memory (see :class:`StepProbe`).
        setup: the sizes.
        out_dir: where the ranks write their results.
    """
    seed_everything(0, workers=True, verbose=False)
    cuda = torch.cuda.is_available()
    accelerator, devices = ("gpu", min(2, torch.cuda.device_count())) if cuda else ("cpu", 2)
    arguments = dict(CONFIGS[config])
    if "activation_checkpointing" in arguments:
        arguments["activation_checkpointing"] = Block
    model = DeepResidualMLP(setup.depth, setup.width)
    parameters = sum(p.numel() for p in model.parameters())  # before sharding
    steps = setup.warmup + setup.steps
    probe = StepProbe(measure_memory)
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=DDPFullyShardedStrategy(auto_wrap_policy={Block}, **arguments),
        max_steps=steps,
        callbacks=[probe],
        **_common.QUIET_TRAINER,
    )
    data = RandomSequences(steps * setup.batch * trainer.world_size, setup.seq, setup.width)
    trainer.fit(model, DataLoader(data, batch_size=setup.batch))
    result = {
        "config": config,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "device": str(trainer.strategy.root_device),
        "threads": probe.threads,
        "process_peak_bytes": probe.process_peak_bytes,
        "parameters": parameters,
        "steps": [dataclasses.asdict(record) for record in probe.records],
    }
    _common.write_rank_result(out_dir, trainer.global_rank, result)
    # Every rank's file is written before rank 0 (the process the parent waits for) returns.
    torch.distributed.barrier()
    # Left open, gloo's threads occasionally abort the process at exit.
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# The parent: one launch per configuration, then the report


@dataclasses.dataclass
class ConfigResult:
    """The measured steps of one configuration, summarised over its ranks.

    Attributes:
        name: the configuration's name (a key of ``CONFIGS``).
        peak_above_resting: per rank, the median over measured steps of peak minus resting memory (bytes).
        resting: per rank, the median resting memory (bytes).
        step_seconds: the median step time, the slowest rank's (ranks wait for each other in collectives anyway).
        step_range: the fastest and the slowest measured step of any rank (seconds), to judge the noise.
        cpu_seconds: the median CPU time of a step, the largest over ranks.
        process_peak: on the CPU, per rank, the peak resident set of the whole timing launch (default allocator).
        ranks: the raw results of the memory launch's ranks.
    """

    name: str
    peak_above_resting: list[int]
    resting: list[int]
    step_seconds: float
    step_range: tuple[float, float]
    cpu_seconds: float
    process_peak: Optional[list[int]]
    ranks: list[dict[str, Any]]

    @property
    def memory(self) -> int:
        """Peak step memory above the resting state, the largest over ranks."""
        return max(self.peak_above_resting)


def launch(config: str, mode: str, setup: Setup, argv: list[str], work: Path) -> list[dict[str, Any]]:
    """Run one fresh 2-process training launch of ``config`` and return its ranks' results.

    Args:
        config: a key of ``CONFIGS``.
        mode: ``"memory"`` (steps timed and their peak memory measured, with the fixed mmap threshold on the CPU) or
            ``"time"`` (steps only timed, with the default allocator).
        setup: the sizes.
        argv: the sizes as command-line arguments, for the worker.
        work: a scratch folder.

    Returns:
        Each rank's result (see :func:`run_worker`), with its steps after the warm-up added as ``"measured"``.
    """
    out_dir = work / f"{config}-{mode}"
    env = dict(os.environ)
    if not torch.cuda.is_available():
        if mode == "memory":
            env["MALLOC_MMAP_THRESHOLD_"] = str(_common.MALLOC_MMAP_THRESHOLD)  # see the module docstring
        else:
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
        # Two processes share the cores; set it here so that both ranks get it (Lightning would pick the same).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
    started = time.perf_counter()
    worker = [*argv, "--worker", config, "--mode", mode]
    ranks = _common.launch(Path(__file__).resolve(), worker, out_dir, CONFIG_TIMEOUT_S, env)
    print(f"  {config} ({mode}): done in {time.perf_counter() - started:.0f} s", flush=True)
    if len(ranks) != ranks[0]["world_size"]:
        raise RuntimeError(f"configuration {config!r}: {len(ranks)} of {ranks[0]['world_size']} ranks reported")
    for rank in ranks:
        rank["measured"] = rank["steps"][setup.warmup :]
        if len(rank["measured"]) != setup.steps:
            ran = len(rank["steps"])
            raise RuntimeError(f"configuration {config!r} ran {ran} steps, not {setup.warmup} + {setup.steps}")
    return ranks


def run_config(config: str, setup: Setup, argv: list[str], work: Path) -> ConfigResult:
    """Measure ``config``: on the CPU one launch for memory and one for time, on CUDA one launch for both.

    Timing on the CPU needs a launch of its own because the fixed mmap threshold that memory measurement needs makes
    every step map fresh pages for its activations: the page faults make the steps much slower than with the default
    allocator that users run with. CUDA's caching allocator has no such effect.
    """
    cuda = torch.cuda.is_available()
    memory_ranks = launch(config, "memory", setup, argv, work)
    time_ranks = memory_ranks if cuda else launch(config, "time", setup, argv, work)
    seconds = [step["seconds"] for rank in time_ranks for step in rank["measured"]]
    return ConfigResult(
        name=config,
        peak_above_resting=[
            int(statistics.median(s["peak_bytes"] - s["resting_bytes"] for s in rank["measured"]))
            for rank in memory_ranks
        ],
        resting=[int(statistics.median(s["resting_bytes"] for s in rank["measured"])) for rank in memory_ranks],
        step_seconds=max(statistics.median(s["seconds"] for s in rank["measured"]) for rank in time_ranks),
        step_range=(min(seconds), max(seconds)),
        cpu_seconds=max(statistics.median(s["cpu_seconds"] for s in rank["measured"]) for rank in time_ranks),
        process_peak=None if cuda else [rank["process_peak_bytes"] for rank in time_ranks],
        ranks=memory_ranks,
    )


def _mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def report(setup: Setup, results: list[ConfigResult]) -> tuple[str, bool]:
    """The markdown report, and whether every target was met."""
    base = results[0]
    first = base.ranks[0]
    cuda = first["device"].startswith("cuda")
    params = first["parameters"]
    if cuda:
        device = f"{first['world_size']} x {torch.cuda.get_device_name(0)}"
        memory_kind = (
            "CUDA memory allocated: `max_memory_allocated` after the step (reset before it) minus `memory_allocated`"
            " before it"
        )
        timing = "from the same launch"
    else:
        device = f"{first['world_size']} CPU processes (gloo), {first['threads']} thread(s) each"
        memory_kind = (
            "resident set: `VmHWM` after the step (reset before it) minus `VmRSS` before it, in a launch with"
            f" `MALLOC_MMAP_THRESHOLD_={_common.MALLOC_MMAP_THRESHOLD}` so that freed tensors leave the resident set"
        )
        timing = "from a second launch with the default allocator"
    lines = [
        "# Activation checkpointing: memory and step time",
        "",
        f"- Machine: {_common.machine()}; {device}",
        f"- Versions: {_common.versions()}",
        f"- Model: {setup.depth} residual MLP blocks, width {setup.width} (hidden {4 * setup.width}),"
        f" {params / 1e6:.2f} M parameters ({_mib(params * 4)} MiB in float32), one FSDP unit per block",
        f"- Batch per process: {setup.batch} sequences x {setup.seq} tokens = {setup.tokens} tokens;"
        f" world size {first['world_size']}; float32; AdamW",
        f"- Steps: {setup.warmup} warm-up, then {setup.steps} measured; each configuration in fresh launches",
        f"- Peak step memory: {memory_kind}; median over the measured steps, largest over ranks",
        f"- Step time: median over the measured steps, slowest rank, {timing}",
    ]
    if not cuda:
        lines.append(
            "- Process peak: the whole process's `VmHWM` at the end of the timing launch (default allocator, which"
            " keeps freed memory for reuse): what `top` would show at most"
        )
    header = "| Configuration | Peak step memory above resting (MiB) | Resting (MiB) | Memory vs. none"
    header += " | Median step time (s) | Range (s) | Time vs. none |"
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    if not cuda:
        header += " CPU time vs. none | Process peak (MiB) |"
        rule += " ---: | ---: |"
    lines += ["", header, rule]
    for result in results:
        row = (
            f"| {result.name} | {_mib(result.memory)} | {_mib(max(result.resting))}"
            f" | {result.memory / base.memory - 1:+.0%} | {result.step_seconds:.3f}"
            f" | {result.step_range[0]:.2f}-{result.step_range[1]:.2f}"
            f" | {result.step_seconds / base.step_seconds:.2f}x |"
        )
        if result.process_peak is not None:
            row += f" {result.cpu_seconds / base.cpu_seconds:.2f}x | {_mib(max(result.process_peak))} |"
        lines.append(row)
    checkpointed = next(r for r in results if r.name == "checkpointing")
    reduction = 1 - checkpointed.memory / base.memory
    ratio = checkpointed.step_seconds / base.step_seconds
    memory_ok, time_ok = reduction >= TARGET_MEMORY_REDUCTION, ratio <= TARGET_TIME_RATIO
    expected = {flag: setup.saved_activation_bytes(flag) for flag in (False, True)}
    lines += [
        "",
        "| Target (checkpointing vs. none) | Measured | Result |",
        "| --- | ---: | --- |",
        f"| Peak step memory at least {TARGET_MEMORY_REDUCTION:.0%} lower | {reduction:.1%} lower"
        f" | {'PASS' if memory_ok else 'MISS'} |",
        f"| Step time at most {TARGET_TIME_RATIO - 1:.0%} higher | {ratio - 1:+.1%} ({ratio:.2f}x)"
        f" | {'PASS' if time_ok else 'MISS'} |",
        "",
        "Expected from the model's structure, per process (the tensors the blocks save for backward, nothing else):"
        f" {_mib(expected[False])} MiB without checkpointing, {_mib(expected[True])} MiB with"
        f" ({1 - expected[True] / expected[False]:.0%} less). The measured peak step memory also counts what lives"
        " only during a step in both runs (gradients of activations and parameters in backward, parameters"
        " gathered by FSDP, the loss), so its reduction is a little smaller.",
        "",
    ]
    if not cuda:
        cpu_ratio = checkpointed.cpu_seconds / base.cpu_seconds
        lines += [
            f"CPU time per step (all threads of a process) grows {cpu_ratio:.2f}x with checkpointing; it depends much"
            " less than wall time on other programs using the cores, so a wall-time ratio far from it means the"
            " machine was busy during the run."
            + (" **It is far from it here: rerun on an idle machine.**" if abs(ratio / cpu_ratio - 1) > 0.15 else ""),
            "",
        ]
    lines += [
        "Regenerate with `make bench` or `.venv/bin/python benchmarks/activation_checkpointing.py`.",
    ]
    return "\n".join(lines) + "\n", memory_ok and time_ok


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark (or, with ``--worker``, one configuration's training). Returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=16, help="number of blocks")
    parser.add_argument("--width", type=int, default=128, help="model width")
    parser.add_argument("--batch", type=int, default=32, help="sequences per process and step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        help="configurations to run (default: none and checkpointing; with CUDA also checkpointing+offload, which"
        " on the CPU changes nothing: the checkpointed inputs are in CPU memory already)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the markdown report")
    parser.add_argument("--strict", action="store_true", help="exit with code 1 when a target is missed")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["memory", "time"], default="memory", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = Setup(args.depth, args.width, args.batch, args.seq, args.warmup, args.steps)

    if args.worker:
        run_worker(args.worker, args.mode == "memory", setup, args.out)
        return 0

    configs = args.configs or ["none", "checkpointing"]
    if not args.configs and torch.cuda.is_available():
        configs.append("checkpointing+offload")
    for needed in ("none", "checkpointing"):
        if needed not in configs:
            parser.error(f"--configs must include {needed!r}: the report compares checkpointing with none")
    configs = sorted(configs, key=list(CONFIGS).index)  # "none" first: the reference
    if not torch.cuda.is_available() and not Path("/proc/self/clear_refs").exists():
        print("Measuring CPU memory needs Linux's /proc/self/clear_refs (to reset the peak resident set).")
        return 1
    sizes = ["--depth", args.depth, "--width", args.width, "--batch", args.batch, "--seq", args.seq]
    sizes += ["--warmup", args.warmup, "--steps", args.steps]
    print(f"Activation checkpointing benchmark: {', '.join(configs)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ac-") as work:
        results = [run_config(config, setup, [str(a) for a in sizes], Path(work)) for config in configs]
    text, all_met = report(setup, results)
    _common.publish(text, args.output)
    return 1 if args.strict and not all_met else 0


if __name__ == "__main__":
    sys.exit(main())
