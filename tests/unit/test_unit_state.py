"""What the package knows about units, flat parameters, the user's modules and optimizers lives in objects of its own
(``fsdp.unit.unit_state``: the units' records and the model's owner): nothing of ours is written into objects we do
not own."""

from __future__ import annotations

import functools
import gc
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_fairscale.fsdp import engine as fsdp_engine
from lightning_fairscale.fsdp.config import FullyShardedConfig
from lightning_fairscale.fsdp.unit import unit_state
from lightning_fairscale.fsdp.unit.instances import fsdp_instances
from lightning_fairscale.fsdp.unit.param_views import views_of
from lightning_fairscale.fsdp.wrapping.unwrapping import wrapped_root

from .helpers import Block, Net, batches

#: What FairScale itself writes into a flat parameter's ``__dict__`` (its flattening and sharding).
FAIRSCALE_FLAT = {
    "_fp16_shard", "_fp32_shard", "_is_sharded", "_orig_size", "_param_infos", "_param_numels", "_param_shapes",
    "_shard_bwd_hook", "_shared_param_infos", "_full_param_padded", "_cpu_grad", "_saved_grad_shard",
}  # fmt: skip
#: What FairScale's ``FlattenParamsWrapper`` writes into the modules it flattens.
FAIRSCALE_MODULE = {"_unflattened_param_views"}
MARKER = "_lightning" + "_fairscale"


def _train(root: nn.Module, optimizer: torch.optim.Optimizer, clip: bool) -> None:
    for x, y in batches(2):
        nn.functional.mse_loss(root(x), y).backward()
        if clip:
            root.clip_grad_norm_(1.0)  # type: ignore[operator]
        optimizer.step()
        optimizer.zero_grad()


def test_nothing_of_ours_is_written_into_flat_parameters_user_modules_or_the_optimizer(
    process_group: dist.ProcessGroup,
) -> None:
    model = Net()
    model.inp.weight.requires_grad_(False)  # the root unit flattens frozen and trainable parameters (workaround 11)
    modules = list(model.modules())
    before = {id(m): set(vars(m)) for m in modules}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    reference = Net()  # the same optimizer over an unsharded model: the attributes torch gives it
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    _train(reference, reference_optimizer, clip=False)

    config = FullyShardedConfig(auto_wrap_policy={Block}, activation_checkpointing=Block, bucket_cap_mb=1)
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=timedelta(60))
    compiler = functools.partial(torch.compile, backend="eager")
    wrapped = fsdp_engine.wrap_model(config, model, torch.device("cpu"), groups, "32-true", None, [optimizer], compiler)
    root = wrapped.root
    _train(root, optimizer, clip=True)

    # What we know is known, from our side: the state of every unit and flat parameter, the root, the norm group.
    units = list(fsdp_instances(root))
    assert len(units) == 3 and all(isinstance(unit_state.peek(unit), unit_state.UnitState) for unit in units)
    owner = unit_state.owner_of(root)  # the model's owner, held by the root unit
    assert owner.has_views and owner.wrapped is not None
    flat = [param for unit in units for param in unit.params]
    assert all(views_of(unit_state.peek_flat(unit, param)) for unit in units for param in unit.params)
    states = [state for unit in units for state in unit_state.flat_states(unit)]
    assert all(state is not None and state.views and state.hooked for state in states)
    assert unit_state.flat_states(root)[0].frozen == [True, False, False, False]  # type: ignore[union-attr]
    assert wrapped_root(model) is root and wrapped.norm_group(optimizer) is root.process_group
    # ... and nothing of ours in their objects.
    assert all(not name.startswith(MARKER) for unit in units for name in vars(unit))
    assert [sorted(set(vars(param)) - FAIRSCALE_FLAT) for param in flat] == [[]] * len(flat)
    regions = set(map(id, wrapped.checkpointed)) | {id(model.inp), id(model.out)}  # compiled or checkpointed
    own_forward = [{"forward"} if id(m) in regions else set() for m in modules]  # what compiling/checkpointing is
    added = [
        (type(m).__name__, set(vars(m)) - before[id(m)] - FAIRSCALE_MODULE - own)
        for m, own in zip(modules, own_forward)
    ]
    assert [(name, keys) for name, keys in added if keys] == []
    assert set(vars(optimizer)) == set(vars(reference_optimizer))

    # Unsharded: the records go with the units; the user's modules are as they were.
    module = wrapped.unshard(keep=True)
    assert module is model and wrapped_root(model) is None
    assert all(set(vars(m)) - FAIRSCALE_MODULE <= before[id(m)] for m in modules)


def test_a_sharded_module_holds_its_root_and_both_are_freed_with_it(process_group: dist.ProcessGroup) -> None:
    """A module kept sharded between stages finds its root again, which lives as long as the module does (the next
    stage reuses it) and no longer: dropped without unsharding, module and root are freed (no map of ours keeps
    them), also when it never trained (an evaluation loop over many checkpoints)."""
    config = FullyShardedConfig(auto_wrap_policy={Block})
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=timedelta(60))
    model = Net()
    wrapped = fsdp_engine.wrap_model(config, model, torch.device("cpu"), groups, "32-true", None, [], None)
    root = weakref.ref(wrapped.root)
    del wrapped
    gc.collect()
    assert wrapped_root(model) is root() is not None  # the module alone keeps its root
    module = weakref.ref(model)
    del model
    gc.collect()
    assert module() is None and root() is None


class _Scaled(Net):
    """``Net`` with a parameter of its own: the root unit's flat parameter records the module itself as its owner."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _dropped_after(how: str, make: type[nn.Module]) -> list[bool]:
    """Shard a ``make()``, train it a step, then ``how`` (``"step"``: nothing more; ``"forward"``: a forward with
    gradients whose backward never comes; ``"exception"``: an exception inside the root's forward), drop everything:
    which of the module, the root unit and a flat parameter are still alive after a garbage collection."""
    config = FullyShardedConfig(auto_wrap_policy={Block}, activation_checkpointing=Block)
    groups = fsdp_engine.make_process_groups(config, rank=0, world_size=1, num_nodes=1, timeout=timedelta(60))
    module = make()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    wrapped = fsdp_engine.wrap_model(config, module, torch.device("cpu"), groups, "32-true", None, [optimizer], None)
    root = wrapped.root
    _train(root, optimizer, clip=False)
    x, _ = batches(1)[0]
    if how == "forward":
        root(x).sum()  # dropped: its backward never comes
    elif how == "exception":
        block = next(m for m in module.modules() if isinstance(m, Block))
        handle = block.register_forward_hook(lambda *args: 1 / 0)
        try:
            root(x)
        except ZeroDivisionError:
            pass
        handle.remove()
    refs = [weakref.ref(module), weakref.ref(root), weakref.ref(root.params[0])]
    del module, root, wrapped, optimizer
    gc.collect()
    return [ref() is not None for ref in refs]


def test_a_trained_model_is_freed_once_dropped(process_group: dist.ProcessGroup) -> None:
    """Issue 54: FairScale's post-backward hooks on the flat parameters' gradient accumulators, and the views of the
    full parameters that lead to them, kept every model that ran a backward alive (a cycle through autograd's C++
    objects): after a training step, after a forward whose backward never came, after an exception in a step, also
    for a module that owns a parameter of the root unit (its records lead back to the root). Not yet: that module
    after a forward whose backward never came and nothing restored (the views its backward would need are held by
    the root until the next forward or backward)."""
    for how, make in [("step", Net), ("forward", Net), ("exception", Net), ("step", _Scaled), ("exception", _Scaled)]:
        assert _dropped_after(how, make) == [False] * 3, (how, make.__name__)
