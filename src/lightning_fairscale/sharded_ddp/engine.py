"""FairScale's sharded DDP (OSS + ShardedDataParallel), for the Trainer's strategy and for Fabric's.

``DDPShardedStrategy`` rebuilds each optimizer as a :class:`fairscale.optim.OSS` over the same param groups and
hyperparameters (:func:`shard_optimizer`), so every rank keeps the optimizer state of its share of the parameters
only (ZeRO stage 1), and wraps the module in :class:`fairscale.nn.data_parallel.ShardedDataParallel`, which reduces
each gradient to the rank that owns its parameter (stage 2). Parameters stay whole on every rank.

The strategy's arguments are a :class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig`; the Trainer's
strategy (:mod:`lightning_fairscale.strategies.sharded`) and Fabric's (:mod:`lightning_fairscale.fabric.sharded`) hold
one each and call the functions here. Nothing here imports Lightning.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, Optional

import torch
from fairscale.nn.data_parallel import ShardedDataParallel as _FairScaleShardedDataParallel
from fairscale.optim import OSS
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fairscale.distributed import collectives
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig, sharded_ddp_kwargs
from lightning_fairscale.sharded_ddp.grad_norms import torch_norms_follow_partitions
from lightning_fairscale.sharded_ddp.trainability import Trainability
from lightning_fairscale.distributed import process_exit

log = logging.getLogger(__name__)

__all__ = [
    "ShardedDataParallel",
    "check_optimizers",
    "check_steps_each_tensor",
    "full_state",
    "load_full_state",
    "repoint_schedulers",
    "shard_optimizer",
    "sharded_class",
    "sync_module_states",
    "wrap_model",
]


class ShardedDataParallel(_FairScaleShardedDataParallel):
    """FairScale's ``ShardedDataParallel``, which dynamo never traces.

    Its forward keeps Python state for the backward (which parameters train, which gradients wait to be reduced,
    the gradient buckets): compiled, by Fabric's ``torch.compile`` of the module a strategy returns, it trained the
    wrong thing without an error (a tiny GPT-2's last layer 30% off ``"ddp"`` after 4 steps; found by the feature
    matrix). Its call is excluded from compilation, as our FSDP units' are; the model inside is what
    :func:`wrap_model` compiles.
    """

    __call__ = torch.compiler.disable(_FairScaleShardedDataParallel.__call__)


def wrap_model(
    config: ShardedDDPConfig,
    module: Module,
    optimizers: list[OSS],
    num_nodes: int,
    compiler: Optional[Callable[..., Any]] = None,
) -> tuple[ShardedDataParallel, Trainability]:
    """``module`` in ``ShardedDataParallel``, which reduces each gradient to the rank whose OSS shard owns it, and
    the :class:`~lightning_fairscale.sharded_ddp.trainability.Trainability` that keeps what it derives from the
    trainable parameters up to date (call its ``begin_backward``/``end_backward`` around every backward pass).

    FairScale's own detection of changes is off (FairScale workaround 24): ``auto_refresh_trainable`` is ``False``
    whatever the configuration says. ``compiler``: the ``torch.compile`` the model was given with (Fabric's
    options); the model's ``forward`` is compiled in place (its parameters' names unchanged), inside the wrapper that
    stays eager.
    """
    if compiler is not None:
        module.forward = compiler(module.forward)  # type: ignore[method-assign]
    if not torch_norms_follow_partitions():
        warnings.warn(
            f"torch {torch.__version__}: `torch.nn.utils.clip_grad_norm_` called by your own code sees the gradients"
            " of this rank's OSS partition only under `DDPShardedStrategy`, and clips by their norm, not the whole"
            " model's (torch 2.6 or later makes it exact). Clip with the Trainer's `gradient_clip_val` or Fabric's"
            " `clip_gradients`, which clip by the whole model's norm.",
            stacklevel=2,
        )
    kwargs = {**sharded_ddp_kwargs(config, num_nodes), "auto_refresh_trainable": False}
    wrapped = ShardedDataParallel(module, sharded_optimizer=optimizers, **kwargs)
    process_exit.release_at_exit(wrapped, *optimizers)  # their references to process groups are dropped at exit
    return wrapped, Trainability(wrapped)


def full_state(optimizer: Optimizer, is_global_zero: bool) -> dict[str, Any]:
    """The full state of a plain optimizer of the same class, on rank 0 (``{}`` on the other ranks).

    A collective call for OSS, which gathers every rank's shard of the state on rank 0.
    """
    if not isinstance(optimizer, OSS):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(recipient_rank=0)
    return optimizer.state_dict() if is_global_zero else {}


@torch.no_grad()
def sync_module_states(module: Module) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP does when it wraps a module). A collective call.

    One broadcast per tensor, once per set-up: torch's bucketed version is private (``_sync_module_states``).
    """
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name not in ignored:
            collectives.broadcast(tensor.data, src=0)


