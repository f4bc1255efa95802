"""The strategies' options as typed properties: :class:`FullyShardedOptions` (``DDPFullyShardedStrategy``) and
:class:`ShardedDDPOptions` (``DDPShardedStrategy``), the Trainer's and Fabric's alike.

Each is a mixin after Lightning's class (``class DDPShardedStrategy(DDPStrategy, ShardedDDPOptions)``): it adds names
Lightning does not have, and overrides nothing. Its properties read the strategy's configuration
(``strategy.config``); setting one replaces it with a checked copy, and after setup raises for an option the run has
already used (see :class:`_StrategyOptions`). Written in the source, so that editors and type checkers see each
option's type and docstring; it imports no Lightning module, as the rest of :mod:`lightning_fairscale._adapters`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional, Union

import torch
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
from torch.nn import Module

from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.unit.materialize import ParamInitFn
from lightning_fairscale.fsdp.wrapping.policies import AutoWrapPolicy
from lightning_fairscale.sharded_ddp.config import ShardedDDPConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FullyShardedOptions", "ShardedDDPOptions"]


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

    #: The options that may change after setup: the strategy reads them each time it uses them.
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


class FullyShardedOptions(_StrategyOptions):
    """The options of ``DDPFullyShardedStrategy`` (the Trainer's and Fabric's), as typed properties.

    Each reads the strategy's :class:`~lightning_fairscale.fsdp.config.FullyShardedConfig` (``strategy.config``) and
    setting one makes a checked copy of it. Before setup every option may change; after it only ``state_dict_type``
    (read at each save: ``strategy.state_dict_type = "full"`` before a last ``save_checkpoint`` writes one full file)
    and ``lightning_1x_optimizer_state`` (read at each load). The others raise: the process groups
    (``sharding_strategy``, ``device_mesh``), the checks against the device and precision and the FSDP units made
    when the model is wrapped (all the others) use them once, at setup.
    """

    _CHANGEABLE = frozenset({"state_dict_type", "lightning_1x_optimizer_state"})

    @property
    def config(self) -> FullyShardedConfig:
        """All the options, checked and frozen; a checked copy (``dataclasses.replace``) may replace it, before setup,
        or after it where only ``state_dict_type`` and ``lightning_1x_optimizer_state`` differ."""
        return self._options_config

    @config.setter
    def config(self, config: FullyShardedConfig) -> None:
        self._set_config(config)

    @property
    def cpu_offload(self) -> bool:
        """Keep the FP32 parameter shards on the CPU (CUDA only). Fixed at setup."""
        return self.config.cpu_offload

    @cpu_offload.setter
    def cpu_offload(self, value: Union[bool, CPUOffload]) -> None:
        self._set_option("cpu_offload", value)

    @property
    def flatten_parameters(self) -> bool:
        """Flatten each unit's parameters into one contiguous tensor. Fixed at setup."""
        return self.config.flatten_parameters

    @flatten_parameters.setter
    def flatten_parameters(self, value: bool) -> None:
        self._set_option("flatten_parameters", value)

    @property
    def reshard_after_forward(self) -> bool:
        """Free full parameters after the forward pass (as given: the ZeRO-2 sharding strategies keep them whatever
        it says). Fixed at setup."""
        return self.config.reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self._set_option("reshard_after_forward", value)

    @property
    def move_grads_to_cpu(self) -> Optional[bool]:
        """Move gradient shards to the CPU after reduction (``None``: as ``cpu_offload``). Fixed at setup."""
        return self.config.move_grads_to_cpu

    @move_grads_to_cpu.setter
    def move_grads_to_cpu(self, value: Optional[bool]) -> None:
        self._set_option("move_grads_to_cpu", value)

    @property
    def fp32_reduce_scatter(self) -> Optional[bool]:
        """Reduce-scatter gradients in FP32 under mixed precision. Fixed at setup."""
        return self.config.fp32_reduce_scatter

    @fp32_reduce_scatter.setter
    def fp32_reduce_scatter(self, value: Optional[bool]) -> None:
        self._set_option("fp32_reduce_scatter", value)

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the full parameters in computation (``None``: from the precision). Fixed at setup."""
        return self.config.compute_dtype

    @compute_dtype.setter
    def compute_dtype(self, value: Optional[torch.dtype]) -> None:
        self._set_option("compute_dtype", value)

    @property
    def bucket_cap_mb(self) -> int:
        """The size of the reduce-scatter buckets in MB (``<= 0``: no buckets). Fixed at setup."""
        return self.config.bucket_cap_mb

    @bucket_cap_mb.setter
    def bucket_cap_mb(self, value: int) -> None:
        self._set_option("bucket_cap_mb", value)

    @property
    def min_num_params(self) -> int:
        """Auto wrap by size: a module with at least this many unwrapped parameters becomes its own unit. Fixed at
        setup."""
        return self.config.min_num_params

    @min_num_params.setter
    def min_num_params(self, value: float) -> None:  # Lightning 1.x's default was `1e8`
        self._set_option("min_num_params", value)

    @property
    def state_dict_to_cpu(self) -> bool:
        """Return full state dicts on the CPU instead of the compute device. Fixed at setup."""
        return self.config.state_dict_to_cpu

    @state_dict_to_cpu.setter
    def state_dict_to_cpu(self, value: bool) -> None:
        self._set_option("state_dict_to_cpu", value)

    @property
    def auto_wrap_policy(self) -> Optional[AutoWrapPolicy]:
        """Which submodules become units (``None``: by size, ``min_num_params``). Fixed at setup."""
        return self.config.auto_wrap_policy

    @auto_wrap_policy.setter
    def auto_wrap_policy(self, value: Optional[AutoWrapPolicy]) -> None:
        self._set_option("auto_wrap_policy", value)

    @property
    def exclude_wrap_modules(self) -> Optional[tuple[type[Module], ...]]:
        """Layer classes that never become units themselves under auto wrap. Fixed at setup."""
        return self.config.exclude_wrap_modules

    @exclude_wrap_modules.setter
    def exclude_wrap_modules(self, value: Optional[Iterable[type[Module]]]) -> None:
        self._set_option("exclude_wrap_modules", value)

    @property
    def force_leaf_modules(self) -> Optional[tuple[type[Module], ...]]:
        """Layer classes that auto wrap does not descend into. Fixed at setup."""
        return self.config.force_leaf_modules

    @force_leaf_modules.setter
    def force_leaf_modules(self, value: Optional[Iterable[type[Module]]]) -> None:
        self._set_option("force_leaf_modules", value)

    @property
    def activation_checkpointing(self) -> tuple[type[Module], ...]:
        """The layer classes whose activations are recomputed in the backward pass. Fixed at setup."""
        return self.config.activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: Optional[Union[type[Module], list[type[Module]]]]) -> None:
        self._set_option("activation_checkpointing", value)

    @property
    def activation_checkpointing_offload(self) -> bool:
        """Keep the checkpointed layers' inputs in CPU memory until backward. Fixed at setup."""
        return self.config.activation_checkpointing_offload

    @activation_checkpointing_offload.setter
    def activation_checkpointing_offload(self, value: bool) -> None:
        self._set_option("activation_checkpointing_offload", value)

    @property
    def state_dict_type(self) -> Literal["full", "sharded"]:
        """``"full"`` (one checkpoint file, gathered on rank 0) or ``"sharded"`` (one file per rank). Read at each
        save: may change at any time."""
        return self.config.state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, value: Literal["full", "sharded"]) -> None:
        self._set_option("state_dict_type", value)

    @property
    def lightning_1x_optimizer_state(self) -> OptimizerStatePolicy:
        """Resuming a Lightning 1.x FSDP checkpoint's optimizer state: ``"error"`` or ``"reset"``. Read at each load:
        may change at any time."""
        return self.config.lightning_1x_optimizer_state

    @lightning_1x_optimizer_state.setter
    def lightning_1x_optimizer_state(self, value: OptimizerStatePolicy) -> None:
        self._set_option("lightning_1x_optimizer_state", value)

    @property
    def param_init_fn(self) -> Optional[ParamInitFn]:
        """Initialises the modules of a model built on the ``meta`` device, unit by unit. Fixed at setup."""
        return self.config.param_init_fn

    @param_init_fn.setter
    def param_init_fn(self, value: Optional[ParamInitFn]) -> None:
        self._set_option("param_init_fn", value)

    @property
    def sharding_strategy(self) -> str:
        """``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"`` or ``"_HYBRID_SHARD_ZERO2"``. Fixed at setup."""
        return self.config.sharding_strategy

    @sharding_strategy.setter
    def sharding_strategy(self, value: Union[str, ShardingStrategy]) -> None:
        self._set_option("sharding_strategy", value)

    @property
    def device_mesh(self) -> Optional[tuple[int, int]]:
        """Under hybrid sharding, ``(replicas, shard_size)`` (``None``: one replica per node). Fixed at setup."""
        return self.config.device_mesh

    @device_mesh.setter
    def device_mesh(self, value: Optional[Union[tuple[int, int], DeviceMesh]]) -> None:
        self._set_option("device_mesh", value)

    @property
    def backward_prefetch(self) -> Optional[str]:
        """When the backward on CPU gathers the next unit: ``"BACKWARD_POST"``, ``"BACKWARD_PRE"`` or ``None``.
        Fixed at setup."""
        return self.config.backward_prefetch

    @backward_prefetch.setter
    def backward_prefetch(self, value: Optional[Union[str, BackwardPrefetch]]) -> None:
        self._set_option("backward_prefetch", value)

    @property
    def sync_each_batch(self) -> bool:
        """Reduce-scatter after every micro-batch when accumulating, instead of FairScale's ``no_sync``. Fixed at
        setup (checked against the device then, and one way of accumulating for the whole run)."""
        return self.config.sync_each_batch

    @sync_each_batch.setter
    def sync_each_batch(self, value: bool) -> None:
        self._set_option("sync_each_batch", value)

    @property
    def optimizer_path(self) -> Literal["auto", "elementwise", "whole"]:
        """How the optimizers step the sharded parameters: ``"auto"``, ``"elementwise"`` or ``"whole"``. Fixed at
        setup."""
        return self.config.optimizer_path

    @optimizer_path.setter
    def optimizer_path(self, value: Literal["auto", "elementwise", "whole"]) -> None:
        self._set_option("optimizer_path", value)


