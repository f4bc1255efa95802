"""Auto-wrap policies: the strategy's ``auto_wrap_policy``/``min_num_params`` as FairScale's policy (layer classes,
FairScale's policy callables and torch's, the policies of Lightning's own ``FSDPStrategy``), and :func:`wrap_module`,
which wraps the large layers (auto wrap) unless the user wrapped some already (manual wrap), then the root, so that
every parameter belongs to exactly one unit."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy
from torch import nn

from lightning_fairscale.distributed.torch_private import TorchPolicy
from lightning_fairscale.fsdp.unit.materialize import check_materializable
from lightning_fairscale.fsdp.unit.state_names import is_wrapped
from lightning_fairscale.fsdp.unit.ties import keep_ties_together
from lightning_fairscale.fsdp.unit.units import FullyShardedDataParallel

__all__ = [
    "AutoWrapPolicy",
    "PolicyCallable",
    "auto_wrap_policy",
    "policy_signature",
    "validate_auto_wrap_policy",
    "wrap_module",
]


#: A policy callable: FairScale's signature ``(module, recurse, unwrapped_params, module_is_root) -> bool`` or torch's
#: ``(module, recurse, nonwrapped_numel) -> bool``.
PolicyCallable = Callable[..., bool]


#: What the strategy accepts: a policy callable, one of torch's policy objects (``ModuleWrapPolicy``...), or layer
#: classes whose instances become units.
AutoWrapPolicy = Union[PolicyCallable, TorchPolicy, Iterable[type[nn.Module]]]


#: The keywords with which each auto wrap calls a policy callable: FairScale's ``auto_wrap`` and torch's FSDP.
_FAIRSCALE_KEYWORDS = ("module", "recurse", "unwrapped_params", "module_is_root")


_TORCH_KEYWORDS = ("module", "recurse", "nonwrapped_numel")


def _wrap_layer_classes(
    module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool, layer_classes: tuple[type, ...]
) -> bool:
    if recurse:
        return True  # look inside every module for instances of the classes
    return isinstance(module, layer_classes)


def _units_of_their_own(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool,
    units: frozenset[int],
    inside: frozenset[int],
    around: frozenset[int],
    policy: PolicyCallable,
) -> bool:
    if id(module) in inside:
        return False  # part of a layer that becomes a unit of its own: never wrapped separately
    if id(module) in units:
        return True  # look inside (nothing there gets wrapped), then wrap the layer itself
    if recurse and id(module) in around:
        return True  # always look inside modules that hold such a layer, whatever the size policy says
    return policy(module=module, recurse=recurse, unwrapped_params=unwrapped_params, module_is_root=module_is_root)


def _with_controls(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool,
    policy: PolicyCallable,
    exclude: tuple[type[nn.Module], ...],
    force_leaf: tuple[type[nn.Module], ...],
) -> bool:
    if recurse and isinstance(module, force_leaf):
        return False
    if not recurse and isinstance(module, exclude):
        return False
    return policy(module=module, recurse=recurse, unwrapped_params=unwrapped_params, module_is_root=module_is_root)


def _call_problem(policy: Callable[..., Any], keywords: tuple[str, ...]) -> Optional[str]:
    """Why ``policy`` cannot be called with ``keywords`` (``None`` when it can)."""
    try:
        inspect.signature(policy).bind(**dict.fromkeys(keywords))
    except ValueError as error:  # a partial whose bound arguments do not fit its function, a builtin
        return str(error.__cause__ or error)
    except TypeError as error:
        return str(error)
    return None


def policy_signature(policy: Callable[..., Any]) -> Optional[str]:
    """``"fairscale"`` or ``"torch"``: whose auto wrap can call ``policy`` (FairScale's when both can), else ``None``.

    A ``functools.partial`` is read with its bound keywords, so ``partial(size_based_auto_wrap_policy,
    min_num_params=N)`` takes torch's keywords and not FairScale's.

    Example:
        >>> from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
        >>> policy_signature(functools.partial(size_based_auto_wrap_policy, min_num_params=100))
        'torch'
        >>> policy_signature(functools.partial(default_auto_wrap_policy, min_num_params=100))
        'fairscale'
        >>> policy_signature(transformer_auto_wrap_policy) is None  # `transformer_layer_cls` is not given
        True
    """
    if _call_problem(policy, _FAIRSCALE_KEYWORDS) is None:
        return "fairscale"
    if _call_problem(policy, _TORCH_KEYWORDS) is None:
        return "torch"
    return None


def _torch_signature_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool, policy: PolicyCallable
) -> bool:
    # Both auto wraps count the same thing: the elements (numel) of the module's parameters that no unit below it
    # holds yet. So `min_num_params=N` makes the same units under either.
    return bool(policy(module=module, recurse=recurse, nonwrapped_numel=unwrapped_params))


def _torch_policy_object(
    module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool, policy: TorchPolicy
) -> bool:
    if recurse:
        return True  # torch runs its policy objects over every module of the model
    # The policy asked about this module alone: FairScale asks about each submodule itself.
    submodules = set(module.modules()) - {module}
    chosen = policy._run_policy(module, ignored_modules=submodules, root_kwargs={})
    if module not in chosen:
        return False
    if chosen[module]:
        raise ValueError(
            f"`auto_wrap_policy={policy!r}` gives {type(module).__name__} its own FSDP arguments {chosen[module]}."
            " Those are arguments of torch's FSDP; every FairScale unit of the strategy is built with the strategy's"
            " settings. Return True for this module instead of a dict."
        )
    return True


def _as_fairscale_policy(policy: AutoWrapPolicy) -> PolicyCallable:
    """``policy`` (layer classes, a policy callable of either signature, a torch policy object) as FairScale's."""
    if isinstance(policy, TorchPolicy):  # before `callable`: ModuleWrapPolicy is callable too
        return functools.partial(_torch_policy_object, policy=policy)
    if isinstance(policy, type) or not callable(policy):
        classes = (policy,) if isinstance(policy, type) else tuple(policy)
        return functools.partial(_wrap_layer_classes, layer_classes=classes)
    if policy_signature(policy) == "torch":
        return functools.partial(_torch_signature_policy, policy=policy)
    return policy


def auto_wrap_policy(
    policy: Optional[AutoWrapPolicy],
    min_num_params: int,
    own_units: Iterable[nn.Module] = (),
    root: Optional[nn.Module] = None,
    exclude_wrap_modules: Optional[Iterable[type[nn.Module]]] = None,
    force_leaf_modules: Optional[Iterable[type[nn.Module]]] = None,
) -> PolicyCallable:
    """The FairScale auto-wrap policy for the strategy's arguments.

    Args:
        policy: ``None`` for FairScale's size policy with ``min_num_params``; a set (or list, tuple) of layer classes
            to make each instance of them its own unit; a callable with FairScale's policy signature or with torch's
            (``partial(transformer_auto_wrap_policy, ...)``, ``partial(size_based_auto_wrap_policy, ...)``); or one
            of torch's policy objects (``ModuleWrapPolicy``, ``CustomPolicy``), which make the same units as under
            torch's FSDP.
        min_num_params: the size threshold of the default policy.
        exclude_wrap_modules: layer classes never made units themselves (their children still can be). ``None``:
            FairScale's default for the size policy (``nn.ModuleList``, ``nn.ModuleDict``: containers without a
            ``forward`` cannot be units), nothing for the other policies.
        force_leaf_modules: layer classes auto wrap does not descend into: neither they nor their children become
            units; their parameters belong to the enclosing unit. ``None``: FairScale's default for the size policy
            (``nn.MultiheadAttention``, which reads its parameters directly), nothing for the other policies.
        own_units: modules that become units of their own, with nothing wrapped inside them (activation-checkpointed
            layers: their recomputation must happen inside one FSDP unit).
        root: the module that will be wrapped; needed with ``own_units`` so that the modules holding them are
            always searched.

    Example:
        >>> policy = auto_wrap_policy({nn.Linear}, min_num_params=0)
        >>> policy(nn.Linear(2, 2), recurse=False, unwrapped_params=6, module_is_root=False)
        True
        >>> policy(nn.ReLU(), recurse=False, unwrapped_params=0, module_is_root=False)
        False
        >>> from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        >>> policy = auto_wrap_policy(ModuleWrapPolicy({nn.Linear}), min_num_params=0)
        >>> policy(nn.Linear(2, 2), recurse=False, unwrapped_params=6, module_is_root=False)
        True
        >>> policy = auto_wrap_policy(None, min_num_params=10, exclude_wrap_modules={nn.Sequential})
        >>> policy(nn.Sequential(nn.Linear(4, 4)), recurse=False, unwrapped_params=20, module_is_root=False)
        False
    """
    base: PolicyCallable
    if policy is None:
        base = functools.partial(
            default_auto_wrap_policy,
            min_num_params=min_num_params,
            exclude_wrap_modules=None if exclude_wrap_modules is None else set(exclude_wrap_modules),
            force_leaf_modules=None if force_leaf_modules is None else set(force_leaf_modules),
        )
    else:
        base = _as_fairscale_policy(policy)
        if exclude_wrap_modules or force_leaf_modules:
            base = functools.partial(
                _with_controls,
                policy=base,
                exclude=tuple(exclude_wrap_modules or ()),
                force_leaf=tuple(force_leaf_modules or ()),
            )
    own_units = list(own_units)
    if own_units:
        units = frozenset(id(m) for m in own_units)
        inside = frozenset(id(m) for unit in own_units for m in unit.modules() if m is not unit)
        around = frozenset(
            id(m) for m in (root.modules() if root is not None else ()) if any(id(c) in units for c in m.modules())
        )
        return functools.partial(
            _units_of_their_own, units=units, inside=inside - units, around=around - units, policy=base
        )
    return base


def validate_auto_wrap_policy(policy: Any) -> None:
    """Raise a ``TypeError`` that says what is accepted when ``policy`` is not a valid ``auto_wrap_policy``."""
    if policy is None or isinstance(policy, TorchPolicy):
        return
    if isinstance(policy, type):
        policy = {policy}
    problem = ""
    if callable(policy):
        if policy_signature(policy) is not None:
            return
        problem = (
            f": it cannot be called with FairScale's keywords ({_call_problem(policy, _FAIRSCALE_KEYWORDS)}) nor with"
            f" torch's ({_call_problem(policy, _TORCH_KEYWORDS)})"
        )
    elif isinstance(policy, (set, frozenset, list, tuple)) and policy:
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not bad:
            return
    raise TypeError(
        "`auto_wrap_policy` must be a non-empty set of `nn.Module` subclasses whose instances become FSDP units, a"
        " callable with FairScale's policy signature `(module, recurse, unwrapped_params, module_is_root) -> bool`"
        " or torch's `(module, recurse, nonwrapped_numel) -> bool` (for example"
        " `functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})`), or one of torch's"
        f" policy objects (`ModuleWrapPolicy({{Block}})`), got {policy!r}{problem}."
    )


def wrap_module(module: nn.Module, policy: PolicyCallable, **fsdp_kwargs: Any) -> FullyShardedDataParallel:
    """Wrap ``module`` so that each of its parameters belongs to one FSDP unit, and return the root unit.

    Modules the user wrapped already (manual wrap) are kept as they are, and no auto wrap happens then; otherwise
    the ``policy`` decides which submodules become units. The remaining parameters go to the root unit.
    Must be called inside an ``enable_wrap`` context that carries ``fsdp_kwargs``.
    """
    # A module built on the meta device fails here, on every rank alike and before any unit is materialised, when a
    # part of it cannot be initialised.
    check_materializable(module, fsdp_kwargs.get("param_init_fn"))
    if not is_wrapped(module):
        # A unit never takes some names of a tied parameter without the others (see `fsdp.unit.ties`).
        module = auto_wrap(module, auto_wrap_policy=keep_ties_together(policy, module))
    if not isinstance(module, _FairScaleFSDP):
        module = FullyShardedDataParallel(module, **fsdp_kwargs)
    return module
