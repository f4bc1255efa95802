"""Benchmark: what one collective costs on CPU between 2 ranks (gloo), for the tensors FSDP moves (issue 35).

FSDP on CPU spends most of what a step costs beyond the computation in its all-gathers and reduce-scatters
(``benchmarks/speed.py``'s breakdown). This measures them alone, with nothing else running, on 2 processes with 1
thread each, for the shards of ``speed.py``'s models: one encoder layer of the small model (394,880 float32
elements per rank, 1.58 MB) and of the large one (1,576,448, 6.3 MB), and the whole small model (2,369,536,
9.5 MB). For each size:

* gloo's ``all_gather_single`` and ``reduce_scatter_single`` (what FairScale calls), and ``all_reduce`` of the same
  whole tensor (what DDP calls for its gradients: one all-reduce moves what an all-gather and a reduce-scatter do);
* the exchanges that replace the first two on CPU (:mod:`lightning_fairscale.distributed.exchanges`).

Then, for "gather small units together" (issue 35): several units' shards all-gathered by one exchange each, all
started before any is waited for (what the prefetcher does), against one exchange of their concatenation, with the
copies that needs (each unit's full parameters are a storage of their own: the shards are copied into one tensor,
and the gathered tensor out into each unit's), for units of ``min_num_params=100_000`` in the small model (each
attention and each feed-forward linear: ~131,600 elements per rank, 0.53 MB), for smaller ones, and for the small
model's layers.

Each figure is the median over 3 rounds of the mean of 20 calls (after 3 warm-up calls), rank 0's wall time; the
rounds interleave the kinds. Run from the project's root (about 40 s)::

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
#: Units gathered at once: (elements of each unit's shard, how many units), by what they are.
UNITS = {
    "18 units of 16,384 elements (64 KB)": (16_384, 18),
    "6 units of min_num_params=100_000 (0.53 MB)": (131_584, 6),
    "18 units of min_num_params=100_000 (0.53 MB)": (131_584, 18),
    "3 layers of the small model (1.58 MB)": (394_880, 3),
}
TOGETHER = ("each its own exchange", "one exchange, with the copies")


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


def _unit_calls(numel: int, units: int) -> dict[str, Callable[[], Any]]:
    shards = [torch.randn(numel) for _ in range(units)]
    fulls = [torch.empty(WORLD_SIZE * numel) for _ in range(units)]
    gathered = torch.empty(WORLD_SIZE * units * numel)

    def separate() -> None:
        for work in [exchanges.all_gather(full, shard) for full, shard in zip(fulls, shards)]:
            work.wait()

    def together() -> None:
        exchanges.all_gather(gathered, torch.cat(shards)).wait()
        by_rank = gathered.view(WORLD_SIZE, units, numel)  # rank r's shards, unit after unit
        for index, full in enumerate(fulls):
            full.view(WORLD_SIZE, numel).copy_(by_rank[:, index])

    return dict(zip(TOGETHER, (separate, together)))


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
    gathered: dict[str, dict[str, list[float]]] = {name: {way: [] for way in TOGETHER} for name in UNITS}
    for _ in range(ROUNDS):
        for name, numel in SHARDS.items():
            for kind, call in _calls(numel).items():
                results[name][kind].append(_mean_ms(call))
        for name, (numel, units) in UNITS.items():
            for way, call in _unit_calls(numel, units).items():
                gathered[name][way].append(_mean_ms(call))
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
    unit_rows = []
    for name, (_, units) in UNITS.items():
        medians = {way: statistics.median(times) for way, times in gathered[name].items()}
        separate, together = (medians[way] for way in TOGETHER)
        unit_rows.append([name, f"{separate:.2f}", f"{together:.2f}", f"{together / separate:.2f}x",
                          f"{(separate - together) / units * 1e3:+.0f}"])
    unit_header = ["Units gathered at once", f"{TOGETHER[0]} (ms)", f"{TOGETHER[1]} (ms)", "together / separate",
                   "saved per unit (us)"]
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
        "## Gathering units together",
        "",
        "Every unit's shard gathered by an exchange of its own, all started before the first is waited for (what the"
        " prefetcher does), against one exchange of the concatenated shards with the copies in and out that it needs"
        " (each unit's full parameters are their own storage). Same rounds and calls as above.",
        "",
        *_common.markdown_table(unit_header, "l" + "r" * (len(unit_header) - 1), unit_rows),
        "",
        "Command: `.venv/bin/python benchmarks/collectives.py`",
        "",
    ]
    _common.publish("\n".join(lines), OUTPUT)


if __name__ == "__main__":
    main()
