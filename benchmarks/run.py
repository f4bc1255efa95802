"""Run every benchmark of this folder, one after the other (``make bench``).

A benchmark is a script ``benchmarks/<name>.py`` that runs with no arguments, prints its results, writes them to
``benchmarks/results/<name>.md``, and exits non-zero only when it could not measure (a missed performance target is a
result, not a failure). This runner finds them by name: every ``*.py`` file here except itself and helper modules whose
names start with ``_``. Each runs in a process of its own: benchmarks start multi-process training (Lightning's
launcher re-runs the script it was started from), so they cannot share an interpreter.

Usage (from the project's root)::

    .venv/bin/python benchmarks/run.py                           # all of them
    .venv/bin/python benchmarks/run.py activation_checkpointing  # only those named

The exit code is 1 when any benchmark failed, 2 when a name matches no benchmark.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent


def discover() -> list[Path]:
    """The benchmark scripts of this folder, sorted by name."""
    return sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmarks named in ``argv`` (all when none). Returns the exit code."""
    names = sys.argv[1:] if argv is None else argv
    scripts = discover()
    if names:
        unknown = sorted(set(names) - {p.stem for p in scripts})
        if unknown:
            print(f"No benchmark named {', '.join(unknown)}; there are: {', '.join(p.stem for p in scripts)}")
            return 2
        scripts = [p for p in scripts if p.stem in names]
    failed = []
    for script in scripts:
        print(f"==> {script.stem}", flush=True)
        started = time.perf_counter()
        # The same interpreter (the project's virtual environment under `make bench`), from the project's root.
        code = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        status = "ok" if code == 0 else f"FAILED (exit code {code})"
        print(f"<== {script.stem}: {status} in {time.perf_counter() - started:.0f} s\n", flush=True)
        if code != 0:
            failed.append(script.stem)
    if failed:
        print(f"Failed: {', '.join(failed)}")
        return 1
    print(f"All {len(scripts)} benchmark(s) ran.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
