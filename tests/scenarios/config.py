"""What a scenario script runs, as frozen dataclasses with defaults: :class:`Scenario` for ``train.py`` (the
Trainer), :class:`FabricScenario` for ``fabric_train.py``.

A test module builds them in Python (``Scenario(policy="blocks", steps=3)``, variants with :meth:`Config.replace`),
``conftest.run_jobs`` writes them into the launch's jobs file as JSON (only the fields that differ from the defaults,
:meth:`Config.to_json`) and the script reads them back (:meth:`Config.from_json`). No Lightning import here: the
test modules and ``conftest.py`` use these classes without choosing a Lightning package.

The fields were the scripts' command-line flags: ``--foo-bar X`` is ``foo_bar=X``, with Python types (``True`` for
a switch or a 0/1 flag, tuples for lists). Three groups of flags became one field each: ``--clip-val V --clip-alg A``
is ``clip=(V, A)`` (as ``common.reference_training`` takes it), ``--kill-during-save N --kill-rank R --kill-how H``
is ``kill=Kill(N, R, H)``, ``--lose-rank R --lose-at-step S --lose-how H`` is ``lose=Lose(R, S, H)``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, TypeVar

C = TypeVar("C", bound="Config")


class Config:
    """JSON round trip and variants, for the frozen dataclasses below."""

    #: The scenario module (under ``tests/scenarios``) whose ``main`` runs this configuration.
    SCRIPT: ClassVar[str] = ""

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` (field names and values)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from their defaults (nested configurations as their own ``to_json``)."""
        data: dict[str, Any] = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if value != field.default:
                data[field.name] = value.to_json() if isinstance(value, Config) else value
        return data

    @classmethod
    def from_json(cls: type[C], data: dict[str, Any]) -> C:
        """The configuration ``to_json`` gave; an unknown field is an error that names it."""
        hints = typing.get_type_hints(cls)
        names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {unknown}; its fields are {sorted(names)}")
        return cls(**{name: _decode(hints[name], value) for name, value in data.items()})


def _decode(hint: Any, value: Any) -> Any:
    """``value`` read from JSON as the type ``hint`` says: tuples from lists, nested configurations from dicts."""
    if value is None:
        return None
    if typing.get_origin(hint) is typing.Union:  # Optional[X]
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if isinstance(hint, type) and issubclass(hint, Config):
        return hint.from_json(value)
    if typing.get_origin(hint) is tuple:
        return tuple(value)
    return value


# ------------------------------------------------------------------------------------------------------------------
# scenarios/train.py


@dataclass(frozen=True)
class Kill(Config):
    """Rank ``rank`` dies (SIGKILL) halfway through writing its ``nth`` checkpoint file; ``how="enospc"``: the write
    fails as on a full disk instead."""

    nth: int
    rank: int = 0
    how: str = "kill"  # "kill" or "enospc"


@dataclass(frozen=True)
class Lose(Config):
    """Rank ``rank`` is lost at the start of training step ``step``: killed (``how="KILL"``) or stuck (``"STOP"``)."""

    rank: int
    step: int = 3
    how: str = "KILL"


