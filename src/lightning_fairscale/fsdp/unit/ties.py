"""Tied parameters: one parameter reachable under several names (a language model's input embedding and output
head, ``lm_head.weight is embed.weight``).

FairScale keeps a tie when both names are inside one unit: it flattens the parameter once and makes the second name
an alias of the first (``_shared_param_infos``). When the names fall into different units it does not notice: each
unit flattens the parameter on its own, and the two copies then train apart. So:

* :func:`keep_ties_together` wraps an auto-wrap policy so that it never makes a unit of a module that holds some but
  not all names of a tied parameter: the tie then goes to the enclosing unit, which holds all of them (torchtitan and
  Accelerate put the embedding and the head in one unit for the same reason);
* :func:`check_not_split`, called by every unit as it is built, fails when a unit would flatten a parameter that an
  inner unit flattened already (the user's own wrapping split a tie), naming both places;
* the state dicts' names of the aliases are in :mod:`lightning_fairscale.fsdp.unit.state_names`.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable

from torch import nn

from lightning_fairscale.fsdp.unit import unit_state
from lightning_fairscale.fsdp.unit.state_names import clean_path

__all__ = ["check_not_split", "keep_ties_together", "record_flattened", "tie_counts"]

def tie_counts(module: nn.Module) -> Counter[int]:
    """How many names each tied parameter of ``module`` has (by ``id``; untied parameters are left out)."""
    counts = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    return Counter({key: n for key, n in counts.items() if n > 1})


def keep_ties_together(policy: Callable[..., bool], root: nn.Module) -> Callable[..., bool]:
    """``policy`` (FairScale's signature), except that a module holding only some names of a parameter tied in
    ``root`` is not made a unit (its children still may be)."""
    ties = tie_counts(root)
    if not ties:
        return policy

    def splits_a_tie(module: nn.Module) -> bool:
        inside = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False) if id(p) in ties)
        return any(n < ties[key] for key, n in inside.items())

    def guarded(module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        wanted = policy(module, recurse, *args, **kwargs)
        if recurse or not wanted:
            return wanted
        return not splits_a_tie(module)

    return guarded


def check_not_split(module: nn.Module) -> None:
    """Fail when a parameter ``module`` is about to flatten was flattened already by a unit inside it.

    Raises:
        ValueError: naming the parameter's two names, and what to do.
    """
    flattened = {}
    for path, unit in module.named_modules():
        state = unit_state.peek(unit)
        if state is None:
            continue
        prefix = clean_path(path + ".") if path else ""
        for key, (ref, name) in state.flattened.items():
            flattened[key] = (ref, prefix + name)
    if not flattened:
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        found = flattened.get(id(param))
        # An inner unit's own parameter (sharded in place, `flatten_parameters=False`) is not a second copy.
        if found is not None and found[0]() is param and not hasattr(param, "_is_sharded"):
            name = clean_path(name)
            raise ValueError(
                f"The parameter `{name}` is tied to `{found[1]}` (one parameter under both names, as tied input and"
                f" output embeddings are), but the module holding `{found[1]}` was made an FSDP unit of its own, apart"
                f" from `{name}`: FairScale would keep two copies of the parameter that train apart. Wrap a module that"
                " holds both names (leave the embedding and the output layer to the enclosing unit: do not wrap either"
                " alone), or untie them."
            )


def record_flattened(unit: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
    """Note the parameters ``unit`` flattened (in its state, weakly: nothing is kept alive), for
    :func:`check_not_split`."""
    unit_state.of(unit).flattened = {id(p): (weakref.ref(p), name) for name, p in params}
