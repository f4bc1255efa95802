"""The models people bring (issue 32): Hugging Face GPT-2 and Llama (tied input/output embeddings), GPT-2 with PEFT's
LoRA, and LitGPT's own GPT (a Llama configuration: its Block, RMSNorm, rotary cache; untied), trained with
``DDPFullyShardedStrategy`` as a Lightning user writes it, on 2 CPU processes: each against plain single-process
training of the same model on the same global batches (computed in the launched processes,
with torch only), and what the user's own code sees of the module once the strategy has set it up.

Every training of this module runs in one launch of ``scenarios/hf_models.py`` (``conftest.run_jobs``): :data:`JOBS`
lists them by name. A stage that fails in a job is recorded there (every rank's traceback) and fails the tests that
need it; the other tests still run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# transformers and peft: in a folder of their own (the Makefile's `$(VENV)/hf`, pyproject's `hf` extra), last, so
# that the environment's packages win where both have one.
sys.path.append(os.path.join(sys.prefix, "hf"))
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
if not transformers.utils.is_torch_available():  # transformers 5 needs torch >= 2.6 (CI's lowest torch is 2.4)
    pytest.skip(
        f"transformers {transformers.__version__} does not work with torch {torch.__version__}",
        allow_module_level=True,
    )

from scenarios.common import assert_adam_close  # noqa: E402
from scenarios.hf_models import EMBEDDING, GLOBAL_BATCH, HFJob  # noqa: E402

from conftest import TESTS, Jobs, run_jobs  # noqa: E402

HF_SCRIPT = TESTS / "scenarios" / "hf_models.py"
ATOL = 1e-5
MODELS = ("gpt2", "llama")
#: LitGPT's GPT, where its package is installed (the Makefile puts it beside transformers): the recipe only.
LITGPT = ("litgpt",) if importlib.util.find_spec("litgpt") is not None else ()
RECIPE_MODELS = (
    *MODELS,
    pytest.param("litgpt", marks=pytest.mark.skipif(not LITGPT, reason="litgpt is not installed (see the Makefile)")),
)
KINDS = ("full", "sharded")
#: The resumes: 2 steps saved, then 2 more. Lightning resumes exactly from the end of an epoch only when an epoch is
#: one batch (from a 2-batch epoch, plain Lightning 2.6 restarts the next epoch at batch_idx 2, ends it after one
#: batch, and with accumulation steps after one micro-batch): the resumes train on one global batch a step, without
#: accumulation (the saved checkpoint is still the recipe's: two param groups, the schedule, clipping).
HALF, MORE = 2, 2
RESUME = {"steps": HALF, "more_steps": MORE, "accumulate": 1, "samples": GLOBAL_BATCH}

JOBS: dict[str, HFJob] = {
    # The recipe: AdamW in two param groups, warm-up schedule, clipping by norm at 1.0, 2 micro-batches a step.
    **{f"recipe-{m}": HFJob(job="recipe", model=m, steps=3) for m in (*MODELS, *LITGPT)},
    **{f"resume-{m}": HFJob(job="resume", model=m, **RESUME) for m in MODELS},
    **{f"probes-{m}": HFJob(job="probes", model=m, steps=2) for m in MODELS},
    **{f"probes-{m}-bf16": HFJob(job="probes", model=m, steps=1, accumulate=1, precision="bf16-true")
       for m in MODELS},
    "lora": HFJob(job="lora", model="gpt2", steps=3),
    # Fabric's loop: 2 + 2 steps over the 4 global batches of 16 samples, clipping, no accumulation.
    "fabric": HFJob(job="fabric", model="llama", steps=HALF, more_steps=MORE, accumulate=1),
    "validate-fit": HFJob(job="validate-fit", model="gpt2", **RESUME),
}  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_models")


@pytest.fixture(scope="module")
def runs(folder: Path) -> Jobs:
    return run_jobs(folder, JOBS, script=HF_SCRIPT)


@pytest.fixture(scope="module")
def resharded(runs: Jobs, folder: Path) -> Jobs:
    """The 2-process resume job's checkpoints (GPT-2, tied) resumed on 1 process: one more, short, launch."""
    jobs = {"resharded-gpt2": HFJob(job="resume-resharded", model="gpt2", devices=1,
                                    checkpoints=str(folder / "resume-gpt2"), **RESUME)}  # fmt: skip
    return run_jobs(folder / "resharded", jobs, script=HF_SCRIPT)


