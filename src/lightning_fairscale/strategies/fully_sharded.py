"""``DDPFullyShardedStrategy``: FairScale's Fully Sharded Data Parallel under Lightning 2.x's Trainer."""

# No postponed annotations: jsonargparse (LightningCLI) reads the constructor's from `inspect.signature`.
import contextlib
from collections.abc import Generator, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import pytorch_lightning as pl
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import CPUOffload
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fairscale._adapters import config_arguments, lightning_arguments, register_strategies
from lightning_fairscale._adapters.options import FullyShardedOptions
from lightning_fairscale._compat import _PATH, _optimizers_to_device, precision_plugin_property, take_trainer_compile
from lightning_fairscale._compat import attached_trainer, collective_timeout, layer_sync_plugin, plain_optimizer
from lightning_fairscale.callbacks.model_summary import restore_model_summaries, use_for_model_summaries
from lightning_fairscale.callbacks import weight_averaging
from lightning_fairscale.checkpoint.legacy import OptimizerStatePolicy
from lightning_fairscale.distributed import process_exit
from lightning_fairscale.fsdp import engine as fsdp_engine, model as fsdp_model, run as fsdp_run
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.patches.hybrid import ProcessGroups, release_groups
from lightning_fairscale.fsdp.unit.materialize import ParamInitFn, has_meta_tensors, to_device_keeping_meta
from lightning_fairscale.fsdp.wrapping.policies import AutoWrapPolicy
from lightning_fairscale.fsdp.unit.state_names import is_wrapped
from lightning_fairscale.fsdp.wrapping.compile import Compiler
from lightning_fairscale.fsdp.wrapping.summary import memory_figures
from lightning_fairscale.fsdp.wrapping.unwrapping import wrapped_root
from lightning_fairscale import checkpointer
from lightning_fairscale.plugins.checkpoint_io import checkpoint_files, default_checkpoint_io, finish_background
from lightning_fairscale.plugins.checkpoint_io import sharded_storage
from lightning_fairscale.precision.fully_sharded import FullyShardedPrecisionPlugin, fully_sharded_precision_plugin
from lightning_fairscale.strategies import _optimizers
from lightning_fairscale.strategies._callbacks import check_callbacks, trainer_callbacks
from lightning_fairscale.strategies._lost_ranks import report_collective_failure

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class DDPFullyShardedStrategy(DDPStrategy, FullyShardedOptions):
    """Fully Sharded Data Parallel training with FairScale, for Lightning 2.x.

    Lightning 1.x's strategy: shards parameters, gradients and optimizer state (ZeRO stage 3), on GPUs and CPUs. Each
    option is declared once, by :class:`~lightning_fairscale.fsdp.config.FullyShardedConfig` (``strategy.config``),
    whence its parameter and ``Args:`` entry here and its typed attribute come (``make options``).

    Args:
        accelerator: the accelerator; the Trainer sets it.
        cpu_offload: keep the FP32 parameter shards on the CPU (CUDA only), a bool or torch's ``CPUOffload``.
        flatten_parameters: flatten each unit's parameters into one contiguous tensor (faster).
        reshard_after_forward: free full parameters after the forward pass, gathering them again for backward.
        move_grads_to_cpu: move gradient shards to the CPU after reduction (default: as ``cpu_offload``).
        fp32_reduce_scatter: reduce-scatter gradients in FP32 under mixed precision.
        compute_dtype: the dtype of the full parameters in computation (default: from the precision).
        bucket_cap_mb: the size of the reduce-scatter buckets in MB; ``<= 0`` disables bucketing.
        min_num_params: auto wrap by size: a module with this many unwrapped parameters becomes its own unit.
        state_dict_to_cpu: return full state dicts on the CPU instead of the compute device.
        parallel_devices: the devices of this node; the Trainer sets them.
        cluster_environment: the cluster environment; the Trainer sets it.
        checkpoint_io: the checkpoint IO plugin (default: :class:`~lightning_fairscale.ShardedCheckpointIO`).
        precision_plugin: the precision plugin; the Trainer's ``precision`` flag chooses it.
        process_group_backend: ``"nccl"``, ``"gloo"``... (default: from the device).
        auto_wrap_policy: which submodules become units: layer classes, FairScale's or torch's policy.
        exclude_wrap_modules: layer classes that never become units themselves under auto wrap.
        force_leaf_modules: layer classes auto wrap does not descend into.
        activation_checkpointing: a layer class, or a list, whose activations are recomputed in backward.
        activation_checkpointing_offload: keep the checkpointed layers' inputs in CPU memory until backward.
        state_dict_type: ``"full"`` (one checkpoint file, gathered on rank 0) or ``"sharded"`` (a file per rank).
        timeout: how long collectives wait for the other ranks before failing.
        start_method: ``"popen"`` (re-run the script for each rank, the default) or ``"spawn"``/``"fork"``.
        precision: another name for ``precision_plugin`` (Fabric's).
        lightning_1x_optimizer_state: resuming a Lightning 1.x checkpoint's optimizer state: ``"error"``/``"reset"``.
        activation_checkpointing_policy: Lightning ``FSDPStrategy``'s name for ``activation_checkpointing``.
        param_init_fn: initialises the modules of a model built on the ``meta`` device, unit by unit.
        sharding_strategy: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"``... or torch's enum.
        device_mesh: under hybrid sharding, ``(replicas, shard_size)`` or torch's 2-D ``DeviceMesh``.
        backward_prefetch: when the backward on CPU gathers the next unit (torch's ``BackwardPrefetch`` or its name).
        sync_each_batch: reduce-scatter after every micro-batch when accumulating, instead of ``no_sync``.
        optimizer_path: ``"auto"``/``"elementwise"``/``"whole"``: how optimizers step (Adafactor, Muon: whole).
        **kwargs: passed to FairScale's ``FullyShardedDataParallel``.

    Example:
        >>> DDPFullyShardedStrategy(min_num_params=1_000_000, bucket_cap_mb=50).min_num_params
        1000000
    """

    strategy_name = "fsdp_fairscale"

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        cpu_offload: Union[bool, CPUOffload] = False,
        flatten_parameters: bool = True,
        reshard_after_forward: bool = True,
        move_grads_to_cpu: Optional[bool] = None,
        fp32_reduce_scatter: Optional[bool] = None,
        compute_dtype: Optional[torch.dtype] = None,
        bucket_cap_mb: int = 25,
        min_num_params: int = 100_000_000,
        state_dict_to_cpu: bool = True,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        auto_wrap_policy: Optional[AutoWrapPolicy] = None,
        exclude_wrap_modules: Optional[Iterable[type[Module]]] = None,
        force_leaf_modules: Optional[Iterable[type[Module]]] = None,
        activation_checkpointing: Optional[Union[type[Module], list[type[Module]]]] = None,
        activation_checkpointing_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "full",
        timeout: Optional[timedelta] = default_pg_timeout,  # Lightning's default too
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        precision: Optional[Precision] = None,
        lightning_1x_optimizer_state: OptimizerStatePolicy = "error",
        activation_checkpointing_policy: Optional[Union[AutoWrapPolicy, type[Module]]] = None,
        param_init_fn: Optional[ParamInitFn] = None,
        sharding_strategy: Any = "FULL_SHARD",
        device_mesh: Optional[Union[tuple[int, int], "DeviceMesh"]] = None,
        backward_prefetch: Any = "BACKWARD_POST",
        sync_each_batch: bool = False,
        optimizer_path: Literal["auto", "elementwise", "whole"] = "auto",
        **kwargs: Any,
    ) -> None:
        config = FullyShardedConfig(**config_arguments(FullyShardedConfig, locals()), owner=type(self).__name__)
        super().__init__(**lightning_arguments(locals(), "precision_plugin"))
        self.config = config  # the options (see `FullyShardedOptions`)
        self._groups = ProcessGroups()  # FSDP's process groups, made in `setup_environment`
        self._sharded: Optional[fsdp_model.WrappedModel] = None  # the engine's sharded model, while wrapped
        #: Whether the stage failed: teardown then waits for no other rank's background writes. The
        #: ``WeightAveraging`` callbacks given an average over this rank's shards, while the module is sharded.
        self._failed, self._averaging = False, []  # type: tuple[bool, list[Any]]

    # ------------------------------------------------------------------------------------------------------------
    # FSDP configuration (the options' attributes come with `FullyShardedOptions`)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fsdp_fairscale"`` and ``"ddp_fully_sharded"`` with the Trainer's registry, where free."""
        names = ("fsdp_fairscale", "ddp_fully_sharded")
        register_strategies(strategy_registry, cls, names, "FairScale's Fully Sharded Data Parallel")

    precision_plugin = precision_plugin_property(FullyShardedPrecisionPlugin, fully_sharded_precision_plugin)
    checkpoint_io = default_checkpoint_io(DDPStrategy)

    def fsdp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every FSDP unit of this strategy is built with."""
        return fsdp_run.fsdp_kwargs(self.config, self.root_device, self._groups, self.precision_plugin.precision)

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks

    # Lightning annotates the generator-based context manager its own implementation returns; callers only enter it.
    @override
    def model_sharded_context(self) -> contextlib.AbstractContextManager:  # type: ignore[override]
        """Inside this context, ``fairscale.nn.wrap`` and ``torch.distributed.fsdp.wrap.wrap`` make FSDP units."""
        precision = self.precision_plugin.precision
        return fsdp_engine.wrapping_context(self.config, self.root_device, self._groups, precision)

    @override
    def setup_environment(self) -> None:
        """Lightning's set-up (the default process group), then everything FSDP needs; all ranks together."""
        check_callbacks(trainer_callbacks(self), type(self).__name__)  # before any process group
        with process_exit.closing_at_exit(self):
            super().setup_environment()
        self._groups = fsdp_engine.set_up_run(
            self.config, self.root_device, self.precision_plugin.precision, self.global_rank, self.world_size,
            self.num_nodes, collective_timeout(self),
        )
        self._fix_options()
        if self.config.state_dict_type == "sharded":
            sharded_storage(self.checkpoint_io)  # fail before training, not at the first save

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        # `trainer.fit(torch.compile(model))`: Lightning compiled the module's forward and step methods, which would
        # trace FairScale's units; their layers are compiled instead, with the same options (workaround 18).
        compiler = take_trainer_compile(self.lightning_module)
        root = wrapped_root(self.model)
        if root is not None:  # a stage after another one: the module is still sharded; it stays so (given compiled,
            self._sharded, self.model = fsdp_engine.wrapped_model(root, compiler), root  # its layers are compiled)
            _optimizers.for_sharded_stage(self, trainer, fitting, self._sharded, self.config)
        else:
            self._setup_unwrapped(trainer, fitting, compiler)
        use_for_model_summaries(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.clip_for(self._sharded)  # always one of ours: it clips by the norm over the model's group
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            # `WeightAveraging` copied the module before it was sharded: its average goes over the shards now.
            self._averaging += weight_averaging.shard(trainer_callbacks(self), self, self.lightning_module_state_dict)
        self.barrier()

    def _setup_unwrapped(self, trainer: pl.Trainer, fitting: bool, compiler: Optional[Compiler]) -> None:
        assert self.model is not None
        layer_sync = layer_sync_plugin(self)
        if fitting and layer_sync:
            self.model = layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        # Optimizers are made on the unwrapped module and re-pointed to the shards after wrapping; but after it when
        # units made in `configure_model` flattened their layers' parameters (the originals are back then).
        before = fitting and not is_wrapped(self.model)
        if before:
            self.setup_optimizers(trainer)
        elif not fitting:  # validate/test/predict of a new module (`trainer.test(NewModule())` after `fit`): none
            own = {id(param) for param in self.model.parameters()}  # of fit's optimizers
            self.optimizers = _optimizers.kept_of(self.optimizers, lambda param: id(param) in own)
        self.model_to_device()
        # The unit summary goes where Lightning's own messages go (its logger has a handler), once, from rank 0.
        self._sharded = fsdp_engine.wrap_model(
            self.config, self.model, self.root_device, self._groups, self.precision_plugin.precision, rank_zero_info,
            _optimizers.plain(self.optimizers) if before or not fitting else None, compiler,
        )
        self.model = self._sharded.root
        if fitting and not before:
            _optimizers.configure_on_sharded(self, trainer, self._sharded, self.config)
            self._sharded.forget_originals()

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Lightning's (the root device, the precision's dtype), but on the CPU with ``cpu_offload`` (FairScale keeps
        offloaded shards there; units are sharded where made); with ``empty_init=True`` on the ``meta`` device, as
        Lightning's ``FSDPStrategy``: each unit materialises its part before sharding it (``fsdp.unit.materialize``)."""
        if empty_init:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
            return
        with super().tensor_init_context(empty_init):
            offload = fsdp_run.offloads_to_cpu(self.config, self.root_device)
            with torch.device("cpu") if offload else contextlib.nullcontext():
                yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        # With `cpu_offload` FairScale keeps (and asserts) the shards in CPU memory: a module moved to the GPU goes
        # back first; buffers go to the GPU when FSDP first runs; meta tensors stay (each unit materialises its own).
        offload = fsdp_run.offloads_to_cpu(self.config, self.root_device)
        to_device_keeping_meta(self.model, torch.device("cpu") if offload else self.root_device)

    def memory_figures(self) -> dict[str, float]:
        """This rank's bytes of parameters, gradients and optimizer state (and peak device memory on CUDA); log them
        from the LightningModule, e.g. ``self.log_dict(self.trainer.strategy.memory_figures())``."""
        assert self.model is not None
        return memory_figures(self.model, _optimizers.plain(self.optimizers))

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduce-scatter on accumulation steps (FSDP's ``no_sync``); with ``sync_each_batch``
        skip nothing: every micro-batch reduce-scatters, and FairScale adds each reduced shard to the one held."""
        if isinstance(self.model, _FairScaleFSDP) and not self.config.sync_each_batch:
            with self.model.no_sync():
                yield
        else:
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward; one inside the training step (``manual_backward``, which runs inside the root unit's
        forward) ends as FairScale ends a backward after the forward (``fsdp.unit.step_state``); after an exception in
        it the units are as the last completed step left them (``fsdp.unit.recovery``)."""
        if self._sharded is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with self._sharded.backward():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def _saves_sharded(self) -> bool:
        return self.config.state_dict_type == "sharded" and self._sharded is not None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict with the unwrapped module's keys, gathered unit by unit and kept on rank 0 only;
        with ``state_dict_type="sharded"``, this rank's parameter shards (FairScale's ``local_state_dict``)."""
        if self._sharded is None:
            return super().lightning_module_state_dict()
        return self._sharded.state_dict(self._saves_sharded(), self.is_global_zero)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full optimizer state in the layout of a plain optimizer, on rank 0 (``{}`` on the other ranks); with
        ``state_dict_type="sharded"``, this rank's state over its shards."""
        if self._sharded is None:  # not wrapped (after `unshard_module`): a plain optimizer over the module
            return super().optimizer_state(optimizer)
        return self._sharded.optimizer_state(plain_optimizer(optimizer), self._saves_sharded())

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Rank 0 writes a full checkpoint file; with ``state_dict_type="sharded"`` every rank writes its shard of a
        checkpoint directory (see :class:`~lightning_fairscale.plugins.checkpoint_io.ShardedCheckpointIO`); with a
        plugin that saves in the background, on its thread, from a copy (earlier background writes agreed first)."""
        if not self._saves_sharded():
            if self.config.state_dict_type == "sharded" and self.lightning_module is not None:
                rank_zero_warn(
                    f"The model is not sharded (`unshard_module()` gave it its full parameters back), so {filepath} is"
                    " written as a full checkpoint file.",
                )
            return checkpointer.save_full(self._files(), filepath, checkpoint, storage_options)
        assert self._sharded is not None
        checkpointer.save_sharded(self._sharded.settled(), self._files(sharded_save=True), filepath, checkpoint,
                                  self._layout(), _optimizers.plain(self.optimizers))
        return None

    def _files(self, sharded_save: bool = False) -> checkpointer.Files:  # the checkpointer's, with our plugin
        return checkpoint_files(self.checkpoint_io, self.global_rank, collective_timeout(self), sharded_save)

    def _layout(self) -> checkpointer.TrainerLayout:  # the Trainer's file layout, for the checkpointer
        policy, averaging = self.config.lightning_1x_optimizer_state, bool(self._averaging)
        return checkpointer.TrainerLayout(pl.__version__, type(self).__name__, policy, averaging)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # `load_checkpoint` loads the optimizer states itself, into this rank's shards.
        return self._sharded is None

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the model's and the optimizers' states into this rank's shards, and return the rest of the checkpoint.

        Either kind of checkpoint loads without gathering anything: a full file is memory-mapped and each rank reads
        the slices of each parameter that it owns, unit by unit; a sharded directory saved by any number of
        processes is read the same way from the saved shards (see :mod:`lightning_fairscale.fsdp.state.resharding`).

        With ``LightningModule.strict_loading = False``, the model's parameters and buffers that the checkpoint lacks
        keep their values and its other entries are ignored (a warning names them); shapes must still match.

        A Fabric checkpoint (``fabric.save``, full or sharded) is read in the Trainer's layout (see
        :func:`~lightning_fairscale.checkpoint.fabric.to_trainer_layout`): its model, optimizers and LR schedulers
        resume; the file is not changed. Checkpoints still being written in the background are written first.
        """
        assert self.lightning_module is not None
        if self._sharded is None:
            keys = list(self.lightning_module.state_dict())  # a Fabric file's model entry: these keys
            return checkpointer.read_full(self._files(), checkpoint_path, weights_only, (pl.__version__, keys))
        optimizers = _optimizers.plain(self.optimizers) if _optimizers.restored(self) else []
        return checkpointer.load(self._sharded.settled(), self._files(), checkpoint_path, self._layout(),
                                 self.lightning_module.strict_loading, weights_only, optimizers=optimizers)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._sharded is None:  # `load_checkpoint` has loaded the sharded model
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._sharded is None:  # `load_checkpoint` has loaded the optimizers' shards
            super().load_optimizer_state_dict(checkpoint)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        weight_averaging.drop_stale_full_params(self._averaging, self.model)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # another rank may be gone: teardown must not wait for its shards; its loss is named
        _optimizers.abort_steps(self._sharded)  # a whole-path step that raised: no tensor left whole, others told
        report_collective_failure(exception, collective_timeout(self), self.launcher)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """End a stage without gathering anything: the LightningModule stays sharded.

        The next stage (``validate``, ``test``, ``predict`` or another ``fit``, with this Trainer or another one)
        takes the sharded module as it is, and ``trainer.save_checkpoint`` after ``fit`` writes the same checkpoint
        as during training. Call :meth:`unshard_module` to get the full module back. As Lightning's own FSDP
        strategy does, the module and the optimizers stay on their device: FairScale keeps references to the
        parameter shards that moving them would break. A module still on the meta device (the stage failed before
        wrapping it) is not moved either: it has no data to move. The process groups go with the sharded module
        (see :mod:`lightning_fairscale.fsdp.patches.hybrid`): destroyed here when no module is kept sharded over them.
        Checkpoints written in the background are in place when it returns (after a failed stage, those that can
        still complete).
        """
        finish_background(self.checkpoint_io, self._failed)
        self._failed = False
        if release_groups(self._groups):
            self._groups = ProcessGroups()
        restore_model_summaries(attached_trainer(self.lightning_module) if self.lightning_module else None)
        if self._sharded is None and not (self.model is not None and has_meta_tensors(self.model)):
            super().teardown()
            return
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def unshard_module(self, rank_zero_only: bool = True) -> Module:
        """Give the LightningModule its full parameters back, as a plain module: an explicit, collective call.

        After ``fit`` the module stays sharded, so nothing is gathered at the end of a run. Call this on every rank
        when a full module is wanted in memory (to export it, or to use it outside the Trainer). FSDP units are
        gathered one at a time; with ``rank_zero_only`` (the default) only rank 0 keeps the full parameters (on the
        CPU), the other ranks' parameters are left on the ``meta`` device, so the memory of one full model is needed
        on one rank only. With ``rank_zero_only=False`` every rank gets the full module, which can then be wrapped
        again by a later stage.

        The optimizers' state lives in the shards this frees: the strategy's optimizers and LR schedulers are dropped
        (save a checkpoint first to keep them).

        Returns:
            The LightningModule, unwrapped.
        """
        module = self.lightning_module
        assert module is not None
        if self._sharded is None:
            return module
        self._sharded.unshard(keep=self.is_global_zero or not rank_zero_only)
        self._sharded, self._averaging = None, weight_averaging.release(self._averaging)
        self.model = module
        self.optimizers = []
        self.lr_scheduler_configs = []
        return module
