"""The strategies' options as typed attributes: :class:`FullyShardedOptions` (``DDPFullyShardedStrategy``) and
:class:`ShardedDDPOptions` (``DDPShardedStrategy``), the Trainer's and Fabric's alike.

Each is a mixin after Lightning's class (``class DDPShardedStrategy(DDPStrategy, ShardedDDPOptions)``): it adds names
Lightning does not have, and overrides nothing. Each option is an :class:`Option`, a typed descriptor that reads the
strategy's configuration (``strategy.config``); setting one replaces it with a checked copy, and after setup raises
for an option the run has already used (see :class:`_StrategyOptions`). The attributes are written from the
configurations' fields by ``make options`` (``tools/generate_options.py``; the option is declared there once), so
that editors and type checkers see each one's types and docstring; it imports no Lightning module, as the rest of
:mod:`lightning_fairscale._adapters`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Optional, TypeVar, Union, overload

import torch
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module

from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.unit.materialize import ParamInitFn
from lightning_fairscale.fsdp.wrapping.policies import AutoWrapPolicy
from lightning_fairscale.option_fields import declaration, declared
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FullyShardedOptions", "Option", "ShardedDDPOptions"]

#: What an option reads as (the configuration's type) and what setting it takes (the constructors' type).
Value = TypeVar("Value")
Given = TypeVar("Given")


class _StrategyOptions:
    """What both option mixins share: the strategy's config, replaced by a checked copy when an option is set, and
    kept from changing, after setup, where the run has already used it.

    The strategy calls :meth:`_fix_options` when it is set up (its ``setup_environment``: ``trainer.fit``...,
    ``fabric.launch()``). From then on its process groups exist, its options were checked against the device and the
    precision, and its model is wrapped with them: a new value of most options would do nothing (or, not checked
    again, train something else than asked). Setting one raises at once, saying what to do, whether through its
    property or by replacing ``strategy.config``; the options of :attr:`_CHANGEABLE`, which the strategy reads each
    time it uses them (at each save, at each load), may change at any time.
    """

    #: The options that may change after setup (declared ``changeable``): the strategy reads them at each use.
    _CHANGEABLE: ClassVar[frozenset[str]] = frozenset()
    #: Set when the strategy is set up (see :meth:`_fix_options`); the class's ``False`` until then.
    _options_fixed: bool = False
    #: The config (see the subclasses' ``config`` property).
    _options_config: Any

    def _fix_options(self) -> None:
        """From now on, only the options of :attr:`_CHANGEABLE` may change (called by ``setup_environment``)."""
        self._options_fixed = True

    def _set_config(self, config: Any) -> None:
        """Make ``config`` the strategy's; after setup, it may differ from the current one in :attr:`_CHANGEABLE`
        only."""
        if self._options_fixed:
            current = self._options_config
            fixed = [f.name for f in dataclasses.fields(config) if f.name not in self._CHANGEABLE | {"owner"}]
            changed = [name for name in fixed if _differs(getattr(config, name), getattr(current, name))]
            if changed:
                owner, names = type(self).__name__, ", ".join(f"`{name}`" for name in changed)
                raise RuntimeError(
                    f"{owner}: {names} cannot change once the strategy is set up (`trainer.fit`/`validate`/..., or"
                    f" `fabric.launch()`): its process groups, its checks and its wrapped model were made with the"
                    f" old value, which a new one would not change. Pass it when making the strategy"
                    f" (`{owner}({changed[0]}=...)`) or set it before the run starts; for another run, make a new"
                    f" strategy. After setup only {', '.join(f'`{n}`' for n in sorted(self._CHANGEABLE))} may change."
                )
        self._options_config = config

    def _set_option(self, name: str, value: Any) -> None:
        """Set option ``name``: the config becomes a copy with ``value``, checked as the constructor checks it."""
        self._set_config(dataclasses.replace(self._options_config, **{name: value}))


def _differs(new: Any, old: Any) -> bool:
    """Whether an option's new value is another than its old one (``==`` where it is not the same object)."""
    return new is not old and bool(new != old)


