"""Weight averaging (EMA, SWA) of a sharded model, on this rank's shards only.

``torch.optim.swa_utils.AveragedModel`` deep-copies a module and averages the copy's ``parameters()`` with the
model's, elementwise. A module sharded by this package has, as its ``parameters()``, this rank's views into the flat
shards (one 1-D slice per original parameter, empty where the rank holds none of it): a deep copy made before
sharding has the full shapes, and one made after it copies FairScale's units. Both averages are elementwise, so each
rank averages its own slices and nothing is gathered: :class:`ShardAveragedModel` is an ``AveragedModel`` whose
module is a :class:`ShardCopy`, a copy of those slices and of the (unsharded) buffers, ``parameters()`` and
``buffers()`` in the sharded module's order. It costs this rank's share of the parameters, ``Ψ/N`` elements.

What it averages is what the sharded module's ``parameters()`` gives, so the code that uses an ``AveragedModel``
(``update_parameters(module)``, swapping ``module.parameters()`` with the average's) works on the shards unchanged.
Its state dict is the model's, in the format the model's owner saves (a full state dict gathered on rank 0, or this
rank's local shards): it swaps the average into the model, asks ``model_state`` for it, and swaps back. Loading
takes the shard slices by the unwrapped module's names (:func:`shard_state` gives them).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Generator, Iterator, Mapping
from typing import Any, Callable, Optional, Union, cast

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from lightning_fairscale.distributed.torch_private import ModuleIncompatibleKeys
from lightning_fairscale.fsdp.unit.state_names import clean_path
from lightning_fairscale.fsdp.unit.gathered import drop_full_params

__all__ = ["ShardAveragedModel", "ShardCopy", "shard_state", "swap_values"]

#: ``AveragedModel``'s prefix of its module's entries in its state dict.
MODULE_PREFIX = "module."


def _values(module: nn.Module) -> Iterator[Tensor]:
    """The tensors an ``AveragedModel`` pairs up: ``parameters()`` then ``buffers()``."""
    return itertools.chain(module.parameters(), module.buffers())


def _names(module: nn.Module) -> list[str]:
    """The unwrapped module's names of :func:`_values`, in the same order."""
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    return [clean_path(name) for name, _ in named]


def shard_state(module: nn.Module, persistent_only: bool = False) -> dict[str, Tensor]:
    """Copies of this rank's slices of ``module``'s parameters and of its buffers, by the unwrapped module's names.

    With ``persistent_only``, without the buffers a state dict leaves out: what ``module.load_state_dict`` takes
    back (FairScale's units put their wrappers' names back in front of each name, and each slice is copied into the
    view of the same shape)."""
    state = {clean_path(name): param.detach().clone() for name, param in module.named_parameters()}
    for path, owner in module.named_modules():
        for name, buffer in owner._buffers.items():
            if buffer is None or (persistent_only and name in owner._non_persistent_buffers_set):
                continue
            state[clean_path(f"{path}.{name}" if path else name)] = buffer.detach().clone()
    return state


def swap_values(a: nn.Module, b: nn.Module) -> None:
    """Exchange the values of ``a``'s and ``b``'s parameters and buffers, pairwise in order (same shapes)."""
    with torch.no_grad():
        for x, y in zip(_values(a), _values(b), strict=True):
            held = x.detach().clone()
            x.detach().copy_(y.detach())
            y.detach().copy_(held)


class ShardCopy(nn.Module):
    """A copy of a sharded module's ``parameters()`` (this rank's slices) and ``buffers()``, in their order, known by
    the unwrapped module's names.

    Args:
        module: the sharded module (its parameters are this rank's views into the flat shards).
        device: where the copy lives (``None``: where each tensor is).
    """

    def __init__(self, module: nn.Module, device: Optional[Union[torch.device, str, int]] = None) -> None:
        super().__init__()
        self.slices = nn.ParameterList(
            [nn.Parameter(p.detach().to(device, copy=True), requires_grad=False) for p in module.parameters()]
        )
        for index, buffer in enumerate(module.buffers()):
            self.register_buffer(f"buffer_{index}", buffer.detach().to(device, copy=True))
        #: The unwrapped module's name of each entry of ``parameters()`` then ``buffers()``.
        self.names = _names(module)

    def numel(self) -> int:
        """The elements of this copy's parameters: this rank's share of the model's."""
        return sum(p.numel() for p in self.parameters())

    def fits(self, state_dict: Mapping[str, Any]) -> bool:
        """Whether ``state_dict``'s entries have the shapes of this copy's (this rank's slices, not full tensors)."""
        tensors = dict(zip(self.names, _values(self)))
        return all(name not in tensors or value.shape == tensors[name].shape for name, value in state_dict.items())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "The average of this rank's shards runs no forward of its own (it holds no layers, only the shards): run"
            " the model with the average swapped in, `with averaged.swapped_in(): model(x)`."
        )

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> ModuleIncompatibleKeys:
        """Copy the entries of ``state_dict`` (the unwrapped module's names, this rank's slices: :func:`shard_state`)
        into this copy. Without ``strict`` the entries it lacks keep their values and the others are ignored."""
        tensors = dict(zip(self.names, _values(self)))
        missing = [name for name in tensors if name not in state_dict]
        unexpected = [name for name in state_dict if name not in tensors]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"The averaged copy of this rank's shards does not fit: missing {missing}, unexpected {unexpected}."
            )
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name in state_dict:
                    value = state_dict[name]
                    if value.shape != tensor.shape:
                        raise RuntimeError(
                            f"{name}: this rank's slice has shape {tuple(tensor.shape)}, the state {tuple(value.shape)}"
                            " (a full state dict does not load here: load it into the sharded model first)."
                        )
                    tensor.copy_(value)
        return ModuleIncompatibleKeys(missing, unexpected)


