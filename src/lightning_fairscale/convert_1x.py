"""``lightning-fairscale-convert-1x SRC DST``: a Lightning 1.x FairScale checkpoint without its incomplete optimizer
state.

Lightning 1.x's ``DDPFullyShardedStrategy`` saved only rank 0's shard of the optimizer state (see
:mod:`lightning_fairscale.checkpoint.legacy`). The command writes a copy of such a checkpoint without that state,
keeping the weights, loops, LR schedulers, callbacks and the optimizers' hyperparameters; this package's strategies
resume the copy with a fresh optimizer state. Runs in one CPU process; the write is atomic. Also runs as
``python -m lightning_fairscale.convert_1x``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lightning_fairscale import checkpointer
from lightning_fairscale.checkpoint.files import CheckpointFileError
from lightning_fairscale.checkpoint.legacy import written_version

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-fairscale-convert-1x SRC DST``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="lightning-fairscale-convert-1x",
        description="Convert a checkpoint of Lightning 1.x's FairScale FSDP strategy (strategy='ddp_fully_sharded' or"
        " 'fsdp') so that it resumes with lightning-fairscale's strategies with a fresh optimizer state. Lightning"
        " 1.x saved only rank 0's shard of the optimizer state; this drops it and keeps the weights, loops, LR"
        " schedulers, callbacks and the optimizers' hyperparameters. The file is unpickled in full: convert only"
        " checkpoints you trust. Also runs as python -m lightning_fairscale.convert_1x.",
    )
    parser.add_argument("source", type=Path, help="the Lightning 1.x checkpoint file")
    parser.add_argument("output", type=Path, help="the converted checkpoint file to write")
    args = parser.parse_args(argv)
    if args.output.resolve() == args.source.resolve():
        print("error: write the converted checkpoint to another file; the original stays as it is.", file=sys.stderr)
        return 2
    try:
        checkpoint, report = checkpointer.convert_1x(args.source, args.output)
    except (CheckpointFileError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for line in report:
        print(line)
    print(
        f"wrote {args.output} (from Lightning {written_version(checkpoint)}): resume it with lightning-fairscale's"
        " DDPFullyShardedStrategy or DDPShardedStrategy; the optimizers start with a fresh state."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
