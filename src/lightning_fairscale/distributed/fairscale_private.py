"""Every private name of FairScale that lightning-fairscale uses, in one place.

FairScale 0.4.13 is frozen, and its FSDP and sharded DDP leave gaps we fill (the numbered workarounds,
:mod:`lightning_fairscale.fsdp.patches.workarounds`). Filling them means reaching past FairScale's public API: this
module holds all of it, so that a reader sees what a FairScale release may break, and where.

* **Private imports**: FairScale's ``fairscale.internal`` package (its helpers, outside its API) and any ``_`` name
  of its modules are imported here only; other modules import them from this one.
* **Private attributes**: the private attributes and methods of FairScale's objects that the package reads, writes,
  calls or overrides (an override is a method of ours under FairScale's name, so it cannot go through a function
  here) are listed in :data:`PRIVATE_ATTRIBUTES`: the name, the FairScale class that has it, what we rely on.

``tests/unit/test_import_graph.py`` holds both: a FairScale private name used in the package but not listed here fails,
a listed name no longer used fails, and a private import from ``fairscale`` outside this module fails (its docstring
says exactly what counts). torch's private names live in :mod:`~lightning_fairscale.distributed.torch_private`.
Like it, this module is the engine's lowest layer and imports no Lightning.

Checked against FairScale 0.4.13.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairscale.internal import reduce_scatter_bucketer
from fairscale.internal.containers import apply_to_tensors

__all__ = ["PRIVATE_ATTRIBUTES", "PrivateAttribute", "apply_to_tensors", "reduce_scatter_bucketer"]

_FSDP = "FullyShardedDataParallel"
_FLAT = "FlatParameter (a FullyShardedDataParallel unit's flat parameter)"
_PARAM = "a FullyShardedDataParallel unit's flat parameter (set by _init_param_attributes)"
_SDP = "ShardedDataParallel"


@dataclass(frozen=True)
class PrivateAttribute:
    """A private attribute or method of a FairScale object that the package uses."""

    #: The FairScale class (or object) that has it.
    owner: str
    #: What we do with it and rely on.
    relies_on: str


#: The private attributes and methods of FairScale's objects that the package reads, writes, calls or overrides.
PRIVATE_ATTRIBUTES: dict[str, PrivateAttribute] = {
    # FullyShardedDataParallel: the methods our unit class overrides (each calls FairScale's, around a workaround).
    "_cast_buffers": PrivateAttribute(_FSDP, "overridden (bookkeeping) and called to cast buffers back to fp32"),
    "_free_full_params": PrivateAttribute(_FSDP, "overridden and called: frees a unit's gathered full parameters"),
    "_init_param_attributes": PrivateAttribute(
        _FSDP, "overridden and called: creates a flat parameter's shard attributes (first forward, loading)"
    ),
    "_post_backward_hook": PrivateAttribute(
        _FSDP, "overridden; bound into our one hook per gradient accumulator (workaround 20)"
    ),
    "_post_reduction_hook": PrivateAttribute(
        _FSDP, "overridden: called once a parameter's reduce-scatter is done, before accumulation (8, 14)"
    ),
    "_prep_grads_for_backward": PrivateAttribute(_FSDP, "overridden: runs before each backward (workaround 12)"),
    "_queue_wait_for_post_backward": PrivateAttribute(_FSDP, "overridden: queues the end-of-backward callback"),
    "_rebuild_full_params": PrivateAttribute(
        _FSDP, "overridden and called: all-gathers a unit's full parameters (workarounds 16, 23)"
    ),
    "_register_post_backward_hooks": PrivateAttribute(_FSDP, "overridden: registers the post-backward hooks (20)"),
    "_setup_streams": PrivateAttribute(_FSDP, "overridden: creates the CUDA streams, the reducer (1, 3, 9)"),
    "_use_full_params": PrivateAttribute(_FSDP, "overridden: points the parameters at their full data"),
    "_wait_for_post_backward": PrivateAttribute(
        _FSDP, "overridden and called: the end of a backward, where gradients are final (12, 15, 28)"
    ),
    # FullyShardedDataParallel: methods called.
    "_free_fp16_param_shard": PrivateAttribute(_FSDP, "called: frees the compute-dtype copy of the shards"),
    "_lazy_init": PrivateAttribute(_FSDP, "called: decides the root and sets up the units (idempotent)"),
    "_use_fp32_param_shard": PrivateAttribute(_FSDP, "called: points the parameters back at their fp32 shards"),
    # FullyShardedDataParallel: attributes read or written.
    "_fsdp_wrapped_module": PrivateAttribute(_FSDP, "read: the FlattenParamsWrapper a unit wraps"),
    "_has_shared_params": PrivateAttribute(_FSDP, "read: a unit with parameters shared with another unit"),
    "_is_root": PrivateAttribute(_FSDP, "read (None before the first forward) and reset on recovery"),
    "_num_flatten_params": PrivateAttribute(_FSDP, "read: how many of a unit's params are flat parameters (first)"),
    "_output_pre_backward_hook_registered": PrivateAttribute(_FSDP, "read and cleared on recovery (a list)"),
    "_param_name_groups": PrivateAttribute(_FSDP, "read: the names of a unit's parameters that are not flattened"),
    "_post_backward_callback_queued": PrivateAttribute(
        _FSDP, "read (a backward begins while it is False) and reset on recovery"
    ),
    "_pre_backward_hook_has_run": PrivateAttribute(
        _FSDP, "written: reset on recovery; set for a backward inside the root's forward (28)"
    ),
    "_reducer": PrivateAttribute(_FSDP, "written: our reduce-scatter bucketer (3, 9); read to close it at exit"),
    "_require_backward_grad_sync": PrivateAttribute(_FSDP, "read: whether this backward synchronises (no_sync)"),
    "_streams": PrivateAttribute(_FSDP, "read and written: the name -> stream dict, CPU no-op streams (1)"),
    # The attributes FullyShardedDataParallel sets on its flat parameters.
    "_cpu_grad": PrivateAttribute(_PARAM, "cleared when a model is unwrapped"),
    "_fp16_shard": PrivateAttribute(_PARAM, "read: the compute-dtype shard (mixed precision, workaround 21)"),
    "_fp32_shard": PrivateAttribute(_PARAM, "read: the full-precision shard the optimizer's views point into"),
    "_full_param_padded": PrivateAttribute(_PARAM, "read and gathered into ahead of time (workaround 16)"),
    "_is_sharded": PrivateAttribute(_PARAM, "read: whether the parameter is sharded (False on one rank)"),
    "_orig_size": PrivateAttribute(_PARAM, "read: the full flat parameter's size, before sharding and padding"),
    "_saved_grad_shard": PrivateAttribute(_PARAM, "read and dropped: the reduced gradient shard being accumulated"),
    "_shard_bwd_hook": PrivateAttribute(_PARAM, "cleared when unwrapped: FairScale's record, never ours (20)"),
    # FlattenParamsWrapper and its FlatParameter.
    "_fpw_module": PrivateAttribute("FlattenParamsWrapper", "read: the user's module inside the wrapper"),
    "_unflattened_param_views": PrivateAttribute(
        "FlattenParamsWrapper", "dropped from the user's module once a backward ends (it holds the step's graph)"
    ),
    "_unflatten_params": PrivateAttribute("FlattenParamsWrapper", "called: puts the original parameters back"),
    "_param_infos": PrivateAttribute(_FLAT, "read: (module name, module, parameter name) of each piece"),
    "_param_numels": PrivateAttribute(_FLAT, "read: each original parameter's number of elements"),
    "_param_shapes": PrivateAttribute(_FLAT, "read: each original parameter's shape"),
    "_shared_param_infos": PrivateAttribute(_FLAT, "read: the tied parameters' (module, name) pairs"),
    # FairScale's activation checkpointing.
    "_checkpointed_forward": PrivateAttribute(
        "fairscale.nn.checkpoint.checkpoint_activations", "the function's name: how a layer its checkpoint_wrapper "
        "patched is recognised"
    ),
    # ReduceScatterBucketer (fairscale.internal.reduce_scatter_bucketer).
    "_get_bucket": PrivateAttribute("ReduceScatterBucketer", "overridden: gloo's 1-D bucket (workaround 3)"),
    "_get_shard_size": PrivateAttribute("ReduceScatterBucketer", "overridden without lru_cache (workaround 9)"),
    # ShardedDataParallel: its per-backward state (sharded_ddp/trainability.py, workarounds 24 and 25).
    "_all_params": PrivateAttribute(_SDP, "read: every parameter, for the trainability mask"),
    "_bucket_flush_callback_set": PrivateAttribute(_SDP, "read: whether this backward queued its bucket flush"),
    "_bucket_list": PrivateAttribute(_SDP, "read: the gradient buckets"),
    "_clear_counters": PrivateAttribute(_SDP, "called: re-arms the per-backward state"),
    "_flush_reduce_calls": PrivateAttribute(_SDP, "called: sends the buckets not sent yet, waits for them (30)"),
    "_grad_hooks": PrivateAttribute(_SDP, "read: whether any gradient hook is registered"),
    "_grad_to_be_reduced": PrivateAttribute(_SDP, "written: a list of flags, one per trainable parameter"),
    "_local_to_global_rank": PrivateAttribute(_SDP, "read: a rank of its group as a global rank (30)"),
    "_process_group": PrivateAttribute(_SDP, "read: the group its reductions run on (30)"),
    "_rank": PrivateAttribute(_SDP, "read: this rank in the wrapper's process group"),
    "_should_accumulate_grads": PrivateAttribute(_SDP, "read: a no_sync backward"),
    "_should_bucket_grad": PrivateAttribute(_SDP, "read: which trainable parameters go through a bucket"),
    "_trainable_param_to_rank": PrivateAttribute(_SDP, "read: the rank that owns each trainable parameter"),
    "_trainable_params": PrivateAttribute(_SDP, "read: the parameters it reduces"),
    "_use_buckets": PrivateAttribute(_SDP, "read: whether gradients are bucketed"),
    "_work_handles": PrivateAttribute(_SDP, "read and drained: the pending reductions (a deque)"),
    "_world_size_scaling": PrivateAttribute(_SDP, "read: 1 / its group's size, the gradients' averaging (30)"),
    # OSS.
    "_OSS__local_params": PrivateAttribute(
        "OSS", "written (None): its cached list of the gradients it clips, listed again at the next call (25)"
    ),
    "_params": PrivateAttribute("GradBucket (fairscale.nn.misc.param_bucket)", "read: the parameters of a bucket"),
}