class ShardAveragedModel(AveragedModel):
    """An ``AveragedModel`` of a sharded module over this rank's shards (see the module's docstring).

    Args:
        module: the sharded module whose ``parameters()`` and ``buffers()`` are averaged.
        model_state: the module's state dict as its owner saves it (a collective call on every rank): what
            :meth:`state_dict` returns, with the average swapped in.
        device, avg_fn, multi_avg_fn, use_buffers: as for ``AveragedModel``.
        root: the root unit of the sharded model (``module`` itself or around it): its units drop the full
            parameters they hold when the average is swapped in or out (workaround 27,
            :func:`~lightning_fairscale.fsdp.unit.gathered.drop_full_params`).
        load_full: loads a full state dict into ``module``'s shards: then :meth:`load_state_dict` also takes the
            full state dict that ``model_state`` gives.
    """

    def __init__(
        self,
        module: nn.Module,
        model_state: Callable[[], dict[str, Any]],
        device: Optional[Union[torch.device, int]] = None,
        avg_fn: Optional[Callable[[Tensor, Tensor, Union[Tensor, int]], Tensor]] = None,
        multi_avg_fn: Optional[Callable[..., None]] = None,
        use_buffers: bool = False,
        root: Optional[nn.Module] = None,
        load_full: Optional[Callable[[dict[str, Any]], None]] = None,
    ) -> None:
        super().__init__(ShardCopy(module, device), device, avg_fn, multi_avg_fn, use_buffers)
        # In lists: not submodules of the average (no second copy in `state_dict`, no `.to()` of the model).
        self._live, self._root = [module], [root if root is not None else module]
        self._model_state, self._load_full = model_state, load_full

    @property
    def live(self) -> nn.Module:
        """The sharded module whose shards this averages."""
        return self._live[0]

    @contextlib.contextmanager
    def swapped_in(self) -> Generator[None, None, None]:
        """Inside, the model holds the average (to evaluate or save it) and this copy the model's own weights;
        swapped back at the end."""
        drop_full_params(self._root[0])
        swap_values(self.live, self.module)
        try:
            yield
        finally:
            drop_full_params(self._root[0])
            swap_values(self.live, self.module)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The averaged model's state dict, in the format and on the ranks ``model_state`` gives the live one's, its
        entries prefixed with ``module.``, and ``n_averaged``: what ``AveragedModel.state_dict()`` holds under
        unsharded training. A collective call (the average is swapped into the model while it is taken)."""
        with self.swapped_in():
            # Copies: a local state dict holds the shards themselves, which the swap back changes.
            state = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in self._model_state().items()}
        averaged = {MODULE_PREFIX + name: value for name, value in state.items()}
        averaged["n_averaged"] = self.n_averaged.detach().clone()
        return averaged

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> ModuleIncompatibleKeys:
        """Load ``n_averaged`` and the ``module.``-prefixed slices of :func:`shard_state`; with ``load_full``, also
        the full state dict :meth:`state_dict` gives (loaded into the model's shards while the average is swapped
        in, so only this rank's slices are read)."""
        module = {k[len(MODULE_PREFIX):]: v for k, v in state_dict.items() if k.startswith(MODULE_PREFIX)}
        if self._load_full is not None and not cast(ShardCopy, self.module).fits(module):
            with self.swapped_in():
                self._load_full(module)
            keys = ModuleIncompatibleKeys([], [])
        else:
            keys = self.module.load_state_dict(module, strict=strict)
        if "n_averaged" in state_dict:
            self.n_averaged.copy_(state_dict["n_averaged"])
        elif strict:
            raise RuntimeError("The averaging state has no `n_averaged`.")
        return keys
