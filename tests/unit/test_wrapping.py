"""fsdp/wrapping/policies.py, activation_checkpointing.py, state_names.py and unwrapping.py: auto-wrap policies and
their controls, validation, names, activation checkpointing, wrap/unwrap."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from fairscale.nn.wrap import default_auto_wrap_policy
from torch import nn
from torch.distributed.fsdp._wrap_utils import _auto_wrap as torch_auto_wrap
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from lightning_fairscale.fsdp.wrapping.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointing_layer_classes,
    remove_activation_checkpointing,
    validate_layer_classes,
)
from lightning_fairscale.fsdp.wrapping.policies import validate_auto_wrap_policy
from lightning_fairscale.fsdp.unit import unit_state
from lightning_fairscale.fsdp.unit.frozen_params import frozen_pieces
from lightning_fairscale.fsdp.unit.state_names import add_aliases, apply_aliases, clean_path, is_wrapped, state_aliases
from lightning_fairscale.fsdp.wrapping.unwrapping import unwrap_module

from .helpers import OPTIMIZERS, Block, Net, batches, parameters_of, shard, step, unit_paths, wrap

pytestmark = pytest.mark.usefixtures("process_group")

BLOCK_LINEARS = ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]


def _linears_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
    """A policy with FairScale's signature: look everywhere, make every LayerNorm a unit."""
    return True if recurse else isinstance(module, nn.LayerNorm)


@pytest.mark.parametrize(
    ("min_num_params", "expected"),
    [
        # Linear(5, 6) has 36 parameters, Linear(6, 5) 35, a Block 81: each Linear of the blocks is large enough.
        (35, ["", *BLOCK_LINEARS]),
        # Only `up` is; what stays in a Block (norm + down: 45) then makes the Block a unit itself.
        (36, ["", "blocks.0", "blocks.0.up", "blocks.1", "blocks.1.up"]),
        (10**9, [""]),
    ],
)
def test_size_policy_wraps_what_reaches_min_num_params(min_num_params: int, expected: list[str]) -> None:
    assert unit_paths(wrap(Net(), min_num_params=min_num_params)) == expected


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({Block}, ["", "blocks.0", "blocks.1"]),
        (Block, ["", "blocks.0", "blocks.1"]),  # a single class
        ([nn.Linear], ["", "blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up", "inp", "out"]),
        ((nn.LayerNorm, Block), ["", "blocks.0", "blocks.0.norm", "blocks.1", "blocks.1.norm"]),
        (_linears_policy, ["", "blocks.0.norm", "blocks.1.norm"]),  # a FairScale policy callable
        (functools.partial(default_auto_wrap_policy, min_num_params=36), ["", "blocks.0", "blocks.0.up", "blocks.1",
                                                                           "blocks.1.up"]),
    ],
    ids=["set", "class", "list", "tuple", "callable", "fairscale-partial"],
)
def test_layer_classes_and_callables_choose_the_units(policy: Any, expected: list[str]) -> None:
    # min_num_params=0 would wrap everything under the size policy: these policies must not consult it.
    assert unit_paths(wrap(Net(), policy=policy, min_num_params=0)) == expected


class WithContainers(nn.Module):
    """A ModuleList and a MultiheadAttention: FairScale's size policy neither wraps the one nor enters the other."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.attn(x, x, x)[0]


def _layer_norms(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm)


def _torch_signature_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """A policy with torch's signature: the same choice as `_linears_policy`."""
    return True if recurse else isinstance(module, nn.LayerNorm)


class TorchUnit(nn.Module):
    """Marks what torch's FSDP would make a unit (its FSDP needs an accelerator: the marker stands in for it)."""

    def __init__(self, module: nn.Module, **fsdp_kwargs: Any) -> None:
        super().__init__()
        self.torch_unit = module


def torch_unit_paths(model: nn.Module, policy: Any) -> list[str]:
    """The units torch's FSDP makes of ``model`` with ``policy``: its own auto wrap, the function FSDP calls."""
    torch_auto_wrap(model, policy, set(), set(), {"mixed_precision": None}, TorchUnit)
    units = (path for path, m in model.named_modules() if isinstance(m, TorchUnit))
    return sorted(["", *(path.replace(".torch_unit", "") for path in units)])  # the root is always a unit