class Option(Generic[Value, Given]):
    """One option of the strategy as a typed attribute: reading it gives the configuration's value (a ``Value``),
    setting it (a ``Given``, what the constructor takes) replaces the configuration by a checked copy."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, strategy: None, owner: type) -> Option[Value, Given]: ...

    @overload
    def __get__(self, strategy: _StrategyOptions, owner: type) -> Value: ...

    def __get__(self, strategy: Optional[_StrategyOptions], owner: type) -> Any:
        return self if strategy is None else getattr(strategy._options_config, self.name)

    def __set__(self, strategy: _StrategyOptions, value: Given) -> None:
        strategy._set_option(self.name, value)


def _changeable(config_class: type) -> frozenset[str]:
    """The options of ``config_class`` declared changeable after setup."""
    return frozenset(name for name, field in declared(config_class) if declaration(field).changeable)


class FullyShardedOptions(_StrategyOptions):
    """The options of ``DDPFullyShardedStrategy`` (the Trainer's and Fabric's), as typed attributes.

    Each reads the strategy's :class:`~lightning_fairscale.fsdp.config.FullyShardedConfig` (``strategy.config``) and
    setting one makes a checked copy of it. Before setup every option may change; after it only ``state_dict_type``
    (read at each save: ``strategy.state_dict_type = "full"`` before a last ``save_checkpoint`` writes one full file)
    and ``lightning_1x_optimizer_state`` (read at each load). The others raise: the process groups
    (``sharding_strategy``, ``device_mesh``), the checks against the device and precision and the FSDP units made
    when the model is wrapped (all the others) use them once, at setup.
    """

    _CHANGEABLE = _changeable(FullyShardedConfig)

    @property
    def config(self) -> FullyShardedConfig:
        """All the options, checked and frozen; a checked copy (``dataclasses.replace``) may replace it, before setup,
        or after it where only ``state_dict_type`` and ``lightning_1x_optimizer_state`` differ."""
        return self._options_config

    @config.setter
    def config(self, config: FullyShardedConfig) -> None:
        self._set_config(config)

    # BEGIN generated from FullyShardedConfig by `make options`
    cpu_offload: Option[bool, Union[bool, CPUOffload]] = Option()
    """Keep the FP32 parameter shards on the CPU (CUDA only; ignored with a warning on CPU runs). A bool, or torch's
    ``CPUOffload(offload_params=...)`` as Lightning's ``FSDPStrategy`` takes it. Fixed at setup."""
    flatten_parameters: Option[bool, bool] = Option()
    """Flatten each unit's parameters into one contiguous tensor (faster). Fixed at setup."""
    reshard_after_forward: Option[bool, bool] = Option()
    """Free full parameters after the forward pass, gathering them again for backward. Under
    ``sharding_strategy="SHARD_GRAD_OP"`` or ``"_HYBRID_SHARD_ZERO2"`` FSDP does not reshard, whatever this says (the
    strategy keeps the value given, for another ``sharding_strategy``). Fixed at setup."""
    move_grads_to_cpu: Option[Optional[bool], Optional[bool]] = Option()
    """Move gradient shards to the CPU after reduction (defaults to ``cpu_offload``). Fixed at setup."""
    fp32_reduce_scatter: Option[Optional[bool], Optional[bool]] = Option()
    """Reduce-scatter gradients in FP32 under mixed precision (an error under true half precision, whose gradients
    are fp16 or bf16). Fixed at setup."""
    compute_dtype: Option[Optional[torch.dtype], Optional[torch.dtype]] = Option()
    """Dtype of the full parameters used in computation (defaults from ``precision``); under true half precision
    (``"bf16-true"``, ``"16-true"``) only that dtype is accepted. Fixed at setup."""
    bucket_cap_mb: Option[int, int] = Option()
    """Size of the reduce-scatter buckets in MB; ``<= 0`` disables bucketing. On CPU (gloo) also what the units the
    forward gathers ahead may hold together (at least the next unit is gathered). Fixed at setup."""
    min_num_params: Option[int, int] = Option()
    """A module with at least this many unwrapped parameters becomes its own unit (auto wrap). Fixed at setup."""
    state_dict_to_cpu: Option[bool, bool] = Option()
    """Return full state dicts on the CPU instead of the compute device. Fixed at setup."""
    auto_wrap_policy: Option[Optional[AutoWrapPolicy], Optional[AutoWrapPolicy]] = Option()
    """Which submodules become units when the model wraps nothing itself: a set of layer classes (each instance its
    own unit), a callable with FairScale's policy signature ``(module, recurse, unwrapped_params, module_is_root) ->
    bool``, or what Lightning's ``FSDPStrategy`` takes: a callable with torch's signature ``(module, recurse,
    nonwrapped_numel) -> bool`` (such as ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``) or
    torch's ``ModuleWrapPolicy``/``CustomPolicy``, making the units torch's FSDP would. Default: by size
    (``min_num_params``). Fixed at setup."""
    exclude_wrap_modules: Option[Optional[tuple[type[Module], ...]], Optional[Iterable[type[Module]]]] = Option()
    """Layer classes that never become units themselves under auto wrap (their children still can). Default:
    FairScale's (``nn.ModuleList``, ``nn.ModuleDict``) for the size policy, none else. Fixed at setup."""
    force_leaf_modules: Option[Optional[tuple[type[Module], ...]], Optional[Iterable[type[Module]]]] = Option()
    """Layer classes auto wrap does not descend into: neither they nor their children become units, their parameters
    belong to the enclosing unit. Default: FairScale's (``nn.MultiheadAttention``) for the size policy, none else.
    Fixed at setup."""
    activation_checkpointing: Option[
        tuple[type[Module], ...], Optional[Union[type[Module], list[type[Module]]]]
    ] = Option()
    """A layer class, or a list of them, whose instances recompute their activations in the backward pass instead of
    keeping them (FairScale's ``checkpoint_wrapper``, inside the FSDP unit). Fixed at setup."""
    activation_checkpointing_offload: Option[bool, bool] = Option()
    """Keep the checkpointed layers' inputs in CPU memory until backward. Fixed at setup."""
    state_dict_type: Option[Literal["full", "sharded"], Literal["full", "sharded"]] = Option()
    """``"full"`` (default): checkpoints are one file with the full model and optimizer state, gathered on rank 0,
    loadable anywhere. ``"sharded"``: every rank writes its own shard into a checkpoint directory, in parallel, and
    no rank gathers the full model; it resumes on the same number of processes, and
    ``lightning-fairscale-consolidate`` turns it into a full checkpoint. Loading accepts either kind. Read at each
    use: may change at any time."""
    lightning_1x_optimizer_state: Option[OptimizerStatePolicy, OptimizerStatePolicy] = Option()
    """Resuming a checkpoint of Lightning 1.x's FairScale FSDP strategy, whose optimizer state is rank 0's shard
    only: ``"error"`` (default) fails before training when the optimizer has per-parameter state (Adam...);
    ``"reset"`` starts that state afresh, with the checkpoint's hyperparameters. Stateless optimizers (SGD without
    momentum) resume exactly either way. Read at each use: may change at any time."""
    param_init_fn: Option[Optional[ParamInitFn], Optional[ParamInitFn]] = Option()
    """For a model built on the ``meta`` device (``trainer.init_module(empty_init=True)``,
    ``fabric.init_module(empty_init=True)``, or ``torch.device("meta")``): called with each module that holds meta
    tensors, once they are on the device (uninitialised), to initialise them in place, just before its FSDP unit is
    sharded (torch FSDP's argument). Default: each such module's ``reset_parameters()``. Fixed at setup."""
    sharding_strategy: Option[str, Any] = Option()
    """``"FULL_SHARD"`` (default: over all ranks), ``"SHARD_GRAD_OP"`` (as ``reshard_after_forward=False``),
    ``"HYBRID_SHARD"`` (shard over the ranks of each node, replicate across nodes: the gradient shards are
    all-reduced over the replicas) or ``"_HYBRID_SHARD_ZERO2"`` (hybrid, without resharding after forward); a string
    or torch's ``ShardingStrategy``. Fixed at setup."""
    device_mesh: Option[Optional[tuple[int, int]], Optional[Union[tuple[int, int], "DeviceMesh"]]] = Option()
    """Under hybrid sharding, ``(replicas, shard_size)`` to shard over other groups than the nodes (consecutive ranks
    form a replica); torch's 2-D ``DeviceMesh`` is taken for its shape (which ``strategy.device_mesh`` then is).
    Fixed at setup."""
    backward_prefetch: Option[Optional[str], Any] = Option()
    """When the backward of a run on CPU (gloo) gathers the next unit's parameters, torch's ``BackwardPrefetch`` or
    its name: ``BACKWARD_POST`` (default) once the current unit's gradient is done, alongside its reduce-scatter (the
    peak memory of the synchronous backward); ``BACKWARD_PRE`` before the current unit's backward, which it overlaps
    (faster, about a unit's parameters and gradient more); ``None``: no prefetch in the backward. The forward on CPU
    always gathers ahead (the next units that fit in ``bucket_cap_mb``, at least one). On CUDA, FairScale's streams
    overlap the collectives and this is not used. Fixed at setup."""
    sync_each_batch: Option[bool, bool] = Option()
    """How gradients accumulate over micro-batches (the Trainer's ``accumulate_grad_batches``, Fabric's
    ``no_backward_sync``). ``False`` (default): FairScale's ``no_sync``, each rank keeps the full, unsharded gradient
    of every unit until the last micro-batch, which reduce-scatters it once (least traffic, but the memory of a full
    gradient per rank). ``True``: every micro-batch reduce-scatters, and between micro-batches a rank holds only its
    gradient shard (what Lightning's own ``FSDPStrategy`` does in the Trainer; Accelerate's
    ``GradientAccumulationPlugin(sync_each_batch=True)``); Fabric's ``no_backward_sync`` then skips nothing. Same
    result either way. On CUDA not with ``cpu_offload`` or ``move_grads_to_cpu`` (FairScale cannot accumulate into
    gradient shards in CPU memory). Fixed at setup."""
    optimizer_path: Option[Literal["auto", "elementwise", "whole"], Literal["auto", "elementwise", "whole"]] = Option()
    """How the optimizers step the sharded parameters. ``"auto"`` (default): element-wise optimizers (SGD, Adam,
    AdamW...) step this rank's 1-D slices, with no more communication than FSDP's; those that read a parameter as a
    tensor (Adafactor, Muon, a LARS or LAMB of the user's) step each parameter whole on one owner rank, which
    receives its gradient and data slices and sends the updated slices back; an optimizer the table does not know is
    checked by a throwaway step of a small matrix whole against its slices. ``"elementwise"`` or ``"whole"`` force a
    path (see the guide, "Reading parameters outside the forward"). Fixed at setup."""
    # END generated