class ShardedDDPOptions(_StrategyOptions):
    """The options of ``DDPShardedStrategy`` (the Trainer's and Fabric's), as typed properties.

    Each reads the strategy's :class:`~lightning_fairscale.sharded_ddp.config.ShardedDDPConfig` (``strategy.config``)
    and setting one makes a checked copy of it. After setup only ``lightning_1x_optimizer_state`` (read at each load)
    may change; the others raise.
    """

    _CHANGEABLE = frozenset({"lightning_1x_optimizer_state"})

    @property
    def config(self) -> ShardedDDPConfig:
        """All the options, checked and frozen; a checked copy (``dataclasses.replace``) may replace it, before setup,
        or after it where only ``lightning_1x_optimizer_state`` differs."""
        return self._options_config

    @config.setter
    def config(self, config: ShardedDDPConfig) -> None:
        self._set_config(config)

    @property
    def find_unused_parameters(self) -> bool:
        """Only ``False``: ``ShardedDataParallel`` has no search for unused parameters. Fixed at setup."""
        return self.config.find_unused_parameters

    @find_unused_parameters.setter
    def find_unused_parameters(self, value: bool) -> None:
        self._set_option("find_unused_parameters", value)

    @property
    def lightning_1x_optimizer_state(self) -> OptimizerStatePolicy:
        """Resuming a Lightning 1.x FSDP checkpoint's optimizer state: ``"error"`` or ``"reset"``. Read at each load:
        may change at any time."""
        return self.config.lightning_1x_optimizer_state

    @lightning_1x_optimizer_state.setter
    def lightning_1x_optimizer_state(self, value: OptimizerStatePolicy) -> None:
        self._set_option("lightning_1x_optimizer_state", value)

    @property
    def sync_each_batch(self) -> bool:
        """Reduce after every micro-batch when accumulating, instead of ``ShardedDataParallel.no_sync``. Fixed at
        setup (one way of accumulating for the whole run)."""
        return self.config.sync_each_batch

    @sync_each_batch.setter
    def sync_each_batch(self, value: bool) -> None:
        self._set_option("sync_each_batch", value)