SIZE_35 = ["", *BLOCK_LINEARS]
SIZE_36 = ["", "blocks.0", "blocks.0.up", "blocks.1", "blocks.1.up"]
LAYER_NORMS = ["", "blocks.0.norm", "blocks.1.norm"]


@pytest.mark.parametrize(
    ("torch_policy", "ours", "expected"),
    [
        (ModuleWrapPolicy({Block}), ({Block}, 0), ["", "blocks.0", "blocks.1"]),
        (functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}), ({Block}, 0),
         ["", "blocks.0", "blocks.1"]),
        # Both count the elements of the parameters not yet in a unit: the same threshold, the same units.
        (functools.partial(size_based_auto_wrap_policy, min_num_params=35), (None, 35), SIZE_35),
        (functools.partial(size_based_auto_wrap_policy, min_num_params=36), (None, 36), SIZE_36),
        (_torch_signature_policy, (_linears_policy, 0), LAYER_NORMS),
        (functools.partial(lambda_auto_wrap_policy, lambda_fn=_layer_norms), (_linears_policy, 0), LAYER_NORMS),
        (CustomPolicy(_layer_norms), (_linears_policy, 0), LAYER_NORMS),
    ],
    ids=["ModuleWrapPolicy", "transformer", "size-35", "size-36", "torch-signature", "lambda", "CustomPolicy"],
)
def test_torch_policies_make_the_units_of_torch_and_of_their_fairscale_equivalent(
    torch_policy: Any, ours: tuple[Any, int], expected: list[str]
) -> None:
    assert torch_unit_paths(Net(), torch_policy) == expected
    assert unit_paths(wrap(Net(), policy=torch_policy, min_num_params=0)) == expected
    assert unit_paths(wrap(Net(), policy=ours[0], min_num_params=ours[1])) == expected


def test_torch_size_policy_keeps_its_defaults_which_are_fairscales() -> None:
    """No ModuleList unit, MultiheadAttention kept whole: torch's size policy has FairScale's defaults."""
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=50)
    expected = ["", "layers.0", "layers.1"]
    assert torch_unit_paths(WithContainers(), policy) == expected
    assert unit_paths(wrap(WithContainers(), policy=policy)) == expected
    assert unit_paths(wrap(WithContainers(), policy=None, min_num_params=50)) == expected


def test_a_custom_policy_with_fsdp_arguments_of_its_own_is_refused() -> None:
    policy = CustomPolicy(lambda m: {"sharding_strategy": "SHARD_GRAD_OP"} if isinstance(m, Block) else False)
    with pytest.raises(ValueError, match=r"gives Block its own FSDP arguments \{'sharding_strategy'.*Return True"):
        wrap(Net(), policy=policy)




@pytest.mark.parametrize(
    ("policy", "exclude", "force_leaf", "expected"),
    [
        # FairScale's defaults for the size policy: no ModuleList unit; MultiheadAttention (288 parameters) is a
        # leaf: neither it nor its out_proj becomes a unit, its parameters go to the root.
        (None, None, None, ["", "layers.0", "layers.1"]),
        # Given controls replace the defaults: the attention is entered (not excluded: it is too large as a whole).
        (None, {nn.MultiheadAttention}, {nn.ModuleList}, ["", "attn.out_proj"]),
        (None, {nn.MultiheadAttention}, set(), ["", "attn.out_proj", "layers.0", "layers.1"]),
    ],
    ids=["defaults", "replaced", "attention-excluded"],
)
def test_size_policy_controls(policy: Any, exclude: Any, force_leaf: Any, expected: list[str]) -> None:
    root = wrap(WithContainers(), policy=policy, min_num_params=50, exclude=exclude, force_leaf=force_leaf)
    assert unit_paths(root) == expected


