"""The sha256 of every kind of checkpoint file the package writes, to check that a change leaves them byte-for-byte
as they were.

Run from the repository root (minutes on 2 cores; every training run has 2 processes, Lightning's launcher starting
the second)::

    PYTHONPATH=$PWD/src .venv/bin/python tests/checkpoint_digests.py /tmp/lf-digests > digests.json
    PYTHONPATH=$PWD/src .venv/bin/python tests/checkpoint_digests.py /tmp/lf-digests --compare digests.json

It writes, with fixed seeds, under ``OUT`` (always the same path: Lightning records the paths of some callbacks):
the Trainer's full and sharded checkpoints of ``DDPFullyShardedStrategy``, Fabric's full and sharded ones, the
Trainer's and Fabric's of ``DDPShardedStrategy``, the consolidation of the Trainer's sharded directory, its
safetensors export and the 1.x conversion of ``tests/fixtures/lightning_1x/fsdp_adam.ckpt``; then prints a JSON
object ``{relative file: sha256}``. Each file is also read back across the front ends: the Trainer's files into
Fabric's strategy and Fabric's into the Trainer's (``resumed`` in the output: the sha256 of the weights loaded).

Not a test (digests depend on the CPU's arithmetic): compare before and after a change on one machine.
``tests/fixtures/checkpoint_digests.json`` holds main's digests as of issue 55 item 4 (the development machine: 2 CPU
cores, torch 2.13 CPU), the same in 3 runs; ``resumed/*-loaded``: the weights right after loading, ``resumed/*`` after
2 more steps (the Trainer's runs: a Fabric file holds no loop state; rank 0's full state dict in every case).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _model() -> Any:
    """The model, its parameters named as the LightningModule's (``net.*``), so that either front end resumes
    the other's files."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2)
            )

        def forward(self, x: Any) -> Any:
            return self.net(x)

    return Net()


def _batches(rank: int) -> list[Any]:
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(3, 4, generator=generator), torch.randn(3, 2, generator=generator)) for _ in range(2)]


def _weights_digest(state: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().double().numpy().tobytes())
    return digest.hexdigest()


def _fsdp_policy() -> Any:
    from torch import nn

    return {nn.Sequential}


def _full_state(strategy: Any) -> dict[str, Any]:
    """The LightningModule's full state dict on rank 0 (a collective call), whatever the strategy saves."""
    kind = getattr(strategy, "state_dict_type", None)
    if kind is not None:
        strategy.state_dict_type = "full"
    try:
        return strategy.lightning_module_state_dict()
    finally:
        if kind is not None:
            strategy.state_dict_type = kind


def trainer_run(kind: str, out: Path) -> None:
    """Train 2 steps under the Trainer and save (``fsdp-full``, ``fsdp-sharded``, ``ddp_sharded``); or (``resume-*``)
    load one of Fabric's files into the Trainer's strategy and record the weights."""
    import pytorch_lightning as pl
    import torch

    from lightning_fairscale import DDPFullyShardedStrategy, DDPShardedStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model().net

        def training_step(self, batch: Any, index: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def on_train_start(self) -> None:  # after the checkpoint is restored
            if kind.startswith("resume-"):
                state = _full_state(self.trainer.strategy)
                if self.trainer.is_global_zero:
                    (out / f"{kind}-loaded.txt").write_text(_weights_digest(state))

        def train_dataloader(self) -> Any:
            x, y = (torch.cat(t) for t in zip(*_batches(self.global_rank)))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)

    if kind == "ddp_sharded":
        strategy: Any = DDPShardedStrategy()
    else:
        sharded = kind in ("fsdp-sharded", "resume-fabric-sharded")
        strategy = DDPFullyShardedStrategy(
            auto_wrap_policy=_fsdp_policy(), state_dict_type="sharded" if sharded else "full"
        )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    module = Module()
    if kind.startswith("resume-"):
        source = out / ("fabric-sharded.ckpt" if kind.endswith("sharded") else "fabric-full.ckpt")
        trainer.fit(module, ckpt_path=source)  # a Fabric file has no loops: 2 more steps
        state = _full_state(trainer.strategy)
        if trainer.is_global_zero:
            (out / f"{kind}.txt").write_text(_weights_digest(state))
        return
    trainer.fit(module)
    name = {"fsdp-full": "trainer-full.ckpt", "fsdp-sharded": "trainer-sharded.ckpt"}.get(kind, "ddp-sharded.ckpt")
    trainer.save_checkpoint(out / name)


