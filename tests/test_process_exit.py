"""A run holds nothing it no longer needs: no unsharded original parameter while FSDP trains, no FairScale wrapper
after ``fit``, no gloo thread at interpreter shutdown; and it leaves torch, FairScale and Lightning as they were.

Gloo threads that are still running when the interpreter is torn down can abort a run that succeeded ("terminate
called without an active exception"; under Lightning's launcher rank 1 then dies silently) — rarely, so the test
checks the cause, which is deterministic: which threads are alive once every ``atexit`` handler has run.

FSDP runs on a default group the script created itself (ranks started by the test, as ``torchrun`` does), then a
Fabric loop; sharded DDP under Lightning's launcher, which creates the group in the strategy's set-up.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import TESTS, run_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")

SCRIPT = TESTS / "scenarios" / "process_exit.py"
GLOO_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")
#: What a process that never used this package sees (`checkpointed`: layers with FairScale's checkpoint wrapper).
PRISTINE = {
    "fairscale_sees_torch": True, "record_stream_on_cpu": False, "summary_hooks": 0, "default_group_works": True
}


@pytest.fixture(scope="module", params=["fsdp_fairscale", "ddp_sharded"])
def records(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    strategy, tmp_path = request.param, tmp_path_factory.mktemp(request.param)
    fsdp = strategy == "fsdp_fairscale"
    extra = ["--user-group", "--fabric"] if fsdp else []
    proc = run_script(
        [str(SCRIPT), "--out-dir", str(tmp_path), "--strategy", strategy, *extra], cwd=tmp_path, ranks=2 if fsdp else 1
    )
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    return strategy, [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_a_run_holds_nothing_it_no_longer_needs(records: tuple[str, list[dict]]) -> None:
    strategy, per_rank = records
    for rank, record in enumerate(per_rank):
        assert record["trained"]
        # The module stays sharded after fit: its FSDP units (the root, and each Block: it recomputes its activations)
        # and their gradient reducer (shared; on CPU the asynchronous one of `fsdp.patches.reduce_scatter`) live as
        # long as the module does, and the second fit reuses them instead of wrapping again. Once the module is released
        # nothing is left: FairScale alone kept every unit and bucketer (with their buffers and process groups) for the
        # life of the process.
        sharded = strategy == "fsdp_fairscale"
        live_units = {"fsdp_units": 3, "reducers": 1} if sharded else {"fsdp_units": 0, "reducers": 0}
        assert record["after_fit"] == [live_units] * 2, (rank, record)
        assert record["after_release"] == {"fsdp_units": 0, "reducers": 0}, (rank, record)
        # FSDP replaces the module's parameters by flat shards: the unsharded originals must be freed by the first
        # step, or every rank holds the whole model next to its shards for the entire fit (the second fit starts
        # from the shards). OSS keeps them (whole).
        expected = [0, 0] if strategy == "fsdp_fairscale" else [record["model_parameters"]] * 2
        assert record["originals_alive"] == expected, (rank, record)
        left = [name for name in record["threads_at_exit"] if name.startswith(GLOO_THREADS)]
        assert left == [], (rank, record["threads_at_exit"])


def test_torch_fairscale_and_lightning_are_left_as_they_were(records: tuple[str, list[dict]]) -> None:
    """After teardown the Trainer's ModelSummary callbacks are Lightning's and the default group works; the CPU
    workarounds of FairScale (its FSDP module's ``torch``, a ``record_stream`` kernel) last while a sharded model
    does (FairScale still runs on it: ``save_checkpoint``, ``unshard_module()``), and are gone with it; a module
    unsharded by another Trainer than the one that checkpointed it recomputes nothing any more."""
    strategy, per_rank = records
    for rank, record in enumerate(per_rank):
        seen = record["patches"]
        if strategy == "ddp_sharded":  # nothing to patch
            for moment in ("during_fit", "after_fit_0", "after_fit_1"):
                assert seen[moment] == {**PRISTINE, "checkpointed": 0}, (rank, moment, seen)
            continue
        sharded = {**PRISTINE, "fairscale_sees_torch": False, "record_stream_on_cpu": True, "checkpointed": 2}
        assert seen["during_fit"] == {**sharded, "summary_hooks": 1}, (rank, seen)  # what the checks below undo
        assert seen["after_fit_0"] == seen["after_fit_1"] == sharded, (rank, seen)
        assert seen["after_unshard"] == {**PRISTINE, "checkpointed": 0}, (rank, seen)
        # Fabric: the model stays wrapped (and checkpointed, as under Lightning's FSDP) while the user holds it.
        assert seen["fabric_after_teardown"] == sharded, (rank, seen)
        # The default group the script created survives the strategies' exit handling (it is the user's).
        assert record["user_group_works_at_exit"], (rank, record)