@dataclass(frozen=True)
class Scenario(Config):
    """One training with the Trainer (``scenarios/train.py``): the defaults are 4 steps of Adam on 2 CPU processes
    with ``DDPFullyShardedStrategy``'s size policy (``min_num_params=1000``) and full checkpoints."""

    SCRIPT: ClassVar[str] = "train"

    # --- the model (scenarios.common)
    #: regression, manual (wraps its Blocks itself), lazy (built in configure_model), partial (PartialWrapper's net)
    model: str = "regression"
    depth: int = 2  # Blocks of the regression and lazy models
    wrap_with: str = "torch"  # the manual model's `wrap`: "torch" or "fairscale"
    hook: str = "configure_model"  # or Lightning 1.x's "configure_sharded_model" (manual model)
    #: eager; empty: under trainer.init_module(empty_init=True); meta: on the meta device
    init: str = "eager"
    init_seed_per_rank: bool = False  # each rank seeds the sharding-time init apart
    uninitializable: bool = False  # a Block holds a buffer nothing can initialise
    freeze: tuple[str, ...] = ()  # parameters (by name) frozen before training
    strict_loading: bool = True  # LightningModule.strict_loading
    model_on_gpu: bool = False  # the model moved to the GPU before `fit`
    example_input: bool = False  # the model gets an example_input_array

    # --- the Trainer and the training
    accelerator: str = "cpu"
    devices: int = 2
    num_nodes: int = 1
    steps: int = 4
    samples: int = 16  # 8 makes every epoch one step (exact resume in Lightning)
    optimizer: str = "adam"  # scenarios.common.make_optimizer
    params: str = "self"  # what configure_optimizers names: self, trainer, stray, split
    scheduler: bool = False
    accumulate: int = 1
    clip: Optional[tuple[float, str]] = None  # (gradient_clip_val, "norm" or "value")
    precision: str = "32-true"
    precision_plugin: Optional[str] = None  # FullyShardedMixedPrecisionPlugin(this, "cpu") instead of `precision`
    callback: Optional[str] = None  # Lightning's "swa" (StochasticWeightAveraging) or "pruning" (ModelPruning)
    model_summary: bool = False  # the Trainer's model summary, and each rank's record of it

    # --- the strategy (DDPFullyShardedStrategy unless `strategy_name`)
    strategy_name: str = ""  # a registry name instead of an instance
    #: size, blocks, callable; torch-transformer, torch-module, torch-size: the policies of Lightning's FSDPStrategy
    #: (torch-size takes `min_num_params`, the strategy keeps its default)
    policy: str = "size"
    min_num_params: int = 1000
    exclude: Optional[tuple[str, ...]] = None  # class names (Block, Linear, Sequential): exclude_wrap_modules
    force_leaf: Optional[tuple[str, ...]] = None  # class names: force_leaf_modules
    flatten: bool = True
    cpu_offload: bool = False
    checkpointing: bool = False  # activation checkpointing of every Block
    checkpointing_offload: bool = False
    state_dict_type: str = "full"
    lightning_1x_optimizer_state: str = "error"
    timeout: Optional[float] = None  # the collective timeout, in seconds
    sharding_strategy: Optional[str] = None
    device_mesh: Optional[tuple[int, int]] = None  # (replicas, shard_size)
    backward_prefetch: str = ""  # "" (the strategy's default), "BACKWARD_PRE", "BACKWARD_POST" or "none" (None)
    compute_dtype: Optional[str] = None  # "float16" or "bfloat16"
    move_grads_to_cpu: Optional[bool] = None
    sync_each_batch: bool = False  # reduce-scatter after every micro-batch instead of no_sync

    # --- stages, checkpoints and records
    ckpt_path: Optional[str] = None  # fit(ckpt_path=...)
    save_ckpt: Optional[str] = None  # trainer.save_checkpoint after fit
    validate_only: bool = False  # trainer.validate instead of fit: no optimizer exists
    eval_after: bool = False  # validate, test and predict after fit
    save_ckpt_after_eval: Optional[str] = None  # trainer.save_checkpoint after the eval_after stages
    checkpoint_dir: Optional[str] = None  # a ModelCheckpoint saving every epoch into this folder
    save_top_k: int = -1  # the ModelCheckpoint keeps this many (by step)
    save_last: bool = False  # the ModelCheckpoint overwrites last.ckpt
    record_loaded: bool = False  # the full state dict as training starts
    #: Issue 48 item 2: a ModelCheckpoint on val_loss (top 2, last) into `checkpoint_dir`; after `fit`, `test` and
    #: `validate` of new modules from the best checkpoint, then `fit` of a new module for one more epoch
    new_modules: bool = False
    #: checkpoints written in the background: "option" (ShardedCheckpointIO(async_save=True)) or "lightning"
    #: (Lightning's AsyncCheckpointIO(ShardedCheckpointIO()))
    async_save: str = ""
    #: ThroughputMonitor (FLOPs measured on a meta copy, as Lightning's docs do) and DeviceStatsMonitor, logged to
    #: an in-memory logger whose metrics rank 0 records
    throughput: bool = False

    # --- faults
    kill: Optional[Kill] = None
    lose: Optional[Lose] = None
    #: (global step, where): the user's code raises in that step (``train.RaiseInStep``): "forward" (inside the
    #: model's forward, between layers), "step" (training_step after the model's forward: a NaN guard), "backward"
    #: (a gradient hook in the middle of the backward), "optimizer" (``on_before_optimizer_step``)
    fail_at: Optional[tuple[int, str]] = None
    fail_rank: Optional[int] = None  # only this rank raises (None: every rank)
    on_exception_dir: Optional[str] = None  # an OnExceptionCheckpoint saving into this folder


# ------------------------------------------------------------------------------------------------------------------
# scenarios/fabric_train.py


