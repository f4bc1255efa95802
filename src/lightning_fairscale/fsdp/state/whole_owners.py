"""Who steps each parameter of an optimizer on the whole path: an owner rank per original parameter.

On the whole path (:mod:`~lightning_fairscale.fsdp.state.optimizer_paths`) every original parameter an optimizer holds
is stepped, as the whole tensor it is, by one rank: its **owner**, one of the ranks whose shard holds part of it.
:func:`assign_owners` balances them: the largest first, each to the candidate with the fewest elements so far (the
lowest rank on a tie), which every rank computes alike from what every rank knows (the parameters' sizes and where
FairScale's shards cut them). A parameter inside one rank's shard is owned by that rank and moves nothing. Under
hybrid sharding the owners are ranks of the shard group: every replica repeats the same plan on its own shards.

:class:`WholePlan` is the result for one optimizer on this rank: for each of its original parameters, this rank's view
of it, which ranks hold which part (:class:`Span`), and its owner. The step itself is
:mod:`~lightning_fairscale.fsdp.state.whole_step`'s; the checkpoints of its state,
:mod:`~lightning_fairscale.fsdp.state.whole_state`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_fairscale.fsdp.state.optim import GroupOrder, ParameterLayout, managed_params
from lightning_fairscale.fsdp.state.resharding import flat_numel, owned_range
from lightning_fairscale.fsdp.unit.param_views import ParamView

__all__ = ["Span", "WholePiece", "WholePlan", "assign_owners", "make_plan", "spans_of"]


@dataclass(frozen=True)
class Span:
    """Rank ``rank`` of the shard group holds elements ``[lo, hi)`` of the (flattened) original parameter."""

    rank: int
    lo: int
    hi: int


@dataclass(eq=False)
class WholePiece:
    """One original parameter of the optimizer: ``(m, piece)`` (the ``m``-th managed parameter as checkpoints number
    them, its ``piece``-th original parameter), this rank's view of it, its shape, which ranks hold which part of
    it, and its owner."""

    m: int
    piece: int
    view: ParamView
    shape: torch.Size
    spans: tuple[Span, ...]
    owner: int
    #: Trainable when the optimizer was set up (a frozen one is not counted in the balance; it is stepped if it trains
    #: later, by its owner like any other).
    trainable: bool = True

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def span_of(self, rank: int) -> Optional[Span]:
        """The part of it that ``rank`` holds, ``None`` when it holds none."""
        for span in self.spans:
            if span.rank == rank:
                return span
        return None

    def inside(self, rank: int) -> bool:
        """Whether ``rank`` holds all of it (nothing to move when it is the owner)."""
        span = self.span_of(rank)
        return span is not None and span.hi - span.lo == self.numel


@dataclass
class WholePlan:
    """The whole path of one optimizer on this rank (rank ``rank`` of ``world`` in the shard group ``group``)."""

    rank: int
    world: int
    group: Optional[ProcessGroup]
    #: Every original parameter the optimizer holds, ordered by ``(m, piece)``: the same on every rank.
    pieces: list[WholePiece]
    _by_param: dict[int, WholePiece] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_param = {id(p.view.param): p for p in self.pieces}

    def of(self, param: torch.nn.Parameter) -> Optional[WholePiece]:
        """The piece whose view ``param`` is (``None``: not one of the optimizer's)."""
        return self._by_param.get(id(param))

    def owned(self) -> list[WholePiece]:
        """The pieces this rank owns (steps, and keeps the state of)."""
        return [p for p in self.pieces if p.owner == self.rank]

    def peers(self) -> list[int]:
        """The other ranks of the shard group."""
        return [r for r in range(self.world) if r != self.rank]

    def describe(self) -> dict[str, Any]:
        """What a sharded checkpoint records of the plan: the ``(m, piece)`` this rank owns (its whole-shaped state
        is that parameter's)."""
        return {"path": "whole", "owned": [(p.m, p.piece) for p in self.owned()]}


def assign_owners(sizes: Sequence[tuple[int, Sequence[int]]], counted: Optional[Sequence[bool]] = None) -> list[int]:
    """An owner for each ``(numel, candidate ranks)``: the largest first (the first listed on a tie), each to the
    candidate with the fewest elements assigned so far (the lowest rank on a tie). ``counted[i]`` false: item ``i``
    is assigned after the others and adds nothing to the balance (a frozen parameter).

    Example:
        >>> assign_owners([(10, [0, 1]), (6, [0]), (5, [1]), (4, [0, 1])])
        [0, 0, 1, 1]
    """
    counted = counted if counted is not None else [True] * len(sizes)
    load: dict[int, int] = {}
    owners = [-1] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: (not counted[i], -sizes[i][0], i))
    for i in order:
        numel, candidates = sizes[i]
        owner = min(candidates or [0], key=lambda r: (load.get(r, 0), r))
        owners[i] = owner
        if counted[i]:
            load[owner] = load.get(owner, 0) + numel
    return owners


def spans_of(offset: int, numel: int, flat: int, world: int, sharded: bool, rank: int) -> tuple[Span, ...]:
    """Which ranks hold which part of the original parameter at ``[offset, offset + numel)`` of a managed parameter
    of ``flat`` real elements sharded over ``world`` ranks as FairScale shards it (``sharded`` false: not sharded,
    this rank holds it all).

    Example:
        >>> spans_of(3, 6, 10, 2, True, 0)  # shards [0, 5) and [5, 10)
        (Span(rank=0, lo=0, hi=2), Span(rank=1, lo=2, hi=6))
    """
    if not sharded:
        return (Span(rank, 0, numel),)
    spans = []
    for r in range(world):
        start, stop, _ = owned_range(flat, r, world)
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo < hi:
            spans.append(Span(r, lo - offset, hi - offset))
    return tuple(spans)


def make_plan(optimizer: Optimizer, layout: ParameterLayout, orders: GroupOrder) -> WholePlan:
    """The whole path of ``optimizer`` (re-pointed to ``layout``'s views, its state saved in ``orders``)."""
    params = managed_params(orders)
    position = {id(param): m for m, param in enumerate(params)}
    found: dict[tuple[int, int], tuple[ParamView, torch.nn.Parameter]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            managed, view = layout.view_of(param)
            found[(position[id(managed)], view.piece)] = (view, managed)
    rank, world, group_ = 0, 1, None
    described: list[tuple[int, int, ParamView, torch.Size, tuple[Span, ...], bool]] = []
    for (m, k), (view, managed) in sorted(found.items()):
        unit = layout.managed[managed].unit
        rank, world, group_ = unit.rank, unit.world_size, unit.process_group
        piece = layout.managed[managed].pieces[k]
        sharded = bool(getattr(managed, "_is_sharded", False))
        spans = spans_of(piece.offset, piece.numel, flat_numel(managed), world, sharded, rank)
        described.append((m, k, view, piece.shape, spans, piece.trainable))
    owners = assign_owners(
        [(shape.numel(), [s.rank for s in spans]) for _, _, _, shape, spans, _ in described],
        [trainable for *_, trainable in described],
    )
    pieces = [
        WholePiece(m, k, view, shape, spans, owner, trainable)
        for (m, k, view, shape, spans, trainable), owner in zip(described, owners)
    ]
    return WholePlan(rank, world, group_, pieces)
