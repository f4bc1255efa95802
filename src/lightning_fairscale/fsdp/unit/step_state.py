"""What the loop changes between steps, followed: workaround 28 of :mod:`lightning_fairscale.fsdp.patches.workarounds`.

FairScale derives things once and keeps them: a flat parameter's ``requires_grad`` (set when the unit is built:
which of its parameters train), the gradient hooks registered in each forward for the flat parameters that require
gradients, each unit's training state, and the end of the backward (queued by the root's pre-backward hook, which
only the root's output has). A Lightning loop changes them between steps, or inside one:

* ``requires_grad`` flips on the model's parameters (``BaseFinetuning.freeze`` / ``make_trainable``, Lightning's
  ``toggle_optimizer``): those are this package's views of the flat shards (workaround 17), not FairScale's flat
  parameters, whose backward computes a gradient for every element whatever the views say;
* backward passes inside the root's forward (manual optimization: the Trainer runs ``training_step`` inside the
  root unit's forward, so ``manual_backward`` runs where FairScale expects no backward; its end of the backward is
  never queued, and the units are left in ``BACKWARD_POST``);
* a second backward through a graph kept from an earlier one (``retain_graph=True``: a GAN's generator output used by
  both losses), which reaches a unit whose full parameters the first backward freed.

:class:`StepState` is the one owner of that knowledge for a sharded model, and re-derives it at the moments it
matters, without asking the user to tell it anything:

* before each unit's forward (:meth:`StepState.before_forward`), which parameters train is read from the views (the
  model's parameters, whatever changed them): each view remembers whether it trained when its unit last computed
  (``ParamView.trainable``), and the flat parameter requires gradients when any of its views does (the same on every
  rank: every rank holds a view of every original parameter, and the loop flips them alike), so a unit frozen
  whole computes no gradient and one unfrozen computes them again;
* at the end of every backward (:mod:`~lightning_fairscale.fsdp.unit.param_views`), a view gets its gradient only if it
  trained when its unit computed and still does (unsharded torch: a parameter that does not require gradients when
  the backward reaches it gets none, and one that did not when the forward ran is not in the graph): a frozen
  parameter's gradient stays ``None`` (or what it was), the optimizer skips it (no update, no change of its state),
  and clipping by norm leaves it out;
* around every backward the front end runs (:meth:`StepState.backward`): one that runs inside the root's forward is
  given the root's pre-backward preparation and FairScale's end of the backward (every unit back to ``IDLE``, the
  views given their gradients), and the root's forward goes on;
* when a unit gathers its full parameters (:meth:`StepState.gathering`): in a forward, the versions of its shards are
  noted; in a backward, shards an optimizer changed since are refused (unsharded torch refuses a backward through
  weights changed in place too), instead of differentiating the new weights.

A model whose root unit holds parameters of its own cannot run a backward inside its forward (the root's full
parameters would be freed and stale for the rest of the step): that is refused at the first such backward, on every
rank alike, with what to do.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState
from torch import nn

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.distributed.torch_private import in_backward
from lightning_fairscale.fsdp.unit import original_params, unit_state
from lightning_fairscale.fsdp.unit.unit_state import UnitState
from lightning_fairscale.fsdp.unit.instances import fsdp_instances

__all__ = ["StepState", "before_forward", "gathering", "of"]


def of(unit: nn.Module) -> Optional[StepState]:
    """The :class:`StepState` of ``unit``'s model, ``None`` for a unit of no model the engine set up (its units know
    the model's owner: :func:`~lightning_fairscale.fsdp.unit.unit_state.adopt`)."""
    return StepState(unit) if _adopted(unit) else None


def before_forward(unit: nn.Module, state: UnitState) -> None:
    """Before ``unit``'s forward: :meth:`StepState.before_forward`, for a unit of a model the engine set up
    (``state``: ``unit``'s)."""
    if state.owner is not None and state.owner.adopted:
        StepState.before_forward(unit, state)


def gathering(unit: nn.Module, state: UnitState) -> None:
    """``unit`` gathers its full parameters: :meth:`StepState.gathering`, for a unit of a model the engine set up
    (``state``: ``unit``'s)."""
    if state.owner is not None and state.owner.adopted:
        StepState.gathering(unit, state)


def _adopted(unit: nn.Module) -> bool:
    owner = unit_state.peek_owner(unit)
    return owner is not None and owner.adopted


