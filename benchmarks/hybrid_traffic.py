"""The bytes each rank sends within its node and across nodes per training step, on 2 simulated nodes of 2
processes: ``DDPFullyShardedStrategy`` with ``FULL_SHARD``, ``SHARD_GRAD_OP`` and ``HYBRID_SHARD``, and Lightning's
``"ddp"``, next to the formulas.

This machine has one node and no network to measure, so this is a model of the traffic, built from what the ranks
really run: every all-gather, reduce-scatter and all-reduce of a steady-state training step is recorded with its
group and payload (``lightning_fairscale.distributed.collectives.recording_traffic``: FairScale's FSDP collectives,
the replica all-reduce of hybrid sharding, DDP's gradient all-reduce through its communication hook). Each is then
costed as a bandwidth-optimal ring over its group's ranks in rank order (what NCCL and gloo do for large tensors):
each rank sends ``(g - 1) / g`` of the payload for an all-gather or a reduce-scatter, ``2 (g - 1) / g`` for an
all-reduce, all of it to the next rank of the ring, which is on the other node or not. Ranks ``2n`` and ``2n + 1``
form node ``n``, as under torchrun and SLURM.

Usage::

    python benchmarks/hybrid_traffic.py            # writes benchmarks/results/hybrid_traffic.md (~30 s)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import QUIET_TRAINER, Block, free_port, machine, publish, quiet_known_warnings, versions  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "hybrid_traffic.md"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
WIDTH, DEPTH = 256, 4  # 8 W^2 + 7 W parameters a block: every unit's divides by 4 (no padding)
STEPS = 3  # the last one is reported; the first ones build what FSDP and DDP build lazily
CONFIGS = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "DDP")

#: Per rank and step, in units of Ψ bytes (Ψ parameters, fp32), on 2 nodes of 2 under the ring model: (within the
#: node, across nodes), averaged over the ranks; and the formula in words.
FORMULAS: dict[str, tuple[float, float, str]] = {
    # 2 all-gathers (forward, backward) + 1 reduce-scatter of 4Ψ over 4 ranks: 3 x 3/4 x 4Ψ = 9Ψ, half of the ring's
    # hops (1 -> 2, 3 -> 0) cross the nodes.
    "FULL_SHARD": (4.5, 4.5, "3 × (N−1)/N × 4Ψ = 9Ψ; M of the N ring hops cross nodes (M/N = 1/2)"),
    "SHARD_GRAD_OP": (3.0, 3.0, "2 × (N−1)/N × 4Ψ = 6Ψ; M/N = 1/2 across"),
    # 3 collectives of 4Ψ over the node's 2 ranks, then the all-reduce of the 4Ψ/2 gradient shard over 2 replicas.
    "HYBRID_SHARD": (6.0, 2.0, "within: 3 × (k−1)/k × 4Ψ = 6Ψ; across: 2 (M−1)/M × 4Ψ/k = 2Ψ"),
    "DDP": (3.0, 3.0, "2 × (N−1)/N × 4Ψ = 6Ψ; M/N = 1/2 across"),
}


class Net(nn.Module):
    """``DEPTH`` blocks: under FSDP each is a unit, and the root unit holds no parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(DEPTH)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _lightning_module() -> Any:
    from pytorch_lightning import LightningModule

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            data = torch.randn(8 * STEPS, WIDTH)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, data.flip(1)), batch_size=8)

    return Model()


def _strategy(config: str) -> Any:
    if config == "DDP":
        return "ddp"
    from lightning_fairscale.strategies import DDPFullyShardedStrategy

    return DDPFullyShardedStrategy(auto_wrap_policy={Block}, sharding_strategy=config)


def _record_steps() -> Any:
    from pytorch_lightning import Callback

    from lightning_fairscale.distributed import collectives

    class RecordSteps(Callback):
        """Each training step's collectives (forward, backward, optimizer step)."""

        def __init__(self) -> None:
            self.steps: list[list[collectives.Transfer]] = []
            self._recording: Any = None

        def on_train_start(self, trainer: Any, *args: Any) -> None:
            model = trainer.strategy.model
            if isinstance(model, nn.parallel.DistributedDataParallel):
                # DDP's own all-reduce, through the hook that calls `torch.distributed.all_reduce` (so that it is
                # seen; Lightning registers `ddp_comm_hook` on CUDA only).
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                model.register_comm_hook(None, allreduce_hook)

        def on_train_batch_start(self, *args: Any) -> None:
            self._recording = collectives.recording_traffic()
            self.steps.append(self._recording.__enter__())

        def on_train_batch_end(self, *args: Any) -> None:
            self._recording.__exit__(None, None, None)

    return RecordSteps()


