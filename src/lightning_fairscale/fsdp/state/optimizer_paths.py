"""Which path each optimizer steps on under FSDP: on this rank's slices (element-wise) or on whole tensors.

Outside a unit's forward every original parameter an optimizer holds is this rank's 1-D slice of FairScale's flat
shard (:mod:`~lightning_fairscale.fsdp.unit.param_views`). An optimizer that updates each element from that element's
own history alone (SGD, Adam, AdamW...) is exact on slices: the **element-wise** path, which costs nothing more than
FSDP itself. One that reads a parameter as a tensor (Adafactor's row and column means, Muon's orthogonalisation of
each matrix, a LARS or LAMB trust ratio ``||w|| / ||g||``) is not: it takes the **whole** path
(:mod:`~lightning_fairscale.fsdp.state.whole_step`), where each parameter's owner rank steps it whole.

Nothing is guessed. :data:`ELEMENTWISE`, :data:`WHOLE` and :data:`REFUSED` declare the ``torch.optim`` classes
(checked against torch 2.13's sources: the element-wise ones compute every update with per-element tensor ops, and
their per-parameter scalars, ``step``, ``eta``, ``mu``, depend on the step count only). An optimizer of another class
(a user's subclass, a third-party optimizer) is checked by :func:`steps_elementwise`: a throwaway step of a small
random matrix whole against the same step of it as two 1-D slices, with the same class and param-group
hyperparameters, on this rank alone. Equal: the element-wise path; different, or the check cannot run: the whole
path, exact for any optimizer that steps each parameter on its own.

An optimizer that reads the whole parameter *vector* (LBFGS: a line search over dot products of every parameter;
anything holding its own list of parameters or needing a closure that re-evaluates the model) is exact on no rank:
:func:`refusal` names it and what to do, before the first step.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Literal, Optional

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["ELEMENTWISE", "PATHS", "REFUSED", "WHOLE", "Path", "choose_path", "refusal", "steps_elementwise"]

#: The values of the strategies' ``optimizer_path`` option.
Path = Literal["auto", "elementwise", "whole"]
PATHS: tuple[str, ...] = ("auto", "elementwise", "whole")


def _classes(*names: str) -> frozenset[type]:
    """The classes of ``torch.optim`` of these names that this torch has."""
    return frozenset(getattr(torch.optim, name) for name in names if hasattr(torch.optim, name))


#: Element-wise: every update of an element reads that element's gradient, value and state only.
ELEMENTWISE = _classes("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD", "NAdam",
                       "RAdam")
#: Per tensor: Adafactor factors each matrix's second moment into row and column means; Muon orthogonalises each
#: matrix's momentum (and refuses a 1-D gradient).
WHOLE = _classes("Adafactor", "Muon")
#: Exact on no rank of a sharded model, with why (completed by :func:`refusal`).
REFUSED: dict[type, str] = {
    **{cls: "its line search reads the whole parameter vector (dot products over every parameter)"
       for cls in _classes("LBFGS")},
    **{cls: "it takes sparse gradients only, and FSDP's gradients are dense" for cls in _classes("SparseAdam")},
}


def _holds_own_params(optimizer: Optimizer) -> Optional[str]:
    """The name of an attribute of ``optimizer`` (other than its param groups and state) that holds a list of
    tensors: its own list of the parameters, which re-pointing to the shards cannot reach (LBFGS's ``_params``)."""
    for name, value in vars(optimizer).items():
        if name in ("param_groups", "state", "defaults") or not isinstance(value, (list, tuple)):
            continue
        if value and all(isinstance(item, torch.Tensor) for item in value):
            return name
    return None


def _needs_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` takes a closure it cannot do without (a line search re-evaluating the model)."""
    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def refusal(optimizer: Optimizer, owner: str = "DDPFullyShardedStrategy") -> Optional[str]:
    """Why ``optimizer`` cannot train a model sharded by ``owner`` and what to do; ``None`` when it can."""
    cls = type(optimizer)
    why = REFUSED.get(cls)
    if why is None:
        attribute = _holds_own_params(optimizer)
        if attribute is not None:
            why = (f"it keeps its own list of the parameters (`{attribute}`), which sharding cannot point to the"
                   " shards: it would step the unsharded parameters, which get no gradient")
        elif _needs_closure(optimizer):
            why = "its step needs a closure that re-evaluates the model (a line search over the whole parameters)"
    if why is None:
        return None
    return (
        f"The optimizer {cls.__name__} cannot train a model sharded by {owner}: {why}, and no rank holds the whole"
        " model's parameters. Use `strategy=\"ddp\"` (every rank holds every parameter), or an optimizer that steps"
        " each parameter on its own (SGD, Adam, AdamW, Adafactor, Muon...)."
    )


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _fresh(cls: type, params: list[dict[str, Any]], hyperparameters: dict[str, Any]) -> Optimizer:
    """An optimizer of ``cls`` over ``params`` (param groups), given the constructor arguments it names among
    ``hyperparameters`` (the groups carry them all anyway)."""
    accepted: Mapping[str, inspect.Parameter]
    try:
        accepted = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in hyperparameters.items() if takes_any or k in accepted}
    kwargs.pop("params", None)
    return cls(params, **kwargs)