class ShardedDDPOptions(_StrategyOptions):
    """The options of ``DDPShardedStrategy`` (the Trainer's and Fabric's), as typed attributes.

    Each reads the strategy's :class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig` (``strategy.config``)
    and setting one makes a checked copy of it. After setup only ``lightning_1x_optimizer_state`` (read at each load)
    may change; the others raise.
    """

    _CHANGEABLE = _changeable(ShardedDDPConfig)

    @property
    def config(self) -> ShardedDDPConfig:
        """All the options, checked and frozen; a checked copy (``dataclasses.replace``) may replace it, before setup,
        or after it where only ``lightning_1x_optimizer_state`` differs."""
        return self._options_config

    @config.setter
    def config(self, config: ShardedDDPConfig) -> None:
        self._set_config(config)

    # BEGIN generated from ShardedDDPConfig by `make options`
    find_unused_parameters: Option[bool, bool] = Option()
    """Only ``False``: ``ShardedDataParallel`` has no search for unused parameters. A parameter that no rank uses
    keeps no gradient and is not reduced; one used on some ranks only is not supported (use Lightning's
    ``"ddp_find_unused_parameters_true"``). Fixed at setup."""
    lightning_1x_optimizer_state: Option[OptimizerStatePolicy, OptimizerStatePolicy] = Option()
    """Resuming a checkpoint of Lightning 1.x's FairScale *FSDP* strategy (1.x's ``"ddp_sharded"`` checkpoints resume
    exactly): ``"error"`` (default) or ``"reset"``, as in
    :class:`~lightning_fairscale.strategies.DDPFullyShardedStrategy`. Read at each use: may change at any time."""
    sync_each_batch: Option[bool, bool] = Option()
    """How gradients accumulate over micro-batches (the Trainer's ``accumulate_grad_batches``, Fabric's
    ``no_backward_sync``). ``False`` (default): ``ShardedDataParallel.no_sync``, each rank keeps the gradients of
    every parameter until the last micro-batch, which reduces them once. ``True``: every micro-batch reduces each
    gradient to the rank that owns its parameter, and between micro-batches a rank holds only the gradients of the
    parameters it owns (Accelerate's ``GradientAccumulationPlugin(sync_each_batch=True)``); Fabric's
    ``no_backward_sync`` then skips nothing. Same result either way. Fixed at setup."""
    # END generated
