"""The one numbered table of the FairScale workarounds: what FairScale 0.4.13 does, why it is wrong here, our fix,
the module that holds it and the tests that fail without it.

FairScale's FSDP and sharded DDP were written for CUDA and NCCL. They run unchanged on GPUs, but on a CPU process
group (gloo) they fail in several places, and some of their bugs hit every device. FairScale is frozen, so the fixes
live in this package, each bounded: the CPU-only ones change nothing on a CUDA device, the others say where they
apply, and no installed file is edited. Most are overrides in our unit class,
:class:`lightning_fairscale.fsdp.unit.units.FullyShardedDataParallel`, each calling the module named; the private
FairScale names they reach are listed in :mod:`lightning_fairscale.distributed.fairscale_private`.

:data:`WORKAROUNDS` holds the table as records (the table below is made from them). Each workaround's tests are
marked with its number, ``@pytest.mark.workaround(12)``, and named in its record; ``tests/unit/test_workarounds.py``
checks that every number has a marked test, that every marker names a number of the table, and that the records name
the marked tests. A new workaround gets its number from the project's lead.
"""

from __future__ import annotations

from lightning_fairscale.fsdp.patches.workaround_table import Workaround, list_table

__all__ = ["WORKAROUNDS", "Workaround", "table"]

_UNIT = ":class:`FullyShardedDataParallel`"

