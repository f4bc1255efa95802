"""Checkpoints of Lightning 1.x's FairScale strategies: recognising them, and what of them can be resumed.

Lightning 1.x's ``DDPFullyShardedStrategy`` (``strategy="ddp_fully_sharded"`` or ``"fsdp"``; the PL-Fairscale
extension's is the same code and ran on Lightning up to 2.0) wrote checkpoints that differ from ours in one part:

* ``state_dict`` holds the full weights with the unwrapped module's keys (FairScale's ``state_dict``): loadable.
* ``loops``, ``lr_schedulers``, ``callbacks``, ``epoch``/``global_step``: standard Lightning entries, loadable
  (Lightning upgrades the 1.x loop layout itself).
* ``optimizer_states`` is ``optimizer.state_dict()`` of rank 0 only, over FairScale's *flat* parameters: one per
  FSDP unit (the whole module, unless ``configure_sharded_model`` wrapped layers), each rank 0's shard of about
  ``numel / world_size`` elements. The other ranks' shards were never saved.

So an optimizer without per-parameter state (SGD without momentum) resumes exactly: its state is only the param
groups' hyperparameters, which are complete. A stateful one (Adam's ``exp_avg``...) cannot be restored by anyone:
the checkpoint holds a fraction of it. :func:`adopt_optimizer_states` turns the former into our (plain) layout,
and for the latter raises :class:`Lightning1xOptimizerStateError` unless told to start the state afresh.

**The rule** (:func:`is_flat_optimizer_state`). A saved optimizer state is one of a Lightning 1.x FairScale FSDP
checkpoint when all of:

1. the checkpoint was written by Lightning older than 2.1 (``pytorch-lightning_version``, or the version Lightning
   keeps in ``legacy_pytorch-lightning_version`` after upgrading it on load): no later Lightning had a FairScale
   strategy, and ours always save the plain layout;
2. it has as many param groups as the optimizer now, none with more parameters than the optimizer's group;
3. every element-wise tensor of its state is 1-D (flat or sharded FairScale parameters are), and
4. either some group has fewer parameters than now (several parameters flattened into one), or some element-wise
   tensor has another number of elements than its parameter (a shard: ``flatten_parameters=False``).

A plain checkpoint (ours, Lightning's DDP, 1.x's ``ddp_sharded`` whose state OSS consolidated) fits the optimizer
parameter by parameter, so it fails 4, and loads as it always did. A checkpoint of another model fails 2 or 3, and
gets the usual "different model or optimizer" error. Where no state tensor exists (stateless optimizers), a
false match could only come from a 1.x checkpoint of the same weights whose optimizer held fewer parameters; even
then the result is right, because only the hyperparameters are restored.

``lightning-fairscale-convert-1x SRC DST`` (:mod:`lightning_fairscale.convert_1x`, :func:`convert_checkpoint`)
writes a copy without the incomplete state, marked with :data:`CONVERTED_KEY`; the strategies then resume it with a
fresh state, whatever their ``lightning_1x_optimizer_state``.

This module does not import Lightning: the strategies of both Lightning packages and the command use it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

from torch import Tensor

__all__ = [
    "CONVERTED_KEY",
    "CurrentOptimizer",
    "Lightning1xOptimizerStateError",
    "OptimizerStatePolicy",
    "adopt_optimizer_states",
    "convert_checkpoint",
    "is_flat_optimizer_state",
    "validate_policy",
    "written_version",
]

#: Marks a checkpoint written by ``lightning-fairscale-convert-1x``; its value says what was dropped.
CONVERTED_KEY = "lightning_fairscale_converted_1x"
#: What to do with the incomplete optimizer state of a stateful optimizer: raise (default), or start it afresh.
OptimizerStatePolicy = Literal["error", "reset"]
_POLICIES = ("error", "reset")
#: The first Lightning without a FairScale strategy of its own (the PL-Fairscale extension allowed up to 2.0.x).
_FIRST_WITHOUT_FAIRSCALE = (2, 1)


class Lightning1xOptimizerStateError(ValueError):
    """The optimizer state of a Lightning 1.x FairScale checkpoint is incomplete and cannot be resumed as it is."""


@dataclass(frozen=True)
class CurrentOptimizer:
    """What the strategy knows of one of its optimizers: its class name and, for each param group, the shapes of
    the (unwrapped) parameters in the user's order, as a plain optimizer over the LightningModule holds them."""

    name: str
    groups: Sequence[Sequence[Sequence[int]]]


