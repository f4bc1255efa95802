"""Count how a call wanders through the project's own files (issue 55, item 5): stops and returns.

Runs in one process (a gloo group of one rank, on the CPU) and follows, with ``sys.setprofile``, which file of
``src/lightning_fairscale`` holds the innermost running frame of ours while one phase runs:

* **stops**: how many times that file changes (a call into another file of ours, or a return to one);
* **files**: how many files of ours the phase runs code in;
* **returns**: of the stops, those into a file the phase had been in before and left;
* **front-end stops**: of the stops, those into the adapters' files (the Trainer's and Fabric's strategies and what
  they call before the engine: ``strategies/``, ``fabric/``, ``callbacks/``, ``plugins/``, ``precision/``,
  ``_adapters/``, ``_compat.py``).

Phases: the Trainer's set-up of the sharded model (``strategy.setup``: wrapping, optimizers), one Trainer training
step (the third: ``on_train_batch_start`` to ``on_train_batch_end``), for ``DDPFullyShardedStrategy`` and
``DDPShardedStrategy``, and ``trainer.save_checkpoint`` after ``fit`` (FSDP: ``state_dict_type="sharded"``); Fabric's
``setup``, one step and a sharded ``fabric.save`` of ``DDPFullyShardedStrategy``.

Usage: ``PYTHONPATH=$PWD/src .venv/bin/python tools/call_path.py [--detail]``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

ROOT = str(Path(__import__("lightning_fairscale").__file__).parent) + os.sep
GENERATED = ROOT + "lightning" + os.sep  # the copies for the unified `lightning` package: not run here
FRONT_ENDS = ("strategies/", "fabric/", "callbacks/", "plugins/", "precision/", "_adapters/", "_compat.py")


def _ours(filename: str) -> Optional[str]:
    if filename.startswith(ROOT) and not filename.startswith(GENERATED):
        return filename[len(ROOT):]
    return None


class PathCounter:
    """The sequence of our files the innermost frame of ours is in, while on."""

    def __init__(self) -> None:
        self.sequence: list[str] = []

    def _move(self, file: Optional[str]) -> None:
        if file is not None and (not self.sequence or self.sequence[-1] != file):
            self.sequence.append(file)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self._move(_ours(frame.f_code.co_filename))
        elif event == "return" and _ours(frame.f_code.co_filename) is not None:
            back = frame.f_back
            while back is not None and _ours(back.f_code.co_filename) is None:
                back = back.f_back
            if back is not None:
                self._move(_ours(back.f_code.co_filename))

    def start(self) -> None:
        self.sequence = []
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)

    def figures(self) -> dict[str, Any]:
        seen: set[str] = set()
        returns = 0
        for file in self.sequence:
            returns += file in seen
            seen.add(file)
        front = sum(file.startswith(FRONT_ENDS) for file in self.sequence)
        return {"stops": len(self.sequence), "files": len(seen), "returns": returns, "front": front,
                "entries": Counter(self.sequence).most_common()}


def _trainer_phases(strategy_name: str, counter: PathCounter, report: Callable[[str, dict[str, Any]], None]) -> None:
    import pytorch_lightning as pl

    from lightning_fairscale.strategies import DDPFullyShardedStrategy, DDPShardedStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layers(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(32, 16))
            return torch.utils.data.DataLoader(data, batch_size=4)

    class Step(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:
                counter.start()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:
                counter.stop()
                report(f"Trainer {strategy_name}: one training step", counter.figures())

    if strategy_name == "fsdp_fairscale":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({nn.Sequential})
        strategy: Any = DDPFullyShardedStrategy(auto_wrap_policy=policy, state_dict_type="sharded")
    else:
        strategy = DDPShardedStrategy()
    setup = type(strategy).setup

    def counted_setup(self: Any, trainer: Any) -> None:
        counter.start()
        try:
            setup(self, trainer)
        finally:
            counter.stop()
        report(f"Trainer {strategy_name}: strategy.setup (wrapping, optimizers)", counter.figures())

    type(strategy).setup = counted_setup  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as folder:
            trainer = pl.Trainer(
                accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False, callbacks=[Step()],
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=folder,
            )
            trainer.fit(Module())
            counter.start()
            trainer.save_checkpoint(os.path.join(folder, "checkpoint"))
            counter.stop()
            report(f"Trainer {strategy_name}: trainer.save_checkpoint", counter.figures())
    finally:
        type(strategy).setup = setup  # type: ignore[method-assign]


def _fabric_phases(counter: PathCounter, report: Callable[[str, dict[str, Any]], None]) -> None:
    from lightning_fabric import Fabric
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_fairscale.fabric import DDPFullyShardedStrategy

    policy = ModuleWrapPolicy({nn.Sequential})
    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=DDPFullyShardedStrategy(auto_wrap_policy=policy, state_dict_type="sharded"))
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter.start()
    model, optimizer = fabric.setup(model, optimizer)
    counter.stop()
    report("Fabric fsdp_fairscale: fabric.setup (wrapping, optimizer)", counter.figures())
    for step in range(3):
        if step == 2:
            counter.start()
        loss = model(torch.randn(4, 16)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            counter.stop()
            report("Fabric fsdp_fairscale: one training step", counter.figures())
    with tempfile.TemporaryDirectory() as folder:
        counter.start()
        fabric.save(os.path.join(folder, "checkpoint"), {"model": model, "optimizer": optimizer, "step": 3})
        counter.stop()
        report("Fabric fsdp_fairscale: fabric.save (sharded)", counter.figures())


def main() -> None:
    detail = "--detail" in sys.argv
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    results: dict[str, dict[str, Any]] = {}

    def report(name: str, figures: dict[str, Any]) -> None:
        results[name] = figures

    counter = PathCounter()
    for name in ("fsdp_fairscale", "ddp_sharded"):
        _trainer_phases(name, counter, report)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    _fabric_phases(counter, report)
    for name, figures in results.items():
        print(f"{name}: {figures['stops']} stops in {figures['files']} files, {figures['returns']} returns,"
              f" {figures['front']} front-end stops")
        if detail:
            print("   ", ", ".join(f"{file} {n}" for file, n in figures["entries"]))


if __name__ == "__main__":
    main()
