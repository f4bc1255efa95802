"""Benchmark (GPU only): step time and peak GPU memory of ``DDPFullyShardedStrategy`` on one GPU, against Lightning's
``"ddp"`` and Lightning's own ``"fsdp"`` (PyTorch FSDP), with and without ``cpu_offload``.

On a machine without CUDA it prints "no CUDA", measures nothing, writes nothing and exits 0, so ``make bench`` can
run it everywhere.

The model is the residual MLP stack of ``benchmarks/training.py`` (``Block``: ``x + down(GELU(up(LayerNorm(
x))))``, 4x wide hidden layer, between an input projection and a head), trained with Adam through the real
``Trainer`` on one GPU (world size 1, NCCL), each block an FSDP unit for both FSDP implementations. Each
configuration runs in a fresh launch of this script (``--worker``), so that the CUDA allocator's high-water mark
and cache start empty, with the same seed, data, batch and precision.

Measured, per configuration:

* **step time**: the median of the wall time between the starts of consecutive training steps after ``--warmup``
  steps, with ``torch.cuda.synchronize()`` at every mark (the GPU runs asynchronously, so an unsynchronised clock
  would measure the launch of the kernels only). It counts everything the Trainer does per step.
* **peak GPU memory**: ``torch.cuda.max_memory_allocated`` over the measured steps (reset at the first of them, read
  at the start of the step after the last), and the resting memory then: ``memory_allocated`` at that reset
  (parameters, gradients kept by the Trainer, optimizer state). With ``cpu_offload`` the parameter shards, gradients
  and Adam state are in CPU memory, which this figure does not count: that is the point of offloading.

World size 1 shards nothing: the FSDP rows measure what the wrapping costs (all-gathers and reduce-scatters on one
rank, flattening, offload transfers), not the memory that sharding over several GPUs saves (see
``benchmarks/training.py`` for that, on CPU processes). There are no targets: the report is the table.

Run it from the project's root on a machine with a GPU::

    .venv/bin/python benchmarks/gpu.py                           # or: make bench BENCHMARKS=gpu
    .venv/bin/python benchmarks/gpu.py --width 1024 --precision bf16-mixed

It writes ``benchmarks/results/gpu.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import Block  # noqa: E402
from training import BlockStack, parameter_count  # noqa: E402  (the model the CPU benchmark trains)

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "results" / "gpu.md"
MIB = _common.MIB
#: A launch that takes longer than this has hung.
LAUNCH_TIMEOUT_S = 600

#: The configurations, by name: their label in the report.
CONFIGURATIONS: dict[str, str] = {
    "ddp": 'Lightning `strategy="ddp"`',
    "fsdp": 'Lightning `strategy="fsdp"` (PyTorch FSDP, `auto_wrap_policy={Block}`)',
    "fsdp-offload": "Lightning `FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=True)`",
    "ours": "`DDPFullyShardedStrategy(auto_wrap_policy={Block})`",
    "ours-offload": "`DDPFullyShardedStrategy(auto_wrap_policy={Block}, cpu_offload=True)`",
}

warnings.filterwarnings("ignore", message=".*(TypedStorage|_all_gather_base|_reduce_scatter_base|reduce_scatter_tensor"
                        "|LeafSpec|workers|number of training batches|deprecated).*")


class GpuProbe(Callback):
    """Synchronised step marks; the allocator's peak over the steps after ``warmup``."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.starts: list[float] = []
        self.resting = self.peak = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        device = trainer.strategy.root_device  # the module itself is in CPU memory with `cpu_offload`
        torch.cuda.synchronize(device)
        self.starts.append(time.perf_counter())
        if len(self.starts) == self.warmup + 1:  # the first measured step starts
            self.resting = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        elif len(self.starts) == self.warmup + self.steps + 1:  # the last measured step has ended
            self.peak = torch.cuda.max_memory_allocated(device)


