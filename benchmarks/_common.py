"""What the benchmarks share: their models' repeated block (the tests' ``Block``), quiet Trainer arguments, memory readings, the machine's
description, fresh multi-process launches and the report's publication.

Each benchmark measures its configurations in fresh launches of itself (``--worker ...``): Lightning's launcher
re-runs the script for every rank, and memory high-water marks or allocator state must not carry over between
configurations. A worker writes one ``rank<N>.json`` per rank into the folder it is given; :func:`launch` collects
them.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

import torch

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
    return f"Python {platform.python_version()}, " + ", ".join(f"{name} {version(name)}" for name in names)


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
