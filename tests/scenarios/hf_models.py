"""The models people bring (issue 32): Hugging Face causal LMs trained with ``DDPFullyShardedStrategy``, as a Lightning
user writes it, on 2 CPU processes, against plain single-process training of the same model computed in this
process with torch only.

Two tiny models, built from their configurations (nothing is downloaded), each with its input embedding tied to its
output layer (``lm_head.weight`` *is* the embedding's weight): GPT-2 (Conv1D layers, biases, LayerNorms, learned
positions) and Llama (RMSNorm, rotary positions, no biases); and, for the recipe, LitGPT's own ``GPT`` of a Llama
configuration (untied, as LitGPT builds it). The data are random token ids; the loss is the model's own causal LM
loss (``labels=input_ids``; LitGPT's: the same next-token cross-entropy of its logits). Each job is an
:class:`HFJob`; ``tests/test_hf_models.py`` runs them all in one launch (``conftest.run_jobs``) and checks what
rank 0 saved:

* ``recipe``: a fine-tuning recipe (AdamW with two param groups, no decay on biases and norm weights, a warm-up
  schedule, clipping by norm, accumulation) with each transformer layer an FSDP unit; the trained weights
  (``unshard_module``), the losses, a full checkpoint loaded into a fresh HF model, and the unsharded reference;
* ``resume``: N steps saved full and sharded, each resumed for M more steps in a new Trainer; the sharded checkpoint
  consolidated offline (``lightning_fairscale.consolidate``); both exported to safetensors and loaded by
  ``from_pretrained`` (issue 36);
* ``probes``: what the LightningModule's code sees after set-up (``on_train_start``, ``on_after_backward``,
  ``on_train_batch_end``, on every rank): tied weights, the optimizer's parameters, gradients, deep copies, reads;
* ``lora``: PEFT's LoRA on GPT-2 (frozen base weights in the units that train);
* ``fabric``: the same recipe's optimizer in a Fabric loop, saved and resumed in both formats;
* ``validate-fit``: ``trainer.validate(model)`` then ``trainer.fit(model)`` on one instance, saved in both formats.

Every stage that may fail is run by :class:`Stages`, which records its error (every rank's) in the result instead of
ending the launch, so that one test fails and the others still see their jobs. By hand (from the project's root)::

    PYTHONPATH=src python tests/scenarios/hf_models.py --config '{"job": "recipe", "model": "llama"}' --out r.pt
    PYTHONPATH=src python tests/scenarios/hf_models.py --job test_hf_models:recipe-gpt2
"""

from __future__ import annotations

