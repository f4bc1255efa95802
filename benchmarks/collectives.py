"""Benchmark: what one collective costs on CPU between 2 ranks (gloo), for the tensors FSDP moves (issue 35).

FSDP on CPU spends most of what a step costs beyond the computation in its all-gathers and reduce-scatters
(``benchmarks/speed.py``'s breakdown). This measures them alone, with nothing else running, on 2 processes with 1
thread each, for the shards of ``speed.py``'s models: one encoder layer of the small model (394,880 float32
elements per rank, 1.58 MB) and of the large one (1,576,448, 6.3 MB), and the whole small model (2,369,536,
9.5 MB). For each size:

* gloo's ``all_gather_single`` and ``reduce_scatter_single`` (what FairScale calls), and ``all_reduce`` of the same
  whole tensor (what DDP calls for its gradients: one all-reduce moves what an all-gather and a reduce-scatter do);
* the exchanges that replace the first two on CPU (:mod:`lightning_fairscale.distributed.exchanges`).

Each figure is the median over 3 rounds of the mean of 20 calls (after 3 warm-up calls), rank 0's wall time; the
rounds interleave the kinds. Run from the project's root (about 30 s)::

    .venv/bin/python benchmarks/collectives.py      # or: make bench BENCHMARKS=collectives

It writes ``benchmarks/results/collectives.md``.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from lightning_fairscale.distributed import collectives, exchanges  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "results" / "collectives.md"
WORLD_SIZE, ROUNDS, CALLS, WARMUP = 2, 3, 20, 3
#: Elements of each rank's shard, by what it is.
SHARDS = {
    "small model, one layer": 394_880,
    "large model, one layer": 1_576_448,
    "small model, whole": 2_369_536,
}
KINDS = ("gloo all-gather", "exchange all-gather", "gloo reduce-scatter", "exchange reduce-scatter", "all-reduce")


def _calls(numel: int) -> dict[str, Callable[[], Any]]:
    shard, gathered = torch.randn(numel), torch.empty(WORLD_SIZE * numel)
    full, reduced = torch.randn(WORLD_SIZE * numel), torch.empty(numel)
    chunks = list(full.chunk(WORLD_SIZE))
    return {
        "gloo all-gather": lambda: collectives.current_name("all_gather_into_tensor")(gathered, shard),
        "exchange all-gather": lambda: exchanges.all_gather(gathered, shard).wait(),
        "gloo reduce-scatter": lambda: collectives.reduce_scatter_tensor(reduced, full),
        "exchange reduce-scatter": lambda: exchanges.reduce_scatter(reduced, chunks).wait(),
        "all-reduce": lambda: dist.all_reduce(full),
    }


def _mean_ms(call: Callable[[], Any]) -> float:
    for _ in range(WARMUP):
        call()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(CALLS):
        call()
    return (time.perf_counter() - started) / CALLS * 1e3


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    rank, children = _common.start_ranks(WORLD_SIZE)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    load_before = _common.load_average()
    results: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in KINDS} for name in SHARDS}
    for _ in range(ROUNDS):
        for name, numel in SHARDS.items():
            for kind, call in _calls(numel).items():
                results[name][kind].append(_mean_ms(call))
    dist.destroy_process_group()
    _common.join_ranks(children)
    if rank != 0:
        return
    rows = []
    for name, numel in SHARDS.items():
        medians = {kind: statistics.median(times) for kind, times in results[name].items()}
        rows.append([
            name, f"{numel * 4 / 1e6:.2f}", *(f"{medians[kind]:.2f}" for kind in KINDS),
            f"{medians['gloo all-gather'] / medians['exchange all-gather']:.2f}x",
            f"{medians['gloo reduce-scatter'] / medians['exchange reduce-scatter']:.2f}x",
        ])
    header = ["Shard", "MB per rank", *(f"{kind} (ms)" for kind in KINDS), "all-gather speed-up",
              "reduce-scatter speed-up"]
    lines = [
        "# One collective on CPU between 2 ranks: gloo's against the exchanges",
        "",
        f"- Machine: {_common.machine()}; 2 ranks (gloo) x 1 thread, nothing else running in them",
        f"- Versions: {_common.versions()}",
        f"- {CALLS} calls after {WARMUP} warm-up calls, mean per call (rank 0), median over {ROUNDS} interleaved "
        "rounds; float32; the all-reduce is of the whole tensor (2 shards)",
        f"- Before: {load_before}; after: {_common.load_average()}",
        "",
        *_common.markdown_table(header, "ll" + "r" * (len(header) - 2), rows),
        "",
        "Command: `.venv/bin/python benchmarks/collectives.py`",
        "",
    ]
    _common.publish("\n".join(lines), OUTPUT)


if __name__ == "__main__":
    main()
