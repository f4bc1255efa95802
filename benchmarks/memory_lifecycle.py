"""Benchmark: every rank's peak memory at every stage of a run, against 16Ψ/N, up to a 1B-parameter model.

With Ψ parameters, N ranks, float32 and Adam, a rank of a fully sharded run holds 16Ψ/N bytes (parameters 4,
gradients 4, Adam's two moments 8). This benchmark follows a model through a whole run, in fresh launches, and reads
every rank's peak resident set (``VmHWM`` of ``/proc/self/status``, reset at each stage boundary by writing ``5`` to
``/proc/self/clear_refs``) in each stage:

* **construction**: ``configure_model`` builds the model, each block wrapped with ``fairscale.nn.wrap.wrap`` as it is
  made (the documented way to build a model too big to build whole); the strategy wraps the root, makes the optimizer;
* **first step** (Adam allocates its state), **steady state** (the next steps); **full save** (medium model only) and
  **sharded save** (``trainer.save_checkpoint`` after the last step); **end of fit** (until ``fit`` returns);
* **full resume** (medium model), **sharded resume** on the same and on another number of processes (large model): a
  fresh launch builds the model the same way, ``fit(ckpt_path=...)`` loads the checkpoint (the stage ends when it is
  in the shards); the resume on another number of processes trains one more step.

A tiny model (75 K parameters) goes through the same launches first: its peaks, stage by stage and rank by rank, are
the runtime's fixed baseline (interpreter, torch, Lightning, FairScale, gloo). A stage passes when every rank's peak is
at most ``1.15 x 16Ψ/N`` plus its baseline. A full save cannot (rank 0 gathers the full model and Adam state).

Models: a stem ``Linear(w, w)``, ``depth`` residual MLP blocks (``Block``, 8w² + 7w parameters each, one FSDP
unit each), a LayerNorm and a head ``Linear(w, w)``, width 2048, as deep as needed to reach the requested size:
1,015.5 M parameters (30 blocks) for the large model, 209.8 M (6 blocks) for the medium one. 2 CPU processes (gloo),
2 rows per rank per step, 2 steps. Checkpoints are written to a temporary folder under /tmp, deleted at the end.

``--meta-construction`` measures one thing only, in two launches (the tiny model, then the large one): the
construction peak of the large model built under ``trainer.init_module(empty_init=True)`` (on the meta device, each
block made a unit by ``auto_wrap_policy={Block}``, materialised and sharded as it is wrapped), against the rank's
parameter shards plus one block; ``fit`` runs with ``max_steps=0``. It writes ``results/memory_meta_construction.md``
and needs about 6 GiB (2 minutes here).

Run it from the project's root (about 12 minutes on our 2-core, 24 GiB machine; the large model needs about 19 GiB
available, and waits up to ``--wait-for-memory`` seconds for it); it writes ``results/memory_lifecycle.md`` and
``.png``; the exit code is 1 only when something could not be measured (a missed target is a result)::

    .venv/bin/python benchmarks/memory_lifecycle.py                  # or: make bench BENCHMARKS=memory_lifecycle
    .venv/bin/python benchmarks/memory_lifecycle.py --params 1e8 --medium-params 5e7 --width 1024   # smaller
    .venv/bin/python benchmarks/memory_lifecycle.py --meta-construction   # the meta-device construction only
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from fairscale.nn.wrap import wrap
from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import Block  # noqa: E402

from lightning_fairscale.strategies import DDPFullyShardedStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "results" / "memory_lifecycle.md"
PLOT = HERE / "results" / "memory_lifecycle.png"
META_OUTPUT = HERE / "results" / "memory_meta_construction.md"
MIB = _common.MIB
GIB = 2**30
TOLERANCE = 1.15
BASELINE_WIDTH, BASELINE_DEPTH = 64, 2
LAUNCH_TIMEOUT_S = 2400
#: What a process needs besides 16Ψ/N (the baseline, transients), when checking that a launch fits in memory.
PROCESS_RESERVE = 500 * MIB

warnings.filterwarnings(
    "ignore", message=".*(TypedStorage|_all_gather_base|_reduce_scatter_base|reduce_scatter_tensor|LeafSpec|workers"
    "|number of training batches|deprecated|does not have many workers).*"
)


def parameter_count(width: int, depth: int) -> int:
    """Ψ of :class:`Stack` without building it: ``depth`` blocks of 8w² + 7w, stem and head w² + w, a norm 2w."""
    return depth * (8 * width * width + 7 * width) + 2 * width * width + 4 * width


def depth_for(params: float, width: int) -> int:
    """The smallest depth at which :class:`Stack` of ``width`` has at least ``params`` parameters (at least 1)."""
    return max(1, math.ceil((params - parameter_count(width, 0)) / (8 * width * width + 7 * width)))


class Stack(LightningModule):
    """A stem, ``depth`` blocks (each its own FSDP unit, wrapped as it is built), a norm and a head; Adam, MSE.

    With ``build_now`` the layers are built in ``__init__`` instead, unwrapped (build it on the meta device, and let
    the strategy's ``auto_wrap_policy={Block}`` make the units)."""

    def __init__(
        self, width: int, depth: int, on_loaded: Optional[Callable[[Trainer], None]] = None, build_now: bool = False
    ) -> None:
        super().__init__()
        self.width, self.depth, self.on_loaded = width, depth, on_loaded
        self.blocks: Optional[nn.Sequential] = None
        if build_now:
            self._build(wrap_blocks=False)

    def configure_model(self) -> None:
        if self.blocks is None:
            # One block at a time: `wrap` shards each block as soon as it exists, so the full model never does.
            self._build(wrap_blocks=True)

    def _build(self, wrap_blocks: bool) -> None:
        self.stem = nn.Linear(self.width, self.width)
        blocks = (_common.wide_block(self.width) for _ in range(self.depth))  # each wrapped as soon as it is built
        self.blocks = nn.Sequential(*[wrap(block) if wrap_blocks else block for block in blocks])
        self.norm = nn.LayerNorm(self.width)
        self.head = nn.Linear(self.width, self.width)

    def forward(self, x: Tensor) -> Tensor:
        assert self.blocks is not None
        return self.head(self.norm(self.blocks(self.stem(x))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Called right after the strategy has loaded the checkpoint into the shards (`fit(ckpt_path=...)`).
        if self.on_loaded is not None:
            self.on_loaded(self.trainer)


def memory_kib() -> dict[str, int]:
    """This process's resident set now and its parts (anonymous, file-backed), in KiB."""
    return {field: _common.status_kib(field) for field in ("VmRSS", "RssAnon", "RssFile")}


class StageProbe(Callback):
    """Resets the resident-set peak at each stage boundary and records every stage's peak, time and end state."""

    def __init__(self, saves: list[str], folder: Optional[Path], steps: int, resuming: bool) -> None:
        self.saves, self.folder, self.steps, self.resuming = saves, folder, steps, resuming
        self.stages: list[dict[str, Any]] = []
        self._open: dict[str, Any] = {}
        self._step = 0

    def start(self, name: str, trainer: Optional[Trainer] = None) -> None:
        gc.collect()
        if trainer is not None:
            trainer.strategy.barrier()  # every rank enters the stage together
        before = memory_kib()
        _common.reset_peak_rss()
        self._open = {"name": name, "before": before, "started": time.perf_counter()}

    def end(self) -> None:
        stage, self._open = self._open, {}
        stage.update(peak_kib=_common.status_kib("VmHWM"), after=memory_kib())
        stage["seconds"] = time.perf_counter() - stage.pop("started")
        self.stages.append(stage)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.start("construction", trainer)  # before `configure_model`

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.end()  # the strategy has wrapped the root and created the optimizer
        if self.resuming:
            self.start("resume", trainer)  # the checkpoint is loaded after this hook

    def loaded(self, trainer: Trainer) -> None:
        """The checkpoint is in the shards (:meth:`Stack.on_load_checkpoint`): the next stage begins (no barrier:
        the strategy's loading ends with an agreement of all ranks already)."""
        self.end()
        self.held(trainer)
        self.start("step after resume" if self.steps else "end of fit")

    def held(self, trainer: Trainer) -> None:
        """Record what the rank's tensors hold after the last stage (parameters, gradients, optimizer state)."""
        figures = trainer.strategy.memory_figures()  # type: ignore[attr-defined]
        self.stages[-1]["held_bytes"] = sum(figures.values())

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.resuming and self._step < 2:  # (a resume's step began when the checkpoint was loaded)
            self.start("steady state" if self._step else "first step", trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._step += 1
        if self._step == 1 or self._step == self.steps:
            self.end()
            self.held(trainer)
        if self._step < self.steps:
            return
        for kind in self.saves:
            assert self.folder is not None
            trainer.strategy.state_dict_type = kind  # type: ignore[attr-defined]  # the kind of the next save
            self.start(f"{kind} save", trainer)
            trainer.save_checkpoint(self.folder / f"{kind}.ckpt")
            self.end()
        self.start("end of fit", trainer)  # ended when `fit` has returned


def run_worker(args: argparse.Namespace) -> None:
    """One rank of one launch: train (and save) or resume (and train one more step); writes ``rank<N>.json``."""
    seed_everything(0, verbose=False)
    resuming = args.worker == "resume"
    saves = [s for s in args.saves.split(",") if s] if not resuming else []
    probe = StageProbe(saves, args.ckpt if not resuming else None, args.extra if resuming else args.steps, resuming)
    steps = args.steps + (args.extra if resuming else 0)
    rows = 2 * steps * args.batch
    data = TensorDataset(torch.randn(rows, args.width), torch.randn(rows, args.width))
    strategy = DDPFullyShardedStrategy(state_dict_type="sharded")
    trainer = Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=steps, callbacks=[probe],
                      use_distributed_sampler=False, **_common.QUIET_TRAINER)
    model = Stack(args.width, args.depth, on_loaded=probe.loaded if resuming else None)
    trainer.fit(model, DataLoader(data, batch_size=args.batch), ckpt_path=args.ckpt if resuming else None)
    probe.end()  # "end of fit"
    result = {"stages": probe.stages, "threads": torch.get_num_threads(), "cpu_seconds": time.process_time()}
    _common.write_rank_result(args.out, trainer.global_rank, result)
    if dist.is_initialized():
        dist.barrier()  # every rank has written its file before rank 0 (the process the parent waits for) returns


def run_meta_construction_worker(args: argparse.Namespace) -> None:
    """One rank of a meta-construction launch: the model built under ``trainer.init_module(empty_init=True)`` (on the
    meta device), then ``fit`` with ``max_steps=0``: the strategy materialises and shards each block as it wraps it,
    wraps the root and creates the optimizer (the *construction* stage), and stops. Writes ``rank<N>.json``."""
    seed_everything(0, verbose=False)
    probe = StageProbe([], None, 0, False)
    strategy = DDPFullyShardedStrategy(auto_wrap_policy={Block})
    trainer = Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=0, callbacks=[probe],
                      use_distributed_sampler=False, **_common.QUIET_TRAINER)
    before = memory_kib()
    with trainer.init_module(empty_init=True):
        model = Stack(args.width, args.depth, build_now=True)
    built = memory_kib()
    rows = 2 * args.batch
    data = TensorDataset(torch.randn(rows, args.width), torch.randn(rows, args.width))
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    probe.held(trainer)  # the parameter shards: no gradients or optimizer state exist yet
    meta = [p for p in trainer.strategy.model.parameters() if p.is_meta]  # type: ignore[union-attr]
    result = {"stages": probe.stages, "built": {"before": before, "after": built}, "meta_left": len(meta)}
    _common.write_rank_result(args.out, trainer.global_rank, result)
    if dist.is_initialized():
        dist.barrier()


def run_meta_construction(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], int]:
    """The tiny model's and the large model's meta-construction launches; ``({model: ranks' results}, exit code)``."""
    sizes = {"baseline": (BASELINE_WIDTH, BASELINE_DEPTH), "large": (args.width, depth_for(args.params, args.width))}
    results: dict[str, Any] = {}
    for model, (width, depth) in sizes.items():
        numel = parameter_count(width, depth)
        needed = args.ranks * int(4 * numel / args.ranks + 3 * block_bytes(width) + PROCESS_RESERVE)
        if model != "baseline" and not wait_for_memory(needed, args.wait_for_memory):
            print(f"  {model}: not measured, only {available_bytes() / GIB:.1f} GiB available", flush=True)
            return results, 1
        sizes_args = ["--width", str(width), "--depth", str(depth), "--batch", str(args.batch)]
        started = time.perf_counter()
        ranks = _common.launch(
            Path(__file__).resolve(), [*sizes_args, "--worker", "construct", "--world", str(args.ranks)],
            work / f"meta-{model}", LAUNCH_TIMEOUT_S,
        )
        results[model] = {"numel": numel, "width": width, "depth": depth, "ranks": ranks,
                          "seconds": time.perf_counter() - started}
        peaks = fmt([stage_of(r, "construction")["peak_kib"] / 1024 for r in ranks])
        print(f"  {model} ({numel / 1e6:,.1f} M parameters): construction peak MiB {peaks}", flush=True)
    return results, 0


def block_bytes(width: int) -> int:
    """The bytes of one block's parameters (float32): the largest FSDP unit of :class:`Stack`."""
    return 4 * (8 * width * width + 7 * width)


def meta_construction_report(results: dict[str, Any], args: argparse.Namespace, conditions: str, command: str) -> str:
    """The construction peak of each rank of the meta-built large model, against its shards plus one unit."""
    large, baseline = results["large"], results["baseline"]
    world, numel = len(large["ranks"]), large["numel"]
    shards, unit = 4 * numel / world / MIB, block_bytes(large["width"]) / MIB
    lines = [
        "# Building a model larger than one rank's memory: the construction peak of a meta-device model",
        "",
        f"- Machine: {_common.machine()}; {conditions}",
        f"- Versions: {_common.versions()}",
        f"- Command: `{command}`",
        f"- Model: {numel / 1e6:,.1f} M parameters (width {large['width']}, {large['depth']} blocks of"
        f" {unit:,.0f} MiB), built under `trainer.init_module(empty_init=True)`; `DDPFullyShardedStrategy("
        "auto_wrap_policy={Block})` on"
        f" {world} CPU processes materialises and shards each block as it wraps it; `fit` with `max_steps=0`",
        "- Construction: from the `setup` hook to `on_fit_start` (materialising, wrapping, the optimizer); peak ="
        " `VmHWM`, reset at its start; baseline = the same launch with a tiny model"
        f" ({parameter_count(BASELINE_WIDTH, BASELINE_DEPTH):,} parameters); MiB",
        f"- Target: baseline + the rank's parameter shards (4Ψ/N = {shards:,.0f}) + one unit ({unit:,.0f})",
        "",
        "| Rank | Built on meta (RSS growth) | Peak | Baseline | Shards + one unit | Target | Above target |"
        " Held after |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rank, (result, base) in enumerate(zip(large["ranks"], baseline["ranks"])):
        peak = stage_of(result, "construction")["peak_kib"] / 1024
        base_peak = stage_of(base, "construction")["peak_kib"] / 1024
        built = (result["built"]["after"]["VmRSS"] - result["built"]["before"]["VmRSS"]) / 1024
        target = base_peak + shards + unit
        held = stage_of(result, "construction").get("held_bytes", 0) / MIB
        lines.append(f"| {rank} | {built:,.0f} | {peak:,.0f} | {base_peak:,.0f} | {shards + unit:,.0f} |"
                     f" {target:,.0f} | {peak - target:+,.0f} ({(peak - target) / unit:+.2f} units) | {held:,.0f} |")
    left = sum(r["meta_left"] for r in large["ranks"])
    lines += ["", f"Parameters left on the meta device after setup: {left}. Wall time of the large launch:"
              f" {large['seconds']:.0f} s.", ""]
    return "\n".join(lines) + "\n"


def available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo``: what can be allocated without swapping or evicting much."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable field")


def load_average() -> str:
    """The load average over 1 and 5 minutes (other programs on the cores slow the run down)."""
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"


def wait_for_memory(needed: int, wait_s: float) -> bool:
    """Wait up to ``wait_s`` seconds until ``needed`` bytes are available; whether they are."""
    deadline = time.monotonic() + wait_s
    while available_bytes() < needed and time.monotonic() < deadline:
        print(f"  waiting: {available_bytes() / GIB:.1f} GiB available, {needed / GIB:.1f} GiB needed", flush=True)
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))
    return available_bytes() >= needed


