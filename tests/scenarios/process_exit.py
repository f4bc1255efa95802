"""Fit twice, keep the Trainer referenced to the end, and record what is left of FairScale and gloo.

Each rank writes ``--out-dir/rank<N>.json``: at the first training step of each ``fit``, how many of the
LightningModule's parameters from before the ``fit`` are still alive (with FSDP, the unsharded originals: the
sharded model replaces them); after each ``fit`` (and a garbage collection) the number of live FairScale FSDP units
and reduce-scatter bucketers (the module stays sharded after ``fit``: its units live as long as it does, and the
second ``fit`` reuses them), and the same once the module is released; and — from the last ``atexit`` handler, registered before
anything else so that it runs after the strategy's — the names of the process's threads that belong to gloo. A user's
script that keeps its ``trainer`` in a global looks like this one; gloo threads still running when the interpreter
shuts down can abort a finished run ("terminate called without an active exception").
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECORD: dict[str, Any] = {"after_fit": []}
PARSER = argparse.ArgumentParser()
PARSER.add_argument("--out-dir", required=True)
PARSER.add_argument("--strategy", required=True, choices=["fsdp_fairscale", "ddp_sharded"])
TRAINER: Any = None  # kept to the end, as a user's script that holds its trainer in a global does


def thread_names() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


def write_record(out_dir: str) -> None:
    """Runs last: every other ``atexit`` handler (the strategy's included) was registered later."""
    RECORD["threads_at_exit"] = thread_names()
    rank = os.environ.get("LOCAL_RANK", "0")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(RECORD))


def live(cls: type) -> int:
    gc.collect()
    return sum(isinstance(obj, cls) for obj in gc.get_objects())


def fit_twice(strategy: str) -> None:
    global TRAINER
    # Imported here, after ``write_record`` is registered: nothing they register at exit may run after it.
    import torch
    from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer
    from fairscale.nn import FullyShardedDataParallel

    import lightning_fairscale  # noqa: F401  (registers the strategy names)
    from scenarios.common import RegressionModel
    from scenarios.flavor import Callback, Trainer

    class CountOriginals(Callback):
        def __init__(self, originals: list[weakref.ref]) -> None:
            self.originals = originals

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            gc.collect()
            RECORD["originals_alive"].append(sum(ref() is not None for ref in self.originals))

    RECORD["originals_alive"] = []
    model = RegressionModel()
    for _ in range(2):
        originals = [weakref.ref(param) for param in model.parameters()]
        RECORD["model_parameters"] = len(originals)
        TRAINER = Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[CountOriginals(originals)],
        )  # fmt: skip
        del originals
        TRAINER.fit(model)
        RECORD["after_fit"].append(
            {"fsdp_units": live(FullyShardedDataParallel), "bucketers": live(ReduceScatterBucketer)}
        )
    if hasattr(TRAINER.strategy, "unshard_module"):
        TRAINER.strategy.unshard_module(rank_zero_only=False)
    RECORD["trained"] = bool(torch.isfinite(next(model.parameters())).all())
    del model
    RECORD["after_release"] = {"fsdp_units": live(FullyShardedDataParallel), "bucketers": live(ReduceScatterBucketer)}


if __name__ == "__main__":
    ARGS = PARSER.parse_args()
    atexit.register(write_record, ARGS.out_dir)
    fit_twice(ARGS.strategy)
