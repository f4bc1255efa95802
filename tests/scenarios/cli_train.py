"""Training through ``LightningCLI``: the strategy comes from a YAML file or the command line, as users write it.

Run as ``cli_train.py fit --config CONFIG [--trainer.strategy=...] --out OUT``. Lightning's launcher re-runs this
script with the same arguments for the other rank. Rank 0 writes ``--out`` (torch.save): the trained module's state
dict, the strategy's settings and the FSDP units it built.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib  # noqa: E402

import torch  # noqa: E402
from jsonargparse import ArgumentParser  # noqa: E402

from lightning_fairscale.fsdp.unit.state_names import clean_path  # noqa: E402
from scenarios.common import RegressionModel  # noqa: E402
from scenarios.flavor import PACKAGE, Callback, Trainer, register_strategy_names  # noqa: E402

register_strategy_names()  # `--trainer.strategy=fsdp_fairscale`, as a user's script imports our package
LightningCLI = importlib.import_module(f"{'lightning.pytorch' if PACKAGE == 'lightning' else PACKAGE}.cli").LightningCLI


class RecordStrategy(Callback):
    """Records, on rank 0, the strategy's settings and the FSDP units it built."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        strategy = trainer.strategy
        policy = strategy.auto_wrap_policy
        self.info = {
            "strategy": type(strategy).__name__,
            "auto_wrap_policy": sorted(c.__name__ for c in policy) if policy is not None else None,
            "activation_checkpointing": [c.__name__ for c in strategy.activation_checkpointing],
            "checkpointed": sorted(type(m).__name__ for m in strategy._sharded.checkpointed),
            "bucket_cap_mb": strategy.bucket_cap_mb,
            "reshard_after_forward": strategy.reshard_after_forward,
            "units": [
                clean_path(name + ".").rstrip(".") or "(root)"
                for name, module in strategy.model.named_modules()
                if isinstance(module, FullyShardedDataParallel)
            ],
        }


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser: ArgumentParser) -> None:
        parser.add_argument("--out", required=True)

    def before_fit(self) -> None:
        self.recorder = RecordStrategy()
        self.trainer.callbacks.append(self.recorder)

    def after_fit(self) -> None:
        self.trainer.strategy.unshard_module()  # every rank: the module stays sharded after fit; rank 0 gets it whole
        if self.trainer.global_rank == 0:
            state_dict = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            result = {"state_dict": state_dict, "global_step": self.trainer.global_step, **self.recorder.info}
            torch.save(result, self.config.fit.out)


if __name__ == "__main__":
    CLI(RegressionModel, seed_everything_default=7)
