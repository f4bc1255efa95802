"""The strategy's extra keyword arguments (``DDPFullyShardedStrategy(**kwargs)``), which go to FairScale's
``FullyShardedDataParallel`` as they are: checked against FairScale's arguments, those the strategy sets itself and
those of torch's FSDP, each refused with what to do instead. Kept by the configuration as ``fairscale_kwargs``.
"""

from __future__ import annotations

import inspect
from typing import Any

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP

__all__ = ["check_fairscale_kwargs"]

#: Arguments of FairScale's FSDP that the strategy sets itself; users set them through the strategy's arguments.
_MANAGED_FSDP_ARGUMENTS = {
    "module": "the strategy wraps the model itself",
    "process_group": "the strategy makes its process groups (with `timeout`)",
    "compute_device": "the `accelerator`/`devices` of the Trainer or Fabric choose it",
    "mixed_precision": "the `precision` flag of the Trainer or Fabric sets it",
    "move_params_to_cpu": "use `cpu_offload`",
    "state_dict_device": "use `state_dict_to_cpu`",
}


_FSDP_ARGUMENTS = set(inspect.signature(_FairScaleFSDP.__init__).parameters) - {"self"}


#: Arguments of Lightning's ``FSDPStrategy`` (for torch's FSDP) that FairScale has no equivalent of, and what to do.
_TORCH_FSDP_ARGUMENTS = {
    "limit_all_gathers": (
        "FairScale has no all-gather rate limiter (on CPU our forward gathers ahead what fits in `bucket_cap_mb`,"
        " and at least the next unit): remove it"
    ),
    "forward_prefetch": (
        "on CPU the forward gathers the next units ahead, and on CUDA FairScale's streams overlap the all-gathers:"
        " remove it (`backward_prefetch` chooses the backward's)"
    ),
    "sync_module_states": (
        "FairScale does not broadcast rank 0's weights: seed every rank alike (`seed_everything`) or load a"
        " checkpoint, as Lightning's FSDPStrategy needs without it"
    ),
    "ignored_modules": "under FairScale every parameter belongs to an FSDP unit",
    "ignored_states": "under FairScale every parameter belongs to an FSDP unit",
    "device_id": "the `devices` of the Trainer or Fabric choose it",
}


def check_fairscale_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (a copy), the strategy's extra keyword arguments, to pass to FairScale's FSDP; raise, saying what to
    do, for one that is no argument of FairScale's to pass (the strategy's own, torch FSDP's, unknown ones).

    Example:
        >>> check_fairscale_kwargs({"verbose": True, "use_orig_params": True})
        {'verbose': True}
    """
    kwargs = _without_use_orig_params(kwargs)
    for name in kwargs:
        if name in _MANAGED_FSDP_ARGUMENTS:
            raise TypeError(f"`DDPFullyShardedStrategy` does not take `{name}`: {_MANAGED_FSDP_ARGUMENTS[name]}.")
        if name in _TORCH_FSDP_ARGUMENTS:
            raise TypeError(
                f"`DDPFullyShardedStrategy` does not take `{name}`, an argument of torch's FSDP (Lightning's"
                f" FSDPStrategy): {_TORCH_FSDP_ARGUMENTS[name]}."
            )
        if name not in _FSDP_ARGUMENTS:
            accepted = ", ".join(sorted(_FSDP_ARGUMENTS - set(_MANAGED_FSDP_ARGUMENTS)))
            raise TypeError(
                f"`DDPFullyShardedStrategy` got an unexpected argument `{name}`. Extra keyword arguments go to"
                f" FairScale's FullyShardedDataParallel, which takes: {accepted}."
            )
    return kwargs


def _without_use_orig_params(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without torch FSDP's ``use_orig_params``, which is what the strategy does anyway (the model's
    attributes are the parameters the optimizer steps, see ``fsdp.unit.original_params``): ``True`` is accepted,
    ``False`` refused with the reason."""
    kwargs = dict(kwargs)
    if kwargs.pop("use_orig_params", True) is not True:
        raise ValueError(
            "`DDPFullyShardedStrategy(use_orig_params=False)` is not supported, and not needed: the strategy always"
            " keeps the original parameters (torch FSDP's `use_orig_params=True`), so param groups may split FSDP"
            " units, frozen and trainable parameters may share one, and `model.parameters()` after setup are the"
            " parameters the optimizer steps. Remove `use_orig_params`."
        )
    return kwargs
