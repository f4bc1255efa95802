"""The engine on 2 and 3 real ranks: one forked run per world size, whose results the tests below check.

Sharding proper (shards, padding, reduce-scatter, norms and inf checks across ranks) needs several ranks. Each
world size is one run of forked processes (well under a second) shared by this module's tests, all compared with
references computed in this process without sharding.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fairscale.distributed import collectives, exchanges
from lightning_fairscale.fsdp.patches import cpu_streams, prefetch, reduce_scatter
from lightning_fairscale.fsdp.state.optim import norm_group
from lightning_fairscale.fsdp.patches.bucketing import GlooReduceScatterBucketer
from lightning_fairscale.fsdp.patches.grad_norm import clip_grad_norm_
from lightning_fairscale.mixed_precision.grad_scaler import ShardedGradScaler
from lightning_fairscale.fsdp.state.optim_state import describe_layout
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module
from lightning_fairscale.strategies._lost_ranks import is_collective_failure

from .helpers import (
    IN_FEATURES,
    OPTIMIZERS,
    OUT_FEATURES,
    WIDTH,
    Block,
    Net,
    assert_optimizer_states_equal,
    assert_tensors_equal,
    batches,
    param_groups,
    parameters_of,
    small_block,
    run_ranks,
    shard,
    split_by_hand,
    step,
    wrap,
)

#: Three units (the root holds inp and out, each Block is one): few units, few collectives, fast ranks.
POLICY = {True: {Block}, False: {Block}}
CASES = [("sgd", True), ("adam", True), ("sgd", False), ("adam", False)]
NORM_TYPES = [2.0, 1.0, math.inf]
CLIP = 0.05


def references() -> dict[Any, Any]:
    """Plain training on the whole global batch: the optimizer states and parameters the ranks must reproduce."""
    out: dict[Any, Any] = {}
    for optimizer, flatten in CASES:
        model = Net()
        plain = OPTIMIZERS[optimizer](param_groups(model, flatten))
        for batch in batches(2):
            step(model, plain, batch)
        out[optimizer, flatten] = {"optimizer": plain.state_dict(), "parameters": parameters_of(model)}
    model = Net()
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    out["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    out["clipped"] = parameters_of(model)
    return out


def rank_batch(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's equal share of a global batch: FSDP's averaged gradients are those of the whole batch."""
    return tuple(t[rank::world_size] for t in batch)


def _views_model() -> nn.Module:
    """One unit of 26 elements (split 13/13 or 9/9/8 by ranks: the weight of the first Linear crosses a boundary
    on 3 ranks, its bias on 2), and one of a single element (every rank but the first holds only padding)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1), nn.Linear(1, 1, bias=False))
    model[1].weight.requires_grad_(False)  # frozen, in a unit that trains
    return model


def view_checks(rank: int, world_size: int) -> dict[str, Any]:
    """This rank's views of :func:`_views_model`: ``(name, start in the parameter, values, requires_grad)`` each, and
    after one AdamW step with decay on weights only, the parameters and the consolidated state."""
    model = _views_model()
    named = dict(model.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if n.endswith("weight")], "weight_decay": 0.5},
        {"params": [p for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0},
    ]
    sharded = shard(model, torch.optim.AdamW(groups, lr=0.1), policy={nn.Linear}, exclude={nn.Sequential},
                    min_num_params=0)  # fmt: skip
    views = []
    for group in sharded.optimizer.param_groups:
        for param in group["params"]:
            [(managed, k)] = sharded.layout.locate(param)
            piece = sharded.layout.managed[managed].pieces[k]
            start, _ = sharded.layout.global_range(managed, sharded.layout.view(managed, k))
            views.append((piece.name, start - piece.offset, param.detach().clone(), param.requires_grad))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    loss = (sharded.root(x) ** 2).mean()
    loss.backward()
    sharded.optimizer.step()
    # An optimizer over the one-element unit only: the other ranks hold an empty view of it (padding), yet take part
    # in the same norm, over the optimizer's views alone (not their flat gradients, which hold the other parameters'),
    # as the precision plugins take it; the root's `clip_grad_norm_` takes the whole model's, as torch's.
    only = _views_model()
    alone = shard(only, torch.optim.SGD([only[2].weight], lr=0.1), policy={nn.Linear}, exclude={nn.Sequential},
                  min_num_params=0)  # fmt: skip
    (alone.root(x) ** 2).mean().backward()
    held = [p for group in alone.optimizer.param_groups for p in group["params"] if p.grad is not None]
    lone_norm = clip_grad_norm_(held, 1e9, 2.0, group=norm_group(alone.orders, alone.layout))
    model_norm = alone.root.clip_grad_norm_(1e9)
    return {
        "lone_norm": lone_norm,
        "model_norm": model_norm,
        "views": views,
        "parameters": parameters_of(unwrap_module(sharded.root)),
        "inputs": x,
        "consolidated": sharded.consolidate(),
    }


def _frozen_root_model() -> Net:
    """``Net`` with a frozen root unit (``inp`` and ``out``, with the policy ``{Block}``), as the embeddings and head
    of a LoRA fine-tuning: only the blocks train."""
    model = Net()
    for layer in (model.inp, model.out):
        layer.requires_grad_(False)
    return model


def frozen_root_checks(rank: int, world_size: int) -> dict[str, Any]:
    """Two Adam steps of :func:`_frozen_root_model`: the elements each root parameter holds after each backward,
    against its shard's, and the parameters at the end."""
    model = _frozen_root_model()
    sharded = shard(model, torch.optim.Adam(model.parameters(), lr=0.01), {Block})
    held = []
    for batch in batches(2):
        x, y = rank_batch(batch, rank, world_size)
        nn.functional.mse_loss(sharded.root(x), y).backward()
        held.append([(p.data.numel(), p._fp32_shard.numel()) for p in sharded.root.params])
        sharded.optimizer.step()
        sharded.optimizer.zero_grad()
    try:
        parameters: Any = parameters_of(unwrap_module(sharded.root))
    except AssertionError as error:  # FairScale's summon_full_params on a root left gathered; keep the other checks
        parameters = repr(error)
    return {"held": held, "parameters": parameters}


