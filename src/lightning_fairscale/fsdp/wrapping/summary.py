"""What sharding produced: a readable summary of the FSDP units, and per-rank memory figures to log."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_fairscale.fsdp.unit.units import fsdp_instances, named_fsdp_instances
from lightning_fairscale.fsdp.unit.state_names import clean_path

__all__ = ["memory_figures", "unit_summary"]


def _unit_rows(root: nn.Module) -> list[tuple[str, int, int]]:
    rows = []
    for path, unit in named_fsdp_instances(root):
        full = sum(torch.Size(p._orig_size).numel() for p in unit.params)
        local = sum(p.numel() for p in unit.params)
        rows.append((clean_path(path + ".").rstrip(".") or "(root)", full, local))
    return rows


def unit_summary(root: nn.Module) -> str:
    """A table of the FSDP units in ``root``: parameters of each unit, and this rank's shard of them.

    Example:
        >>> print(unit_summary(nn.Linear(2, 2)))
        0 FSDP units
    """
    rows = _unit_rows(root)
    if not rows:
        return "0 FSDP units"
    width = max(len(name) for name, _, _ in rows)
    total, on_rank = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines = [f"{len(rows)} FSDP units, {total:,} parameters, {on_rank:,} on this rank"]
    lines.append(f"  {'unit':<{width}}  {'parameters':>12}  {'shard':>12}")
    lines += [f"  {name:<{width}}  {full:>12,}  {local:>12,}" for name, full, local in rows]
    return "\n".join(lines)


class _StorageCounter:
    """Counts the bytes of the storages behind tensors: each storage whole, and once.

    A tensor that is a view into a larger buffer keeps the whole buffer alive, so it counts as the whole buffer; a
    storage already counted (a gradient sharing its parameter's memory, say) does not count again; a freed storage
    (FSDP resizes gathered parameters to 0 between uses) counts as 0.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[torch.device, int]] = set()

    def __call__(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total


def memory_figures(model: nn.Module, optimizers: Iterable[Optimizer] = ()) -> dict[str, float]:
    """Bytes this rank holds for parameters, gradients and optimizer state; peak device memory where reported.

    The figures count memory, not elements: each tensor with the whole storage it keeps alive, and each storage once
    (first as a parameter, then as a gradient, then as optimizer state). The keys suit ``LightningModule.log_dict``.

    Example:
        >>> figures = memory_figures(nn.Linear(2, 2))
        >>> figures["memory/parameters_bytes"]
        24.0
    """
    # FSDP's own parameters too: their gradients stay allocated after `zero_grad()` on the original parameters
    # (FairScale drops them at the next backward), and a storage is counted once whichever holds it.
    params = list(model.parameters()) + [param for unit in fsdp_instances(model) for param in unit.params]
    state = [
        value
        for optimizer in optimizers
        for param_state in optimizer.state.values()
        for value in param_state.values()
        if isinstance(value, torch.Tensor)
    ]
    count = _StorageCounter()
    figures = {
        "memory/parameters_bytes": float(count(params)),
        "memory/gradients_bytes": float(count(p.grad for p in params if p.grad is not None)),
        "memory/optimizer_state_bytes": float(count(state)),
    }
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        figures["memory/peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
    return figures