def worker(out: Path) -> None:
    """One rank: a short fit under each configuration; writes the last step's collectives as ``rank<N>.json``."""
    quiet_known_warnings()
    torch.set_num_threads(1)
    from pytorch_lightning import Trainer, seed_everything

    results: dict[str, Any] = {}
    for config in CONFIGS:
        seed_everything(0)
        recorder = _record_steps()
        trainer = Trainer(
            accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=_strategy(config), max_steps=STEPS,
            callbacks=[recorder], **QUIET_TRAINER,
        )  # fmt: skip
        model = _lightning_module()
        trainer.fit(model)
        if hasattr(trainer.strategy, "unshard_module"):
            trainer.strategy.unshard_module(rank_zero_only=False)
        results[config] = [[t.kind, list(t.ranks), t.nbytes] for t in recorder.steps[-1]]
    results["parameters"] = sum(p.numel() for p in Net().parameters())
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def launch(out: Path) -> list[dict[str, Any]]:
    """Start the 4 ranks as 2 nodes of 2, as a cluster launcher does (every rank told its node and local rank)."""
    out.mkdir(parents=True, exist_ok=True)
    common = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD))
    common["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    processes = []
    log = open(out / "launch.log", "w")
    with log, contextlib.ExitStack() as stack:
        for rank in range(WORLD):
            env = dict(common, NODE_RANK=str(rank // PER_NODE), LOCAL_RANK=str(rank % PER_NODE))
            process = subprocess.Popen(
                [sys.executable, __file__, "--worker", "--out", str(out)], env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            stack.callback(lambda pid=process.pid: _kill_group(pid))
            processes.append(process)
        codes = [process.wait(timeout=300) for process in processes]
    if any(codes):
        sys.stdout.write((out / "launch.log").read_text()[-6000:])
        raise RuntimeError(f"a rank failed (exit codes {codes}); the output is above")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def sent(kind: str, ranks: list[int], nbytes: int, rank: int) -> tuple[float, float]:
    """The bytes ``rank`` sends for one collective under the ring model: (within its node, across nodes)."""
    g = len(ranks)
    if g == 1:
        return 0.0, 0.0
    amount = (2 if kind == "all_reduce" else 1) * (g - 1) / g * nbytes
    successor = ranks[(ranks.index(rank) + 1) % g]
    across = successor // PER_NODE != rank // PER_NODE
    return (0.0, amount) if across else (amount, 0.0)


def summarise(config: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank sent bytes (mean over ranks, within and across nodes), the bytes each node sends across, and the
    payloads counted, by kind and group size."""
    within = across = 0.0
    node_across = [0.0] * NODES
    payloads: dict[tuple[str, int, bool], int] = {}
    for rank, result in enumerate(ranks):
        for kind, group, nbytes in result[config]:
            w, a = sent(kind, group, nbytes, rank)
            within, across = within + w, across + a
            node_across[rank // PER_NODE] += a
            spans = len({r // PER_NODE for r in group}) > 1
            key = (kind, len(group), spans)
            payloads[key] = payloads.get(key, 0) + (nbytes if rank == 0 else 0)
    return {"within": within / WORLD, "across": across / WORLD, "node_across": max(node_across), "payloads": payloads}


def report(ranks: list[dict[str, Any]], seconds: float) -> str:
    psi = ranks[0]["parameters"]
    mib = 2**20
    lines = [
        "# Hybrid sharding: bytes sent per rank and step, within and across nodes",
        "",
        f"Machine: {machine()}. {versions()}.",
        f"Model: {DEPTH} residual MLP blocks of width {WIDTH}, Ψ = {psi:,} parameters (fp32: 4Ψ = {4 * psi / mib:.2f}"
        f" MiB), each block an FSDP unit, Adam; 2 simulated nodes × 2 processes (gloo), step {STEPS} of {STEPS}.",
        "Counted: every all-gather, reduce-scatter and all-reduce of the step (`collectives.recording_traffic`).",
        "Modelled: a ring over each group's ranks; a rank sends (g−1)/g of an all-gather's or reduce-scatter's"
        " payload,",
        "2(g−1)/g of an all-reduce's, to the next rank of the ring (N = 4 ranks, M = 2 nodes, k = 2 ranks a node).",
        f"Measured in {seconds:.0f} s.",
        "",
        "| Strategy | Collectives counted per step (payload, group) | Sent per rank within node (mean) | Sent per rank"
        " across nodes (mean) | Sent across by each node | Formula (per rank) | Model = formula |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config in CONFIGS:
        summary = summarise(config, ranks)
        expected_within, expected_across, formula = FORMULAS[config]
        counted = "; ".join(
            f"{kind} {nbytes / (4 * psi):g} × 4Ψ over {size} ({'across' if spans else 'within'})"
            for (kind, size, spans), nbytes in sorted(summary["payloads"].items())
        )
        matches = abs(summary["within"] - expected_within * psi) + abs(summary["across"] - expected_across * psi)
        lines.append(
            f"| {config} | {counted} | {summary['within'] / mib:.2f} MiB = {summary['within'] / psi:.2f}Ψ"
            f" | {summary['across'] / mib:.2f} MiB = {summary['across'] / psi:.2f}Ψ"
            f" | {summary['node_across'] / mib:.2f} MiB = {summary['node_across'] / psi:.2f}Ψ"
            f" | {formula} | {'yes' if matches < 1e-6 * psi else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="/tmp/hybrid_traffic", help="where the ranks write their records")
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.out))
        return 0
    started = time.perf_counter()
    ranks = launch(Path(args.out) / str(os.getpid()))
    publish(report(ranks, time.perf_counter() - started), RESULT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
