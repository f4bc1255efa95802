"""fsdp/patches/cpu_streams.py, bucketing.py, grad_norm.py and the grad scaler on one rank: the CPU patches, the
bucketers, global-norm clipping and the sharded grad scaler.

(Their behaviour across ranks is in test_multirank.py.)
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.internal import reduce_scatter_bucketer as fairscale_bucketer
from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module
from torch import nn

from lightning_fairscale.fsdp.patches import cpu_streams, prefetch
from lightning_fairscale.fsdp.unit import units as fsdp_units
from lightning_fairscale.fsdp.patches.bucketing import GlooReduceScatterBucketer, ReduceScatterBucketer
from lightning_fairscale.fsdp.patches.prefetch import Prefetcher
from lightning_fairscale.fsdp.patches.reduce_scatter import AsyncReduceScatter
from lightning_fairscale.fsdp.patches.grad_norm import clip_grad_norm_, global_grad_norm
from lightning_fairscale.mixed_precision.grad_scaler import ShardedGradScaler

from .helpers import (
    Block, Net, assert_tensors_equal, batches, mixed_precision_reference, parameters_of, shard, step, wrap
)

pytestmark = [
    pytest.mark.usefixtures("process_group"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),  # inside FairScale's bucketer
]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are not installed where CUDA is")


@no_cuda
@pytest.mark.workaround(1)
def test_install_gives_fsdp_a_torch_whose_streams_do_nothing() -> None:
    patched = fsdp_module.torch
    cpu_streams.install()  # idempotent
    assert cpu_streams.is_installed() and fsdp_module.torch is patched
    stream = patched.cuda.current_stream()
    assert stream.device == torch.device("cpu") and patched.cuda.Stream() is stream
    stream.wait_stream(stream)
    stream.synchronize()
    with patched.cuda.stream(stream):
        patched.cuda.synchronize()
    # Everything else is the real torch, and only FairScale's FSDP module sees the patched one.
    assert patched.float32 is torch.float32 and patched.cuda.is_available is torch.cuda.is_available
    assert torch.cuda.current_stream is not patched.cuda.current_stream
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_stream()


@no_cuda
@pytest.mark.workaround(2)
def test_record_stream_on_a_cpu_tensor_does_nothing() -> None:
    tensor = torch.arange(4.0)
    assert tensor.record_stream(fsdp_module.torch.cuda.current_stream()) is None
    assert torch.equal(tensor, torch.arange(4.0))


@pytest.mark.workaround(16)
def test_fsdp_on_cpu_gloo_shares_one_async_reducer_and_one_prefetcher() -> None:
    root = wrap(Net(), policy={Block})
    step(root, torch.optim.SGD(root.parameters(), lr=0.1), batches(1)[0])
    units = [m for m in root.modules() if isinstance(m, fsdp_units.FullyShardedDataParallel)]
    assert len(units) == 3
    assert type(root._reducer) is AsyncReduceScatter and type(root._prefetcher) is Prefetcher
    assert all(unit._reducer is root._reducer and unit._prefetcher is root._prefetcher for unit in units)
    assert root._prefetcher.order == units  # the forward order: the root, then the blocks


def test_each_forward_runs_fairscales_lazy_initialisation_once_per_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our forward initialises lazily only while the root is undecided: FairScale's forward does it anyway, and each
    of the root's runs walks the whole model (``_cast_buffers``)."""
    root = wrap(Net(), policy={Block})
    blocks = [m for m in root.modules() if isinstance(m, fsdp_units.FullyShardedDataParallel) and m is not root]
    calls: list[Any] = []
    lazy_init = fsdp_module.FullyShardedDataParallel._lazy_init

    def counted(self: Any) -> None:
        calls.append(self)
        lazy_init(self)

    monkeypatch.setattr(fsdp_module.FullyShardedDataParallel, "_lazy_init", counted)
    x = batches(1)[0][0]
    root(x)
    assert calls == [root, root, *blocks]  # ours decides the root and its prefetcher, then FairScale's forwards
    calls.clear()
    root(x).sum().backward()
    assert calls == [root, *blocks]  # FairScale's forwards only


