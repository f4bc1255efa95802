"""Benchmark: gradient accumulation with ``no_sync`` against ``sync_each_batch=True``, memory per rank and step time.

FairScale's way (``DDPFullyShardedStrategy()``, the default) accumulates each rank's full, unreduced gradient of
every unit until the last micro-batch; ``DDPFullyShardedStrategy(sync_each_batch=True)`` reduce-scatters after every
micro-batch, so that a rank holds only its gradient shard between them. This benchmark trains the medium model of
``memory_lifecycle.py`` (a stem, residual MLP blocks of width 2048, each wrapped with ``fairscale.nn.wrap`` as it is
built, a norm and a head; Adam) with the real Trainer, ``accumulate_grad_batches=4``, on 2 CPU processes (gloo), one
fresh launch per mode, and reads on every rank, in the last step (Adam's state exists):

* **held between micro-batches**: ``memory_figures()``'s gradient bytes after the 1st micro-batch (the full gradient,
  4Ψ, against the shard, 4Ψ/N);
* **accumulation peak**: the resident-set peak (``VmHWM``, reset when the step begins) over the first 3 micro-batches,
  the part of a step where the modes hold different gradients; and the same above the resident set when the step
  began (what the accumulation itself adds);
* **step peak**: the peak over the whole step (4 micro-batches, clipping-free optimizer step);
* **held after the step**: ``memory_figures()`` in total, which must be 16Ψ/N in both modes;
* **step time**: the median over the steps after the first, from the first micro-batch's start to the step's end.

Run it from the project's root (about 6 minutes on our 2-core machine; it needs about 8 GiB)::

    .venv/bin/python benchmarks/accumulation.py                   # or: make bench BENCHMARKS=accumulation
    .venv/bin/python benchmarks/accumulation.py --params 5e7 --width 1024 --steps 3   # smaller, 1 minute
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from memory_lifecycle import Stack, depth_for, parameter_count  # noqa: E402

from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "results" / "accumulation.md"
MIB = _common.MIB
MODES = {"no_sync": False, "sync_each_batch": True}


class AccumulationProbe(Callback):
    """Per step: the peak resident set over the first ``micro - 1`` micro-batches and over the step, the gradient
    bytes held after the first micro-batch, the tensors held after the step, and the step's time."""

    def __init__(self, micro: int) -> None:
        self.micro = micro
        self.steps: list[dict[str, Any]] = []
        self._step: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.micro == 0:
            gc.collect()
            trainer.strategy.barrier()  # every rank begins the step together
            _common.reset_peak_rss()
            self._step = {"start_kib": _common.status_kib("VmRSS"), "started": time.perf_counter()}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        micro = batch_idx % self.micro
        figures = trainer.strategy.memory_figures()  # type: ignore[attr-defined]
        if micro == 0:
            self._step["held_gradient_bytes"] = figures["memory/gradients_bytes"]
        if micro == self.micro - 2:
            self._step["accumulation_peak_kib"] = _common.status_kib("VmHWM")
        if micro == self.micro - 1:
            self._step["seconds"] = time.perf_counter() - self._step.pop("started")
            self._step["step_peak_kib"] = _common.status_kib("VmHWM")
            self._step["held_after_step_bytes"] = sum(figures.values())
            self.steps.append(self._step)


def run_worker(args: argparse.Namespace) -> None:
    """One rank of one launch: ``args.steps`` steps of ``args.micro`` micro-batches; writes ``rank<N>.json``."""
    seed_everything(0, verbose=False)
    _common.quiet_known_warnings()
    rows = args.steps * args.micro * args.batch
    data = TensorDataset(torch.randn(rows, args.width), torch.randn(rows, args.width))
    probe = AccumulationProbe(args.micro)
    strategy = DDPFullyShardedStrategy(sync_each_batch=MODES[args.mode])
    trainer = Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=args.steps,
                      accumulate_grad_batches=args.micro, callbacks=[probe], use_distributed_sampler=False,
                      **_common.QUIET_TRAINER)
    trainer.fit(Stack(args.width, args.depth), DataLoader(data, batch_size=args.batch))
    result = {"steps": probe.steps, "threads": torch.get_num_threads()}
    _common.write_rank_result(args.out, trainer.global_rank, result)
    if dist.is_initialized():
        dist.barrier()


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, numel: int, command: str,
           conditions: str) -> str:
    """The markdown report: one row per mode, each figure per rank (the last step's) and its median step time."""
    world = args.ranks
    lines = [
        "# Gradient accumulation: no_sync against sync_each_batch",
        "",
        f"{_common.machine()}; {_common.versions()}.",
        f"Model: {numel / 1e6:,.1f} M parameters (width {args.width}, {args.depth} blocks, each an FSDP unit); Adam;"
        f" {world} CPU processes (gloo); `accumulate_grad_batches={args.micro}`, {args.batch} rows per rank per"
        f" micro-batch; {args.steps} steps, figures of the last one (step time: median of the steps after the first)."
        f" 4Ψ (the full gradient) = {4 * numel / MIB:,.1f} MiB, 4Ψ/N = {4 * numel / world / MIB:,.1f} MiB,"
        f" 16Ψ/N = {16 * numel / world / MIB:,.1f} MiB. {conditions}.",
        "",
    ]
    rows = []
    for mode, ranks in results.items():
        last = [r["steps"][-1] for r in ranks]
        times = [max(r["steps"][i]["seconds"] for r in ranks) for i in range(1, len(ranks[0]["steps"]))]

        def each(values: list[float]) -> str:
            return " / ".join(f"{v:,.0f}" for v in values)

        rows.append([
            f"`{mode}`" if mode == "no_sync" else "`sync_each_batch=True`",
            each([s["held_gradient_bytes"] / MIB for s in last]),
            each([s["accumulation_peak_kib"] / 1024 for s in last]),
            each([(s["accumulation_peak_kib"] - s["start_kib"]) / 1024 for s in last]),
            each([s["step_peak_kib"] / 1024 for s in last]),
            each([s["held_after_step_bytes"] / MIB for s in last]),
            f"{statistics.median(times):.2f}",
        ])
    header = ["mode", "gradient held between micro-batches (MiB, per rank)", "peak over micro-batches 1-3 (MiB)",
              "of which above the step's start (MiB)", "step peak (MiB)", "held after the step (MiB; 16Ψ/N)",
              "step time (s)"]
    lines += _common.markdown_table(header, "lrrrrrr", rows)
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=2e8, help="parameters of the model (at least)")
    parser.add_argument("--width", type=int, default=2048, help="width of the blocks (and of the data)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step (accumulate_grad_batches)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (at least 2)")
    parser.add_argument("--batch", type=int, default=2, help="rows per rank per micro-batch")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step allocates Adam's state)")
    args.depth = depth_for(args.params, args.width)
    numel = parameter_count(args.width, args.depth)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/accumulation.py", *sys.argv[1:]])
    conditions = f"{_common.load_average()} before"
    sizes = ["--width", str(args.width), "--depth", str(args.depth), "--steps", str(args.steps), "--batch",
             str(args.batch), "--micro", str(args.micro), "--world", str(args.ranks)]
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-accumulation-") as scratch:
        for mode in MODES:
            started = time.perf_counter()
            results[mode] = _common.launch(Path(__file__).resolve(), [*sizes, "--worker", "--mode", mode],
                                           Path(scratch) / mode, timeout_s=3600)
            print(f"  {mode}: {time.perf_counter() - started:.0f} s", flush=True)
    conditions += f", {_common.load_average()} after"
    _common.publish(report(results, args, numel, command, conditions), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