class StepState:
    """What FairScale and the engine derived about one sharded model that the loop may change, re-derived when it
    does (see the module's docstring). What it follows is kept in the records of the model's units and flat
    parameters (:mod:`~lightning_fairscale.fsdp.unit.unit_state`); this object only refers to the root, weakly."""

    def __init__(self, root: nn.Module) -> None:
        self._root = weakref.ref(root)

    @property
    def root(self) -> Any:
        root = self._root()
        assert root is not None, "the sharded model is gone"
        return root

    # ------------------------------------------------------------------------------------------------------------
    # Before a unit's forward

    @staticmethod
    def before_forward(unit: _FairScaleFSDP, state: UnitState) -> None:
        """Read which of ``unit``'s parameters train now; make its flat parameters require gradients accordingly
        (``state``: ``unit``'s)."""
        flat_count = unit._num_flatten_params
        for index, managed in enumerate(unit.params):
            record = state.flats.get(managed)
            views = record.views if record is not None else None
            if not views:
                continue
            if index < flat_count:
                for view in views:
                    view.trainable = view.param.requires_grad
                wanted = any(view.trainable for view in views)
                if managed.requires_grad != wanted:
                    managed.requires_grad_(wanted)
            else:  # sharded in place: the module's parameter is the managed one, the optimizer holds a view of it
                flag = managed.requires_grad
                assert record is not None  # it has views
                if record.trained is not None and record.trained != flag:  # flipped on the module
                    for view in views:  # (`BaseFinetuning`): the view follows; a flip of the view (`toggle_optimizer`)
                        view.param.requires_grad_(flag)  # stays its own
                record.trained = flag
                for view in views:
                    view.trainable = view.param.requires_grad and flag

    @staticmethod
    def gathering(unit: _FairScaleFSDP, state: UnitState) -> None:
        """``unit`` gathers its full parameters: in a forward with gradients, note its shards' versions; in a backward
        (its pre-backward hook, a recomputation, a second backward through a kept graph), refuse shards that an
        optimizer changed since: the backward would differentiate the new weights where the forward computed with the
        old ones, which unsharded torch refuses too ("modified by an inplace operation"). ``state``: ``unit``'s."""
        versions = _shard_versions(unit, state)
        if not in_backward():
            if torch.is_grad_enabled():
                state.shard_versions = versions
            return
        noted = state.shard_versions
        if noted is not None and noted != versions:
            raise RuntimeError(
                "A backward reaches an FSDP unit whose parameters an optimizer step changed after the forward it"
                " differentiates (a graph kept with `retain_graph=True` across `optimizer.step()`). Unsharded"
                " training fails there too (a variable needed for gradient computation has been modified by an"
                " inplace operation): step that optimizer after the last backward through the graph, or compute"
                " the forward again."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Around a backward

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around a backward the front end runs: one inside the root's forward (manual optimization under the
        Trainer) gets what FairScale gives a backward after it (see the module's docstring)."""
        root = self.root
        if root.training_state != TrainingState.FORWARD:
            yield  # after the root's forward: FairScale's own pre- and post-backward hooks do it
            return
        if root.params:
            raise RuntimeError(
                "A backward inside the training step (manual optimization) needs every parameter of the model inside"
                f" an FSDP unit below the root, but the root unit holds {sum(p.numel() for p in root.params)}"
                " elements of its own (parameters no unit wraps). Wrap the modules that hold them: name their classes"
                " in `auto_wrap_policy` (e.g. `{Generator, Discriminator}`), or wrap them in `configure_model`."
            )
        root.training_state = TrainingState.BACKWARD_PRE
        root._pre_backward_hook_has_run = True
        try:
            yield
        except BaseException:
            root.training_state = TrainingState.FORWARD
            raise
        self._end_backward(root)

    def _end_backward(self, root: _FairScaleFSDP) -> None:
        """FairScale's end of the backward, for a backward that ran inside the root's forward; the forward goes on."""
        with original_params.fairscale_layout(root):  # FairScale checks each unit's state by its flat parameters
            for unit in _units(root):
                expected = _end_state(unit)
                if expected is not None:
                    unit.training_state = expected
        root._wait_for_post_backward()
        root.training_state = TrainingState.FORWARD


def _units(root: nn.Module) -> list[Any]:
    return list(fsdp_instances(root))


def _end_state(unit: _FairScaleFSDP) -> Optional[TrainingState]:
    """The state FairScale's end of the backward expects ``unit`` in (``None``: ``IDLE`` or ``BACKWARD_PRE``, as it
    is): a unit this backward did not reach is ``IDLE`` (its forward's output, or the part of it used, led elsewhere),
    which is fine, not the failure FairScale's check takes it for."""
    if not any(p.requires_grad for p in unit.parameters()):
        return None
    if any(p.requires_grad for p in unit.params):
        return TrainingState.BACKWARD_POST
    return TrainingState.BACKWARD_PRE


def _shard_versions(unit: _FairScaleFSDP, state: UnitState) -> list[int]:
    """The version counters of ``unit``'s shards and of their views (the optimizer updates the shards in place through
    the views, whose ``.data`` is set to slices of them: each has a counter of its own)."""
    versions = []
    for managed in unit.params:
        versions.append(getattr(managed, "_fp32_shard", managed)._version)
        record = state.flats.get(managed)
        if record is not None:
            versions.extend(view.param._version for view in record.views)
    return versions