import copy
import functools
import math
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# transformers and peft: in a folder of their own (the Makefile's `$(VENV)/hf`), last, so that the environment's
# packages win where both have one.
sys.path.append(os.path.join(sys.prefix, "hf"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import lightning_fairscale  # noqa: E402,F401  (registers the strategy names)
import scenarios.jobs  # noqa: E402
from scenarios.config import Config  # noqa: E402
from scenarios.flavor import LightningModule, Trainer  # noqa: E402

VOCAB, SEQUENCE = 64, 16
GLOBAL_BATCH = 4  # 2 sequences per rank
SAMPLES = 16  # 4 global batches: one epoch is 2 optimizer steps with 2 micro-batches a step
SEED = 1234
LR, WEIGHT_DECAY = 1e-3, 0.1
#: Where each model's input embedding is: the weight ``lm_head.weight`` is tied to (but LitGPT's, untied).
EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight", "litgpt": "transformer.wte.weight"}
#: A batch no training sees, for comparing logits.
PROBE_BATCH_SEED = 5


@dataclass(frozen=True)
class HFJob(Config):
    """One job of this script: ``job`` names the function of :data:`JOB_FUNCTIONS` that runs it."""

    SCRIPT: ClassVar[str] = "hf_models"

    job: str = "recipe"
    model: str = "gpt2"  # "gpt2", "llama" or "litgpt"
    devices: int = 2
    steps: int = 3  # optimizer steps (the resumes' first part: `steps`, then `more_steps`)
    more_steps: int = 2
    accumulate: int = 2
    clip: Optional[float] = 1.0  # gradient_clip_val (by norm)
    precision: str = "32-true"
    samples: int = SAMPLES
    #: ``resume-resharded``: the folder of a ``resume`` job run on another number of processes (its checkpoints).
    checkpoints: str = ""


# ------------------------------------------------------------------------------------------------------------------
# Models, data, optimizer: shared by the sharded runs and the unsharded reference


def build_model(kind: str, lora: bool = False) -> nn.Module:
    """A fresh tiny HF causal LM, the same weights every time (seeded). Dropout off: the sharded and the unsharded
    training must compute the same thing. ``lora``: wrapped by PEFT's LoRA on GPT-2's attention input projection."""
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny vocabulary lacks GPT-2's special token ids: a warning
    torch.manual_seed(SEED)
    model: nn.Module
    if kind == "gpt2":
        gpt2 = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(gpt2)
    elif kind == "llama":
        llama = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=True,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(llama)
    elif kind == "litgpt":  # LitGPT's own GPT (its Block, rotary cache buffers), untied as LitGPT builds it
        from litgpt import GPT
        from litgpt import Config as LitConfig

        model = GPT(LitConfig.from_name(
            "Llama-2-7b-hf", n_layer=2, n_embd=32, n_head=2, n_query_groups=2, intermediate_size=64, vocab_size=VOCAB,
            padded_vocab_size=VOCAB, block_size=32,
        ))  # fmt: skip
    else:
        raise ValueError(kind)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    return model


def layer_class(kind: str) -> type[nn.Module]:
    """The transformer layer of the model ``kind``: each instance is an FSDP unit."""
    if kind == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block
    if kind == "litgpt":
        from litgpt.model import Block

        return Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def tokens(samples: int = SAMPLES, seed: int = 99) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (samples, SEQUENCE), generator=g))


def global_batches(samples: int = SAMPLES) -> list[torch.Tensor]:
    return [batch for (batch,) in DataLoader(tokens(samples), batch_size=GLOBAL_BATCH)]


def probe_batch() -> torch.Tensor:
    return tokens(GLOBAL_BATCH, seed=PROBE_BATCH_SEED).tensors[0]


def is_litgpt(model: nn.Module) -> bool:
    return type(model).__module__.startswith("litgpt")


def call(model: nn.Module, ids: torch.Tensor) -> Any:
    """``model`` on the token ids: LitGPT's GPT takes them as its first argument (and returns the logits), HF's
    models by name (and return an output whose ``logits`` they are)."""
    return model(ids) if is_litgpt(model) else model(input_ids=ids)


def lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The causal LM loss: HF's own (``labels=input_ids``); for LitGPT, which returns logits, the same next-token
    cross-entropy, as a LitGPT user computes it."""
    if is_litgpt(model):
        out = call(model, ids)
        return nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.size(-1)), ids[:, 1:].reshape(-1))
    return model(input_ids=ids, labels=ids).loss


def no_decay(name: str) -> bool:
    """Biases and norm weights get no weight decay (GPT-2's ``ln_1``/``ln_2``/``ln_f``, Llama's ``*norm``)."""
    return name.endswith("bias") or "norm" in name or ".ln_" in name


def param_groups(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """AdamW's two groups, by parameter name: decay on the weights, none on biases and norm weights."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]


def warmup(step: int) -> float:
    """The LR factor of optimizer step ``step`` (0-based): a linear warm-up over 2 steps, then constant."""
    return min(1.0, (step + 1) / 2)


def make_optimizer(kind: str, named: Iterable[tuple[str, nn.Parameter]]) -> tuple[torch.optim.Optimizer, Any]:
    """``groups``: AdamW with :func:`param_groups` and the :func:`warmup` schedule; ``single``: AdamW over all the
    parameters in one group, no schedule; ``lora``: AdamW over the trainable parameters, no schedule."""
    named = list(named)
    if kind == "groups":
        optimizer = torch.optim.AdamW(param_groups(named), lr=LR)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    if kind == "single":
        return torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=WEIGHT_DECAY), None
    if kind == "lora":
        return torch.optim.AdamW([p for _, p in named if p.requires_grad], lr=LR), None
    raise ValueError(kind)


