"""The benchmarks' harness: what every benchmark script shares, so that each script holds only its own idea (its
model, its configurations, what it measures in a worker and how its report reads).

* the model's repeated block (:func:`wide_block`, the tests' ``Block``) and quiet Trainer arguments;
* fresh launches: :func:`launch` runs the script itself as a worker (``--worker ...``; Lightning's launcher re-runs
  it for every rank, and memory high-water marks or allocator state must not carry over between configurations);
  a worker writes one ``rank<N>.json`` per rank (:func:`write_rank_result`), which :func:`launch` collects.
  :func:`threads_env` gives every launch ranks x threads = cores; :func:`start_ranks` / :func:`join_ranks` start
  the ranks of a hand-written loop the way Lightning's launcher does;
* measuring in a worker: :class:`StepClock` marks each step, :func:`step_times` turns the ranks' marks into
  medians (slowest rank); :func:`held_bytes` counts parameters, gradients and optimizer state by distinct storage;
  :func:`resident_bytes` / :func:`status_kib` / :func:`reset_peak_rss` read the resident set and its peak
  (``VmHWM``) per rank;
* the report: :func:`markdown_table`, :func:`mib`, :func:`verdict`, :func:`machine`, :func:`versions`,
  :func:`load_average`, and :func:`publish` (print and write ``benchmarks/results/<name>.md``).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

#: The tests' folder, for the one test model (``tests/models.py``): the benchmarks train the same ``Block``.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import Block  # noqa: E402

MIB = 2**20
#: glibc's initial mmap threshold (128 KiB), made fixed: otherwise glibc raises it after the first large ``free`` and
#: then keeps freed tensors in its heap, so the resident set never goes down and peaks above it measure nothing.
MALLOC_MMAP_THRESHOLD = 128 * 1024


def wide_block(width: int) -> Block:
    """The benchmarks' block: the tests' ``Block`` (``tests/models.py``) with a 4x wide hidden layer and GELU,
    ``x + down(GELU(up(LayerNorm(x))))``.

    The repeated layer of the benchmarks' models, standing in for a transformer block: one FSDP unit each, and
    internal activations (the two wide tensors above all) about 10 times the size of its input, which is all that
    activation checkpointing keeps of it.
    """
    return Block(width, hidden=4 * width)


#: The Trainer arguments every benchmark shares: nothing that writes files, prints per step or runs extra batches.
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


#: Deprecation notices from FairScale 0.4.13 and Lightning internals on recent torch: noise for a benchmark.
_KNOWN_WARNINGS = (
    "TypedStorage is deprecated",
    "`torch.distributed._all_gather_base`",
    "`torch.distributed.reduce_scatter_tensor`",
    r"`isinstance\(treespec, LeafSpec\)`",
    "The number of training batches",
    "does not have many workers",
)


#: The strategy's defaults for a CPU run (``fsdp_kwargs()`` with ``DDPFullyShardedStrategy()``), for benchmarks that
#: build our FairScale units by hand: flattened parameters, resharded after forward, 25 MB reduce-scatter buckets,
#: float32, no offload. FairScale's default groups (none given) are the strategy's two: the default group for
#: all-gathers, one more for reduce-scatters.
STRATEGY_CPU_UNIT_KWARGS: dict[str, Any] = {
    "compute_device": torch.device("cpu"),
    "reshard_after_forward": True,
    "flatten_parameters": True,
    "bucket_cap_mb": 25,
    "mixed_precision": False,
    "fp32_reduce_scatter": False,
    "cpu_offload": False,
    "move_grads_to_cpu": False,
    "state_dict_device": torch.device("cpu"),
}


def quiet_known_warnings() -> None:
    """Silence :data:`_KNOWN_WARNINGS` in this process."""
    for message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=".*" + message)


def status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field")


def reset_peak_rss() -> None:
    """Reset this process's resident-set high-water mark (``VmHWM``) to its current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def cpu_model() -> str:
    """The CPU's model name."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line: the accelerator or CPU, and the number of cores."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, {os.cpu_count()} CPU cores"
    return f"{cpu_model()}, {os.cpu_count()} cores, no GPU"


def versions() -> str:
    """One line: the versions that matter for the figures."""
    names = ("torch", "pytorch-lightning", "fairscale", "lightning-fairscale")
    return f"Python {platform.python_version()}, " + ", ".join(f"{name} {_version(name)}" for name in names)


def _version(name: str) -> str:
    """``name``'s installed version; for a package imported from a path without its metadata (``PYTHONPATH=src``),
    its module's ``__version__`` (or "(not installed)"): the figures a run measured are still reported."""
    try:
        return version(name)
    except PackageNotFoundError:
        found = getattr(sys.modules.get(name.replace("-", "_")), "__version__", None)
        return f"{found} (from source)" if found else "(not installed)"


