"""FairScale 0.4.13's ``FullyShardedDataParallel`` as this package builds its units.

FairScale's FSDP was written for CUDA and NCCL. It runs unchanged on GPUs, but on a CPU process group (gloo) it
fails in several places, and some of its bugs hit every device. FairScale is frozen, so the fixes live in this
package, each bounded: the CPU-only ones (1 to 3, in :mod:`~lightning_fairscale.fsdp.patches.cpu_streams` and
:mod:`~lightning_fairscale.fsdp.patches.bucketing`) change nothing on a CUDA device, the others say where they apply,
and no installed file is edited. :class:`FullyShardedDataParallel` here is the unit class every other module uses.

The workarounds, numbered, and why each is needed: :mod:`lightning_fairscale.fsdp.patches.workarounds`.

Use :class:`FullyShardedDataParallel` wherever FairScale's class would be used: it is a subclass; on CUDA it differs
by the workarounds above that say "all devices".
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import inspect
from collections.abc import Iterator
from typing import Any, Optional

import torch
from fairscale.nn.data_parallel.fully_sharded_data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState
from torch import Tensor, nn

from lightning_fairscale.distributed import exchanges
from lightning_fairscale.distributed.fairscale_private import apply_to_tensors
from lightning_fairscale.fsdp.patches import backward_hooks, bookkeeping, deprecations, forward_grads, one_rank
from lightning_fairscale.fsdp.patches import prefetch
from lightning_fairscale.fsdp.unit import copying, frozen_params, not_run, original_params, param_views, recompute
from lightning_fairscale.fsdp.unit import rank_agreement, recovery
from lightning_fairscale.fsdp.unit import step_state, ties, unit_state
from lightning_fairscale.fsdp.unit.instances import fsdp_instances, named_fsdp_instances
from lightning_fairscale.fsdp.unit.unit_state import UnitState
from lightning_fairscale.fsdp.patches.bucketing import GlooReduceScatterBucketer, ReduceScatterBucketer
from lightning_fairscale.fsdp.patches.cpu_streams import _CPU_STREAM
from lightning_fairscale.fsdp.patches.grad_norm import clip_grad_norm_
from lightning_fairscale.fsdp.patches.hybrid import replicate_gradient
from lightning_fairscale.fsdp.unit.materialize import ParamInitFn, has_meta_tensors, materialize, validate_param_init_fn
from lightning_fairscale.mixed_precision.settings import true_half_dtype

__all__ = ["FullyShardedDataParallel", "fsdp_instances", "named_fsdp_instances"]


def _cast_float32(dtype: torch.dtype, args: Any, kwargs: Any) -> tuple[Any, Any]:
    def cast(x: Tensor) -> Tensor:
        if x.dtype is not torch.float32:
            return x
        y = x.to(dtype)
        if x.is_leaf:
            y.requires_grad = x.requires_grad
        return y

    with torch.no_grad():
        return apply_to_tensors(cast, args), apply_to_tensors(cast, kwargs)


#: The types of FairScale's plain per-step state: values ``nn.Module.__setattr__`` would only store.
_PLAIN_TYPES = (bool, int, float, str, type(None))

_FSDP_SIGNATURE = inspect.signature(_FairScaleFSDP.__init__)


def _unit_device(arguments: dict[str, Any]) -> torch.device:
    """Where a unit built with FairScale's ``arguments`` keeps its parameters before sharding: the compute device,
    or the CPU when it keeps its shards there (``cpu_offload``)."""
    if arguments.get("move_params_to_cpu") or arguments.get("cpu_offload"):
        return torch.device("cpu")
    device = arguments.get("compute_device")
    if device is None:  # FairScale's default: the current CUDA device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class FullyShardedDataParallel(copying.NotCopyable, _FairScaleFSDP):
    """FairScale's ``FullyShardedDataParallel`` that also runs on CPU with gloo, and computes in bf16 when asked.

    On CUDA it differs from FairScale's class by the workarounds of this module's list marked "all devices". On CPU
    it uses no-op streams too (while :mod:`~lightning_fairscale.fsdp.patches.cpu_streams` holds them), a gloo-compatible
    reduce-scatter bucketer, a device-agnostic :meth:`clip_grad_norm_` and collectives that overlap the computation.

    A module built on the ``meta`` device is materialised here, just before FairScale flattens and shards it: its
    meta tensors become real ones on the unit's device, initialised by each module's ``reset_parameters()`` or by
    ``param_init_fn`` (the one argument FairScale's class does not take; see
    :mod:`lightning_fairscale.fsdp.unit.materialize`).
    """

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        param_init_fn: Optional[ParamInitFn] = None,
        replica_group: Optional[torch.distributed.ProcessGroup] = None,
        backward_prefetch: Optional[str] = "BACKWARD_POST",
        **kwargs: Any,
    ):
        deprecations.install()  # workaround 19, before FairScale's first call
        # What we know about this unit and its flat parameters (nothing of ours is written into FairScale's objects).
        object.__setattr__(self, unit_state.ATTRIBUTE, unit_state.UnitState())
        if not has_meta_tensors(module):
            self._build(module, *args, **kwargs)
        else:
            arguments = _FSDP_SIGNATURE.bind(self, module, *args, **kwargs).arguments
            device = _unit_device(arguments)
            # Replicas must be initialised alike too: the random state comes from one rank of the whole world.
            group = None if replica_group is not None else arguments.get("process_group")
            # Inside `init_module(empty_init=True)` the default device is `meta`: what is made here must be real.
            with torch.device(device):
                materialize(module, device, validate_param_init_fn(param_init_fn), group)
                self._build(module, *args, **kwargs)
        #: Hybrid sharding (workaround 14): the ranks holding the same shard in the other replicas, or ``None``.
        self.replica_group = replica_group
        #: When a root's backward on CPU gathers the next unit ahead (workaround 16): ``"BACKWARD_POST"``,
        #: ``"BACKWARD_PRE"`` or ``None`` (``prefetch.BACKWARD_MODES``).
        self.backward_prefetch = backward_prefetch

    def _build(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        """FairScale's ``__init__``, with frozen and trainable parameters allowed in one unit (workaround 11)."""
        ties.check_not_split(module)
        own = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if not hasattr(p, "_is_sharded")]
        frozen = frozen_params.unfreeze_own_parameters(module)
        try:
            self._build_in_dtype(module, *args, **kwargs)
        finally:
            for param in frozen.values():
                param.requires_grad_(False)
        frozen_params.record_frozen(self, frozen)
        ties.record_flattened(self, own)

    def _build_in_dtype(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        """FairScale's ``__init__``, also over parameters in true half precision (workaround 13)."""
        arguments = _FSDP_SIGNATURE.bind(self, module, *args, **kwargs).arguments
        arguments.pop("self")
        half = true_half_dtype(arguments.get("mixed_precision", False), arguments.get("compute_dtype"))
        if half is None:
            super().__init__(**arguments)
            return
        # FairScale's check sees fp32 parameters; the unit then holds them in `half`.
        own = [p for p in arguments["module"].parameters() if not hasattr(p, "_is_sharded")]
        for param in own:
            param.data = param.data.float()
        super().__init__(**{**arguments, "compute_dtype": torch.float32})
        for param in {id(p): p for p in [*own, *self.params]}.values():  # the flat parameters and the originals
            param.data = param.data.to(half)
        self.compute_dtype = half
        self.buffer_dtype = arguments.get("buffer_dtype") or half

    #: What we know about this unit and its flat parameters (made in ``__init__``).
    unit_state: UnitState
    #: The CPU prefetcher of this unit's root (workaround 16), ``None`` where it does not apply (CUDA).
    _prefetcher: Optional[prefetch.Prefetcher] = None
    #: The check that every rank runs this unit's root's units alike (issue 54 item 4), shared by them; ``None``
    #: before the root's first forward.
    _agreement: Optional[rank_agreement.Agreement] = None

    # Workaround 18: dynamo never traces a unit (FairScale's parameter swaps and collectives), it runs it eagerly;
    # the compiled regions inside run compiled (`torch.compiler.disable` gives each compiled function called from
    # it its own compiler back). A skipped call, not a graph break: a `fullgraph=True` compile around a unit works.
    __call__ = torch.compiler.disable(_FairScaleFSDP.__call__)

    def __setattr__(self, name: str, value: Any) -> None:
        """``nn.Module.__setattr__``, for less Python work with the same effect: FairScale writes its plain per-step
        state (``training_state``, ``has_full_params``, ...) a dozen times a unit a step, and ``nn.Module``'s looks
        each name up in the parameters, submodules and buffers first. An attribute that is already a plain one (in
        the instance's ``__dict__``: never a parameter, submodule or buffer) given a plain value (``None``, a number,
        a string, an enum member) is stored directly, where ``nn.Module``'s would end up after its lookups."""
        if name in self.__dict__ and (type(value) in _PLAIN_TYPES or isinstance(value, enum.Enum)):
            object.__setattr__(self, name, value)
        else:
            nn.Module.__setattr__(self, name, value)

    # FairScale's cast of the buffers at every forward, each module once (the same effect).
    _cast_buffers = bookkeeping.cast_buffers

    @recovery.restoring  # after an exception in a step, the units as the last completed step left them
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if recompute.runs_in_backward(self):  # workaround 23: torch's checkpoint recomputes inside the backward
            return recompute.forward(self, args, kwargs)
        try:
            with recompute.state_restored_on_error(self):  # workaround 23
                return self._forward(*args, **kwargs)
        finally:  # workaround 20: the forward's graph holds the accumulators it hooked, or they are of no use
            unit_state.of(self).accumulators.clear()

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_root is None:  # FairScale's forward starts with it too; here it decides the root and sets up
            self._lazy_init()  # the prefetcher, once (again after FairScale resets it): it walks the whole model
        step_state.before_forward(self, self.unit_state)  # workaround 28: which parameters train now
        agreement = self._agreement if not prefetch.in_backward() else None
        if agreement is not None:
            if self._is_root:
                agreement.forward_started()
            agreement.unit_runs(self)
        computes_in_bf16 = self.mixed_precision and self.compute_dtype is torch.bfloat16
        if computes_in_bf16 and self._is_root:  # the root: inputs enter here
            args, kwargs = _cast_float32(self.compute_dtype, args, kwargs)
        # workaround 17: FairScale's views while the unit computes
        original_params.before_forward(self, self.unit_state.originals)
        try:
            with forward_grads.gradients_set_aside(self.params):  # workaround 26: what dynamo may trace
                if not self._is_root or self._prefetcher is None:
                    result = super().forward(*args, **kwargs)
                else:
                    self._prefetcher.forward_started()  # workaround 16
                    try:
                        result = super().forward(*args, **kwargs)
                    finally:
                        self._prefetcher.forward_ended()
            if agreement is not None and self._is_root:
                agreement.forward_ended()  # every rank ran the same units
            return result
        finally:
            original_params.show(self, self.unit_state.originals)  # workaround 17: the original parameters again
            if agreement is not None and self._is_root:
                agreement.outside_forward()

    def named_modules(  # type: ignore[override]
        self, memo: Optional[set[nn.Module]] = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """``nn.Module.named_modules``, but once the unit holds the original parameters (workaround 17) its wrappers
        (this unit and FairScale's ``FlattenParamsWrapper``) take the path of the module they wrap, so that
        ``model.named_parameters()`` names the parameters as the unwrapped model does.

        Not a generator: the iterator it returns is torch's (each module the walk yields is not a call into this
        file), and this unit's wrappers are entered in ``memo`` when it is called, as torch's walk of a parent does
        just before it iterates a child's (a caller that shares one ``memo`` between walks it has not iterated yet
        would see the difference; torch, Lightning and FairScale make a fresh one for each walk)."""
        if self.unit_state.originals is None:
            return super().named_modules(memo, prefix, remove_duplicate)
        memo = set() if memo is None else memo
        if self in memo:  # as torch's walk: a module met before is skipped with everything below it
            return iter(())
        wrapper = self._fsdp_wrapped_module
        head = []
        for module in (self, wrapper):
            if module not in memo:
                if remove_duplicate:
                    memo.add(module)
                head.append((prefix, module))
        return itertools.chain(head, wrapper.module.named_modules(memo, prefix, remove_duplicate))

    def _setup_streams(self) -> None:
        if len(self._streams) > 0 or not self._is_root:
            return
        super()._setup_streams()
        if self.compute_device.type == "cpu" and not self._streams:
            # No CUDA: FairScale created no streams, but indexes ``self._streams`` on every forward and backward.
            for name in ("fp32_to_fp16", "all_gather", "post_backward"):
                self._streams[name] = _CPU_STREAM
        # Replaces FairScale's bucketer (unused so far) everywhere it was shared (workarounds 3, 9 and 16).
        gloo = exchanges.is_gloo(self.process_group_reduce_scatter)
        overlaps = gloo and self.compute_device.type == "cpu" and prefetch.OVERLAP_ON_CPU
        bucketer = GlooReduceScatterBucketer if gloo else ReduceScatterBucketer
        reducer: Any = bucketer(self.bucket_cap_mb)
        prefetcher = None
        if overlaps:
            reducer, prefetcher = prefetch.overlap(self.backward_prefetch, self.bucket_cap_mb)
        self._reducer = reducer
        agreement = rank_agreement.Agreement(self)
        if prefetcher is not None:
            prefetcher.before_gathers = agreement.before_collective
            agreement.on_divergence = prefetcher.forget_order
        for module in fsdp_instances(self):
            module._streams = self._streams  # FairScale's own attributes, which its `_setup_streams` shares too
            module._reducer = reducer
            if isinstance(module, FullyShardedDataParallel):  # ours only: a unit of FairScale's own class (wrapped
                module._prefetcher = prefetcher  # by hand) runs FairScale's methods, which use neither, and gets
                module._agreement = agreement  # nothing of ours

    def _rebuild_full_params(self, force_full_precision: bool = False) -> Any:
        one_rank.forget_freed_half_params(self)  # workaround 21
        if self._agreement is not None and self._prefetcher is None and not self.has_full_params:
            if not prefetch.in_backward():  # FairScale gathers, in a forward: every rank is at the same unit
                self._agreement.before_collective()
        # workaround 28: the shards a backward differentiates are its forward's
        step_state.gathering(self, self.unit_state)
        if self._prefetcher is None or force_full_precision:
            if self._prefetcher is not None:
                self._prefetcher.settle(self)
            result = super()._rebuild_full_params(force_full_precision)
        else:
            result = self._prefetcher.rebuild(self, super()._rebuild_full_params)  # workaround 16
        if prefetch.in_backward() and not force_full_precision:
            # workaround 17: a recomputed forward sees the full parameters
            original_params.use_full_views(self, self.unit_state.originals)
        return result

    def _use_full_params(self) -> None:
        if prefetch.in_backward() and not self.has_full_params:  # workaround 28: a second backward through a kept
            self._rebuild_full_params()  # graph reaches a unit (a root) whose first backward freed its full ones
            return
        super()._use_full_params()
        if prefetch.in_backward():
            original_params.use_full_views(self, self.unit_state.originals)  # workaround 17

    def _free_full_params(self, params: Optional[list[torch.nn.Parameter]] = None) -> None:
        if self._prefetcher is not None:
            if params is None and self.training_state == TrainingState.FORWARD and self._prefetcher.keeps(self):
                return  # workaround 16: the forward's last units keep them for their backward (what fits)
            self._prefetcher.settle(self)  # gloo may still be writing into them (workaround 16)
        super()._free_full_params(params)
        if self._prefetcher is not None:
            self._prefetcher.freed(self)  # workaround 16: no longer kept

    def _queue_wait_for_post_backward(self) -> None:
        begins = not self._post_backward_callback_queued  # FairScale calls it at every firing of the root's hook
        super()._queue_wait_for_post_backward()
        if begins and self._prefetcher is not None:
            self._prefetcher.backward_started()  # workaround 16: the root's backward begins

    def _register_post_backward_hooks(self) -> None:
        hooked = backward_hooks.register_post_backward_hooks(
            self, functools.partial(unit_state.flat_record, self)
        )  # workaround 20
        unit_state.of(self).accumulators.extend(hooked)  # until the module's forward puts them in its graph

    def _post_backward_hook(self, param: nn.Parameter, *unused: Any) -> None:
        super()._post_backward_hook(param, *unused)
        if self._prefetcher is not None:
            self._prefetcher.after_post_backward(self)  # workaround 16

    def _prep_grads_for_backward(self) -> None:
        for param in self.params:  # workaround 12
            param_views.take_back_gradients(param, unit_state.peek_flat(self, param))
        super()._prep_grads_for_backward()

    def _wait_for_post_backward(self) -> None:
        # FairScale checks each unit's state by its `parameters()`, which must be its flat ones there (workaround 17);
        # the original parameters come back at the end of the context.
        with original_params.fairscale_layout(self):
            self._finish_backward()
        owner = unit_state.peek_owner(self)
        for unit in fsdp_instances(self):  # the full views' graph is spent: held longer, they keep the model alive
            original_params.release_views(unit, owner)

    def _finish_backward(self) -> None:
        not_run.before_end_of_backward(self)  # workaround 29: the units this backward did not reach
        super()._wait_for_post_backward()
        owner = unit_state.owner_of(self)  # the records of the units wrapped by hand are its
        for unit in fsdp_instances(self):  # workaround 12
            for param in unit.params:
                if self._require_backward_grad_sync:
                    param_views.share_gradients(param, unit_state.peek_flat(unit, param, owner))
                else:
                    param_views.share_local_gradients(param, unit_state.flat_record(unit, param, owner), unit.rank)
        frozen_params.reshard_frozen(self)  # workaround 15
        if self._prefetcher is not None:  # workaround 16: nothing gathered ahead or kept outlives the backward
            self._prefetcher.pass_ended()
            self._prefetcher.release_kept()

    def load_local_state_dict(self, state_dict: Any, strict: bool = True) -> Any:
        """FairScale's ``load_local_state_dict``, also before the first forward (workaround 7)."""
        for unit in fsdp_instances(self):
            for param in unit.params:
                unit._init_param_attributes(param)
        with original_params.fairscale_layout(self):  # workaround 17
            return super().load_local_state_dict(state_dict, strict)

    # FairScale's state dicts and `summon_full_params` see the units as FairScale made them (workaround 17).

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with original_params.fairscale_layout(self):
            return super().state_dict(*args, **kwargs)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with original_params.fairscale_layout(self):
            return super().local_state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with original_params.fairscale_layout(self):
            return super().load_state_dict(*args, **kwargs)

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> Iterator[None]:
        if self._prefetcher is not None:
            self._prefetcher.release_kept()  # workaround 16: gathered again, from the shards as they are now
        with original_params.fairscale_layout(self), super().summon_full_params(recurse, volatile):
            yield

    def _post_reduction_hook(self, param: torch.nn.Parameter, reduced_grad: Tensor) -> None:
        """FairScale's hook, given a compact copy of a shard that is a view into a bucket's buffer (workaround 8),
        averaged over the replicas first under hybrid sharding (workaround 14); on one rank, the parameter then holds
        the gradient FairScale cast to its dtype (workaround 21)."""
        if reduced_grad.untyped_storage().nbytes() > reduced_grad.numel() * reduced_grad.element_size():
            reduced_grad = reduced_grad.clone()
        if self.replica_group is not None:
            replicate_gradient(reduced_grad, self.replica_group)
        super()._post_reduction_hook(param, reduced_grad)
        one_rank.keep_cast_gradient(self, param, reduced_grad)  # workaround 21

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> Tensor:
        """Clip the gradients of all shards by their global norm, like :func:`torch.nn.utils.clip_grad_norm_`.

        Must be called on the root instance, on all ranks. On CUDA this is FairScale's own implementation, unless an
        optimizer holds the original parameters' views (then frozen parameters are left out, as unsharded).
        """
        if self.compute_device.type == "cuda" and not param_views.has_views(self):
            return super().clip_grad_norm_(max_norm, norm_type)
        self._lazy_init()
        assert self._is_root, "clip_grad_norm_ must be called on the root FullyShardedDataParallel instance"
        return clip_grad_norm_(self.gradient_holders(), max_norm, norm_type, group=self.process_group)

    def gradient_holders(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients are the model's, with a gradient: the trainable original parameters' views
        where the model's optimizers hold views (frozen parameters' elements excluded; decided alike on every rank,
        also one that holds no trainable view), else FSDP's own parameters."""
        units = list(fsdp_instances(self))
        if param_views.has_views(self):
            owner = unit_state.peek_owner(self)
            records = (record for unit in units for record in unit_state.flat_states(unit, owner))
            holders = param_views.trainable_views(records)
        else:
            holders = [param for unit in units for param in unit.params]
        return [p for p in holders if p.grad is not None]

    def _init_param_attributes(self, p: torch.nn.Parameter) -> None:
        super()._init_param_attributes(p)
        # FairScale may have replaced the shard (a pinned copy): views follow it.
        param_views.repoint_data(p, unit_state.peek_flat(self, p))

