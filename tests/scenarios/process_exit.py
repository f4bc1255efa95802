"""Fit twice, keep the Trainer referenced to the end, and record what is left of FairScale, gloo and our patches.

Each rank writes ``--out-dir/rank<N>.json``: at the first training step of each ``fit``, how many of the
LightningModule's parameters from before the ``fit`` are still alive (with FSDP, the unsharded originals: the
sharded model replaces them); after each ``fit`` (and a garbage collection) the number of live FairScale FSDP units
and reduce-scatter bucketers (the module stays sharded after ``fit``: its units live as long as it does, and the
second ``fit`` reuses them), and the same once the module is released; and — from the last ``atexit`` handler,
registered before anything else so that it runs after the strategy's — the names of the process's threads that belong
to gloo. A user's script that keeps its ``trainer`` in a global looks like this one; gloo threads still running when
the interpreter shuts down can abort a finished run ("terminate called without an active exception").

It also records what the strategies changed of torch, FairScale and Lightning (``patches``): during ``fit``, after
each ``fit`` (the strategy torn down), after ``unshard_module()`` (by the second Trainer, whose strategy did not wrap
the module), and with ``--fabric`` after a Fabric FSDP loop's ``teardown``: whether
FairScale's FSDP module sees the real ``torch``, whether CPU tensors have a ``record_stream`` kernel, whether the
Trainer's ``ModelSummary`` callbacks have a hook of ours, how many layers are checkpointed, and whether an
all-reduce over the default group works. With ``--user-group`` the script creates the default group itself before
the Trainer (its ranks started by the test, as ``torchrun`` starts them), checks from its last ``atexit`` handler
that the group still works after the strategies' exit handling, and destroys it there.
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

RECORD: dict[str, Any] = {"after_fit": [], "patches": {}}
PARSER = argparse.ArgumentParser()
PARSER.add_argument("--out-dir", required=True)
PARSER.add_argument("--strategy", required=True, choices=["fsdp_fairscale", "ddp_sharded"])
PARSER.add_argument("--user-group", action="store_true", help="create (and destroy) the default group ourselves")
PARSER.add_argument("--fabric", action="store_true", help="then an FSDP loop with Fabric, torn down")
TRAINER: Any = None  # kept to the end, as a user's script that holds its trainer in a global does


def thread_names() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


def default_group_works() -> bool:
    import torch
    import torch.distributed as dist

    try:
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
    except (RuntimeError, ValueError):  # no default group (any more)
        return False
    return tensor.item() == dist.get_world_size()


def write_record(out_dir: str, user_group: bool) -> None:
    """Runs last: every other ``atexit`` handler (the strategy's included) was registered later."""
    if user_group:
        import torch.distributed as dist

        RECORD["user_group_works_at_exit"] = default_group_works()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
    RECORD["threads_at_exit"] = thread_names()
    rank = os.environ.get("LOCAL_RANK", "0")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(RECORD))


def live(cls: type) -> int:
    gc.collect()
    return sum(isinstance(obj, cls) for obj in gc.get_objects())


def reducers() -> int:
    """The units' gradient reducers alive: FairScale's bucketers, or on CPU (gloo) the asynchronous reducer of
    ``fsdp.patches.reduce_scatter`` that replaces them."""
    from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer

    from lightning_fairscale.fsdp.patches.reduce_scatter import AsyncReduceScatter

    return live(ReduceScatterBucketer) + live(AsyncReduceScatter)


def checkpointed(module: Any) -> bool:
    """Whether the strategy's activation checkpointing gave ``module`` a ``forward`` that recomputes its activations."""
    return type(vars(module).get("forward")).__name__ == "CheckpointedForward"


def patches(trainer: Any = None, model: Any = None) -> dict[str, Any]:
    """What our strategies changed of torch, FairScale and Lightning, as seen from outside."""
    import torch
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

    from scenarios.flavor import pl

    try:
        torch.ones(1).record_stream(torch.Stream(device="cpu"))
        record_stream_on_cpu = True
    except NotImplementedError:  # PyTorch has no CPU kernel for it
        record_stream_on_cpu = False
    summaries = [c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelSummary)] if trainer else []
    return {
        "fairscale_sees_torch": fsdp_module.torch is torch,
        "record_stream_on_cpu": record_stream_on_cpu,
        "summary_hooks": sum("_summary" in vars(callback) for callback in summaries),
        "checkpointed": sum(map(checkpointed, model.modules())) if model is not None else None,
        "default_group_works": default_group_works(),
    }


