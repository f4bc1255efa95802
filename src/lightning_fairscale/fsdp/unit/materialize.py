"""Modules built on the ``meta`` device, given real tensors one FSDP unit at a time, just before it is sharded.

A model too large for one rank's memory is built without memory: on the ``meta`` device (``torch.device("meta")``,
or the strategies' ``init_module(empty_init=True)``), where tensors have shapes and dtypes but no data. Each FSDP
unit then calls :func:`materialize` on the module it wraps, before FairScale flattens and shards its parameters:

1. every parameter and buffer still on ``meta`` in the unit's own modules (not those of units inside it, which
   were materialised when they were wrapped) is replaced by an uninitialised tensor of its shape on the unit's
   device; a tensor shared by several modules stays shared;
2. each module that held such a tensor is initialised: ``param_init_fn(module)`` when the strategy was given one
   (torch FSDP's argument), else the module's own ``reset_parameters()``, modules in ``modules()`` order;
3. every tensor made in 1. must have been written: a floating-point one is filled with NaN in 1. and must hold no
   NaN now, any other one must have been changed in place (its version counter) or replaced.

A rank then never holds more than its shards of the units wrapped so far plus the unit being wrapped (for a moment
twice: FairScale copies a unit's parameters into one flat tensor before it shards that), never the full model.
Before step 1 every rank takes the random state of the first rank of the unit's process group (CPU, and the GPU's
when the unit lives there), so the initial weights are those of the same modules initialised in the same order on
one process from that state, on every rank, whatever each rank was seeded with.

Torch FSDP (``_materialize_meta_module``) does 1 and 2 but not 3: a buffer that ``reset_parameters()`` does not
set (one computed in ``__init__``, like position ids) would keep whatever memory it was given. Here it is an error
that names it, as is a module holding meta tensors that has no ``reset_parameters()`` when no ``param_init_fn`` is
given: that one is found before anything is materialised (:func:`check_materializable`), so on every rank alike and
before any collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_fairscale.distributed import collectives

__all__ = [
    "ParamInitFn",
    "check_materializable",
    "has_meta_tensors",
    "materialize",
    "to_device_keeping_meta",
    "validate_param_init_fn",
]

#: ``param_init_fn``: called with each module that held meta tensors, once they are on the unit's device (not yet
#: initialised), to initialise that module's own parameters and buffers in place.
ParamInitFn = Callable[[nn.Module], None]

_WHAT_TO_DO = (
    "Give {cls} a `reset_parameters()` that initialises every parameter and buffer the module holds itself (not"
    " its submodules'), or pass `DDPFullyShardedStrategy(param_init_fn=...)`: a function that is given each such"
    " module, with its tensors already on the device, and initialises them in place."
)


def validate_param_init_fn(param_init_fn: Any) -> Optional[ParamInitFn]:
    """``param_init_fn`` itself when it is ``None`` or callable; a ``TypeError`` that says what is expected else."""
    if param_init_fn is None or callable(param_init_fn):
        return param_init_fn
    raise TypeError(
        "`param_init_fn` must be a function that takes a module and initialises its own parameters and buffers in"
        f" place (as torch FSDP's `param_init_fn`), got {param_init_fn!r}."
    )


def _own_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its submodules, in ``named_modules()`` order, without FSDP units inside it and theirs."""
    seen: set[int] = set()

    def visit(current: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
        if id(current) in seen:
            return
        seen.add(id(current))
        yield path, current
        for name, child in current.named_children():
            if not isinstance(child, _FairScaleFSDP):
                yield from visit(child, f"{path}.{name}" if path else name)

    return visit(module, "")


def _meta_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s own parameters and buffers on the meta device."""
    tensors = [*module._parameters.items(), *module._buffers.items()]
    return [name for name, tensor in tensors if tensor is not None and tensor.is_meta]


def _modules_to_materialize(module: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """``(path, module, names of its meta tensors)`` of each of ``module``'s own modules that holds meta tensors."""
    found = [(path, m, _meta_names(m)) for path, m in _own_modules(module)]
    return [entry for entry in found if entry[2]]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether ``module``'s own modules (not those of FSDP units inside it) hold tensors on the meta device."""
    return any(_meta_names(m) for _, m in _own_modules(module))


def _describe(path: str, module: nn.Module, root_name: str) -> str:
    return f"`{path}` ({type(module).__name__})" if path else f"the {root_name} ({type(module).__name__})"


def check_materializable(
    module: nn.Module, param_init_fn: Optional[ParamInitFn], root_name: str = "model"
) -> list[tuple[str, nn.Module, list[str]]]:
    """The modules :func:`materialize` would initialise (``(path, module, meta tensor names)``); a ``ValueError``
    naming the first one that has no way to be initialised: no ``param_init_fn`` and no ``reset_parameters()``."""
    found = _modules_to_materialize(module)
    if param_init_fn is not None:
        return found
    for path, submodule, names in found:
        if not callable(getattr(submodule, "reset_parameters", None)):
            raise ValueError(
                f"{_describe(path, submodule, root_name)} holds {_quoted(names)} on the meta device and has no"
                f" `reset_parameters()`, so FSDP cannot initialise {'them' if len(names) > 1 else 'it'} when it"
                " shards the module. "
                + _WHAT_TO_DO.format(cls=type(submodule).__name__)
            )
    return found


def _quoted(names: list[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def materialize(
    module: nn.Module,
    device: torch.device,
    param_init_fn: Optional[ParamInitFn] = None,
    group: Optional[ProcessGroup] = None,
) -> bool:
    """Give ``module``'s meta tensors real, initialised ones on ``device`` (see the module's documentation).

    A collective call on ``group`` when there is anything to materialise (the random state of its first rank is
    shared), so every rank of ``group`` must call it for the same module. Returns whether anything was materialised.

    Example:
        >>> with torch.device("meta"):
        ...     layer = nn.Linear(2, 3)
        >>> materialize(layer, torch.device("cpu"))
        True
        >>> layer.weight.device, bool(layer.weight.isfinite().all())
        (device(type='cpu'), True)
    """
    found = check_materializable(module, param_init_fn, root_name="module wrapped as an FSDP unit")
    if not found:
        return False
    _share_random_state(group, device)
    # `made` keeps the new tensors alive until they are checked, so that their ids in `versions` stay theirs.
    made: dict[int, Tensor] = {}
    versions: dict[int, int] = {}
    with torch.no_grad(), torch.device(device):
        for _, submodule, names in found:
            for name in names:
                setattr(submodule, name, _empty_like(getattr(submodule, name), device, made, versions))
        for _, submodule, _ in found:
            if param_init_fn is not None:
                param_init_fn(submodule)
            else:
                submodule.reset_parameters()  # type: ignore[operator]
    how = "`param_init_fn`" if param_init_fn is not None else "`reset_parameters()`"
    for path, submodule, names in found:
        for name in names:
            _check_initialised(path, submodule, name, made, versions, how)
    return True


def _empty_like(tensor: Tensor, device: torch.device, made: dict[int, Tensor], versions: dict[int, int]) -> Tensor:
    """An uninitialised copy of ``tensor`` on ``device`` (the same one for a tensor seen before: shared stays shared),
    NaN when floating-point, so that what initialisation leaves out can be found."""
    if id(tensor) in made:
        return made[id(tensor)]
    fresh = torch.empty_like(tensor, device=device)
    if fresh.is_floating_point():
        fresh.fill_(float("nan"))
    if isinstance(tensor, nn.Parameter):
        fresh = nn.Parameter(fresh, requires_grad=tensor.requires_grad)
    made[id(tensor)] = fresh
    versions[id(fresh)] = fresh._version
    return fresh


def _check_initialised(
    path: str, module: nn.Module, name: str, made: dict[int, Tensor], versions: dict[int, int], how: str
) -> None:
    tensor = getattr(module, name)
    kind = "parameter" if name in module._parameters else "buffer"
    if tensor is None or tensor.is_meta:
        state = "is on the meta device again"
    elif id(tensor) not in versions:  # replaced by the initialisation: it is what the module wanted
        return
    elif tensor.is_floating_point() and tensor.numel() and bool(tensor.detach().max().isnan()):
        state = "was not initialised (it still holds NaN, what it was filled with before)"
    elif not tensor.is_floating_point() and tensor._version == versions[id(tensor)]:
        state = "was not initialised (it was neither written nor replaced)"
    else:
        return
    raise ValueError(
        f"After {how} of {_describe(path, module, 'module wrapped as an FSDP unit')}, its {kind} `{name}`, built on"
        f" the meta device, {state}. " + _WHAT_TO_DO.format(cls=type(module).__name__)
    )


def _share_random_state(group: Optional[ProcessGroup], device: torch.device) -> None:
    """Every rank of ``group`` takes the random state of its first rank (CPU, and ``device``'s when it is a GPU), so
    that random initialisation gives every rank the same tensors."""
    if not dist.is_available() or not dist.is_initialized():
        return
    # `dist.group.WORLD` is typed optional (``None`` before the default group exists); it exists here.
    group = group if group is not None else cast(ProcessGroup, dist.group.WORLD)
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    state = collectives.broadcast(torch.get_rng_state(), src=source, group=group)
    torch.set_rng_state(state)
    if device.type == "cuda":
        cuda_state = collectives.broadcast(torch.cuda.get_rng_state(device), src=source, group=group)
        torch.cuda.set_rng_state(cuda_state, device)


def to_device_keeping_meta(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)``, except that tensors on the meta device stay there (FSDP materialises them on the
    device of their unit when it wraps it); a module without meta tensors is moved with ``module.to``."""
    if not any(t.is_meta for t in _all_tensors(module)):
        module.to(device)
        return
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _all_tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()
