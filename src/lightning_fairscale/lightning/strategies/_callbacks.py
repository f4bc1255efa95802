# Generated from lightning_fairscale/strategies/_callbacks.py by `make lightning`: do not edit.
"""Lightning callbacks that cannot work on FSDP's sharded parameters, refused before anything runs.

Lightning's own ``StochasticWeightAveraging`` refuses its FSDP and DeepSpeed strategies, which it knows by class;
ours it does not know. Each entry below was run under ``DDPFullyShardedStrategy`` first; what happened is the reason
given. Under ``DDPShardedStrategy`` the parameters stay whole on every rank: ``StochasticWeightAveraging`` gives the
same weights as under Lightning's ``"ddp"``, and so does ``ModelPruning`` without its lottery-ticket reset (both
tested), which alone is refused there.
"""

from __future__ import annotations

from collections.abc import Iterable
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ModelPruning, StochasticWeightAveraging
from lightning.pytorch.strategies import Strategy

from lightning_fairscale.lightning._compat import attached_trainer, lottery_ticket_reset

#: Callback classes, why they cannot work under FSDP, and what to do instead.
_UNSUPPORTED: dict[type[Callback], tuple[str, str]] = {
    StochasticWeightAveraging: (
        "it deep-copies the LightningModule once it is sharded (FairScale's units and views into their flat shards"
        " do not copy), and it replaces the LR schedulers and recomputes BatchNorm statistics in an extra pass of its"
        " own",
        ". For SWA on the shards use `pytorch_lightning.callbacks.WeightAveraging()` (its default `avg_fn` is the"
        " same equal-weight average; each rank averages its own shard, and checkpoints hold the average as under"
        " `\"ddp\"`) with `torch.optim.swa_utils.SWALR` in `configure_optimizers` if you want SWA's learning rate,"
        " or train with `strategy=\"ddp_sharded\"` (parameters stay whole, and this callback works there)",
    ),
    ModelPruning: (
        "it prunes the modules' weights in place, but under FSDP they are views into flat parameters that FSDP"
        " rebuilds for every forward pass, so pruning would fail at the end of the first epoch",
        "",
    ),
}


def check_sharded_ddp_callbacks(callbacks: Iterable[Callback], strategy: str) -> None:
    """Raise ``MisconfigurationException`` for a callback that cannot work under ``DDPShardedStrategy``.

    ``ModelPruning``'s lottery-ticket reset (``use_lottery_ticket_hypothesis``, on by default) gives the weights their
    first values by rebinding ``param.data``. OSS keeps each rank's parameters as views into one buffer and sends
    every step's update through those buffers, so a rebound parameter stops receiving the updates of the ranks that
    own it: training goes on with stale weights, silently (0.26 off after 3 epochs of the tests' model).
    """
    for callback in callbacks:
        if isinstance(callback, ModelPruning) and lottery_ticket_reset(callback):
            raise MisconfigurationException(
                f"`ModelPruning(use_lottery_ticket_hypothesis=...)` does not work with `{strategy}`: resetting the"
                " weights rebinds their `.data`, which detaches them from the buffers through which FairScale's OSS"
                " shares every optimizer step between the ranks, so training would go on with stale weights. Pass"
                " `ModelPruning(..., use_lottery_ticket_hypothesis=False)` (pruning itself works with this strategy),"
                ' or train with `strategy="ddp"`.'
            )


def check_callbacks(callbacks: Iterable[Callback], strategy: str) -> None:
    """Raise ``MisconfigurationException`` for the first callback that cannot work under the FSDP strategy.

    Example:
        >>> check_callbacks([ModelPruning("l1_unstructured")], "DDPFullyShardedStrategy")
        Traceback (most recent call last):
        ...
        lightning_fabric.utilities.exceptions.MisconfigurationException: `ModelPruning` does not work with ...
    """
    for callback in callbacks:
        for kind, (why, instead) in _UNSUPPORTED.items():
            if isinstance(callback, kind):
                raise MisconfigurationException(
                    f"`{type(callback).__name__}` does not work with `{strategy}`: {why}. Remove the callback from the"
                    f" Trainer (or from `configure_callbacks`){instead}."
                )


def trainer_callbacks(strategy: Strategy) -> list[Callback]:
    """The callbacks of the Trainer running ``strategy``: known in ``setup_environment``, before any process group
    exists, so that every rank refuses a callback alike; none before the LightningModule is connected."""
    module = strategy.lightning_module
    if module is None or attached_trainer(module) is None:
        return []
    callbacks: list[Callback] = module.trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connectors
    return list(callbacks)
