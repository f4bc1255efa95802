"""Parameters that know they are sharded: what user code reads outside a unit's forward is the whole parameter.

Between a unit's forwards each original parameter is this rank's 1-D slice of FairScale's flat shard
(:mod:`~lightning_fairscale.fsdp.unit.param_views`). Here it is a :class:`ShardedParameter`, and the gradient it is
given a :class:`ShardedTensor`: they carry their :class:`ShardLayout` (the whole shape, every rank's element range,
the shard group), so that what the *user's* code computes on them is what it computes on the unsharded parameter,
as DTensor does for PyTorch's FSDP2:

* a full reduction (``sum``, ``mean``, ``norm``, ``linalg.vector_norm``, ``torch._foreach_norm``, ``amax``...)
  reduces the local slices across the shard group, with autograd: its backward gives each rank the gradient of its
  slice, averaged over the ranks as DDP averages gradients;
* an element-wise operation of tensors of one layout (``p.pow(2)``, ``p * 0.1``, ``p - p.detach()``) stays local and
  its result keeps the layout, so that ``p.pow(2).sum()`` is one reduction;
* an in-place element-wise operation (clipping's ``_foreach_mul_``) stays local;
* anything else (``t()``, ``@``, ``reshape``, indexing, ``print``, an operand of another layout) gathers the whole
  parameter, with autograd (the backward averages the whole gradient and keeps this rank's slice); ``.shape``,
  ``size()``, ``numel()``, ``dim()`` answer the whole parameter's.

Whose code reads decides: calls made from our engine, FairScale, Lightning, ``torch.optim`` (the optimizer keeps its
local 1-D tensors), ``torch.distributed`` and ``torch.nn.Module``'s bookkeeping, or inside :func:`local_reads`, keep
plain local semantics; ``.data`` is always the local slice. A read is a collective: the first time a parameter is
read some way, the ranks agree through the store within :data:`AGREEMENT_TIMEOUT` seconds, so that a read made on
one rank only ends in an error naming the parameter, never in a hang.
"""

from __future__ import annotations

import copy
import math
import zlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_fairscale.distributed.torch_private import plain_torch_functions
from lightning_fairscale.fsdp.unit.shard_layout import (
    Gather,
    ShardLayout,
    SumAcrossShards,
    agree,
    group_world,
    local_reads,
    reads_locally,
)

__all__ = [
    "ShardLayout",
    "ShardedParameter",
    "ShardedTensor",
    "layout_of",
    "local_reads",
    "local_slice",
    "mark",
    "whole",
]


class ShardedTensor(Tensor):
    """A tensor holding this rank's elements of a sharded parameter's (its gradient, an element-wise result)."""

    _shard_layout: Optional[ShardLayout] = None

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved as the plain tensor it holds (no process group)
        with plain_torch_functions():
            return self.as_subclass(Tensor).__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


class ShardedParameter(nn.Parameter):
    """An original parameter's view (:mod:`~lightning_fairscale.fsdp.unit.param_views`) that knows its layout."""

    _shard_layout: Optional[ShardLayout] = None

    def __new__(cls, data: Tensor, requires_grad: bool = True, layout: Optional[ShardLayout] = None) -> Any:
        param = Tensor._make_subclass(cls, data, requires_grad)
        param._shard_layout = layout
        return param

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved as the plain parameter it holds (no process group)
        return (nn.Parameter, (self.data, self.requires_grad))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy of this rank's slice that knows its layout too (``copy.deepcopy`` of the parameters: EMA)."""
        if id(self) not in memo:
            with plain_torch_functions():
                data = self.data.clone(memory_format=torch.preserve_format)
            layout = copy.deepcopy(self._shard_layout, memo)
            memo[id(self)] = type(self)(data, self.requires_grad, layout)
        return memo[id(self)]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _dispatch(func, args, kwargs or {})


