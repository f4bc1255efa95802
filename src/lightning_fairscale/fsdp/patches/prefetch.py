"""Overlapping FairScale's collectives with the computation on CPU (gloo): workaround 16 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`; here, the gathers ahead.

FairScale overlaps its all-gathers and reduce-scatters with the computation on CUDA streams. On a CPU there are no
streams (:mod:`~lightning_fairscale.fsdp.patches.cpu_streams` makes them no-ops), so every collective ran
synchronously: a unit's forward or backward waited for its own all-gather, and each reduce-scatter bucket for its
flush. gloo runs asynchronous work on threads of its own; two objects use it, for the units of a root on CPU,
through the exchanges of :mod:`~lightning_fairscale.distributed.exchanges` (point-to-point messages straight from and
into the tensors, which take a fraction of the time of gloo's own collectives), made together by :func:`overlap`:

* :class:`Prefetcher` starts the all-gather of the units that come next as asynchronous gloo work, so that they wait
  for it instead of gathering. In the forward, while the current unit computes: the units after it, as many as fit
  in the reduce-scatter bucket's ``bucket_cap_mb`` together (and at least the next one), started before the current
  one is waited for, so that the ranks meet once for all of them (a window that moves along the forward: with the
  default 25 MB a small model's units all fit, and are gathered at the forward's start; a unit larger than the
  budget is gathered one ahead, as before). In the backward, as
  the ``backward_prefetch`` mode says (:data:`BACKWARD_MODES`, torch's names): ``"BACKWARD_POST"`` (the default)
  when the current unit's gradient is done, alongside its reduce-scatter, and with it the units before it whose full
  parameters fit, beside the gradients still reducing, in ``bucket_cap_mb`` (the memory of the synchronous
  backward's reduce-scatter bucket): the same window as the forward's, but never a unit beyond the one the
  synchronous backward gathers then, unless it fits. The units it would gather at the backward's start are not
  freed at all: the forward's last units keep their full parameters for their backward, the last one (the
  backward's first, unless a unit is still on its way) and the ones before it that fit in the same budget
  (:meth:`Prefetcher.keeps`; a small model's units all fit: its backward gathers nothing, as under
  ``SHARD_GRAD_OP``). While a layer computes, whatever reduces, arrives or is kept beyond its own unit's full
  parameters and the forward's last unit's holds at most ``bucket_cap_mb``: the backward's peak is at most that
  above the synchronous one's (whose reduce-scatter bucket holds up to as much, for gradients smaller than it),
  and the same for units larger than the budget, which are neither gathered ahead nor kept but the last
  (unlike torch's ``BACKWARD_POST`` on GPUs, whose reduce-scatter overlaps the next unit's computation whatever
  its size);
  ``"BACKWARD_PRE"`` the unit before the current one, before the current unit's backward, overlapping it with the
  computation, and the reduce-scatter in flight while the next unit computes, at the cost of about a unit's full
  parameters and a gradient more (two units' full parameters at most: the one computing, the one arriving, plus
  the root's);
  ``None``: the backward's collectives are synchronous. A unit that nothing gathered ahead (the root,
  the forward's first unit) is gathered by an exchange when FairScale would gather it.
  Units that keep their shards elsewhere or share parameters are gathered by FairScale, synchronously
  (:func:`can_prefetch`).
* :class:`~lightning_fairscale.fsdp.patches.reduce_scatter.AsyncReduceScatter` (a module of its own: it knows no
  units, only the reductions it is given) replaces the reduce-scatter bucketer: each unit's gradient is
  reduce-scattered asynchronously, straight from the gradient; how many reductions are in flight the backward mode
  says (:func:`overlap`), and in the ``"BACKWARD_POST"`` mode the :class:`Prefetcher` says when they are waited for.

The results are the same bits as the synchronous collectives' on two ranks (each element of a sum of two terms is the
same in any order): the same values on the same tensors, only started earlier and waited for later. The order of
collectives and exchanges on each process group is the same on every rank (it follows the model's forward order,
recorded in the previous forward), as gloo requires. The CUDA path does not use them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.distributed import exchanges
from lightning_fairscale.distributed.torch_private import in_backward
from lightning_fairscale.fsdp.patches.reduce_scatter import AsyncReduceScatter

__all__ = [
    "BACKWARD_MODES",
    "OVERLAP_ON_CPU",
    "Prefetcher",
    "can_prefetch",
    "in_backward",
    "overlap",
]

#: Whether roots set up on CPU from now on overlap their collectives (``False``: FairScale's synchronous collectives
#: and reduce-scatter buckets, as before; for comparisons, ``benchmarks/speed.py``).
OVERLAP_ON_CPU = True

#: When the backward gathers the next unit, by torch's ``BackwardPrefetch`` names: ``"BACKWARD_POST"`` when the current
#: unit's gradient is done, ``"BACKWARD_PRE"`` before its backward computes, ``None`` never.
BACKWARD_MODES = ("BACKWARD_POST", "BACKWARD_PRE", None)


def _holds_storage(tensor: Tensor) -> bool:
    return tensor.untyped_storage().size() > 0


def _alloc_storage(tensor: Tensor) -> None:
    """Give ``tensor`` (whose storage FairScale resized to 0) its full storage back."""
    if not _holds_storage(tensor):
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


def can_prefetch(unit: _FairScaleFSDP) -> bool:
    """Whether ``unit``'s full parameters can be gathered ahead: a unit that computes on CPU over gloo, whose
    parameters are all sharded and its own (what FairScale's ``_rebuild_full_params`` then does is one all-gather per
    parameter into ``_full_param_padded``, of the shard cast to the compute dtype under mixed precision, which this
    module does asynchronously)."""
    if unit.compute_device.type != "cpu" or unit.move_params_to_cpu:
        return False
    if unit._has_shared_params or not unit.params or not _over_gloo(unit):
        return False
    return all(getattr(p, "_is_sharded", False) and hasattr(p, "_full_param_padded") for p in unit.params)


def _over_gloo(unit: _FairScaleFSDP) -> bool:
    """Whether ``unit`` gathers over a gloo group (asked at every gather: torch's answer is a lookup in its map of
    groups, and nothing of ours is cached in the unit, which may be FairScale's own class)."""
    return exchanges.is_gloo(unit.process_group)


def overlap(backward_prefetch: Optional[str], bucket_cap_mb: float) -> tuple[AsyncReduceScatter, "Prefetcher"]:
    """The reducer and the prefetcher of a root on CPU (gloo) for its ``backward_prefetch`` mode
    (:data:`BACKWARD_MODES`): without prefetch in the backward each reduction is waited for at once,
    ``"BACKWARD_PRE"`` keeps one in flight, ``"BACKWARD_POST"`` as many as its prefetcher lets go on (within the
    ``bucket_cap_mb`` bucket the reducer replaces: see :meth:`Prefetcher.after_post_backward`)."""
    max_in_flight = {None: 0, "BACKWARD_PRE": 1}.get(backward_prefetch, sys.maxsize)
    reducer = AsyncReduceScatter(max_in_flight, budget_bytes=max(0, int(bucket_cap_mb * 2**20)))
    return reducer, Prefetcher(reducer, backward_prefetch)


class Prefetcher:
    """Gathers the next units' full parameters ahead (one per root, shared by its units).

    The units call :meth:`rebuild` instead of FairScale's ``_rebuild_full_params`` (forward and backward),
    :meth:`after_post_backward` after their post-backward hook, :meth:`settle` and :meth:`freed` before and after
    they free their full parameters; the root calls :meth:`forward_started` / :meth:`forward_ended` around its forward,
    :meth:`backward_started` when its backward begins and :meth:`pass_ended` when it ends: whatever was gathered
    ahead and not used by then (a forward that took another path) is dropped, so that no copy gathered ahead
    outlives a pass, in which the optimizer cannot have changed the shards. What a forward kept for its backward
    (:meth:`keeps`) is dropped when the backward ends, or at the next root forward or ``summon_full_params`` if no
    backward came.

    Args:
        reducer: the root's reducer, whose reductions the ``"BACKWARD_POST"`` mode finishes before a layer computes.
        backward: when the backward gathers ahead, one of :data:`BACKWARD_MODES` (torch's ``BackwardPrefetch``
            names).
    """

    def __init__(self, reducer: AsyncReduceScatter, backward: Optional[str] = "BACKWARD_POST") -> None:
        if backward not in BACKWARD_MODES:
            raise ValueError(f"backward must be one of {BACKWARD_MODES}, not {backward!r}")
        self.reducer = reducer
        self.backward = backward
        #: How many bytes of full parameters the units on their way may hold together, beside the gradients in
        #: flight (in the forward the next unit is gathered ahead even if larger; in the backward the one the
        #: synchronous backward gathers then): the reducer's budget (``bucket_cap_mb``). ``0`` (or less): only
        #: those, whatever their cost (``benchmarks/speed.py`` compares the two).
        self.ahead_budget = reducer.budget_bytes
        #: The units in the order of their first gathering in the last complete root forward (``_positions``: where).
        self.order: list[Any] = []
        self._positions: dict[Any, int] = {}
        self._recording: Optional[list[Any]] = None
        #: The units gathered ahead, in the order they started (a module is its own key: identity), each with its
        #: exchanges' handles, the shards they read (in the compute dtype) and what it costs (:func:`_ahead_bytes`).
        self._pending: dict[Any, tuple[list[Any], list[Tensor], int]] = {}
        #: The units this forward may keep (:meth:`_tail_to_keep`), each with its cost against :attr:`ahead_budget`.
        self._to_keep: dict[Any, int] = {}
        #: The units of :attr:`_to_keep` whose forward kept their full parameters for their backward (:meth:`keeps`)
        #: and hold them still (:meth:`freed`); emptied (:meth:`release_kept`) before :attr:`_to_keep` is planned again.
        self._kept: set[Any] = set()
        #: Called before the gathers a forward starts (the ranks' check that they run the same units), if set.
        self.before_gathers: Optional[Callable[[], None]] = None

    def forward_started(self) -> None:
        """The root's forward begins (not a recomputation inside a backward): record the order of the units, and
        plan which of them to keep for the backward."""
        self.release_kept()
        self.pass_ended()
        self._recording = [] if not in_backward() else None
        self._to_keep = self._tail_to_keep() if self._recording is not None else {}

    def _tail_to_keep(self) -> dict[Any, int]:
        """The last units of the recorded order that a forward may keep for its backward, with their cost: the last one
        (nothing: the backward gathers it first, at once) and, in the ``"BACKWARD_POST"`` mode, the ones before it as
        long as they fit in :attr:`ahead_budget` together (the backward's look-ahead would gather them as it starts,
        within the same budget)."""
        if not self.order:
            return {}
        tail, spent = {self.order[-1]: 0}, 0
        if self.backward == "BACKWARD_POST" and self.ahead_budget > 0:
            for unit in reversed(self.order[:-1]):
                cost = _ahead_bytes(unit)
                if spent + cost > self.ahead_budget:
                    break
                tail[unit], spent = cost, spent + cost
        return tail

    def forward_ended(self) -> None:
        """The root's forward ended: its recorded order is the one to prefetch in (unless a unit ran twice); what
        was gathered ahead and not used is dropped."""
        if self._recording is not None:
            unique = len({id(u) for u in self._recording}) == len(self._recording)
            self.order = self._recording if unique else []
            self._positions = {unit: index for index, unit in enumerate(self.order)}
            self._recording = None
        self.pass_ended()

    def forget_order(self) -> None:
        """The ranks' forwards ran different units: the order recorded (or recording) is not every rank's; the next
        forward records it again, gathering nothing ahead until then."""
        self.order, self._positions, self._recording = [], {}, None

    def backward_started(self) -> None:
        """The root's backward begins: in the ``"BACKWARD_PRE"`` mode the backward's first unit (the forward's last)
        starts gathering while the root's last layers compute their gradients. In the ``"BACKWARD_POST"`` mode, if
        the forward's last unit kept its full parameters (:meth:`keeps`), the units before it that fit in
        :attr:`ahead_budget` beside the others kept start gathering (none if the next one alone does not fit: the
        synchronous backward holds no other unit's full parameters while the first computes)."""
        if self.backward == "BACKWARD_PRE" and self.order and not self._pending:
            self._start(self.order[-1])
        elif self.backward == "BACKWARD_POST" and self.order and self.order[-1] in self._kept:
            self._start_window(self.order[-2::-1], at_least_first=False)

    def keeps(self, unit: _FairScaleFSDP) -> bool:
        """Whether ``unit``'s forward, ending, keeps its full parameters for its backward instead of freeing them, in
        a root forward with gradients (a backward is expected, which would gather the same shards again at once):
        the units of the recorded order's tail (:meth:`_tail_to_keep`), the last one if no unit is on its way, the
        others if they fit in :attr:`ahead_budget` beside the units kept and gathered ahead at that moment (but the
        next one, which computes next). The backward's look-ahead would hold them as it starts within the same
        budget; their post-backward hook frees them as always, and :meth:`release_kept` does if no backward came (at
        the next root forward, a state dict, or the end of the backward for a unit it did not reach)."""
        keep = (
            self._recording is not None
            and unit in self._to_keep
            and torch.is_grad_enabled()
            and not in_backward()
            and can_prefetch(unit)
        )
        if not keep:
            return False
        cost = self._to_keep[unit]
        if self.order[-1] is unit:
            keep = not self._pending
        else:
            # Beside what the next unit holds as it computes (the synchronous path holds it then too).
            coming = self.order[self._positions[unit] + 1]
            keep = self._held_beside(coming) + cost <= self.ahead_budget
        if keep:
            self._kept.add(unit)
        return keep

    def freed(self, unit: _FairScaleFSDP) -> None:
        """``unit`` freed its full parameters (some or all): what its forward kept is gone."""
        self._kept.discard(unit)

    def release_kept(self) -> None:
        """Free the full parameters :meth:`keeps` kept, if their backward has not freed them."""
        kept, self._kept = self._kept, set()
        for unit in kept:
            if unit.has_full_params:
                unit._free_full_params()
                unit._use_fp32_param_shard()

    def pass_ended(self) -> None:
        """Drop what was gathered ahead and not used (wait for it first: gloo may still be writing into it)."""
        while self._pending:
            unit = next(iter(self._pending))
            self.settle(unit)
            unit._free_full_params()

    def settle(self, unit: _FairScaleFSDP) -> bool:
        """Wait for ``unit``'s prefetched all-gathers, if any; then its full parameters are complete. Returns
        whether there were any."""
        if unit not in self._pending:
            return False
        works = self._pending.pop(unit)[0]
        for work in works:
            work.wait()
        unit.has_full_params = True
        return True

    def rebuild(self, unit: _FairScaleFSDP, rebuild: Callable[[], Any]) -> Any:
        """FairScale's ``rebuild()`` of ``unit``'s full parameters, from its prefetched all-gathers if there are
        any. In the forward, the units ahead start gathering first (:meth:`_start_next`); in the backward's
        ``"BACKWARD_PRE"`` mode the unit before it once its parameters are there."""
        backward = in_backward()
        if self._recording is not None and not backward:
            self._recording.append(unit)
        if backward and self.backward == "BACKWARD_POST":
            # The gradients reduced while this unit was gathered are freed before the unit computes, but what fits the
            # synchronous path's bucket beside the units gathered ahead of it.
            self._settle_beside(unit)
        # A unit nobody gathered ahead (the root, the forward's first unit) is gathered now, by exchanges, where
        # FairScale would gather it by gloo's slower all-gather. In the forward the units ahead start gathering before
        # it is waited for: the ranks meet once for all of them.
        self._start(unit)
        if not backward:
            self._start_next(unit, backward)
        self.settle(unit)
        result = rebuild()  # with the parameters gathered, FairScale only points them at the full ones
        if backward and self.backward == "BACKWARD_PRE":
            self._start_next(unit, backward)
        return result

    def after_post_backward(self, unit: _FairScaleFSDP) -> None:
        """``unit``'s post-backward hook has run for one of its parameters (and started its reduce-scatter). In the
        ``"BACKWARD_POST"`` mode, once the unit holds no full parameters, the unit before it starts gathering (if it
        is not on its way already), alongside the reduce-scatter, and the ones before that which fit the budget
        (:meth:`_start_next`); the reductions are waited for before that unit computes (:meth:`rebuild`), but what
        fits the reducer's ``budget_bytes`` beside the units gathered ahead of it or kept. When the unit before it is
        not on its way (it holds its full parameters: kept by the forward, or the root, or a unit of
        ``SHARD_GRAD_OP``, or an outer unit whose own layers go on; or it cannot be gathered ahead), the reductions
        are waited for now, down to what fits ``budget_bytes`` beside the units gathered ahead and kept (but the
        unit before it, which computes next). Either way, while a layer computes, the gradients in flight and the full
        parameters of the units held ahead of it (but the forward's last) hold no more than ``budget_bytes``. While a
        parameter of this unit still computes (a unit of several parameters), nothing happens: its last parameter's
        hook decides. (A unit whose parameters are all frozen has no post-backward hook: the unit before it is
        gathered by FairScale, synchronously.)"""
        if self.backward != "BACKWARD_POST" or _still_gathered(unit):
            return
        if not self._start_next(unit, backward=True):
            index = self._positions.get(unit)
            self._settle_beside(self.order[index - 1] if index else None)  # the unit whose layers compute next

    def _start_next(self, unit: _FairScaleFSDP, backward: bool) -> bool:
        """Start gathering the units the pass meets after ``unit`` (the last forward's order; reversed in a
        backward); whether the first of them is on its way. In the forward, the units after it; in the backward's
        ``"BACKWARD_POST"`` mode (``unit``'s gradient is done, its full parameters freed), the units before it:
        each time as many as fit in :attr:`ahead_budget` (:meth:`_start_window`). In the ``"BACKWARD_PRE"`` mode,
        the unit before it, if no other is on its way."""
        index = self._positions.get(unit)
        if index is None:
            return False
        if not backward:
            return self._start_window(self.order[index + 1 :], computing=unit)
        if index == 0:
            return False
        if self.backward == "BACKWARD_POST":
            # The unit before it is the one the synchronous backward gathers now: it costs nothing against the budget.
            return self._start_window(self.order[index - 1 :: -1], computing=self.order[index - 1])
        return not self._pending and self._start(self.order[index - 1])

    def _start_window(self, coming: list[Any], computing: Any = None, at_least_first: bool = True) -> bool:
        """Start gathering the units of ``coming`` (in the order the pass meets them) that fit, with those already on
        their way (but ``computing``'s, which the synchronous path holds now) and the gradients in flight (the
        reducer's: none in a forward), in :attr:`ahead_budget` together (the synchronous backward's reduce-scatter
        bucket, FairScale's ``bucket_cap_mb``); with ``at_least_first`` the first one whatever its cost (only it, with
        a budget of 0 or less). Units that keep their full parameters from their forward to their backward
        (``reshard_after_forward=False``: ``SHARD_GRAD_OP``) cost nothing against it: they hold them at the
        backward's start either way. Returns whether the first one is on its way."""
        spent = self.reducer.bytes_in_flight + self._held_beside(computing)
        for position, unit in enumerate(coming):
            if unit in self._pending or unit in self._kept:
                continue
            cost = 0 if unit is computing else _ahead_bytes(unit)
            first = position == 0 and at_least_first
            if not first and (self.ahead_budget <= 0 or spent + cost > self.ahead_budget):
                break
            if not self._start(unit):
                break  # gathered by FairScale (or still holding its parameters): the ones after it wait for it
            spent += cost
        return bool(coming) and coming[0] in self._pending

    def _held_beside(self, computing: Any) -> int:
        """What the units gathered ahead and kept hold against the budget, but ``computing``'s."""
        return self._cost_ahead_of(computing) + self._cost_kept(computing)

    def _settle_beside(self, computing: Any) -> None:
        """Wait for reductions until the gradients in flight fit the reducer's budget beside what the units gathered
        ahead and kept hold (but ``computing``'s)."""
        self.reducer.settle(self.reducer.budget_bytes - self._held_beside(computing))

    def _cost_ahead_of(self, computing: Any) -> int:
        """What the units on their way but ``computing`` hold beyond the synchronous path (:func:`_ahead_bytes`)."""
        return sum(cost for pending, (_, _, cost) in self._pending.items() if pending is not computing)

    def _cost_kept(self, computing: Any) -> int:
        """What the units :meth:`keeps` kept, and that hold their full parameters still, hold against the budget, but
        ``computing``'s."""
        return sum(self._to_keep[unit] for unit in self._kept if unit is not computing)

    def _start(self, unit: _FairScaleFSDP) -> bool:
        """Start gathering ``unit``, unless it is on its way or this module does not gather it; whether it started."""
        if unit in self._pending or not _to_gather(unit):
            return False
        if self.before_gathers is not None and not in_backward():
            self.before_gathers()
        self._pending[unit] = (*_gather(unit), _ahead_bytes(unit))
        return True


def _to_gather(unit: _FairScaleFSDP) -> bool:
    """Whether this module gathers ``unit``'s full parameters: it can (:func:`can_prefetch`) and the unit holds none
    of them (FairScale's own rebuild completes a partly freed one)."""
    return not unit.has_full_params and can_prefetch(unit) and not _still_gathered(unit)


def _gather(unit: _FairScaleFSDP) -> tuple[list[Any], list[Tensor]]:
    """Start gathering ``unit``'s full parameters (:func:`can_prefetch`) into their ``_full_param_padded``: the
    exchanges' handles, and the shards they read (kept alive until waited for)."""
    works, sources = [], []
    for param in unit.params:
        full = param._full_param_padded
        _alloc_storage(full)
        # Under mixed precision the full parameters are in the compute dtype: FairScale gathers the cast shard.
        sources.append(param._fp32_shard.to(full.dtype))
        works.append(exchanges.all_gather(full, sources[-1], group=unit.process_group))
    return works, sources


def _ahead_bytes(unit: _FairScaleFSDP) -> int:
    """The bytes that gathering ``unit`` ahead of its forward holds beyond the synchronous path: its full parameters',
    none for a unit that keeps them from its forward to its backward."""
    if not unit.reshard_after_forward:
        return 0
    full = [p._full_param_padded for p in unit.params if hasattr(p, "_full_param_padded")]
    return sum(f.numel() * f.element_size() for f in full)


def _still_gathered(unit: _FairScaleFSDP) -> bool:
    """Whether any of ``unit``'s full parameters still has its storage."""
    return any(_holds_storage(p._full_param_padded) for p in unit.params if hasattr(p, "_full_param_padded"))
