"""FairScale 0.4.13's ``FullyShardedDataParallel`` as this package builds its units, and the one numbered list of
the FairScale workarounds.

FairScale's FSDP was written for CUDA and NCCL. It runs unchanged on GPUs, but on a CPU process group (gloo) it
fails in several places, and some of its bugs hit every device. FairScale is frozen, so the fixes live in this
package, each bounded: the CPU-only ones (1 to 3, in :mod:`~lightning_fairscale.fsdp.cpu_streams` and
:mod:`~lightning_fairscale.fsdp.bucketing`) change nothing on a CUDA device, the others say where they apply, and no
installed file is edited. :class:`FullyShardedDataParallel` here is the unit class every other module uses.

The workarounds, and why each is needed:

1. **CUDA streams.** FSDP overlaps communication with computation on ``torch.cuda.Stream`` objects and calls
   ``torch.cuda.current_stream()``, ``torch.cuda.stream(...)`` and ``torch.cuda.synchronize()`` unconditionally,
   which raise on a machine without CUDA. CPU work is executed in program order, so streams have nothing to do
   there. FairScale's FSDP module (and only that module) gets a view of ``torch`` whose ``cuda`` attribute answers
   these calls with a single no-op CPU stream. Only when ``torch.cuda.is_available()`` is ``False``; with CUDA
   present FairScale keeps the real ``torch``. Held by each model the engine wrapped to compute on the CPU, for as
   long as it lives (:func:`~lightning_fairscale.fsdp.cpu_streams.hold_while_alive`; ``unshard_module()`` ends the
   hold at once), and undone with the last one: FairScale's module then has its own ``torch`` again.
2. **``Tensor.record_stream`` on CPU tensors.** FSDP records its CUDA streams on gradient and parameter buffers so
   the caching allocator does not reuse them early. PyTorch has no CPU kernel for ``aten::record_stream`` (it raises
   ``NotImplementedError``). CPU memory is not stream-ordered, so recording is meaningless there: a no-op CPU kernel
   is registered (``torch.library``) with workaround 1, and deregistered with it. CUDA tensors keep PyTorch's own
   kernel.
3. **Reduce-scatter buckets on gloo.** FairScale's ``ReduceScatterBucketer`` hands a 2-D ``(world_size, n)`` tensor to
   ``_reduce_scatter_base``. NCCL accepts that; gloo checks ``output.numel() * world_size == input.shape[0]`` and
   aborts. :class:`~lightning_fairscale.fsdp.bucketing.GlooReduceScatterBucketer` passes the same memory as a 1-D view,
   which is the layout gloo expects and gives the identical result. It is used only when the reduce-scatter group's
   backend is gloo.
4. **``clip_grad_norm_`` calls ``.cuda()``** on the local norm. :class:`FullyShardedDataParallel` computes the global
   norm on the gradients' own device when the module computes on CPU, and defers to FairScale on CUDA. The precision
   plugins clip with :func:`~lightning_fairscale.fsdp.grad_norm.clip_grad_norm_` on every device; its all-reduce goes
   through :mod:`lightning_fairscale.distributed.collectives`, which moves the norm to CUDA for NCCL when the gradients
   are in CPU memory (``move_grads_to_cpu``).
5. **fp16 loss scaling.** FairScale's ``ShardedGradScaler`` disables itself when CUDA is not available, and for
   gradients in CPU memory it all-reduces a CUDA copy of the inf/NaN flags and then drops the result.
   :class:`~lightning_fairscale.mixed_precision.grad_scaler.ShardedGradScaler` is PyTorch's device-generic
   ``torch.amp.GradScaler`` plus the one thing sharding needs: the "found inf" flags are combined across ranks, in
   place, wherever they are (through :mod:`lightning_fairscale.distributed.collectives`), so every rank skips the same
   steps. The FSDP precision plugin uses it on every device (this one is not CPU-specific), the sharded-DDP plugin off
   CUDA.
6. **bf16 compute (all devices).** With ``mixed_precision=True`` FairScale casts float32 inputs of the root module to
   fp16, whatever ``compute_dtype`` is, which breaks bf16 compute. :class:`FullyShardedDataParallel` casts them to
   the unit's ``compute_dtype`` first, which FairScale then leaves alone. This one is not CPU-specific.
7. **Loading a sharded state before the first forward (all devices).** ``load_local_state_dict`` ends by freeing
   every unit's full parameters, which reads an attribute that inner units create only in their first forward, so
   resuming from a sharded checkpoint fails with ``AttributeError: _full_param_padded``.
   :meth:`FullyShardedDataParallel.load_local_state_dict` initialises those attributes first (what the first
   forward would do; it is idempotent). This one is not CPU-specific.
8. **Gradient shards that pin reduce-scatter buckets (all devices).** Gradients of units smaller than
   ``bucket_cap_mb`` are reduce-scattered together through a bucket, and FairScale keeps each reduced shard as a
   *view* into that bucket's output buffer, which is then replaced by a new one. Until the next ``zero_grad`` every
   flushed buffer stays alive whole, unused tail included: through the optimizer step, where memory peaks, a rank
   held up to 7.6% more gradient memory than its shards (measured by ``benchmarks/training.py``).
   :meth:`FullyShardedDataParallel._post_reduction_hook` keeps a compact copy of such a shard instead, so a
   bucket's buffer is freed as soon as it has been read. Shards reduced on their own are kept as they are.
9. **Reduce-scatter bucketers that live forever (all devices).** FairScale caches
   ``ReduceScatterBucketer._get_shard_size`` with ``functools.lru_cache`` on the method, so the cache holds every
   bucketer ever used — with its bucket buffers (``bucket_cap_mb`` per dtype) and its process group — for the rest of
   the process: each ``fit`` leaked its buffers, and gloo's threads outlived the process group into interpreter
   shutdown, where they could abort a finished run. :class:`~lightning_fairscale.fsdp.bucketing.ReduceScatterBucketer`
   computes the same size without the cache, and :class:`FullyShardedDataParallel` uses it (or its gloo variant) on
   every device.
10. **Pinned memory.** ``cpu_offload``/``move_grads_to_cpu`` pin host memory, which needs CUDA. Offloading to the
    CPU from the CPU has no effect anyway, so the strategy turns both off on CPU runs with a warning (see
    :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`); they are not handled here.
11. **Frozen and trainable parameters in one unit (all devices).** FairScale flattens a unit's parameters into one
    tensor with one ``requires_grad`` and asserts that they all agree. :class:`FullyShardedDataParallel` flattens
    them as trainable and records which original parameters were frozen (``requires_grad`` of the flat parameter
    is then ``False`` only when all of them were): the optimizer's view parameters
    (:mod:`lightning_fairscale.fsdp.param_views`) keep each one's own ``requires_grad``. The backward computes a
    gradient for the frozen elements too (as PyTorch's FSDP with ``use_orig_params=True`` does); nothing uses it.
12. **Optimizers over the original parameters (all devices).** The optimizer holds views into the flat shards
    (:mod:`lightning_fairscale.fsdp.param_views`). :class:`FullyShardedDataParallel` hands them their gradient
    slices at the end of every synchronising backward (``_wait_for_post_backward``), and before every backward
    lets ``zero_grad`` on the views reach the flat gradient (``_prep_grads_for_backward``), which FairScale would
    otherwise accumulate into.
13. **Pure bf16 parameters (all devices).** FairScale trains a model held in fp16 (``mixed_precision=False``,
    ``compute_dtype=torch.float16``), but its constructor refuses any other parameter dtype than fp16 or fp32
    ("Expecting FP16 param type in FP32 & MP modes"), although nothing after that check depends on the dtype
    (flattening, sharding, all-gathers, reduce-scatters and the state dicts keep the parameters' dtype). A unit made
    with ``mixed_precision=False`` and a half ``compute_dtype`` (fp16 or bf16) is a *true half precision* unit:
    :class:`FullyShardedDataParallel` builds it over fp32 copies of its own parameters (the check passes), then
    holds its shards, and the originals, in ``compute_dtype`` (half to fp32 and back is exact). While a unit is
    built, its unsharded parameters briefly take fp32 memory, as in a ``"32-true"`` run; its shards never do. Used
    for fp16 too, so that a unit made over fp32 parameters (layers wrapped before the precision plugin converts the
    model) ends up in the dtype asked for.

14. **Hybrid sharding (all devices).** FairScale shards over one process group and has no notion of replicas.
    A unit given a ``replica_group`` (the ranks that hold the same shard on the other nodes) shards within its
    ``process_group`` and, in :meth:`FullyShardedDataParallel._post_reduction_hook`, which FairScale calls for each
    parameter once its reduce-scatter is done (before the shard is accumulated into the gradient, and before
    ``_wait_for_post_backward`` hands it to the optimizer's views), all-reduces the shard over the replicas and
    divides it by their number: every rank then holds the average over all ranks, as under full sharding. Clipping
    by norm takes the norm over one replica's shards (``process_group``): the replicas hold the same gradients.
15. **A frozen root stays gathered (all devices).** FairScale frees a unit's full parameters after the backward in
    the post-backward hook of each parameter, which never fires for a parameter that does not require gradients;
    it frees every other unit's at the end of the backward, but not the root's (it may keep them from the forward
    to the backward on purpose). So a root unit whose parameters are all frozen (embeddings and head of a LoRA
    fine-tuning, say) kept its whole unsharded parameters on every rank from the first backward on (4 MiB per
    rank above 4Ψ/N in ``benchmarks/frozen_layers.py``), and FairScale's ``summon_full_params`` then failed
    (``AssertionError: 0 vs. 1``): no full ``state_dict()``, full checkpoint or ``unshard_module()`` after
    training. :meth:`FullyShardedDataParallel._wait_for_post_backward` frees them at the end of the backward,
    under the hook's condition (a synchronising backward, or a unit that reshards after forward).
16. **Collectives that wait on CPU.** Without CUDA streams every all-gather and reduce-scatter ran synchronously,
    by gloo's slow collectives. On CPU with gloo, a root's units gather the next units' parameters (what fits in
    ``bucket_cap_mb``, at least one) while the current one computes its forward; the forward's last units (the last
    one, and those before it that fit the same budget) keep their full parameters for the backward, which would
    gather them again at once; in the backward, by default, the next unit's all-gather runs alongside the current
    unit's reduce-scatter, with the units before it that fit the budget beside the gradients still reducing, and
    the reductions wait before the next unit computes down to what fits beside what is held ahead: while a layer
    computes, at most ``bucket_cap_mb`` beyond its own unit and the forward's last one;
    ``backward_prefetch="BACKWARD_PRE"`` overlaps them with the computation too (:mod:`~.fsdp.prefetch`; one unit
    gathered ahead at most), by exchanges (:mod:`~.distributed.exchanges`). Same results; CUDA unchanged.
17. **The model's own parameters (all devices).** FairScale deletes a unit's parameters from their modules and
    leaves stale views of the full flat parameter in their place (freed memory between steps), and
    ``model.parameters()`` gives its flat parameters. As torch FSDP's ``use_orig_params=True``, each original
    parameter is put back, under its names (tied ones: one parameter), as the optimizer's view of it
    (:mod:`~lightning_fairscale.fsdp.original_params`). :class:`FullyShardedDataParallel` hands its modules
    FairScale's views of the full parameters for its forward and, in the backward, once its full parameters are
    gathered (a checkpointed layer recomputes with them), and the original parameters back after each; FairScale's
    end of the backward sees its flat parameters (it checks each unit's state by its ``parameters()``).
18. **``torch.compile`` (all devices).** Dynamo cannot trace a unit (FairScale swaps ``param.data`` between shard
    and full parameter, resizes storages and runs collectives): every backend failed at the first step. FairScale
    declared compile unsupported. The user's compile is taken as "compile my layers" (regional compilation,
    :mod:`~lightning_fairscale.fsdp.compile`): compiled submodules are unwrapped before wrapping, and after it the
    largest modules that hold no unit get a compiled ``forward`` with the user's options, so that each unit's
    gather, reshard and reduce-scatter run eagerly around compiled code. :class:`FullyShardedDataParallel`'s
    ``__call__`` is skipped by dynamo, so that a compile around units (Fabric compiles the module its strategy
    returns) runs them eagerly.
19. **Deprecation warnings from FairScale's calls (all devices).** FairScale calls ``dist._all_gather_base``,
    ``dist._reduce_scatter_base`` and ``Tensor.storage()``, which torch deprecates with a warning on every rank that
    the user can do nothing about. :mod:`~lightning_fairscale.fsdp.deprecations` gives FairScale's modules a view of
    ``torch.distributed`` with the current names of those collectives (no warning is raised) and ignores the
    ``TypedStorage`` warning where FairScale's code is its location only; installed by the first unit built.
20. **Post-backward hooks that pile up (all devices).** FairScale adds its post-backward hook to each flat
    parameter's gradient accumulator in every forward and keeps the accumulator alive, so after ``k`` steps the hook
    ran ``k`` times per backward (idempotent, but a cost that grew with the run, and on CPU it undid workaround 16's
    overlap from the second step on). One hook per accumulator (:mod:`~lightning_fairscale.fsdp.backward_hooks`).
21. **Mixed precision on one rank (all devices).** With ``mixed_precision=True`` and nothing sharded (one rank),
    FairScale left the flat parameter's gradient in the compute dtype (the optimizer's fp32 views refused it at the
    first backward), and freed the half parameter after a ``no_sync`` backward that the root then computed with
    (:mod:`~lightning_fairscale.fsdp.one_rank`: ``Trainer(devices=1, precision="bf16-mixed")`` failed; found on a
    GPU, the same on CPU).

Use :class:`FullyShardedDataParallel` wherever FairScale's class would be used: it is a subclass; on CUDA it differs
by the workarounds above that say "all devices".
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, Optional

import torch
from fairscale.internal.containers import apply_to_tensors
from fairscale.nn.data_parallel.fully_sharded_data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState
from torch import Tensor, nn

from lightning_fairscale.distributed import exchanges
from lightning_fairscale.fsdp import backward_hooks, deprecations, frozen_params, original_params, param_views
from lightning_fairscale.fsdp import bookkeeping, one_rank, prefetch, recovery, ties
from lightning_fairscale.fsdp.bucketing import GlooReduceScatterBucketer, ReduceScatterBucketer
from lightning_fairscale.fsdp.cpu_streams import _CPU_STREAM
from lightning_fairscale.fsdp.grad_norm import clip_grad_norm_
from lightning_fairscale.fsdp.hybrid import replicate_gradient
from lightning_fairscale.fsdp.materialize import ParamInitFn, has_meta_tensors, materialize, validate_param_init_fn
from lightning_fairscale.mixed_precision.settings import true_half_dtype

__all__ = [
    "FullyShardedDataParallel",
    "fsdp_instances",
    "named_fsdp_instances",
]


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


class FullyShardedDataParallel(_FairScaleFSDP):
    """FairScale's ``FullyShardedDataParallel`` that also runs on CPU with gloo, and computes in bf16 when asked.

    On CUDA it differs from FairScale's class by the workarounds of this module's list marked "all devices". On CPU
    it uses no-op streams too (while :mod:`~lightning_fairscale.fsdp.cpu_streams` holds them), a gloo-compatible
    reduce-scatter bucketer, a device-agnostic :meth:`clip_grad_norm_` and collectives that overlap the computation.

    A module built on the ``meta`` device is materialised here, just before FairScale flattens and shards it: its
    meta tensors become real ones on the unit's device, initialised by each module's ``reset_parameters()`` or by
    ``param_init_fn`` (the one argument FairScale's class does not take; see
    :mod:`lightning_fairscale.fsdp.materialize`).
    """

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        param_init_fn: Optional[ParamInitFn] = None,
        replica_group: Any = None,
        backward_prefetch: Optional[str] = "BACKWARD_POST",
        **kwargs: Any,
    ):
        deprecations.install()  # workaround 19, before FairScale's first call
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

    #: The CPU prefetcher of this unit's root (workaround 16), ``None`` where it does not apply (CUDA).
    _prefetcher: Optional[prefetch.Prefetcher] = None

    # Workaround 18: dynamo never traces a unit (FairScale's parameter swaps and collectives), it runs it eagerly;
    # the compiled regions inside run compiled (`torch.compiler.disable` gives each compiled function called from
    # it its own compiler back). A skipped call, not a graph break: a `fullgraph=True` compile around a unit works.
    __call__ = torch.compiler.disable(_FairScaleFSDP.__call__)

    # FairScale's per-step bookkeeping, for less Python work (the same effect).
    __setattr__ = bookkeeping.set_attribute
    _cast_buffers = bookkeeping.cast_buffers

    @recovery.restoring  # after an exception in a step, the units as the last completed step left them
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_root is None:  # FairScale's forward starts with it too; here it decides the root and sets up
            self._lazy_init()  # the prefetcher, once (again after FairScale resets it): it walks the whole model
        computes_in_bf16 = self.mixed_precision and self.compute_dtype is torch.bfloat16
        if computes_in_bf16 and self._is_root:  # the root: inputs enter here
            args, kwargs = _cast_float32(self.compute_dtype, args, kwargs)
        original_params.before_forward(self)  # workaround 17: FairScale's views while the unit computes
        try:
            if not self._is_root or self._prefetcher is None:
                return super().forward(*args, **kwargs)
            self._prefetcher.forward_started()  # workaround 16
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._prefetcher.forward_ended()
        finally:
            original_params.show(self)  # workaround 17: the original parameters again

    def named_modules(  # type: ignore[override]
        self, memo: Optional[set[nn.Module]] = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """``nn.Module.named_modules``, but once the unit holds the original parameters (workaround 17) its wrappers
        (this unit and FairScale's ``FlattenParamsWrapper``) take the path of the module they wrap, so that
        ``model.named_parameters()`` names the parameters as the unwrapped model does."""
        if not original_params.is_installed_on(self):
            yield from super().named_modules(memo, prefix, remove_duplicate)
            return
        memo = set() if memo is None else memo
        wrapper = self._fsdp_wrapped_module
        for module in (self, wrapper):
            if module not in memo:
                if remove_duplicate:
                    memo.add(module)
                yield prefix, module
        yield from wrapper.module.named_modules(memo, prefix, remove_duplicate)

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
        for module in fsdp_instances(self):
            module._streams = self._streams
            module._reducer = reducer
            module._prefetcher = prefetcher

    def _rebuild_full_params(self, force_full_precision: bool = False) -> Any:
        one_rank.forget_freed_half_params(self)  # workaround 21
        if self._prefetcher is None or force_full_precision:
            if self._prefetcher is not None:
                self._prefetcher.settle(self)
            result = super()._rebuild_full_params(force_full_precision)
        else:
            result = self._prefetcher.rebuild(self, super()._rebuild_full_params)  # workaround 16
        if prefetch.in_backward() and not force_full_precision:
            original_params.use_full_views(self)  # workaround 17: a recomputed forward sees the full parameters
        return result

    def _use_full_params(self) -> None:
        super()._use_full_params()
        if prefetch.in_backward():
            original_params.use_full_views(self)  # workaround 17

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
        backward_hooks.register_post_backward_hooks(self)  # workaround 20

    def _post_backward_hook(self, param: nn.Parameter, *unused: Any) -> None:
        super()._post_backward_hook(param, *unused)
        if self._prefetcher is not None:
            self._prefetcher.after_post_backward(self)  # workaround 16

    def _prep_grads_for_backward(self) -> None:
        for param in self.params:  # workaround 12
            param_views.take_back_gradients(param)
        super()._prep_grads_for_backward()

    def _wait_for_post_backward(self) -> None:
        # FairScale checks each unit's state by its `parameters()`, which must be its flat ones there (workaround 17);
        # the original parameters come back at the end of the context.
        with original_params.fairscale_layout(self):
            self._finish_backward()

    def _finish_backward(self) -> None:
        super()._wait_for_post_backward()
        for unit in fsdp_instances(self):  # workaround 12
            for param in unit.params:
                if self._require_backward_grad_sync:
                    param_views.share_gradients(param)
                else:
                    param_views.share_local_gradients(param, unit.rank)
        self._reshard_frozen_params()
        if self._prefetcher is not None:  # workaround 16: nothing gathered ahead or kept outlives the backward
            self._prefetcher.pass_ended()
            self._prefetcher.release_kept()

    def _reshard_frozen_params(self) -> None:
        """Free this (root) unit's gathered frozen parameters after a backward, as FairScale's post-backward hook
        frees a trainable parameter's and under the same condition (workaround 15)."""
        frozen = [param for param in self.params if not param.requires_grad]
        if not frozen or not (self._require_backward_grad_sync or self.reshard_after_forward):
            return
        self._free_full_params(frozen)
        if self.mixed_precision:
            self._free_fp16_param_shard(frozen)
        self._use_fp32_param_shard(frozen)

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
        own = [param for unit in fsdp_instances(self) for param in unit.params]
        holders = param_views.trainable_views(own) if param_views.has_views(self) else own
        return [p for p in holders if p.grad is not None]

    def _init_param_attributes(self, p: torch.nn.Parameter) -> None:
        super()._init_param_attributes(p)
        param_views.repoint_data(p)  # FairScale may have replaced the shard (a pinned copy): views follow it


def fsdp_instances(module: torch.nn.Module) -> Iterator[_FairScaleFSDP]:
    """Every FairScale FSDP instance in ``module`` (itself included), outermost first: the one scan for the FSDP
    units of a module that the package uses."""
    return (unit for _, unit in named_fsdp_instances(module))


def named_fsdp_instances(module: torch.nn.Module) -> Iterator[tuple[str, _FairScaleFSDP]]:
    """:func:`fsdp_instances` with each unit's path in ``module`` (``""`` for ``module`` itself, wrapper names
    included: ``lightning_fairscale.fsdp.state_names.clean_path`` removes them)."""
    return ((path, m) for path, m in module.named_modules() if isinstance(m, _FairScaleFSDP))