@dataclass(frozen=True)
class FabricScenario(Config):
    """One loop written with Fabric (``scenarios/fabric_train.py``): the defaults are 4 steps of Adam on 2 CPU
    processes with the ``"fsdp_fairscale"`` strategy."""

    SCRIPT: ClassVar[str] = "fabric_train"

    # --- the strategy and the model's set-up
    strategy: str = "fsdp_fairscale"  # a registry name, or "fsdp"/"sharded" for an instance
    devices: int = 2
    num_nodes: int = 1
    sharding_strategy: Optional[str] = None  # the "fsdp" instance's `sharding_strategy`
    precision: str = "32-true"  # the flag, or plugin-16-mixed: MixedPrecision("16-mixed")
    policy: str = "blocks"  # the "fsdp" instance's: "blocks" ({Block}) or "size"
    checkpointing: bool = False  # activation checkpointing of every Block ("fsdp" instance)
    init_module: bool = False  # the model built in fabric.init_module(), each Block wrapped by fairscale.nn.wrap
    #: the model built in fabric.init_module(empty_init=True): on the meta device, initialised when sharded
    #: (build_network's seed, 1234, is then the random state the units start from)
    empty_init: bool = False
    #: joint: fabric.setup(model, optimizer); separate: optimizer made first, then setup_module and setup_optimizers;
    #: after: setup_module, then the optimizer over the set-up model's parameters
    setup: str = "joint"
    freeze: tuple[str, ...] = ()  # parameters (by name) frozen before set-up

    # --- the training
    steps: int = 4
    samples: int = 16
    optimizer: str = "adam"
    params: str = "self"  # or "split": split_param_groups
    accumulate: int = 1
    sync_each_batch: bool = False  # the "fsdp"/"sharded" instance's: no_backward_sync then skips nothing
    clip_norm: Optional[float] = None
    clip_val: Optional[float] = None

    # --- checkpoints
    save_at: Optional[int] = None  # checkpoints of this step, then resumed in this process
    save_dir: Optional[str] = None
    save_last: bool = False  # instead: one checkpoint, last.ckpt in save_dir, overwritten after every step
    async_save: bool = False  # the "fsdp"/"sharded" instance saves with ShardedCheckpointIO(async_save=True)
    kill: Optional[Kill] = None  # a rank dies halfway through writing its n-th checkpoint file
    resume_setup: Optional[tuple[str, str]] = None  # `setup` of the full and of the sharded resume
    load: Optional[str] = None  # start from this checkpoint (Fabric's or the Trainer's)
    load_step: int = 0  # the step the `load` checkpoint was saved at
    #: load PartialWrappers from this folder's full.ckpt, sharded.ckpt and raw.pt (and nothing else)
    partial_from: Optional[str] = None
    partial_kinds: tuple[str, ...] = ("full", "sharded", "raw", "raw-sharded")
    strict: bool = False  # the partial loads' `strict`
    #: (step, where): the loop's step ``step`` (0-based) raises the user's error in the model's "forward" (before its
    #: third layer) or "backward" (a gradient hook on its second layer's output); the loop catches it, saves (with
    #: ``save_at`` = ``step``: ``full.ckpt`` and, under FSDP, ``sharded.ckpt``, as after a step) and goes on with the
    #: next step
    fail_at: Optional[tuple[int, str]] = None


# ------------------------------------------------------------------------------------------------------------------
# scenarios/between_steps.py


@dataclass(frozen=True)
class BetweenSteps(Config):
    """A loop that changes the model's state between (and inside) steps (``scenarios/between_steps.py``), with the
    Trainer or Fabric under the FSDP strategy, and its unsharded reference computed in the same process.

    ``case="freeze"``: gradual unfreezing (layers frozen and unfrozen at each epoch's start, one Adam over all
    parameters); ``case="gan"``: two optimizers, a generator and a discriminator, each an FSDP unit (the Trainer's
    manual optimization with ``toggle_optimizer``; Fabric: two set-up modules)."""

    SCRIPT: ClassVar[str] = "between_steps"

    front: str = "trainer"  # or "fabric"
    #: "fsdp" (DDPFullyShardedStrategy); "ddp": Lightning's DDPStrategy(find_unused_parameters=True), unsharded,
    #: to check a scenario itself against its reference
    strategy: str = "fsdp"
    case: str = "freeze"  # or "gan"
    devices: int = 2
    steps: int = 8  # optimizer steps of the freeze case; batches of the gan case
    #: freeze: the first epoch's frozen layers are frozen before set-up already (a unit wholly frozen at set-up)
    setup_frozen: bool = False
    #: gan: the discriminator's loss on the generator's output detached (else its backward reaches the generator,
    #: whose graph the first backward keeps)
    detach: bool = True
    clip: Optional[float] = None  # clipping by norm, on every step (Trainer: gradient_clip_val / clip_gradients)
    state_dict_type: str = "full"  # of the save at `save_at`
    save_at: Optional[int] = None  # after this many steps (batches), save, then resume in a fresh model
    save_dir: Optional[str] = None


