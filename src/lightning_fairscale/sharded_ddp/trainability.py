"""What a ``ShardedDataParallel`` derives from which parameters are trainable, owned by one object of ours.

FairScale's ``ShardedDataParallel`` and ``OSS`` derive, in ``refresh_trainable()``, from the parameters that
require gradients: a gradient hook per trainable parameter (which rank each gradient is reduced to), the gradient
buckets, and OSS's parameter buckets (which parameters are broadcast after a step). Lightning changes that state
between steps (validation's ``eval()``/``train()``, ``BaseFinetuning.freeze``/``make_trainable``,
``toggle_optimizer``/``untoggle_optimizer``), and FairScale follows such changes badly (FairScale workaround 24,
below). :class:`Trainability` owns that knowledge for one wrapper: it compares the trainable parameters with what
was derived before every forward pass that records a graph and before every backward pass, re-derives when they
changed, and refuses the one change that cannot be followed (between micro-batches of a step, while gradients wait
to be reduced) with what to do. It also holds the state of a step's micro-batches under ``sync_each_batch``
(:meth:`Trainability.begin_backward`).

FairScale workarounds (the numbered table is :mod:`lightning_fairscale.fsdp.patches.workarounds`):

24. **ShardedDataParallel's detection of trainability changes (all devices).** FairScale re-derives in its
    ``forward`` when it sees a change, and misses or mishandles these:

    * it reads the *wrapper's* ``training`` flag, which Lightning's validation loop sets to ``False``
      (``trainer.model.eval()``) and never sets back (it restores the LightningModule's modes, not the wrapper's):
      every step after the first validation trained without reducing a single gradient, each rank on its own half
      of the batch (8 SGD steps validating every 2: weights 0.14 off unsharded training);
    * in eval mode it removes its gradient hooks: a model trained in eval mode (frozen normalisation statistics)
      is not reduced at all, where unsharded training and DDP train it (Fabric: 0.092 off after 6 steps, two of
      them in eval mode);
    * it re-arms its per-backward state (which gradients are still to be reduced, the end-of-backward flush) in
      ``forward`` only: the second backward pass after one forward (manual optimization: one backward per
      optimizer) queued no flush, its reductions were still in flight through the optimizer step, and the next
      backward failed with ``assert param.grad is not None``;
    * it detects ``requires_grad`` flips only in ``forward``, and keeps its reference of the trainable parameters
      up to date only with ``warn_on_trainable_params_changed=True``.

    :class:`Trainability` wraps the module with FairScale's detection off (``auto_refresh_trainable=False``, the
    value :func:`~lightning_fairscale.sharded_ddp.engine.wrap_model` passes; a user's value has no effect) and
    re-derives itself (``refresh_trainable()``). During a forward pass FairScale sees the wrapper in training mode
    exactly when there are hooks to arm, whatever the modules' modes, which change what the layers compute and
    nothing else (as under DDP); the wrapper's own flag is restored afterwards. Before each backward pass it re-arms
    FairScale's per-backward state (``_clear_counters``).
25. **OSS's list of the gradients it clips (all devices).** ``OSS.clip_grad_norm`` lists this rank's parameters
    that hold a gradient at its first call, and keeps that list: a parameter frozen then (or unused in that step)
    was left out of every later norm, and the run trained with another clipping than unsharded training (frozen
    before set-up, unfrozen an epoch later: 7.4e-3 off after 6 steps). :func:`clip_grad_norm` forgets the list
    before each call, so OSS lists the gradients of the moment.

30. **Gradients a reducing backward did not reach (all devices).** ``ShardedDataParallel`` reduces a gradient from
    its hook, when the backward reaches the parameter: a layer that ran in the accumulating micro-batches of a step
    (``no_sync``) but not in the last one kept each rank's own sum, unreduced and not averaged, and its owner stepped
    with it (AdamW, 4 steps of 2 micro-batches, a Block in the first only: 0.071 off unsharded training).
    :meth:`Trainability.end_backward` reduces them as their hooks would have.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Union

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from torch import Tensor
from torch.nn import Module
from torch.utils.hooks import RemovableHandle

from lightning_fairscale.sharded_ddp.grad_norms import PARTITIONED

log = logging.getLogger(__name__)

__all__ = ["Trainability", "TrainabilityChangeError", "clip_grad_norm", "reattach_bucketed_gradients"]


class TrainabilityChangeError(RuntimeError):
    """A change of which parameters are trainable that sharded DDP cannot follow, raised before it trains wrong."""


class Trainability:
    """What ``wrapper`` derived from its trainable parameters, kept up to date (FairScale workaround 24).

    Installs a forward pre-hook and a forward hook on ``wrapper``; :meth:`close` removes them. The strategy calls
    :meth:`begin_backward` and :meth:`end_backward` around every backward pass.

    Args:
        wrapper: a ``ShardedDataParallel`` built by :func:`~lightning_fairscale.sharded_ddp.engine.wrap_model`.
    """

    def __init__(self, wrapper: ShardedDataParallel) -> None:
        # Weakly: the wrapper holds this object (through its hooks), and the strategy's table keys it by the wrapper.
        self._wrapper = weakref.ref(wrapper)
        #: Which of ``wrapper._all_params`` were trainable when its hooks and buckets were last derived (``None``:
        #: never; FairScale derives nothing before the first forward pass).
        self._derived: Union[list[bool], None] = None
        #: The wrapper's own ``training`` flags, set aside during forward passes.
        self._modes: list[bool] = []
        #: Whether the last backward pass reduced (``sync_each_batch``: see :meth:`begin_backward`).
        self._reduced = False
        #: Whether the last backward pass ran under ``no_sync`` (its gradients wait for a reducing one).
        self._accumulating = False
        #: During a backward pass: the reduced gradients set aside, ``(parameter, gradient)``.
        self._held: list[tuple[Tensor, Tensor]] = []
        self._handles: list[RemovableHandle] = [
            wrapper.register_forward_pre_hook(self._before_forward),
            wrapper.register_forward_hook(self._after_forward, always_call=True),
        ]

    @property
    def wrapper(self) -> ShardedDataParallel:
        """The ``ShardedDataParallel`` whose derived state this object keeps up to date."""
        wrapper = self._wrapper()
        assert wrapper is not None, "the wrapper is gone"
        return wrapper

    def close(self) -> None:
        """Remove the hooks from the wrapper (its forward passes are FairScale's own again), and give torch its own
        total norm back (see :mod:`~lightning_fairscale.sharded_ddp.grad_norms`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        PARTITIONED.discard(self)

    # ------------------------------------------------------------------------------------------------------------
    # Partitioned gradients

    @property
    def device(self) -> torch.device:
        """Where the wrapper's parameters live (where a collective's tensor goes)."""
        params = self.wrapper._all_params
        return params[0].device if params else torch.device("cpu")

    def gradient_owners(self) -> tuple[set[int], set[int]]:
        """The ``id`` of each gradient this rank holds of the trainable parameters, in two sets: those of the
        parameters this rank's OSS partition owns, and those of the others'."""
        wrapper = self.wrapper
        mine: set[int] = set()
        others: set[int] = set()
        for param in wrapper._trainable_params:
            if param.grad is not None:
                owner = wrapper._trainable_param_to_rank[param]
                (mine if owner == wrapper._rank else others).add(id(param.grad))
        return mine, others

    @torch.no_grad()
    def _drop_others_gradients(self) -> None:
        """After a reducing backward pass: no gradient of a parameter another rank owns stays here. Unbucketed,
        FairScale drops them itself; a bucketed one is a view into the bucket this rank sent, which holds this rank's
        unreduced (or, after the reduction, undefined) values and would pose as the gradient to anyone reading it.
        The slot is put back before the next backward (:func:`reattach_bucketed_gradients`)."""
        wrapper = self.wrapper
        for param in wrapper._trainable_params:
            if param.grad is not None and wrapper._trainable_param_to_rank[param] != wrapper._rank:
                param.grad = None

    # ------------------------------------------------------------------------------------------------------------
    # Following the changes

    def follow(self) -> None:
        """Re-derive the hooks and buckets if the trainable parameters changed since they were last derived.

        Raises:
            TrainabilityChangeError: they changed between micro-batches of a step, while this rank holds gradients
                that ``no_sync`` left unreduced.
        """
        mask = self._mask()
        if mask == self._derived:
            return
        if self._derived is not None and self._waiting_gradients():
            raise TrainabilityChangeError(
                "The parameters that require gradients changed between the micro-batches of one optimizer step"
                " (gradient accumulation), while gradients were waiting to be reduced: `DDPShardedStrategy` would"
                " leave those of the newly frozen parameters unreduced and train on them. Freeze or unfreeze"
                " parameters (`requires_grad_`, `BaseFinetuning.freeze`/`make_trainable`, `toggle_optimizer`) between"
                " optimizer steps, after `optimizer.zero_grad()`, or accumulate with `sync_each_batch=True`, which"
                " reduces every micro-batch."
            )
        wrapper = self.wrapper
        # Decided above: FairScale's own check (hooks armed but not fired, e.g. for the parameters a toggled
        # optimizer froze) would only log a misleading warning. Its per-backward state is re-armed before use.
        wrapper._grad_to_be_reduced = [False] * len(wrapper._grad_to_be_reduced)
        with _training(wrapper, True):
            wrapper.refresh_trainable()
        self._derived = mask

    def _mask(self) -> list[bool]:
        return [param.requires_grad for param in self.wrapper._all_params]

    def _waiting_gradients(self) -> bool:
        """Whether the last backward pass ran under ``no_sync`` and left gradients that wait for a reduction."""
        params = self.wrapper._trainable_params
        return self._accumulating and any(param.grad is not None for param in params)

    def _before_forward(self, module: Module, args: Any) -> None:
        if torch.is_grad_enabled():  # no graph, no backward: nothing to derive (nor under inference mode)
            self.follow()
        # FairScale's forward re-derives if it sees no hooks in training mode, and arms the hooks in training mode
        # only: it sees training mode exactly when there are hooks to arm.
        self._modes.append(module.training)
        module.training = bool(self.wrapper._grad_hooks)

    def _after_forward(self, module: Module, args: Any, output: Any) -> None:
        if self._modes:
            module.training = self._modes.pop()

    # ------------------------------------------------------------------------------------------------------------
    # Backward passes

    @torch.no_grad()
    def begin_backward(self) -> None:
        """Before each backward pass: follow changes made since the forward pass (``toggle_optimizer`` inside
        ``training_step``), re-arm FairScale's per-backward state (a second backward after one forward reduces
        too), put the gradients into their buckets (:func:`reattach_bucketed_gradients`), and, when a reducing
        backward follows another one without ``zero_grad`` (accumulating with ``sync_each_batch=True``), start from
        no gradient, the reduced ones set aside until :meth:`end_backward`.

        FairScale reduces whatever a parameter's gradient holds: after a reducing backward the owner's gradient is
        already the sum over the ranks, and reduced again it would count the first micro-batch once per rank...
        divided by their number (and a non-owner's bucket holds what the reduction left there). So each owner keeps
        its reduced gradients aside (the bucketed ones copied: their slots are the bucket's), the others' are
        dropped, and the backward reduces this micro-batch's gradients alone; :meth:`end_backward` adds the kept
        ones back.
        """
        wrapper = self.wrapper
        if self._derived is not None and self._newly_trainable():
            with torch.enable_grad():  # the hooks are found through a graph
                self.follow()
        with _training(wrapper, bool(wrapper._grad_hooks)):
            wrapper._clear_counters()
        reattach_bucketed_gradients(wrapper)
        if wrapper._should_accumulate_grads or not self._reduced:
            return
        bucketed = wrapper._should_bucket_grad if wrapper._use_buckets else [False] * len(wrapper._trainable_params)
        for param, in_bucket in zip(wrapper._trainable_params, bucketed):
            grad = param.grad
            if grad is None:
                continue
            if wrapper._trainable_param_to_rank[param] == wrapper._rank:
                self._held.append((param, grad.clone() if in_bucket else grad))
            if in_bucket:
                grad.zero_()  # the slot stays the gradient: the bucket is reduced whole
            else:
                param.grad = None

    def _newly_trainable(self) -> bool:
        """Whether a parameter requires gradients now that did not when the hooks were derived: one used in a
        forward pass that did not go through the wrapper would keep an unreduced gradient."""
        assert self._derived is not None
        return any(now and not then for now, then in zip(self._mask(), self._derived))

    @torch.no_grad()
    @torch.no_grad()
    def recover(self) -> None:
        """After an exception in a backward (a hook of the user's): the wrapper as the last completed step left it,
        local to this rank (issue 47, item 5). The reductions this rank started are waited for (every rank that got
        as far started them; left in flight, the next backward would run their callbacks over its own gradients),
        nothing new is sent (a bucket not sent yet is dropped), and the gradients of the unfinished backward are
        dropped, as ``zero_grad()`` does (a bucketed one is zeroed in its slot): they are not the model's."""
        wrapper = self.wrapper
        while wrapper._work_handles:
            work = wrapper._work_handles.popleft()
            try:
                work.handle.wait()
            except Exception as error:  # a lost rank's: never raised in place of the exception being handled
                log.warning("A reduction of the failed backward failed too (%s: %s).", type(error).__name__, error)
        self._held = []
        self._reduced = False
        PARTITIONED.discard(self)
        for param in wrapper._trainable_params:
            param.grad = None
        if wrapper._use_buckets:
            for bucket in wrapper._bucket_list:
                if bucket.buffer is not None:
                    bucket.buffer.zero_()
        wrapper._clear_counters()

    def end_backward(self) -> None:
        """After each backward pass: reduce what it did not reach (:meth:`_reduce_unreached`), add back what
        :meth:`begin_backward` set aside (the owner's reduced gradients of the earlier micro-batches), and record
        whether this backward reduced."""
        self._reduce_unreached()
        held, self._held = self._held, []
        for param, grad in held:
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self._accumulating = self.wrapper._should_accumulate_grads
        self._reduced = not self._accumulating
        if self._reduced:  # each gradient is on its owner only: torch's total norms reduce over the ranks
            self._drop_others_gradients()
            PARTITIONED.add(self)
        else:  # every rank holds its own unreduced gradients, as DDP's under `no_sync`: torch's norms are local
            PARTITIONED.discard(self)


    @torch.no_grad()
    def _reduce_unreached(self) -> None:
        """After a reducing backward, the gradients it did not reach: those of layers that ran only in the
        accumulating micro-batches of the step (``no_sync``), which FairScale reduces only from hooks that did not
        fire (workaround 30). A gradient reduced directly is averaged to its owner here, as its hook would have (a
        non-owner's dropped); one in a bucket is part of the bucket, which the end of the backward sends whole,
        unless no hook fired at all."""
        wrapper = self.wrapper
        if wrapper._should_accumulate_grads or not wrapper._trainable_params:
            return
        bucketed = wrapper._should_bucket_grad if wrapper._use_buckets else [False] * len(wrapper._trainable_params)
        unsent = False
        for index, (param, in_bucket) in enumerate(zip(wrapper._trainable_params, bucketed)):
            if not wrapper._grad_to_be_reduced[index] or param.grad is None:
                continue
            wrapper._grad_to_be_reduced[index] = False
            unsent = unsent or in_bucket
            if in_bucket:
                continue
            owner = wrapper._trainable_param_to_rank[param]
            param.grad.mul_(wrapper._world_size_scaling)
            dist.reduce(param.grad, dst=wrapper._local_to_global_rank[owner], group=wrapper._process_group)
            if owner != wrapper._rank:
                param.grad = None
        if unsent and not wrapper._bucket_flush_callback_set:
            wrapper._flush_reduce_calls()


@contextmanager
def _training(wrapper: ShardedDataParallel, mode: bool) -> Iterator[None]:
    """The wrapper's own ``training`` flag (not its modules') set to ``mode`` for a while."""
    saved = wrapper.training
    wrapper.training = mode
    try:
        yield
    finally:
        wrapper.training = saved


@torch.no_grad()
def reattach_bucketed_gradients(module: ShardedDataParallel) -> None:
    """Put the gradients of bucketed parameters back into their bucket slots (zero where they are ``None``).

    With ``reduce_buffer_size > 0`` FairScale makes the gradients of small parameters views into one bucket per
    destination rank, and reduces the bucket as a whole. PyTorch 2's ``Optimizer.zero_grad()`` sets gradients to
    ``None`` by default (Lightning calls it after the forward pass), after which backward allocates new gradients
    outside the bucket and FairScale would reduce the stale bucket instead: wrong gradients, silently. A parameter
    frozen since the buckets were derived keeps its gradient (``None``): an optimizer would step a zero gradient
    (Adam's moments would move it).
    """
    if not module._use_buckets:
        return
    for bucket in module._bucket_list:
        offset = 0
        for param in bucket._params:
            slot = bucket.buffer[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            if not param.requires_grad:
                continue
            if param.grad is None:
                slot.zero_()
                param.grad = slot
            elif param.grad.data_ptr() != slot.data_ptr():
                slot.copy_(param.grad)
                param.grad = slot


def clip_grad_norm(optimizer: OSS, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0) -> Tensor:
    """``OSS.clip_grad_norm`` over the gradients this rank owns now (FairScale workaround 25): the norm of all
    ranks' gradients, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. A collective call."""
    optimizer._OSS__local_params = None  # type: ignore[attr-defined]  # OSS lists them again, as they are now
    return optimizer.clip_grad_norm(max_norm, norm_type=norm_type)
