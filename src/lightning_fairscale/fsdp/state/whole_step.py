"""The whole path's optimizer step: each parameter stepped whole by its owner rank, around the user's step.

An optimizer on the whole path (:mod:`~lightning_fairscale.fsdp.state.optimizer_paths`) holds, as every optimizer
over a sharded model, this rank's 1-D views of the original parameters. Around each of its steps, through torch's
public hooks (``register_step_pre_hook``/``register_step_post_hook``, so that a raw ``optimizer.step()`` in manual
optimization or Fabric is covered too), :class:`WholeStep`:

1. **before** (once the gradients are there: when ``step`` is given a closure, right after the closure returns)
   sends each parameter's data and gradient slices to its owner (:mod:`~lightning_fairscale.fsdp.state.whole_owners`)
   in one batched point-to-point exchange per pair of ranks (about ``Ψ/N`` elements each way; a parameter inside its
   owner's shard moves nothing); on the owner the view parameter then holds the whole tensor (``.data``) and the
   whole gradient (``.grad``, ``None`` when no rank had one), on the other ranks its ``.grad`` is ``None``: the
   optimizer skips it there;
2. the user's optimizer steps (its state is whole-shaped, on the owner only: about ``Ψ/N`` per rank);
3. **after**, sends each updated slice back to the rank whose shard holds it, and gives every view its shard slice and
   its gradient back as they were (FSDP's gradient bookkeeping, :mod:`~lightning_fairscale.fsdp.unit.param_views`,
   sees the same tensors).

A step that raises leaves no whole tensor behind: the strategies call :meth:`WholeStep.abort` (the engine's
``WrappedModel.abort_steps``) on the way out, which completes the exchange of step 3 with a failure flag, so that the
other ranks, waiting for it, raise too instead of hanging, and no rank applies a partial update; every view is
restored. The hooks' handles live in this object, which the sharded model keeps for each optimizer
(:class:`~lightning_fairscale.fsdp.model.WrappedModel`); they are removed when the model is unsharded or the optimizer
set up again.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_fairscale.distributed.collectives import point_to_point
from lightning_fairscale.fsdp.state.whole_owners import WholePiece, WholePlan
from lightning_fairscale.fsdp.unit import param_views

__all__ = ["WholeStep"]


@dataclass(eq=False)
class _Held:
    """A view parameter's own data (its shard slice) and gradient, kept while it holds something else."""

    piece: WholePiece
    data: Tensor
    grad: Optional[Tensor]
    #: Whether it took part in the step (trainable): only those are exchanged back.
    active: bool = False
    #: On the owner, what it was given to step (the whole parameter), else ``None``.
    whole: Optional[Tensor] = None


def _dtype_key(dtype: torch.dtype) -> str:
    return str(dtype)


#: The code of torch's wrapper around every optimizer class's ``step`` (the one that runs the step hooks).
_HOOKED_STEP = Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def _steps_under_way(optimizer: Optimizer) -> int:
    """How many of ``optimizer``'s hooked ``step`` calls are on the stack. More than one: a subclass's ``step``
    called its parent's (``super().step()``), and torch wrapped both classes' ``step`` with the hooks: only the
    outermost call is the step (its inner calls' hooks do nothing), whatever an earlier step left behind."""
    count = 0
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is _HOOKED_STEP and frame.f_locals.get("self") is optimizer:
            count += 1
        frame = frame.f_back
    return count


