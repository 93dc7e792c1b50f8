"""Whole KV blocks as the rows of one array, for the copies between caches: the host tier's pieces
(worker/kv/host_store.py) and the disaggregated hand-over (disagg/transfer.py).

Row i is block ids[i] of every layer, `[n, layers, heads, block_size, k_width + v_width]`: each
layer's K and V side by side on the last axis, so a page whose K and V differ in width travels
like any other (the MLA latent: K 576 wide, V empty; `KVCacheSpec.stored_widths`). The head axis
(2) keeps the cache's sharding under tensor parallelism. Here in model/ beside kv_specs.py for the
same reason: disagg/ sits below worker/ and core/ and may not import them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.model.transformer import KVCache


def gather_rows(kv_cache: KVCache, ids: jax.Array) -> jax.Array:
    """Blocks `ids` of every layer, one row per block (trace under jit)."""
    layers = [jnp.concatenate((k[:, ids], v[:, ids]), axis=-1) for k, v in kv_cache]
    return jnp.moveaxis(jnp.stack(layers), 2, 0)  # [layers, heads, n, ...] -> [n, layers, ...]


def scatter_rows(kv_cache: KVCache, rows: jax.Array, ids: jax.Array) -> KVCache:
    """Row i of `rows` into block ids[i] of every layer; ids[i] < 0: nowhere (a row not needed, or
    padding). Such rows go to distinct out-of-range blocks (dropped), so the indices stay unique
    and XLA may write the blocks in parallel. Donate the cache where it is jitted."""
    stacked = jnp.moveaxis(rows, 0, 2)  # [layers, heads, n, block_size, width]
    num_blocks, k_width = kv_cache[0][0].shape[1], kv_cache[0][0].shape[-1]
    dst = jnp.where(ids < 0, num_blocks + jnp.arange(ids.shape[0]), ids)
    return tuple((k.at[:, dst].set(stacked[i, ..., :k_width], mode="drop", unique_indices=True),
                  v.at[:, dst].set(stacked[i, ..., k_width:], mode="drop", unique_indices=True))
                 for i, (k, v) in enumerate(kv_cache))


def row_bytes(kv_cache: KVCache) -> int:
    """Bytes of one row: one block of every layer's K and V."""
    return sum(k.nbytes + v.nbytes for k, v in kv_cache) // kv_cache[0][0].shape[1]