@pytest.mark.workaround(3)
def test_fsdp_on_gloo_without_overlap_uses_one_shared_gloo_bucketer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "OVERLAP_ON_CPU", False)
    root = wrap(Net(), policy={Block})
    step(root, torch.optim.SGD(root.parameters(), lr=0.1), batches(1)[0])
    units = [m for m in root.modules() if isinstance(m, fsdp_units.FullyShardedDataParallel)]
    assert type(root._reducer) is GlooReduceScatterBucketer and root._prefetcher is None
    assert all(unit._reducer is root._reducer and unit._prefetcher is None for unit in units)


@pytest.mark.workaround(3)
def test_gloo_bucketer_equals_a_plain_reduce_scatter_on_one_rank() -> None:
    bucketer, results = GlooReduceScatterBucketer(bucket_cap_mb=1), []
    small, large = torch.randn(5), torch.randn(300_000)  # the large one does not fit a 1 MB bucket: sent at once
    for tensor in (small, large, 2 * small):
        bucketer.reduce_scatter_async([tensor], group=dist.group.WORLD, callback_fn=results.append)
    assert len(results) == 1  # only the large one so far; the small ones wait in the bucket
    bucketer.flush()
    expected = []
    for tensor in (large, small, 2 * small):
        out = torch.empty_like(tensor)
        dist.reduce_scatter_tensor(out, tensor)
        expected.append(out)
    assert [r.shape for r in results] == [e.shape for e in expected]
    assert all(torch.equal(r, e) for r, e in zip(results, expected))


@pytest.mark.workaround(3)
def test_fairscales_bucketer_fails_on_gloo_where_ours_works() -> None:
    """Why GlooReduceScatterBucketer exists: gloo refuses FairScale's 2-d bucket input."""
    tensor = torch.randn(5)
    fairscale = fairscale_bucketer.ReduceScatterBucketer(bucket_cap_mb=1)
    try:
        fairscale.reduce_scatter_async([tensor], group=dist.group.WORLD)
        with pytest.raises(RuntimeError, match="(?i)shape"):  # gloo: outputShape[0] * worldSize == inputShape[0]
            fairscale.flush()
    finally:
        fairscale_bucketer.ReduceScatterBucketer._get_shard_size.cache_clear()


@pytest.mark.parametrize("bucketer", [ReduceScatterBucketer, GlooReduceScatterBucketer])
@pytest.mark.workaround(9)
def test_our_bucketers_are_freed_with_their_last_reference(bucketer: type) -> None:
    ours = bucketer(bucket_cap_mb=1)
    assert ours._get_shard_size(4, 2) == 2**20 // 4 // 2
    alive = weakref.ref(ours)
    del ours
    assert alive() is None, "something (FairScale's lru_cache) still holds the bucketer and its buffers"


def test_fairscales_bucketer_is_kept_alive_by_its_cache() -> None:
    """The leak our bucketers avoid, shown on FairScale's class."""
    theirs = fairscale_bucketer.ReduceScatterBucketer(bucket_cap_mb=1)
    theirs._get_shard_size(4, 2)
    alive = weakref.ref(theirs)
    del theirs
    try:
        assert alive() is not None
    finally:
        fairscale_bucketer.ReduceScatterBucketer._get_shard_size.cache_clear()


@pytest.mark.parametrize(("cap", "element_size", "shards"), [(25, 4, 2), (1, 2, 3), (3, 8, 7), (0, 4, 2), (-1, 4, 2)])
@pytest.mark.workaround(9)
def test_shard_sizes_are_fairscales(cap: int, element_size: int, shards: int) -> None:
    theirs = fairscale_bucketer.ReduceScatterBucketer(cap)
    try:
        assert ReduceScatterBucketer(cap)._get_shard_size(element_size, shards) == theirs._get_shard_size(
            element_size, shards
        )
    finally:
        fairscale_bucketer.ReduceScatterBucketer._get_shard_size.cache_clear()


def gradients(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in [(3, 4), (5,), (2, 2, 2)]]