class WholeStep:
    """The whole path of one optimizer (see the module's docstring), from its :class:`WholePlan`."""

    def __init__(self, plan: WholePlan) -> None:
        self.plan = plan
        self._handles: list[Any] = []
        #: While the views hold the step's tensors (between the exchanges), what they held before.
        self._held: Optional[list[_Held]] = None

    # ------------------------------------------------------------------------------------------------------------
    # The hooks

    def install(self, optimizer: Optimizer) -> None:
        """Hook into ``optimizer``'s steps (its handles kept here, not in the optimizer)."""
        self.remove()
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def remove(self) -> None:
        """Unhook; views holding whole tensors (a step that failed without :meth:`abort`) get their slices back."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._restore()

    def _before_step(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _steps_under_way(optimizer) > 1:
            return None  # a parent class's step inside the step: the outermost call's hooks do the work
        self._restore()  # what a failed step left (without `abort`): its views, as they were
        # `args` holds the optimizer itself first (torch's hooks see the step's arguments as they were given).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.gather()
            return None

        def closure_then_gather() -> Any:
            self._restore()  # a closure called again: the views must be FSDP's while it runs
            result = closure()
            self.gather()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_gather}
        return (args[0], closure_then_gather, *args[2:]), kwargs

    def _after_step(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._held is not None and _steps_under_way(optimizer) <= 1:
            self.scatter()

    # ------------------------------------------------------------------------------------------------------------
    # Before the step: slices to the owners

    @torch.no_grad()
    def gather(self) -> None:
        """Give each owner the whole parameters and gradients it steps; the other ranks' views no gradient."""
        plan, me = self.plan, self.plan.rank
        active = [p for p in plan.pieces if param_views.gets_gradient(p.view)]
        sends: dict[tuple[int, str], list[Tensor]] = defaultdict(list)
        flags: dict[tuple[int, str], list[float]] = defaultdict(list)
        incoming: dict[tuple[int, str], list[tuple[WholePiece, int]]] = defaultdict(list)
        for piece in active:
            param, mine = piece.view.param, piece.span_of(me)
            key_dtype = _dtype_key(param.dtype)
            if piece.owner != me and mine is not None:
                grad = param.grad
                sends[(piece.owner, key_dtype)].append(param.data.reshape(-1))
                sends[(piece.owner, key_dtype)].append(
                    grad.reshape(-1).to(param.dtype) if grad is not None else param.data.new_zeros(param.numel())
                )
                flags[(piece.owner, key_dtype)].append(float(grad is not None))
            elif piece.owner == me:
                for span in piece.spans:
                    if span.rank != me:
                        incoming[(span.rank, key_dtype)].append((piece, span.hi - span.lo))
        messages = [(peer, torch.cat([*parts, parts[0].new_tensor(flags[(peer, d)])])) for (peer, d), parts in
                    sorted(sends.items())]
        buffers = {
            key: torch.empty(2 * sum(n for _, n in items) + len(items), dtype=items[0][0].view.param.dtype,
                             device=items[0][0].view.param.device)
            for key, items in sorted(incoming.items())
        }
        point_to_point(messages, [(peer, buffers[(peer, d)]) for peer, d in sorted(buffers)], plan.group)
        received = self._unpack(incoming, buffers)
        held: list[_Held] = []
        self._held = held
        stepped = {id(piece) for piece in active}
        for piece in plan.pieces:
            param = piece.view.param
            if id(piece) not in stepped or piece.owner != me:
                held.append(_Held(piece, param.data, param.grad, active=id(piece) in stepped))
                param.grad = None  # not stepped here
                continue
            held.append(self._give_whole(piece, received.get(piece, [])))

    @staticmethod
    def _unpack(
        incoming: dict[tuple[int, str], list[tuple[WholePiece, int]]], buffers: dict[tuple[int, str], Tensor]
    ) -> dict[WholePiece, list[tuple[int, Tensor, Optional[Tensor]]]]:
        """For each piece this rank owns, each peer's ``(peer, data slice, gradient slice or None)``."""
        out: dict[WholePiece, list[tuple[int, Tensor, Optional[Tensor]]]] = defaultdict(list)
        for key, items in incoming.items():
            buffer, at = buffers[key], 0
            flag_at = buffer.numel() - len(items)
            for i, (piece, numel) in enumerate(items):
                data, grad = buffer[at : at + numel], buffer[at + numel : at + 2 * numel]
                out[piece].append((key[0], data, grad if bool(buffer[flag_at + i]) else None))
                at += 2 * numel
        return out

    def _give_whole(self, piece: WholePiece, peers: list[tuple[int, Tensor, Optional[Tensor]]]) -> _Held:
        """The owner's view of ``piece`` holds the whole parameter and gradient (``None`` when no rank had one)."""
        param, me = piece.view.param, self.plan.rank
        data, grad = param.data, param.grad
        held = _Held(piece, data, grad, active=True)
        if piece.inside(me):  # nothing moved: the whole is the shard slice itself, updated in place
            whole = data.view(piece.shape)
            whole_grad = grad.view(piece.shape) if grad is not None else None
        else:
            mine = piece.span_of(me)
            whole = data.new_empty(piece.numel)
            present = grad is not None or any(g is not None for _, _, g in peers)
            whole_grad = data.new_zeros(piece.numel) if present else None
            if mine is not None:
                whole[mine.lo : mine.hi].copy_(data.reshape(-1))
                if whole_grad is not None and grad is not None:
                    whole_grad[mine.lo : mine.hi].copy_(grad.reshape(-1))
            for peer, peer_data, peer_grad in peers:
                span = piece.span_of(peer)
                assert span is not None
                whole[span.lo : span.hi].copy_(peer_data)
                if whole_grad is not None and peer_grad is not None:
                    whole_grad[span.lo : span.hi].copy_(peer_grad)
            whole = whole.view(piece.shape)
            whole_grad = whole_grad.view(piece.shape) if whole_grad is not None else None
        held.whole = whole
        param.data = whole
        param.grad = whole_grad
        return held

    # ------------------------------------------------------------------------------------------------------------
    # After the step: updated slices back

    @torch.no_grad()
    def scatter(self, failed: bool = False) -> None:
        """Send each updated slice to the rank that holds it and restore every view. With ``failed`` (this rank's
        step raised), send a failure flag instead, which the other ranks raise on; no rank applies anything then.

        Raises:
            RuntimeError: the step failed on another rank.
        """
        held = self._held
        if held is None:
            return
        plan, me = self.plan, self.plan.rank
        sends: dict[tuple[int, str], list[Tensor]] = defaultdict(list)
        incoming: dict[tuple[int, str], list[tuple[_Held, int]]] = defaultdict(list)
        for entry in held:
            piece = entry.piece
            key_dtype = _dtype_key(entry.data.dtype)
            if entry.whole is not None:  # owned and stepped here
                updated = piece.view.param.data.reshape(-1)
                for span in piece.spans:
                    if span.rank != me:
                        sends[(span.rank, key_dtype)].append(updated[span.lo : span.hi])
            elif piece.owner != me and entry.active and piece.span_of(me) is not None:
                incoming[(piece.owner, key_dtype)].append((entry, entry.data.numel()))
        status = [(peer, torch.tensor([float(failed)])) for peer in plan.peers()]
        statuses = [(peer, torch.zeros(1)) for peer in plan.peers()]
        messages = [(peer, torch.cat(parts)) for (peer, _), parts in sorted(sends.items())]
        buffers = {
            key: torch.empty(sum(n for _, n in items), dtype=items[0][0].data.dtype, device=items[0][0].data.device)
            for key, items in sorted(incoming.items())
        }
        try:
            point_to_point(status + messages, statuses + [(peer, buffers[(peer, d)]) for peer, d in sorted(buffers)],
                           plan.group)
        except BaseException:
            self._restore()
            raise
        failed_ranks = [peer for peer, flag in statuses if bool(flag)]
        if not failed and not failed_ranks:
            self._apply(held, incoming, buffers)
        self._restore()
        if failed_ranks:
            raise RuntimeError(
                f"The optimizer step failed on rank {failed_ranks[0]} of the shard group (its error is in its log), so"
                " no rank applied it: each parameter is stepped whole by one rank (`optimizer_path=\"whole\"`)."
            )

    def _apply(self, held: list[_Held], incoming: dict[tuple[int, str], list[tuple[_Held, int]]],
               buffers: dict[tuple[int, str], Tensor]) -> None:
        """Write the step into this rank's shard: its own slices of what it stepped, the others' from ``buffers``."""
        me = self.plan.rank
        for entry in held:
            if entry.whole is None:
                continue
            updated = entry.piece.view.param.data.reshape(-1)
            mine = entry.piece.span_of(me)
            if mine is not None and updated.data_ptr() != entry.data.data_ptr():
                entry.data.reshape(-1).copy_(updated[mine.lo : mine.hi])
        for key, items in incoming.items():
            buffer, at = buffers[key], 0
            for entry, numel in items:
                entry.data.reshape(-1).copy_(buffer[at : at + numel])
                at += numel

    def _restore(self) -> None:
        """Give every view its shard slice and its gradient back (the data first: a gradient must fit it)."""
        held, self._held = self._held, None
        for entry in held or []:
            param = entry.piece.view.param
            param.grad = None
            param.data = entry.data
            param.grad = entry.grad

    def abort(self) -> None:
        """After a step that raised on this rank: complete the exchange with a failure flag (the other ranks raise
        too) and restore the views. Nothing to do when no step is under way; an error of the exchange itself is not
        raised in the step's place."""
        if self._held is None:
            return
        try:
            self.scatter(failed=True)
        except Exception:  # the step's own error is the one to see
            self._restore()

    @property
    def stepping(self) -> bool:
        """Whether the views hold the step's tensors now (between the exchanges)."""
        return self._held is not None

