"""FairScale's sharded DDP (OSS + ShardedDataParallel), for the Trainer's strategy and for Fabric's.

``DDPShardedStrategy`` rebuilds each optimizer as a :class:`fairscale.optim.OSS` over the same param groups and
hyperparameters (:func:`shard_optimizer`), so every rank keeps the optimizer state of its share of the parameters
only (ZeRO stage 1), and wraps the module in :class:`fairscale.nn.data_parallel.ShardedDataParallel`, which reduces
each gradient to the rank that owns its parameter (stage 2). Parameters stay whole on every rank.

The strategy's arguments are a :class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig`; the Trainer's
strategy (:mod:`lightning_fairscale.strategies.sharded`) and Fabric's (:mod:`lightning_fairscale.fabric.sharded`) hold
one each and call the functions here. Nothing here imports Lightning.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale.distributed import collectives
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig, sharded_ddp_kwargs
from lightning_fairscale.distributed import process_exit

log = logging.getLogger(__name__)

__all__ = [
    "begin_backward",
    "end_backward",
    "full_state",
    "load_full_state",
    "reattach_bucketed_gradients",
    "recover",
    "repoint_schedulers",
    "shard_optimizer",
    "sync_module_states",
    "wrap_model",
]


def wrap_model(config: ShardedDDPConfig, module: Module, optimizers: list[OSS], num_nodes: int) -> ShardedDataParallel:
    """``module`` in ``ShardedDataParallel``, which reduces each gradient to the rank whose OSS shard owns it."""
    wrapped = ShardedDataParallel(module, sharded_optimizer=optimizers, **sharded_ddp_kwargs(config, num_nodes))
    process_exit.release_at_exit(wrapped, *optimizers)  # their references to process groups are dropped at exit
    return wrapped


def full_state(optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
    """The full state of a plain optimizer of the same class, on rank 0 (``{}`` on the other ranks).

    A collective call for OSS, which gathers every rank's shard of the state on rank 0.
    """
    if not isinstance(optimizer, OSS):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(recipient_rank=0)
    return optimizer.state_dict() if is_global_zero else {}


@torch.no_grad()
def sync_module_states(module: Module) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP does when it wraps a module). A collective call.

    One broadcast per tensor, once per set-up: torch's bucketed version is private (``_sync_module_states``).
    """
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name not in ignored:
            collectives.broadcast(tensor.data, src=0)


