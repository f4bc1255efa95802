"""Benchmark: what the whole path costs (issue 53): Adafactor and Muon under ``DDPFullyShardedStrategy``, each
parameter stepped whole by its owner rank, against Adam on the element-wise path and against Lightning's ``"ddp"``.

The model is a stack of the benchmarks' residual blocks (``x + down(GELU(up(LayerNorm(x))))``, 4x wide hidden layer),
one FSDP unit each, float32, 2 processes, Fabric's loop (one forward, backward and step per batch). Configurations:

* ``fsdp-adam``: ``torch.optim.Adam`` over every parameter: the element-wise path (this rank's slices, no hook);
* ``fsdp-adafactor``: ``torch.optim.Adafactor``: the whole path (gradient and data slices to each parameter's
  owner, the step on whole tensors, the updated slices back);
* ``fsdp-muon``: ``torch.optim.Muon`` on the matrices (whole path) + ``AdamW`` on the rest (element-wise);
* ``ddp-adam``, ``ddp-adafactor``, ``ddp-muon``: the same under Lightning's ``"ddp"`` (every rank holds and steps
  every parameter);
* ``fsdp-adam-l2``, ``ddp-adam-l2``: Adam, the loss plus an L2 penalty over ``model.parameters()`` computed after the
  forward, as a user's ``training_step`` adds it (under FSDP: each parameter's sum of squares reduced over the shard
  group, with autograd: ``lightning_fairscale.fsdp.unit.sharded_reads``);
* ``fsdp-adam-local``: ``fsdp-adam`` with the loop inside ``lightning_fairscale.local_reads()`` (every read of a
  parameter outside the forward this rank's slice): what the whole reads cost an element-wise step.

Every configuration runs in a fresh launch, interleaved in ``--rounds`` rounds (a shared machine's load hits all
alike); a ratio is the median of the rounds' own ratios (the two launches of a round ran side by side). Per rank:
the median step time (slowest rank), the bytes this rank sent per step through the whole path's exchanges
(``collectives.point_to_point_bytes``: FSDP's own all-gathers and reduce-scatters are the same for every optimizer),
the optimizer state it holds (``memory_figures()``) and its peak resident set (``VmHWM``, reset after the warm-up),
and the payload of every collective of a step (``collectives.recording_traffic``: FSDP's all-gathers and
reduce-scatters, the reads' all-reduces, DDP's all-reduce through a hook that calls ``torch.distributed``).

Run it from the project's root (about 5 minutes on two busy CPU cores)::

    .venv/bin/python benchmarks/whole_optimizers.py             # or: make bench BENCHMARKS=whole_optimizers
    .venv/bin/python benchmarks/whole_optimizers.py --quick     # a check that it runs
    .venv/bin/python benchmarks/whole_optimizers.py --configs fsdp-adam fsdp-adam-l2 ddp-adam ddp-adam-l2

It prints markdown tables and writes them to ``benchmarks/results/whole_optimizers.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "results" / "whole_optimizers.md"
WORLD = 2
CONFIGS = (
    "fsdp-adam", "fsdp-adafactor", "fsdp-muon", "fsdp-adam-l2", "fsdp-adam-local", "ddp-adam", "ddp-adafactor",
    "ddp-muon", "ddp-adam-l2",
)
#: The L2 penalty's weight (``*-l2``).
L2 = 1e-4
#: (configuration, the one it is compared with): the ratios of step times reported.
PAIRS = [
    ("fsdp-adafactor", "fsdp-adam"), ("fsdp-muon", "fsdp-adam"), ("fsdp-adafactor", "ddp-adafactor"),
    ("fsdp-muon", "ddp-muon"), ("fsdp-adam", "ddp-adam"), ("fsdp-adam-l2", "fsdp-adam"),
    ("fsdp-adam-l2", "ddp-adam-l2"), ("ddp-adam-l2", "ddp-adam"),
    # The Adam path with the parameters' whole reads on (the default) against the same loop inside `local_reads()`
    # (every read of a parameter outside the forward this rank's slice, as before whole reads existed): their cost
    # on an element-wise step.
    ("fsdp-adam", "fsdp-adam-local"),
]


class Stack(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_common.wide_block(width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def optimizers_for(kind: str, module: nn.Module) -> list[torch.optim.Optimizer]:
    params = list(module.parameters())
    if kind == "adam":
        return [torch.optim.Adam(params, lr=1e-3)]
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-3)]
    matrices = [p for p in params if p.ndim >= 2]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW([p for p in params if p.ndim < 2], lr=1e-3)]


def run_worker(config: str, args: argparse.Namespace, out: Path) -> None:
    from lightning_fabric import Fabric

    from lightning_fairscale import local_reads
    from lightning_fairscale.distributed import collectives
    from lightning_fairscale.fabric import DDPFullyShardedStrategy

    _common.quiet_known_warnings()
    front, kind = config.split("-", 1)
    kind, _, extra = kind.partition("-")
    penalty, local = extra == "l2", extra == "local"
    strategy: Any = DDPFullyShardedStrategy(auto_wrap_policy={type(_common.wide_block(8))}) if front == "fsdp" \
        else "ddp"
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    module = Stack(args.width, args.depth)
    numel = sum(p.numel() for p in module.parameters())
    model, *optimizers = fabric.setup(module, *optimizers_for(kind, module))
    if front == "ddp":  # DDP's all-reduce through `torch.distributed`, so that the payload counts it
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model._forward_module.register_comm_hook(None, allreduce_hook)
    g = torch.Generator().manual_seed(fabric.global_rank)
    batch = torch.randn(args.batch, args.width, generator=g)
    clock = _common.StepClock()
    sent: list[int] = []
    payload: list[int] = []
    total = args.warmup + args.steps + 1
    for step in range(total):
        if step == args.warmup:
            _common.reset_peak_rss()
        before = collectives.point_to_point_bytes(every_group=True)
        recording = collectives.recording_traffic()
        transfers = recording.__enter__()
        clock.start()
        with local_reads() if local else contextlib.nullcontext():
            loss = model(batch).pow(2).mean()
            if penalty:  # after the forward, over what the user's `self.parameters()` gives
                loss = loss + L2 * sum(p.pow(2).sum() for p in model.parameters())
            fabric.backward(loss)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        clock.end()
        recording.__exit__(None, None, None)
        sent.append(collectives.point_to_point_bytes(every_group=True) - before)
        payload.append(sum(transfer.nbytes for transfer in transfers))
    held = _common.held_bytes(model, [getattr(o, "optimizer", o) for o in optimizers])
    _common.write_rank_result(out, fabric.global_rank, {
        **clock.marks(), **_common.resident_bytes(), **held, "numel": numel,
        "sent": statistics.median(sent[args.warmup:]), "payload": statistics.median(payload[args.warmup:]),
    })


def launch(config: str, args: argparse.Namespace, work: Path, round_: int) -> list[dict[str, Any]]:
    sizes = [f"--{name}={getattr(args, name)}" for name in ("width", "depth", "batch", "warmup", "steps")]
    return _common.launch(Path(__file__), ["--worker", config, *sizes], work / f"{config}-{round_}", 600,
                          _common.threads_env(WORLD))


def report(args: argparse.Namespace, rounds: list[dict[str, list[dict[str, Any]]]], conditions: str) -> str:
    configs = [c for c in CONFIGS if c in rounds[0]]
    times = {c: [_common.step_times(r[c], args.warmup, args.steps).step for r in rounds] for c in configs}
    first = rounds[0]
    numel = first[configs[0]][0]["numel"]
    lines = [
        "# The whole path's cost: Adafactor and Muon under DDPFullyShardedStrategy",
        "",
        f"{_common.machine()}; {_common.versions()}",
        f"{WORLD} processes, Fabric, {args.depth} blocks of width {args.width} ({numel:,} parameters = Ψ, float32),"
        f" batch {args.batch} per process, {args.warmup} warm-up + {args.steps} measured steps, {len(rounds)} rounds of"
        f" fresh launches. {conditions}.",
        "",
        "## Per configuration (medians over the rounds; per rank: the largest)",
        "",
    ]
    rows = []
    for config in configs:
        ranks = [rank for r in rounds for rank in r[config]]
        sent = max(rank["sent"] for rank in ranks)
        payload = max(rank["payload"] for rank in ranks)
        rows.append([
            config, f"{statistics.median(times[config]) * 1e3:.1f}",
            f"{min(times[config]) * 1e3:.1f}–{max(times[config]) * 1e3:.1f}",
            f"{sent / 1024:,.1f}", f"{sent / (4 * numel):.4f}", f"{payload / 1024:,.1f}",
            _common.mib(max(rank["optimizer_state"] for rank in ranks)),
            _common.mib(max(rank["peak_rss"] for rank in ranks)),
        ])
    lines += _common.markdown_table(
        ["configuration", "step (ms)", "range over rounds", "sent by the whole path (KiB/step/rank)",
         "… in 4Ψ bytes", "collectives' payload (KiB/step/rank)", "optimizer state (MiB/rank)",
         "peak RSS (MiB/rank)"], "lrrrrrrr", rows)
    lines += ["", "## Ratios of step times (median of the rounds' own ratios; each round's)", ""]
    pair_rows = []
    for a, b in (pair for pair in PAIRS if set(pair) <= set(configs)):
        ratios = [x / y for x, y in zip(times[a], times[b])]
        pair_rows.append([f"{a} / {b}", f"{statistics.median(ratios):.2f}", ", ".join(f"{r:.2f}" for r in ratios)])
    lines += _common.markdown_table(["pair", "median ratio", "rounds"], "lrl", pair_rows)
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark (or, with ``--worker``, one configuration's training). Returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512, help="model width")
    parser.add_argument("--depth", type=int, default=4, help="number of blocks")
    parser.add_argument("--batch", type=int, default=64, help="rows per process and step")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of fresh launches")
    parser.add_argument("--quick", action="store_true", help="a small model, one round: a check that it runs")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the markdown report")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS, help="the configurations to run")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args, args.out)
        return 0
    if args.quick:
        args.width, args.depth, args.rounds, args.steps, args.warmup = 64, 2, 1, 2, 1
    started, conditions = time.perf_counter(), f"Load before: {_common.load_average()}"
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-whole-") as work:
        for round_ in range(args.rounds):
            rounds.append({config: launch(config, args, Path(work), round_) for config in args.configs})
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    conditions += f"; after: {_common.load_average()}; the whole benchmark took {time.perf_counter() - started:.0f} s"
    _common.publish(report(args, rounds, conditions), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
