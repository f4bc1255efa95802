"""Shared fixtures: multi-process scenarios run as scripts, so Lightning's launcher can start one process per rank."""

from __future__ import annotations

import contextlib
import textwrap
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

TRAIN_SCRIPT = TESTS / "scenarios" / "train.py"


def run_script(
    args: list[str], cwd: Path, timeout: float = 300, expect_ok: bool = True, package: str = "pytorch_lightning"
) -> subprocess.CompletedProcess:
    """Run a Python script in its own session; whatever it started (the other ranks) is killed when it ends.

    Scenarios run with the Lightning ``package`` given (``scenarios/flavor.py``): ``"pytorch_lightning"`` or
    ``"lightning"``.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning"}
    env["TEST_LIGHTNING_PACKAGE"] = package
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOBAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, *args]
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        finally:
            # A rank left behind (its peer was killed) must not outlive the test, holding ports and CPU.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    proc = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{args} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def package() -> str:
    """The Lightning package the scenarios run with; tests parametrize it to run against both."""
    return "pytorch_lightning"


@pytest.fixture
def train(tmp_path: Path, package: str) -> Callable[..., dict[str, Any]]:
    """Run ``scenarios/train.py`` with the given arguments and return what rank 0 saved."""
    counter = iter(range(1000))

    def _train(*args: str) -> dict[str, Any]:
        out = tmp_path / f"result-{next(counter)}.pt"
        run_script([str(TRAIN_SCRIPT), "--out", str(out), *args], cwd=tmp_path, package=package)
        return torch.load(out, weights_only=False)

    return _train


@pytest.fixture
def train_failing(tmp_path: Path, package: str) -> Callable[..., subprocess.CompletedProcess]:
    """Run ``scenarios/train.py`` expecting it to fail; return the finished process."""

    def _train(*args: str) -> subprocess.CompletedProcess:
        proc = run_script(
            [str(TRAIN_SCRIPT), "--out", str(tmp_path / "unused.pt"), *args], cwd=tmp_path, expect_ok=False,
            package=package,
        )
        assert proc.returncode != 0, proc.stdout[-2000:]
        return proc

    return _train


def assert_loads_without_fairscale(path: Path, expected: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """``RegressionModel.load_from_checkpoint(path)`` in a process where fairscale cannot be imported."""
    torch.save(expected, tmp_path / "expected.pt")
    script = tmp_path / "load.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.modules["fairscale"] = None  # any import of fairscale now fails
            sys.modules["lightning_fairscale"] = None
            sys.path.insert(0, {str(TESTS)!r})
            import torch
            from scenarios.common import RegressionModel, max_difference
            model = RegressionModel.load_from_checkpoint({str(path)!r})
            expected = torch.load({str(tmp_path / "expected.pt")!r})
            assert max_difference(model.state_dict(), expected) == 0.0
            assert not any(name.startswith("fairscale") for name in sys.modules if sys.modules[name] is not None)
            print("loaded without fairscale")
            """
        )
    )
    proc = run_script([str(script)], cwd=tmp_path)
    assert "loaded without fairscale" in proc.stdout