@pytest.mark.parametrize(
    ("policy", "exclude", "force_leaf", "expected"),
    [
        ({nn.Linear}, None, {Block}, ["", "inp", "out"]),  # not descended into: the blocks' Linears stay in the root
        ({nn.Linear, Block}, {Block}, None, ["", *BLOCK_LINEARS, "inp", "out"]),  # the blocks are never units
        (_linears_policy, None, {nn.Sequential}, [""]),
        ({nn.Linear}, None, None, ["", *BLOCK_LINEARS, "inp", "out"]),  # no defaults for layer classes
        (ModuleWrapPolicy({nn.Linear}), None, {Block}, ["", "inp", "out"]),
        (functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}), {nn.Linear}, None, [""]),
    ],
    ids=[
        "classes-force-leaf", "classes-exclude", "callable-force-leaf", "classes-no-defaults",
        "torch-object-force-leaf", "torch-callable-exclude",
    ],
)
def test_controls_apply_to_the_other_policies(policy: Any, exclude: Any, force_leaf: Any, expected: list[str]) -> None:
    assert unit_paths(wrap(Net(), policy=policy, exclude=exclude, force_leaf=force_leaf)) == expected


@pytest.mark.parametrize(
    ("policy", "min_num_params", "expected"),
    [
        (None, 35, ["", "blocks.0", "blocks.1"]),  # the size policy would wrap up/down inside the blocks
        ({nn.Linear}, 0, ["", "blocks.0", "blocks.1", "inp", "out"]),
        (None, 10**9, ["", "blocks.0", "blocks.1"]),  # own units even when the policy wraps nothing
        (ModuleWrapPolicy({nn.Linear}), 0, ["", "blocks.0", "blocks.1", "inp", "out"]),
        (functools.partial(size_based_auto_wrap_policy, min_num_params=35), 0, ["", "blocks.0", "blocks.1"]),
    ],
)
def test_checkpointed_layers_become_units_of_their_own(policy: Any, min_num_params: int, expected: list[str]) -> None:
    model = Net()
    own = apply_activation_checkpointing(model, (Block,))
    assert own == [model.blocks[0], model.blocks[1]]
    assert unit_paths(wrap(model, policy=policy, min_num_params=min_num_params, own_units=own)) == expected


@pytest.mark.parametrize(
    "policy",
    [
        None, Block, {Block}, [Block, nn.Linear], frozenset({nn.Linear}), _linears_policy, _torch_signature_policy,
        ModuleWrapPolicy({Block}), CustomPolicy(_layer_norms), size_based_auto_wrap_policy,
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        functools.partial(default_auto_wrap_policy, min_num_params=10),
    ],
)
def test_valid_auto_wrap_policies_are_accepted(policy: Any) -> None:
    validate_auto_wrap_policy(policy)


@pytest.mark.parametrize("policy", ["Block", 3, [], (Block, "Linear"), {Block, torch.Tensor}])
def test_invalid_auto_wrap_policies_name_what_is_accepted(policy: Any) -> None:
    with pytest.raises(TypeError, match=r"signature `\(module, recurse, unwrapped_params, module_is_root\) -> bool` or"
                                        r" torch's `\(module, recurse, nonwrapped_numel\)"):
        validate_auto_wrap_policy(policy)


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        (transformer_auto_wrap_policy, "torch's \\(missing a required argument: 'transformer_layer_cls'\\)"),
        (lambda module: True, "unexpected keyword argument 'recurse'"),
        (functools.partial(size_based_auto_wrap_policy, min_num_param=10), "unexpected keyword argument 'min_num_p"),
    ],
    ids=["unbound-transformer", "one-argument", "misspelt-keyword"],
)
def test_a_callable_of_neither_signature_is_refused_with_the_reason(policy: Any, problem: str) -> None:
    with pytest.raises(TypeError, match=f"cannot be called with FairScale's keywords .*{problem}"):
        validate_auto_wrap_policy(policy)


@pytest.mark.parametrize(
    "policy",
    [
        {Block}, Block, [Block], ModuleWrapPolicy({Block}),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    ],
)
def test_checkpointing_policies_that_name_classes_become_those_classes(policy: Any) -> None:
    assert checkpointing_layer_classes(policy) == (Block,)


@pytest.mark.parametrize(
    "policy",
    [
        functools.partial(size_based_auto_wrap_policy, min_num_params=10), CustomPolicy(_layer_norms),
        _torch_signature_policy, transformer_auto_wrap_policy, "Block",
    ],
)
def test_checkpointing_policies_that_select_otherwise_say_to_pass_classes(policy: Any) -> None:
    with pytest.raises(TypeError, match="`activation_checkpointing_policy` must name the classes.*pass the classes"):
        checkpointing_layer_classes(policy)


