"""``torch.compile`` under the sharded strategies (issue 34): the user's compile, in each form a Lightning user writes
it, trains on 2 CPU processes as plain eager training on one process does (< 1e-5), its checkpoints have the model's
own keys and resume exactly. Every training runs in one launch of ``scenarios/compiled.py`` (``conftest.run_jobs``).
The engine's regional compilation is tested in process by ``tests/unit/test_compile.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import TESTS, Jobs, run_jobs
from scenarios.compiled import CompileJob

SCRIPT = TESTS / "scenarios" / "compiled.py"
ATOL = 1e-5

PLAIN = CompileJob(
    form="whole", activation_checkpointing=False, optimizer="sgd", steps=4, more_steps=0, accumulate=1, clip=None,
    validate=True,
)
JOBS: dict[str, CompileJob] = {
    # `trainer.fit(torch.compile(model))` with activation checkpointing and clipping: saved full and sharded after 2
    # steps, each resumed for a third (without accumulation: Lightning 2.6 resumes a 2-batch epoch inexactly).
    "whole-aot_eager": CompileJob(form="whole", accumulate=1),
    # The plainest form (issue 48): no activation checkpointing, SGD, 4 steps, each followed by a validation on a batch
    # of another size, in which the layers compile again with the step's gradients held (workaround 26).
    "plain": PLAIN,
    "plain-net": PLAIN.replace(form="net"),  # the LightningModule compiles its own net in `__init__`
    # inductor (the default backend), in the plainest form: no resume (its compile takes most of the launch).
    "whole-inductor": PLAIN.replace(backend="inductor"),
    "init": CompileJob(form="init", more_steps=0),  # 2 micro-batches a step
    "configure_model": CompileJob(form="configure_model", more_steps=0, activation_checkpointing=False),
    # True half precision: compiled against the same sharded training uncompiled.
    "bf16-true": CompileJob(form="init", precision="bf16-true", more_steps=0, clip=None),
    "bf16-true-eager": CompileJob(form="none", precision="bf16-true", more_steps=0, clip=None),
    # Mixed precision: compiled against the same sharded training uncompiled.
    "bf16-mixed": CompileJob(form="whole", precision="bf16-mixed", more_steps=0),
    "bf16-mixed-eager": CompileJob(form="none", precision="bf16-mixed", more_steps=0),
    # Hybrid sharding (2 replicas of one shard: the replicas' all-reduce of the gradient shards), against unsharded.
    "hybrid": CompileJob(form="whole", sharding="HYBRID_SHARD", more_steps=0),
    "ddp_sharded": CompileJob(form="whole", strategy="ddp_sharded", more_steps=0),
    "fabric": CompileJob(front="fabric", form="whole", accumulate=1),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return run_jobs(tmp_path_factory.mktemp("compiled"), JOBS, script=SCRIPT)


def job(runs: Jobs, name: str) -> dict[str, Any]:
    result = runs[name]
    if result["error"]:
        text = next(iter(result["error"].values()))
        pytest.fail(f"job {name} failed on rank(s) {sorted(result['error'])}:\n{text}")
    return result


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = ATOL) -> None:
    assert sorted(actual) == sorted(expected)
    worst = max((actual[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < atol, worst


@pytest.mark.parametrize(
    "name", ["whole-aot_eager", "init", "configure_model", "hybrid", "ddp_sharded", "fabric"]
)
def test_a_compiled_model_trains_as_eager_unsharded_training_with_its_own_keys(runs: Jobs, name: str) -> None:
    result = job(runs, name)
    assert_same(result["trained"], result["reference"])
    assert not [k for k in result["keys"] if "_orig_mod" in k]
    if name != "ddp_sharded":  # FSDP compiled the layers (regional compilation), with the user's options
        assert result["compiled"], "no layer was compiled: the model trained eagerly"


@pytest.mark.parametrize("name", ["plain", "plain-net", "whole-inductor"])
@pytest.mark.workaround(26)
def test_the_plainest_form_trains_and_validates_as_eager_unsharded_training(runs: Jobs, name: str) -> None:
    """Issue 48 item 1 (workaround 26): without activation checkpointing, a validation after each step compiles the
    layers again while the gradient shards are held; each validation loss and the trained weights are eager
    unsharded training's."""
    result = job(runs, name)
    assert_same(result["trained"], result["reference"])
    assert len(result["val_losses"]) == len(result["reference_val"]) == 4
    worst = max(abs(a - b) for a, b in zip(result["val_losses"], result["reference_val"]))
    assert worst < ATOL, worst
    assert result["compiled"], "no layer was compiled: the model trained eagerly"
    assert not [k for k in result["keys"] if "_orig_mod" in k]


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_compiled_model_resumes_exactly_and_its_checkpoint_loads_uncompiled(runs: Jobs, kind: str) -> None:
    result = job(runs, "whole-aot_eager")
    assert result["loads_uncompiled"]
    assert_same(result[f"resumed_{kind}"], result["reference_more"])


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_half_precision_compiled_equals_it_uncompiled(runs: Jobs, precision: str) -> None:
    compiled, eager = job(runs, precision), job(runs, f"{precision}-eager")
    assert_same(compiled["trained"], eager["trained"], atol=1e-2)  # bf16: inductor-free aot_eager, same ops
    assert compiled["compiled"] and not eager["compiled"]
