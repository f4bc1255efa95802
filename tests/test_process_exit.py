"""A run holds nothing it no longer needs: no unsharded original parameter while FSDP trains, no FairScale wrapper
after ``fit``, no gloo thread at interpreter shutdown.

Gloo threads that are still running when the interpreter is torn down can abort a run that succeeded ("terminate
called without an active exception"; under Lightning's launcher rank 1 then dies silently) — rarely, so the test
checks the cause, which is deterministic: which threads are alive once every ``atexit`` handler has run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import TESTS, run_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")

SCRIPT = TESTS / "scenarios" / "process_exit.py"
GLOO_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")


@pytest.mark.parametrize("strategy", ["fsdp_fairscale", "ddp_sharded"])
def test_a_run_holds_nothing_it_no_longer_needs(strategy: str, tmp_path: Path) -> None:
    proc = run_script([str(SCRIPT), "--out-dir", str(tmp_path), "--strategy", strategy], cwd=tmp_path)
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["trained"]
        # The module stays sharded after fit: its one FSDP unit (the model is small: the root is the only unit) and
        # the unit's reduce-scatter bucketer live as long as the module does, and the second fit reuses them instead
        # of wrapping again. Once the module is released nothing is left: FairScale alone kept every unit and
        # bucketer (with their buffers and process groups) for the life of the process.
        live_units = {"fsdp_units": 1, "bucketers": 1} if strategy == "fsdp_fairscale" else {"fsdp_units": 0, "bucketers": 0}
        assert record["after_fit"] == [live_units] * 2, (rank, record)
        assert record["after_release"] == {"fsdp_units": 0, "bucketers": 0}, (rank, record)
        # FSDP replaces the module's parameters by flat shards: the unsharded originals must be freed by the first
        # step, or every rank holds the whole model next to its shards for the entire fit (the second fit starts
        # from the shards). OSS keeps them (whole).
        expected = [0, 0] if strategy == "fsdp_fairscale" else [record["model_parameters"]] * 2
        assert record["originals_alive"] == expected, (rank, record)
        left = [name for name in record["threads_at_exit"] if name.startswith(GLOO_THREADS)]
        assert left == [], (rank, record["threads_at_exit"])
