"""``lightning-fairscale-consolidate SRC_DIR OUT.ckpt``: a sharded checkpoint directory to one full checkpoint file.

Runs in one CPU process, with no process group and no GPU, and needs memory for the full model and optimizer state.
The result is what ``DDPFullyShardedStrategy(state_dict_type="full")`` would have saved at the same step, in the
layout it saved (the Trainer's, or Fabric's for ``fabric.save``): it resumes training on any number of processes, and
a Trainer's loads with ``LightningModule.load_from_checkpoint`` (without FairScale).
Also runs as ``python -m lightning_fairscale.consolidate``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lightning_fairscale.checkpoint.files import CheckpointFileError, find_checkpoint, is_sharded, write_atomically
from lightning_fairscale.fsdp.sharded_checkpoint import consolidate

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-fairscale-consolidate",
        description="Turn a sharded checkpoint directory (DDPFullyShardedStrategy(state_dict_type='sharded')) into"
        " one full checkpoint file (in the layout it was saved in: the Trainer's or Fabric's), loadable on any number"
        " of processes and without FairScale.",
    )
    parser.add_argument("source", type=Path, help="the sharded checkpoint directory (holds meta.pt and shard-*.pt)")
    parser.add_argument("output", type=Path, help="the full checkpoint file to write (e.g. model-full.ckpt)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line tool; returns the exit status."""
    args = _parser().parse_args(argv)
    started = time.perf_counter()

    def say(message: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

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
        checkpoint = consolidate(args.source, progress=say)
    except (CheckpointFileError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    say(f"writing {args.output}")
    write_atomically(checkpoint, args.output)
    size = args.output.stat().st_size / 2**20
    say(f"done: {size:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
