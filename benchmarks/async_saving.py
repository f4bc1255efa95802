"""Benchmark: how long a checkpoint save blocks training, written synchronously or in the background.

The model of ``checkpoint_saving.py`` (square ``Linear`` layers, each its own FSDP unit; here 8 x 1024 x 1024 by
default: 8.4 M parameters, a checkpoint of about 100 MB with Adam's two moments) trains one step with the real
``Trainer`` and ``DDPFullyShardedStrategy`` on two ranks; then every rank calls ``trainer.save_checkpoint`` a few
times, as ``ModelCheckpoint`` does, with each combination of:

* ``state_dict_type="full"`` (gathered on rank 0, one file) or ``"sharded"`` (each rank its shard);
* the default ``ShardedCheckpointIO()`` (the call returns once the files are in place) or
  ``ShardedCheckpointIO(async_save=True)`` (the call returns once the state is copied; a thread writes the files).

Measured per save: the time the call blocks (the slowest rank's), and, for background saves, the time until the
files are in place (``checkpoint_io.wait()`` on every rank, then a barrier). Saves are spaced out (each waits for the
previous one to be written), so that a save never waits for the one before it. Each combination runs in a fresh
launch; figures are medians over the saves after the first.

Run it from the project's root (about a minute)::

    .venv/bin/python benchmarks/async_saving.py          # or: make bench BENCHMARKS=async_saving
"""

from __future__ import annotations

import argparse
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
from checkpoint_saving import LinearStack  # noqa: E402

from lightning_fairscale.plugins.checkpoint_io import ShardedCheckpointIO  # noqa: E402
from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "results" / "async_saving.md"
LAUNCH_TIMEOUT_S = 600
MODES = [(kind, how) for kind in ("full", "sharded") for how in ("sync", "async")]

warnings.filterwarnings("ignore", message=".*(TypedStorage|_all_gather_base|reduce_scatter_tensor|LeafSpec|workers).*")


class SaveProbe(Callback):
    """After training (the model is still sharded), saves ``repeats`` checkpoints and times each save."""

    def __init__(self, folder: Path, repeats: int) -> None:
        self.folder, self.repeats = folder, repeats
        self.saves: list[dict[str, float]] = []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        io = trainer.strategy.checkpoint_io
        for index in range(self.repeats):
            trainer.strategy.barrier()
            started = time.perf_counter()
            trainer.save_checkpoint(self.folder / f"save-{index}.ckpt")
            blocked = time.perf_counter() - started
            io.wait()  # the files are in place (at once without async_save)
            trainer.strategy.barrier()
            self.saves.append({"blocked": blocked, "written": time.perf_counter() - started})


def run_worker(mode: str, depth: int, width: int, repeats: int, out_dir: Path) -> None:
    kind, how = mode.split("-")
    torch.manual_seed(0)
    model = LinearStack(depth, width)
    numel = sum(p.numel() for p in model.parameters())  # before sharding: each rank then holds its part
    data = TensorDataset(torch.randn(8, width), torch.randn(8, width))
    probe = SaveProbe(out_dir, repeats)
    strategy = DDPFullyShardedStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=kind,
                                       checkpoint_io=ShardedCheckpointIO(async_save=how == "async"))
    trainer = Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        callbacks=[probe],
        **_common.QUIET_TRAINER,
        use_distributed_sampler=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    _common.write_rank_result(out_dir, trainer.global_rank, {"saves": probe.saves, "numel": numel})


def measure(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sizes = ["--depth", str(args.depth), "--width", str(args.width), "--repeats", str(args.repeats)]
    started = time.perf_counter()
    ranks = _common.launch(Path(__file__).resolve(), [*sizes, "--worker", mode], work / mode, LAUNCH_TIMEOUT_S)
    print(f"  {mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
    measured = [rank["saves"][1:] for rank in ranks]  # the first save warms up the file system and allocator
    count = len(measured[0])
    return {
        "blocked": statistics.median(max(r[i]["blocked"] for r in measured) for i in range(count)),
        "written": statistics.median(max(r[i]["written"] for r in measured) for i in range(count)),
        "numel": ranks[0]["numel"],
    }


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    numel = next(iter(results.values()))["numel"]
    lines = [
        "# Checkpoint saves: how long training is blocked, sync against async",
        "",
        f"- Machine: {_common.machine()}; 2 processes",
        f"- Versions: {_common.versions()}",
        f"- Model: {args.depth} x Linear({args.width}, {args.width}), {numel / 1e6:.1f} M parameters, each Linear its"
        " own FSDP unit; Adam after one step; float32",
        f"- Each mode in a fresh launch; {args.repeats} saves, medians over all but the first; the slowest rank's time",
        "",
        "| state_dict_type | Plugin | Training blocked (s) | Until written (s) | Blocked vs. sync |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for kind in ("full", "sharded"):
        sync = results[f"{kind}-sync"]["blocked"]
        for how in ("sync", "async"):
            r = results[f"{kind}-{how}"]
            plugin = "ShardedCheckpointIO(async_save=True)" if how == "async" else "ShardedCheckpointIO()"
            lines.append(f"| {kind} | {plugin} | {r['blocked']:.3f} | {r['written']:.3f} | {r['blocked'] / sync:.0%} |")
    lines += ["", "Regenerate with `.venv/bin/python benchmarks/async_saving.py`."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--worker", choices=[f"{k}-{h}" for k, h in MODES], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.depth, args.width, args.repeats, args.out)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-async-") as scratch:
        results = {f"{k}-{h}": measure(f"{k}-{h}", args, Path(scratch)) for k, h in MODES}
    _common.publish(report(results, args), OUTPUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
