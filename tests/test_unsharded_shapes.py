"""Param groups by shape over a sharded model: ``configure_optimizers`` (Trainer) and ``unsharded_shapes`` (Fabric).

The most common AdamW recipe splits the parameters by dimension (``p.ndim >= 2``: weight decay on matrices only).
Once the model is sharded its parameters are this rank's 1-D views of the flat shards, so wherever an optimizer was
made over them (layers wrapped by hand in ``configure_model``; a second stage; Fabric after ``setup_module``) every
matrix went to the no-decay group and the run trained something else than unsharded, without an error (found by
the feature matrix, issue 48: 2.4e-3 from ``"ddp"``'s weights after 4 AdamW steps). Each case here trains 4 steps
against Lightning's (or Fabric's) ``"ddp"`` in one launch (``scenarios/matrix.py``), and Fabric's optimizer made
before ``fabric.setup`` over layers wrapped by hand is refused with what to do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Jobs, run_jobs

from scenarios.common import assert_adam_close
from scenarios.matrix import Cell

MATRIX_SCRIPT = Path(__file__).parent / "scenarios" / "matrix.py"

ADAMW = dict(optimizer="adamw-groups")
#: Each case: the cell, trained by our strategy and by "ddp".
CASES: dict[str, Cell] = {
    # configure_optimizers after the root wrap (units made in configure_model), then a full checkpoint resumed.
    "trainer-manual-resume": Cell(wrap="manual", checkpoint="full", **ADAMW),
    # configure_optimizers in a second stage, on the module still sharded.
    "trainer-validate-fit": Cell(stages="validate-fit", **ADAMW),
    "trainer-fit-fit": Cell(stages="fit-fit", **ADAMW),
    # fabric.setup_module, the optimizer inside fabric.strategy.unsharded_shapes(model), fabric.setup_optimizers.
    "fabric-manual-after": Cell(front="fabric", wrap="manual", fabric_setup="after", **ADAMW),
    # a second optimizer over the set-up model, inside unsharded_shapes.
    "fabric-fit-fit": Cell(front="fabric", stages="fit-fit", **ADAMW),
}
#: Made before fabric.setup over FairScale's flat parameters (layers wrapped by hand in fabric.init_module()).
REFUSED = Cell(front="fabric", wrap="manual", fabric_setup="joint", **ADAMW)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    jobs: dict[str, Cell] = {"refused": REFUSED}
    for name, cell in CASES.items():
        jobs[name] = cell
        jobs[f"{name}-ref"] = cell.replace(reference=True)
    return run_jobs(tmp_path_factory.mktemp("shapes"), jobs, script=MATRIX_SCRIPT, timeout=600)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(CASES))
def test_param_groups_by_shape_train_as_ddp(results: Jobs, name: str) -> None:
    ours, reference = results[name], results[f"{name}-ref"]
    assert "error" not in reference, reference.get("traceback")
    assert "error" not in ours, ours.get("traceback")
    # AdamW: the whole update relative to its size, as the matrix's Adam cells (tests/test_matrix.py, tolerance).
    assert_adam_close(ours["final"], reference["final"], ours["start"], what="against ddp")
    assert ours["losses"] == pytest.approx(reference["losses"], abs=1e-5)


def test_groups_over_flat_parameters_are_refused_with_what_to_do(results: Jobs) -> None:
    error = results["refused"].get("error", "")
    assert error.startswith("ValueError: ") and "flat parameters" in error, error
    assert "fabric.strategy.unsharded_shapes(model)" in error and "fabric.setup_module(model)" in error
