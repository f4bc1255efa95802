"""The one numbered list of the FairScale workarounds: what FairScale 0.4.13 does, why it is wrong here, and where
our fix lives.

FairScale's FSDP and sharded DDP were written for CUDA and NCCL. They run unchanged on GPUs, but on a CPU process
group (gloo) they fail in several places, and some of their bugs hit every device. FairScale is frozen, so the fixes
live in this package, each bounded: the CPU-only ones change nothing on a CUDA device, the others say where they
apply, and no installed file is edited. Most are overrides in our unit class,
:class:`lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel`, each calling the module named; the tests of a
workaround name its number. This module holds no code: it is the list, where a newcomer looks first.

The workarounds, and why each is needed:

1. **CUDA streams.** FSDP overlaps communication with computation on ``torch.cuda.Stream`` objects and calls
   ``torch.cuda.current_stream()``, ``torch.cuda.stream(...)`` and ``torch.cuda.synchronize()`` unconditionally,
   which raise on a machine without CUDA. CPU work is executed in program order, so streams have nothing to do
   there. FairScale's FSDP module (and only that module) gets a view of ``torch`` whose ``cuda`` attribute answers
   these calls with a single no-op CPU stream. Only when ``torch.cuda.is_available()`` is ``False``; with CUDA
   present FairScale keeps the real ``torch``. Held by each model the engine wrapped to compute on the CPU, for as
   long as it lives (:func:`~lightning_fairscale.fsdp.patches.cpu_streams.hold_while_alive`; ``unshard_module()`` ends
   the hold at once), and undone with the last one: FairScale's module then has its own ``torch`` again.
2. **``Tensor.record_stream`` on CPU tensors.** FSDP records its CUDA streams on gradient and parameter buffers so
   the caching allocator does not reuse them early. PyTorch has no CPU kernel for ``aten::record_stream`` (it raises
   ``NotImplementedError``). CPU memory is not stream-ordered, so recording is meaningless there: a no-op CPU kernel
   is registered (``torch.library``) with workaround 1, and deregistered with it. CUDA tensors keep PyTorch's own
   kernel.
3. **Reduce-scatter buckets on gloo.** FairScale's ``ReduceScatterBucketer`` hands a 2-D ``(world_size, n)`` tensor to
   ``_reduce_scatter_base``. NCCL accepts that; gloo checks ``output.numel() * world_size == input.shape[0]`` and
   aborts. :class:`~lightning_fairscale.fsdp.patches.bucketing.GlooReduceScatterBucketer` passes the same memory as a
   1-D view, which is the layout gloo expects and gives the identical result. It is used only when the reduce-scatter
   group's backend is gloo.
4. **``clip_grad_norm_`` calls ``.cuda()``** on the local norm. :class:`FullyShardedDataParallel` computes the global
   norm on the gradients' own device when the module computes on CPU, and defers to FairScale on CUDA. The precision
   plugins clip with :func:`~lightning_fairscale.fsdp.patches.grad_norm.clip_grad_norm_` on every device; its
   all-reduce goes through :mod:`lightning_fairscale.distributed.collectives`, which moves the norm to CUDA for NCCL
   when the gradients are in CPU memory (``move_grads_to_cpu``).
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
   shutdown, where they could abort a finished run.
   :class:`~lightning_fairscale.fsdp.patches.bucketing.ReduceScatterBucketer` computes the same size without the cache,
   and :class:`FullyShardedDataParallel` uses it (or its gloo variant) on every device.
10. **Pinned memory.** ``cpu_offload``/``move_grads_to_cpu`` pin host memory, which needs CUDA. Offloading to the
    CPU from the CPU has no effect anyway, so the strategy turns both off on CPU runs with a warning (see
    :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`); they are not handled here.
11. **Frozen and trainable parameters in one unit (all devices).** FairScale flattens a unit's parameters into one
    tensor with one ``requires_grad`` and asserts that they all agree. :class:`FullyShardedDataParallel` flattens
    them as trainable and records which original parameters were frozen (``requires_grad`` of the flat parameter
    is then ``False`` only when all of them were): the optimizer's view parameters
    (:mod:`lightning_fairscale.fsdp.unit.param_views`) keep each one's own ``requires_grad``. The backward computes a
    gradient for the frozen elements too (as PyTorch's FSDP with ``use_orig_params=True`` does); nothing uses it.
12. **Optimizers over the original parameters (all devices).** The optimizer holds views into the flat shards
    (:mod:`lightning_fairscale.fsdp.unit.param_views`). :class:`FullyShardedDataParallel` hands them their gradient
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
    ``backward_prefetch="BACKWARD_PRE"`` overlaps them with the computation too (one unit gathered ahead at most), by
    exchanges (:mod:`~.distributed.exchanges`): the gathers ahead in :mod:`~.fsdp.patches.prefetch`, the
    reduce-scatters in flight in :mod:`~.fsdp.patches.reduce_scatter`. Same results; CUDA unchanged.
17. **The model's own parameters (all devices).** FairScale deletes a unit's parameters from their modules and
    leaves stale views of the full flat parameter in their place (freed memory between steps), and
    ``model.parameters()`` gives its flat parameters. As torch FSDP's ``use_orig_params=True``, each original
    parameter is put back, under its names (tied ones: one parameter), as the optimizer's view of it
    (:mod:`~lightning_fairscale.fsdp.unit.original_params`). :class:`FullyShardedDataParallel` hands its modules
    FairScale's views of the full parameters for its forward and, in the backward, once its full parameters are
    gathered (a checkpointed layer recomputes with them), and the original parameters back after each; FairScale's
    end of the backward sees its flat parameters (it checks each unit's state by its ``parameters()``).
18. **``torch.compile`` (all devices).** Dynamo cannot trace a unit (FairScale swaps ``param.data`` between shard
    and full parameter, resizes storages and runs collectives): every backend failed at the first step. FairScale
    declared compile unsupported. The user's compile is taken as "compile my layers" (regional compilation,
    :mod:`~lightning_fairscale.fsdp.wrapping.compile`): compiled submodules are unwrapped before wrapping, and after it
    the largest modules that hold no unit get a compiled ``forward`` with the user's options, so that each unit's
    gather, reshard and reduce-scatter run eagerly around compiled code. :class:`FullyShardedDataParallel`'s
    ``__call__`` is skipped by dynamo, so that a compile around units (Fabric compiles the module its strategy
    returns) runs them eagerly.
19. **Deprecation warnings from FairScale's calls (all devices).** FairScale calls ``dist._all_gather_base``,
    ``dist._reduce_scatter_base`` and ``Tensor.storage()``, which torch deprecates with a warning on every rank that
    the user can do nothing about. :mod:`~lightning_fairscale.fsdp.patches.deprecations` gives FairScale's modules a
    view of ``torch.distributed`` with the current names of those collectives (no warning is raised) and ignores the
    ``TypedStorage`` warning where FairScale's code is its location only; installed by the first unit built.
20. **Post-backward hooks that pile up (all devices).** FairScale adds its post-backward hook to each flat
    parameter's gradient accumulator in every forward and keeps the accumulator alive, so after ``k`` steps the hook
    ran ``k`` times per backward (idempotent, but a cost that grew with the run, and on CPU it undid workaround 16's
    overlap from the second step on). One hook per accumulator
    (:mod:`~lightning_fairscale.fsdp.patches.backward_hooks`).
21. **Mixed precision on one rank (all devices).** With ``mixed_precision=True`` and nothing sharded (one rank),
    FairScale left the flat parameter's gradient in the compute dtype (the optimizer's fp32 views refused it at the
    first backward), and freed the half parameter after a ``no_sync`` backward that the root then computed with
    (:mod:`~lightning_fairscale.fsdp.patches.one_rank`: ``Trainer(devices=1, precision="bf16-mixed")`` failed; found
    on a GPU, the same on CPU).
22. **Checkpointing that recomputes something else (all devices).** FairScale's ``checkpoint_wrapper`` recomputed a
    layer without the CPU's autocast (and under CUDA's in fp16 whatever the forward's dtype), and gave a Hugging Face
    GPT-2 layer 1% of its attention's gradients: wrong gradients without an error (found by the feature matrix). The
    strategy's ``activation_checkpointing`` uses torch's non-reentrant checkpoint
    (:mod:`~lightning_fairscale.fsdp.wrapping.activation_checkpointing`).
23. **The model's own checkpointing around a unit (all devices).** torch's non-reentrant checkpoint (Hugging Face's
    ``gradient_checkpointing_enable``) calls a unit's forward again inside the backward; FairScale took it for a new
    forward, left the unit ``FORWARD`` and the backward failed (found by the feature matrix). A unit in its backward
    recomputes with its gathered parameters, its state unchanged (:mod:`~lightning_fairscale.fsdp.unit.recompute`).
24. **ShardedDataParallel's detection of trainability changes (sharded DDP, all devices).** It read the wrapper's
    ``training`` flag, which Lightning's validation leaves ``False``: every step after a validation inside ``fit``
    reduced no gradient; it re-armed its per-backward state in ``forward`` only (manual optimization's second
    backward failed) (:class:`~lightning_fairscale.sharded_ddp.trainability.Trainability`).
25. **OSS's list of the gradients it clips (sharded DDP, all devices).** ``OSS.clip_grad_norm`` keeps the list of its
    first call: a layer frozen then was left out of every later norm
    (:mod:`~lightning_fairscale.sharded_ddp.trainability`).
26. **Gradient shards beside gathered parameters (all devices).** A compile after the first step (an evaluation, a
    batch of another size) failed: dynamo copied a flat parameter's gradient shard onto a fake tensor of its
    gathered size. A unit's forward sets the shards aside (:mod:`~lightning_fairscale.fsdp.patches.forward_grads`).
27. **A root gathered by an evaluation forward (all devices).** FairScale does not reshard the root after its forward:
    after one with no backward (validation) it kept its full parameters, and the next forward used them, missing any
    write into the shards in between (weight averaging's swap back): :mod:`~lightning_fairscale.fsdp.unit.gathered`.
28. **What the loop changes between steps (all devices).** FairScale derives a flat parameter's ``requires_grad`` at
    build time, and ends a backward only after the root's forward. Freezing or unfreezing the model's parameters
    (views, workaround 17) or ``toggle_optimizer`` changed nothing, and ``manual_backward`` (inside the root's
    forward) left units in ``BACKWARD_POST``: :mod:`~lightning_fairscale.fsdp.unit.step_state` owns both, per model.
"""