def with_grads(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 1e4], ids=["clipped", "unclipped"])
@pytest.mark.workaround(4)
def test_clip_grad_norm_equals_torchs(norm_type: float, max_norm: float) -> None:
    grads = gradients()
    ours, theirs = with_grads(grads), with_grads(grads)
    ours.append(nn.Parameter(torch.ones(2)))  # no gradient: left out, as torch does
    total = clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(global_grad_norm(with_grads(grads), norm_type), expected, rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    changed = any(not torch.equal(p.grad, g) for p, g in zip(theirs, grads))
    assert changed == (max_norm == 0.1)


@pytest.mark.workaround(4)
def test_global_grad_norm_of_nothing_is_zero() -> None:
    assert global_grad_norm([], 2.0).item() == 0.0
    assert global_grad_norm([], math.inf).item() == 0.0


@pytest.mark.workaround(4)
def test_fsdp_clip_grad_norm_on_cpu_equals_torch_on_the_plain_model() -> None:
    model, reference = Net(), Net()
    root = wrap(model, policy={Block})
    x, y = batches(1)[0]
    for m in (root, reference):
        nn.functional.mse_loss(m(x), y).backward()
    total = root.clip_grad_norm_(0.05)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    assert expected > 0.05
    flat = torch.cat([p.grad.reshape(-1) for p in root.parameters()])
    torch.testing.assert_close(flat.norm(), torch.tensor(0.05), rtol=1e-4, atol=0)


def scaled_steps(scaler: Any, poison: list[bool]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Steps with loss scaling; where ``poison`` says so, one gradient is inf. The parameters and scales after."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for batch, bad in zip(batches(len(poison)), poison):
        x, y = batch
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if bad:
            model.out.bias.grad[0] = math.inf
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return parameters_of(model), scales


@pytest.mark.workaround(5)
def test_sharded_grad_scaler_on_one_rank_equals_torchs_grad_scaler() -> None:
    poison = [False, True, False, True, True]
    ours = scaled_steps(ShardedGradScaler(device="cpu", init_scale=2.0**8), poison)
    theirs = scaled_steps(torch.amp.GradScaler("cpu", init_scale=2.0**8), poison)
    assert ours[1] == theirs[1] == [2.0**8, 2.0**7, 2.0**7, 2.0**6, 2.0**5]
    for name, value in theirs[0].items():
        assert torch.equal(ours[0][name], value), name


def test_sharded_grad_scaler_disabled_does_not_scale() -> None:
    scaler = ShardedGradScaler(device="cpu", enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    params, _ = scaled_steps(scaler, [False])
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer, batches(1)[0])
    assert all(torch.equal(params[n], v) for n, v in parameters_of(model).items())


@pytest.mark.workaround(6)
def test_bf16_compute_really_computes_in_bf16() -> None:
    """FairScale casts the root's float32 inputs to fp16 whatever compute_dtype is; ours casts to compute_dtype."""
    root = wrap(Net(), policy={Block}, mixed_precision=True, compute_dtype=torch.bfloat16)
    x = batches(1)[0][0]
    out = root(x)
    assert out.dtype == torch.bfloat16
    reference = Net().to(torch.bfloat16)
    torch.testing.assert_close(out, reference(x.to(torch.bfloat16)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.workaround(21)
def test_mixed_precision_on_one_rank_trains_the_fp32_parameters_with_fp32_gradients(dtype: torch.dtype) -> None:
    """Workaround 21: on one rank FairScale left the flat parameter's gradient in the compute dtype, which the
    optimizer's fp32 views refused at the first backward. The steps equal a half copy's gradients applied in fp32."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = shard(model, optimizer, {Block}, mixed_precision=True, compute_dtype=dtype)
    for x, y in batches(3):
        nn.functional.mse_loss(sharded.root(x).float(), y).backward()
        grads = [p.grad for group in sharded.optimizer.param_groups for p in group["params"]]
        assert {g.dtype for g in grads if g is not None} == {torch.float32}
        sharded.optimizer.step()
        sharded.optimizer.zero_grad()
    assert_tensors_equal(sharded.root.state_dict(), mixed_precision_reference(dtype, 3), atol=0)


@pytest.mark.parametrize("no_sync", [False, True], ids=["sync-each-batch", "no-sync"])
@pytest.mark.workaround(21)
def test_mixed_precision_on_one_rank_accumulates(no_sync: bool) -> None:
    """Workaround 21 with accumulation: reducing every micro-batch (``sync_each_batch=True``), the second backward
    adds its half gradient to the fp32 one the first left; in ``no_sync`` (Lightning's default), the half gradients
    add up in the compute dtype, and the next forward computes with the half parameters again (FairScale had freed
    them). Either way, as unsharded mixed precision sums them."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = shard(model, optimizer, {Block}, mixed_precision=True, compute_dtype=torch.bfloat16)
    for index, (x, y) in enumerate(batches(4)):
        accumulating = no_sync and not index % 2
        with sharded.root.no_sync() if accumulating else contextlib.nullcontext():
            nn.functional.mse_loss(sharded.root(x).float(), y).backward()
        if index % 2:
            sharded.optimizer.step()
            sharded.optimizer.zero_grad()
    expected = mixed_precision_reference(torch.bfloat16, 2, accumulate=2, sum_in_half=no_sync)
    assert_tensors_equal(sharded.root.state_dict(), expected, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fairscale_alone_refuses_a_model_held_in_bf16(dtype: torch.dtype) -> None:
    """Why workaround 13 exists: FairScale's constructor accepts pure fp16 parameters only, and fp32 ones."""
    kwargs = dict(process_group=dist.group.WORLD, compute_device=torch.device("cpu"), compute_dtype=dtype)
    if dtype is torch.bfloat16:
        with pytest.raises(ValueError, match="Expecting FP16 param type in FP32 & MP modes"):
            fsdp_module.FullyShardedDataParallel(Net().to(dtype), **kwargs)
    with pytest.raises(ValueError, match="Expecting FP16 param type in pure FP16 mode"):
        fsdp_module.FullyShardedDataParallel(Net(), **{**kwargs, "compute_dtype": torch.float16})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("built_in", ["half", "fp32"], ids=["converted-before", "fp32-model"])
@pytest.mark.parametrize("flatten", [False, True], ids=["unflattened", "flattened"])
@pytest.mark.workaround(13)
def test_a_true_half_precision_unit_holds_and_computes_in_its_dtype(
    dtype: torch.dtype, built_in: str, flatten: bool
) -> None:
    """Workaround 13: units made without mixed precision and a half compute_dtype hold everything in it, and train as
    the plain model in that dtype: exactly on one rank (nothing is reduced), except that the weight gradient of a view
    into a flat parameter is computed in another order (within 3 units in the last place of a tensor's largest
    values: measured 0.7 for bf16, 2.2 for fp16)."""
    model = Net().to(dtype) if built_in == "half" else Net()
    originals = list(model.parameters())
    root = wrap(model, policy={Block}, flatten=flatten, mixed_precision=False, compute_dtype=dtype)
    units = list(fsdp_units.fsdp_instances(root))
    assert len(units) == 3 and all((u.compute_dtype, u.buffer_dtype) == (dtype, dtype) for u in units)
    assert {p.dtype for p in root.parameters()} == {p.dtype for p in originals} == {dtype}  # no FP32 left behind
    reference = Net().to(dtype)
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch in batches(2):
        x, y = (t.to(dtype) for t in batch)
        assert root(x).dtype == dtype
        for m, o in ((root, optimizer), (reference, plain)):
            nn.functional.mse_loss(m(x), y).backward()
            assert all(p.grad.dtype == dtype for p in m.parameters())
            o.step()
            o.zero_grad()
    assert {v.dtype for state in optimizer.state.values() for v in state.values()} == {dtype}
    state_dict = root.state_dict()
    for name, value in reference.state_dict().items():
        assert state_dict[name].dtype == dtype
        tolerance = 3 * torch.finfo(dtype).eps * value.abs().max().item() if flatten else 0.0
        torch.testing.assert_close(state_dict[name], value, rtol=0, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clipping_half_gradients_takes_the_norm_in_fp32(dtype: torch.dtype) -> None:
    """The squares of these fp16 gradients (1e6) overflow fp16, and a bf16 sum of 256 of them would lose the last
    ones (bf16 has 8 significant bits): the norm is accumulated in FP32, as torch does, and the gradients are scaled
    in their dtype."""
    params = with_grads([torch.full((256,), 1000.0, dtype=dtype)])
    total = clip_grad_norm_(params, max_norm=16.0, norm_type=2.0)
    assert total.dtype == torch.float32 and total.item() == 16000.0  # 1000 * sqrt(256)
    assert params[0].grad.dtype == dtype
    torch.testing.assert_close(params[0].grad, torch.full((256,), 1.0, dtype=dtype), rtol=2e-3, atol=0)
