"""Lightning callbacks that cannot work on FSDP's sharded parameters, refused before anything runs.

Lightning's own ``StochasticWeightAveraging`` refuses its FSDP and DeepSpeed strategies, which it knows by class;
ours it does not know. Each entry below was run under ``DDPFullyShardedStrategy`` first; what happened is the reason
given. Under ``DDPShardedStrategy`` the parameters stay whole on every rank, and ``StochasticWeightAveraging`` gives
the same weights as under Lightning's ``"ddp"`` (tested), so nothing is refused there.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.callbacks import Callback, ModelPruning, StochasticWeightAveraging

#: Callback classes, why they cannot work under FSDP, and what to do instead.
_UNSUPPORTED: dict[type[Callback], tuple[str, str]] = {
    StochasticWeightAveraging: (
        "it averages the LightningModule's parameters into a copy of the module and copies the average back, but under"
        " FSDP the module's parameters are flat shards held by FSDP's wrappers, so it would average nothing and"
        " change nothing, silently",
        " or train with `strategy=\"ddp_sharded\"` (FairScale's optimizer and gradient sharding: parameters stay whole,"
        " and SWA works there) or `\"ddp\"`",
    ),
    ModelPruning: (
        "it prunes the modules' weights in place, but under FSDP they are views into flat parameters that FSDP"
        " rebuilds for every forward pass, so pruning would fail at the end of the first epoch",
        "",
    ),
}


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
