"""Benchmark: saving a checkpoint, full against sharded, on a model of about 100M parameters and two ranks.

A stack of ``depth`` ``Linear(width, width)`` layers (24 x 2048 x 2048: 100.7M parameters, 403 MB in float32),
each its own FSDP unit, trains one step with Adam through the real ``Trainer`` and ``DDPFullyShardedStrategy``, so
that the checkpoint holds the parameters and two Adam moments: about 1.2 GB. Then every rank calls
``trainer.save_checkpoint`` a few times, exactly as ``ModelCheckpoint`` does:

* ``state_dict_type="full"``: the parameters are gathered unit by unit and the optimizer state with ``gather``, all
  kept on rank 0, which writes one file;
* ``state_dict_type="sharded"``: each rank writes the shards it holds, in parallel; rank 0 adds ``meta.pt``.

Both are written through :class:`~lightning_fairscale.ShardedCheckpointIO`, i.e. fsync'ed and renamed into place.
Measured per save: wall time from before the call to after it (the call ends with a barrier, so it covers every
rank's part), and rank 0's resident-set peak above its resting state (``VmHWM`` after, reset before, minus
``VmRSS`` before; in a launch with a fixed mmap threshold so that freed memory leaves the resident set). Each mode
runs in a fresh launch; figures are medians over the saves after the first.

Targets (issue "Sharded checkpoints"): sharded saving at least 1.5x faster, and rank 0's peak at most 1/world_size of
the full path's (plus a small constant, 64 MiB here).

Run it from the project's root (about a minute)::

    .venv/bin/python benchmarks/checkpoint_saving.py          # or: make bench
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "results" / "checkpoint_saving.md"
TARGET_SPEEDUP = 1.5
PEAK_ALLOWANCE = 64 * _common.MIB
LAUNCH_TIMEOUT_S = 900

warnings.filterwarnings("ignore", message=".*(TypedStorage|_all_gather_base|reduce_scatter_tensor|LeafSpec|workers).*")


class LinearStack(LightningModule):
    """``depth`` square Linear layers with ReLU in between, regressing random targets with Adam."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class SaveProbe(Callback):
    """After training (the model is still sharded), saves ``repeats`` checkpoints and measures each save."""

    def __init__(self, folder: Path, repeats: int) -> None:
        self.folder, self.repeats = folder, repeats
        self.saves: list[dict[str, float]] = []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for index in range(self.repeats):
            path = self.folder / f"save-{index}.ckpt"
            gc.collect()
            trainer.strategy.barrier()
            resting = _common.status_kib("VmRSS")
            _common.reset_peak_rss()
            started = time.perf_counter()
            trainer.save_checkpoint(path)
            seconds = time.perf_counter() - started
            peak = _common.status_kib("VmHWM")
            self.saves.append({"seconds": seconds, "resting": resting * 1024, "above": (peak - resting) * 1024})
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
                self.saves[-1]["bytes"] = size
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def run_worker(mode: str, depth: int, width: int, repeats: int, out_dir: Path) -> None:
    torch.manual_seed(0)
    model = LinearStack(depth, width)
    data = TensorDataset(torch.randn(8, width), torch.randn(8, width))
    probe = SaveProbe(out_dir, repeats)
    trainer = Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        strategy=DDPFullyShardedStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=mode),
        max_steps=1,
        callbacks=[probe],
        **_common.QUIET_TRAINER,
        use_distributed_sampler=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    numel = sum(p.numel() for p in model.parameters())
    _common.write_rank_result(out_dir, trainer.global_rank, {"saves": probe.saves, "numel": numel})


def measure(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(_common.MALLOC_MMAP_THRESHOLD))
    sizes = ["--depth", str(args.depth), "--width", str(args.width), "--repeats", str(args.repeats)]
    started = time.perf_counter()
    ranks = _common.launch(Path(__file__).resolve(), [*sizes, "--worker", mode], work / mode, LAUNCH_TIMEOUT_S, env)
    print(f"  {mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
    measured = [rank["saves"][1:] for rank in ranks]  # the first save warms up the file system and allocator
    return {
        "seconds": statistics.median(max(r[i]["seconds"] for r in measured) for i in range(len(measured[0]))),
        "rank0_above": statistics.median(s["above"] for s in measured[0]),
        "rank1_above": statistics.median(s["above"] for s in measured[1]),
        "bytes": measured[0][0]["bytes"],
        "numel": ranks[0]["numel"],
    }


def report(full: dict[str, Any], sharded: dict[str, Any], args: argparse.Namespace) -> tuple[str, bool]:
    speedup = full["seconds"] / sharded["seconds"]
    limit = full["rank0_above"] / 2 + PEAK_ALLOWANCE
    speed_ok, memory_ok = speedup >= TARGET_SPEEDUP, sharded["rank0_above"] <= limit
    mib = _common.MIB
    lines = [
        "# Checkpoint saving: full against sharded",
        "",
        f"- Machine: {_common.machine()}; 2 processes",
        f"- Versions: {_common.versions()}",
        f"- Model: {args.depth} x Linear({args.width}, {args.width}), {full['numel'] / 1e6:.1f} M parameters, each"
        " Linear its own FSDP unit; Adam after one step; float32",
        f"- Each mode in a fresh launch; {args.repeats} saves, medians over all but the first; the time of a save is"
        " the slowest rank's; memory is the resident-set peak above the resting state during the save",
        "",
        "| Mode | Save time (s) | Written (MiB) | Rank 0 peak above resting (MiB) | Rank 1 peak above resting (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in (("full", full), ("sharded", sharded)):
        lines.append(
            f"| {name} | {r['seconds']:.2f} | {r['bytes'] / mib:,.0f} | {r['rank0_above'] / mib:,.0f} |"
            f" {r['rank1_above'] / mib:,.0f} |"
        )
    lines += [
        "",
        "| Target (sharded vs. full) | Measured | Result |",
        "| --- | ---: | --- |",
        f"| Saving at least {TARGET_SPEEDUP}x faster | {speedup:.1f}x | {'PASS' if speed_ok else 'MISS'} |",
        f"| Rank 0 peak at most full/2 + {PEAK_ALLOWANCE // mib} MiB ({limit / mib:,.0f} MiB) |"
        f" {sharded['rank0_above'] / mib:,.0f} MiB | {'PASS' if memory_ok else 'MISS'} |",
        "",
        "Regenerate with `make bench` or `.venv/bin/python benchmarks/checkpoint_saving.py`.",
    ]
    return "\n".join(lines) + "\n", speed_ok and memory_ok


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--worker", choices=["full", "sharded"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--strict", action="store_true", help="exit with 1 when a target is missed")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.depth, args.width, args.repeats, args.out)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as scratch:
        full = measure("full", args, Path(scratch))
        sharded = measure("sharded", args, Path(scratch))
    text, met = report(full, sharded, args)
    _common.publish(text, OUTPUT)
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
