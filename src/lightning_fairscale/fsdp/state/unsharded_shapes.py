"""The sharded model's parameters with their unsharded shapes, while an optimizer's param groups are made.

Once a model is sharded its parameters are this rank's 1-D views of the flat shards
(:mod:`~lightning_fairscale.fsdp.unit.original_params`), so the most common recipe for AdamW's param groups,
``decay = [p for p in model.parameters() if p.ndim >= 2]``, puts every matrix in the no-decay group, and the run
trains something else than the same code unsharded, without an error. Inside :func:`unsharded_shapes` each parameter
shows what it shows unsharded where param groups are made from: ``shape``, ``ndim``, ``size()``, ``dim()``,
``numel()``, its name, ``dtype``, ``device`` and ``requires_grad``; it is the same ``Parameter`` object, so the
optimizer made over it is re-pointed to the shards as one made before wrapping. Its values are not there: any other
use of it inside the context (reading, writing, ``.data``, ``repr``) raises :class:`ValuesUnavailableError`, which
says what to do; its data is restored when the context ends.

How: each parameter's data is, for the context, a tensor of the unsharded shape on its own device and of its own
dtype that holds one element (a NaN, repeated by zero strides: no memory for the full parameter, and a write into
it fails), and a ``TorchFunctionMode`` answers for the parameters (shape-only questions pass, any other function
that gets one of them raises).

:func:`param_group_problem` tells an optimizer made over the sharded model's parameters outside this context (Fabric's
``fabric.setup_optimizers``) by the two marks such a recipe leaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode

from lightning_fairscale.fsdp.state.optim import ParameterLayout
from lightning_fairscale.fsdp.unit.sharded_reads import tensors_in

__all__ = ["ValuesUnavailableError", "param_group_problem", "shaped_params", "unsharded_shapes"]


class ValuesUnavailableError(RuntimeError):
    """A parameter's values were used inside :func:`unsharded_shapes`, where it shows only its unsharded shape."""


def _answered() -> frozenset[Callable[..., Any]]:
    """What a parameter answers inside the context: its metadata (the unsharded shape; the rest is its own)."""
    methods: list[Callable[..., Any]] = [
        Tensor.size, Tensor.dim, Tensor.ndimension, Tensor.numel, Tensor.nelement, Tensor.__len__, Tensor.__hash__,
        Tensor.get_device, Tensor.is_floating_point, Tensor.is_complex, Tensor.element_size, Tensor.requires_grad_,
    ]
    properties = (
        "shape", "ndim", "dtype", "device", "is_cuda", "is_cpu", "is_meta", "layout", "requires_grad", "is_leaf",
        "retains_grad", "grad", "grad_fn",
    )
    # A property reaches `__torch_function__` as its descriptor's `__get__` (`__set__` when assigned).
    methods += [getattr(Tensor, name).__get__ for name in properties]
    methods += [getattr(Tensor, name).__set__ for name in ("requires_grad", "grad")]
    return frozenset(methods)


_ANSWERED = _answered()


class _ShapesOnly(TorchFunctionMode):
    """Raises :class:`ValuesUnavailableError` for any function but the metadata ones (:func:`_answered`) that gets a
    stood-in parameter."""

    def __init__(self, names: dict[int, str], shards: dict[int, int], where: str, instead: str) -> None:
        super().__init__()
        self._names, self._shards, self._where, self._instead = names, shards, where, instead

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _ANSWERED:
            for leaf in tensors_in((args, kwargs)):
                if id(leaf) in self._names:
                    raise ValuesUnavailableError(self._message(leaf, func))
        return func(*args, **kwargs)

    def _message(self, param: Tensor, func: Callable[..., Any]) -> str:
        name = self._names[id(param)]
        what = getattr(func, "__name__", None) or str(func)
        return (
            f"The values of parameter `{name}` were used ({what}) {self._where}, where the sharded model's parameters"
            " show only what they show unsharded (shape, `ndim`, `numel()`, name, dtype, device, `requires_grad`):"
            f" FSDP holds their values in shards ({self._shards[id(param)]} of its {param.numel()} elements on this"
            f" rank). Make the optimizer's param groups from those; {self._instead}"
        )


def shaped_params(layout: ParameterLayout) -> dict[nn.Parameter, tuple[str, torch.Size]]:
    """The parameters the sharded model shows (this rank's views of the flat parameters' original parameters, and
    the parameters sharded in place), each with its name and unsharded shape."""
    found: dict[nn.Parameter, tuple[str, torch.Size]] = {}
    for managed, info in layout.managed.items():
        if hasattr(managed, "_param_infos"):  # a flat parameter: its original parameters are views of it
            for k, piece in enumerate(info.pieces):
                found.setdefault(layout.view(managed, k).param, (piece.name, piece.shape))
        else:  # `flatten_parameters=False`: the parameter itself, sharded in place
            piece = info.pieces[0]
            found.setdefault(managed, (piece.name, piece.shape))
    return found


@contextlib.contextmanager
def unsharded_shapes(layout: ParameterLayout, where: str, instead: str) -> Iterator[None]:
    """Inside this context the sharded model's parameters show their unsharded shapes and no values (see the
    module's docstring); ``where`` (e.g. "inside `configure_optimizers`") and ``instead`` (what to do) complete the
    error a use of their values raises."""
    params = shaped_params(layout)
    saved: list[tuple[nn.Parameter, Tensor]] = []
    names = {id(param): name for param, (name, _) in params.items()}
    shards = {id(param): param.numel() for param in params}
    try:
        with torch.no_grad():
            for param, (_, shape) in params.items():
                data = param.data
                saved.append((param, data))
                # One NaN repeated by zero strides: no memory for the full parameter; a write into it fails.
                param.data = torch.full((), float("nan"), dtype=data.dtype, device=data.device).expand(shape)
        with _ShapesOnly(names, shards, where, instead):
            yield
    finally:
        with torch.no_grad():
            for param, data in saved:
                param.data = data


def param_group_problem(optimizer: Optimizer, layout: ParameterLayout) -> Optional[str]:
    """What shows that ``optimizer``'s param groups were made from the sharded model's parameters as they are
    outside :func:`unsharded_shapes` (``None`` when nothing does):

    * a param group holds none of the sharded model's parameters while another holds some: every parameter is 1-D
      here, so a selection by ``ndim`` or shape (``p.ndim >= 2``) matched none of them;
    * several param groups and a FairScale flat parameter (of units wrapped by hand, before the model was set up):
      one flat parameter is many original parameters, and their groups cannot have been told apart by name or shape.
    """
    groups = optimizer.param_groups
    if len(groups) < 2:
        return None
    shown = shaped_params(layout)
    flat = [param for group in groups for param in group["params"] if hasattr(param, "_param_infos")]
    if flat:
        return (
            f"it has {len(groups)} param groups and holds FairScale's flat parameters of units wrapped by hand"
            f" (a flat parameter of {len(flat[0]._param_infos)} parameters, in param group"
            f" {next(i for i, g in enumerate(groups) if any(p is flat[0] for p in g['params']))}): each one holds the"
            " parameters of a whole unit, so param groups made by the parameters' names or shapes (weight decay on"
            " matrices only...) cannot be kept"
        )
    held = [sum(1 for param in group["params"] if param in shown) for group in groups]
    if 0 in held and any(held):
        return (
            f"its param group {held.index(0)} holds none of the sharded model's parameters: they are this rank's 1-D"
            " views of the shards, so a selection by `ndim` or shape (`p.ndim >= 2`) matches none of them"
        )
    return None
