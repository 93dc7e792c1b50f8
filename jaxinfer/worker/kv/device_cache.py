"""The device-side KV cache: per layer one K and one V array in the head-major paged layout
[num_kv_heads, num_blocks, block_size, head_dim] (see pallas_kernels/attention/reference.py for why)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.transformer import KVCache


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: jnp.dtype = jnp.bfloat16, *, num_heads: int | None = None,
                      sharding: jax.sharding.Sharding | None = None,
                      num_slots: int | None = None) -> KVCache:
    """Zeroed cache; under tensor parallelism `num_heads` and `sharding` come from the replica's
    ShardingPlan (stored_kv_heads, kv_cache), so each device allocates only its heads.
    `num_slots`: how many K/V array pairs (KVCacheGroups.num_slots; None: one per layer)."""
    k_shape, v_shape = kv_block_shapes(cfg, num_heads or cfg.num_kv_heads, num_blocks, block_size)
    return tuple((jnp.zeros(k_shape, dtype, device=sharding),
                  jnp.zeros(v_shape, dtype, device=sharding))
                 for _ in range(num_slots or cfg.num_layers))


def kv_block_shapes(cfg: ModelConfig, heads: int, num_blocks: int,
                    block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One layer's K and V cache shapes; an MLA model's V is empty (its K is the latent cache:
    ModelConfig.kv_widths)."""
    k_width, v_width = cfg.kv_widths
    return ((heads, num_blocks, block_size, k_width), (heads, num_blocks, block_size, v_width))



# The cache is donated, so XLA updates the copied blocks in place instead of copying the cache.
@functools.partial(jax.jit, donate_argnums=0)
def copy_blocks(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy whole blocks src[i] -> dst[i] in every layer's K and V (copy-on-write after a fork).

    src, dst: int32[N], from KVCacheManager.take_pending_copies(); pad both to a fixed N (a bucket)
    with dst = -1, which is skipped, to avoid one compilation per count. Destinations must be
    distinct. All reads happen before all writes (a gather, then a scatter), so a block that is
    both a destination and a source in one call is read with its old content."""
    num_blocks = kv_cache[0][0].shape[1]
    dst = jnp.where(dst < 0, num_blocks, dst)  # out of range -> dropped by the scatter
    src = jnp.clip(src, 0, num_blocks - 1)

    def copy(cache: jax.Array) -> jax.Array:
        return cache.at[:, dst].set(cache[:, src], mode="drop")

    return tuple((copy(k), copy(v)) for k, v in kv_cache)