def _plain_reduce_scatters(inputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """This rank's result of a plain reduce-scatter of each input (one chunk of 4 elements per rank), the reference
    the bucketer is held to."""
    results = []
    for chunks in inputs:
        result = torch.empty(4)
        dist.reduce_scatter_tensor(result, torch.cat(chunks))
        results.append(result)
    return results


def _deep_model() -> nn.Module:
    torch.manual_seed(3)
    blocks = [small_block() for _ in range(5)]
    return nn.Sequential(nn.Linear(IN_FEATURES, WIDTH), *blocks, nn.Linear(WIDTH, OUT_FEATURES))


@dataclasses.dataclass
class _Overlap:
    """What :func:`_train_deep` saw: at every gathering, how many units held full parameters (gathered or arriving),
    in all and in the backward; how many gatherings a prefetch served; how many reductions were in flight as each
    layer's backward was about to compute; and whether anything was still gathered ahead after a no-grad forward."""

    holding: list[int] = dataclasses.field(default_factory=list)
    #: In each forward, how many blocks held full parameters (gathered or arriving) once the root's were gathered.
    at_forward_start: list[int] = dataclasses.field(default_factory=list)
    holding_backward: list[int] = dataclasses.field(default_factory=list)
    served: int = 0
    #: (reductions, bytes of gradients) in flight, and the bytes of the full parameters other blocks than the one about
    #: to compute hold (gathered ahead).
    reducing: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    #: At each layer's backward: what the prefetcher counts against its budget for the units held ahead of the unit
    #: about to compute (gathered ahead or kept), and the bytes those units hold (but the forward's last: cost 0).
    accounted: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    pending_after_no_grad_forward: bool = False
    #: Calls of the units' post-backward hooks in each step (workaround 20: as many in every step).
    hook_calls: list[int] = dataclasses.field(default_factory=list)
    #: All-gathers and reduce-scatters over the three steps, by kind: every one (``collectives.recording_traffic``),
    #: and those made by exchanges (:mod:`lightning_fairscale.distributed.exchanges`).
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    exchanges: dict[str, int] = dataclasses.field(default_factory=dict)


def _train_deep(
    rank: int, world_size: int, overlap: bool, backward_prefetch: Optional[str] = "BACKWARD_POST", **kwargs: Any
) -> tuple[nn.Module, _Overlap]:
    """Three Adam steps of a root and five Block units (FSDP arguments ``kwargs``), then a forward without
    gradients; what the overlap did (:class:`_Overlap`), and the collectives of it all."""
    model = _deep_model()
    root = wrap(model, policy={Block}, backward_prefetch=backward_prefetch, **kwargs)
    units = [m for m in root.modules() if isinstance(m, FullyShardedDataParallel) and m is not root]
    seen = _Overlap()
    real_rebuild = FullyShardedDataParallel._rebuild_full_params
    real_hook = FullyShardedDataParallel._post_backward_hook

    def hook(self: Any, *args: Any) -> None:
        seen.hook_calls[-1] += 1
        real_hook(self, *args)

    def rebuild(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._prefetcher is not None:
            seen.served += self in self._prefetcher._pending
        result = real_rebuild(self, *args, **kwargs)
        full = [getattr(u.params[0], "_full_param_padded", None) for u in units]  # made at a unit's first forward
        holding = sum(f is not None and f.untyped_storage().size() > 0 for f in full)
        seen.holding.append(holding)
        if prefetch.in_backward():
            seen.holding_backward.append(holding)
        elif self is root:
            seen.at_forward_start.append(holding)
        return result

    owner = {id(module): unit for unit in units for module in unit.modules()}

    def count_reductions(module: nn.Module, *unused: Any) -> None:
        if isinstance(root._reducer, reduce_scatter.AsyncReduceScatter):
            full = [u.params[0]._full_param_padded for u in units if u is not owner.get(id(module))]
            ahead = sum(f.numel() * f.element_size() for f in full if f.untyped_storage().size() > 0)
            seen.reducing.append((len(root._reducer._in_flight), root._reducer.bytes_in_flight, ahead))
        prefetcher = root._prefetcher
        if prefetcher is not None and prefetcher.order:
            computing = owner.get(id(module))
            others = [u for u in units if u is not computing and u is not prefetcher.order[-1]]
            held = sum(prefetch._ahead_bytes(u) for u in others if prefetch._still_gathered(u))
            seen.accounted.append((prefetcher._held_beside(computing), held))

    # Every block, and the root's first layer (which computes last, after the root's own reduce-scatter started).
    hooks = [m.register_full_backward_pre_hook(count_reductions) for m in model.modules() if isinstance(m, Block)]
    hooks.append(model[0].register_full_backward_pre_hook(count_reductions))
    # SGD: with 3 ranks gloo adds the ranks' gradients in an order that depends on the buffer, and the comparisons
    # below hold to the last bits; Adam would turn such a difference in a near-zero gradient into a step's (it
    # did under MKL_CBWR=COMPATIBLE: 1.3e-7 after 3 steps), and what is compared is the units' scheduling.
    optimizer = torch.optim.SGD(root.parameters(), lr=0.01)
    FullyShardedDataParallel._rebuild_full_params = rebuild  # type: ignore[method-assign]
    FullyShardedDataParallel._post_backward_hook = hook  # type: ignore[method-assign]
    prefetch.OVERLAP_ON_CPU = overlap  # read when the root sets up, in its first forward
    real_exchanges = {kind: getattr(exchanges, kind) for kind in ("all_gather", "reduce_scatter")}

    def counted(kind: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.exchanges[kind] = seen.exchanges.get(kind, 0) + 1
            return real_exchanges[kind](*args, **kwargs)

        return call

    for kind in real_exchanges:
        setattr(exchanges, kind, counted(kind))
    try:
        with collectives.recording_traffic() as transfers:
            for batch in batches(3):
                seen.hook_calls.append(0)
                step(root, optimizer, rank_batch(batch, rank, world_size))
            with torch.no_grad():
                root(rank_batch(batches(1)[0], rank, world_size)[0])
        for transfer in transfers:
            seen.collectives[transfer.kind] = seen.collectives.get(transfer.kind, 0) + 1
        seen.pending_after_no_grad_forward = root._prefetcher is not None and bool(root._prefetcher._pending)
    finally:
        for kind, function in real_exchanges.items():
            setattr(exchanges, kind, function)
        FullyShardedDataParallel._rebuild_full_params = real_rebuild  # type: ignore[method-assign]
        FullyShardedDataParallel._post_backward_hook = real_hook  # type: ignore[method-assign]
        prefetch.OVERLAP_ON_CPU = True
        for hook in hooks:
            hook.remove()
    return root, seen


def prefetch_checks(rank: int, world_size: int) -> dict[str, Any]:
    """Training with overlapped collectives (workaround 16) in each backward mode, and in the default mode under
    ``SHARD_GRAD_OP`` (units keep their full parameters from forward to backward), against the synchronous ones; and
    the async reducer."""
    synchronous, seen_sync = _train_deep(rank, world_size, overlap=False)
    out: dict[str, Any] = {
        "reducer_sync": type(synchronous._reducer).__name__, "modes": {}, "served_sync": seen_sync.served,
        "exchanges_sync": seen_sync.exchanges,
    }
    reference = parameters_of(unwrap_module(synchronous))
    for mode in prefetch.BACKWARD_MODES:
        overlapped, seen = _train_deep(rank, world_size, overlap=True, backward_prefetch=mode)
        out["modes"][mode] = {
            "reducer": type(overlapped._reducer).__name__,
            "seen": dataclasses.asdict(seen),
            "parameters": (parameters_of(unwrap_module(overlapped)), reference),
        }
    # Mixed precision (bf16 compute over fp32 shards): the cast shards are gathered ahead too.
    mixed = {"mixed_precision": True, "compute_dtype": torch.bfloat16}
    overlapped, seen = _train_deep(rank, world_size, overlap=True, **mixed)
    synchronous, _ = _train_deep(rank, world_size, overlap=False, **mixed)
    out["mixed"] = {
        "served": seen.served,
        "parameters": (parameters_of(unwrap_module(overlapped)), parameters_of(unwrap_module(synchronous))),
    }
    # Without a bucket's worth of budget, with two and a half blocks' worth, and under SHARD_GRAD_OP (units keep their
    # full parameters).
    no_budget = _train_deep(rank, world_size, overlap=True, bucket_cap_mb=0)[1]
    zero2 = _train_deep(rank, world_size, overlap=True, reshard_after_forward=False, bucket_cap_mb=0)[1]
    out["no_budget_reducing"], out["zero2_reducing"] = no_budget.reducing, zero2.reducing
    block_bytes = 4 * math.ceil(sum(p.numel() for p in small_block().parameters()) / world_size) * world_size
    middle = _train_deep(rank, world_size, overlap=True, bucket_cap_mb=2.5 * block_bytes / 2**20)[1]
    zero2_middle = _train_deep(
        rank, world_size, overlap=True, reshard_after_forward=False, bucket_cap_mb=2.5 * block_bytes / 2**20
    )[1]
    out["ahead"] = {
        "none": no_budget.at_forward_start, "2.5 blocks": middle.at_forward_start,
        "zero2 none": zero2.at_forward_start, "zero2 2.5 blocks": zero2_middle.at_forward_start,
    }  # fmt: skip
    out["most_holding_without_budget"] = max(no_budget.holding)
    out["backward"] = {
        "none": (no_budget.holding_backward, no_budget.reducing),
        "2.5 blocks": (middle.holding_backward, middle.reducing),
        "served": {"none": no_budget.served, "2.5 blocks": middle.served},
        "accounted": {"1 MiB": out["modes"]["BACKWARD_POST"]["seen"]["accounted"], "2.5 blocks": middle.accounted},
        "budget": 2.5 * block_bytes,
    }
    # The async reducer: the same results as plain reduce-scatters, callbacks in order, one reduction in flight.
    g = torch.Generator().manual_seed(200 + rank)
    inputs = [[torch.randn(4, generator=g) for _ in range(world_size)] for _ in range(3)]
    plain = []
    for chunks in inputs:  # FairScale's own reduce-scatter of a gradient larger than its bucket
        plain.append(torch.empty(4))
        dist.reduce_scatter(plain[-1], chunks)
    reduced: list[torch.Tensor] = []
    reducer = reduce_scatter.AsyncReduceScatter(max_in_flight=1)
    done_before_flush = []
    piece_bytes, reduce_scatter.PIECE_BYTES = reduce_scatter.PIECE_BYTES, 8  # two pieces of two elements each
    try:
        for chunks in inputs:
            reducer.reduce_scatter_async(chunks, group=dist.group.WORLD, callback_fn=reduced.append)
            done_before_flush.append(len(reduced))
        reducer.flush()
    finally:
        reduce_scatter.PIECE_BYTES = piece_bytes
    out["async_reduce_scatter"] = (reduced, plain, done_before_flush)
    out["exchanges"] = exchange_checks(rank, world_size)
    out["tail"] = {overlap: _kept_tail(rank, world_size, overlap) for overlap in (True, False)}
    out["kept_then_stepped"] = {
        (overlap, then): _kept_then_stepped(rank, world_size, overlap, then)
        for overlap in (True, False) for then in ("forward", "summon")
    }
    return out


#: The hidden sizes of the blocks of :func:`_kept_tail`'s model: a small block, a big one, two middle ones.
TAIL_HIDDEN = (2, 40, 20, 20)


def _kept_tail(rank: int, world_size: int, overlap: bool) -> dict[str, Any]:
    """Three steps of blocks of unequal sizes (:data:`TAIL_HIDDEN`) with a budget of a middle block and one and a half
    small ones: which blocks each forward keeps for the backward (indices in the model), and the parameters."""
    torch.manual_seed(5)
    blocks = [Block(WIDTH, hidden=hidden, activation=torch.tanh) for hidden in TAIL_HIDDEN]
    model = nn.Sequential(nn.Linear(IN_FEATURES, WIDTH), *blocks, nn.Linear(WIDTH, OUT_FEATURES))
    full = [4 * math.ceil(sum(p.numel() for p in b.parameters()) / world_size) * world_size for b in blocks]
    budget = full[2] + 1.5 * full[0]
    prefetch.OVERLAP_ON_CPU = overlap
    try:
        root = wrap(model, policy={Block}, bucket_cap_mb=budget / 2**20)
        units = [m for m in root.modules() if isinstance(m, FullyShardedDataParallel) and m is not root]
        optimizer = torch.optim.SGD(root.parameters(), lr=0.01)  # as in _train_deep: the schedule is compared
        kept = []
        for x, y in (rank_batch(batch, rank, world_size) for batch in batches(3)):
            loss = nn.functional.mse_loss(root(x), y)
            kept.append(sorted(units.index(u) for u in root._prefetcher._kept) if root._prefetcher else [])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        prefetch.OVERLAP_ON_CPU = True
    return {"kept": kept, "parameters": parameters_of(unwrap_module(root))}


def _kept_then_stepped(rank: int, world_size: int, overlap: bool, then: str) -> dict[str, Any]:
    """A forward with gradients and no backward (the forward keeps its units' full parameters for a backward that
    does not come), then an optimizer step (of an earlier backward's gradients) changes the shards under them; then
    (``then``) the full parameters read by ``summon_full_params``, or a forward and a step, which must see the new
    shards."""
    prefetch.OVERLAP_ON_CPU = overlap
    try:
        root = wrap(_deep_model(), policy={Block})
        optimizer = torch.optim.SGD(root.parameters(), lr=0.01)  # as in _train_deep: the schedule is compared
        data = [rank_batch(batch, rank, world_size) for batch in batches(3)]
        step(root, optimizer, data[0])  # records the order
        nn.functional.mse_loss(root(data[1][0]), data[1][1]).backward()
        root(data[2][0])  # no backward
        kept = len(root._prefetcher._kept) if root._prefetcher is not None else 0
        optimizer.step()
        if then == "summon":
            with root.summon_full_params():
                return {"kept": kept, "parameters": parameters_of(root)}
        optimizer.zero_grad()
        output = root(data[1][0])
        nn.functional.mse_loss(output, data[1][1]).backward()
        optimizer.step()
    finally:
        prefetch.OVERLAP_ON_CPU = True
    return {"kept": kept, "output": output.detach(), "parameters": parameters_of(unwrap_module(root))}


def exchange_checks(rank: int, world_size: int) -> dict[str, Any]:
    """An exchange all-gather and an exchange reduce-scatter in flight together (the reduction waited for first),
    against the concatenation and the rank-order sum of every rank's tensors, rebuilt here from their seeds."""

    def tensors_of(r: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        g = torch.Generator().manual_seed(300 + r)
        return torch.randn(5, generator=g), [torch.randn(3, generator=g) for _ in range(world_size)]

    shard, chunks = tensors_of(rank)
    gathered, reduced = torch.full((5 * world_size,), float("nan")), torch.empty(3)
    gathering = exchanges.all_gather(gathered, shard)
    reducing = exchanges.reduce_scatter(reduced, chunks)
    reducing.wait()
    gathering.wait()
    everyone = [tensors_of(r) for r in range(world_size)]
    in_rank_order = everyone[0][1][rank].clone()
    for r in range(1, world_size):
        in_rank_order += everyone[r][1][rank]
    plain = torch.empty(3)
    dist.reduce_scatter(plain, chunks)
    return {
        "gathered": (gathered, torch.cat([s for s, _ in everyone])),
        "reduced": (reduced, in_rank_order, plain),
        "stuck_peer": stuck_peer_errors(rank, world_size),
    }


def stuck_peer_errors(rank: int, world_size: int) -> list[tuple[str, bool]]:
    """Rank 0 waits for two exchanges in flight, the second first, while the other ranks never answer, each message
    for at most 1 s (what a group's timeout does; a group made with a timeout of 1 s could time out while it
    connects, on a busy machine): gloo's error of each exchange, and whether the strategies take it for a lost rank
    (which they then name) rather than an error of the model."""
    group = dist.new_group()  # every rank makes the group
    errors = []
    if rank == 0:
        full = torch.empty(2 * world_size)
        first, second = (exchanges.all_gather(full, torch.ones(2), group=group) for _ in range(2))
        for exchange in (second, first):
            try:
                for work in exchange._works:
                    work.wait(datetime.timedelta(seconds=1))
            except RuntimeError as error:
                errors.append((str(error), is_collective_failure(error)))
    dist.barrier()  # the others wait here for rank 0's timeouts
    return errors


def rank_checks(rank: int, world_size: int, expected: dict[Any, Any]) -> dict[str, Any]:
    cpu_streams.install()
    out: dict[str, Any] = {"views": view_checks(rank, world_size), "frozen_root": frozen_root_checks(rank, world_size)}
    out["prefetch"] = prefetch_checks(rank, world_size)
    for optimizer, flatten in CASES:
        model = Net()
        sharded = shard(model, OPTIMIZERS[optimizer](param_groups(model, flatten)), POLICY[flatten], flatten)
        for batch in batches(2):
            step(sharded.root, sharded.optimizer, rank_batch(batch, rank, world_size))
        case: dict[str, Any] = {
            "local": {
                "state_dict": sharded.root.local_state_dict(),
                "metadata": sharded.root.local_metadata_dict(),
                "optimizer": sharded.optimizer.state_dict(),
                "layout": describe_layout(sharded.optimizer, sharded.orders, sharded.root, sharded.layout),
            },
            "consolidated": sharded.consolidate(),
        }
        # Every rank shards a full state it was given (as when resuming from a full checkpoint), then consolidates.
        fresh_model = Net()
        fresh = shard(fresh_model, OPTIMIZERS[optimizer](param_groups(fresh_model, flatten)), POLICY[flatten], flatten)
        fresh.load(expected[optimizer, flatten]["optimizer"])
        case["reloaded"] = fresh.consolidate()
        # A sharded checkpoint's parameters, loaded into units that never ran a forward (as on resuming).
        unused = wrap(Net(seed=5), policy=POLICY[flatten], flatten=flatten)
        unused.load_local_state_dict(sharded.root.local_state_dict())
        case["parameters"] = parameters_of(unwrap_module(sharded.root))
        case["loaded_parameters"] = parameters_of(unwrap_module(unused))
        out[f"{optimizer}-{flatten}"] = case

    # Gradient clipping by the global norm of all shards (FSDP's clip_grad_norm_ on CPU).
    model = Net()
    root = shard(model, torch.optim.SGD(model.parameters(), lr=0.5), {Block}).root
    x, y = rank_batch(batches(1)[0], rank, world_size)
    nn.functional.mse_loss(root(x), y).backward()
    # Gradient shards reduced through a bucket are compact copies, not views that keep the bucket's buffer alive.
    flat = [p for unit in root.modules() if isinstance(unit, FullyShardedDataParallel) for p in unit.params]
    out["grad_bytes"] = [(p.grad.untyped_storage().nbytes(), p.grad.numel() * 4) for p in flat]
    out["norm"] = root.clip_grad_norm_(CLIP)
    torch.optim.SGD(root.parameters(), lr=0.5).step()
    out["clipped"] = parameters_of(unwrap_module(root))

    # Global norms of disjoint gradient shards, against torch's norm of them all.
    g = torch.Generator().manual_seed(100 + rank)
    grads = [torch.randn(n, generator=g) for n in (3, 5)]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, grads)
    out["norms"] = {}
    for norm_type in NORM_TYPES:
        params = [nn.Parameter(torch.zeros_like(t)) for t in grads]
        for p, t in zip(params, grads):
            p.grad = t.clone()
        total = clip_grad_norm_(params, 0.5, norm_type)
        reference = [nn.Parameter(torch.zeros_like(t)) for rank_grads in everyone for t in rank_grads]
        for p, t in zip(reference, [t for rank_grads in everyone for t in rank_grads]):
            p.grad = t.clone()
        expected_total = torch.nn.utils.clip_grad_norm_(reference, 0.5, norm_type)
        mine = reference[len(grads) * rank : len(grads) * (rank + 1)]
        out["norms"][norm_type] = (total, expected_total, [p.grad for p in params], [p.grad for p in mine])

    # Reduce-scatter through the gloo bucketer, against a plain reduce-scatter of the same inputs.
    inputs = [[torch.randn(4, generator=g) for _ in range(world_size)] for _ in range(3)]
    plain = _plain_reduce_scatters(inputs)
    bucketed: list[torch.Tensor] = []
    bucketer = GlooReduceScatterBucketer(bucket_cap_mb=1)
    for chunks in inputs:  # three small inputs share one bucket
        bucketer.reduce_scatter_async(chunks, group=dist.group.WORLD, callback_fn=bucketed.append)
    assert not bucketed, "small inputs should wait in the bucket until it is flushed"
    bucketer.flush()
    out["reduce_scatter"] = (bucketed, plain)

    # Loss scaling: an inf in the last rank's gradients makes every rank skip the step and back off the scale.
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=4.0)
    scaler.scale(weight.sum()).backward()
    if rank == world_size - 1:
        weight.grad[0] = math.inf
    scaler.step(optimizer)
    scaler.update()
    out["scaler"] = (weight.detach().clone(), scaler.get_scale())
    return out


@pytest.fixture(scope="module")
def expected() -> dict[Any, Any]:
    return references()


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, expected: Any) -> list[Any]:
    directory: Path = tmp_path_factory.mktemp(f"ranks-{request.param}")
    return run_ranks(rank_checks, request.param, directory, expected)


@pytest.mark.parametrize(("optimizer", "flatten"), CASES)
@pytest.mark.workaround(7)
def test_consolidated_state_and_parameters_equal_plain_training(
    ranks: list[Any], expected: Any, optimizer: str, flatten: bool
) -> None:
    case = ranks[0][f"{optimizer}-{flatten}"]
    assert_optimizer_states_equal(case["consolidated"], expected[optimizer, flatten]["optimizer"])
    assert_tensors_equal(case["parameters"], expected[optimizer, flatten]["parameters"])
    assert_tensors_equal(case["loaded_parameters"], expected[optimizer, flatten]["parameters"])
    assert all(r[f"{optimizer}-{flatten}"]["consolidated"] == {} for r in ranks[1:])  # rank 0 only


@pytest.mark.parametrize(("optimizer", "flatten"), CASES)
def test_a_full_state_sharded_on_every_rank_consolidates_back(
    ranks: list[Any], expected: Any, optimizer: str, flatten: bool
) -> None:
    reloaded = ranks[0][f"{optimizer}-{flatten}"]["reloaded"]
    assert_optimizer_states_equal(reloaded, expected[optimizer, flatten]["optimizer"], atol=0)


@pytest.mark.parametrize(("optimizer", "flatten"), CASES)
def test_the_hand_built_shards_of_the_offline_tests_are_those_of_real_ranks(
    ranks: list[Any], optimizer: str, flatten: bool
) -> None:
    """``split_by_hand`` (FairScale's chunking rule) applied to one rank's state gives each real rank's state."""
    local = [r[f"{optimizer}-{flatten}"]["local"] for r in ranks]
    whole = {
        "state_dict": _unsharded_local_state(local),
        "shard_metadata": {**local[0]["metadata"], "param_metadata": _one_rank_metadata(local)},
    }
    whole["optimizer_states"], layout = (list(x) for x in zip(_unsharded_optimizer_state(local)))
    whole["optimizer_layouts"] = layout
    for rank, built in enumerate(split_by_hand(whole, len(ranks))):
        assert built["shard_metadata"] == local[rank]["metadata"]
        assert_tensors_equal(built["state_dict"], local[rank]["state_dict"], atol=0)
        assert_optimizer_states_equal(built["optimizer_states"][0], local[rank]["optimizer"], atol=0)
        assert [tuple(v) for v in built["optimizer_layouts"][0]["views"]] == local[rank]["layout"]["views"]


def _unsharded_local_state(local: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each rank's flat shards put together, padding dropped: what one rank would hold."""
    out = {}
    for unit in local[0]["metadata"]["param_metadata"]:
        for name, info in unit["params"].items():
            key = f"{unit['fsdp_path']}.{name}" if unit["fsdp_path"] else name
            out[key] = torch.cat([r["state_dict"][key] for r in local])[: sum(info["numels"])]
    return out


def _one_rank_metadata(local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    metadata = copy.deepcopy(local[0]["metadata"]["param_metadata"])
    for unit in metadata:
        for info in unit["params"].values():
            info["padding"] = 0
    return metadata


def _unsharded_optimizer_state(local: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each rank's optimizer state put together (the views of each original parameter, in rank order), and the
    layout one rank would have described: what one rank would hold."""
    units = local[0]["metadata"]["param_metadata"]
    params = [list(units[u]["params"].values())[i] for u, i in local[0]["layout"]["params"]]
    first = local[0]["optimizer"]
    state, views, groups = {}, [], []
    for group, order in zip(first["param_groups"], local[0]["layout"]["orders"]):
        indices = []
        for m, piece in order:
            parts = [
                r["optimizer"]["state"].get(j, {})
                for r in local
                for j, view in enumerate(r["layout"]["views"])
                if tuple(view[:2]) == (m, piece) and view[2] < view[3]  # an empty view holds no state
            ]
            if all(parts):
                state[len(views)] = {
                    key: torch.cat([part[key] for part in parts]) if value.dim() else value
                    for key, value in parts[0].items()
                }
            offset = sum(params[m]["numels"][:piece])
            indices.append(len(views))
            views.append((m, piece, offset, offset + params[m]["numels"][piece]))
        groups.append({**group, "params": indices})
    return {"state": state, "param_groups": groups}, {**local[0]["layout"], "views": views}


@pytest.mark.workaround(12)
def test_each_original_parameter_is_the_union_of_its_views_on_the_ranks(ranks: list[Any]) -> None:
    model = _views_model()
    expected = dict(model.named_parameters())
    for name, param in expected.items():
        views = [v for r in ranks for v in r["views"]["views"] if v[0] == name and v[2].numel()]
        parts = sorted((start, values) for _, start, values, _ in views)
        assert [start for start, _ in parts] == [sum(v.numel() for _, v in parts[:i]) for i in range(len(parts))]
        assert torch.equal(torch.cat([v for _, v in parts]), param.detach().reshape(-1)), name
        assert all(grad == param.requires_grad for r in ranks for n, _, _, grad in r["views"]["views"] if n == name)
    split = {n for r in ranks for n, start, _, _ in r["views"]["views"] if start > 0}
    assert split, "some parameter should cross a shard boundary"
    # The single-element unit: only rank 0 holds it; the others hold padding and an empty view of it, as torch FSDP's
    # original parameters outside a rank's shard.
    held = [[v.numel() for n, _, v, _ in r["views"]["views"] if n == "2.weight"] for r in ranks]
    assert held == [[1]] + [[0]] * (len(ranks) - 1)


@pytest.mark.workaround(11)
def test_adamw_groups_across_units_and_a_frozen_weight_equal_plain_training(ranks: list[Any]) -> None:
    model = _views_model()
    named = dict(model.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if n.endswith("weight")], "weight_decay": 0.5},
        {"params": [p for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0},
    ]
    plain = torch.optim.AdamW(groups, lr=0.1)
    x = torch.cat([r["views"]["inputs"] for r in ranks])
    ((model(x) ** 2).mean()).backward()
    plain.step()
    for r in ranks:
        assert_tensors_equal(r["views"]["parameters"], parameters_of(model))
    assert_optimizer_states_equal(ranks[0]["views"]["consolidated"], plain.state_dict())
    assert sorted(ranks[0]["views"]["consolidated"]["state"]) == sorted(plain.state_dict()["state"])


@pytest.mark.workaround(15)
def test_a_frozen_root_holds_only_its_shards_after_each_backward_and_trains_like_plain(ranks: list[Any]) -> None:
    for result in ranks:
        for held in result["frozen_root"]["held"]:
            assert held and all(data == own for data, own in held), held
    model = _frozen_root_model()
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    for batch in batches(2):
        step(model, plain, batch)
    for result in ranks:
        gathered = result["frozen_root"]["parameters"]
        assert not isinstance(gathered, str), f"unwrapping failed: {gathered}"
        assert_tensors_equal(gathered, parameters_of(model))


def test_the_norm_of_an_optimizer_that_some_ranks_hold_no_view_of_is_its_parameters_norm(ranks: list[Any]) -> None:
    model = _views_model()
    x = torch.cat([r["views"]["inputs"] for r in ranks])
    ((model(x) ** 2).mean()).backward()
    expected = model[2].weight.grad.norm()
    whole = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    for r in ranks:
        torch.testing.assert_close(r["views"]["lone_norm"], expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(r["views"]["model_norm"], whole, rtol=1e-6, atol=0)


@pytest.mark.workaround(4)
def test_clipping_by_norm_equals_torch_on_the_unsharded_gradients(ranks: list[Any], expected: Any) -> None:
    for result in ranks:
        torch.testing.assert_close(result["norm"], expected["norm"], rtol=1e-6, atol=0)
        assert_tensors_equal(result["clipped"], expected["clipped"])
    assert expected["norm"] > CLIP, "the clip value should bite"


def test_gradient_shards_do_not_pin_the_reduce_scatter_buckets(ranks: list[Any]) -> None:
    for result in ranks:
        assert len(result["grad_bytes"]) == 3
        assert all(storage == own for storage, own in result["grad_bytes"]), result["grad_bytes"]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.workaround(4)
def test_global_grad_norm_of_disjoint_shards_equals_torchs_norm_of_them_all(ranks: list[Any], norm_type: float) -> None:
    for rank, result in enumerate(ranks):
        total, expected_total, clipped, expected_clipped = result["norms"][norm_type]
        torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=0, msg=f"rank {rank}")
        for got, want in zip(clipped, expected_clipped):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"rank {rank}")


@pytest.mark.workaround(3)
def test_gloo_bucketer_reduces_like_a_plain_reduce_scatter(ranks: list[Any]) -> None:
    for result in ranks:
        bucketed, plain = result["reduce_scatter"]
        assert len(bucketed) == len(plain) == 3
        for got, want in zip(bucketed, plain):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.workaround(5)
def test_sharded_grad_scaler_skips_the_step_on_every_rank(ranks: list[Any]) -> None:
    for rank, result in enumerate(ranks):
        weight, scale = result["scaler"]
        assert torch.equal(weight, torch.ones(3)), f"rank {rank} stepped despite another rank's inf gradient"
        assert scale == 2.0, f"rank {rank} did not back off the scale"


#: Gatherings a prefetch serves in three steps and a no-grad forward of the deep model, by backward mode: in the
#: forward every block's but in the first forward (no order recorded yet): 3 x 5; in the backward of the first step
#: (no order recorded in its forward: nothing kept) every block's but the backward's first block's, 4 (BACKWARD_POST:
#: the synchronous backward holds no unit while the root's last layers compute), and with BACKWARD_PRE that one too,
#: gathered when the backward starts. From the second step on the forward's last block keeps its full parameters for
#: the backward (nothing to gather), and with BACKWARD_POST every other block too (all fit the tests' 1 MiB: nothing
#: at all to gather in the backward); BACKWARD_PRE gathers the 4 others.
SERVED = {"BACKWARD_POST": 3 * 5 + 4, "BACKWARD_PRE": 3 * 5 + 5 + 2 * 4, None: 3 * 5}


@pytest.mark.parametrize("mode", prefetch.BACKWARD_MODES)
@pytest.mark.workaround(16)
def test_cpu_units_overlap_their_collectives_and_train_as_synchronous_ones(ranks: list[Any], mode: Any) -> None:
    for rank, result in enumerate(ranks):
        checks = result["prefetch"]["modes"][mode]
        assert (checks["reducer"], result["prefetch"]["reducer_sync"]) == (
            "AsyncReduceScatter", "GlooReduceScatterBucketer"
        )
        served = (checks["seen"]["served"], result["prefetch"]["served_sync"])
        assert served == (SERVED[mode], 0), f"rank {rank}: {served}"
        assert not checks["seen"]["pending_after_no_grad_forward"], "a forward without gradients left a unit gathered"
        # Every all-gather of the units is an exchange; so is every reduce-scatter between 2 ranks (beyond, gloo's
        # reduce-scatter in pieces). The synchronous path is FairScale's own, by gloo's collectives.
        counts, exchanged = checks["seen"]["collectives"], checks["seen"]["exchanges"]
        assert counts["all_gather"] == exchanged["all_gather"] > 0, f"rank {rank}: {counts} {exchanged}"
        exchanged_reductions = counts["reduce_scatter"] if len(ranks) == 2 else 0
        assert exchanged.get("reduce_scatter", 0) == exchanged_reductions > 0 or len(ranks) > 2, exchanged
        assert result["prefetch"]["exchanges_sync"] == {}, "the synchronous path exchanged"
        overlapped, synchronous = checks["parameters"]
        assert overlapped.keys() == synchronous.keys()
        for name in overlapped:
            # Two ranks: each element is the sum of two terms, the same in any order: bit for bit. Three: gloo adds the
            # three terms in an order that depends on the buffer it reduces (one gradient, or a bucket of several),
            # so the results may differ in the last bit of some elements (3e-8 after 3 Adam steps here).
            if len(ranks) == 2:
                assert torch.equal(overlapped[name], synchronous[name]), f"rank {rank}: {name} differs"
            else:
                difference = (overlapped[name] - synchronous[name]).abs().max().item()
                assert difference <= 1e-7, f"rank {rank}: {name} differs by {difference}"


@pytest.mark.parametrize(("mode", "in_backward"), [("BACKWARD_POST", 5), ("BACKWARD_PRE", 2), (None, 1)])
@pytest.mark.workaround(16)
def test_the_backward_holds_other_units_full_parameters_only_as_its_prefetch_mode_says(
    ranks: list[Any], mode: Any, in_backward: int
) -> None:
    """The most blocks holding full parameters in the backward: with BACKWARD_PRE two (the one computing, the one
    arriving); with BACKWARD_POST all five, which the forward kept for the backward (its last block, and the four
    before it, which fit in the tests' 1 MiB); without prefetch one."""
    for rank, result in enumerate(ranks):
        seen = result["prefetch"]["modes"][mode]["seen"]
        assert max(seen["holding_backward"]) == in_backward, f"rank {rank}: {seen['holding_backward']}"


def test_the_post_mode_gathers_ahead_in_the_backward_what_fits_the_bucket_beside_the_gradients(
    ranks: list[Any],
) -> None:
    """BACKWARD_POST's look-ahead in the backward: at each layer's backward the blocks held ahead of it (kept by the
    forward or gathered ahead) and the gradients in flight fit in ``bucket_cap_mb`` together (two and a half blocks'
    worth: two blocks beside the one computing, or one and gradients), and some were held ahead; without a budget
    nothing beyond what the synchronous backward holds (one block at a time, its own). The forward keeps, beside its
    last block, the blocks before it that fit the budget: with two and a half blocks' worth two more (from the second
    step on the backward gathers 2 blocks a step instead of 4), with the tests' 1 MiB all (none; :data:`SERVED`),
    without a budget none more (4 a step, each served by a prefetch)."""
    for rank, result in enumerate(ranks):
        backward = result["prefetch"]["backward"]
        holding, reducing = backward["none"]
        assert max(holding) == 1 and max(ahead for _, _, ahead in reducing) == 0, f"rank {rank}: {backward['none']}"
        forward = 3 * 5
        assert backward["served"] == {"none": forward + 3 * 4, "2.5 blocks": forward + 4 + 2 * 2}, f"rank {rank}"
        holding, reducing = backward["2.5 blocks"]
        assert holding[-5:] == [3, 2, 1, 1, 1], f"rank {rank}: {holding}"
        assert max(grads + ahead for _, grads, ahead in reducing) <= backward["budget"], f"rank {rank}: {reducing}"
        assert max(ahead for _, _, ahead in reducing) > 0, f"rank {rank}: nothing gathered ahead: {reducing}"


def test_what_the_post_mode_counts_against_the_budget_is_what_the_units_held_ahead_hold(ranks: list[Any]) -> None:
    """At every layer's backward, the bytes the prefetcher counts against ``bucket_cap_mb`` for the units held ahead
    of the one about to compute (kept by the forward, or gathered ahead) are the bytes those units' full parameters
    hold: a kept unit whose backward freed them counts no more (with the tests' 1 MiB every block is kept; with two
    and a half blocks' worth, some are kept and some gathered ahead)."""
    for rank, result in enumerate(ranks):
        for budget, accounted in result["prefetch"]["backward"]["accounted"].items():
            assert accounted, f"rank {rank}: no backward seen with {budget}"
            assert any(held for _, held in accounted), f"rank {rank}: nothing held ahead with {budget}: {accounted}"
            assert all(counted == held for counted, held in accounted), f"rank {rank}, {budget}: {accounted}"


@pytest.mark.workaround(16)
def test_the_forward_gathers_ahead_the_units_that_fit_the_bucket_at_its_start(ranks: list[Any]) -> None:
    """Once the root's parameters are gathered, the blocks ahead are on their way while their full parameters fit in
    ``bucket_cap_mb`` together (all five in the tests' 1 MiB, two in two and a half blocks' worth), and at least the
    next one (without a budget the next one only: the one computing and the one arriving, two at most); under
    SHARD_GRAD_OP all five within any budget (they hold them until the backward either way), the next one without.
    The first forward has no recorded order: nothing ahead."""
    expected = {"none": [0, 1, 1, 1], "2.5 blocks": [0, 2, 2, 2], "zero2 none": [0, 1, 1, 1],
                "zero2 2.5 blocks": [0, 5, 5, 5]}  # fmt: skip
    for rank, result in enumerate(ranks):
        ahead = result["prefetch"]["ahead"]
        assert ahead == expected, f"rank {rank}: {ahead}"
        assert result["prefetch"]["most_holding_without_budget"] == 2, f"rank {rank}"
        default = result["prefetch"]["modes"]["BACKWARD_POST"]["seen"]["at_forward_start"]
        assert default == [0, 5, 5, 5], f"rank {rank}: {default}"


@pytest.mark.parametrize("mode", prefetch.BACKWARD_MODES)
@pytest.mark.workaround(20)
def test_each_units_post_backward_hook_runs_once_a_step_not_once_more_every_step(ranks: list[Any], mode: Any) -> None:
    """Workaround 20: FairScale added one more hook to each accumulator every forward (1, 2, 3... calls a step)."""
    for rank, result in enumerate(ranks):
        calls = result["prefetch"]["modes"][mode]["seen"]["hook_calls"]
        assert calls == [6, 6, 6], f"rank {rank}: {calls} (the root and five blocks, one flat parameter each)"


def test_mixed_precision_units_are_gathered_ahead_and_train_as_synchronous_ones(ranks: list[Any]) -> None:
    for rank, result in enumerate(ranks):
        mixed = result["prefetch"]["mixed"]
        assert mixed["served"] == SERVED["BACKWARD_POST"], f"rank {rank}: {mixed['served']}"
        overlapped, synchronous = mixed["parameters"]
        assert overlapped.keys() == synchronous.keys()
        for name in overlapped:
            if len(ranks) == 2:  # three ranks: bf16 sums of three terms in a buffer-dependent order
                assert torch.equal(overlapped[name], synchronous[name]), f"rank {rank}: {name} differs"


def test_the_forward_keeps_the_tail_of_its_units_that_fits_the_budget_not_any_unit_that_fits(
    ranks: list[Any],
) -> None:
    """Blocks small, big, middle, middle (:data:`TAIL_HIDDEN`), a budget of a middle block and one and a half small
    ones: from the second step on the forward keeps its last block (always) and the middle one before it, not the big
    one before that (the tail stops at the first unit that does not fit), nor the small first one, which would fit
    but is not in the tail (the backward would not need it until its end). The same parameters as synchronous
    collectives'."""
    for rank, result in enumerate(ranks):
        tail = result["prefetch"]["tail"]
        assert tail[True]["kept"] == [[], [2, 3], [2, 3]], f"rank {rank}: {tail[True]['kept']}"
        assert tail[False]["kept"] == [[], [], []]
        for name, value in tail[True]["parameters"].items():
            want = tail[False]["parameters"][name]
            if len(ranks) == 2:
                assert torch.equal(value, want), f"rank {rank}: {name}"
            else:  # gloo adds three ranks' terms in an order that depends on the buffer: within the last bit
                torch.testing.assert_close(value, want, rtol=2.4e-7, atol=1e-7)


def test_full_parameters_kept_for_a_backward_that_did_not_come_are_never_read_after_the_shards_change(
    ranks: list[Any],
) -> None:
    """The forward keeps its units' full parameters for the backward (all five blocks in the tests' 1 MiB); without
    a backward, an optimizer step changes the shards under them: ``summon_full_params``, or the next forward and the
    step after it, see the new shards, as with synchronous collectives (which keep nothing)."""

    def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        if len(ranks) == 2:
            assert torch.equal(got, want), what
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=what)

    for rank, result in enumerate(ranks):
        for then in ("forward", "summon"):
            overlapped, synchronous = (result["prefetch"]["kept_then_stepped"][o, then] for o in (True, False))
            assert (overlapped["kept"], synchronous["kept"]) == (5, 0), f"rank {rank}"
            assert overlapped["parameters"].keys() == synchronous["parameters"].keys()
            for name, value in overlapped["parameters"].items():
                assert_same(value, synchronous["parameters"][name], f"rank {rank}, then {then}: {name}")
            if then == "forward":
                assert_same(overlapped["output"], synchronous["output"], f"rank {rank}: the output")


def test_the_post_mode_computes_a_backward_beside_no_more_gradients_than_the_bucket_holds(ranks: list[Any]) -> None:
    """The memory of BACKWARD_POST (the default) is the synchronous backward's: while a layer's backward computes,
    be it a block's or the root's first layer (whose unit keeps its full parameters), also under SHARD_GRAD_OP (every
    unit keeps them), the gradients in flight fit in the reduce-scatter bucket the synchronous path would hold
    (``bucket_cap_mb``: 1 MiB in these tests, none at 0), together with the blocks gathered ahead of it;
    BACKWARD_PRE overlaps one reduction whatever its size;
    without prefetch each is waited for at once."""
    for rank, result in enumerate(ranks):
        checks = result["prefetch"]
        reducing = {mode: checks["modes"][mode]["seen"]["reducing"] for mode in prefetch.BACKWARD_MODES}
        post, pre, none = reducing["BACKWARD_POST"], reducing["BACKWARD_PRE"], reducing[None]
        assert len(post) == 3 * 6, "every block's and the first layer's backward, each step"
        assert max(b + a for _, b, a in post) <= 2**20 and max(n for n, _, _ in post) >= 1, f"rank {rank}: {post}"
        assert max(n for n, _, _ in none) == 0 and max(n for n, _, _ in pre) == 1, f"rank {rank}: {reducing}"
        for name in ("no_budget_reducing", "zero2_reducing"):
            counts = [n for n, _, _ in checks[name]]
            assert len(counts) == 3 * 6 and max(counts) == 0, f"rank {rank}: {name}: {checks[name]}"


def test_async_reducer_reduces_like_plain_reduce_scatters_one_at_a_time(ranks: list[Any]) -> None:
    for result in ranks:
        reduced, plain, done_before_flush = result["prefetch"]["async_reduce_scatter"]
        assert done_before_flush == [0, 1, 2], "each new reduction first completes the one in flight"
        assert len(reduced) == len(plain) == 3
        # Two ranks: bit for bit. Three: gloo adds the three terms in an order that depends on the buffer it reduces
        # (the whole gradient, or a piece of it), so the last bit of an element may differ.
        rtol = 0.0 if len(ranks) == 2 else 2**-22
        for got, want in zip(reduced, plain):
            torch.testing.assert_close(got, want, rtol=rtol, atol=0)


def test_exchanges_gather_and_reduce_as_gloos_collectives_with_both_in_flight(ranks: list[Any]) -> None:
    for result in ranks:
        gathered, expected = result["prefetch"]["exchanges"]["gathered"]
        assert torch.equal(gathered, expected)
        reduced, in_rank_order, plain = result["prefetch"]["exchanges"]["reduced"]
        assert torch.equal(reduced, in_rank_order)  # the ranks' terms added in rank order
        # gloo adds them in an order of its own: the same bits on 2 ranks (a sum of two terms), a last bit apart on 3
        torch.testing.assert_close(reduced, plain, rtol=0, atol=0 if len(ranks) == 2 else 2**-21)


def test_every_exchange_that_a_stuck_peer_fails_is_taken_for_a_lost_rank(ranks: list[Any]) -> None:
    """The first wait times out; the other exchange in flight then fails with "pair closure", which must also be
    taken for a lost rank, or the run fails without naming it and leaves the stuck rank behind."""
    errors = ranks[0]["prefetch"]["exchanges"]["stuck_peer"]
    assert len(errors) == 2, errors
    assert "Timed out" in errors[0][0] and "pair closure" in errors[1][0], errors
    assert all(taken for _, taken in errors), errors
    assert all(result["prefetch"]["exchanges"]["stuck_peer"] == [] for result in ranks[1:])
