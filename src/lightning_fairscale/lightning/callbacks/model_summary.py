# Generated from lightning_fairscale/callbacks/model_summary.py by `make lightning`: do not edit.
"""The Trainer's model summary under FSDP: the full model's parameter counts, and this rank's shard of them.

Lightning's ``ModelSummary`` counts ``module.parameters()``. Under FairScale's FSDP those are the flat parameter
shards of this rank, owned by wrapper modules, so the Trainer's summary would show half the model on 2 processes,
under layer types that are FSDP's, and an ``example_input_array`` would be run past the root unit (which fails).
:class:`FullyShardedSummary` counts each original parameter from the metadata FairScale keeps on its flat
parameters (which module owned it, how many elements it has, where it sits in the flat parameter), so nothing is
gathered; it shows the user's layers under their own names and types, runs the example input through the root
unit, and adds a column with the elements of each layer that this rank holds.

:func:`use_for_model_summaries` makes the Trainer's ``ModelSummary`` callbacks (the default one included) use it, as
Lightning does with its ``DeepSpeedSummary`` for ZeRO stage 3; the strategy calls it at setup, and
:func:`restore_model_summaries` at teardown.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from fairscale.nn.misc import FlattenParamsWrapper
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning_fairscale.lightning._compat import _ModuleMode, attached_trainer
from lightning_fairscale.fsdp.unit import unit_state
from lightning_fairscale.fsdp.unit.frozen_params import trainable_pieces
from lightning_fairscale.fsdp.unit.units import fsdp_instances
from lightning.pytorch.utilities.model_summary.model_summary import (
    NOT_APPLICABLE,
    LayerSummary,
    ModelSummary,
    get_human_readable_count,
)
from torch import nn
from typing_extensions import override

__all__ = ["FullyShardedSummary", "ParameterCounts", "restore_model_summaries", "use_for_model_summaries"]

#: A parameter, or one original parameter inside a flat parameter: (id of the parameter, index of the piece).
_Key = tuple[int, int]


@dataclass(frozen=True)
class _Count:
    full: int
    local: int
    trainable: bool


def _local_elements(offset: int, numel: int, total: int, world_size: int, rank: int) -> int:
    """How many of the elements ``[offset, offset + numel)`` of a ``total``-element tensor ``rank`` holds.

    FairScale shards a (flat) parameter with ``torch.chunk``: rank ``r`` holds ``[r * c, (r + 1) * c)`` with
    ``c = ceil(total / world_size)``, the last chunks shorter or empty (padding is not counted).
    """
    chunk = -(-total // world_size)
    start, end = max(offset, rank * chunk), min(offset + numel, (rank + 1) * chunk, total)
    return max(0, end - start)


class ParameterCounts:
    """The parameters of each module of ``root``, counted as the unwrapped model has them, without gathering.

    Under FSDP an original parameter is a piece of a flat parameter (``flatten_parameters=True``: FairScale's
    ``_param_infos`` name its module and ``_param_numels`` its size) or a parameter sharded in place (its
    ``_orig_size``); anything else counts as it is.

    Example:
        >>> counts = ParameterCounts(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
        >>> counts.of(counts.root[0]), counts.rank
        ((9, 9, 9), 0)
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.rank = 0
        self._counts: dict[_Key, _Count] = {}
        self._owned: dict[int, list[_Key]] = {}  # id(module) -> the keys of the parameters it owns
        pieces: dict[tuple[int, str], _Key] = {}  # (id(owner), name) -> key, for the pieces of flat parameters
        flat: set[int] = set()
        model_owner = unit_state.peek_owner(root)  # the records of the units wrapped by hand are its
        for unit in fsdp_instances(root):
            self.rank = unit.rank
            for index, param in enumerate(unit.params):
                if index >= unit._num_flatten_params:  # sharded in place: counted with its owner below
                    full = torch.Size(param._orig_size).numel()
                    local = _local_elements(0, full, full, unit.world_size, unit.rank)
                    self._counts[(id(param), 0)] = _Count(full, local, param.requires_grad)
                    continue
                flat.add(id(param))
                total, offset = sum(param._param_numels), 0
                # Frozen pieces of a unit that also trains (FairScale workarounds 11 and 22) count as frozen.
                trains = trainable_pieces(param, unit_state.peek_flat(unit, param, model_owner))
                for piece, ((_, owner, name), numel) in enumerate(zip(param._param_infos, param._param_numels)):
                    local = _local_elements(offset, numel, total, unit.world_size, unit.rank)
                    self._counts[(id(param), piece)] = _Count(numel, local, trains[piece])
                    pieces[(id(owner), name)] = (id(param), piece)
                    self._owned.setdefault(id(owner), []).append((id(param), piece))
                    offset += numel
                # A parameter shared by several modules is flattened once; the other owners point at it.
                for _, _, owner, name, source, source_name in param._shared_param_infos:
                    self._owned.setdefault(id(owner), []).append(pieces[(id(source), source_name)])
                    pieces[(id(owner), name)] = pieces[(id(source), source_name)]
        for module in root.modules():
            for name, param in module._parameters.items():
                # A piece's original parameter (FairScale workaround 17) is counted as the piece, above.
                if param is None or id(param) in flat or (id(module), name) in pieces:
                    continue
                key = (id(param), 0)
                if key not in self._counts:  # a parameter FSDP does not manage
                    self._counts[key] = _Count(param.numel(), param.numel(), param.requires_grad)
                self._owned.setdefault(id(module), []).append(key)

    def of(self, module: nn.Module) -> tuple[int, int, int]:
        """``(parameters, of them on this rank, of them trainable)`` of ``module`` and its submodules."""
        keys = {key for submodule in module.modules() for key in self._owned.get(id(submodule), ())}
        counts = [self._counts[key] for key in keys]
        return (
            sum(c.full for c in counts),
            sum(c.local for c in counts),
            sum(c.full for c in counts if c.trainable),
        )


def _inner(module: nn.Module) -> nn.Module:
    """The user's module inside FSDP's wrappers (FSDP unit -> FlattenParamsWrapper -> module)."""
    while True:
        if isinstance(module, _FairScaleFSDP):
            module = module._fsdp_wrapped_module
        elif isinstance(module, FlattenParamsWrapper):
            module = module._fpw_module
        else:
            return module


def user_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The submodules of ``module`` as the unwrapped model names them, FSDP's wrappers skipped, each once.

    Example:
        >>> [name for name, _ in user_modules(nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.ReLU())))]
        ['0', '1', '1.0']
    """
    seen: set[int] = set()

    def walk(parent: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        for name, child in parent.named_children():
            child = _inner(child)
            if id(child) in seen:
                continue
            seen.add(id(child))
            yield prefix + name, child
            yield from walk(child, f"{prefix}{name}.")

    return walk(module, prefix)


def _attribute_paths(root: nn.Module) -> dict[int, str]:
    """Each module's path by attribute names, wrappers included (as torch's module tracker, and so the FLOP counter,
    names modules: ``named_modules()`` of a unit holding its original parameters skips its wrappers)."""
    paths: dict[int, str] = {}

    def walk(module: nn.Module, path: str) -> None:
        if id(module) in paths:
            return
        paths[id(module)] = path
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(root, "")
    return paths


def _fsdp_root(model: pl.LightningModule) -> Optional[nn.Module]:
    trainer = attached_trainer(model)
    wrapped = trainer.strategy.model if trainer is not None else None
    return wrapped if isinstance(wrapped, _FairScaleFSDP) else None


class FullyShardedLayerSummary(LayerSummary):
    """A layer's summary with its counts taken from :class:`ParameterCounts`."""

    def __init__(self, module: nn.Module, counts: ParameterCounts) -> None:
        super().__init__(module)
        self._full, self._local, _ = counts.of(module)

    @property
    @override
    def num_parameters(self) -> int:
        """The layer's parameters in the unwrapped model."""
        return self._full

    @property
    def shard_parameters(self) -> int:
        """The elements of the layer's parameters that this rank holds."""
        return self._local