def shard_optimizer(optimizer: Optimizer, broadcast_fp16: bool = False) -> OSS:
    """``optimizer`` rebuilt as ``fairscale.optim.OSS``: same class, param groups and hyperparameters, sharded.

    Needs an initialized process group. Any state ``optimizer`` already has is carried over (sharded). The OSS is of
    a subclass named after ``optimizer``'s class (:func:`sharded_class`), so that what Lightning names after the
    optimizer's class (``LearningRateMonitor``'s ``lr-Adam``) is what it is under ``"ddp"``.

    Args:
        optimizer: a ``torch.optim`` optimizer (or one built the same way: ``cls(param_groups, **defaults)``).
        broadcast_fp16: send the updated parameters to the other ranks in fp16 (see ``OSS``).

    Raises:
        TypeError: the optimizer's class cannot be built again from its param groups and ``defaults``.
        ValueError: the optimizer steps all parameters as one vector (:func:`check_steps_each_tensor`).
    """
    optim_class = type(optimizer)
    check_steps_each_tensor(optimizer)
    defaults = _constructor_defaults(optimizer)
    param_groups = [dict(group) for group in optimizer.param_groups]
    try:
        inspect.signature(optim_class).bind(param_groups, **defaults)
    except TypeError as error:
        raise TypeError(
            f"`DDPShardedStrategy` cannot shard {optim_class.__name__}: OSS builds each rank's optimizer as"
            f" `{optim_class.__name__}(param_groups, **defaults)` ({error}). Give the class a constructor that takes"
            " its `defaults` as keyword arguments, or return a `fairscale.optim.OSS` from `configure_optimizers`."
        ) from None
    oss_class = sharded_class(optim_class)
    sharded = oss_class(params=param_groups, optim=optim_class, broadcast_fp16=broadcast_fp16, **defaults)
    if optimizer.state:
        load_full_state(sharded, optimizer.state_dict())
    return sharded


def check_optimizers(optimizers: Iterable[Optimizer]) -> None:
    """:func:`check_steps_each_tensor` for each optimizer (an ``OSS``'s own optimizer for an ``OSS``), all before any
    is sharded (sharding may start collectives): every rank refuses the same optimizer at the same point."""
    for optimizer in optimizers:
        if isinstance(optimizer, OSS):
            check_steps_each_tensor(optimizer.optim)
        elif isinstance(optimizer, Optimizer):
            check_steps_each_tensor(optimizer)


def sharded_class(optim_class: type[Optimizer]) -> type[OSS]:
    """A subclass of ``OSS`` named after ``optim_class`` (``__name__`` ``"Adam"``, ``__qualname__`` ``"OSS[Adam]"``):
    what callbacks and loggers name after the optimizer's class (``LearningRateMonitor``'s ``lr-Adam``) is the
    user's choice, as under ``"ddp"``; its ``repr`` still says OSS. A new class per optimizer, which dies with it."""
    name = optim_class.__name__
    namespace = {
        "__module__": __name__,
        "__qualname__": f"OSS[{optim_class.__qualname__}]",
        "__doc__": f"FairScale's OSS over {name}: this rank's {name} steps the parameters of this rank's partition.",
    }
    return type(name, (OSS,), namespace)


#: ``torch.optim`` classes that step all their parameters as one vector (declared, not guessed).
_WHOLE_VECTOR_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)