def test_validate_layer_classes_returns_a_tuple_or_names_the_argument() -> None:
    assert validate_layer_classes(None, "x") == ()
    assert validate_layer_classes(Block, "x") == (Block,)
    assert set(validate_layer_classes({Block, nn.Linear}, "x")) == {Block, nn.Linear}
    assert validate_layer_classes([nn.Linear, Block], "x") == (nn.Linear, Block)
    with pytest.raises(TypeError, match=r"`force_leaf_modules` must be .*force_leaf_modules=MyTransformerBlock"):
        validate_layer_classes(nn.Linear(2, 2), "force_leaf_modules")  # an instance, not a class
    with pytest.raises(TypeError, match="`exclude_wrap_modules` must be"):
        validate_layer_classes(iter([Block]), "exclude_wrap_modules")


def test_clean_path_gives_the_unwrapped_names() -> None:
    expected = [name for name, _ in Net().named_parameters()]  # unflattened: the wrapped names keep the originals
    root = wrap(Net(), policy={Block}, flatten=False)
    assert [clean_path(name) for name, _ in root.named_parameters()] == expected
    assert clean_path("_fsdp_wrapped_module._fpw_module.blocks.0._fsdp_wrapped_module._fpw_module.up.weight") == (
        "blocks.0.up.weight"
    )
    assert clean_path("blocks.0.up.weight") == "blocks.0.up.weight"


class Aliased(Net):
    """The first block is also an attribute of its own, as in the documentation's manual-wrap example."""

    def __init__(self) -> None:
        super().__init__()
        self.first = self.blocks[0]


def test_state_aliases_name_every_path_of_a_shared_layer() -> None:
    aliases = state_aliases(Aliased())
    assert ("blocks.0.", "first.") in aliases and ("first.", "blocks.0.") in aliases
    assert all(known != alias for known, alias in aliases)
    # The block and its layers have two names each; every other module has one.
    shared = {prefix + child for prefix in ("blocks.0.", "first.") for child in ("", "norm.", "up.", "down.")}
    assert {known for known, _ in aliases} == shared
    plain = Aliased().state_dict()
    partial = {k: v for k, v in plain.items() if not k.startswith("first.")}
    assert apply_aliases(dict(partial), aliases).keys() == plain.keys()


def test_aliases_of_a_wrapped_module_restore_the_plain_state_dict_keys() -> None:
    model = Aliased()
    plain = copy.deepcopy(model).state_dict()
    root = wrap(model, policy={Block})
    full = add_aliases(root.state_dict(), root)
    assert sorted(full) == sorted(plain)
    for key, value in plain.items():
        assert torch.equal(full[key], value), key


def test_activation_checkpointing_recomputes_in_backward_and_is_removable() -> None:
    model, reference = Net(), Net()
    calls: list[int] = []
    model.blocks[0].up.register_forward_hook(lambda *args: calls.append(1))
    checkpointed = apply_activation_checkpointing(model, (Block,))
    assert apply_activation_checkpointing(model, (Block,)) == []  # already checkpointed: not wrapped twice
    x, y = batches(1)[0]
    for m in (model, reference):
        nn.functional.mse_loss(m(x), y).backward()
    assert len(calls) == 2, "the checkpointed block should run its forward again in backward"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert checkpointed == list(model.blocks)
    remove_activation_checkpointing(model)
    assert all("forward" not in block.__dict__ for block in model.blocks)
    calls.clear()
    nn.functional.mse_loss(model(x), y).backward()
    assert len(calls) == 1


def test_activation_checkpointing_refuses_a_layer_that_contains_units() -> None:
    model = Net()
    model.blocks[0].up = wrap(model.blocks[0].up)
    with pytest.raises(ValueError, match="Block, but an instance of it contains FSDP units.*wrap the Block instance"):
        apply_activation_checkpointing(model, (Block,))