class FullyShardedSummary(ModelSummary):
    """Lightning's model summary of a LightningModule sharded by FairScale's FSDP, counted without gathering.

    The layers, their types and parameter counts, the totals and the model size are those of the unwrapped model;
    the column ``Params per Device`` has the elements of each layer's parameters that this rank holds (an FSDP unit's
    parameters are split evenly across ranks, so a layer inside a unit may lie more on one rank than another). An
    ``example_input_array`` runs through the root FSDP unit, on every rank. Outside FSDP it equals Lightning's
    summary.

    Args:
        model: the LightningModule; while its Trainer's strategy holds it wrapped in FSDP, that wrapping is counted.
        max_depth: as for Lightning's ``ModelSummary``.
    """

    def __init__(self, model: pl.LightningModule, max_depth: int = 1) -> None:
        self._root: nn.Module = _fsdp_root(model) or model
        self._counts = ParameterCounts(self._root)
        # Paths from the module the example input is passed to: the names FLOP counting records modules by.
        self._raw_paths = _attribute_paths(self._root)
        self._layer_paths: dict[str, str] = {}
        super().__init__(model, max_depth=max_depth)

    @property
    @override
    def named_modules(self) -> list[tuple[str, nn.Module]]:
        if self._max_depth == 0:
            return []
        modules = list(user_modules(self._model))
        if self._max_depth == 1:
            modules = [(name, module) for name, module in modules if "." not in name]
        return modules

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        modules = self.named_modules
        self._layer_paths = {name: self._raw_paths.get(id(module), name) for name, module in modules}
        summary: dict[str, LayerSummary] = OrderedDict(
            (name, FullyShardedLayerSummary(module, self._counts)) for name, module in modules
        )
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for name in [name for name in summary if name.count(".") >= self._max_depth]:
                del summary[name]
        return summary

    @override
    def _forward_example_input(self) -> None:
        """Run the example input through the root FSDP unit (the LightningModule alone lacks the root's parameters)."""
        model, trainer = self._model, attached_trainer(self._model)
        batch = model._apply_batch_transfer_handler(model._on_before_batch_transfer(model.example_input_array))
        mode = _ModuleMode()
        mode.capture(self._root)
        self._root.eval()
        forward_context = contextlib.nullcontext() if trainer is None else trainer.precision_plugin.forward_context()
        with torch.no_grad(), forward_context, self._flop_counter:
            if isinstance(batch, (list, tuple)):
                self._root(*batch)
            elif isinstance(batch, dict):
                self._root(**batch)
            else:
                self._root(batch)
        mode.restore(self._root)

    @property
    @override
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        """FLOPs of each layer, found under the names the FLOP counter saw (paths through FSDP's wrappers)."""
        counts = self._flop_counter.get_flop_counts()
        prefix = type(self._root).__name__
        return {name: counts.get(f"{prefix}.{self._layer_paths[name]}", {}) for name in self.layer_names}

    @property
    @override
    def total_parameters(self) -> int:
        return self._counts.of(self._model)[0]

    @property
    @override
    def trainable_parameters(self) -> int:
        return self._counts.of(self._model)[2]

    @property
    def shard_parameters(self) -> int:
        """The elements of the model's parameters that this rank holds."""
        return self._counts.of(self._model)[1]

    @property
    @override
    def total_training_modes(self) -> dict[str, int]:
        modes = [module.training for _, module in user_modules(self._model)]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @override
    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        layers: list[Any] = list(self._layer_summary.values())
        shard = [get_human_readable_count(layer.shard_parameters) for layer in layers]
        shard += [NOT_APPLICABLE] * (len(arrays[0][1]) - len(shard))  # the "other params" row, if any
        after = [name for name, _ in arrays].index("Params") + 1
        # Lightning's name for it (its DeepSpeed summary's), which its RichModelSummary knows how to show.
        arrays.insert(after, ("Params per Device", shard))
        return arrays


