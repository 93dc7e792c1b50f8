"""Paged decode over an MLA latent cache in pure jnp: the reference a latent decode kernel is
tested against, and what MLA decode runs until one exists (jaxinfer/model/mla.py).

The cache is one "KV head" [1, NB, B, W] (W = kv_lora_rank + rope dim = 576 for DeepSeek) that
is both the keys and, in its first kv_lora_rank columns, the values (docs/MLA.md). So each
sequence's pages are gathered once, in the cache dtype (an fp8 cache widened to q's), for every
query head:

    scores[s, h, l] = scale * q[s, h] . latent[s, l]          (f32 accumulation)
    out[s, h]       = sum_l softmax(scores)[s, h, l] * latent[s, l]

(the generic reference gathers keys and values separately, in float32, a query chunk at a time).
The output keeps all W columns, like the generic backend's, so it concatenates with prefill rows;
the model keeps the first kv_lora_rank.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.attention.backend import REFERENCE
from pallas_kernels.attention.reference import masked_softmax_rows


def paged_latent_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                        block_tables: jax.Array, seq_lens: jax.Array, *, scale: float,
                        softcap: float | None = None, window: int | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:
    """The backend `decode` signature; q [S, H, W], k_cache = v_cache = the latent cache
    [1, NB, B, W]; seq_lens == 0 gives zeros. No soft-cap, window or sinks (MLA has none)."""
    if softcap or window is not None or sinks is not None:
        raise ValueError("the latent decode has no soft-cap, window or sinks")
    if k_cache.shape[0] != 1 or v_cache is not k_cache and v_cache.shape != k_cache.shape:
        raise ValueError(f"expected one latent head as both K and V, got {k_cache.shape} and "
                         f"{v_cache.shape}")
    s, m = block_tables.shape
    _, _, bs, w = k_cache.shape
    ctx = k_cache[0][block_tables].reshape(s, m * bs, w)  # [S, L, W], gathered once
    if ctx.dtype.itemsize < jnp.dtype(q.dtype).itemsize:  # an fp8 cache: widened (exactly)
        ctx = ctx.astype(q.dtype)
    scores = jnp.einsum("shw,slw->shl", q.astype(ctx.dtype), ctx,
                        preferred_element_type=jnp.float32) * scale
    valid = (jnp.arange(m * bs)[None, :] < seq_lens[:, None])[:, None, :]
    p = masked_softmax_rows(scores, valid, None)
    out = jnp.einsum("shl,slw->shw", p.astype(ctx.dtype), ctx, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


# The reference backend with the latent decode (prefill: the generic ragged reference).
LATENT_REFERENCE = dataclasses.replace(REFERENCE, name="latent-reference",
                                       decode=paged_latent_decode)