@pytest.mark.parametrize(
    ("policy", "flatten", "frozen"),
    [
        (None, True, None),
        (None, False, "blocks.1"),
        ({Block}, True, "blocks.1"),  # a whole unit frozen
        ({nn.Linear}, True, "blocks.0.up"),
        ({Block}, False, "blocks.1.norm"),
    ],
)
def test_wrap_then_unwrap_gives_the_module_its_parameters_back(policy: Any, flatten: bool, frozen: Any) -> None:
    model = Net()
    if frozen:
        model.get_submodule(frozen).requires_grad_(False)
    before = {name: (p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()}
    blocks = list(model.blocks)
    root = wrap(model, policy=policy, flatten=flatten)
    assert is_wrapped(root)
    back = unwrap_module(root)
    assert back is model and not is_wrapped(back)
    assert list(back.blocks) == blocks  # the same submodule objects
    after = dict(back.named_parameters())
    assert sorted(after) == sorted(before)
    for name, (value, requires_grad) in before.items():
        assert type(after[name]) is nn.Parameter, name
        assert torch.equal(after[name], value), name
        assert after[name].requires_grad == requires_grad, name
        assert not hasattr(after[name], "_is_sharded"), name


@pytest.mark.parametrize("flatten", [True, False])
def test_unwrapped_module_after_training_equals_plain_training(flatten: bool) -> None:
    model, reference = Net(), Net()
    plain_optimizer = OPTIMIZERS["adam"](reference.parameters())
    sharded = shard(model, OPTIMIZERS["adam"](model.parameters()), policy={Block}, flatten=flatten)
    for batch in batches(3):
        step(sharded.root, sharded.optimizer, batch)
        step(reference, plain_optimizer, batch)
    back = unwrap_module(sharded.root)
    expected = parameters_of(reference)
    for name, value in back.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=0, atol=1e-6, msg=name)
    assert max((value - Net().state_dict()[name]).abs().max() for name, value in expected.items()) > 1e-3


@pytest.mark.parametrize(("policy", "flatten"), [({Block}, True), ({Block}, False), (None, False)])
def test_a_rank_that_keeps_nothing_gets_meta_parameters(policy: Any, flatten: bool) -> None:
    """``keep=False`` (``unshard_module(rank_zero_only=True)`` on ranks > 0): parameters of every shape on ``meta``,
    flattened or not (torch refuses ``param.data = <meta tensor>``, so unflattened parameters are replaced)."""
    model = Net()
    tied = policy is None  # one unit: a parameter shared by two layers stays shared
    if tied:
        model.blocks[1].down.weight = model.blocks[0].down.weight
    shapes = {name: (p.shape, p.requires_grad) for name, p in model.named_parameters()}
    back = unwrap_module(wrap(model, policy=policy, flatten=flatten), keep=False)
    assert back is model and not is_wrapped(back)
    after = dict(back.named_parameters())
    assert {name: (p.shape, p.requires_grad) for name, p in after.items()} == shapes
    assert all(p.device.type == "meta" and type(p) is nn.Parameter for p in after.values())
    assert (back.blocks[1].down.weight is back.blocks[0].down.weight) == tied


def test_tied_weights_stay_tied_through_wrap_and_unwrap() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    before = model.embed.weight.detach().clone()
    back = unwrap_module(wrap(model))
    assert back.head.weight is back.embed.weight
    assert torch.equal(back.embed.weight, before)


def test_a_unit_flattens_frozen_and_trainable_parameters_together_and_records_which_were_frozen() -> None:
    model = Net()
    model.inp.weight.requires_grad_(False)
    for block in model.blocks:
        block.requires_grad_(False)
    original = model.inp.weight
    root = wrap(model, policy={Block})
    flat = {path: unit.params[0] for path, unit in unit_paths_and_units(root)}
    records = {path: unit_state.peek_flat(unit, unit.params[0]) for path, unit in unit_paths_and_units(root)}
    assert flat[""].requires_grad and frozen_pieces(records[""]) == [True, False, False, False]
    assert not flat["blocks.0"].requires_grad and frozen_pieces(records["blocks.0"]) is None
    assert not original.requires_grad  # the user's parameter object keeps its flag
    back = unwrap_module(root)
    assert [n for n, p in back.named_parameters() if not p.requires_grad] == [
        "inp.weight", *[n for n, _ in back.named_parameters() if n.startswith("blocks.")]
    ]


def unit_paths_and_units(root: nn.Module) -> list[tuple[str, Any]]:
    from lightning_fairscale.fsdp.unit.units import named_fsdp_instances

    return [(clean_path(path + ".").rstrip("."), unit) for path, unit in named_fsdp_instances(root)]


def test_unwrap_of_a_plain_module_returns_it_unchanged() -> None:
    model = Net()
    before = parameters_of(model)
    assert unwrap_module(model) is model
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