def create_default_group() -> None:
    """As a user's script run by ``torchrun`` does. After the imports: a module imported while a default group
    exists may keep it (``group=dist.group.WORLD`` as a default argument), and the group then outlives its
    ``destroy_process_group`` (with its threads)."""
    import torch.distributed

    # The test starts the ranks with a launcher's variables (one node: the local rank is the rank).
    rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def fit_twice(strategy_name: str, user_group: bool) -> Any:
    global TRAINER
    # Imported here, after ``write_record`` is registered: nothing they register at exit may run after it.
    import torch
    from fairscale.nn import FullyShardedDataParallel

    import lightning_fairscale  # noqa: F401  (registers the strategy names)
    from lightning_fairscale.fsdp.unit.param_views import views_of
    from lightning_fairscale.fsdp.unit.unit_state import flat_states, peek_owner
    from lightning_fairscale.fsdp.wrapping.unwrapping import wrapped_root
    from scenarios.common import Block, RegressionModel
    from scenarios.flavor import Callback, DDPFullyShardedStrategy, Trainer

    if user_group:
        create_default_group()

    class CountOriginals(Callback):
        def __init__(self, originals: list[weakref.ref]) -> None:
            self.originals = originals

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            gc.collect()
            RECORD["originals_alive"].append(sum(ref() is not None for ref in self.originals))
            RECORD["patches"].setdefault("during_fit", patches(trainer, pl_module))

    RECORD["originals_alive"] = []
    model = RegressionModel()
    for index in range(2):
        # The parameters the fit starts from, but for FSDP's shards and the views into them that the model holds as
        # its parameters once sharded (the second fit starts from the first's): those hold no memory of their own.
        root = wrapped_root(model)  # the root unit wraps the LightningModule: it is not among its modules
        views = {
            id(view.param)
            for unit in (root.modules() if root is not None else []) if isinstance(unit, FullyShardedDataParallel)
            for state in flat_states(unit, peek_owner(root)) for view in views_of(state)
        }  # fmt: skip
        originals = [
            weakref.ref(param) for param in model.parameters()
            if not hasattr(param, "_is_sharded") and id(param) not in views
        ]  # fmt: skip
        del root
        RECORD["model_parameters"] = len(originals)
        # FSDP: every Block recomputes its activations (a unit of its own); the second Trainer's strategy unshards.
        fsdp = strategy_name == "fsdp_fairscale"
        strategy = DDPFullyShardedStrategy(activation_checkpointing=Block) if fsdp else strategy_name
        TRAINER = Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, callbacks=[CountOriginals(originals)],
        )  # fmt: skip
        del originals
        TRAINER.fit(model)
        RECORD["after_fit"].append(
            {"fsdp_units": live(FullyShardedDataParallel), "reducers": reducers()}
        )
        RECORD["patches"][f"after_fit_{index}"] = patches(TRAINER, model)
    if hasattr(TRAINER.strategy, "unshard_module"):
        TRAINER.strategy.unshard_module(rank_zero_only=False)
        RECORD["patches"]["after_unshard"] = patches(TRAINER, model)  # no garbage collection: released at once
    RECORD["trained"] = bool(torch.isfinite(next(model.parameters())).all())
    del model
    RECORD["after_release"] = {"fsdp_units": live(FullyShardedDataParallel), "reducers": reducers()}


def fabric_loop() -> None:
    """An FSDP loop with Fabric on the processes and default group there are, then the strategy's teardown."""
    import torch

    from scenarios.common import Block, RegressionModelWrapper, build_network
    from scenarios.flavor import Fabric, FabricDDPFullyShardedStrategy

    strategy = FabricDDPFullyShardedStrategy(auto_wrap_policy={Block}, activation_checkpointing=Block)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    inner = RegressionModelWrapper(build_network())
    model, optimizer = fabric.setup(inner, torch.optim.SGD(inner.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(4, 16)).sum())
    optimizer.step()
    fabric.strategy.teardown()
    RECORD["patches"]["fabric_after_teardown"] = patches(model=inner)


if __name__ == "__main__":
    ARGS = PARSER.parse_args()
    atexit.register(write_record, ARGS.out_dir, ARGS.user_group)
    fit_twice(ARGS.strategy, ARGS.user_group)
    if ARGS.fabric:
        fabric_loop()
