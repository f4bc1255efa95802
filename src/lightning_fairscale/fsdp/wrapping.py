"""Wrapping a LightningModule in FairScale FSDP units, and taking the units off again.

* :func:`auto_wrap_policy` turns the strategy's ``auto_wrap_policy``/``min_num_params`` into FairScale's policy:
  layer classes, FairScale's policy callables, and torch's (the policies of Lightning's own ``FSDPStrategy``).
* :func:`wrap_module` wraps the large layers (auto wrap) unless the user wrapped some already (manual wrap), then
  the root, so that every parameter belongs to exactly one unit.
* :func:`apply_activation_checkpointing` makes instances of given layer classes recompute their activations in the
  backward pass (FairScale's ``checkpoint_wrapper``), before wrapping, so checkpointing runs inside the FSDP unit.
* :func:`unwrap_module` undoes it unit by unit: full parameters come back as ordinary ``nn.Parameter`` objects on
  the original submodules, so the same LightningModule instance can be evaluated, saved or trained again.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional, Union

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
from torch.distributed.fsdp.wrap import _Policy as TorchPolicy  # the base of torch's policy objects

from lightning_fairscale.fsdp.fairscale_cpu import FullyShardedDataParallel, fsdp_instances
from lightning_fairscale.fsdp.materialize import check_materializable

__all__ = [
    "AutoWrapPolicy",
    "add_aliases",
    "apply_aliases",
    "module_aliases",
    "policy_signature",
    "apply_activation_checkpointing",
    "auto_wrap_policy",
    "checkpointing_layer_classes",
    "clean_path",
    "forget_root",
    "is_wrapped",
    "remember_root",
    "remove_activation_checkpointing",
    "root_parameters_visible",
    "unwrap_module",
    "validate_layer_classes",
    "wrap_module",
    "wrapped_root",
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

_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_fpw_module.")


def clean_path(path: str) -> str:
    """A module path without FairScale's wrapper names, as the unwrapped module would name it.

    Example:
        >>> clean_path("_fsdp_wrapped_module._fpw_module.layer._fsdp_wrapped_module._fpw_module.weight")
        'layer.weight'
    """
    for name in _WRAPPER_NAMES:
        path = path.replace(name, "")
    return path


def is_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is, or contains, a FairScale FSDP unit."""
    return next(fsdp_instances(module), None) is not None


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
        >>> from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
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
            units; their parameters belong to the enclosing unit. ``None``: FairScale's default for the size policy (``nn.MultiheadAttention``, which reads its
            parameters directly), nothing for the other policies.
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


def checkpointing_layer_classes(policy: Any) -> tuple[type[nn.Module], ...]:
    """The layer classes named by ``activation_checkpointing_policy`` (the argument of Lightning's ``FSDPStrategy``).

    Lightning checkpoints the modules its policy selects; the policies that select by class (a set of classes,
    ``ModuleWrapPolicy``, ``partial(transformer_auto_wrap_policy, transformer_layer_cls=...)``) become those classes,
    the strategy's ``activation_checkpointing``. A ``TypeError`` says what to pass for any other policy.

    Example:
        >>> checkpointing_layer_classes(ModuleWrapPolicy({nn.Linear}))
        (<class 'torch.nn.modules.linear.Linear'>,)
    """
    classes: Any = policy
    if isinstance(policy, ModuleWrapPolicy):
        classes = policy._module_classes  # torch's record of the classes it was given
    elif isinstance(policy, functools.partial) and policy.func is transformer_auto_wrap_policy:
        classes = policy.keywords.get("transformer_layer_cls")
    try:
        return validate_layer_classes(classes, "activation_checkpointing_policy")
    except TypeError:
        raise TypeError(
            "`activation_checkpointing_policy` must name the classes of the layers to checkpoint: a set of"
            " `nn.Module` subclasses (`{Block}`), `ModuleWrapPolicy({Block})` or"
            " `functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})`, got"
            f" {policy!r}. The strategy checkpoints every instance of the given classes; a policy that selects"
            " layers otherwise (by size, by a function) cannot be mapped onto classes: pass the classes of the"
            " layers it selects."
        ) from None


def validate_layer_classes(value: Any, argument: str) -> tuple[type[nn.Module], ...]:
    """``value`` as a tuple of ``nn.Module`` subclasses; a ``TypeError`` naming ``argument`` when it is not one.

    Example:
        >>> validate_layer_classes(nn.Linear, "activation_checkpointing")
        (<class 'torch.nn.modules.linear.Linear'>,)
    """
    if value is None:
        return ()
    classes = (value,) if isinstance(value, type) else value
    if isinstance(classes, (list, tuple, set, frozenset)) and all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in classes
    ):
        return tuple(classes)
    raise TypeError(
        f"`{argument}` must be an `nn.Module` subclass or a list of them (for example `{argument}=MyTransformerBlock`),"
        f" got {value!r}."
    )