def mark(tensor: Tensor, layout: ShardLayout) -> ShardedTensor:
    """``tensor`` (this rank's elements of a parameter of ``layout``) as a :class:`ShardedTensor`, same storage."""
    with plain_torch_functions():
        marked = tensor.as_subclass(ShardedTensor)
    marked._shard_layout = layout
    return marked  # type: ignore[return-value]


def layout_of(tensor: Any) -> Optional[ShardLayout]:
    """The layout of ``tensor`` when it holds exactly its rank's elements (a view whose ``.data`` another path swapped
    for the whole tensor during a step is plain), else ``None``."""
    if not isinstance(tensor, (ShardedTensor, ShardedParameter)):
        return None
    layout = tensor._shard_layout
    if layout is None:
        return None
    with plain_torch_functions():
        return layout if tensor.numel() == layout.local_numel else None


def local_slice(tensor: Tensor) -> Tensor:
    """This rank's elements of ``tensor`` (a parameter or its gradient), a plain 1-D tensor, no collective; any other
    tensor as it is. Autograd flows through it to the parameter."""
    if layout_of(tensor) is None:
        return tensor
    with plain_torch_functions():
        return tensor.as_subclass(Tensor)


def whole(tensor: Tensor) -> Tensor:
    """The whole of ``tensor`` (a sharded parameter or its gradient), gathered with autograd: a collective, to call on
    every rank alike. Any other tensor as it is."""
    layout = layout_of(tensor)
    if layout is None:
        return tensor
    agree(layout, "gather")
    return Gather.apply(local_slice(tensor), layout)


# ------------------------------------------------------------------------------------------------------------------
# The rules


#: Element-wise operations: of tensors of one layout (and scalars), local, their result of that layout.
_ELEMENTWISE = frozenset(
    "abs neg pow sqrt rsqrt exp expm1 log log1p log2 square sign sgn sigmoid tanh relu reciprocal sin cos clamp clip "
    "clamp_min clamp_max add sub mul div true_divide lerp addcmul addcdiv maximum minimum detach clone contiguous to "
    "float double half bfloat16 cpu cuda type_as zeros_like ones_like full_like empty_like eq ne lt le gt ge isnan "
    "isfinite isinf logical_not nan_to_num floor ceil round trunc frac __add__ __radd__ __sub__ __rsub__ __mul__ "
    "__rmul__ __truediv__ __rtruediv__ __pow__ __rpow__ __neg__ __abs__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__"
    .split()
)
#: What stays local whatever the operands: bookkeeping, not values.
_PLAIN = frozenset(
    "__get__ __set__ __delete__ __hash__ __reduce_ex__ __setstate__ __deepcopy__ requires_grad_ retain_grad "
    "register_hook register_post_accumulate_grad_hook data_ptr untyped_storage storage stride is_contiguous "
    "element_size is_floating_point is_complex get_device share_memory_ pin_memory is_pinned".split()
)
_SHAPES = frozenset("size dim ndimension numel nelement __len__".split())
_REDUCTIONS = frozenset("sum nansum mean norm linalg_vector_norm linalg_norm amax amin max min".split())
#: Property getters (what ``__torch_function__`` is given for ``t.shape``...): those answered from the layout, and
#: those that need the whole tensor.
_GETTERS = {getattr(Tensor, name).__get__: name for name in ("shape", "ndim", "grad")}
_WHOLE_GETTERS = {getattr(Tensor, name).__get__ for name in ("T", "mT", "H", "mH")}