def reference(
    kind: str, steps: int, optimizer: str = "groups", accumulate: int = 2, clip: Optional[float] = 1.0,
    samples: int = SAMPLES, lora: bool = False,
) -> tuple[nn.Module, list[float]]:
    """Plain training on one process, with torch only, on the same global batches (cycled as the epochs repeat them):
    the model after ``steps`` optimizer steps and each micro-batch's loss (the global batch's mean)."""
    model = build_model(kind, lora)
    opt, schedule = make_optimizer(optimizer, model.named_parameters())
    batches = global_batches(samples)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            ids = batches[(step * accumulate + micro) % len(batches)]
            loss = lm_loss(model, ids)
            losses.append(loss.item())
            (loss / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
    return model, losses


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@torch.no_grad()
def logits(model: nn.Module) -> torch.Tensor:
    was_training = model.training
    model.eval()
    out = call(model, probe_batch())
    out = (out if is_litgpt(model) else out.logits).detach().clone()
    model.train(was_training)
    return out


def strip_prefix(state_dict: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    """The HF model's own keys of a LightningModule's state dict (its attribute ``model``)."""
    assert all(k.startswith(prefix) for k in state_dict), sorted(state_dict)
    return {k[len(prefix) :]: v for k, v in state_dict.items()}


# ------------------------------------------------------------------------------------------------------------------
# Processes


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else scenarios.jobs.rank()


def gather(obj: Any) -> list[Any]:
    """``obj`` of every rank (on every rank), over the default process group."""
    objects: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(objects, obj)
    return objects


def barrier() -> None:
    torch.distributed.barrier()


def global_losses(per_rank: list[list[float]]) -> list[float]:
    """Each micro-batch's loss over the global batch: the mean of the ranks' (each rank's half has as many tokens)."""
    return [sum(values) / len(values) for values in zip(*per_rank)]


class Stages:
    """Runs the stages of a job, recording any error instead of raising it: every rank's traceback, by stage."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.errors[name] = traceback.format_exc()
            print(f"[rank {rank()}] stage {name!r} failed:\n{self.errors[name]}", file=sys.stderr, flush=True)
            return None


# ------------------------------------------------------------------------------------------------------------------
# The Trainer side


class CausalLM(LightningModule):
    """A HF causal LM (attribute ``model``) trained on :func:`tokens` with its own loss, as a user wraps one.

    ``optimizer``: see :func:`make_optimizer` (from ``self.named_parameters()``); each rank records its micro-batch
    losses in ``losses``."""

    def __init__(self, model: nn.Module, optimizer: str = "groups", samples: int = SAMPLES) -> None:
        super().__init__()
        self.model = model
        self.optimizer_kind = optimizer
        self.samples = samples
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> Any:
        return call(self.model, ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = lm_loss(self.model, ids)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (ids,) = batch
        self.log("val_loss", lm_loss(self.model, ids), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer, schedule = make_optimizer(self.optimizer_kind, self.named_parameters())
        if schedule is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        # Unshuffled, so that each step's global batch is the reference's: rank r sees samples r, r + W, ... of it.
        world_size, global_rank = self.trainer.world_size, self.trainer.global_rank
        data = tokens(self.samples)
        sampler = DistributedSampler(data, num_replicas=world_size, rank=global_rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)

    val_dataloader = train_dataloader


def attempt(check: Callable[[], Any]) -> Any:
    """``check()``, or the error it raised as a string (a probe must not break the training it watches)."""
    try:
        return check()
    except Exception as error:
        return f"{type(error).__name__}: {error}"


class ProbedCausalLM(CausalLM):
    """:class:`CausalLM` recording what its own code sees once the strategy has set it up: ``probes`` is a list of
    ``(hook, check, value)`` where every ``value`` must be ``True`` (else it says what was seen instead)."""

    def __init__(self, model: nn.Module, kind: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.kind = kind
        self.plain_names = [n for n, _ in self.named_parameters()]  # before the strategy has seen the module
        self.probes: list[tuple[str, str, Any]] = []
        self.dtypes: dict[str, list[str]] = {}

    def _embedding(self) -> nn.Parameter:
        # Attribute by attribute, as a user's code spells it: self.model.transformer.wte.weight
        return functools.reduce(getattr, EMBEDDING[self.kind].split("."), self.model)

    def _tied(self) -> Any:
        head, embedding = self.model.lm_head.weight, self._embedding()
        return True if head is embedding else f"lm_head.weight is not {EMBEDDING[self.kind]}: {head!r}, {embedding!r}"

    def _optimizer_holds_parameters(self) -> Any:
        held = self.trainer.optimizers[0].param_groups[0]["params"][0]
        first = next(iter(self.parameters()))
        return True if held is first else f"param_groups[0]['params'][0] is {held!r}, the first parameter {first!r}"

    def _names(self) -> Any:
        names = [n for n, _ in self.named_parameters()]
        return True if names == self.plain_names else f"self.named_parameters() names {names}, not {self.plain_names}"

    def _gradients(self) -> Any:
        # Every trainable parameter reads as having a gradient on every rank, in every micro-batch (a rank holding no
        # element of it holds an empty slice: a read of the gradient is a collective, made on every rank alike).
        missing = [n for n, p in self.named_parameters() if p.requires_grad and p.numel() and p.grad is None]
        return True if not missing else f"no .grad on {missing}"

    def _deepcopy(self) -> Any:
        params = list(self.parameters())
        copies = copy.deepcopy(params)
        equal = len(copies) == len(params) and all(
            c.shape == p.shape and torch.equal(c.detach(), p.detach()) for c, p in zip(copies, params)
        )
        return True if equal else "the deep copies differ from the parameters"

    def _readable(self) -> Any:
        sums = {n: float(p.detach().float().sum()) for n, p in self.named_parameters()}
        bad = [n for n, s in sums.items() if not math.isfinite(s)]
        return True if not bad else f"non-finite sums: {bad}"

    def _record(self, hook: str, checks: dict[str, Callable[[], Any]]) -> None:
        for name, check in checks.items():
            self.probes.append((hook, name, attempt(check)))
        self.dtypes[hook] = sorted({str(p.dtype) for p in self.parameters()})

    def on_train_start(self) -> None:
        self._record(
            "on_train_start",
            {
                "tied": self._tied,
                "optimizer": self._optimizer_holds_parameters,
                "names": self._names,
                "deepcopy": self._deepcopy,
                "readable": self._readable,
            },
        )

    def on_after_backward(self) -> None:
        self._record(
            "on_after_backward",
            {
                "tied": self._tied,
                "optimizer": self._optimizer_holds_parameters,
                "names": self._names,
                "gradients": self._gradients,
            },
        )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._record(
            "on_train_batch_end",
            {"tied": self._tied, "optimizer": self._optimizer_holds_parameters, "readable": self._readable},
        )


def make_trainer(config: HFJob, steps: int, state_dict_type: str = "full", validate: bool = False) -> Any:
    from scenarios.flavor import DDPFullyShardedStrategy

    strategy = DDPFullyShardedStrategy(auto_wrap_policy={layer_class(config.model)}, state_dict_type=state_dict_type)
    return Trainer(
        accelerator="cpu",
        devices=config.devices,
        strategy=strategy,
        precision=config.precision,
        max_steps=steps,
        accumulate_grad_batches=config.accumulate,
        gradient_clip_val=config.clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1 if validate else 0,
        use_distributed_sampler=False,
    )


def fit(config: HFJob, module: CausalLM, steps: int, ckpt_path: Optional[str] = None, **trainer_args: Any) -> Any:
    trainer = make_trainer(config, steps, **trainer_args)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def save_both(trainer: Any, work: Path, stem: str) -> None:
    """``trainer.save_checkpoint`` full (``STEM-full.ckpt``), then with ``state_dict_type="sharded"``."""
    trainer.strategy.state_dict_type = "full"
    trainer.save_checkpoint(work / f"{stem}-full.ckpt")
    trainer.strategy.state_dict_type = "sharded"
    trainer.save_checkpoint(work / f"{stem}-sharded.ckpt")


def unsharded(trainer: Any, module: CausalLM) -> dict[str, torch.Tensor]:
    """The trained HF model's full state dict (rank 0; ``{}`` elsewhere), through ``unshard_module``."""
    trainer.strategy.unshard_module()
    return state(module.model) if rank() == 0 else {}


def consolidate(source: Path, target: Path) -> None:
    """``lightning-fairscale-consolidate SOURCE TARGET`` (rank 0, offline)."""
    from lightning_fairscale.consolidate import main as consolidate_main

    if rank() == 0:
        code = consolidate_main([str(source), str(target), "--quiet"])
        assert code == 0, f"lightning-fairscale-consolidate exited with {code}"


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------------------------------------------
# Jobs: each fills `result` (rank 0 saves it)


def recipe(config: HFJob, work: Path, stages: Stages, result: dict[str, Any]) -> None:
    """The recipe for ``config.steps`` steps; the trained weights, a full checkpoint loaded into a fresh HF model."""
    module = CausalLM(build_model(config.model), samples=config.samples)
    trainer = fit(config, module, config.steps)
    result["losses"] = global_losses(gather(module.losses))
    path = work / "full.ckpt"
    stages.run("save", trainer.save_checkpoint, path)
    barrier()
    result["trained"] = stages.run("unshard", unsharded, trainer, module)
    if rank() != 0:
        return
    result["trained_logits"] = stages.run("trained-logits", logits, module.model)
    result["initial"] = state(build_model(config.model))
    model, result["reference_losses"] = reference(
        config.model, config.steps, accumulate=config.accumulate, clip=config.clip, samples=config.samples
    )
    result["reference"] = state(model)

    def load_full() -> None:
        saved = load(path)["state_dict"]
        result["saved_keys"] = sorted(saved)
        embedding = saved[f"model.{EMBEDDING[config.model]}"]
        result["saved_tied_equal"] = torch.equal(saved["model.lm_head.weight"], embedding)
        fresh = build_model(config.model)
        fresh.load_state_dict(strip_prefix(saved), strict=True)
        result["loaded_logits"] = logits(fresh)

    stages.run("load", load_full)


def resume(config: HFJob, work: Path, stages: Stages, result: dict[str, Any]) -> None:
    """``steps`` steps saved in both formats, each resumed for ``more_steps`` in a new Trainer; the sharded one also
    consolidated offline."""
    first, total = config.steps, config.steps + config.more_steps

    def train_and_save() -> None:
        module = CausalLM(build_model(config.model), samples=config.samples)
        save_both(fit(config, module, first), work, "half")

    stages.run("train-and-save", train_and_save)
    barrier()
    stages.run("consolidate", consolidate, work / "half-sharded.ckpt", work / "consolidated.ckpt")
    if rank() == 0:
        stages.run("export", export_to_hf, config, work, result)
    barrier()
    result["resumed"], result["resumed_losses"] = {}, {}
    for kind in ("full", "sharded"):

        def resumed(kind: str = kind) -> None:
            module = CausalLM(build_model(config.model), samples=config.samples)
            trainer = fit(config, module, total, ckpt_path=str(work / f"half-{kind}.ckpt"), state_dict_type=kind)
            result["resumed_losses"][kind] = global_losses(gather(module.losses))
            result["resumed"][kind] = unsharded(trainer, module)

        stages.run(f"resume-{kind}", resumed)
        barrier()
    if rank() != 0:
        return
    model, result["reference_losses"] = reference(
        config.model, total, accumulate=config.accumulate, clip=config.clip, samples=config.samples
    )
    result["reference"] = state(model)
    result.setdefault("initial", state(build_model(config.model)))  # where both start

    def read_both() -> None:
        result["full_state_dict"] = load(work / "half-full.ckpt")["state_dict"]
        result["consolidated_state_dict"] = load(work / "consolidated.ckpt")["state_dict"]

    stages.run("read-consolidated", read_both)


#: The exports of :func:`export_to_hf`: the command line's arguments beyond the source and the folder. The sharded
#: checkpoint's is split into files of at most 20 KB (the tiny models have ~100 KB): the index is what loads.
EXPORTS = {"sharded": ["--max-shard-size", "20KB"], "full": []}


def export_to_hf(config: HFJob, work: Path, result: dict[str, Any]) -> None:
    """Rank 0: both checkpoints of step ``steps`` exported by ``lightning-fairscale-consolidate --format safetensors
    --prefix model.``, the model's config saved beside each (as a user does), loaded by ``from_pretrained``: its
    loading info, logits, keys and tie; the unsharded training's logits at that step; the keys HF's own
    ``save_pretrained`` writes."""
    import safetensors.torch
    import transformers

    from lightning_fairscale.consolidate import main as consolidate_main

    plain = build_model(config.model)
    plain.save_pretrained(work / "hf-own")
    result["hf_own_keys"] = sorted(safetensors.torch.load_file(str(work / "hf-own" / "model.safetensors")))
    model, _ = reference(
        config.model, config.steps, accumulate=config.accumulate, clip=config.clip, samples=config.samples
    )
    result["half_reference_logits"] = logits(model)
    result["exported"] = {}
    for kind, options in EXPORTS.items():
        out = work / f"hf-{kind}"
        args = [str(work / f"half-{kind}.ckpt"), str(out), "--format", "safetensors", "--prefix", "model.", *options]
        code = consolidate_main([*args, "--quiet"])
        assert code == 0, f"lightning-fairscale-consolidate {' '.join(args)} exited with {code}"
        plain.config.save_pretrained(out)
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        embedding = loaded.get_input_embeddings().weight
        files = sorted(p.name for p in out.glob("*.safetensors"))
        result["exported"][kind] = {
            "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "logits": logits(loaded),
            "keys": sorted(k for f in files for k in safetensors.torch.load_file(str(out / f))),
            "files": files,
            "tied": loaded.lm_head.weight is embedding,
        }


def resume_resharded(config: HFJob, work: Path, stages: Stages, result: dict[str, Any]) -> None:
    """The checkpoints of a ``resume`` job saved on another number of processes, each resumed here for
    ``more_steps``: the whole training of unsharded training."""
    total = config.steps + config.more_steps
    result["resumed"], result["resumed_losses"] = {}, {}
    for kind in ("full", "sharded"):

        def resumed(kind: str = kind) -> None:
            module = CausalLM(build_model(config.model), samples=config.samples)
            path = Path(config.checkpoints) / f"half-{kind}.ckpt"
            trainer = fit(config, module, total, ckpt_path=str(path), state_dict_type=kind)
            result["resumed_losses"][kind] = global_losses(gather(module.losses))
            result["resumed"][kind] = unsharded(trainer, module)

        stages.run(f"resume-{kind}", resumed)
        barrier()
    if rank() == 0:
        model, result["reference_losses"] = reference(
            config.model, total, accumulate=config.accumulate, clip=config.clip, samples=config.samples
        )
        result["reference"] = state(model)
        result.setdefault("initial", state(build_model(config.model)))  # where both start


def probes(config: HFJob, work: Path, stages: Stages, result: dict[str, Any]) -> None:
    """The recipe's training with :class:`ProbedCausalLM`; every rank's probes and dtypes."""
    module = ProbedCausalLM(build_model(config.model), config.model, samples=config.samples)
    stages.run("fit", fit, config, module, config.steps)
    result["probes"] = gather(module.probes)
    result["dtypes"] = gather(module.dtypes)
    result["trained_batches"] = len(module.losses)


def lora(config: HFJob, work: Path, stages: Stages, result: dict[str, Any]) -> None:
    """GPT-2 with LoRA adapters on ``c_attn``: only the adapters train."""
    module = CausalLM(build_model("gpt2", lora=True), optimizer="lora", samples=config.samples)
    trainer = fit(config, module, config.steps)
    result["losses"] = global_losses(gather(module.losses))
    result["trained"] = stages.run("unshard", unsharded, trainer, module)
    if rank() != 0:
        return
    result["initial"] = state(build_model("gpt2", lora=True))
    model, result["reference_losses"] = reference(
        "gpt2", config.steps, "lora", accumulate=config.accumulate, clip=config.clip, samples=config.samples, lora=True
    )
    result["reference"] = state(model)


def validate_fit(config: HFJob, work: Path, stages: Stages, result: dict[str, Any]) -> None:
    """``trainer.validate(model)``, then ``trainer.fit(model)`` (AdamW over ``self.parameters()``, one group), saved
    in both formats (the sharded one consolidated); each resumed in a new Trainer for ``more_steps``."""
    first, total = config.steps, config.steps + config.more_steps

    def validate_then_fit() -> None:
        module = CausalLM(build_model(config.model), optimizer="single", samples=config.samples)
        trainer = make_trainer(config, first, validate=True)
        result["validated"] = trainer.validate(module, verbose=False)
        trainer.fit(module)
        save_both(trainer, work, "half")

    stages.run("validate-fit-save", validate_then_fit)
    barrier()
    stages.run("consolidate", consolidate, work / "half-sharded.ckpt", work / "consolidated.ckpt")
    barrier()
    result["resumed"] = {}
    for kind in ("full", "sharded"):

        def resumed(kind: str = kind) -> None:
            module = CausalLM(build_model(config.model), optimizer="single", samples=config.samples)
            trainer = fit(config, module, total, ckpt_path=str(work / f"half-{kind}.ckpt"), state_dict_type=kind)
            result["resumed"][kind] = unsharded(trainer, module)

        stages.run(f"resume-{kind}", resumed)
        barrier()
    if rank() != 0:
        return
    plain = list(build_model(config.model).parameters())  # the plain module's parameters, in their order
    result["parameter_shapes"] = [tuple(p.shape) for p in plain]
    result["saved_moments"] = {}
    for kind, name in (("full", "half-full.ckpt"), ("sharded", "consolidated.ckpt")):

        def moments(name: str = name) -> dict[int, tuple[int, ...]]:
            saved = load(work / name)["optimizer_states"][0]["state"]
            return {i: tuple(s["exp_avg"].shape) for i, s in saved.items()}

        result["saved_moments"][kind] = stages.run(f"read-{kind}", moments)
    model, _ = reference(
        config.model, total, "single", accumulate=config.accumulate, clip=config.clip, samples=config.samples
    )
    result["reference"] = state(model)
    result.setdefault("initial", state(build_model(config.model)))  # where both start


# ------------------------------------------------------------------------------------------------------------------
# Fabric


def fabric_job(config: HFJob, work: Path, stages: Stages, result: dict[str, Any]) -> None:
    """Llama in a Fabric loop (the recipe's optimizer and schedule, clipping; no accumulation): ``steps + more_steps``
    steps, saved after ``steps`` in both formats; fresh models, optimizers and schedules load each and train the
    rest."""
    from scenarios.flavor import Fabric, FabricDDPFullyShardedStrategy

    assert config.accumulate == 1, "the Fabric loop steps after every batch"
    strategy = FabricDDPFullyShardedStrategy(auto_wrap_policy={layer_class(config.model)})
    fabric = Fabric(accelerator="cpu", devices=config.devices, strategy=strategy, precision=config.precision)
    fabric.launch(fabric_run, config.to_json(), str(work), stages, result)


def fabric_full_state(fabric: Any, model: Any, path: Path) -> dict[str, torch.Tensor]:
    """The model's full state dict through a full ``fabric.save`` (rank 0; ``{}`` elsewhere)."""
    fabric.strategy.state_dict_type = "full"
    fabric.save(path, {"model": model})
    return dict(load(path)["model"]) if fabric.is_global_zero else {}


def fabric_setup(fabric: Any, kind: str) -> dict[str, Any]:
    """A fresh model with the recipe's optimizer (made over the plain model) and schedule, set up by Fabric: the
    checkpoint's state (``step`` 0)."""
    model = build_model(kind)
    optimizer, schedule = make_optimizer("groups", model.named_parameters())
    model, optimizer = fabric.setup(model, optimizer)
    return {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 0}


def fabric_train(fabric: Any, run: dict[str, Any], last: int, config: HFJob,
                 save: Optional[Callable[[], None]] = None, save_at: int = -1) -> list[float]:
    """Optimizer steps ``run["step"]`` to ``last`` (excluded) on :func:`global_batches`, each rank on its slice of
    the global batch; ``save()`` after step ``save_at``. Returns this rank's losses."""
    model, optimizer, schedule = run["model"], run["optimizer"], run["schedule"]
    batches = global_batches(config.samples)
    losses = []
    while run["step"] < last:
        ids = batches[run["step"] % len(batches)][fabric.global_rank :: fabric.world_size]
        loss = lm_loss(model, ids)
        losses.append(loss.item())
        fabric.backward(loss)
        if config.clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=config.clip)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        run["step"] += 1
        if save is not None and run["step"] == save_at:
            save()
    return losses


def fabric_probes(model: Any, optimizer: Any, kind: str) -> dict[str, Any]:
    """What a Fabric loop's own code sees after ``fabric.setup``: the tie, and the optimizer's parameters being the
    model's (the same objects, both ways)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    params = list(model.parameters())
    inner = model.module  # the HF model inside Fabric's wrapper (and the FSDP units)
    embedding = inner.get_submodule(EMBEDDING[kind].rsplit(".", 1)[0]).weight
    return {
        "tied": inner.lm_head.weight is embedding,
        "optimizer_holds_the_parameters": held == {id(p) for p in params},
        # Parameters (the views know they are sharded: a subclass of torch's, as `isinstance` checks in HF see).
        "plain_parameters": all(isinstance(p, torch.nn.Parameter) for p in params),
        "copies": len(copy.deepcopy(params)) == len(params),
    }


def fabric_run(fabric: Any, fields: dict[str, Any], work_dir: str, stages: Stages, result: dict[str, Any]) -> None:
    config = HFJob.from_json(fields)
    work = Path(work_dir)
    first, total = config.steps, config.steps + config.more_steps
    run = fabric_setup(fabric, config.model)
    result["fabric_probes"] = gather(fabric_probes(run["model"], run["optimizer"], config.model))

    def save() -> None:
        fabric.strategy.state_dict_type = "full"
        fabric.save(work / "half-full.ckpt", run)
        fabric.strategy.state_dict_type = "sharded"
        fabric.save(work / "half-sharded.ckpt", run)
        fabric.strategy.state_dict_type = "full"

    losses = fabric_train(fabric, run, total, config, save=save, save_at=first)
    result["losses"] = global_losses(gather(losses))
    result["trained"] = stages.run("final-state", fabric_full_state, fabric, run["model"], work / "final.ckpt")
    result["resumed"], result["resumed_losses"], result["resumed_step"] = {}, {}, {}
    for kind in ("full", "sharded"):

        def resumed(kind: str = kind) -> None:
            fresh = fabric_setup(fabric, config.model)
            remainder = fabric.load(work / f"half-{kind}.ckpt", fresh)
            assert not remainder, remainder
            result["resumed_step"][kind] = fresh["step"]
            more = fabric_train(fabric, fresh, total, config)
            result["resumed_losses"][kind] = global_losses(gather(more))
            result["resumed"][kind] = fabric_full_state(fabric, fresh["model"], work / f"resumed-{kind}.ckpt")

        stages.run(f"resume-{kind}", resumed)
        barrier()
    if fabric.is_global_zero:
        model, result["reference_losses"] = reference(
            config.model, total, accumulate=1, clip=config.clip, samples=config.samples
        )
        result["reference"] = state(model)
        result.setdefault("initial", state(build_model(config.model)))  # where both start


#: The job functions, by :attr:`HFJob.job`.
JOB_FUNCTIONS: dict[str, Callable[[HFJob, Path, Stages, dict[str, Any]], None]] = {
    "recipe": recipe,
    "resume": resume,
    "resume-resharded": resume_resharded,
    "probes": probes,
    "lora": lora,
    "validate-fit": validate_fit,
    "fabric": fabric_job,
}

#: The configuration class of this scenario (``scenarios/jobs.py``).
CONFIG = HFJob


def main(config: HFJob, out: str) -> None:
    """Run the job ``config`` describes; rank 0 writes the result to ``out`` (``error``: an error no stage caught, on
    any rank; ``errors``: each stage's, by rank)."""
    work = Path(out).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    stages = Stages()
    result: dict[str, Any] = {"job": config.to_json(), "error": None}
    try:
        JOB_FUNCTIONS[config.job](config, work, stages, result)
    except Exception:
        result["error"] = traceback.format_exc()
        print(f"[rank {rank()}] job failed:\n{result['error']}", file=sys.stderr, flush=True)
    local = (result["error"], stages.errors)
    errors = gather(local) if torch.distributed.is_initialized() else [local]
    result["error"] = {r: error for r, (error, _) in enumerate(errors) if error is not None} or None
    result["errors"] = {}
    for r, (_, by_stage) in enumerate(errors):
        for name, text in by_stage.items():
            result["errors"].setdefault(name, {})[r] = text
    if rank() == 0:
        torch.save(result, out)


if __name__ == "__main__":
    scenarios.jobs.main(HFJob, main)
