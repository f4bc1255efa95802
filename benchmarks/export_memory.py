"""Benchmark: the peak memory of exporting a 1B-parameter sharded checkpoint to safetensors (issue 36).

Two fresh launches:

1. **save**: ``memory_lifecycle``'s large model (a stem, residual MLP blocks of width 2048, a norm and a head; 1,015.5 M
   parameters, 30 blocks) built under ``trainer.init_module(empty_init=True)`` on ``--ranks`` CPU processes, each
   block an FSDP unit (``auto_wrap_policy={Block}``), ``fit`` with ``max_steps=0``, then
   ``trainer.save_checkpoint`` with ``state_dict_type="sharded"``: a sharded checkpoint of 4 GB of parameters.
2. **export**: one process, ``export_safetensors`` (what ``lightning-fairscale-consolidate SRC OUT --format
   safetensors`` runs) of that checkpoint, with ``--max-shard-size`` (5GB: one file, as ``save_pretrained``). Its peak
   resident set (``VmHWM``, reset after the imports) against its resident set before the export, the largest tensor
   of the model and the whole model.

Run it from the project's root (about 3 minutes here; 9 GB of disk under /tmp, deleted at the end, and about 3 GB of
memory for the save launch); it writes ``results/export_memory.md``::

    .venv/bin/python benchmarks/export_memory.py
    .venv/bin/python benchmarks/export_memory.py --params 1e8 --width 1024   # smaller
"""

from __future__ import annotations

import argparse
import gc
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pytorch_lightning import Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import Block  # noqa: E402
from memory_lifecycle import Stack, depth_for, memory_kib, parameter_count  # noqa: E402

from lightning_fairscale.fsdp.state.export import export_safetensors  # noqa: E402
from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "results" / "export_memory.md"
MIB = _common.MIB
LAUNCH_TIMEOUT_S = 1800


def run_save_worker(args: argparse.Namespace) -> None:
    """One rank of the save launch: the model built on the meta device, sharded as it is wrapped, saved sharded."""
    seed_everything(0, verbose=False)
    strategy = DDPFullyShardedStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    trainer = Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=0,
                      use_distributed_sampler=False, **_common.QUIET_TRAINER)  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = Stack(args.width, args.depth, build_now=True)
    data = TensorDataset(torch.randn(2, args.width), torch.randn(2, args.width))
    trainer.fit(model, DataLoader(data, batch_size=1))
    trainer.save_checkpoint(args.ckpt)
    _common.write_rank_result(args.out, trainer.global_rank, {"saved": str(args.ckpt)})
    if dist.is_initialized():
        dist.barrier()


def run_export_worker(args: argparse.Namespace) -> None:
    """The export, in a process of its own: its peak resident set, from after the imports."""
    gc.collect()
    before = memory_kib()
    _common.reset_peak_rss()
    started = time.perf_counter()
    report = export_safetensors(args.ckpt, args.hf, max_shard_size=args.max_shard_size)
    seconds = time.perf_counter() - started
    result = {
        "before": before, "peak_kib": _common.status_kib("VmHWM"), "after": memory_kib(), "seconds": seconds,
        "files": {p.name: p.stat().st_size for p in report.files}, "tensors": len(report.written),
        "total_bytes": report.total_bytes,
    }  # fmt: skip
    _common.write_rank_result(args.out, 0, result)


def largest_tensor_bytes(width: int) -> int:
    """The largest tensor of :class:`Stack`: a block's ``Linear(w, 4w)`` weight, 4w² float32 elements."""
    return 4 * width * width * 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=1.0e9)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--worker", choices=("save", "export"))
    parser.add_argument("--depth", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--hf", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker == "save":
        run_save_worker(args)
        return 0
    if args.worker == "export":
        run_export_worker(args)
        return 0
    depth = depth_for(args.params, args.width)
    numel = parameter_count(args.width, depth)
    work = Path(tempfile.mkdtemp(prefix="export_memory_", dir="/tmp"))
    script = Path(__file__).resolve()
    try:
        ckpt, hf = work / "sharded.ckpt", work / "hf"
        started = time.perf_counter()
        _common.launch(script, ["--worker", "save", "--width", str(args.width), "--depth", str(depth), "--world",
                                str(args.ranks), "--ckpt", str(ckpt)], work / "save", LAUNCH_TIMEOUT_S)  # fmt: skip
        save_seconds = time.perf_counter() - started
        checkpoint_bytes = sum(p.stat().st_size for p in ckpt.iterdir())
        [result] = _common.launch(script, ["--worker", "export", "--ckpt", str(ckpt), "--hf", str(hf),
                                           "--max-shard-size", args.max_shard_size], work / "export", LAUNCH_TIMEOUT_S)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    before, peak = result["before"]["VmRSS"] / 1024, result["peak_kib"] / 1024
    largest, model = largest_tensor_bytes(args.width) / MIB, 4 * numel / MIB
    command = "python benchmarks/export_memory.py " + shlex.join(sys.argv[1:])
    files = ", ".join(f"{name} ({size / MIB:,.0f} MiB)" for name, size in result["files"].items())
    lines = [
        "# Exporting a sharded checkpoint to safetensors: peak memory",
        "",
        f"- Machine: {_common.machine()}; {_common.versions()}; {_common.load_average()}",
        f"- Command: `{command}`",
        f"- Model: {numel / 1e6:,.1f} M parameters (width {args.width}, {depth} blocks), float32: {model:,.0f} MiB;"
        f" its largest tensor {largest:,.0f} MiB",
        f"- Source: a sharded checkpoint of {args.ranks} processes ({checkpoint_bytes / MIB:,.0f} MiB, saved in"
        f" {save_seconds:.0f} s)",
        f"- Written: {result['tensors']} tensors, {result['total_bytes'] / MIB:,.0f} MiB: {files}, in"
        f" {result['seconds']:.0f} s",
        "",
        "| export process | MiB |",
        "|---|--:|",
        f"| resident before the export (interpreter, torch, FairScale) | {before:,.0f} |",
        f"| peak during the export (VmHWM) | {peak:,.0f} |",
        f"| **peak above the start** | **{peak - before:,.0f}** |",
        f"| the largest tensor | {largest:,.0f} |",
        f"| the whole model | {model:,.0f} |",
        "",
        f"The export held {(peak - before) / model:.1%} of the model's size above its start: one tensor at a time (the"
        " tensor assembled from the ranks' slices, and the pages of the source read for it until they are released).",
        "",
    ]
    _common.publish("\n".join(lines), OUTPUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
