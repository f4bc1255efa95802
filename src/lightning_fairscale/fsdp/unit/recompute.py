"""A unit's forward called again inside the backward by the model's own activation checkpointing: workaround 23 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`.

torch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, what Hugging Face's
``gradient_checkpointing_enable`` and LitGPT use) keeps the forward's autograd graph and recomputes only the tensors
it saved, when the backward first needs one of them, by calling the checkpointed region's forward again from inside
the backward; once it has them all it stops that forward by raising an exception of its own. A region that holds
an FSDP unit (each transformer layer a unit, the model checkpointing each layer's call) calls the unit's forward
there. FairScale's forward, written for its own (reentrant) checkpointing, then treats the call as a new forward:
it sets the unit's state to ``FORWARD``, frees the full parameters the backward is about to compute with (under
``FULL_SHARD``), and, stopped by torch's exception, leaves the state ``FORWARD``, where the unit's post-backward
hook fails (``expected to be in states [BACKWARD_PRE, BACKWARD_POST] but current state is FORWARD``).

What the recomputation needs is the forward's values, nothing else: the gradients flow through the graph of the
first forward, into the gradient accumulators, and through the hooks, that it set up. So a unit that is already in
its backward (``BACKWARD_PRE``: its output's gradient has arrived, its full parameters are gathered) computes its
module with the views of the full parameters its forward used (workaround 17 keeps them for this), and keeps its
state; any other unit called inside a backward runs FairScale's forward, whose state is restored if torch's
exception stops it. :func:`runs_in_backward` decides, :func:`forward` computes.
"""

from __future__ import annotations

from typing import Any

from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.distributed.torch_private import in_backward
from lightning_fairscale.fsdp.unit import original_params

__all__ = ["forward", "runs_in_backward", "state_restored_on_error"]

_IN_BACKWARD = (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)


def runs_in_backward(unit: _FairScaleFSDP) -> bool:
    """Whether a call of ``unit``'s forward now recomputes values for its own backward (see the module)."""
    return unit.training_state in _IN_BACKWARD and in_backward()


def forward(unit: _FairScaleFSDP, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``unit``'s module on ``args``, computed with the full parameters its backward holds; its state unchanged.

    FairScale's ``FlattenParamsWrapper`` would make new views of the flat parameters, which under mixed precision
    lead to another gradient accumulator than the forward's; the module computes with the forward's views instead.
    """
    state = unit.training_state
    try:
        if not unit.has_full_params:  # gathered by the pre-backward hook; a unit freed since is gathered again
            unit._rebuild_full_params()
        original_params.use_full_views(unit, original_params.slots_of(unit))
        return unit.module.module(*args, **kwargs)
    finally:
        unit.training_state = state


class state_restored_on_error:
    """Around FairScale's forward of a unit called inside a backward (a recomputation that reaches a unit before its
    own backward): if torch's checkpoint stops the forward by its exception, the unit's state goes back to what it
    was, so that its backward hooks find it as they expect."""

    def __init__(self, unit: _FairScaleFSDP) -> None:
        self.unit = unit
        self.state = unit.training_state
        self.active = in_backward()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is not None and self.active:
            self.unit.training_state = self.state
