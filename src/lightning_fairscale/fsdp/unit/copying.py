"""Why a sharded model cannot be deep-copied, said at once: the mixin of this package's FSDP unit class.

``copy.deepcopy`` of a model this package sharded failed deep inside torch ("Only Tensors created explicitly by the
user (graph leaves) support the deepcopy protocol"): a unit holds FairScale's flat shards, gathered buffers and
process groups, and its module's parameters are this rank's views into the shards. The usual reason to copy a
trained model is weight averaging (``torch.optim.swa_utils.AveragedModel(model)``, Lightning's ``WeightAveraging``
in a second ``fit``), which works on the shards without a copy of the model: the error says how.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["NotCopyable"]


class NotCopyable:
    """Refuses ``copy.deepcopy`` with what to do instead."""

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            f"A model sharded by lightning-fairscale's FSDP cannot be deep-copied ({type(self).__name__} holds this"
            " rank's flat shards, and the module's parameters are views into them). For weight averaging, average"
            " this rank's shards instead of a copy of the model: with Fabric, `averaged ="
            " fabric.strategy.averaged_model(model, avg_fn=...)` in place of `AveragedModel(model, avg_fn=...)` (the"
            " same `update_parameters(model)`; evaluate with `with averaged.swapped_in(): ...`); with the Trainer,"
            " Lightning's `WeightAveraging` callback in the first `fit` of the module. Otherwise copy the module before"
            " it is set up, or save a checkpoint and load it into a new module."
        )