#: The workarounds, by number.
WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        1, "CUDA streams", "CPU",
        "FSDP overlaps communication with computation on ``torch.cuda.Stream`` objects and calls"
        " ``torch.cuda.current_stream()``, ``torch.cuda.stream(...)`` and ``torch.cuda.synchronize()``"
        " unconditionally, which raise on a machine without CUDA. CPU work is executed in program order, so streams"
        " have nothing to do there.",
        "FairScale's FSDP module (and only that module) gets a view of ``torch`` whose ``cuda`` attribute answers these"
        " calls with a single no-op CPU stream. Only when ``torch.cuda.is_available()`` is ``False``; with CUDA present"
        " FairScale keeps the real ``torch``. Held by each model the engine wrapped to compute on the CPU, for as long"
        " as it lives (:func:`~lightning_fairscale.fsdp.patches.cpu_streams.hold_while_alive`; ``unshard_module()``"
        " ends the hold at once), and undone with the last one: FairScale's module then has its own ``torch`` again.",
        "fsdp.patches.cpu_streams",
        ("tests/unit/test_fairscale_cpu.py::test_install_gives_fsdp_a_torch_whose_streams_do_nothing",),
    ),
    Workaround(
        2, "``Tensor.record_stream`` on CPU tensors", "CPU",
        "FSDP records its CUDA streams on gradient and parameter buffers so the caching allocator does not reuse them"
        " early. PyTorch has no CPU kernel for ``aten::record_stream`` (it raises ``NotImplementedError``). CPU memory"
        " is not stream-ordered, so recording is meaningless there.",
        "A no-op CPU kernel is registered (``torch.library``) with workaround 1, and deregistered with it. CUDA tensors"
        " keep PyTorch's own kernel.",
        "fsdp.patches.cpu_streams",
        ("tests/unit/test_fairscale_cpu.py::test_record_stream_on_a_cpu_tensor_does_nothing",),
    ),
    Workaround(
        3, "Reduce-scatter buckets on gloo", "gloo",
        "FairScale's ``ReduceScatterBucketer`` hands a 2-D ``(world_size, n)`` tensor to ``_reduce_scatter_base``."
        " NCCL accepts that; gloo checks ``output.numel() * world_size == input.shape[0]`` and aborts.",
        ":class:`~lightning_fairscale.fsdp.patches.bucketing.GlooReduceScatterBucketer` passes the same memory as a 1-D"
        " view, which is the layout gloo expects and gives the identical result. It is used only when the"
        " reduce-scatter group's backend is gloo.",
        "fsdp.patches.bucketing",
        (
            "tests/unit/test_fairscale_cpu.py::test_fsdp_on_gloo_without_overlap_uses_one_shared_gloo_bucketer",
            "tests/unit/test_fairscale_cpu.py::test_gloo_bucketer_equals_a_plain_reduce_scatter_on_one_rank",
            "tests/unit/test_fairscale_cpu.py::test_fairscales_bucketer_fails_on_gloo_where_ours_works",
            "tests/unit/test_multirank.py::test_gloo_bucketer_reduces_like_a_plain_reduce_scatter",
        ),
    ),
    Workaround(
        4, "``clip_grad_norm_`` calls ``.cuda()``", "CPU; the plugins' clipping: all devices",
        "FSDP's ``clip_grad_norm_`` calls ``.cuda()`` on the local norm.",
        f"{_UNIT} computes the global norm on the gradients' own device when the module computes on CPU, and defers"
        " to FairScale on CUDA. The precision plugins clip with"
        " :func:`~lightning_fairscale.fsdp.patches.grad_norm.clip_grad_norm_` on every device; its all-reduce goes"
        " through :mod:`lightning_fairscale.distributed.collectives`, which moves the norm to CUDA for NCCL when the"
        " gradients are in CPU memory (``move_grads_to_cpu``).",
        "fsdp.patches.grad_norm",
        (
            "tests/unit/test_fairscale_cpu.py::test_clip_grad_norm_equals_torchs",
            "tests/unit/test_fairscale_cpu.py::test_global_grad_norm_of_nothing_is_zero",
            "tests/unit/test_fairscale_cpu.py::test_fsdp_clip_grad_norm_on_cpu_equals_torch_on_the_plain_model",
            "tests/unit/test_multirank.py::test_clipping_by_norm_equals_torch_on_the_unsharded_gradients",
            "tests/unit/test_multirank.py::test_global_grad_norm_of_disjoint_shards_equals_torchs_norm_of_them_all",
            "tests/unit/test_precision.py::test_fsdp_plugins_clip_by_the_norm_of_all_shards",
        ),
    ),
    Workaround(
        5, "fp16 loss scaling", "FSDP: all devices; sharded DDP: off CUDA",
        "FairScale's ``ShardedGradScaler`` disables itself when CUDA is not available, and for gradients in CPU memory"
        " it all-reduces a CUDA copy of the inf/NaN flags and then drops the result.",
        ":class:`~lightning_fairscale.mixed_precision.grad_scaler.ShardedGradScaler` is PyTorch's device-generic"
        " ``torch.amp.GradScaler`` plus the one thing sharding needs: the \"found inf\" flags are combined across"
        " ranks, in place, wherever they are (through :mod:`lightning_fairscale.distributed.collectives`), so every"
        " rank skips the same steps. The FSDP precision plugin uses it on every device (this one is not CPU-specific),"
        " the sharded-DDP plugin off CUDA.",
        "mixed_precision.grad_scaler",
        (
            "tests/unit/test_fairscale_cpu.py::test_sharded_grad_scaler_on_one_rank_equals_torchs_grad_scaler",
            "tests/unit/test_multirank.py::test_sharded_grad_scaler_skips_the_step_on_every_rank",
            "tests/unit/test_precision.py::test_mixed_precision_gets_a_sharded_scaler_for_fp16_only",
        ),
    ),
    Workaround(
        6, "bf16 compute", "all devices",
        "With ``mixed_precision=True`` FairScale casts float32 inputs of the root module to fp16, whatever"
        " ``compute_dtype`` is, which breaks bf16 compute.",
        f"{_UNIT} (its ``forward``) casts them to the unit's ``compute_dtype`` first, which FairScale then leaves"
        " alone.",
        "fsdp.unit.units",
        ("tests/unit/test_fairscale_cpu.py::test_bf16_compute_really_computes_in_bf16",),
    ),
    Workaround(
        7, "Loading a sharded state before the first forward", "all devices",
        "``load_local_state_dict`` ends by freeing every unit's full parameters, which reads an attribute that inner"
        " units create only in their first forward, so resuming from a sharded checkpoint fails with"
        " ``AttributeError: _full_param_padded``.",
        ":meth:`FullyShardedDataParallel.load_local_state_dict` initialises those attributes first (what the first"
        " forward would do; it is idempotent).",
        "fsdp.unit.units",
        ("tests/unit/test_multirank.py::test_consolidated_state_and_parameters_equal_plain_training",),
    ),
    Workaround(
        8, "Gradient shards that pin reduce-scatter buckets", "all devices",
        "Gradients of units smaller than ``bucket_cap_mb`` are reduce-scattered together through a bucket, and"
        " FairScale keeps each reduced shard as a *view* into that bucket's output buffer, which is then replaced by a"
        " new one. Until the next ``zero_grad`` every flushed buffer stays alive whole, unused tail included: through"
        " the optimizer step, where memory peaks, a rank held up to 7.6% more gradient memory than its shards"
        " (measured by ``benchmarks/training.py``).",
        ":meth:`FullyShardedDataParallel._post_reduction_hook` keeps a compact copy of such a shard instead, so a"
        " bucket's buffer is freed as soon as it has been read. Shards reduced on their own are kept as they are.",
        "fsdp.unit.units",
        ("tests/unit/test_workarounds.py::test_gradient_shards_reduced_in_a_bucket_hold_only_their_own_memory",),
    ),
    Workaround(
        9, "Reduce-scatter bucketers that live forever", "all devices",
        "FairScale caches ``ReduceScatterBucketer._get_shard_size`` with ``functools.lru_cache`` on the method, so the"
        " cache holds every bucketer ever used, with its bucket buffers (``bucket_cap_mb`` per dtype) and its process"
        " group, for the rest of the process: each ``fit`` leaked its buffers, and gloo's threads outlived the process"
        " group into interpreter shutdown, where they could abort a finished run.",
        ":class:`~lightning_fairscale.fsdp.patches.bucketing.ReduceScatterBucketer` computes the same size without the"
        f" cache, and {_UNIT} uses it (or its gloo variant) on every device.",
        "fsdp.patches.bucketing",
        (
            "tests/unit/test_fairscale_cpu.py::test_our_bucketers_are_freed_with_their_last_reference",
            "tests/unit/test_fairscale_cpu.py::test_shard_sizes_are_fairscales",
        ),
    ),
    Workaround(
        10, "Pinned memory", "CPU",
        "``cpu_offload``/``move_grads_to_cpu`` pin host memory, which needs CUDA. Offloading to the CPU from the CPU"
        " has no effect anyway.",
        "The strategy turns both off on CPU runs with a warning (see"
        " :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`); they are not handled in the unit class.",
        "fsdp.config",
        (
            "tests/unit/test_config.py::test_fsdp_kwargs_follow_the_device",
            "tests/unit/test_config.py::test_options_that_do_nothing_on_the_cpu_warn",
        ),
    ),
    Workaround(
        11, "Frozen and trainable parameters in one unit", "all devices",
        "FairScale flattens a unit's parameters into one tensor with one ``requires_grad`` and asserts that they all"
        " agree.",
        f"{_UNIT} flattens them as trainable and records which original parameters were frozen (``requires_grad`` of"
        " the flat parameter is then ``False`` only when all of them were): the optimizer's view parameters"
        " (:mod:`lightning_fairscale.fsdp.unit.param_views`) keep each one's own ``requires_grad``. The backward"
        " computes a gradient for the frozen elements too (as PyTorch's FSDP with ``use_orig_params=True`` does);"
        " nothing uses it.",
        "fsdp.unit.frozen_params",
        ("tests/unit/test_multirank.py::test_adamw_groups_across_units_and_a_frozen_weight_equal_plain_training",),
    ),
    Workaround(
        12, "Optimizers over the original parameters", "all devices",
        "FairScale's optimizer must hold the flat parameters (``model.parameters()``): an optimizer over the original"
        " parameters gets no gradient, and its ``zero_grad`` does not reach the flat gradient, which FairScale"
        " accumulates into.",
        "The optimizer holds views into the flat shards (:mod:`lightning_fairscale.fsdp.unit.param_views`)."
        f" {_UNIT} hands them their gradient slices at the end of every synchronising backward"
        " (``_wait_for_post_backward``), and before every backward lets ``zero_grad`` on the views reach the flat"
        " gradient (``_prep_grads_for_backward``), which FairScale would otherwise accumulate into.",
        "fsdp.unit.param_views",
        (
            "tests/unit/test_original_params.py::test_the_attributes_hold_this_ranks_slice_and_its_gradient",
            "tests/unit/test_original_params.py::test_accumulating_parameters_hold_their_slice_of_this_ranks_own_gradient",
            "tests/unit/test_multirank.py::test_each_original_parameter_is_the_union_of_its_views_on_the_ranks",
        ),
    ),
    Workaround(
        13, "Pure bf16 parameters", "all devices",
        "FairScale trains a model held in fp16 (``mixed_precision=False``, ``compute_dtype=torch.float16``), but its"
        " constructor refuses any other parameter dtype than fp16 or fp32 (\"Expecting FP16 param type in FP32 & MP"
        " modes\"), although nothing after that check depends on the dtype (flattening, sharding, all-gathers,"
        " reduce-scatters and the state dicts keep the parameters' dtype).",
        "A unit made with ``mixed_precision=False`` and a half ``compute_dtype`` (fp16 or bf16) is a *true half"
        f" precision* unit: {_UNIT} builds it over fp32 copies of its own parameters (the check passes), then holds its"
        " shards, and the originals, in ``compute_dtype`` (half to fp32 and back is exact). While a unit is built, its"
        " unsharded parameters briefly take fp32 memory, as in a ``\"32-true\"`` run; its shards never do. Used for"
        " fp16 too, so that a unit made over fp32 parameters (layers wrapped before the precision plugin converts the"
        " model) ends up in the dtype asked for.",
        "fsdp.unit.units",
        ("tests/unit/test_fairscale_cpu.py::test_a_true_half_precision_unit_holds_and_computes_in_its_dtype",),
    ),
    Workaround(
        14, "Hybrid sharding", "all devices",
        "FairScale shards over one process group and has no notion of replicas.",
        "A unit given a ``replica_group`` (the ranks that hold the same shard on the other nodes) shards within its"
        " ``process_group`` and, in :meth:`FullyShardedDataParallel._post_reduction_hook`, which FairScale calls for"
        " each parameter once its reduce-scatter is done (before the shard is accumulated into the gradient, and"
        " before ``_wait_for_post_backward`` hands it to the optimizer's views), all-reduces the shard over the"
        " replicas and divides it by their number: every rank then holds the average over all ranks, as under full"
        " sharding. Clipping by norm takes the norm over one replica's shards (``process_group``): the replicas hold"
        " the same gradients.",
        "fsdp.patches.hybrid",
        (
            "tests/unit/test_workarounds.py::test_two_replicas_of_one_shard_each_train_as_unsharded",
            "tests/test_hybrid_sharding.py::test_hybrid_under_torchrun_equals_unsharded_training",
            "tests/test_hybrid_sharding.py::test_one_all_reduce_of_the_gradient_shards_crosses_the_nodes_per_step",
        ),
    ),
    Workaround(
        15, "A frozen root stays gathered", "all devices",
        "FairScale frees a unit's full parameters after the backward in the post-backward hook of each parameter,"
        " which never fires for a parameter that does not require gradients; it frees every other unit's at the end"
        " of the backward, but not the root's (it may keep them from the forward to the backward on purpose). So a"
        " root unit whose parameters are all frozen (embeddings and head of a LoRA fine-tuning, say) kept its whole"
        " unsharded parameters on every rank from the first backward on (4 MiB per rank above 4Ψ/N in"
        " ``benchmarks/frozen_layers.py``), and FairScale's ``summon_full_params`` then failed (``AssertionError: 0"
        " vs. 1``): no full ``state_dict()``, full checkpoint or ``unshard_module()`` after training.",
        ":meth:`FullyShardedDataParallel._wait_for_post_backward` frees them at the end of the backward"
        " (:func:`~lightning_fairscale.fsdp.unit.frozen_params.reshard_frozen`), under the hook's condition (a"
        " synchronising backward, or a unit that reshards after forward).",
        "fsdp.unit.frozen_params",
        (
            "tests/unit/test_multirank.py::"
            "test_a_frozen_root_holds_only_its_shards_after_each_backward_and_trains_like_plain",
        ),
    ),
    Workaround(
        16, "Collectives that wait on CPU", "CPU (gloo)",
        "Without CUDA streams every all-gather and reduce-scatter ran synchronously, by gloo's slow collectives.",
        "On CPU with gloo, a root's units gather the next units' parameters (what fits in ``bucket_cap_mb``, at least"
        " one) while the current one computes its forward; the forward's last units (the last one, and those before"
        " it that fit the same budget) keep their full parameters for the backward, which would gather them again at"
        " once; in the backward, by default, the next unit's all-gather runs alongside the current unit's"
        " reduce-scatter, with the units before it that fit the budget beside the gradients still reducing, and the"
        " reductions wait before the next unit computes down to what fits beside what is held ahead: while a layer"
        " computes, at most ``bucket_cap_mb`` beyond its own unit and the forward's last one;"
        " ``backward_prefetch=\"BACKWARD_PRE\"`` overlaps them with the computation too (one unit gathered ahead at"
        " most), by exchanges (:mod:`~lightning_fairscale.distributed.exchanges`); the reduce-scatters in flight are"
        " :mod:`~lightning_fairscale.fsdp.patches.reduce_scatter`'s. Same results; CUDA unchanged.",
        "fsdp.patches.prefetch",
        (
            "tests/unit/test_multirank.py::test_cpu_units_overlap_their_collectives_and_train_as_synchronous_ones",
            "tests/unit/test_multirank.py::test_the_backward_holds_other_units_full_parameters_only_as_its_prefetch_mode_says",
            "tests/unit/test_multirank.py::test_the_forward_gathers_ahead_the_units_that_fit_the_bucket_at_its_start",
            "tests/unit/test_fairscale_cpu.py::test_fsdp_on_cpu_gloo_shares_one_async_reducer_and_one_prefetcher",
        ),
    ),
    Workaround(
        17, "The model's own parameters", "all devices",
        "FairScale deletes a unit's parameters from their modules and leaves stale views of the full flat parameter in"
        " their place (freed memory between steps), and ``model.parameters()`` gives its flat parameters.",
        "As torch FSDP's ``use_orig_params=True``, each original parameter is put back, under its names (tied ones:"
        f" one parameter), as the optimizer's view of it. {_UNIT} hands its modules FairScale's views of the full"
        " parameters for its forward and, in the backward, once its full parameters are gathered (a checkpointed"
        " layer recomputes with them), and the original parameters back after each; FairScale's end of the backward"
        " sees its flat parameters (it checks each unit's state by its ``parameters()``).",
        "fsdp.unit.original_params",
        (
            "tests/unit/test_original_params.py::test_the_attributes_are_the_optimizers_parameters_and_the_tie_holds",
            "tests/unit/test_original_params.py::test_training_equals_unsharded_and_the_full_state_dict_has_every_name",
        ),
    ),
    Workaround(
        18, "``torch.compile``", "all devices",
        "Dynamo cannot trace a unit (FairScale swaps ``param.data`` between shard and full parameter, resizes storages"
        " and runs collectives): every backend failed at the first step. FairScale declared compile unsupported.",
        "The user's compile is taken as \"compile my layers\" (regional compilation): compiled submodules are"
        " unwrapped before wrapping, and after it the largest modules that hold no unit get a compiled ``forward``"
        " with the user's options, so that each unit's gather, reshard and reduce-scatter run eagerly around compiled"
        f" code. {_UNIT}'s ``__call__`` is skipped by dynamo, so that a compile around units (Fabric compiles the"
        " module its strategy returns) runs them eagerly.",
        "fsdp.wrapping.compile",
        ("tests/unit/test_compile.py::test_compiled_layers_train_as_eager_ones_and_keep_their_names",),
    ),
    Workaround(
        19, "Deprecation warnings from FairScale's calls", "all devices",
        "FairScale calls ``dist._all_gather_base``, ``dist._reduce_scatter_base`` and ``Tensor.storage()``, which torch"
        " deprecates with a warning on every rank that the user can do nothing about.",
        "FairScale's modules get a view of ``torch.distributed`` with the current names of those collectives (no"
        " warning is raised), and the ``TypedStorage`` warning is ignored where FairScale's code is its location only;"
        " installed by the first unit built.",
        "fsdp.patches.deprecations",
        (
            "tests/unit/test_deprecations.py::"
            "test_training_raises_no_deprecation_warning_and_the_users_calls_still_warn",
            "tests/unit/test_deprecations.py::test_fairscale_calls_the_current_collectives",
        ),
    ),
    Workaround(
        20, "Post-backward hooks that pile up", "all devices",
        "FairScale adds its post-backward hook to each flat parameter's gradient accumulator in every forward and keeps"
        " the accumulator alive: after ``k`` steps the hook ran ``k`` times a backward (on CPU it undid workaround 16's"
        " overlap), and accumulator, parameter and hook kept the whole model alive for the life of the process.",
        "One hook per accumulator (``_register_post_backward_hooks``), the accumulator kept by its graph only.",
        "fsdp.patches.backward_hooks",
        ("tests/unit/test_multirank.py::test_each_units_post_backward_hook_runs_once_a_step_not_once_more_every_step",),
    ),
    Workaround(
        21, "Mixed precision on one rank", "all devices",
        "With ``mixed_precision=True`` and nothing sharded (one rank), FairScale left the flat parameter's gradient in"
        " the compute dtype (the optimizer's fp32 views refused it at the first backward), and freed the half"
        " parameter after a ``no_sync`` backward that the root then computed with (``Trainer(devices=1,"
        " precision=\"bf16-mixed\")`` failed; found on a GPU, the same on CPU).",
        "The parameter keeps the gradient FairScale cast (``_post_reduction_hook``), and a freed half copy makes the"
        " unit gather again (``_rebuild_full_params``).",
        "fsdp.patches.one_rank",
        (
            "tests/unit/test_fairscale_cpu.py::"
            "test_mixed_precision_on_one_rank_trains_the_fp32_parameters_with_fp32_gradients",
            "tests/unit/test_fairscale_cpu.py::test_mixed_precision_on_one_rank_accumulates",
            "tests/unit/test_precision.py::test_fabric_on_one_process_trains_in_bf16_mixed_precision",
        ),
    ),
    Workaround(
        22, "Checkpointing that recomputes something else", "all devices",
        "FairScale's ``checkpoint_wrapper`` recomputed a layer without the CPU's autocast (and under CUDA's in fp16"
        " whatever the forward's dtype), and gave a Hugging Face GPT-2 layer 1% of its attention's gradients: wrong"
        " gradients without an error (found by the feature matrix).",
        "The strategy's ``activation_checkpointing`` uses torch's non-reentrant checkpoint"
        " (:func:`~lightning_fairscale.fsdp.wrapping.activation_checkpointing.apply_activation_checkpointing`).",
        "fsdp.wrapping.activation_checkpointing",
        ("tests/unit/test_workarounds.py::test_activation_checkpointing_recomputes_under_the_forwards_autocast",),
    ),
    Workaround(
        23, "The model's own checkpointing around a unit", "all devices",
        "torch's non-reentrant checkpoint (Hugging Face's ``gradient_checkpointing_enable``) calls a unit's forward"
        " again inside the backward; FairScale took it for a new forward, left the unit ``FORWARD`` and the backward"
        " failed (found by the feature matrix).",
        "A unit in its backward recomputes with its gathered parameters, its state unchanged (the unit's ``forward``).",
        "fsdp.unit.recompute",
        ("tests/unit/test_workarounds.py::test_a_unit_inside_torchs_checkpoint_recomputes_and_trains_as_unsharded",),
    ),
    Workaround(
        24, "ShardedDataParallel's detection of trainability changes", "sharded DDP, all devices",
        "It read the wrapper's ``training`` flag, which Lightning's validation leaves ``False``: every step after a"
        " validation inside ``fit`` reduced no gradient; it re-armed its per-backward state in ``forward`` only"
        " (manual optimization's second backward failed).",
        ":class:`~lightning_fairscale.sharded_ddp.trainability.Trainability` follows the trainability and re-arms the"
        " state before each backward.",
        "sharded_ddp.trainability",
        (
            "tests/unit/test_trainability.py::test_a_model_left_in_training_mode_under_an_eval_wrapper_is_reduced",
            "tests/unit/test_trainability.py::test_a_second_backward_after_one_forward_reduces_too",
        ),
    ),
    Workaround(
        25, "OSS's list of the gradients it clips", "sharded DDP, all devices",
        "``OSS.clip_grad_norm`` keeps the list of its first call: a layer frozen then was left out of every later"
        " norm.",
        ":func:`~lightning_fairscale.sharded_ddp.trainability.clip_grad_norm` forgets the list before each call.",
        "sharded_ddp.trainability",
        ("tests/unit/test_trainability.py::test_clip_grad_norm_counts_parameters_frozen_at_the_first_call",),
    ),
    Workaround(
        26, "Gradient shards beside gathered parameters", "all devices",
        "A compile after the first step (an evaluation, a batch of another size) failed: dynamo copied a flat"
        " parameter's gradient shard onto a fake tensor of its gathered size.",
        "A unit's forward sets the shards aside"
        " (:func:`~lightning_fairscale.fsdp.patches.forward_grads.gradients_set_aside`).",
        "fsdp.patches.forward_grads",
        ("tests/test_compile.py::test_the_plainest_form_trains_and_validates_as_eager_unsharded_training",),
    ),
    Workaround(
        27, "A root gathered by an evaluation forward", "all devices",
        "FairScale does not reshard the root after its forward: after one with no backward (validation) it kept its"
        " full parameters, and the next forward used them, missing any write into the shards in between (weight"
        " averaging's swap back).",
        "The full parameters a unit still holds between steps are freed"
        " (:func:`~lightning_fairscale.fsdp.unit.gathered.drop_full_params`), so the next forward gathers the shards.",
        "fsdp.unit.gathered",
        (
            "tests/unit/test_workarounds.py::test_a_forward_after_an_evaluation_sees_what_was_written_into_the_shards",
            "tests/test_weight_averaging.py::test_validation_swaps_the_average_in_and_out",
        ),
    ),
    Workaround(
        28, "What the loop changes between steps", "all devices",
        "FairScale derives a flat parameter's ``requires_grad`` at build time, and ends a backward only after the"
        " root's forward. Freezing or unfreezing the model's parameters (views, workaround 17) or"
        " ``toggle_optimizer`` changed nothing, and ``manual_backward`` (inside the root's forward) left units in"
        " ``BACKWARD_POST``.",
        ":mod:`~lightning_fairscale.fsdp.unit.step_state` owns both, per model.",
        "fsdp.unit.step_state",
        (
            "tests/unit/test_step_state.py::test_a_unit_frozen_at_set_up_trains_once_unfrozen",
            "tests/unit/test_step_state.py::test_backward_passes_inside_the_roots_forward_train_as_unsharded",
        ),
    ),
    Workaround(
        29, "Units that do not run in a step", "all devices",
        "FairScale ends every backward as if each unit had run in it: a unit whose forward did not run (a head used in"
        " one stage only, a skipped layer, an expert without tokens) failed the first backward on every rank"
        " (``'FlatParameter' object has no attribute '_full_param_padded'``), and one that ran only in accumulating"
        " passes never reduced its gradient.",
        "Before FairScale's end of the backward the units it did not reach are settled: set up, given the state it"
        " expects, their gradient left as it is (no update, no change of the optimizer's state), an accumulated one"
        " reduce-scattered (:func:`~lightning_fairscale.fsdp.unit.not_run.before_end_of_backward`).",
        "fsdp.unit.not_run",
        (
            "tests/test_unused_units.py::test_matches_unsharded",
            "tests/unit/test_not_run.py::test_a_unit_that_never_runs_gets_no_gradient_no_update_and_no_state",
            "tests/unit/test_not_run.py::test_a_unit_only_the_accumulating_pass_ran_has_its_gradient_reduced",
        ),
    ),
    Workaround(
        30, "Gradients a reducing backward did not reach", "sharded DDP, all devices",
        "``ShardedDataParallel`` reduces a gradient from its hook: a layer that ran in a step's accumulating"
        " micro-batches (``no_sync``) but not in the last one kept each rank's own sum, and its owner stepped with it.",
        ":meth:`~lightning_fairscale.sharded_ddp.trainability.Trainability.end_backward` reduces them as their hooks"
        " would have.",
        "sharded_ddp.trainability",
        ("tests/test_unused_units.py::test_matches_unsharded",),
    ),
)


def table(workarounds: tuple[Workaround, ...] = WORKAROUNDS) -> str:
    """The workarounds as a reStructuredText ``list-table`` (:func:`~.workaround_table.list_table`)."""
    return list_table(workarounds)


__doc__ = f"{__doc__}\nThe workarounds:\n\n{table()}"
