"""The Makefile's own promises: ``make -n`` is a dry run (issue 55's read-along finding: the recipe of ``make test``
named ``$(MAKE)``, which GNU make runs even under ``-n``, and with that line the whole suite)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("target", ["test", "unit", "lint", "doctest", "demo"])
def test_make_n_only_prints(tmp_path: Path, target: str) -> None:
    # A virtual environment that does not exist: a recipe that ran would have to create it (or fail without it).
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert f"{venv}/bin/python" in done.stdout  # it printed the recipe...
    assert not venv.exists() and not list(tmp_path.iterdir())  # ...and ran none of it