# ------------------------------------------------------------------------------------------------------------------
# scenarios/unused_units.py


@dataclass(frozen=True)
class UnusedUnits(Config):
    """Units whose forward does not run in a step (``scenarios/unused_units.py``), Trainer or Fabric, against the
    unsharded training computed in the same process."""

    SCRIPT: ClassVar[str] = "unused_units"

    front: str = "trainer"  # or "fabric"
    #: "fsdp" (DDPFullyShardedStrategy; Fabric's "fsdp_fairscale"), "ddp_sharded", or "ddp": Lightning's
    #: DDPStrategy(find_unused_parameters=True), the Trainer's resumes' reference
    strategy: str = "fsdp"
    #: aux: a head used only in predict_step, a unit of its own by the layer-class policy; size: the second block and
    #: the head skipped by every forward, units by the size policy; alternate: the second block runs in every other
    #: batch; diverge: the second block runs on rank 0 only (must fail on every rank, naming it)
    case: str = "aux"
    devices: int = 2
    steps: int = 6  # optimizer steps
    accumulate: int = 1
    clip: Optional[float] = None  # clipping by norm (gradient_clip_val / fabric.clip_gradients)
    checkpointing: bool = False  # activation checkpointing of every Block
    sharding_strategy: Optional[str] = None
    device_mesh: Optional[tuple[int, int]] = None
    state_dict_type: str = "full"  # of the save at `save_at`
    save_at: Optional[int] = None  # after this many optimizer steps, save, then resume in a fresh model
    save_dir: Optional[str] = None


# ------------------------------------------------------------------------------------------------------------------
# scenarios/whole_optimizers.py


@dataclass(frozen=True)
class WholeOptimizers(Config):
    """Optimizers that read whole tensors (``scenarios/whole_optimizers.py``) under the FSDP strategy, Trainer or
    Fabric, with their unsharded reference computed in the same process (float64 unless ``precision`` says)."""

    SCRIPT: ClassVar[str] = "whole_optimizers"

    front: str = "trainer"  # or "fabric"
    #: "fsdp" (DDPFullyShardedStrategy) or "ddp" (Lightning's, unsharded: the Trainer's resumes are compared with it)
    strategy: str = "fsdp"
    #: "adafactor", "muon" (Muon on the matrices + AdamW on the rest), "lars" (the user's own), "lbfgs", "adam"
    optimizer: str = "adafactor"
    devices: int = 2
    steps: int = 4  # optimizer steps
    precision: str = "32-true"  # "32-true" trains in float64; "bf16-mixed", "bf16-true" in those
    groups: bool = False  # two param groups (weights, biases) with their own lr and weight decay
    frozen: bool = False  # the first layer frozen before set-up
    accumulate: int = 1  # micro-batches per optimizer step
    clip: Optional[float] = None  # clipping by norm (Trainer: gradient_clip_val / clip_gradients)
    manual: bool = False  # the Trainer's manual optimization (always for muon: two optimizers)
    optimizer_path: str = "auto"  # the strategy's option
    stages: str = "fit"  # or "validate-fit", "fit-fit" (a second fit of the still sharded model, new optimizers)
    state_dict_type: str = "full"  # of the save at `save_at`
    save_at: Optional[int] = None  # after this many steps, save, then resume in a fresh model
    #: Fabric: resume from this sharded checkpoint at step `save_at` (saved by another number of processes)
    load_from: Optional[str] = None
    save_dir: Optional[str] = None


# ------------------------------------------------------------------------------------------------------------------
# scenarios/reads.py


@dataclass(frozen=True)
class Reads(Config):
    """What user code reads outside a unit's forward (``scenarios/reads.py``): a penalty over the parameters in the
    loss, the user's own clipping, a callback's norms, under the FSDP strategy (Trainer or Fabric), with the
    unsharded reference computed in the same process."""

    SCRIPT: ClassVar[str] = "reads"

    front: str = "trainer"  # or "fabric"
    #: "penalty": an L2 penalty over `self.parameters()` and an orthogonality penalty on another unit's matrix in
    #: the loss; "clip": `clip_grad_norm_(self.parameters(), 0.05)` before each step; "log": a callback's weight and
    #: gradient norms on every rank; "one_rank": a callback's read on rank 0 only
    case: str = "penalty"
    devices: int = 2
    steps: int = 4
    #: Micro-batches per step (Trainer: `accumulate_grad_batches`; the first under `no_sync`), the penalty in each
    accumulate: int = 1