def validate_policy(value: Any, owner: str) -> OptimizerStatePolicy:
    """``value`` if it is a valid ``lightning_1x_optimizer_state``; a ``ValueError`` that says what is otherwise."""
    if value not in _POLICIES:
        raise ValueError(
            f'`{owner}(lightning_1x_optimizer_state=...)` must be "error" (default: resuming a Lightning 1.x FairScale'
            ' checkpoint of a stateful optimizer fails) or "reset" (it resumes with a fresh optimizer state), got'
            f" {value!r}."
        )
    return value


def written_version(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """The Lightning version that wrote ``checkpoint`` (the original one, also after Lightning upgraded it)."""
    version = checkpoint.get("legacy_pytorch-lightning_version") or checkpoint.get("pytorch-lightning_version")
    return str(version) if version is not None else None


def _older_than(version: Optional[str], bound: tuple[int, int]) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return match is not None and (int(match[1]), int(match[2])) < bound


def _elementwise(entry: Mapping[str, Any]) -> dict[str, Tensor]:
    return {key: value for key, value in entry.items() if isinstance(value, Tensor) and value.dim() > 0}


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def is_flat_optimizer_state(checkpoint: Mapping[str, Any], saved: Mapping[str, Any], current: CurrentOptimizer) -> bool:
    """Whether ``saved``, one of ``checkpoint``'s optimizer states, is over FairScale's flat parameters of Lightning
    1.x's FSDP strategy rather than over ``current``'s parameters (the rule in the module's docstring)."""
    if not _older_than(written_version(checkpoint), _FIRST_WITHOUT_FAIRSCALE):
        return False
    groups = saved.get("param_groups") or []
    if len(groups) != len(current.groups):
        return False
    counts = [len(group.get("params", [])) for group in groups]
    if any(count > len(shapes) for count, shapes in zip(counts, current.groups)):
        return False
    state = saved.get("state") or {}
    tensors = {index: _elementwise(entry) for index, entry in state.items()}
    if any(t.dim() != 1 for entry in tensors.values() for t in entry.values()):
        return False
    if any(count < len(shapes) for count, shapes in zip(counts, current.groups)):
        return True
    numel = {
        index: _numel(shape)
        for group, shapes in zip(groups, current.groups)
        for index, shape in zip(group["params"], shapes)
    }
    return any(t.numel() != numel.get(index) for index, entry in tensors.items() for t in entry.values())


def _plain_layout(saved: Mapping[str, Any], current: CurrentOptimizer) -> dict[str, Any]:
    """``saved``'s param group hyperparameters (lr, betas, initial_lr ...) over ``current``'s parameters, no state."""
    groups, index = [], 0
    for group, shapes in zip(saved["param_groups"], current.groups):
        hyperparameters = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
        groups.append({**hyperparameters, "params": list(range(index, index + len(shapes)))})
        index += len(shapes)
    return {"state": {}, "param_groups": groups}


def _describe_state(saved: Mapping[str, Any]) -> str:
    """What the per-parameter state of ``saved`` holds, e.g. ``exp_avg, exp_avg_sq, step of 1 flat parameter(s)``."""
    state = saved.get("state") or {}
    keys = sorted({key for entry in state.values() for key in entry})
    return f"{', '.join(keys)} of {len(state)} flat parameter(s)"


def _coverage(saved: Mapping[str, Any], current: CurrentOptimizer) -> str:
    """How much of one element-wise state entry the checkpoint holds, e.g. ``2,466 of 4,932 values``."""
    state = saved.get("state") or {}
    keys = sorted({key for entry in state.values() for key in _elementwise(entry)})
    if not keys:
        return "a part"
    held = sum(entry[keys[0]].numel() for entry in state.values() if keys[0] in entry)
    total = sum(_numel(shape) for shapes in current.groups for shape in shapes)
    return f"{held:,} of the {total:,} values of each of {', '.join(keys)}"


def _error(version: Optional[str], index: int, saved: Mapping[str, Any], current: CurrentOptimizer, owner: str) -> str:
    return (
        f"The checkpoint was written by Lightning {version}'s FairScale strategy (DDPFullyShardedStrategy,"
        f' strategy="ddp_fully_sharded"/"fsdp" in Lightning 1.x). Its weights, loops, LR schedulers and callbacks'
        f" resume, but its state of optimizer {index} ({current.name}) does not: Lightning 1.x saved only rank 0's"
        " shard of it, over FairScale's flat parameters, and no other rank's, so the checkpoint holds"
        f" {_coverage(saved, current)}; no strategy can restore the {current.name} state from it. To go on"
        f' with a fresh optimizer state (the checkpoint\'s lr and other hyperparameters kept), pass `{owner}('
        'lightning_1x_optimizer_state="reset")`, or convert the file once with `lightning-fairscale-convert-1x'
        " SRC DST` and resume from DST. Optimizers without per-parameter state (SGD without momentum) resume"
        " exactly."
    )


def adopt_optimizer_states(
    checkpoint: Mapping[str, Any],
    current: Sequence[CurrentOptimizer],
    policy: OptimizerStatePolicy = "error",
    owner: str = "DDPFullyShardedStrategy",
) -> tuple[list[dict[str, Any]], Optional[str]]:
    """``checkpoint["optimizer_states"]``, with those of a Lightning 1.x FairScale checkpoint in our layout.

    States in the plain layout are returned unchanged. One over flat parameters (:func:`is_flat_optimizer_state`), or
    any in a file written by ``lightning-fairscale-convert-1x``, becomes the state dict of a fresh optimizer over
    ``current``'s parameters with the checkpoint's param group hyperparameters: exact where it had no per-parameter
    state; where it had some, only with ``policy="reset"``, which drops it.

    Args:
        checkpoint: the loaded checkpoint; its ``optimizer_states`` has one entry per optimizer (checked before).
        current: the strategy's optimizers, in the same order.
        policy: ``"error"`` or ``"reset"``, what to do with an incomplete state (``lightning_1x_optimizer_state``).
        owner: the strategy's class name, for the messages.

    Returns:
        The states to load, and a message to warn with when something was adopted (``None`` otherwise).

    Raises:
        Lightning1xOptimizerStateError: a 1.x checkpoint's state is incomplete and ``policy`` is ``"error"``.
        ValueError: a converted checkpoint has another number of param groups than the optimizer.
    """
    states = list(checkpoint["optimizer_states"])
    converted = checkpoint.get(CONVERTED_KEY)
    version = written_version(checkpoint) if converted is None else converted.get("source_version")
    notes: list[str] = []
    dropped_any = False
    for index, (saved, optimizer) in enumerate(zip(states, current)):
        if converted is None and not is_flat_optimizer_state(checkpoint, saved, optimizer):
            continue
        if len(saved.get("param_groups") or []) != len(optimizer.groups):
            raise ValueError(
                f"The converted Lightning {version} checkpoint's optimizer {index} has"
                f" {len(saved.get('param_groups') or [])} param groups but {optimizer.name} has"
                f" {len(optimizer.groups)}. Resume with the optimizer configuration the checkpoint was saved with."
            )
        if saved.get("state"):
            if policy != "reset":
                raise Lightning1xOptimizerStateError(_error(version, index, saved, optimizer, owner))
            dropped_any = True
            notes.append(
                f"optimizer {index} ({optimizer.name}): dropped {_describe_state(saved)} (rank 0's shard only)"
            )
        elif converted is not None:
            dropped = converted.get("dropped", {}).get(str(index), "no per-parameter state")
            notes.append(f"optimizer {index} ({optimizer.name}): {dropped}")
        else:
            notes.append(f"optimizer {index} ({optimizer.name}): no per-parameter state, restored exactly")
        states[index] = _plain_layout(saved, optimizer)
    if not notes:
        return states, None
    if converted is not None:
        return states, (
            f"The checkpoint was converted from Lightning {version} by lightning-fairscale-convert-1x: the optimizers"
            f" start with a fresh state and the checkpoint's hyperparameters ({'; '.join(notes)})."
        )
    if not dropped_any:
        return states, (
            f"Resuming a Lightning {version} FairScale checkpoint: its optimizer state has no per-parameter entries"
            " (an optimizer like SGD without momentum), so it resumes exactly with the checkpoint's hyperparameters"
            f" ({'; '.join(notes)})."
        )
    return states, (
        f"Resuming a Lightning {version} FairScale checkpoint with lightning_1x_optimizer_state=\"reset\": its"
        f" optimizer state was incomplete, so it starts afresh with the checkpoint's hyperparameters"
        f" ({'; '.join(notes)}). The weights, loops, LR schedulers and callbacks are restored."
    )


def convert_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of a Lightning 1.x FairScale checkpoint without its incomplete per-parameter optimizer state.

    Everything else is kept as it is: the weights, loops, LR schedulers, callbacks, hyperparameters, the Lightning
    version (Lightning upgrades the 1.x loop layout when it loads the file) and the optimizers' param groups with
    their hyperparameters. :data:`CONVERTED_KEY` records what was dropped; the strategies resume such a file with a
    fresh optimizer state.

    Returns:
        The converted checkpoint, and one line per optimizer saying what was dropped.

    Raises:
        ValueError: the checkpoint is not one of Lightning 1.x, was converted already, or an optimizer state is not
            over flat parameters (complete: it resumes as it is, e.g. 1.x's ``"ddp_sharded"``).
    """
    version = written_version(checkpoint)
    if CONVERTED_KEY in checkpoint:
        raise ValueError("The checkpoint was converted already; resume from it as it is.")
    if not _older_than(version, _FIRST_WITHOUT_FAIRSCALE):
        raise ValueError(
            f"The checkpoint was written by Lightning {version or '(unknown version)'}, not by Lightning 1.x's"
            " FairScale strategy: there is nothing to convert. Resume from it as it is."
        )
    if "optimizer_states" not in checkpoint:
        raise ValueError("The checkpoint has no optimizer state (saved with `save_weights_only`): nothing to convert.")
    report: list[str] = []
    dropped: dict[str, str] = {}
    states: list[dict[str, Any]] = []
    for index, saved in enumerate(checkpoint["optimizer_states"]):
        state = saved.get("state") or {}
        if any(t.dim() != 1 for entry in state.values() for t in _elementwise(entry).values()):
            raise ValueError(
                f"Optimizer {index}'s state in the checkpoint is over the model's own parameters (tensors of their"
                " shapes), not over FairScale's flat parameters: it is complete (a checkpoint of Lightning 1.x's"
                ' "ddp_sharded" or "ddp"). Resume from it as it is; it needs no conversion.'
            )
        what = f"dropped {_describe_state(saved)} (rank 0's shard only)" if state else "no per-parameter state"
        dropped[str(index)] = what
        report.append(f"optimizer {index}: {what}; param group hyperparameters kept")
        states.append({"state": {}, "param_groups": copy.deepcopy(saved.get("param_groups") or [])})
    converted = {key: value for key, value in checkpoint.items() if key != "optimizer_states"}
    converted["optimizer_states"] = states
    converted[CONVERTED_KEY] = {"source_version": version, "dropped": dropped}
    return converted, report

