"""What the benchmarks share: process memory readings, the machine's description, and fresh multi-process launches.

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
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

import torch

MIB = 2**20
#: glibc's initial mmap threshold (128 KiB), made fixed: otherwise glibc raises it after the first large ``free`` and
#: then keeps freed tensors in its heap, so the resident set never goes down and peaks above it measure nothing.
MALLOC_MMAP_THRESHOLD = 128 * 1024


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


def write_rank_result(out_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """What a worker rank reports to :func:`launch`."""
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
