"""Moving whole KV blocks from the prefill engine's cache to the decode engine's, device to device.

A transfer is three dispatches, none of which waits:
1. `gather` on the prefill devices: the request's blocks of every layer's K and V into one buffer
   of a row per block (model/kv_block_rows.py; heads sharded like the cache), whatever the K and
   V widths (the MLA latent's V is empty);
2. `jax.device_put` of that buffer onto the decode devices (NVLink between GPUs of one host), which
   runs beside the prefill engine's next step;
3. once the copy has landed, `scatter` into the decode cache: a jitted update with the cache
   donated, so XLA writes the blocks in place.
Block counts are padded to powers of two (gather pads with block 0, scatter drops the padding), so
a handful of shapes cover every request; `warmup` compiles them all.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import ConfigError
from jaxinfer.model.kv_block_rows import gather_rows, scatter_rows
from jaxinfer.parallel.sharding import TP, ShardingPlan


def block_bucket(n: int) -> int:
    """The padded block count of a transfer of n blocks: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def _jitted(src: ShardingPlan, dst: ShardingPlan):
    """gather on the source mesh, scatter on the destination's (cache donated), and the buffer's
    sharding on the destination; cached per pair of plans, like the runner's steps."""
    buffer_spec = P(None, None, TP)  # the rows' head axis
    gather = jax.jit(gather_rows, out_shardings=src.named(buffer_spec))
    scatter = jax.jit(scatter_rows, donate_argnums=0, out_shardings=dst.kv_cache)
    return gather, scatter, dst.named(buffer_spec)


class KVTransfer:
    """Block transfers from one engine's KV cache (`src` plan) to another's (`dst` plan)."""

    def __init__(self, src: ShardingPlan, dst: ShardingPlan, max_blocks: int):
        if src.stored_kv_heads != dst.stored_kv_heads:
            raise ConfigError(
                f"--decode-tensor-parallel-size {dst.tp}: the decode cache would store "
                f"{dst.stored_kv_heads} KV heads and the prefill cache {src.stored_kv_heads} "
                f"(--prefill-tensor-parallel-size {src.tp}); both must store the same heads")
        self.max_blocks = max_blocks
        self._gather, self._scatter, self._dst_sharding = _jitted(src, dst)

    @staticmethod
    def _padded(ids: list[int], fill: int) -> np.ndarray:
        out = np.full(block_bucket(len(ids)), fill, np.int32)
        out[:len(ids)] = ids
        return out

    def send(self, src_cache, block_ids: list[int]) -> jax.Array:
        """Gather `block_ids` of the source cache and start their copy to the destination devices.
        Returns the destination buffer (ready when the copy has landed: `is_ready()`)."""
        gathered = self._gather(src_cache, self._padded(block_ids, 0))
        return jax.device_put(gathered, self._dst_sharding)

    def receive(self, dst_cache, buffer: jax.Array, block_ids: list[int]):
        """Write a landed buffer's first len(block_ids) blocks into `block_ids` of the destination
        cache (donated): the updated cache."""
        return self._scatter(dst_cache, buffer, self._padded(block_ids, -1))

    def warmup(self, src_cache, dst_cache):
        """Compile and run every bucket once (all-padding scatters write nothing): the updated
        destination cache."""
        n = 1
        while True:
            buffer = self.send(src_cache, [0] * n)
            dst_cache = jax.block_until_ready(self.receive(dst_cache, buffer, [-1] * n))
            if n >= self.max_blocks:
                return dst_cache
            n *= 2
