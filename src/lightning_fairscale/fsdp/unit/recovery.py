"""The units back in a defined state after an exception inside a step (issue 47, item 5).

An exception raised in the middle of a step (a NaN guard in ``training_step``, a hook raising in the backward, an
error in the optimizer's closure) leaves FairScale's units where it found them: the root (and the units it was
computing) in ``FORWARD``, ``BACKWARD_PRE`` or ``BACKWARD_POST``, full parameters gathered (``p.data`` the full
parameter, not the shard), the modules holding FairScale's views instead of the original parameters (workaround
17), units gathered ahead or kept for the backward and reductions in flight (workaround 16), a reduce-scatter
bucket half filled, and gradients of half a backward. FairScale then refuses ``summon_full_params`` (every full
state dict), and a sharded state dict records the full parameters as this rank's shard: a checkpoint written then
(``OnExceptionCheckpoint``) failed, or could not be consolidated.

:func:`restore` puts every unit of a root back as the last completed step left it: ``IDLE``, the fp32 shards as
``p.data``, no full parameters, the original parameters on their modules, nothing gathered ahead or in flight, and
no gradient of the failed step (as ``zero_grad()`` leaves them: the failed step's backward did not complete, so
its gradients are not the model's). It starts no collective: it only waits for the asynchronous work this rank
had started already, which every rank that got as far started too (the ranks run the same collectives in the same
order), so it cannot wait for a rank that raised earlier (a rank-local exception). The weights are those of the
last completed step: an exception inside a step stops it before its optimizer step changes a shard.

:func:`needs_restore` says whether a root is in such a state; the units call :func:`restore` when an exception
leaves the root's forward, the strategies when one leaves a backward, and the engine's state dicts, checkpoints
and the next root forward call it when the exception was caught elsewhere (a Fabric loop's ``try``/``except``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import time
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel.fully_sharded_data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState
from torch import nn

from lightning_fairscale.distributed.torch_private import default_store
from lightning_fairscale.fsdp.unit import original_params, unit_state
from lightning_fairscale.fsdp.patches import prefetch, reduce_scatter

__all__ = ["check_failed_together", "needs_restore", "restore", "restore_quietly", "restoring"]

log = logging.getLogger(__name__)

#: How long a rank whose step failed waits, before a collective save, for the other ranks to report theirs.
AGREE_WAIT_S = 10.0

F = TypeVar("F", bound=Callable[..., Any])


def _units(root: nn.Module) -> list[Any]:
    return [m for m in root.modules() if isinstance(m, _FairScaleFSDP)]


def needs_restore(root: nn.Module) -> bool:
    """Whether an exception left ``root`` (a root unit) in the middle of a step, outside a backward (where
    FairScale's own states are expected): not ``IDLE``, or its end-of-backward callback still due. The root is the
    first unit a forward enters and a backward reaches, the last one they leave: an unfinished step shows there."""
    if not isinstance(root, _FairScaleFSDP) or prefetch.in_backward():
        return False
    state = root.training_state
    return state in _IN_A_STEP or bool(getattr(root, "_post_backward_callback_queued", False))


_IN_A_STEP = (TrainingState.FORWARD, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)


def restoring(forward: F) -> F:
    """A unit's ``forward``: the root's restores its units when an exception leaves it (the user's exception goes
    on unchanged), and when it begins after a step that an exception left unfinished elsewhere (a backward whose
    exception a Fabric loop caught)."""

    @functools.wraps(forward)
    def wrapper(unit: _FairScaleFSDP, *args: Any, **kwargs: Any) -> Any:
        if unit._is_root and needs_restore(unit) and unit.training_state != TrainingState.FORWARD:
            restore(unit)  # an unfinished backward (not a forward inside the root's own)
        try:
            result = forward(unit, *args, **kwargs)
        except BaseException:
            if unit._is_root and not prefetch.in_backward():
                restore_quietly(unit)
            raise
        if unit._is_root:
            unit_state.owner_of(unit).failure = None  # a step is under way again
        return result

    return wrapper  # type: ignore[return-value]


def restore(root: nn.Module) -> None:
    """Put every unit of ``root`` (a root unit) back as the last completed step left it (see the module's
    docstring); local to this rank. Idempotent: a root in a defined state stays as it is, but for gathered-ahead
    copies and gradients of an unfinished backward."""
    units = _units(root)
    if not units:
        return
    in_backward = any(unit.training_state in _IN_A_STEP[1:] for unit in units) or bool(
        getattr(units[0], "_post_backward_callback_queued", False)
    )
    _wait_for_streams(units[0])
    _drain_prefetcher(units[0])
    _drop_reductions(units[0])
    for unit in units:
        _reshard(unit)
        _drop_gradients(unit, in_backward)
        unit.training_state = TrainingState.IDLE
        unit._pre_backward_hook_has_run = False
    head = units[0]
    if getattr(head, "_is_root", False):
        head._post_backward_callback_queued = False
        registered = getattr(head, "_output_pre_backward_hook_registered", None)
        if registered is not None:
            registered.clear()
    owner = unit_state.peek_owner(root)
    for unit in units:
        # workaround 17: the original parameters (the shards' views) again
        original_params.show(unit, original_params.slots_of(unit, owner))
        original_params.release_views(unit, owner)  # the failed step's graph is of no use
    state = unit_state.owner_of(root)
    if state.failure is None:
        error = sys.exc_info()[1]
        state.failures += 1
        key = f"{state.serial}/{state.failures}"
        state.failure = unit_state.Failure(id(error) if error is not None else None, repr(error), key)


def restore_quietly(root: nn.Module) -> None:
    """:func:`restore` while an exception is on its way: one that the restore itself meets (a collective of a lost
    rank failing as it is waited for) is logged, never raised in its place."""
    try:
        restore(root)
    except Exception as error:  # the exception being handled is the one the caller must see
        log.warning("The FSDP units could not be restored after the exception (%s: %s).", type(error).__name__, error)


#: How many roots this process wrapped: each root's number (:func:`number_root`). Wrapping is collective, so every
#: rank numbers its models alike.
_ROOTS_WRAPPED = itertools.count()


def number_root(root: nn.Module) -> None:
    """Give ``root`` (a root unit the engine just set up) its number, which names its failures in the store."""
    unit_state.owner_of(root).serial = next(_ROOTS_WRAPPED)


def check_failed_together(root: nn.Module, wait_s: float = AGREE_WAIT_S) -> None:
    """Before a collective call (a state dict, a checkpoint) on ``root`` after its step failed: make sure every rank
    failed too, through the process group's store (no collective: a rank still in the step would not join one).
    Each failing rank checks in and waits up to ``wait_s`` seconds for the others (once per failure).

    Raises:
        BaseException: this rank failed alone (a rank-local exception): the others wait in the step's collectives, so
            nothing can be gathered, and waiting would last until their timeout. The exception being handled, if it
            is the step's (the user's, on its way to the caller: ``OnExceptionCheckpoint``), goes on unchanged, else
            a ``RuntimeError`` that says so; the reason is logged. This rank then ends, and the others fail at once
            ("Connection closed by peer").
    """
    state = unit_state.peek_owner(root)
    failure = state.failure if state is not None else None
    if failure is None or failure.together or not dist.is_available() or not dist.is_initialized():
        return
    missing = _ranks_not_failed(failure.key, wait_s)
    failure.together = not missing
    if failure.together:
        return
    rank = dist.get_rank()
    message = (
        f"Rank {rank} raised an exception inside a training step that rank(s) {missing} did not raise within"
        f" {wait_s:g} s: they are still in the step's collectives, so nothing can be gathered or saved now (an"
        " on-exception checkpoint is skipped). Raise on every rank alike (decide on a NaN from every rank's value)"
        " to get a checkpoint of the last completed step."
    )
    log.error(message)
    handled = sys.exc_info()[1]
    if handled is not None and id(handled) == failure.error_id:
        raise handled
    raise RuntimeError(f"{message} The step's exception: {failure.error_repr}")


def _ranks_not_failed(failure: str, wait_s: float) -> list[int]:
    """The ranks that have not reported ``failure`` (a root's number and failure count) within ``wait_s`` seconds
    (after this one did). Once every rank reported it, the last one to read that removes the failure's keys: the
    store holds none of a failure every rank agreed on."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return []
    store = default_store()
    prefix = f"lightning_fairscale/step_failed/{failure}"
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            if store.add(f"{prefix}/seen", 1) == world_size:  # every rank has read every key: none needs them
                for key in (*keys, f"{prefix}/seen"):
                    store.delete_key(key)
            return missing
        if time.monotonic() > deadline:
            return missing
        time.sleep(0.05)


def _wait_for_streams(root: _FairScaleFSDP) -> None:
    """On CUDA, let the current stream wait for FairScale's side streams (their copies and reductions)."""
    for stream in getattr(root, "_streams", {}).values():
        if isinstance(stream, torch.cuda.Stream):
            torch.cuda.current_stream().wait_stream(stream)


def _drain_prefetcher(root: _FairScaleFSDP) -> None:
    """Workaround 16: wait for the gathers this rank started ahead and free them, and what a forward kept."""
    prefetcher = getattr(root, "_prefetcher", None)
    if prefetcher is None:
        return
    prefetcher._recording = None  # an unfinished forward's order is not the model's
    prefetcher.pass_ended()
    prefetcher.release_kept()


def _drop_reductions(root: _FairScaleFSDP) -> None:
    """The reductions of an unfinished backward: those in flight are waited for (every rank that got as far started
    them), a bucket's unsent gradients are dropped (sending them would start a collective)."""
    reducer = getattr(root, "_reducer", None)
    if reducer is None:
        return
    if isinstance(reducer, reduce_scatter.AsyncReduceScatter):
        reducer.flush()  # its callbacks store the reduced shards, which _drop_gradients then drops
        return
    for bucket in getattr(reducer, "buckets", {}).values():
        if bucket.data.untyped_storage().size() > 0:
            bucket.data.zero_()
        bucket.offset = 0
        bucket.callbacks.clear()
        bucket.output_shard = torch.zeros_like(bucket.data[0])
    reducer.teardown()


def _reshard(unit: _FairScaleFSDP) -> None:
    """Free ``unit``'s full parameters (and fp16 shards) and point its parameters at their fp32 shards."""
    params = [p for p in unit.params if hasattr(p, "_fp32_shard")]
    if not params:
        return
    if any(getattr(p, "_is_sharded", False) and hasattr(p, "_full_param_padded") for p in params):
        unit._free_full_params(params)
    if unit.mixed_precision or unit.move_params_to_cpu:
        unit._free_fp16_param_shard(params)
    unit._use_fp32_param_shard(params)
    unit.has_full_params = False


def _drop_gradients(unit: _FairScaleFSDP, in_backward: bool) -> None:
    """The gradients of an unfinished backward (``in_backward``): the full ones FairScale had not reduced yet, the
    reduced shards not yet handed to the optimizer's views. An exception in a forward leaves the gradients of the
    last completed backward as they are (the views hold theirs)."""
    if not in_backward:
        return
    for param in unit.params:
        param.__dict__.pop("_saved_grad_shard", None)
        param.grad = None