def _summary(
    callback: ModelSummaryCallback,
    lightning_summary: Callable[[ModelSummaryCallback, pl.Trainer, pl.LightningModule], Any],
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
) -> Any:
    if isinstance(trainer.strategy.model, _FairScaleFSDP):
        return FullyShardedSummary(pl_module, max_depth=callback._max_depth)
    return lightning_summary(callback, trainer, pl_module)


def use_for_model_summaries(trainer: pl.Trainer) -> None:
    """Make the Trainer's ``ModelSummary`` callbacks (``RichModelSummary`` too) summarize FSDP models with
    :class:`FullyShardedSummary`, until :func:`restore_model_summaries`.

    Lightning's callback picks its summary class in ``_summary``, knowing DeepSpeed only; each callback instance gets
    its own ``_summary`` that answers for FairScale's FSDP and leaves everything else to Lightning's. The class is not
    changed: other Trainers' callbacks are Lightning's.
    """
    # `Trainer.callbacks` is set by Lightning's callback connector, not declared on the class.
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummaryCallback) and "_summary" not in vars(callback):
            lightning_summary = type(callback)._summary
            callback._summary = functools.partial(_summary, callback, lightning_summary)  # type: ignore[method-assign]


def restore_model_summaries(trainer: Optional[pl.Trainer]) -> None:
    """Give the Trainer's ``ModelSummary`` callbacks Lightning's ``_summary`` back (the strategy's teardown calls
    this); a ``_summary`` that is not ours stays. Nothing to do without a Trainer."""
    # `Trainer.callbacks` is set by Lightning's callback connector, not declared on the class.
    for callback in trainer.callbacks if trainer is not None else []:  # type: ignore[attr-defined]
        hook = vars(callback).get("_summary")
        if isinstance(hook, functools.partial) and hook.func is _summary:
            del callback._summary
