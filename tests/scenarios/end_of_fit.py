"""What the end of ``fit`` costs, and what the module is good for afterwards (run as a script, 2 ranks).

Each rank writes ``--out-dir/rank<N>.json``: its resident-set growth from the end of the last training step to the
return of ``fit`` (``/proc/self/clear_refs`` resets the peak, VmHWM is read afterwards), the parameter bytes of the
full model, the validation loss of ``trainer.validate`` on the same instance after ``fit``, that loss recomputed
on the unsharded module (``unshard_module``), and what ``trainer.save_checkpoint`` after ``fit`` and after
``validate`` wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_fairscale  # noqa: E402,F401
from scenarios.flavor import Callback, DDPFullyShardedStrategy, LightningModule, Trainer, seed_everything  # noqa: E402

WIDTH, DEPTH = 1024, 24  # 25.2 M parameters: 100 MB in fp32


def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set


class Wide(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g))


class MarkEndOfTraining(Callback):
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.resident = resident_kib("VmRSS")
        reset_peak()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--state-dict-type", default="full")
    args = p.parse_args()
    out = Path(args.out_dir)
    seed_everything(5)
    model = Wide()
    mark = MarkEndOfTraining()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPFullyShardedStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=args.state_dict_type),
        max_steps=2,
        callbacks=[mark],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    loader = DataLoader(data(), batch_size=4)
    trainer.fit(model, loader)
    record: dict[str, Any] = {
        "end_of_fit_growth_bytes": (resident_kib("VmHWM") - mark.resident) * 1024,
        "parameter_bytes": (WIDTH * WIDTH + WIDTH) * DEPTH * 4,
    }
    trainer.save_checkpoint(out / "after-fit.ckpt")
    record["validate"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    trainer.save_checkpoint(out / "after-validate.ckpt")
    module = trainer.strategy.unshard_module(rank_zero_only=False)
    with torch.no_grad():
        losses = [nn.functional.mse_loss(module(x), y) for x, y in loader]
    record["unsharded_loss"] = float(torch.stack(losses).mean())
    record["unsharded_parameters"] = sum(p.numel() for p in module.parameters())
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