def fabric_run(kind: str, out: Path) -> None:
    """Train 2 steps under Fabric and save; or (``resume-*``) load one of the Trainer's files and record the
    weights."""
    import torch
    from lightning_fabric import Fabric

    from lightning_fairscale.fabric import DDPFullyShardedStrategy, DDPShardedStrategy

    if kind == "fabric-ddp_sharded":
        strategy: Any = DDPShardedStrategy()
    else:
        sharded = kind in ("fabric-sharded", "fabric-resume-trainer-sharded")
        strategy = DDPFullyShardedStrategy(
            auto_wrap_policy=_fsdp_policy(), state_dict_type="sharded" if sharded else "full"
        )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    if kind == "fabric-ddp_sharded":  # the optimizers are sharded with the model, in one call
        module = _model()
        model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=0.01))
    else:
        model = fabric.setup_module(_model())
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    if kind.startswith("fabric-resume-"):
        source = out / ("trainer-sharded.ckpt" if kind.endswith("sharded") else "trainer-full.ckpt")
        fabric.load(source, {"model": model, "optimizer": optimizer})
        state = fabric.strategy.get_module_state_dict(model)
        if fabric.is_global_zero:
            (out / f"{kind}.txt").write_text(_weights_digest(state))
        return
    for x, y in _batches(fabric.global_rank):
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    name = {"fabric-full": "fabric-full.ckpt", "fabric-sharded": "fabric-sharded.ckpt"}.get(
        kind, "fabric-ddp-sharded.ckpt"
    )
    fabric.save(out / name, {"model": model, "optimizer": optimizer, "step": 2})


def offline(out: Path) -> None:
    """Consolidation, safetensors export and the 1.x conversion, through the command-line tools."""
    from lightning_fairscale import consolidate, convert_1x

    assert consolidate.main([str(out / "trainer-sharded.ckpt"), str(out / "consolidated.ckpt"), "--quiet"]) == 0
    assert consolidate.main([
        str(out / "trainer-sharded.ckpt"), str(out / "export"), "--format", "safetensors", "--prefix", "net.",
        "--quiet",
    ]) == 0  # fmt: skip
    assert convert_1x.main([str(ROOT / "tests/fixtures/lightning_1x/fsdp_adam.ckpt"), str(out / "converted.ckpt")]) == 0


RUNS = [
    ("trainer", "fsdp-full"), ("trainer", "fsdp-sharded"), ("trainer", "ddp_sharded"),
    ("fabric", "fabric-full"), ("fabric", "fabric-sharded"), ("fabric", "fabric-ddp_sharded"),
    ("trainer", "resume-fabric-full"), ("trainer", "resume-fabric-sharded"),
    ("fabric", "fabric-resume-trainer-full"), ("fabric", "fabric-resume-trainer-sharded"),
]  # fmt: skip


def digests(out: Path) -> dict[str, str]:
    found = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        name = str(path.relative_to(out))
        if path.suffix == ".txt":
            found[f"resumed/{path.stem}"] = path.read_text()
        else:
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--run", nargs=2, metavar=("FRONT", "KIND"))
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()
    out = args.out.resolve()
    if args.run:
        front, kind = args.run
        (trainer_run if front == "trainer" else fabric_run)(kind, out)
        return 0
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for front, kind in RUNS:
        subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(out), "--run", front, kind], check=True, env=env,
            stdout=subprocess.DEVNULL, timeout=600,
        )  # fmt: skip
    offline(out)
    found = digests(out)
    if args.compare is None:
        print(json.dumps(found, indent=1, sort_keys=True))
        return 0
    expected = json.loads(args.compare.read_text())
    differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    for key in differ:
        print(f"DIFFERS: {key}: {expected.get(key)} -> {found.get(key)}")
    print(f"{len(found) - len(differ)} of {len(expected)} identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
