"""FairScale's sharded training for PyTorch Lightning 2.x.

Importing the package registers the strategy names ``"fsdp_fairscale"`` and ``"ddp_fully_sharded"`` with Lightning's
strategy registry, so ``Trainer(strategy="fsdp_fairscale")`` works. Lightning's own ``"fsdp"`` stays Lightning's.
"""

from lightning_fairscale.__about__ import __version__
from lightning_fairscale.strategies import DDPFullyShardedStrategy

__all__ = ["DDPFullyShardedStrategy", "__version__"]
