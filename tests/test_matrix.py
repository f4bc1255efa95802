"""Every feature with every other: a pairwise matrix of short trainings, each against Lightning's ``"ddp"``.

One declared list of factors and their levels (:data:`FACTORS`); :mod:`pairwise` generates cells that together hold
every pair of levels of every two factors; each cell trains 4 steps with our strategy and again, as its reference,
with Lightning's (or Fabric's) ``"ddp"`` in the same launch (``scenarios/matrix.py``), and the two must agree: the
final weights and the losses (within :func:`tolerance`), a frozen layer exactly unmoved, a new module's test loss.
A new feature is one more factor (or level) here; the cells follow.

Pairs that cannot be expressed are declared once in :data:`NOT_APPLICABLE` (a level that means nothing with
another); pairs that cannot work are declared in :data:`EXCLUDED`, with the error the library raises for them, which
:func:`test_excluded_pairs_fail_early_with_what_to_do` checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Jobs, run_jobs

import pairwise
from scenarios.common import ADAM_RTOL
from scenarios.common import update_error as common_update_error
from scenarios.matrix import Cell, frozen_name

MATRIX_SCRIPT = Path(__file__).parent / "scenarios" / "matrix.py"

#: The factors and their levels; the first level of each is its plainest form.
FACTORS: dict[str, tuple[str, ...]] = {
    "front": ("trainer", "fabric"),
    "strategy": ("full", "grad_op", "hybrid", "sharded"),
    "wrap": ("layer", "size", "manual", "torch-policy"),
    "checkpointing": ("off", "ours", "model"),
    "compile": ("off", "whole", "inner"),
    "precision": ("32-true", "bf16-mixed", "bf16-true"),
    "optimizer": ("sgd", "adamw-groups", "frozen", "adafactor"),
    "regulariser": ("off", "l2"),
    "accumulation": ("1", "no_sync", "sync_each_batch"),
    "clipping": ("off", "norm"),
    "checkpoint": ("none", "full", "sharded", "async"),
    "stages": ("fit", "validate-fit", "fit-with-val", "fit-test-new", "fit-fit"),
    "model": ("own", "gpt2"),
}

#: Levels that mean nothing with another level: (factor, level) -> the factors it drops, and why.
NOT_APPLICABLE: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("strategy", "sharded"): (("wrap",), "sharded DDP keeps every parameter whole: nothing is wrapped"),
}

#: Pairs that cannot be expressed at all: ((factor, level), (factor, level)) -> why.
UNEXPRESSIBLE: dict[tuple[tuple[str, str], tuple[str, str]], str] = {
    (("strategy", "sharded"), ("checkpointing", "ours")): "DDPShardedStrategy has no activation_checkpointing option",
    (("strategy", "sharded"), ("checkpoint", "sharded")): "sharded DDP's checkpoints are full files (no sharded form)",
}

#: Combinations that cannot work: ((factor, level), ...) -> (why, the error type, words of its message). Each is
#: checked to fail early with that error, and the generator keeps it out of the cells.
EXCLUDED: dict[tuple[tuple[str, str], ...], tuple[str, str, str]] = {
    (("front", "fabric"), ("strategy", "sharded"), ("stages", "fit-fit")): (
        "a second optimizer for a set-up model (fit-fit): OSS and ShardedDataParallel are built together, so sharded"
        " DDP sets up a model and its optimizers in one call",
        "RuntimeError",
        "set up the model and its optimizers in one call",
    ),
}


def _holds(row: dict[str, Any], combination: tuple[tuple[str, str], ...]) -> bool:
    return all(row.get(factor) == level for factor, level in combination)


def allowed(row: dict[str, Any]) -> bool:
    return not any(_holds(row, combination) for combination in (*UNEXPRESSIBLE, *EXCLUDED))


def applies(row: dict[str, Any]) -> dict[str, Any]:
    dropped = {name for (factor, level), (names, _) in NOT_APPLICABLE.items() if row.get(factor) == level
               for name in names}
    return {name: level for name, level in row.items() if name not in dropped}


#: The plainest cell (every factor's first level) first, then what covers the remaining pairs.
PLAINEST = {name: levels[0] for name, levels in FACTORS.items()}
CELLS = pairwise.generate(FACTORS, allowed, applies, first=[PLAINEST])


def cell_name(index: int, row: dict[str, Any]) -> str:
    changed = [f"{name}={level}" for name, level in applies(row).items() if level != PLAINEST[name]]
    return f"{index:02d}:" + (",".join(changed) or "plainest")


def tolerance(row: dict[str, Any]) -> float:
    """How far a cell may end from its reference (:func:`compared`), by what its training sums in another order.

    * float32 with SGD: 1e-5 on every weight. SGD's step is linear in the gradient: a rounding difference in a
      gradient stays a rounding difference in the weight (measured: 3.7e-9 at most, ``MKL_CBWR=COMPATIBLE`` or not).
    * float32 with Adam, AdamW or Adafactor (``adamw-groups``, ``frozen``, ``adafactor``): the model's whole update
      within :data:`~scenarios.common.ADAM_RTOL` (1e-3) of the reference's, relative to its size (:func:`update_error`).
      Not 1e-5 on every weight, which held on one machine only: Adam turns a gradient at its eps's scale into a step
      of any size up to lr, so another CPU's summation order moves such an element by up to ~1e-4 (cells 13, 17, 21
      ended 3.7e-5 from ``"ddp"`` on another AMD machine, 7.9e-5 here under ``MKL_CBWR=COMPATIBLE``: 1 or 2 of 9188
      weights; their whole updates 3.2e-5 apart). One weight a whole step (lr) off is 3.8e-3 of the update.
    * bf16: 0.2 of the whole update. bf16 rounds every step (:func:`update_error`).
    """
    if row["precision"] != "32-true":
        return 0.2
    return 1e-5 if row["optimizer"] == "sgd" else ADAM_RTOL


def update_error(final: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                 start: dict[str, torch.Tensor]) -> float:
    """Adam's float32 cells and the bf16 ones: the distance of the model's whole update (final - start) from the
    reference's, relative to it (:func:`scenarios.common.update_error`).

    bf16 training sums each gradient in another order than ``"ddp"`` (and, under mixed precision, computes with
    bf16 weights where ``"ddp"``'s autocast keeps float32 ones), so an element may round to the neighbouring bf16
    value; Adam's first steps move an element by about its learning rate whatever its gradient, so such an element
    (a bias, a norm's weight) can end far from the reference's while the model as a whole is within 4-8% (measured
    on the cells here). A model that does not train, trains a frozen layer or another model ends 100% or more away.
    """
    return common_update_error(final, reference, start)


def test_the_cells_cover_every_pair() -> None:
    required = pairwise.required_pairs(FACTORS, allowed, applies)
    assert not pairwise.uncovered(CELLS, required, applies)
    # Each factor's every level appears in some cell where it applies, and the plainest cell comes first.
    for name, levels in FACTORS.items():
        assert {applies(row).get(name) for row in CELLS} >= set(levels) - {None}, name


def test_the_generator_covers_every_pair_of_a_small_matrix() -> None:
    factors = {"a": (0, 1, 2), "b": (0, 1), "c": (0, 1, 2), "d": (0, 1)}
    rows = pairwise.generate(factors, lambda row: not (row.get("a") == 2 and row.get("c") == 0))
    required = pairwise.required_pairs(factors, lambda row: not (row.get("a") == 2 and row.get("c") == 0),
                                       lambda row: row)
    assert not pairwise.uncovered(rows, required, lambda row: row)
    assert all(not (r["a"] == 2 and r["c"] == 0) for r in rows)
    assert (("a", 2), ("c", 0)) not in required
    assert len(rows) < 3 * 3 * 2 * 2  # fewer than every combination
    # Dropping a row leaves some pair uncovered: none is redundant for coverage as generated.
    assert pairwise.uncovered(rows[1:], required, lambda row: row)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    folder = tmp_path_factory.mktemp("matrix")
    jobs: dict[str, Cell] = {}
    for index, row in enumerate(CELLS):
        cell = Cell(**row)
        jobs[f"cell{index:02d}"] = cell
        jobs[f"cell{index:02d}-ref"] = cell.replace(reference=True)
    # The exclusions (test_excluded_combinations_fail_with_what_to_do) in the same launch: each records its error.
    for i, combination in enumerate(EXCLUDED):
        jobs[f"excluded{i}"] = Cell(**{**PLAINEST, **dict(combination)})
    return run_jobs(folder, jobs, script=MATRIX_SCRIPT, timeout=900)  # type: ignore[arg-type]


@pytest.mark.parametrize("index", range(len(CELLS)), ids=[cell_name(i, row) for i, row in enumerate(CELLS)])
def test_cell_equals_ddp(matrix: Jobs, index: int) -> None:
    row = CELLS[index]
    ours, reference = matrix[f"cell{index:02d}"], matrix[f"cell{index:02d}-ref"]
    assert "error" not in reference, f"the reference failed: {reference.get('traceback')}"
    assert "error" not in ours, ours.get("traceback")
    tol = tolerance(row)
    assert ours["final"].keys() == reference["final"].keys()
    if row["optimizer"] == "frozen":  # exactly where "ddp" left it (its start, in the training's dtype)
        name = frozen_name(Cell(**row))
        assert torch.equal(ours["final"][name], reference["final"][name]), "the frozen layer moved"
    float32 = row["precision"] == "32-true"
    if float32 and row["optimizer"] == "sgd":  # every weight (see tolerance)
        worst = max(float((ours["final"][k] - reference["final"][k]).abs().max()) for k in reference["final"])
        assert worst < tol, f"final weights {worst:.3g} from ddp's"
    else:  # Adam in float32, bf16: the whole update, relative to its size (see tolerance)
        error = update_error(ours["final"], reference["final"], ours["start"])
        assert error < tol, f"updates {error:.3g} (relative) from ddp's"
    if float32:
        # Within 1e-5 whatever the optimizer: a loss moves with a weight by its gradient, so the weights that Adam
        # moves apart (their gradients at its eps's scale) barely move it (measured: 8.9e-7 at most).
        assert ours["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    else:
        assert ours["losses"] == pytest.approx(reference["losses"], rel=0.05)
    if "metric" in reference:
        assert ours["metric"] == pytest.approx(reference["metric"], rel=1e-4 if float32 else 0.05)


def test_excluded_combinations_fail_with_what_to_do(matrix: Jobs) -> None:
    """Each exclusion, on the plainest cell otherwise, stops with its error (every rank alike: the cell's result
    records rank 0's), which says what to do."""
    for i, (why, error_type, words) in enumerate(EXCLUDED.values()):
        error = matrix[f"excluded{i}"].get("error", "")
        assert error.startswith(f"{error_type}: ") and words in error, (why, error)