def launch(
    script: Path, args: list[str], out_dir: Path, timeout_s: float, env: Optional[dict[str, str]] = None
) -> list[dict[str, Any]]:
    """Run ``script args --out out_dir`` as a fresh launch and return what each rank wrote, by rank.

    The launch runs in a session of its own, so that on a timeout it and the ranks it started end together.
    """
    out_dir.mkdir(parents=True)
    log_path = out_dir / "launch.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(script), *args, "--out", str(out_dir)],
            env=env if env is not None else dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = -1
    files = sorted(out_dir.glob("rank*.json"))
    if code != 0 or not files:
        sys.stdout.write(log_path.read_text()[-6000:])
        raise RuntimeError(f"{script.name} {' '.join(args)} failed (exit code {code}); its output is above")
    return [json.loads(path.read_text()) for path in files]


def publish(text: str, path: Path, *others: Path) -> None:
    """Write a benchmark's markdown report to ``path`` and print it, with the files it was written to."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print()
    print(text)
    print(f"(written to {' and '.join(str(p) for p in (path, *others))})")


def write_rank_result(out_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """What a worker rank reports to :func:`launch`."""
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


#: Set in the environment of the ranks that :func:`start_ranks` starts, so that they do not start ranks themselves.
_STARTED_RANK = "BENCHMARK_STARTED_RANK"


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_ranks(world_size: int) -> tuple[int, list[subprocess.Popen[bytes]]]:
    """Start the other ranks of a hand-written multi-process run, the way Lightning's default launcher does.

    The process that calls this first becomes rank 0: it starts ranks ``1 .. world_size - 1`` as copies of itself
    (``sys.executable`` with the same ``sys.argv``) and sets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE`` for all of them, so that ``torch.distributed.init_process_group`` can use its
    ``env://`` rendezvous. In a started rank it only reads its rank. Comparing a hand-written loop with the
    Trainer is fairer this way: both run one fresh interpreter per rank, started the same way.

    Args:
        world_size: the number of processes, this one included.

    Returns:
        This process's rank, and (in rank 0) the processes it started; pass them to :func:`join_ranks` at the end.
    """
    if os.environ.get(_STARTED_RANK):
        return int(os.environ["RANK"]), []
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}
    children = [
        subprocess.Popen(
            [sys.executable, *sys.argv],
            env=dict(os.environ, **common, RANK=str(rank), LOCAL_RANK=str(rank), **{_STARTED_RANK: "1"}),
        )
        for rank in range(1, world_size)
    ]
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    return 0, children


def join_ranks(children: list[subprocess.Popen[bytes]], timeout_s: float = 120) -> None:
    """Wait for the ranks :func:`start_ranks` started; raise if one of them failed."""
    for child in children:
        code = child.wait(timeout=timeout_s)
        if code != 0:
            raise RuntimeError(f"a rank started by start_ranks exited with code {code}")


# ------------------------------------------------------------------------------------------------------------------
# Measuring in a worker rank: step times, what the rank holds, its resident set


class StepClock:
    """Wall-clock and CPU-time marks at the start and the end of every training step of this rank."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_starts: list[float] = []

    def start(self) -> None:
        """Mark the start of a step (before anything of the step runs)."""
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def end(self) -> None:
        """Mark the end of a step's forward, backward and optimizer step."""
        self.ends.append(time.perf_counter())

    def marks(self) -> dict[str, list[float]]:
        """The marks, for the rank's result (:func:`step_times` reads them back)."""
        return {"starts": self.starts, "ends": self.ends, "cpu_starts": self.cpu_starts}