def launches(model: str, ranks: int, other: int) -> list[tuple[str, str, int, int]]:
    """``(label, kind, world size, steps after resuming)`` of the launches of a model, in order.

    The medium model saves both kinds and resumes from the full checkpoint; the large one saves sharded only (a full
    checkpoint does not fit) and resumes on ``ranks`` and on ``other`` processes; the baseline runs all of them. Only
    the resume on another number of processes trains a step after loading (the others would repeat the steady state).
    """
    plan = [("train", "train", ranks, 0)]
    if model != "large":
        plan.append((f"full resume {ranks}→{ranks}", "full", ranks, 0))
    if model != "medium":
        plan += [(f"sharded resume {ranks}→{ranks}", "sharded", ranks, 0),
                 (f"sharded resume {ranks}→{other}", "sharded", other, 1)]
    return plan


def run_model(model: str, width: int, depth: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every launch of one model; returns ``{"numel", "launches": {label: [rank results]}, "seconds"}``."""
    numel = parameter_count(width, depth)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-memory-{model}-", dir="/tmp"))
    sizes = ["--width", str(width), "--depth", str(depth), "--steps", str(args.steps), "--batch", str(args.batch)]
    result: dict[str, Any] = {"numel": numel, "width": width, "depth": depth, "launches": {}, "seconds": {}}
    try:
        for label, kind, world, extra in launches(model, args.ranks, args.other_ranks):
            if model != "baseline":
                needed = int(TOLERANCE * 16 * numel + world * PROCESS_RESERVE)
                if not wait_for_memory(needed, args.wait_for_memory):
                    free = available_bytes()
                    result["error"] = f"{label}: only {free / GIB:.1f} GiB available, {needed / GIB:.1f} GiB needed"
                    print(f"  {model}: not measured, {result['error']}", flush=True)
                    break
            if kind == "train":
                worker = ["--worker", "train", "--saves", "sharded" if model == "large" else "full,sharded"]
                ckpt = folder
            else:
                worker, ckpt = ["--worker", "resume", "--extra", str(extra)], folder / f"{kind}.ckpt"
            started = time.perf_counter()
            try:
                ranks = _common.launch(
                    Path(__file__).resolve(), [*sizes, *worker, "--world", str(world), "--ckpt", str(ckpt)],
                    work / f"{model}-{len(result['launches'])}", LAUNCH_TIMEOUT_S,
                )
            except RuntimeError as error:  # its output is printed; report what was measured
                result["error"] = f"{label}: {error}"
                break
            seconds = time.perf_counter() - started
            result["launches"][label], result["seconds"][label] = ranks, seconds
            peaks = ", ".join(
                f"{s['name']} {max(stage_of(r, s['name'])['peak_kib'] for r in ranks) / 1024:,.0f}"
                for s in ranks[0]["stages"]
            )
            print(f"  {model} {label} ({world} ranks): {seconds:.0f} s; peak MiB: {peaks}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def stage_of(rank: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in rank["stages"] if s["name"] == name)


def rows_of(model: dict[str, Any], baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (launch, stage): per rank (MiB) the resident set at the start, the peak, the baseline and the
    limit; 16Ψ/N; the verdict; the stage's time (slowest rank) and, after steps, the tensors held."""
    rows = []
    for label, ranks in model["launches"].items():
        world = len(ranks)
        ideal = 16 * model["numel"] / world / MIB
        for stage in ranks[0]["stages"]:
            name = stage["name"]
            peaks = [stage_of(r, name)["peak_kib"] / 1024 for r in ranks]
            base = [stage_of(r, name)["peak_kib"] / 1024 for r in baseline["launches"][label]]
            limits = [TOLERANCE * ideal + b for b in base]
            each = [stage_of(r, name) for r in ranks]
            rows.append({
                "launch": label, "stage": name, "world": world, "peaks": peaks, "baseline": base, "ideal": ideal,
                "limits": limits, "ok": all(p <= lim for p, lim in zip(peaks, limits)),
                "start": [s["before"]["VmRSS"] / 1024 for s in each], "seconds": max(s["seconds"] for s in each),
                "held": [s.get("held_bytes", 0) / MIB for s in each],
            })
    return rows


def headline_name(row: dict[str, Any]) -> str:
    """The stage's name in the report: a resume launch's stages are named after the launch."""
    if row["launch"] == "train":
        return row["stage"]
    return row["launch"] if row["stage"] == "resume" else f"{row['launch']}: {row['stage']}"


def fmt(values: list[float]) -> str:
    return " / ".join(f"{v:,.0f}" for v in values)


def verdict(row: dict[str, Any]) -> str:
    expected = " (expected: rank 0 gathers the full model and Adam state)" if row["stage"] == "full save" else ""
    return "PASS" if row["ok"] else "MISS" + expected


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, conditions: str, command: str) -> str:
    baseline = results["baseline"]
    models = {name: model for name, model in results.items() if name != "baseline"}
    ran = [m for m in models.values() if m["launches"] and not m.get("error")]
    lines = [
        "# Memory through a run: every rank's peak at every stage, against 16Ψ/N",
        "",
        f"- Machine: {_common.machine()}, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB"
        f" of memory; {conditions}",
        f"- Versions: {_common.versions()}",
        f"- Command: `{command}`",
        f"- Training: {args.ranks} CPU processes (gloo, one thread each), {args.batch} rows per rank per step,"
        f" {args.steps} steps, Adam, float32; the resume on {args.other_ranks} processes trains one more step",
        "- Start / Peak: the resident set (`VmRSS`) at the stage's start, and its high-water mark (`VmHWM`) during"
        " the stage, reset at its start (`/proc/self/clear_refs`); per rank (rank 0 / rank 1 / ...), MiB; glibc's"
        " default allocator",
        "- Held: parameters + gradients + optimizer state of the rank after the stage (`strategy.memory_figures()`),"
        " MiB",
        f"- Target: every rank's peak at most {TOLERANCE} x 16Ψ/N + its baseline: the peak of the same stage and rank"
        f" of a tiny model ({parameter_count(BASELINE_WIDTH, BASELINE_DEPTH):,} parameters) through the same launches:"
        " the runtime's fixed cost",
        "",
    ]
    if ran:
        largest = max(ran, key=lambda m: m["numel"])
        lines += [f"Largest model that ran: **{largest['numel'] / 1e9:.3f} B parameters** on {args.ranks} processes"
                  f" (16Ψ = {16 * largest['numel'] / GIB:.1f} GiB in all).", ""]
    for name, model in models.items():
        numel, rows = model["numel"], rows_of(model, baseline)
        misses = [headline_name(r) for r in rows if not r["ok"]]
        lines += [f"## {name.capitalize()} model: {numel / 1e6:,.1f} M parameters (width {model['width']},"
                  f" {model['depth']} blocks), 16Ψ = {16 * numel / MIB:,.0f} MiB", ""]
        lines += [f"**Not measured in full**: {model['error']}.", ""] if model.get("error") else []
        lines += [f"{len(rows) - len(misses)} of {len(rows)} stages within the limit"
                  + (f"; above it: {', '.join(misses)}." if misses else "."), "",
                  "| Stage | N | Start | Peak | Baseline | 16Ψ/N | Limit | Result | Time (s) | Held |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
        for row in rows:
            lines.append(
                f"| {headline_name(row)} | {row['world']} | {fmt(row['start'])} | {fmt(row['peaks'])} |"
                f" {fmt(row['baseline'])} | {row['ideal']:,.0f} | {fmt(row['limits'])} | {verdict(row)} |"
                f" {row['seconds']:.1f} | {fmt(row['held']) if any(row['held']) else ''} |"
            )
        launch_times = ", ".join(
            f"{label} {s:.0f} s ({max(r.get('cpu_seconds', 0) for r in model['launches'][label]):.0f} s of CPU time"
            " on the busiest rank)" for label, s in model["seconds"].items()
        )
        lines += ["", f"Wall time of the launches: {launch_times}.", ""]
    lines += [f"Regenerate with `make bench BENCHMARKS=memory_lifecycle` or `{command}`; the plot is"
              " `benchmarks/results/memory_lifecycle.png`."]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """One panel per model: each rank's peak per stage (bars), 16Ψ/N + baseline and the limit (marks)."""
    import matplotlib  # imported here: `--help` and the workers do not need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [n for n in results if n != "baseline" and results[n]["launches"]]
    figure, axes = plt.subplots(len(models), 1, figsize=(13, 5.6 * len(models)), squeeze=False)
    for axis, name in zip(axes[:, 0], models):
        rows = rows_of(results[name], results["baseline"])
        colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
        labelled: set[str] = set()

        def label(text: str) -> Optional[str]:  # each legend entry once
            first = text not in labelled
            labelled.add(text)
            return text if first else None
        for x, row in enumerate(rows):
            width = 0.8 / row["world"]
            for rank, (peak, start) in enumerate(zip(row["peaks"], row["start"])):
                left = x - 0.4 + width * (rank + 0.5)
                above = peak > row["limits"][rank]
                axis.bar(left, peak / 1024, width * 0.95, color=colors[rank % len(colors)], alpha=0.85,
                         label=label(f"rank {rank}"), hatch="//" if above else None, edgecolor="red" if above else None)
                axis.hlines(start / 1024, left - width / 2, left + width / 2, color="white", linewidth=1.5)
            axis.hlines(max(row["limits"]) / 1024, x - 0.45, x + 0.45, color="black", linewidth=2,
                        label=label(f"limit: {TOLERANCE} x 16Ψ/N + baseline"))
            axis.hlines((row["ideal"] + max(row["baseline"])) / 1024, x - 0.45, x + 0.45, color="gray",
                        linestyle="--", label=label("16Ψ/N + baseline"))
        axis.set_xticks(range(len(rows)), [headline_name(r).replace(": ", ":\n") for r in rows], fontsize=7,
                        rotation=30, ha="right")
        axis.set(ylabel="peak resident set (GiB)",
                 title=f"{name} model, {results[name]['numel'] / 1e6:,.0f} M parameters: each rank's peak per stage"
                 " (white line: resident set at the stage's start; hatched red: above the limit)")
        axis.title.set_fontsize(10)
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=6)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9, help="parameters of the large model (at least)")
    parser.add_argument("--medium-params", type=float, default=2e8, help="parameters of the medium model (full save)")
    parser.add_argument("--width", type=int, default=2048, help="width of the blocks (and of the data)")
    parser.add_argument("--models", nargs="+", choices=["medium", "large"], default=["medium", "large"])
    parser.add_argument("--ranks", type=int, default=2, help="processes that train and save")
    parser.add_argument("--other-ranks", type=int, default=4, help="processes of the resume on another world size")
    parser.add_argument("--steps", type=int, default=2, help="training steps before saving (at least 2)")
    parser.add_argument("--batch", type=int, default=2, help="rows per rank per step")
    parser.add_argument("--wait-for-memory", type=float, default=300, help="seconds to wait for enough free memory")
    parser.add_argument("--raw", type=Path, help="also write every rank's measurements to this JSON file")
    parser.add_argument("--from-raw", type=Path, help="write the report and plot from such a file, measuring nothing")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--meta-output", type=Path, default=META_OUTPUT)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--meta-construction", action="store_true",
                        help="measure only the construction of the large model built on the meta device"
                        f" (trainer.init_module(empty_init=True)); writes {META_OUTPUT.relative_to(HERE)}")
    parser.add_argument("--worker", choices=["train", "resume", "construct"], help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--saves", default="", help=argparse.SUPPRESS)
    parser.add_argument("--extra", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "construct":
        run_meta_construction_worker(args)
        return 0
    if args.worker:
        run_worker(args)
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a first step, then the steady state)")
    if args.from_raw:
        raw = json.loads(args.from_raw.read_text())
        return publish(raw["results"], argparse.Namespace(**raw["args"]), raw["conditions"], raw["command"], args)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/memory_lifecycle.py", *sys.argv[1:]])
    if args.meta_construction:
        conditions = f"load average before: {load_average()}"
        with tempfile.TemporaryDirectory(prefix="bench-memory-logs-") as scratch:
            results, code = run_meta_construction(args, Path(scratch))
        if code:
            return code
        conditions += f", after: {load_average()}"
        _common.publish(meta_construction_report(results, args, conditions, command), args.meta_output)
        return 0
    sizes = {"baseline": (BASELINE_WIDTH, BASELINE_DEPTH)}
    sizes.update({m: (args.width, depth_for(args.params if m == "large" else args.medium_params, args.width))
                  for m in ("medium", "large") if m in args.models})
    print("Memory through a run: " + ", ".join(f"{m} {parameter_count(*s) / 1e6:,.1f} M" for m, s in sizes.items()))
    started = time.perf_counter()
    conditions = f"load average before: {load_average()}"
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-logs-") as scratch:
        for model, (width, depth) in sizes.items():
            results[model] = run_model(model, width, depth, args, Path(scratch))
            if results["baseline"].get("error"):
                print(f"The baseline could not be measured ({results['baseline']['error']}); nothing to report.")
                return 1
    conditions += (f", after: {load_average()}; {available_bytes() / GIB:.1f} GiB available at the end;"
                   f" wall time of the benchmark {time.perf_counter() - started:.0f} s")
    if args.raw:
        kept = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        raw = {"results": results, "args": kept, "conditions": conditions, "command": command}
        args.raw.write_text(json.dumps(raw))
    return publish(results, args, conditions, command, args)


def publish(results: dict[str, Any], measured: argparse.Namespace, conditions: str, command: str,
            args: argparse.Namespace) -> int:
    """Write and print the report, draw the plot; the exit code (1: something could not be measured)."""
    text = report(results, measured, conditions, command)
    plot(results, args.plot)
    _common.publish(text, args.output, args.plot)
    return 1 if any(r.get("error") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
