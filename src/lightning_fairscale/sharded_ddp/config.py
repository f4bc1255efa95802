"""The configuration of ``DDPShardedStrategy``, for the Trainer's strategy and for Fabric's.

:class:`ShardedDDPConfig` holds what the user chose (each option declared once, as a field: see
:mod:`lightning_fairscale.option_fields`), checked once, when it is built, and frozen. Both strategies
build one in their constructor and hold it as ``strategy.config``; the functions here turn it, with what a run adds
(the number of nodes, the precision), into the arguments of ``ShardedDataParallel`` and OSS. Nothing here imports
Lightning.

Example:
    >>> config = ShardedDDPConfig(fairscale_kwargs={"reduce_buffer_size": 2**20})
    >>> sharded_ddp_kwargs(config, num_nodes=2)
    {'reduce_buffer_size': 1048576}
    >>> reduce_buffer_size(ShardedDDPConfig(), num_nodes=2), broadcast_fp16("16-mixed", num_nodes=2)
    (8388608, True)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from fairscale.nn.data_parallel import ShardedDataParallel

from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy, validate_policy
from lightning_fairscale.option_fields import check_options, documented, option

__all__ = [
    "ShardedDDPConfig",
    "broadcast_fp16",
    "reduce_buffer_size",
    "sharded_ddp_kwargs",
    "validate_arguments",
]

#: Arguments of ``ShardedDataParallel`` that the strategy sets itself.
_MANAGED_SDP_ARGUMENTS = {
    "module": "the strategy wraps the model itself",
    "sharded_optimizer": "the strategy shards the optimizers of `configure_optimizers` (or of `fabric.setup`)",
    "process_group": "the strategy uses the default process group",
}
_SDP_ARGUMENTS = set(inspect.signature(ShardedDataParallel.__init__).parameters) - {"self"}
#: Gradient bucket size (elements) for multi-node runs, as in Lightning 1.x; single-node runs reduce unbucketed.
_MULTI_NODE_REDUCE_BUFFER_SIZE = 2**23


@documented
@dataclass(frozen=True)
class ShardedDDPConfig:
    """The options of ``DDPShardedStrategy``, checked when built; frozen.

    Each option is declared here once, as a field made by :func:`~lightning_fairscale.option_fields.option`; the
    strategies' constructors (the Trainer's and Fabric's), their ``Args:`` and their typed attributes are written from
    these fields (``make options``). Lightning's own arguments are not options; the strategy's extra keyword arguments
    are :attr:`fairscale_kwargs`.

    Raises:
        ValueError, TypeError: an argument is not accepted; the message says what is.
    """

    find_unused_parameters: bool = option(
        False,
        summary="only ``False``: ``ShardedDataParallel`` has no search for unused parameters.",
        doc="""only ``False``: ``ShardedDataParallel`` has no search for unused parameters. A parameter that no
            rank uses keeps no gradient and is not reduced; one used on some ranks only is not supported (use
            Lightning's ``"ddp_find_unused_parameters_true"``).""",
    )
    lightning_1x_optimizer_state: OptimizerStatePolicy = option(
        "error",
        check=lambda value, config: validate_policy(value, config.owner),
        changeable=True,
        summary="""resuming a Lightning 1.x FSDP checkpoint's optimizer state: ``"error"`` (default)
            or ``"reset"``, as in ``DDPFullyShardedStrategy``.""",
        doc="""resuming a checkpoint of Lightning 1.x's FairScale *FSDP* strategy (1.x's ``"ddp_sharded"``
            checkpoints resume exactly): ``"error"`` (default) or ``"reset"``, as in
            :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`.""",
    )
    sync_each_batch: bool = option(
        False,
        check=lambda value, config: _check_sync_each_batch(value),
        summary="reduce after every micro-batch when accumulating, instead of ``ShardedDataParallel.no_sync``.",
        doc="""how gradients accumulate over micro-batches (the Trainer's ``accumulate_grad_batches``, Fabric's
            ``no_backward_sync``). ``False`` (default): ``ShardedDataParallel.no_sync``, each rank keeps the
            gradients of every parameter until the last micro-batch, which reduces them once. ``True``: every
            micro-batch reduces each gradient to the rank that owns its parameter, and between micro-batches a rank
            holds only the gradients of the parameters it owns (Accelerate's
            ``GradientAccumulationPlugin(sync_each_batch=True)``); Fabric's ``no_backward_sync`` then skips nothing.
            Same result either way.""",
    )
    #: Keyword arguments passed to FairScale's ``ShardedDataParallel`` as they are (the strategies' ``**kwargs``).
    fairscale_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The strategy's class name, which the error messages name.
    owner: str = "DDPShardedStrategy"

    def __post_init__(self) -> None:
        check_options(self)  # each option's own check, in their order
        validate_arguments(self.owner, self.find_unused_parameters, self.fairscale_kwargs)
        object.__setattr__(self, "fairscale_kwargs", dict(self.fairscale_kwargs))


def _check_sync_each_batch(value: Any) -> bool:
    if not isinstance(value, bool):  # a string such as "false" would be true
        raise TypeError(
            "`sync_each_batch` must be True (reduce the gradients after every micro-batch: each rank holds only"
            " those of the parameters it owns while accumulating) or False (accumulate unreduced, the default),"
            f" got {value!r}."
        )
    return value


def reduce_buffer_size(config: ShardedDDPConfig, num_nodes: int) -> int:
    """Size of ``ShardedDataParallel``'s gradient buckets in elements: ``0`` (no buckets) on one node by default."""
    default = 0 if num_nodes == 1 else _MULTI_NODE_REDUCE_BUFFER_SIZE
    return int(config.fairscale_kwargs.get("reduce_buffer_size", default))


def broadcast_fp16(precision: str, num_nodes: int) -> bool:
    """Whether OSS sends updated parameters in fp16: under fp16 mixed precision (the precision plugin's setting) on
    several nodes."""
    return precision == "16-mixed" and num_nodes > 1


def sharded_ddp_kwargs(config: ShardedDDPConfig, num_nodes: int) -> dict[str, Any]:
    """The keyword arguments ``ShardedDataParallel`` is built with (besides the module and optimizers)."""
    return {**config.fairscale_kwargs, "reduce_buffer_size": reduce_buffer_size(config, num_nodes)}


def validate_arguments(strategy: str, find_unused_parameters: Any, kwargs: dict[str, Any]) -> None:
    """Raise an error that says what is accepted when an argument of ``strategy`` (its class name) is not."""
    if find_unused_parameters:
        raise ValueError(
            f"`{strategy}` does not support `find_unused_parameters=True`: FairScale's ShardedDataParallel reduces"
            " each gradient when backward produces it and cannot wait for parameters that some ranks leave unused."
            " Use `strategy='ddp_find_unused_parameters_true'` for such models."
        )
    size = kwargs.get("reduce_buffer_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"`reduce_buffer_size` must be a number of elements >= 0 (0: no buckets), got {size!r}.")
    for name in kwargs:
        if name in _MANAGED_SDP_ARGUMENTS:
            raise TypeError(f"`{strategy}` does not take `{name}`: {_MANAGED_SDP_ARGUMENTS[name]}.")
        if name not in _SDP_ARGUMENTS:
            raise TypeError(
                f"`{strategy}` got an unexpected argument `{name}`. Extra keyword arguments go to FairScale's"
                f" ShardedDataParallel, which takes: {', '.join(sorted(_SDP_ARGUMENTS - set(_MANAGED_SDP_ARGUMENTS)))}."
            )