@dataclass
class StepTimes:
    """The step times of a run, over its ranks (seconds).

    Attributes:
        step: median time between consecutive step starts, slowest rank.
        step_range: fastest and slowest measured step of any rank.
        window: median time from a step's start to its end (forward, backward, optimizer step), slowest rank.
        cpu: median CPU time of a step (all threads of the process), largest over ranks.
    """

    step: float
    step_range: tuple[float, float]
    window: float
    cpu: float


def step_times(ranks: list[dict[str, Any]], warmup: int, steps: int) -> StepTimes:
    """The :class:`StepTimes` of steps ``warmup .. warmup + steps - 1`` from each rank's :meth:`StepClock.marks`
    (a run needs ``warmup + steps + 1`` steps: the extra step's start closes the last measured interval)."""
    periods, windows, cpus = [], [], []
    measured = range(warmup, warmup + steps)
    for rank in ranks:
        starts, ends, cpu = rank["starts"], rank["ends"], rank["cpu_starts"]
        if len(starts) < warmup + steps + 1:
            raise RuntimeError(f"a rank ran {len(starts)} steps, not {warmup + steps + 1}")
        periods.append([starts[i + 1] - starts[i] for i in measured])
        windows.append([ends[i] - starts[i] for i in measured])
        cpus.append([cpu[i + 1] - cpu[i] for i in measured])
    return StepTimes(
        step=max(statistics.median(p) for p in periods),
        step_range=(min(map(min, periods)), max(map(max, periods))),
        window=max(statistics.median(w) for w in windows),
        cpu=max(statistics.median(c) for c in cpus),
    )


def held_bytes(module: nn.Module, optimizers: Iterable[Optimizer]) -> dict[str, int]:
    """The bytes this rank holds for parameters, gradients and optimizer state, counted by distinct storage.

    :func:`lightning_fairscale.fsdp.wrapping.summary.memory_figures` counts them (for every implementation alike): a
    tensor counts with the whole storage it keeps alive, each storage once, so a shard that were a view into a full-size
    buffer would count as the full buffer and the figure cannot look smaller than what is really held.
    """
    from lightning_fairscale.fsdp.wrapping.summary import memory_figures

    figures = memory_figures(module, optimizers)
    return {kind: int(figures[f"memory/{kind}_bytes"]) for kind in ("parameters", "gradients", "optimizer_state")}


def state_holders(optimizers: Iterable[Optimizer]) -> list[Optimizer]:
    """The optimizer objects that may hold state: Lightning's wrappers unwrapped, and OSS's local optimizer added."""
    holders = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        holders.append(optimizer)
        if isinstance(getattr(optimizer, "optim", None), Optimizer):  # fairscale.optim.OSS
            holders.append(optimizer.optim)
    return holders


def resident_bytes() -> dict[str, int]:
    """This process's resident set now (``rss``) and its peak since it started (``peak_rss``: ``VmHWM``)."""
    return {"rss": status_kib("VmRSS") * 1024, "peak_rss": status_kib("VmHWM") * 1024}


# ------------------------------------------------------------------------------------------------------------------
# Launching: the environment of a run's ranks


def threads_env(world_size: int) -> dict[str, str]:
    """This environment for a fresh launch of ``world_size`` CPU ranks: no launcher's variables, ranks x threads =
    cores (``OMP_NUM_THREADS``), and no CUDA device, so that the figures are comparable on any machine."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world_size)), CUDA_VISIBLE_DEVICES="")
    return env


# ------------------------------------------------------------------------------------------------------------------
# The report


def mib(value: float) -> str:
    """Bytes in MiB, one decimal, thousands separated."""
    return f"{value / MIB:,.1f}"


def verdict(ok: bool) -> str:
    """A target's result in a report."""
    return "PASS" if ok else "MISS"


def load_average() -> str:
    """The load average, for a report: other programs on the cores distort the step times."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def markdown_table(header: Sequence[str], align: str, rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: ``align`` has one letter per column, ``l`` (left) or ``r`` (right); an empty cell
    is written ``| |``."""
    assert len(align) == len(header), (align, header)

    def line(cells: Sequence[Any]) -> str:
        return "|" + "|".join(f" {cell} " if str(cell) else " " for cell in cells) + "|"

    return [line(header), line(["---" if a == "l" else "---:" for a in align]), *(line(row) for row in rows)]
