"""Every rank runs the same units in a forward, or the run ends at once, naming the unit (issue 54, item 4).

A unit's forward gathers its full parameters (a collective over its process group), so the ranks must run the same
units in the same order: when one rank runs a unit another skips (control flow that depends on the rank's own data,
an expert that gets tokens on one rank only), their collectives pair the wrong tensors. On gloo that ended within
seconds with a bare transport error (``Read error``) on one rank and nothing on the other; on NCCL it hangs, or pairs
tensors of the same size silently.

:class:`Agreement` (one per root, shared by its units) follows the units each root forward runs on this rank (a
running digest of their positions) and checks, before every collective a forward starts (a unit's gather, or gathers
started ahead on CPU), and at the end of the root's forward, that every rank's digest is this one's: a 16-byte
all-reduce (:func:`~lightning_fairscale.distributed.collectives.all_equal`), the same on gloo and NCCL. Since every
collective of a forward comes after such a check, the first rank to leave the common path meets the others in a
check, never in a gather: every rank learns it at the same moment, the ranks exchange the units they ran, and each
raises a ``RuntimeError`` that names the unit (its module path in the user's model), which ranks ran it, and what to
do. Nothing is gathered or reduced after it: the units are restored as the last completed step left them
(:mod:`~lightning_fairscale.fsdp.unit.recovery`). On CPU, where a small model's units are gathered ahead at the
forward's start, a forward costs two such checks; on CUDA one per unit the forward gathers (each waits for the host).

Not covered: a rank's own collectives between two units of the root's forward (``self.log(..., sync_dist=True)`` in a
``training_step`` before the model's last unit ran), which meet a check instead of their match; and a unit that runs
on every rank but whose output the loss uses on some ranks only.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.distributed import collectives
from lightning_fairscale.fsdp.unit.instances import named_fsdp_instances
from lightning_fairscale.fsdp.unit.state_names import clean_path

__all__ = ["Agreement", "RankDivergenceError"]

_MODULUS = 2**61 - 1  # a prime: the digest of a sequence of positions, which fits an int64 (and its negation)


class RankDivergenceError(RuntimeError):
    """The ranks ran different units in one forward (raised on every rank at the same moment)."""


class Agreement:
    """What the root ``root``'s current forward has run on this rank, and the checks that every rank ran the same.

    Args:
        root: the root unit (only its units' names and process groups are read; it is not kept).
    """

    def __init__(self, root: _FairScaleFSDP) -> None:
        names = [(clean_path(path + ".").rstrip(".") or "(root)", unit) for path, unit in named_fsdp_instances(root)]
        #: Each unit's position in the root (by identity), and its module path in the user's model.
        self._positions = {id(unit): position for position, (_, unit) in enumerate(names)}
        self.names = [name for name, _ in names]
        #: The group every rank of the model is in: the root's, or the whole world under hybrid sharding.
        self._group = None if getattr(root, "replica_group", None) is not None else root.process_group
        self._world = dist.get_world_size(self._group) if dist.is_available() and dist.is_initialized() else 1
        #: The positions of the units this forward ran, in order, and their digest; ``None`` outside a root forward.
        self.sequence: Optional[list[int]] = None
        self._digest = 0
        self._checked: Optional[int] = None
        #: Called on every rank when the ranks' forwards differ, before the error is raised (the prefetcher forgets
        #: the order it recorded, which is not every rank's), if set.
        self.on_divergence: Optional[Callable[[], None]] = None

    def forward_started(self) -> None:
        """A root forward begins (not a recomputation inside a backward)."""
        self.sequence, self._digest, self._checked = [], 0, None

    def unit_runs(self, unit: _FairScaleFSDP) -> None:
        """``unit``'s forward begins, on this rank."""
        if self.sequence is None:
            return
        position = self._positions.get(id(unit), len(self.names))
        self.sequence.append(position)
        self._digest = (self._digest * 1_000_003 + position + 1) % _MODULUS

    def before_collective(self) -> None:
        """A collective is about to start in the forward: check that every rank ran the same units so far (once per
        unit run: nothing ran since the last check, nothing to check)."""
        if self.sequence is not None and self._checked != self._digest:
            self._check(self._digest)
            self._checked = self._digest

    def forward_ended(self) -> None:
        """The root's forward ended on this rank: check that every rank ran the same units."""
        if self.sequence is None:
            return
        try:
            self._check((self._digest * 1_000_003) % _MODULUS + _MODULUS)  # "ended": no running digest equals it
        finally:
            self.sequence = None

    def outside_forward(self) -> None:
        """The root's forward is over, whatever ended it: nothing is followed or checked until the next one."""
        self.sequence = None

    def _check(self, digest: int) -> None:
        if self._world == 1 or collectives.all_equal(digest, group=self._group):
            return
        sequence, self.sequence = self.sequence or [], None
        if self.on_divergence is not None:
            self.on_divergence()
        raise RankDivergenceError(self._explain(collectives.all_gather_object(sequence, group=self._group)))

    def _name(self, position: int) -> str:
        return self.names[position] if position < len(self.names) else "(a unit of another root)"

    def _explain(self, sequences: list[list[int]]) -> str:
        """The message every rank raises: the first unit the ranks' forwards disagree on, who ran it, what to do."""
        step = next((i for i in range(max(map(len, sequences))) if len({tuple(s[: i + 1]) for s in sequences}) > 1), 0)
        here = {rank: (s[step] if step < len(s) else None) for rank, s in enumerate(sequences)}
        unit = next((p for p in here.values() if p is not None), len(self.names))
        name = self._name(unit)
        ran = ", ".join(str(rank) for rank, position in here.items() if position == unit)
        elsewhere = "; ".join(
            f"rank {rank} went on to {'the end of the forward' if p is None else repr(self._name(p))}"
            for rank, p in here.items()
            if p != unit
        )
        return (
            f"The FSDP unit {name!r} ran on rank(s) {ran} in this forward, and not on the others ({elsewhere}) after"
            f" {step} unit(s) run alike on every rank. Every rank must run the same units in the"
            " same order: a unit's forward gathers its parameters from every rank. Run it on every rank (for example"
            " with an empty input, a batch of zero rows, when a rank has nothing for it), or decide whether to run it"
            " from every rank's value (all-reduce the condition). The step was stopped on every rank before any"
            " gather; the model is as the last completed step left it."
        )
