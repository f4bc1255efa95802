"""The one test model block, shared by the scenarios, the unit tests and the benchmarks (no Lightning import).

``benchmarks/_common.py`` puts this folder on ``sys.path`` to import it; the tests have it there already
(``conftest.py``, and the scenario scripts themselves).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


class Block(nn.Module):
    """A transformer-style MLP block: pre-norm, expand, activation, project, residual:
    ``x + down(activation(up(LayerNorm(x))))``.

    The repeated layer of every test model and benchmark, and the class their auto-wrap policies name (``{Block}``):
    the scenarios' blocks are 32 wide with a 2x hidden layer and GELU (the defaults); the unit tests' are 5 wide with
    6 hidden units and tanh, sizes that make shards padded at world sizes 2 and 3; the benchmarks' have a 4x hidden
    layer, whose activations (10 times the block's input) are what activation checkpointing saves. The activation is
    a function, not a module, so that the block's modules are its three layers (the model summaries list them).
    """

    def __init__(
        self,
        width: int = 32,
        hidden: Optional[int] = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = nn.functional.gelu,
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width if hidden is None else hidden)
        self.down = nn.Linear(2 * width if hidden is None else hidden, width)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.activation(self.up(self.norm(x))))
