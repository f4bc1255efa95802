"""``lightning-fairscale-consolidate SRC OUT``: a sharded checkpoint directory to one full checkpoint file, or any
checkpoint to Hugging Face-ready safetensors.

``lightning-fairscale-consolidate SRC_DIR OUT.ckpt`` (``--format ckpt``, the default) runs in one CPU process, with
no process group and no GPU, and needs memory for the full model and optimizer state. The result is what
``DDPFullyShardedStrategy(state_dict_type="full")`` would have saved at the same step, in the layout it saved (the
Trainer's, or Fabric's for ``fabric.save``): it resumes training on any number of processes, and a Trainer's loads
with ``LightningModule.load_from_checkpoint`` (without FairScale).

``lightning-fairscale-consolidate SRC OUT_DIR --format safetensors [--prefix model.] [--max-shard-size 5GB]`` writes,
from a sharded checkpoint directory or a full checkpoint file, what Hugging Face's ``save_pretrained`` writes
(``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``): the prefix
stripped, tied parameters written once; with the model's ``config.json`` beside them, ``from_pretrained(OUT_DIR)``
loads them. One tensor at a time: the memory of the largest tensor, never of the model
(:func:`~lightning_fairscale.fsdp.state.export.export_safetensors`, also the Python function).

Also runs as ``python -m lightning_fairscale.consolidate``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Optional

from lightning_fairscale import checkpointer
from lightning_fairscale.checkpoint.files import CheckpointFileError, find_checkpoint, is_sharded
from lightning_fairscale.fsdp.state.export import ExportReport, export_safetensors

__all__ = ["ExportReport", "export_safetensors", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fairscale-consolidate",
        description="Turn a sharded checkpoint directory (DDPFullyShardedStrategy(state_dict_type='sharded')) into"
        " one full checkpoint file (in the layout it was saved in: the Trainer's or Fabric's), loadable on any number"
        " of processes and without FairScale; or, with --format safetensors, write the model of a sharded or full"
        " checkpoint as Hugging Face's save_pretrained does (one tensor at a time), for from_pretrained.",
    )
    parser.add_argument(
        "source", type=Path, help="the sharded checkpoint directory (holds meta.pt and shard-*.pt); with --format"
        " safetensors also a full checkpoint file"
    )
    parser.add_argument(
        "output", type=Path, help="the full checkpoint file to write (e.g. model-full.ckpt); with --format safetensors"
        " the folder to write model.safetensors (or its shards and index) into"
    )
    parser.add_argument(
        "--format", choices=("ckpt", "safetensors"), default="ckpt", help="ckpt (default): a full Lightning"
        " checkpoint; safetensors: the model's weights as Hugging Face's save_pretrained writes them"
    )
    parser.add_argument(
        "--prefix", default="", help="safetensors: the LightningModule attribute that holds the model (e.g. model.):"
        " stripped; the keys outside it are left out"
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="safetensors: the largest file (as save_pretrained takes it: 5GB is"
        " 5*10^9 bytes, 2GiB 2*2^30); a larger model is split into files with an index (default: 5GB)"
    )
    parser.add_argument(
        "--drop-key", action="append", default=[], metavar="KEY", help="safetensors: leave out this key (with or"
        " without the prefix); may be repeated. Tied parameters are written once without it"
    )
    parser.add_argument(
        "--key", default=None, help="safetensors, from a full checkpoint file: the entry that holds the state dict"
        " (default: the Trainer's state_dict, or the only state dict of the file)"
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line tool; returns the exit status."""
    args = _parser().parse_args(argv)
    started = time.perf_counter()

    def say(message: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    if args.format == "safetensors":
        return _export(args, say)
    if not is_sharded(find_checkpoint(args.source)):
        print(
            f"error: {args.source} is not a sharded checkpoint directory (a directory with meta.pt and one"
            " shard-XXXXX-of-YYYYY.pt per rank, as DDPFullyShardedStrategy(state_dict_type='sharded') writes).",
            file=sys.stderr,
        )
        return 2
    if args.output.resolve() == args.source.resolve():
        print("error: the output must not be the sharded checkpoint directory itself.", file=sys.stderr)
        return 2
    try:
        checkpointer.consolidate(args.source, args.output, progress=say)
    except (CheckpointFileError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    size = args.output.stat().st_size / 2**20
    say(f"done: {size:.1f} MiB")
    return 0


def _export(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    try:
        report = checkpointer.export(
            args.source, args.output, prefix=args.prefix, max_shard_size=args.max_shard_size,
            drop_keys=args.drop_key, key=args.key, progress=say,
        )  # fmt: skip
    except (CheckpointFileError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for name, kept in report.tied.items():
        say(f"tied: {name} is {kept}, written once (from_pretrained ties it again)")
    if report.outside_prefix:
        say(f"left out {len(report.outside_prefix)} keys outside the prefix {args.prefix!r}:"
            f" {', '.join(report.outside_prefix[:5])}{' ...' if len(report.outside_prefix) > 5 else ''}")  # fmt: skip
    if report.not_tensors:
        say(f"left out entries that are not tensors: {', '.join(report.not_tensors)}")
    files = ", ".join(path.name for path in report.files)
    say(f"done: {len(report.written)} tensors, {report.total_bytes / 2**20:.1f} MiB in {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
