"""Several scenarios in one launch: the same processes run a list of jobs one after another.

Starting a rank costs ~5 s on our 2-core machines (importing torch and Lightning), while a job of these tests trains
for well under a second. So the tests give a scenario script a JSON list of jobs (``script --jobs FILE``), each its
own command line; every rank runs the same list in the same order, reusing one process group. A job may be expected
to fail (``"fails": true``): the error is one every rank raises before it starts a collective the others would not
join (a misconfiguration, a damaged checkpoint), so each rank records it and goes on with the next job. An
unexpected error ends the launch.

Markers in both output streams (:data:`MARK` + the job's name) let a test read what one job printed.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

MARK = "##### job: "


def rank() -> int:
    """This process's global rank, also before the process group exists (a launcher set the variables)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("NODE_RANK", 0)) * int(os.environ.get("LOCAL_WORLD_SIZE", 1)) + int(
        os.environ.get("LOCAL_RANK", 0)
    )


def error_file(out: str, rank: int) -> Path:
    """Where rank ``rank`` records the error of the failing job whose ``--out`` is ``out``."""
    return Path(f"{out}.error-rank{rank}.json")


def run_jobs(path: str, run_one: Callable[[list[str]], None]) -> None:
    """Run the jobs of the JSON file ``path`` in order: ``[{"name", "args", "fails"}, ...]``; a job with a
    ``"script"`` (``"fabric_train"``) runs that scenario module's ``main`` instead of ``run_one``."""
    for job in json.loads(Path(path).read_text()):
        for stream in (sys.stdout, sys.stderr):
            print(f"{MARK}{job['name']}", file=stream, flush=True)
        run = importlib.import_module(f"scenarios.{job['script']}").main if "script" in job else run_one
        try:
            run(job["args"])
        except Exception as error:
            if not job.get("fails"):
                raise
            out = job["args"][job["args"].index("--out") + 1]
            record = {
                "type": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exc(),
                "trained_batches": getattr(error, "trained_batches", None),
            }
            error_file(out, rank()).write_text(json.dumps(record))
        else:
            if job.get("fails"):
                raise AssertionError(f"job {job['name']!r} was expected to fail, and did not")