def check_steps_each_tensor(optimizer: Optimizer) -> None:
    """Refuse an optimizer that would step the wrong thing over one rank's OSS partition, before anything is built.

    OSS gives each rank's optimizer whole tensors, the parameters of its partition, so any optimizer whose update of
    a tensor reads that tensor (and its gradient and state) only is exact: SGD, Adam, Adafactor, Muon, a LARS or
    LAMB... An optimizer that combines all its parameters is not: one that keeps its own list of the parameters (as
    ``LBFGS``'s ``_params``, whose dot products run over the flattened vector of all of them) or whose ``step``
    requires a closure, which it calls again after changing the parameters (LBFGS, SAM-style optimizers, which also
    take a norm over all gradients): over a partition, each rank would run its own line search or scale on part of
    the vector (LBFGS: weights 6.1 off unsharded training after 4 steps).

    Raises:
        ValueError: naming the optimizer's class, why, and what to do.
    """
    cls = type(optimizer)
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    own_lists = [
        name
        for name, value in vars(optimizer).items()
        if name != "param_groups"
        and isinstance(value, (list, tuple))
        and any(isinstance(item, torch.Tensor) and id(item) in ids for item in value)
    ]
    step = inspect.signature(cls.step).parameters.get("closure")
    needs_closure = step is not None and step.default is inspect.Parameter.empty
    reasons = []
    if issubclass(cls, _WHOLE_VECTOR_OPTIMIZERS):
        reasons.append("it steps all its parameters as one vector")
    if own_lists:
        reasons.append(f"it keeps its own list of the parameters ({', '.join(f'`{n}`' for n in own_lists)})")
    if needs_closure:
        reasons.append("its `step` requires a closure, which re-evaluates the model between updates")
    if reasons:
        raise ValueError(
            f"`DDPShardedStrategy` cannot train with {cls.__name__}: {'; '.join(reasons)}. OSS would give each rank's"
            f" {cls.__name__} only the parameters of that rank's partition, so every rank would step its part of the"
            f" model as if it were the whole (LBFGS's dot products and line search over part of the vector), and"
            f" train another model than unsharded training. Use `strategy='ddp'` for {cls.__name__} (every rank"
            " steps every parameter), or an optimizer that updates each tensor on its own (SGD, Adam, AdamW,"
            " Adafactor, Muon, LARS or LAMB...), which `DDPShardedStrategy` trains exactly."
        )


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` less the entries its constructor does not take.

    Some classes record settings they fix themselves, e.g. ``AdamW``'s ``decoupled_weight_decay=True``; the param
    groups keep those entries, so nothing is lost.
    """
    parameters = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {name: value for name, value in optimizer.defaults.items() if name in parameters}


def load_full_state(optimizer: OSS, state: Mapping[str, Any]) -> None:
    """Load a plain optimizer's full state dict into OSS, which keeps this rank's shard.

    ``OSS.load_state_dict`` empties the entries of other ranks' parameters in the dict it gets, so it gets a copy;
    and it leaves a second copy of this rank's shard in the OSS wrapper's own ``state``, which nothing reads
    (``OSS.state_dict`` collects the shards' states), so that copy is dropped.
    """
    optimizer.load_state_dict({**state, "state": dict(state["state"])})
    optimizer.state.clear()


def repoint_schedulers(schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> None:
    """Make the LR schedulers of ``old`` adjust ``new``, and keep PyTorch's step-order check working."""
    repointed = False
    for top in schedulers:
        for scheduler in _scheduler_tree(top):
            if getattr(scheduler, "optimizer", None) is old:
                scheduler.optimizer = new
                repointed = True
    if repointed:
        _flag_steps_for_schedulers(new)


def _scheduler_tree(scheduler: Any) -> Iterator[Any]:
    """A scheduler and those it drives (``SequentialLR``, ``ChainedScheduler``), recursively."""
    yield scheduler
    for inner in getattr(scheduler, "_schedulers", None) or ():
        yield from _scheduler_tree(inner)


def _flag_steps_for_schedulers(optimizer: Optimizer) -> None:
    """Set ``optimizer._opt_called`` on every step, as PyTorch's LR schedulers do to the optimizer they are given.

    A scheduler checks, on its first step, that its optimizer's ``step`` carries the ``_wrapped_by_lr_sched`` mark
    (else it warns that ``optimizer.step()`` was overridden) and that ``_opt_called`` is set (else it warns that the
    scheduler stepped first). The schedulers were created with the user's optimizer; OSS needs the same.
    """
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    optimizer_ref = weakref.ref(optimizer)
    unbound_step = step.__func__  # type: ignore[attr-defined]

    @functools.wraps(unbound_step)
    def flagged_step(*args: Any, **kwargs: Any) -> Any:
        owner = optimizer_ref()
        owner._opt_called = True  # type: ignore[union-attr]
        return unbound_step(owner, *args, **kwargs)

    flagged_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = flagged_step  # type: ignore[method-assign]