def _dispatch(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    if reads_locally():
        with plain_torch_functions():
            return func(*args, **kwargs)
    getter = _GETTERS.get(func)
    if getter is not None:
        return _get(getter, args[0])
    name = getattr(func, "__name__", "")
    if name in _PLAIN and func not in _WHOLE_GETTERS:
        with plain_torch_functions():
            return func(*args, **kwargs)
    tensors = list(tensors_in((args, kwargs)))
    layouts = [layout for layout in map(layout_of, tensors) if layout is not None]
    if not layouts:  # a view whose `.data` is the whole tensor now (another path's step): plain
        with plain_torch_functions():
            return func(*args, **kwargs)
    if name in _SHAPES:
        return _shape(name, layouts[0], args[1:], kwargs)
    if name == "_foreach_norm":
        return _foreach_norm(args, kwargs)
    if name in _REDUCTIONS and layout_of(args[0]) is not None:
        reduced = _reduce(name, args, kwargs)
        if reduced is not None:
            return reduced
    one_layout = all(layouts[0].same_split(layout) for layout in layouts) and all(
        layout_of(t) is not None or t.dim() == 0 for t in tensors
    )
    in_place = "out" in kwargs or name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
    in_place = in_place or (name.startswith("__i") and name not in ("__index__", "__int__", "__invert__"))
    foreach = "_foreach_" in name  # `_foreach_mul_`, `_amp_foreach_non_finite_check_and_unscale_`...
    targets = args[0] if foreach and args and isinstance(args[0], (list, tuple)) else args[:1]
    if in_place and any(layout_of(t) is not None for t in targets):
        if one_layout or foreach:
            with plain_torch_functions():  # element-wise on this rank's elements (clipping's `_foreach_mul_`)
                return func(*args, **kwargs)
        raise RuntimeError(
            f"`{layouts[0].name}` is sharded under DDPFullyShardedStrategy: `{name}` would change it in place from "
            "whole tensors, which cannot be made exact on its slice. Change `param.data` (this rank's slice) "
            "inside `with lightning_fairscale.local_reads():`, or compute element-wise."
        )
    if name in _ELEMENTWISE and one_layout and not in_place:
        with plain_torch_functions():
            result = func(*args, **kwargs)
        return mark(result, layouts[0]) if isinstance(result, Tensor) else result
    return _whole_call(func, args, kwargs)


def tensors_in(tree: Any) -> Iterator[Tensor]:
    """The tensors in a function's arguments (inside lists, tuples and dicts)."""
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from tensors_in(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from tensors_in(item)


def _replace(tree: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        replaced = [_replace(item, fn) for item in tree]
        return replaced if isinstance(tree, list) else type(tree)(replaced) if type(tree) is tuple else tree
    if isinstance(tree, dict):
        return {key: _replace(item, fn) for key, item in tree.items()}
    return tree


def _get(what: str, tensor: Tensor) -> Any:
    layout = layout_of(tensor)
    with plain_torch_functions():
        if what == "grad":
            grad = tensor.grad
            if layout is None:
                return grad
            if grad is None:
                if layout.local_numel == 0 and layout.empty_grad is not None and layout.empty_grad():
                    return mark(tensor.new_empty(0), layout)  # the ranks holding elements hold their gradients
                return None
            if not isinstance(grad, ShardedTensor) and grad.numel() == layout.local_numel:
                # One autograd made for the parameter itself (a term computed outside the forward): it knows too.
                tensor.grad = grad = mark(grad, layout)
            return grad
        if layout is None:
            return getattr(tensor, what)
    return layout.shape if what == "shape" else len(layout.shape)


def _shape(name: str, layout: ShardLayout, rest: Any, kwargs: dict[str, Any]) -> Any:
    if name in ("numel", "nelement"):
        return layout.shape.numel()
    if name in ("dim", "ndimension"):
        return len(layout.shape)
    if name == "__len__":
        return layout.shape[0]
    dim = rest[0] if rest else kwargs.get("dim")
    return layout.shape if dim is None else layout.shape[dim]


def _whole_call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func`` on the whole tensors (gathered with autograd) of every sharded operand."""
    args, kwargs = _replace((args, kwargs), whole)
    with plain_torch_functions():
        return func(*args, **kwargs)


def _norm_order(name: str, args: Any, kwargs: dict[str, Any]) -> Optional[float]:
    """The order of the vector norm over all elements that ``name`` computes, ``None`` when it is not one."""
    if name == "linalg_norm":
        order = args[1] if len(args) > 1 else kwargs.get("ord")
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        return 2.0 if order is None and dim is None else None
    default = "fro" if name == "norm" else 2
    order = args[1] if len(args) > 1 else kwargs.get("p" if name == "norm" else "ord", default)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if dim is not None or kwargs.get("keepdim") or order == "nuc":
        return None
    return 2.0 if order in ("fro", None) else float(order)


def _reduce(name: str, args: Any, kwargs: dict[str, Any]) -> Optional[Tensor]:
    """A reduction over all elements, across the shard group; ``None`` when ``name`` reduces along a dimension."""
    tensor, layout = args[0], layout_of(args[0])
    assert layout is not None
    local = local_slice(tensor)
    dtype = kwargs.get("dtype")
    order: Optional[float] = None
    if name in ("norm", "linalg_vector_norm", "linalg_norm"):
        order = _norm_order(name, args, kwargs)
        if order is None:
            return None
    elif len(args) > 1 or kwargs.get("dim") not in (None, ()) or kwargs.get("keepdim"):
        return None
    extreme = name in ("amax", "amin", "max", "min") or order in (math.inf, -math.inf)
    if extreme and torch.is_grad_enabled() and tensor.requires_grad:
        return None  # the whole tensor's, gathered: its gradient goes to the extreme elements alone
    agree(layout, f"{name}:{order}")
    with plain_torch_functions():
        if dtype is not None:
            local = local.to(dtype)
        if extreme:
            op = dist.ReduceOp.MAX if name in ("amax", "max") or order == math.inf else dist.ReduceOp.MIN
            values = local.abs() if order is not None else local
            fill = -math.inf if op == dist.ReduceOp.MAX else math.inf
            if values.numel():
                value = (values.amax() if op == dist.ReduceOp.MAX else values.amin()).detach().clone()
            else:
                value = torch.full((), fill, dtype=local.dtype, device=local.device)
            if group_world(layout.group) > 1:
                dist.all_reduce(value, op=op, group=layout.group)
            return value
        if order is None:
            total = SumAcrossShards.apply(local.sum(), layout.group)
            return total / layout.shape.numel() if name == "mean" else total
        powered = local.abs().pow(order).sum() if order != 2.0 else local.pow(2).sum()
        return SumAcrossShards.apply(powered, layout.group).pow(1.0 / order)


def _foreach_norm(args: Any, kwargs: dict[str, Any]) -> list[Tensor]:
    """``torch._foreach_norm``: each sharded tensor's norm across its group, in one collective for them all."""
    tensors = list(args[0])
    order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype")
    layouts = [layout_of(t) for t in tensors]
    with plain_torch_functions():
        locals_ = [local_slice(t) if dtype is None else local_slice(t).to(dtype) for t in tensors]
        norms = [
            torch.linalg.vector_norm(t, order) if t.numel() else t.new_zeros((), dtype=t.dtype) for t in locals_
        ]
    sharded = [i for i, layout in enumerate(layouts) if layout is not None]
    if not sharded:
        return norms
    first = layouts[sharded[0]]
    assert first is not None
    if order <= 0:
        raise RuntimeError(f"`{first.name}`: norms of order {order:g} are not computed across shards.")
    serials = ",".join(str(layout.serial) for layout in layouts if layout is not None)
    agree(first, "foreach_norm:" + str(zlib.crc32(serials.encode())))
    with plain_torch_functions():
        stacked = torch.stack([norms[i] for i in sharded])
        if math.isinf(order):
            totals = stacked.detach().clone()
            if group_world(first.group) > 1:
                dist.all_reduce(totals, op=dist.ReduceOp.MAX, group=first.group)
        else:
            totals = SumAcrossShards.apply(stacked.pow(order), first.group).pow(1.0 / order)
        for position, i in enumerate(sharded):
            norms[i] = totals[position]
    return norms