# ------------------------------------------------------------------------------------------------------------------
# Helpers


def _first_line(text: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def job(runs: Jobs, name: str, *stages: str) -> dict[str, Any]:
    """The result of the job ``name``, after checking that it ran through and that none of ``stages`` failed on
    any rank."""
    result = runs[name]
    if result["error"]:
        text = next(iter(result["error"].values()))
        pytest.fail(f"job {name} failed on rank(s) {sorted(result['error'])}: {_first_line(text)}\n{text}")
    assert_stages(result, name, *stages)
    return result


def assert_stages(result: dict[str, Any], name: str, *stages: str) -> None:
    for stage in stages:
        failed = result["errors"].get(stage)
        if failed:
            text = next(iter(failed.values()))
            pytest.fail(f"{name}: stage {stage!r} failed on rank(s) {sorted(failed)}: {_first_line(text)}\n{text}")


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        initial: dict[str, torch.Tensor]) -> None:
    """The same keys (tied ones included), the whole update from ``initial`` within ``ADAM_RTOL`` of the expected one.

    Not ``ATOL`` on every weight: AdamW with 2 micro-batches a step turns a rounding difference in a gradient at its
    eps's scale into a step difference of up to lr, so another CPU's summation order moves such a weight by up to
    ~1e-4 (``scenarios.common.ADAM_RTOL``)."""
    assert actual, "no weights recorded"
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    assert not missing and not extra, f"missing keys {missing}, unexpected keys {extra}"
    assert_adam_close(actual, expected, initial)