def apply_activation_checkpointing(
    module: nn.Module, classes: tuple[type[nn.Module], ...], offload_to_cpu: bool = False
) -> list[nn.Module]:
    """Make every instance of ``classes`` in ``module`` recompute its activations in backward. Returns them.

    FairScale's ``checkpoint_wrapper`` patches the instance's ``forward`` in place, so module names (and so
    state-dict keys) do not change. Instances inside FSDP units (manual wrap) are checkpointed inside their unit.
    """
    if not classes:
        return []
    checkpointed = []
    for submodule in module.modules():
        if isinstance(submodule, classes) and is_wrapped(submodule):
            raise ValueError(
                f"`activation_checkpointing` includes {type(submodule).__name__}, but an instance of it contains FSDP"
                " units (wrapped in `configure_model`). Checkpointing must happen inside one FSDP unit: wrap the"
                f" {type(submodule).__name__} instance itself, not its children."
            )
        if isinstance(submodule, classes) and "forward" not in submodule.__dict__:
            checkpoint_wrapper(submodule, offload_to_cpu=offload_to_cpu)
            checkpointed.append(submodule)
    return checkpointed


def remove_activation_checkpointing(modules: Iterable[nn.Module]) -> None:
    """Give the modules their class's ``forward`` back (undo :func:`apply_activation_checkpointing`)."""
    for submodule in modules:
        submodule.__dict__.pop("forward", None)


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
        module = auto_wrap(module, auto_wrap_policy=policy)
    if not isinstance(module, _FairScaleFSDP):
        module = FullyShardedDataParallel(module, **fsdp_kwargs)
    return module


