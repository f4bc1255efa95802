"""Several machines ("nodes"): ``Trainer(num_nodes=N, devices=per_node)`` under torchrun or SLURM.

The strategies are Lightning strategies, so Lightning's cluster environments start them: TorchElastic (``torchrun``)
and SLURM are detected from their environment variables. On a real cluster, start this script once per machine:

* torchrun, on each of 2 machines (``--node-rank`` 0 and 1, the same address and port)::

      torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr node0 --master-port 29500 \\
          examples/multi_node.py --nodes 2 --devices 8

* SLURM (``#SBATCH --nodes 2 --ntasks-per-node 8 --gpus-per-node 8``)::

      srun python examples/multi_node.py --nodes 2 --devices 8

Run without a launcher (``python examples/multi_node.py``), the script demonstrates the same on this machine: it
starts two ``torchrun`` "nodes" of one CPU process each on localhost and waits for them.
"""

import argparse
import os
import socket
import subprocess
import sys

import torch
from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_fairscale.strategies import DDPFullyShardedStrategy


def launched() -> bool:
    return any(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "LOCAL_RANK"))


def demo_on_localhost() -> int:
    """Two torchrun "nodes" with one process each, on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    nodes = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port,
                __file__, "--nodes", "2", "--devices", "1",
            ]
        )  # fmt: skip
        for rank in range(2)
    ]
    return max(node.wait() for node in nodes)


def train(nodes: int, devices: int) -> None:
    trainer = Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        num_nodes=nodes,
        devices=devices,
        strategy=DDPFullyShardedStrategy(),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(BoringModel())
    environment = type(trainer.strategy.cluster_environment).__name__
    print(f"OK node {trainer.node_rank} rank {trainer.global_rank} of {trainer.world_size} ({environment})", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    if launched():
        train(args.nodes, args.devices)
    else:
        sys.exit(demo_on_localhost())
