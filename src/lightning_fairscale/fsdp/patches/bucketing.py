"""FairScale's reduce-scatter bucketer, without its leak (workaround 9 of
:mod:`lightning_fairscale.fsdp.patches.workarounds`) and with gloo-compatible input shapes (workaround 3)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fairscale.distributed import collectives
from lightning_fairscale.distributed.fairscale_private import reduce_scatter_bucketer as _rs_bucketer

__all__ = [
    "GlooReduceScatterBucketer",
    "ReduceScatterBucketer",
]


class ReduceScatterBucketer(_rs_bucketer.ReduceScatterBucketer):
    """FairScale's reduce-scatter bucketer, without the cache that keeps every instance alive (workaround 9)."""

    def _get_shard_size(self, element_size: int, num_shards: int) -> int:
        if self.bucket_cap_mb <= 0:  # bucketing disabled
            return 0
        elements_per_bucket = self.bucket_cap_mb * 2**20 / element_size
        return int(elements_per_bucket // num_shards)


class GlooReduceScatterBucketer(ReduceScatterBucketer):
    """The reduce-scatter bucketer with gloo-compatible input shapes (workaround 3)."""

    def _get_bucket(self, tensor: Tensor, group: ProcessGroup) -> _rs_bucketer.Bucket:
        key = (tensor.dtype, tensor.device, group)
        if key not in self.buckets:
            world_size = group.size()
            shard_size = self._get_shard_size(tensor.element_size(), world_size)
            data = tensor.new_zeros((world_size, shard_size))
            self.buckets[key] = _GlooBucket(data, group)
        self.buckets[key].setup()
        return self.buckets[key]


class _GlooBucket(_rs_bucketer.Bucket):
    """A bucket whose flush hands gloo a 1-D input of ``world_size * n`` elements."""

    # Set by FairScale's ``Bucket.__init__`` (untyped): the filled columns of ``data``, and the reduced shard.
    offset: int
    output_shard: Tensor

    def flush(self) -> None:
        if self.offset == 0:
            return
        # Row r of ``data`` holds the chunk destined for rank r, so the row-major 1-D view is exactly the
        # concatenation of chunks that ``_reduce_scatter_base`` expects.
        flat_input = self.data[:, : self.offset].contiguous().view(-1)
        collectives.reduce_scatter_tensor(self.output_shard[: self.offset], flat_input, group=self.group)
        for callback_fn in self.callbacks:
            callback_fn()
        self.data[:, : self.offset].zero_()
        self.offset = 0
        self.callbacks.clear()
        self.output_shard = torch.zeros_like(self.data[0])
