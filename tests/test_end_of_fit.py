"""The end of ``fit`` gathers nothing: the module stays sharded, and what users do after ``fit`` still works."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import TESTS, run_script
from lightning_fairscale.checkpoint.files import META_FILE, shard_file_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident set from /proc")


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_end_of_fit_gathers_nothing_and_the_instance_keeps_working(tmp_path: Path, state_dict_type: str) -> None:
    run_script(
        [str(TESTS / "scenarios" / "end_of_fit.py"), "--out-dir", str(tmp_path), "--state-dict-type", state_dict_type],
        cwd=tmp_path, ranks=2,
    )
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Before: every rank gathered the full parameters (100 MB) and rank 0 the Adam state too (4.7x in all).
        assert record["end_of_fit_growth_bytes"] < record["parameter_bytes"] / 4, (rank, record)
        # The same instance validates after fit, and its result is the full module's.
        assert record["validate"] == pytest.approx(record["unsharded_loss"], rel=1e-5), (rank, record)
        assert record["unsharded_parameters"] * 4 == record["parameter_bytes"]
    for name in ("after-fit.ckpt", "after-validate.ckpt"):
        path = tmp_path / name
        if state_dict_type == "sharded":  # sharded stays sharded: no rank gathered the model to save
            assert sorted(p.name for p in path.iterdir()) == [META_FILE, shard_file_name(0, 2), shard_file_name(1, 2)]
        else:
            assert path.is_file()