def assert_trained(trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> None:
    """Training moved the weights well beyond the tolerance (the comparison is not of two untrained models)."""
    moved = max((trained[k].float() - initial[k].float()).abs().max().item() for k in initial)
    assert moved > 100 * ATOL, moved


def assert_same_losses(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected), (actual, expected)
    worst = max(abs(a - b) for a, b in zip(actual, expected))
    assert worst < ATOL, f"losses differ by {worst:.3g}: {actual} against {expected}"


# ------------------------------------------------------------------------------------------------------------------
# 1. The recipe against unsharded training


@pytest.mark.parametrize("model", RECIPE_MODELS)
def test_recipe_equals_unsharded_training(runs: Jobs, model: str) -> None:
    """Each transformer layer an FSDP unit, AdamW with two param groups, a schedule, clipping and accumulation: the
    losses and the trained weights (``unshard_module``) are the unsharded training's."""
    result = job(runs, f"recipe-{model}", "unshard")
    assert_same_losses(result["losses"], result["reference_losses"])
    assert_same_weights(result["trained"], result["reference"], result["initial"])
    assert_trained(result["reference"], result["initial"])


# ------------------------------------------------------------------------------------------------------------------
# 2. A full checkpoint loads into a fresh HF model


@pytest.mark.parametrize("model", RECIPE_MODELS)
def test_full_checkpoint_loads_into_a_fresh_hf_model(runs: Jobs, model: str) -> None:
    """``torch.load`` the full checkpoint, strip the LightningModule's ``model.`` prefix,
    ``load_state_dict(strict=True)`` into a fresh model of the same configuration: the trained model's logits. The
    state dict holds the output layer's key as well as the embedding's (as HF's own ``state_dict()`` does), with the
    same values where they are tied (not LitGPT's)."""
    name = f"recipe-{model}"
    result = job(runs, name, "save")
    keys = result.get("saved_keys")
    assert keys is not None, f"the checkpoint was not read: {result['errors'].get('load')}"
    assert "model.lm_head.weight" in keys and f"model.{EMBEDDING[model]}" in keys, keys
    assert result["saved_tied_equal"] == (model in MODELS), "lm_head.weight and the embedding: tied iff HF's"
    assert_stages(result, name, "load", "unshard", "trained-logits")
    difference = (result["loaded_logits"] - result["trained_logits"]).abs().max().item()
    assert difference < ATOL, difference


# ------------------------------------------------------------------------------------------------------------------
# 3. Exact resumes, and the consolidated sharded checkpoint


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_resume_in_a_new_trainer_is_exact(runs: Jobs, model: str, kind: str) -> None:
    """2 steps of the recipe saved (full, or with ``state_dict_type="sharded"``), resumed with ``fit(ckpt_path=...)`` in
    a new Trainer for 2 more: the 4 steps of unsharded training, loss by loss."""
    name = f"resume-{model}"
    result = job(runs, name, "train-and-save", f"resume-{kind}")
    assert_same_losses(result["resumed_losses"][kind], result["reference_losses"][HALF:])
    assert_same_weights(result["resumed"][kind], result["reference"], result["initial"])


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_of_2_processes_resumes_exactly_on_1(resharded: Jobs, kind: str) -> None:
    """GPT-2's 2-process checkpoints (tied embeddings), full and sharded, resumed on 1 process: unsharded training."""
    result = job(resharded, "resharded-gpt2", f"resume-{kind}")
    assert_same_losses(result["resumed_losses"][kind], result["reference_losses"][HALF:])
    assert_same_weights(result["resumed"][kind], result["reference"], result["initial"])


@pytest.mark.parametrize("model", MODELS)
def test_consolidated_sharded_checkpoint_equals_the_full_save(runs: Jobs, model: str) -> None:
    """``lightning-fairscale-consolidate`` of the sharded checkpoint: the full checkpoint's state dict, key for key
    (the tied output layer's included), value for value."""
    name = f"resume-{model}"
    result = job(runs, name, "train-and-save", "consolidate", "read-consolidated")
    full, consolidated = result["full_state_dict"], result["consolidated_state_dict"]
    assert "model.lm_head.weight" in full and f"model.{EMBEDDING[model]}" in full, sorted(full)
    assert sorted(consolidated) == sorted(full), (sorted(set(full) ^ set(consolidated)))
    different = [k for k in full if not torch.equal(full[k], consolidated[k])]
    assert not different, different


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_exported_safetensors_load_with_from_pretrained_into_the_same_logits(runs: Jobs, model: str, kind: str) -> None:
    """Issue 36: the 2-process checkpoint of step 2 (sharded, or full), ``lightning-fairscale-consolidate --format
    safetensors --prefix model.``, the config saved beside it: ``AutoModelForCausalLM.from_pretrained`` loads it with
    no missing, unexpected or mismatched key, ties the output layer again, and computes the unsharded training's
    logits at that step. The files hold the keys HF's own ``save_pretrained`` writes (the tied ``lm_head.weight``
    once, under the embedding's name); the sharded checkpoint's export is split into files with an index."""
    result = job(runs, f"resume-{model}", "train-and-save", "export")
    exported = result["exported"][kind]
    empty = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert {k: v for k, v in exported["loading_info"].items() if k in empty} == empty, exported["loading_info"]
    assert exported["keys"] == result["hf_own_keys"], sorted(set(exported["keys"]) ^ set(result["hf_own_keys"]))
    assert "lm_head.weight" not in exported["keys"] and EMBEDDING[model] in exported["keys"]
    assert exported["tied"], "from_pretrained did not tie lm_head.weight to the embedding"
    if kind == "sharded":
        count = len(exported["files"])
        assert count > 1 and exported["files"][0] == f"model-00001-of-{count:05d}.safetensors", exported["files"]
    else:
        assert exported["files"] == ["model.safetensors"]
    difference = (exported["logits"] - result["half_reference_logits"]).abs().max().item()
    assert difference < ATOL, difference


# ------------------------------------------------------------------------------------------------------------------
# 4. What the LightningModule's code sees after set-up


#: The hooks that record each probe of ``ProbedCausalLM``.
PROBE_HOOKS = {
    "tied": ("on_train_start", "on_after_backward", "on_train_batch_end"),
    "optimizer": ("on_train_start", "on_after_backward", "on_train_batch_end"),
    "names": ("on_train_start", "on_after_backward"),
    "gradients": ("on_after_backward",),
    "deepcopy": ("on_train_start",),
    "readable": ("on_train_start", "on_train_batch_end"),
}


def probe_values(runs: Jobs, name: str, check: str) -> list[tuple[int, str, Any]]:
    """Every rank's values of the probe ``check``: (rank, hook, value); each of its hooks ran on every rank as often
    as it should (once at the start, once per micro-batch)."""
    result = job(runs, name)
    micro_batches = JOBS[name].steps * JOBS[name].accumulate
    calls = {"on_train_start": 1, "on_after_backward": micro_batches, "on_train_batch_end": micro_batches}
    assert len(result["probes"]) == JOBS[name].devices, len(result["probes"])
    values = []
    for rank, probes in enumerate(result["probes"]):
        for hook in PROBE_HOOKS[check]:
            seen = [value for h, c, value in probes if h == hook and c == check]
            assert len(seen) == calls[hook], (
                f"rank {rank}: {hook} ran {len(seen)} times, not {calls[hook]}: {result['errors']}"
            )
            values += [(rank, hook, value) for value in seen]
    return values


def assert_probe(runs: Jobs, name: str, check: str) -> None:
    values = probe_values(runs, name, check)
    wrong = [(rank, hook, value) for rank, hook, value in values if value is not True]
    assert not wrong, f"{len(wrong)} of {len(values)} {check!r} probes failed, first: {wrong[0]}"
    assert_stages(runs[name], name, "fit")


@pytest.mark.parametrize("model", MODELS)
def test_output_layer_stays_tied_to_the_embedding(runs: Jobs, model: str) -> None:
    """``self.model.lm_head.weight is self.model.<embedding>.weight`` at the start of training, after every backward
    and after every batch, on every rank."""
    assert_probe(runs, f"probes-{model}", "tied")


@pytest.mark.parametrize("model", MODELS)
def test_optimizer_holds_the_modules_parameters(runs: Jobs, model: str) -> None:
    """``optimizer.param_groups[0]["params"][0] is next(iter(self.parameters()))``, throughout training."""
    assert_probe(runs, f"probes-{model}", "optimizer")


@pytest.mark.parametrize("model", MODELS)
def test_named_parameters_keep_the_models_names(runs: Jobs, model: str) -> None:
    """``self.named_parameters()`` after set-up: the names (and order) it had before, ``model.transformer.wte.weight``
    ... (by which the param groups were made, and by which a user logs or checks gradients)."""
    assert_probe(runs, f"probes-{model}", "names")


@pytest.mark.parametrize("model", MODELS)
def test_every_trainable_parameter_has_a_gradient_after_backward(runs: Jobs, model: str) -> None:
    """In ``on_after_backward`` (every micro-batch), ``p.grad is not None`` for every trainable ``p`` of
    ``self.named_parameters()``."""
    assert_probe(runs, f"probes-{model}", "gradients")


@pytest.mark.parametrize("model", MODELS)
def test_parameters_can_be_deep_copied(runs: Jobs, model: str) -> None:
    """``copy.deepcopy(list(self.parameters()))`` in ``on_train_start`` works and copies them."""
    assert_probe(runs, f"probes-{model}", "deepcopy")


@pytest.mark.parametrize("model", MODELS)
def test_every_parameter_is_readable_between_steps_on_every_rank(runs: Jobs, model: str) -> None:
    """``p.sum()`` of every parameter, at the start of training and after every batch, on every rank."""
    assert_probe(runs, f"probes-{model}", "readable")


@pytest.mark.parametrize("model", MODELS)
def test_true_bf16_parameters_are_bf16(runs: Jobs, model: str) -> None:
    """Under ``precision="bf16-true"`` the module's parameters are bfloat16 in every hook, on every rank."""
    name = f"probes-{model}-bf16"
    result = job(runs, name, "fit")
    for rank, dtypes in enumerate(result["dtypes"]):
        assert set(dtypes) == {"on_train_start", "on_after_backward", "on_train_batch_end"}, (rank, dtypes)
        assert all(seen == ["torch.bfloat16"] for seen in dtypes.values()), (rank, dtypes)


# ------------------------------------------------------------------------------------------------------------------
# 5. PEFT


def test_lora_equals_unsharded_lora_training_and_trains_only_the_adapters(runs: Jobs) -> None:
    """``get_peft_model(gpt2, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))``, each GPT2Block a unit
    (frozen base weights beside the adapters): the unsharded LoRA training's losses and weights; only the LoRA
    weights changed."""
    result = job(runs, "lora", "unshard")
    trained, initial = result["trained"], result["initial"]
    assert_same_losses(result["losses"], result["reference_losses"])
    assert_same_weights(trained, result["reference"], result["initial"])
    adapters = [k for k in initial if "lora_" in k]
    assert len(adapters) == 4, adapters
    changed = [k for k in initial if not torch.equal(trained[k], initial[k])]
    assert sorted(changed) == sorted(adapters), changed


# ------------------------------------------------------------------------------------------------------------------
# 6. Fabric


def test_fabric_llama_equals_unsharded_training(runs: Jobs) -> None:
    """Llama set up by ``fabric.setup`` with each decoder layer a unit, AdamW in two param groups, the warm-up
    schedule, ``fabric.clip_gradients``: the losses and the weights (a full ``fabric.save``) of unsharded training."""
    result = job(runs, "fabric", "final-state")
    assert_same_losses(result["losses"], result["reference_losses"])
    assert_same_weights(result["trained"], result["reference"], result["initial"])


def test_after_fabric_setup_the_parameters_are_the_optimizers_and_stay_tied(runs: Jobs) -> None:
    probes = job(runs, "fabric")["fabric_probes"]
    assert len(probes) == 2
    for rank_probes in probes:
        assert rank_probes == {
            "tied": True, "optimizer_holds_the_parameters": True, "plain_parameters": True, "copies": True
        }


@pytest.mark.parametrize("kind", KINDS)
def test_fabric_llama_resumes_exactly(runs: Jobs, kind: str) -> None:
    """``fabric.save`` of step 2 (full or sharded), ``fabric.load`` into a fresh model, optimizer and schedule, 2 more
    steps: the 4 steps of unsharded training."""
    result = job(runs, "fabric", f"resume-{kind}")
    assert result["resumed_step"][kind] == HALF
    assert_same_losses(result["resumed_losses"][kind], result["reference_losses"][HALF:])
    assert_same_weights(result["resumed"][kind], result["reference"], result["initial"])


# ------------------------------------------------------------------------------------------------------------------
# 7. validate, then fit, on one instance


@pytest.mark.parametrize("kind", KINDS)
def test_validate_then_fit_saves_adam_moments_in_parameter_order(runs: Jobs, kind: str) -> None:
    """After ``trainer.validate(model)`` then ``trainer.fit(model)`` (AdamW over ``self.parameters()``), the saved
    ``optimizer_states[0]["state"][i]["exp_avg"]`` has the shape of the i-th parameter of the plain module (the full
    save; the sharded one consolidated)."""
    stages = ["validate-fit-save", *(["consolidate"] if kind == "sharded" else []), f"read-{kind}"]
    result = job(runs, "validate-fit", *stages)
    moments, shapes = result["saved_moments"][kind], result["parameter_shapes"]
    assert sorted(moments) == list(range(len(shapes))), (sorted(moments), len(shapes))
    wrong = [(i, moments[i], shapes[i]) for i in range(len(shapes)) if moments[i] != shapes[i]]
    assert not wrong, f"{len(wrong)} of {len(shapes)} moments have another parameter's shape: {wrong}"


@pytest.mark.parametrize("kind", KINDS)
def test_validate_then_fit_resumes_exactly(runs: Jobs, kind: str) -> None:
    """The checkpoint of the validate-then-fit instance, resumed in a new Trainer: unsharded training's weights."""
    result = job(runs, "validate-fit", "validate-fit-save", f"resume-{kind}")
    assert_same_weights(result["resumed"][kind], result["reference"], result["initial"])
