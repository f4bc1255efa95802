"""Activation checkpointing: instances of given layer classes recompute their activations in the backward pass
(torch's non-reentrant checkpoint: workaround 22 of :mod:`lightning_fairscale.fsdp.patches.workarounds`), applied before
wrapping so that checkpointing runs inside the FSDP unit."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Optional

import torch
from fairscale.nn.checkpoint.checkpoint_activations import enable_recomputing, patch_batchnorm
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

from torch.utils.checkpoint import checkpoint

from lightning_fairscale.distributed.torch_private import in_backward
from lightning_fairscale.fsdp.unit.state_names import is_wrapped

__all__ = [
    "CheckpointedForward",
    "apply_activation_checkpointing",
    "checkpointing_layer_classes",
    "remove_activation_checkpointing",
    "validate_layer_classes",
]


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

    The instance's ``forward`` is replaced in place (as FairScale's ``checkpoint_wrapper`` does), so module names
    (and so state-dict keys) do not change. Instances inside FSDP units (manual wrap) are checkpointed inside their
    unit.
    """
    if not classes:
        return []
    if any(_is_checkpointed(submodule) for submodule in module.modules()):
        # As Lightning's FSDPStrategy: layers checkpointed by the user are not checkpointed a second time.
        rank_zero_warn(
            # Lightning's FSDPStrategy's words first, so that a warning filter written for it matches this one too.
            "FSDP checkpointing is configured, but the model already contains checkpointed layers. Checkpointing will"
            " be ignored. `activation_checkpointing` is not applied: the layers the model checkpoints itself (torch's"
            " `apply_activation_checkpointing` or FairScale's `checkpoint_wrapper`) stay as they are."
        )
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
            patch_batchnorm(submodule)  # its batch norms update their statistics once, not again when recomputed
            submodule.forward = CheckpointedForward(submodule, offload_to_cpu)  # its mark: an object of ours
            checkpointed.append(submodule)
    return checkpointed


class CheckpointedForward:
    """A layer's ``forward`` under torch's non-reentrant checkpoint (workaround 22 of
    :mod:`lightning_fairscale.fsdp.patches.workarounds`): its activations are recomputed in the backward, under the
    autocast and random states of the forward; with ``offload_to_cpu`` the region's saved inputs wait in CPU memory.

    FairScale's ``checkpoint_wrapper`` recomputed under CUDA's autocast state only (on a CPU, ``"bf16-mixed"``
    recomputed without autocast; on CUDA in fp16 whatever the forward's dtype), and gave a Hugging Face GPT-2 layer
    1% of its attention's gradients (transformers 5, measured with and without autocast): wrong without an error.

    ``inner`` is the function computed (the layer's class's ``forward``, or its compiled version: workaround 18
    compiles it inside the checkpoint, so that the recomputation runs the compiled code too). A weak reference to the
    layer, as FairScale's: the layer holds its ``forward``.
    """

    def __init__(
        self, layer: nn.Module, offload_to_cpu: bool, inner: Optional[Callable[..., Any]] = None,
        compiled_from: Optional[CheckpointedForward] = None,
    ) -> None:
        self._layer = weakref.ref(layer)
        self.offload_to_cpu = offload_to_cpu
        self.inner: Callable[..., Any] = inner if inner is not None else type(layer).forward
        #: The checkpointed forward this one replaced, computing the compiled ``inner``
        #: (:mod:`~lightning_fairscale.fsdp.wrapping.compile`), else ``None``.
        self.compiled_from = compiled_from

    def with_inner(self, inner: Callable[..., Any]) -> CheckpointedForward:
        """The same checkpointed forward of the same layer, computing ``inner`` (compiled: this one is given back
        when it is uncompiled)."""
        layer = self._layer()
        assert layer is not None
        return CheckpointedForward(layer, self.offload_to_cpu, inner, compiled_from=self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self._layer()
        if not torch.is_grad_enabled():
            return self.inner(layer, *args, **kwargs)
        offload: Any = contextlib.nullcontext()
        if self.offload_to_cpu:
            offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        with offload:
            return checkpoint(self._compute, layer, *args, use_reentrant=False, **kwargs)

    def _compute(self, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """``inner``; inside the backward (the recomputation) with FairScale's recomputing flag set, so that the
        batch-norm layers it patched do not update their running statistics a second time."""
        if in_backward():
            with enable_recomputing():
                return self.inner(layer, *args, **kwargs)
        return self.inner(layer, *args, **kwargs)


def _is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is torch's ``CheckpointWrapper`` or a layer FairScale's ``checkpoint_wrapper`` patched (not
    by this module). Known by name: torch's class lives in a private module."""
    torch_wrapper = type(module).__name__ == "CheckpointWrapper" and type(module).__module__.startswith("torch.")
    forward = getattr(module.__dict__.get("forward"), "func", None)  # FairScale's partial over its function
    patched = getattr(forward, "__name__", "") == "_checkpointed_forward"
    return torch_wrapper or patched


def remove_activation_checkpointing(module: nn.Module) -> None:
    """Give every layer of ``module`` that :func:`apply_activation_checkpointing` checkpointed its class's ``forward``
    back; a ``forward`` set otherwise (by the user) stays.

    The layers are found by the mark they carry, not by a list a strategy kept: whichever strategy or Trainer unwraps
    the module (``unshard_module()`` after a second ``fit`` with another Trainer) gives it back without wrappers.
    """
    for submodule in module.modules():
        if isinstance(submodule.__dict__.get("forward"), CheckpointedForward):
            del submodule.__dict__["forward"]