def module_aliases(root: nn.Module) -> list[tuple[str, str]]:
    """``(prefix, alias)`` pairs: every state-dict key starting with ``prefix`` also exists starting with ``alias``.

    A layer can be both an attribute of the LightningModule and part of a container that the user wrapped (the
    documentation's manual-wrap example does this). FSDP then saves its tensors under one name only; the plain
    module saves them under every name, and ``load_state_dict`` expects every name.
    """
    paths: dict[int, list[str]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        clean = clean_path(path + ".") if path else ""
        if clean not in paths.setdefault(id(module), []):
            paths[id(module)].append(clean)
    return [(known, alias) for names in paths.values() for known in names for alias in names if alias != known]


def apply_aliases(state_dict: dict[str, Any], aliases: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Add the keys :func:`module_aliases` names to ``state_dict`` (in place), and return it.

    Example:
        >>> apply_aliases({"blocks.0.weight": 1}, [("blocks.0.", "first.")])
        {'blocks.0.weight': 1, 'first.weight': 1}
    """
    for known, alias in aliases:
        for key in [k for k in state_dict if k.startswith(known)]:
            state_dict.setdefault(alias + key[len(known) :], state_dict[key])
    return state_dict


def add_aliases(state_dict: dict[str, Any], root: nn.Module) -> dict[str, Any]:
    """``state_dict`` with the keys of every module reachable under several names in ``root`` (see above)."""
    return apply_aliases(state_dict, module_aliases(root))


def _full_parameters(unit: _FairScaleFSDP, device: torch.device, keep: bool) -> list[torch.Tensor]:
    """Clones of ``unit``'s own parameters, unsharded, in the order of ``unit.params`` (with ``keep=False``, empty
    tensors of their shapes on the ``meta`` device). A collective call."""
    with unit.summon_full_params(recurse=False, volatile=True):
        if not keep:
            return [torch.empty_like(p, device="meta") for p in unit.params]
        return [p.detach().to(device=device, copy=True) for p in unit.params]


def unwrap_module(root: nn.Module, device: torch.device = torch.device("cpu"), keep: bool = True) -> nn.Module:
    """Take every FSDP unit out of ``root`` and give the original submodules their full parameters back.

    Every rank gathers one unit at a time (peak memory: the largest unit, plus the result on ``device``), so all
    ranks must call this together. With ``keep=False`` this rank keeps nothing: its parameters end up on the
    ``meta`` device (so that one rank alone can hold the full model). Returns the unwrapped root (``root`` itself when
    it is not an FSDP unit).
    """
    units = list(fsdp_instances(root))
    if not units:
        return root
    full = {}
    for unit in units:  # one unit at a time: each unit's gathered parameters are freed before the next is gathered
        full[id(unit)] = _full_parameters(unit, device, keep)
    for unit in units:
        if unit.mixed_precision:
            unit._cast_buffers(dtype=torch.float32)
        tensors = full[id(unit)]
        flat_count = unit._num_flatten_params
        flat_params, flat_data = unit.params[:flat_count], tensors[:flat_count]
        if flat_params:
            unit.module._unflatten_params(external_data=flat_data)
            for flat, (_, owner, name), frozen in _flat_pieces(flat_params):
                getattr(owner, name).requires_grad_(flat.requires_grad and not frozen)
            for flat in flat_params:
                # The flat parameter's gradient hook refers back to its unit through autograd, a cycle that Python's
                # garbage collector cannot see: without this, every unwrapped unit (and its shards) would live on.
                _forget_fsdp_attributes(flat)
        plain = unit.params[flat_count:]
        owners = _owners(unit.module, plain) if plain and not keep else {}
        for param, data in zip(plain, tensors[flat_count:]):
            param.grad = None
            _forget_fsdp_attributes(param)
            if keep:
                param.data = data
                continue
            # torch refuses `param.data = <meta tensor>` for a CPU or CUDA parameter: replace the parameter.
            replacement = nn.Parameter(data, requires_grad=param.requires_grad)
            for owner, name in owners[id(param)]:
                owner._parameters[name] = replacement
    return _replace_units(root)


def _owners(module: nn.Module, params: list[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    """For each of ``params`` (by ``id``), the modules that hold it and under which name (shared ones: several)."""
    wanted = {id(p) for p in params}
    owners: dict[int, list[tuple[nn.Module, str]]] = {id(p): [] for p in params}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and id(param) in wanted:
                owners[id(param)].append((owner, name))
    return owners


#: The attribute of a LightningModule that holds its root FSDP unit while the module stays sharded between stages.
_ROOT_ATTRIBUTE = "_lightning_fairscale_root"


def remember_root(module: nn.Module, root: _FairScaleFSDP) -> None:
    """Record that ``module`` is wrapped by ``root``, so that a later stage (``validate`` after ``fit``...) reuses
    the sharded model instead of gathering and wrapping it again. Not a submodule: ``root`` contains ``module``."""
    object.__setattr__(module, _ROOT_ATTRIBUTE, root)


def wrapped_root(module: nn.Module) -> Optional[_FairScaleFSDP]:
    """The root unit that wraps ``module`` (see :func:`remember_root`), or ``None`` when it is not wrapped."""
    root = module.__dict__.get(_ROOT_ATTRIBUTE)
    return root if isinstance(root, _FairScaleFSDP) and _original(root) is module else None


def forget_root(module: nn.Module) -> None:
    """Undo :func:`remember_root` (after unwrapping)."""
    module.__dict__.pop(_ROOT_ATTRIBUTE, None)


@contextlib.contextmanager
def root_parameters_visible(root: _FairScaleFSDP) -> Iterator[None]:
    """Inside this context, the wrapped module's ``parameters()`` include the root unit's own managed parameters.

    FairScale moves the parameters that no inner unit holds into a flat parameter of the wrapper *around* the
    module, where ``module.parameters()`` does not see them. When optimizers are created over a module that is
    already sharded (``fit`` after ``validate``), ``configure_optimizers``' ``self.parameters()`` would silently leave
    them out; they are registered on the module under hidden names while it runs.
    """
    module = _original(root)
    names = [f"_fsdp_root_param_{i}" for i in range(len(root.params))]
    for name, param in zip(names, root.params):
        module._parameters[name] = param
    try:
        yield
    finally:
        for name in names:
            module._parameters.pop(name, None)


def _flat_pieces(
    flat_params: Iterable[nn.Parameter],
) -> Iterable[tuple[nn.Parameter, tuple[str, nn.Module, str], bool]]:
    """Each original parameter of ``flat_params``: its flat parameter, FairScale's ``(module name, owner, name)``,
    and whether it was frozen in a unit that also trains (FairScale workaround 11)."""
    for flat in flat_params:
        infos = flat._param_infos  # type: ignore[attr-defined]
        frozen = flat.__dict__.get("_lightning_fairscale_frozen") or [False] * len(infos)
        yield from ((flat, info, is_frozen) for info, is_frozen in zip(infos, frozen))


_FSDP_PARAM_ATTRIBUTES = (
    "_is_sharded",
    "_orig_size",
    "_fp32_shard",
    "_fp16_shard",
    "_full_param_padded",
    "_cpu_grad",
    "_shard_bwd_hook",
    "_saved_grad_shard",
)


def _forget_fsdp_attributes(param: nn.Parameter) -> None:
    for name in _FSDP_PARAM_ATTRIBUTES:
        if hasattr(param, name):
            delattr(param, name)


def _original(unit: _FairScaleFSDP) -> nn.Module:
    return unit.module.module  # FSDP -> FlattenParamsWrapper -> the user's module


def _replace_units(module: nn.Module) -> nn.Module:
    """Replace every unit in the tree by the module it wraps; innermost units are handled by the recursion."""
    if isinstance(module, _FairScaleFSDP):
        return _replace_units(_original(module))
    for name, child in list(module.named_children()):
        replacement = _replace_units(child)
        if replacement is not child:
            setattr(module, name, replacement)
    return module