def run_worker(impl: str, args: argparse.Namespace, out: Path) -> None:
    """Train with ``impl``'s strategy on one GPU and write ``rank0.json`` into ``out``."""
    from pytorch_lightning.strategies import FSDPStrategy

    from lightning_fairscale.strategies import DDPFullyShardedStrategy

    torch.manual_seed(0)
    model = BlockStack(args.width, args.depth)
    strategies: dict[str, Any] = {
        "ddp": "ddp",
        "fsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}),
        "fsdp-offload": lambda: FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=True),
        "ours": lambda: DDPFullyShardedStrategy(auto_wrap_policy={Block}),
        "ours-offload": lambda: DDPFullyShardedStrategy(auto_wrap_policy={Block}, cpu_offload=True),
    }
    strategy = strategies[impl]
    total = args.warmup + args.steps + 1  # the last step's start closes the last measured interval
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(total * args.batch, args.width, generator=generator)
    y = torch.randn(total * args.batch, args.width, generator=generator)
    probe = GpuProbe(args.warmup, args.steps)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy if isinstance(strategy, str) else strategy(),
        precision=args.precision,
        max_steps=total,
        callbacks=[probe],
        use_distributed_sampler=False,
        **_common.QUIET_TRAINER,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=False))
    intervals = [b - a for a, b in zip(probe.starts[args.warmup :], probe.starts[args.warmup + 1 :])]
    _common.write_rank_result(
        out,
        trainer.global_rank,
        {"impl": impl, "intervals": intervals, "resting": probe.resting, "peak": probe.peak},
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # Lightning leaves the (NCCL) group to the end of the process


def measure(impl: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One configuration in a fresh launch; its result, or ``{"error": ...}`` when it failed."""
    options = [f"--worker={impl}", f"--width={args.width}", f"--depth={args.depth}", f"--batch={args.batch}"]
    options += [f"--warmup={args.warmup}", f"--steps={args.steps}", f"--precision={args.precision}"]
    started = time.perf_counter()
    try:
        (result,) = _common.launch(Path(__file__), options, work / impl, LAUNCH_TIMEOUT_S)
    except RuntimeError as error:  # the launch's output is printed; the report says which one failed
        print(f"  {impl}: FAILED ({error})", flush=True)
        return {"impl": impl, "error": str(error)}
    result["step"] = statistics.median(result["intervals"])
    print(f"  {impl}: step {result['step'] * 1e3:.1f} ms ({time.perf_counter() - started:.0f} s)", flush=True)
    return result


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown report."""
    ddp = next((r for r in results if r["impl"] == "ddp" and "error" not in r), None)
    numel = parameter_count(args.width, args.depth)
    lines = [
        "# GPU: step time and peak GPU memory on one GPU",
        "",
        f"- Machine: {_common.machine()}",
        f"- Versions: {_common.versions()}",
        f"- Model: {args.depth} residual MLP blocks of width {args.width} between an input projection and a head,"
        f" {numel / 1e6:.1f} M parameters; Adam; precision {args.precision!r}; batch {args.batch} rows",
        f"- World size 1 (one GPU, NCCL): nothing is sharded; {args.warmup} warm-up steps, then the median of"
        f" {args.steps} measured steps (synchronised wall time between step starts); each configuration in a fresh"
        " launch",
        "- Peak = `torch.cuda.max_memory_allocated` over the measured steps; resting = `memory_allocated` before them."
        " With `cpu_offload` parameters, gradients and optimizer state are in CPU memory, not counted here",
        "",
        "| Configuration | Step time (ms) | vs. ddp | Peak GPU memory (MiB) | Resting (MiB) | Peak vs. ddp |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        label = CONFIGURATIONS[r["impl"]]
        if "error" in r:
            lines.append(f"| {label} | failed (see the benchmark's output) | | | | |")
            continue
        time_ratio = f"{r['step'] / ddp['step']:.2f}x" if ddp else ""
        peak_ratio = f"{r['peak'] / ddp['peak']:.2f}x" if ddp and ddp["peak"] else ""
        lines.append(
            f"| {label} | {r['step'] * 1e3:.1f} | {time_ratio} | {r['peak'] / MIB:,.0f} | {r['resting'] / MIB:,.0f}"
            f" | {peak_ratio} |"
        )
    lines += ["", "Regenerate with `make bench BENCHMARKS=gpu` or `.venv/bin/python benchmarks/gpu.py` on a GPU."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark (or, with ``--worker``, one configuration). Returns the exit code."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="width of the blocks")
    parser.add_argument("--depth", type=int, default=8, help="number of blocks")
    parser.add_argument("--batch", type=int, default=64, help="rows per step")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=20, help="measured steps")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "16-mixed", "bf16-mixed"])
    parser.add_argument("--only", nargs="+", choices=list(CONFIGURATIONS), help="measure only these")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where to write the markdown report")
    parser.add_argument("--worker", choices=list(CONFIGURATIONS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA: benchmarks/gpu.py measures on a GPU; nothing measured, nothing written.")
        return 0
    if args.worker:
        run_worker(args.worker, args, args.out)
        return 0
    print(f"GPU benchmark: {parameter_count(args.width, args.depth) / 1e6:.1f} M parameters on {_common.machine()}")
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as work:
        results = [measure(impl, args, Path(work)) for impl in (args.only or CONFIGURATIONS)]
    _common.publish(report(results, args), args.output)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