@torch.no_grad()
def _matrix_steps(cls: type, group: dict[str, Any], split: bool, grads: list[torch.Tensor], start: torch.Tensor
                  ) -> torch.Tensor:
    """``start`` after ``len(grads)`` steps of a fresh ``cls`` with ``group``'s hyperparameters: as one matrix, or
    (``split``) as two 1-D slices cut inside a row."""
    hyperparameters = _hyperparameters(group)
    cut = start.numel() // 2 + 1
    flat = start.clone().reshape(-1)
    if split:
        params = [nn.Parameter(flat[:cut].clone()), nn.Parameter(flat[cut:].clone())]
    else:
        params = [nn.Parameter(start.clone())]
    optimizer = _fresh(cls, [{"params": params, **hyperparameters}], hyperparameters)
    for grad in grads:
        if split:
            params[0].grad, params[1].grad = grad.reshape(-1)[:cut].clone(), grad.reshape(-1)[cut:].clone()
        else:
            params[0].grad = grad.clone()
        optimizer.step()
    if split:
        return torch.cat([p.detach().reshape(-1) for p in params]).reshape(start.shape)
    return params[0].detach()


def steps_elementwise(optimizer: Optimizer, steps: int = 3) -> bool:
    """Whether ``optimizer``'s class, with each of its param groups' hyperparameters, steps a random 5x7 float64
    matrix exactly as it steps it cut in two 1-D slices (``steps`` steps, fresh gradients each). Local: no
    communication, nothing of ``optimizer`` changes. ``False`` when the check cannot run (a constructor that needs
    other arguments, a step that needs a closure or another dtype...): the whole path is exact either way."""
    cls = type(optimizer)
    generator = torch.Generator().manual_seed(1234)
    for group in optimizer.param_groups:
        start = torch.randn(5, 7, generator=generator, dtype=torch.float64)
        grads = [torch.randn(5, 7, generator=generator, dtype=torch.float64) for _ in range(steps)]
        try:
            whole = _matrix_steps(cls, group, False, grads, start)
            sliced = _matrix_steps(cls, group, True, grads, start)
        except Exception:  # any failure of a throwaway step: not known to be element-wise
            return False
        if not torch.isfinite(whole).all() or not torch.allclose(whole, sliced, rtol=1e-12, atol=0.0):
            return False
    return True


def choose_path(optimizer: Optimizer, option: Path = "auto") -> Literal["elementwise", "whole"]:
    """The path ``optimizer`` steps on: the option when forced, else the table's, else :func:`steps_elementwise`'s."""
    if option in ("elementwise", "whole"):
        return option
    cls = type(optimizer)
    if cls in ELEMENTWISE:
        return "elementwise"
    if cls in WHOLE:
        return "whole"
    return "elementwise" if steps_elementwise(optimizer) else "whole"
