"""The sharded model: :class:`WrappedModel`, the one object the Trainer's and Fabric's strategies keep of a model
that :mod:`lightning_fairscale.fsdp.engine` wrapped.

Everything a front end does with a sharded model once it is made goes through it: re-pointing the optimizers made
over the unwrapped module, the state dicts in the two checkpoint formats, a full state dict loaded into this rank's
shards (gathering nothing; with strict loading off, what fits, reporting the keys that did not as ``torch`` does),
what the checkpointer needs of it (:meth:`WrappedModel.settled`: checkpoint files are saved and loaded by
:mod:`lightning_fairscale.checkpointer`), putting the units back after an exception inside a step, and giving the
model its full parameters back (:meth:`WrappedModel.unshard`). Nothing here imports Lightning or calls back into a
strategy.

A module of its own: making a sharded model (the options checked against the device, the process groups, the
wrapping) happens once, in :mod:`~lightning_fairscale.fsdp.engine`, from the strategy's configuration; what is done
with the model for the rest of its life is here, and needs neither the configuration nor the run's set-up.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed import ProcessGroup
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale.checkpoint.checks import RELAX_FABRIC, IncompatibleKeys
from lightning_fairscale.fsdp.patches import cpu_streams
from lightning_fairscale.fsdp.patches.hybrid import drop_groups
from lightning_fairscale.fsdp.unit import recovery, shard_layout, step_state, unit_state
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.wrapping.activation_checkpointing import remove_activation_checkpointing
from lightning_fairscale.fsdp.wrapping.compile import uncompile_regions
from lightning_fairscale.fsdp.wrapping.unwrapping import forget_root, unwrap_module, unwrapped
from lightning_fairscale.fsdp.state import saving
from lightning_fairscale.fsdp.state.optim import GroupOrder, ParameterLayout, norm_group, repoint_optimizer
from lightning_fairscale.fsdp.state.optim_state import consolidate_state
from lightning_fairscale.fsdp.state.optimizer_paths import Path, choose_path, refusal
from lightning_fairscale.fsdp.state.whole_owners import make_plan
from lightning_fairscale.fsdp.state.whole_state import consolidate as consolidate_whole, load_plain
from lightning_fairscale.fsdp.state.whole_step import WholeStep
from lightning_fairscale.fsdp.state.saving import ShardedModel
from lightning_fairscale.fsdp.state.unsharded_shapes import param_group_problem, unsharded_shapes

__all__ = ["WrappedModel"]


@dataclass
class _Record(unit_state.ModelRecord):
    """What a root unit keeps of its sharding, for every :class:`WrappedModel` of it: nothing that refers back to
    the root (the layout does weakly), so that a sharded model nobody uses any more is freed at once, not by the
    garbage collector."""

    layout: ParameterLayout
    #: The layers that recompute their activations (activation checkpointing).
    checkpointed: list[Module]
    #: The optimizers re-pointed to the shards, and the order of each one's state in checkpoints.
    orders: weakref.WeakKeyDictionary[Optimizer, GroupOrder] = field(default_factory=weakref.WeakKeyDictionary)
    #: The optimizers on the whole path (each parameter stepped whole by its owner rank), and the hooks of each
    #: (removed when the model is unsharded, or the optimizer set up again).
    whole: weakref.WeakKeyDictionary[Optimizer, WholeStep] = field(default_factory=weakref.WeakKeyDictionary)
    #: The parameters from before wrapping, by id, while something else keeps them alive (an optimizer made over
    #: them, until it is re-pointed).
    originals: weakref.WeakValueDictionary[int, torch.nn.Parameter] = field(
        default_factory=weakref.WeakValueDictionary
    )


#: Where the values of a sharded model's parameters are, for the Trainer's `configure_optimizers`.
_VALUES_ELSEWHERE = (
    "read or set values in `configure_model` (before sharding) or in a hook such as `on_fit_start`, where each"
    " parameter holds this rank's shard of it."
)


class WrappedModel:
    """A model sharded by :func:`~lightning_fairscale.fsdp.engine.wrap_model`: the one object the front ends keep of it.

    It holds the root unit, where each original parameter went
    (:class:`~lightning_fairscale.fsdp.state.optim.ParameterLayout`), the layers that recompute their activations, and
    for each optimizer re-pointed to its shards (:meth:`repoint`) the order its state is saved in. Everything a front
    end does with a sharded model goes through it: re-pointing optimizers, state dicts, both checkpoint formats, and
    giving the model its full parameters back (:meth:`unshard`). What it knows is kept by the model's owner
    (:class:`~lightning_fairscale.fsdp.unit.unit_state.RootState`, held by the root unit), so that every stage and every
    strategy that takes the sharded model (:func:`~lightning_fairscale.fsdp.engine.wrapped_model`) knows the same.
    """

    def __init__(
        self, root: FullyShardedDataParallel, layout: ParameterLayout, checkpointed: Sequence[Module] = (),
        originals: Iterable[torch.nn.Parameter] = (),
    ) -> None:
        self.root = root
        self._record = _Record(layout, list(checkpointed))
        self._record.originals.update({id(param): param for param in originals})
        unit_state.owner_of(root).wrapped = self._record

    @classmethod
    def of(cls, root: FullyShardedDataParallel) -> Optional[WrappedModel]:
        """The sharded model whose root unit is ``root``, if it is one (see
        :func:`~lightning_fairscale.fsdp.engine.wrapped_model`)."""
        owner = unit_state.peek_owner(root)
        record = owner.wrapped if owner is not None else None
        if not isinstance(record, _Record):
            return None
        model = cls.__new__(cls)
        model.root, model._record = root, record
        return model

    @property
    def layout(self) -> ParameterLayout:
        """Where each original parameter went."""
        return self._record.layout

    @property
    def checkpointed(self) -> list[Module]:
        """The layers that recompute their activations."""
        return self._record.checkpointed

    # ------------------------------------------------------------------------------------------------------------
    # Optimizers

    def knows(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` is one of this model's: a parameter from before wrapping (still alive), a view that
        ``model.parameters()`` gives after it, or a managed (flat) parameter."""
        layout = self.layout
        return param in layout.managed or self._record.originals.get(id(param)) is param or bool(layout.locate(param))

    def repoint(self, *optimizers: Optimizer, path: Path = "auto", owner: str = "DDPFullyShardedStrategy") -> None:
        """Make each optimizer hold this rank's views of its parameters, remember the order of its state, and choose
        its path (:mod:`~lightning_fairscale.fsdp.state.optimizer_paths`; ``path``: the strategy's
        ``optimizer_path``): on the whole path its steps are hooked (:mod:`~lightning_fairscale.fsdp.state.whole_step`).

        An optimizer made over the original parameters keeps the order the user listed them in. One made over the
        managed parameters (after wrapping) has no such order: its state is saved in the order of the unwrapped
        module's ``parameters()``, as a plain optimizer over them would save it, so that either one loads the other's
        checkpoint.

        Raises:
            ValueError: an optimizer that no rank of a sharded model can step (LBFGS...), named by ``owner``'s
                message, before anything changes.
        """
        layout = self.layout
        for optimizer in optimizers:
            problem = refusal(optimizer, owner)
            if problem is not None:
                raise ValueError(problem)
        for optimizer in optimizers:
            params = [param for group in optimizer.param_groups for param in group["params"]]
            over_managed = all(param in layout.managed for param in params)
            orders = repoint_optimizer(optimizer, layout)
            self._record.orders[optimizer] = [layout.in_module_order(o) for o in orders] if over_managed else orders
            earlier = self._record.whole.pop(optimizer, None)
            if earlier is not None:
                earlier.remove()
            if choose_path(optimizer, path) == "whole":
                step = WholeStep(make_plan(optimizer, layout, self._record.orders[optimizer]))
                step.install(optimizer)
                self._record.whole[optimizer] = step

    def norm_group(self, optimizer: Optimizer) -> Optional[ProcessGroup]:
        """The process group over which the norm of ``optimizer``'s gradients is taken (``None``: the default group,
        for an optimizer not re-pointed here): the group its units shard over, one replica's under hybrid sharding
        (every unit of a model shards over one group), the same on every rank, also one that holds no view."""
        orders = self._record.orders.get(optimizer)
        return norm_group(orders, self.layout) if orders is not None else None

    def path(self, optimizer: Optimizer) -> str:
        """``"whole"`` or ``"elementwise"``: the path ``optimizer`` (re-pointed) steps on."""
        return "whole" if optimizer in self._record.whole else "elementwise"

    def abort_steps(self) -> None:
        """After an optimizer step that raised: every whole-path step under way ends (the other ranks told, so that
        they raise too), and no view keeps a whole tensor (see :meth:`~.whole_step.WholeStep.abort`); the plain
        context of the step ends (a step that raised outside its closure never ran its post-hook, which ends it:
        ``__torch_function__`` stayed off on this thread, so the user's reads were local slices, and any other tensor
        subclass's rules were skipped, until the next step)."""
        for step in list(self._record.whole.values()):
            step.abort()
        shard_layout.end_steps()

    def unsharded_shapes(
        self, where: str = "inside `configure_optimizers`", instead: str = _VALUES_ELSEWHERE
    ) -> contextlib.AbstractContextManager[None]:
        """A context in which the model's parameters show their unsharded shapes (no values: ``where`` and
        ``instead`` complete the error a use of them raises; the Trainer's words by default), for making an
        optimizer's param groups over them (see :mod:`~lightning_fairscale.fsdp.state.unsharded_shapes`)."""
        return unsharded_shapes(self.layout, where, instead)

    def param_group_problem(self, optimizer: Optimizer) -> Optional[str]:
        """What shows that ``optimizer``'s param groups were made from this model's sharded parameters, outside
        :meth:`unsharded_shapes` (``None`` when nothing does)."""
        return param_group_problem(optimizer, self.layout)

    @contextlib.contextmanager
    def backward(self) -> Generator[None, None, None]:
        """Around every backward the front end runs (``manual_backward`` and automatic optimization alike): one
        inside the root's forward (the Trainer's manual optimization) ends as FairScale ends a backward (see
        :mod:`~lightning_fairscale.fsdp.unit.step_state`); after an exception in it the units are as the last completed
        step left them, before the callbacks' ``on_exception`` (``OnExceptionCheckpoint``) runs (see
        :mod:`~lightning_fairscale.fsdp.unit.recovery`)."""
        state = step_state.of(self.root)
        try:
            with state.backward() if state is not None else contextlib.nullcontext():
                yield
        except BaseException:
            self.recover()
            raise

    def order(self, optimizer: Optimizer) -> GroupOrder:
        """The order of ``optimizer``'s state in checkpoints (see :meth:`repoint`)."""
        return self.for_checkpoints().order(optimizer)

    def for_checkpoints(self) -> ShardedModel:
        """What the checkpointer needs of this model, as plain values: the root unit, where the original
        parameters went, and the order of each re-pointed optimizer's state."""
        whole = {optimizer: step.plan for optimizer, step in self._record.whole.items()}
        return ShardedModel(self.root, self.layout, self._record.orders, whole)

    def forget_originals(self) -> None:
        """Stop answering for the parameters from before wrapping, once the optimizers hold the views: from here on
        nothing refers to the unsharded parameters, and they are freed."""
        self.layout.forget_originals()
        self._record.originals.clear()

    def load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """Load the state of a plain optimizer over the unwrapped module into ``optimizer``'s views (this rank's
        slices only)."""
        step = self._record.whole.get(optimizer)
        load_plain(state, optimizer, self.layout, self.order(optimizer), step.plan if step is not None else None)

    # ------------------------------------------------------------------------------------------------------------
    # After an exception inside a step

    def recover(self) -> bool:
        """Put the units back as the last completed step left them, if an exception left them in the middle of a
        step (see :mod:`~lightning_fairscale.fsdp.unit.recovery`); local to this rank. Returns whether it had to. While
        an exception is being handled, an error of the restore itself is logged, not raised in its place."""
        for step in list(self._record.whole.values()):
            if step.stepping:  # a step that raised: its views get their slices back
                step.abort()
        if not recovery.needs_restore(self.root):
            return False
        if sys.exc_info()[1] is not None:
            recovery.restore_quietly(self.root)
        else:
            recovery.restore(self.root)
        return True

    def _settle(self) -> None:
        """Before every state dict, checkpoint and ``unshard`` below: while an exception is being handled (Lightning's
        ``on_exception``, a Fabric loop's ``except``), the units as the last completed step left them (never in the
        middle of a step that goes on: FairScale then refuses, as before); after a failed step, a rank that failed
        alone raises (:func:`~lightning_fairscale.fsdp.unit.recovery.check_failed_together`): nothing can be
        gathered."""
        if sys.exc_info()[1] is not None:
            self.recover()
        recovery.check_failed_together(self.root)

    # ------------------------------------------------------------------------------------------------------------
    # State dicts and checkpoints

    def state_dict(self, sharded: bool, is_global_zero: bool) -> dict[str, Any]:
        """The full state dict with the unwrapped module's keys, gathered unit by unit and kept on rank 0 only; with
        ``sharded``, this rank's parameter shards (FairScale's ``local_state_dict``). A collective call."""
        self._settle()
        return saving.module_state_dict(self.root, sharded, is_global_zero)

    def optimizer_state(self, optimizer: Optimizer, sharded: bool) -> dict[str, Any]:
        """The full state of ``optimizer`` in the layout of a plain optimizer, on rank 0 (``{}`` on the other ranks);
        with ``sharded``, this rank's state over its views, as it is (its layout is saved beside it). A collective
        call."""
        self._settle()
        order = self.order(optimizer)
        if sharded:
            return optimizer.state_dict()
        step = self._record.whole.get(optimizer)
        if step is not None:
            return consolidate_whole(optimizer, self.layout, order, step.plan)
        return consolidate_state(optimizer, self.layout, order)

    def state_dict_keys(self) -> list[str]:
        """The keys of the unwrapped module's state dict, known without gathering anything."""
        return list(saving.expected_shapes(self.for_checkpoints()))

    def load_full(
        self, state_dict: dict[str, Any], strict: bool,
        optimizers: Sequence[tuple[Optimizer, dict[str, Any]]] = (), relax: str = RELAX_FABRIC,
    ) -> IncompatibleKeys:
        """Load a full state dict and plain optimizer states into this rank's shards, reading only their slices
        (see :func:`~lightning_fairscale.fsdp.state.saving.load_full`)."""
        self._settle()
        return saving.load_full(self.for_checkpoints(), state_dict, strict, optimizers, relax)

    def settled(self) -> ShardedModel:
        """What the checkpointer (:mod:`lightning_fairscale.checkpointer`) needs of this model, once its units are
        settled (see :meth:`_settle`): :meth:`for_checkpoints`."""
        self._settle()
        return self.for_checkpoints()

    # ------------------------------------------------------------------------------------------------------------
    # The end of sharding

    def unshard(self, keep: bool) -> Module:
        """Give the model its full parameters back, as the plain module it was (a collective call): every unit is
        gathered in turn, onto the CPU (with ``keep=False`` this rank keeps nothing: its parameters end up on the
        ``meta`` device). The layers lose their activation checkpointing, the process groups and FairScale's CPU
        workarounds are released, and the optimizers re-pointed to the shards are forgotten (their state lived
        there). Returns the unwrapped module."""
        self._settle()
        root = self.root
        module = unwrapped(root)
        unwrap_module(root, torch.device("cpu"), keep=keep)
        owner = unit_state.owner_of(root)
        drop_groups(owner.groups)  # this model lets go (every rank unshards: a collective call)
        owner.groups = None
        forget_root(module)
        uncompile_regions(module)  # first: a checkpointed layer's compiled forward is inside its checkpoint
        remove_activation_checkpointing(module)
        cpu_streams.release(owner.cpu_hold)  # the sharded model's hold on the CPU workarounds ends with it
        owner.cpu_hold = None
        for step in list(self._record.whole.values()):
            step.remove()  # the optimizers over the shards are forgotten: their steps are hooked no more
        self._record.whole.clear()
        unit_state.owner_of(root).wrapped = None
        return module
