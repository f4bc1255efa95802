"""Several scenarios in one launch: the same processes run a list of jobs one after another.

Starting a rank costs ~5 s on our 2-core machines (importing torch and Lightning), while a job of these tests trains
for well under a second. So the tests give a scenario script a JSON list of jobs (``script --jobs FILE``), each its
own configuration (``scenarios/config.py``) and output file; every rank runs the same list in the same order,
reusing one process group. A job may be expected to fail (``"fails": true``): the error is one every rank raises
before it starts a collective the others would not join (a misconfiguration, a damaged checkpoint), so each rank
records it and goes on with the next job. In a launch of one process, a job may also be allowed to fail
(``"may_fail": true``): its error is recorded the same way and the launch goes on, so that one broken scenario does
not hide what the others show (``tests/test_cuda.py`` on a machine with one GPU). Any other error ends the launch.

Markers in both output streams (:data:`MARK` + the job's name) let a test read what one job printed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from scenarios.config import Config

MARK = "##### job: "


def rank() -> int:
    """This process's global rank, also before the process group exists (a launcher set the variables)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("NODE_RANK", 0)) * int(os.environ.get("LOCAL_WORLD_SIZE", 1)) + int(
        os.environ.get("LOCAL_RANK", 0)
    )


def error_file(out: str, rank: int) -> Path:
    """Where rank ``rank`` records the error of the failing job whose output file is ``out``."""
    return Path(f"{out}.error-rank{rank}.json")


def job_spec(name: str, config: Config, out: str, fails: bool = False, may_fail: bool = False) -> dict[str, Any]:
    """One entry of a jobs file; ``"script"`` names the scenario module that runs it (a Fabric job may run in a
    ``train.py`` launch: the same processes and process group)."""
    return {
        "name": name, "script": config.SCRIPT, "config": config.to_json(), "out": out, "fails": fails,
        "may_fail": may_fail,
    }  # fmt: skip


def run_jobs(path: str, config_class: type[Config], run_one: Callable[[Any, str], None]) -> None:
    """Run the jobs of the JSON file ``path`` in order: ``[{"name", "config", "out", "fails", "may_fail"}, ...]``;
    ``run_one`` gets each job's configuration (a ``config_class``) and output file."""
    for job in json.loads(Path(path).read_text()):
        for stream in (sys.stdout, sys.stderr):
            print(f"{MARK}{job['name']}", file=stream, flush=True)
        run = importlib.import_module(f"scenarios.{job['script']}").main if "script" in job else run_one
        cls, run = config_class, run_one
        if job.get("script", config_class.SCRIPT) != config_class.SCRIPT:  # another scenario's job (its `main`)
            module = importlib.import_module(f"scenarios.{job['script']}")
            cls, run = module.CONFIG, module.main
        try:
            run(cls.from_json(job["config"]), job["out"])
        except Exception as error:
            if not (job.get("fails") or job.get("may_fail")):
                raise
            record = {
                "type": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exc(),
                "trained_batches": getattr(error, "trained_batches", None),
            }
            error_file(job["out"], rank()).write_text(json.dumps(record))
        else:
            if job.get("fails"):
                raise AssertionError(f"job {job['name']!r} was expected to fail, and did not")


def module_job(spec: str) -> Config:
    """The job ``NAME`` of a test module's ``JOBS`` (``spec``: ``test_module:NAME``, the module under tests/). Jobs
    built in a fixture (their paths are the test's temporary folders) are not there: copy one into ``--config``."""
    module_name, _, name = spec.partition(":")
    jobs = getattr(importlib.import_module(module_name.removesuffix(".py")), "JOBS", None)
    if jobs is None:
        raise SystemExit(f"{module_name} has no module-level JOBS; pass the scenario's fields with --config instead")
    if name not in jobs:
        raise SystemExit(f"{module_name}.JOBS has no job {name!r}; it has: {', '.join(jobs)}")
    return jobs[name]


def main(config_class: type[Config], run_one: Callable[[Any, str], None], argv: Optional[Sequence[str]] = None) -> None:
    """A scenario script's command line: ``--jobs FILE`` (what the tests run), or one configuration by hand with
    ``--config JSON`` or ``--job test_module:NAME``, written to ``--out``."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--jobs", help="a jobs file written by conftest.run_jobs")
    source.add_argument("--config", help="the configuration's fields as a JSON object, e.g. '{\"steps\": 2}'")
    source.add_argument("--job", help="a job of a test module's JOBS, e.g. test_fully_sharded:policy-blocks")
    parser.add_argument("--out", default="result.pt", help="where rank 0 writes the result (default: result.pt)")
    args = parser.parse_args(argv)
    if args.jobs:
        run_jobs(args.jobs, config_class, run_one)
    elif args.job:
        run_one(module_job(args.job), args.out)
    else:
        run_one(config_class.from_json(json.loads(args.config)), args.out)