@torch.no_grad()
def reattach_bucketed_gradients(module: ShardedDataParallel) -> None:
    """Put the gradients of bucketed parameters back into their bucket slots (zero where they are ``None``).

    With ``reduce_buffer_size > 0`` FairScale makes the gradients of small parameters views into one bucket per
    destination rank, and reduces the bucket as a whole. PyTorch 2's ``Optimizer.zero_grad()`` sets gradients to
    ``None`` by default (Lightning calls it after the forward pass), after which backward allocates new gradients
    outside the bucket and FairScale would reduce the stale bucket instead: wrong gradients, silently.
    """
    if not module._use_buckets:
        return
    for bucket in module._bucket_list:
        offset = 0
        for param in bucket._params:
            slot = bucket.buffer[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            if param.grad is None:
                slot.zero_()
                param.grad = slot
            elif param.grad.data_ptr() != slot.data_ptr():
                slot.copy_(param.grad)
                param.grad = slot


#: On a ``ShardedDataParallel``: set after a backward that reduced (its gradients are the owners' reduced ones).
_REDUCED = "_lightning_fairscale_reduced"
#: On a ``ShardedDataParallel``, during a backward: the reduced gradients set aside, ``(parameter, gradient)``.
_HELD = "_lightning_fairscale_held"


@torch.no_grad()
def begin_backward(module: ShardedDataParallel) -> None:
    """Before each backward pass: the gradient buckets hold the gradients (:func:`reattach_bucketed_gradients`),
    and a reducing backward that follows another one without ``zero_grad`` (accumulating with
    ``sync_each_batch=True``) starts from no gradient, the reduced ones set aside until :func:`end_backward`.

    FairScale reduces whatever a parameter's gradient holds: after a reducing backward the owner's gradient is
    already the sum over the ranks, and reduced again it would count the first micro-batch once per rank... divided
    by their number (and a non-owner's bucket holds what the reduction left there). So each owner keeps its reduced
    gradients aside (the bucketed ones copied: their slots are the bucket's), the others' are dropped, and the
    backward reduces this micro-batch's gradients alone; :func:`end_backward` adds the kept ones back.
    """
    reattach_bucketed_gradients(module)
    if module._should_accumulate_grads or not module.__dict__.get(_REDUCED):
        return
    bucketed = module._should_bucket_grad if module._use_buckets else [False] * len(module._trainable_params)
    held = []
    for param, in_bucket in zip(module._trainable_params, bucketed):
        grad = param.grad
        if grad is None:
            continue
        if module._trainable_param_to_rank[param] == module._rank:
            held.append((param, grad.clone() if in_bucket else grad))
        if in_bucket:
            grad.zero_()  # the slot stays the gradient: the bucket is reduced whole
        else:
            param.grad = None
    module.__dict__[_HELD] = held


@torch.no_grad()
def end_backward(module: ShardedDataParallel) -> None:
    """After each backward pass: add back what :func:`begin_backward` set aside (the owner's reduced gradients of
    the earlier micro-batches), and record whether this backward reduced."""
    for param, grad in module.__dict__.pop(_HELD, []):
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
    module.__dict__[_REDUCED] = not module._should_accumulate_grads


@torch.no_grad()
def recover(module: ShardedDataParallel) -> None:
    """After an exception in a backward (a hook of the user's): the module as the last completed step left it,
    local to this rank (issue 47, item 5). The reductions this rank started are waited for (every rank that got as
    far started them; left in flight, the next backward would run their callbacks over its own gradients), nothing
    new is sent (a bucket not sent yet is dropped), and the gradients of the unfinished backward are dropped, as
    ``zero_grad()`` does (a bucketed one is zeroed in its slot): they are not the model's."""
    while module._work_handles:
        work = module._work_handles.popleft()
        try:
            work.handle.wait()
        except Exception as error:  # a lost rank's: never raised in place of the exception being handled
            log.warning("A reduction of the failed backward failed too (%s: %s).", type(error).__name__, error)
    module.__dict__.pop(_HELD, None)
    module.__dict__[_REDUCED] = False
    for param in module._trainable_params:
        param.grad = None
    if module._use_buckets:
        for bucket in module._bucket_list:
            if bucket.buffer is not None:
                bucket.buffer.zero_()
    module._clear_counters()


def shard_optimizer(optimizer: Optimizer, broadcast_fp16: bool = False) -> OSS:
    """``optimizer`` rebuilt as ``fairscale.optim.OSS``: same class, param groups and hyperparameters, sharded.

    Needs an initialized process group. Any state ``optimizer`` already has is carried over (sharded).

    Args:
        optimizer: a ``torch.optim`` optimizer (or one built the same way: ``cls(param_groups, **defaults)``).
        broadcast_fp16: send the updated parameters to the other ranks in fp16 (see ``OSS``).

    Raises:
        TypeError: the optimizer's class cannot be built again from its param groups and ``defaults``.
    """
    optim_class = type(optimizer)
    defaults = _constructor_defaults(optimizer)
    param_groups = [dict(group) for group in optimizer.param_groups]
    try:
        inspect.signature(optim_class).bind(param_groups, **defaults)
    except TypeError as error:
        raise TypeError(
            f"`DDPShardedStrategy` cannot shard {optim_class.__name__}: OSS builds each rank's optimizer as"
            f" `{optim_class.__name__}(param_groups, **defaults)` ({error}). Give the class a constructor that takes"
            " its `defaults` as keyword arguments, or return a `fairscale.optim.OSS` from `configure_optimizers`."
        ) from None
    sharded = OSS(params=param_groups, optim=optim_class, broadcast_fp16=broadcast_fp16, **defaults)
    if optimizer.state:
        load_full_state(sharded, optimizer.state_dict())
    return sharded


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` less the entries its constructor does not take.

    Some classes record settings they fix themselves, e.g. ``AdamW``'s ``decoupled_weight_decay=True``; the param
    groups keep those entries, so nothing is lost.
    """
    parameters = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {name: value for name, value in optimizer.defaults.items() if name in parameters}


def load_full_state(optimizer: OSS, state: Mapping[str, Any]) -> None:
    """Load a plain optimizer's full state dict into OSS, which keeps this rank's shard.

    ``OSS.load_state_dict`` empties the entries of other ranks' parameters in the dict it gets, so it gets a copy;
    and it leaves a second copy of this rank's shard in the OSS wrapper's own ``state``, which nothing reads
    (``OSS.state_dict`` collects the shards' states), so that copy is dropped.
    """
    optimizer.load_state_dict({**state, "state": dict(state["state"])})
    optimizer.state.clear()


def repoint_schedulers(schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> None:
    """Make the LR schedulers of ``old`` adjust ``new``, and keep PyTorch's step-order check working."""
    repointed = False
    for top in schedulers:
        for scheduler in _scheduler_tree(top):
            if getattr(scheduler, "optimizer", None) is old:
                scheduler.optimizer = new
                repointed = True
    if repointed:
        _flag_steps_for_schedulers(new)


def _scheduler_tree(scheduler: Any) -> Iterator[Any]:
    """A scheduler and those it drives (``SequentialLR``, ``ChainedScheduler``), recursively."""
    yield scheduler
    for inner in getattr(scheduler, "_schedulers", None) or ():
        yield from _scheduler_tree(inner)


def _flag_steps_for_schedulers(optimizer: Optimizer) -> None:
    """Set ``optimizer._opt_called`` on every step, as PyTorch's LR schedulers do to the optimizer they are given.

    A scheduler checks, on its first step, that its optimizer's ``step`` carries the ``_wrapped_by_lr_sched`` mark
    (else it warns that ``optimizer.step()`` was overridden) and that ``_opt_called`` is set (else it warns that the
    scheduler stepped first). The schedulers were created with the user's optimizer; OSS needs the same.
    """
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    optimizer_ref = weakref.ref(optimizer)
    unbound_step = step.__func__  # type: ignore[attr-defined]

    @functools.wraps(unbound_step)
    def flagged_step(*args: Any, **kwargs: Any) -> Any:
        owner = optimizer_ref()
        owner._opt_called = True  # type: ignore[union-attr]
        return unbound_step(owner, *args, **kwargs)

    flagged_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = flagged_step  # type: ignore[method-assign]
