"""Pure-jnp attention over the paged KV cache: the CPU path and the oracle every kernel is tested against.

KV cache layout (one array for K and one for V per layer), head-major:

    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]

so one (kv head, block) page is a contiguous [block_size, head_dim] tile, which is what a decode
kernel streams. A token's flat slot is block_id * block_size + offset.

Shapes used below: T tokens, S sequences, Hq query heads, Hkv KV heads (G = Hq // Hkv query heads
share each KV head), D head_dim, M max blocks per sequence, B block size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows give 0 instead of NaN


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Put new K/V [T, Hkv, D] into their slots; slots < 0 are dropped (padding tokens).

    One token (a batch-1 decode step) is a dynamic-update-slice per cache, which XLA emits as a
    small in-place kernel (and on the CPU without the scatter's cost); more are `scatter_kv`. With
    the caches donated to the enclosing jit, XLA writes in place either way."""
    if k.shape[0] == 1:
        return _write_one(k_cache, k, slot_mapping[0]), _write_one(v_cache, v, slot_mapping[0])
    return scatter_kv(k_cache, v_cache, k, v, slot_mapping)


def scatter_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
               slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`write_kv` for any T: one XLA scatter per cache."""
    hkv, nb, bs, _ = k_cache.shape
    num_slots = nb * bs
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped

    def put(cache, new):  # K and V may differ in width (MLA's V cache is empty)
        d = cache.shape[-1]
        flat = cache.reshape(hkv, num_slots, d)
        flat = flat.at[:, slots].set(new.astype(cache.dtype).swapaxes(0, 1), mode="drop")
        return flat.reshape(hkv, nb, bs, d)

    return put(k_cache, k), put(v_cache, v)


def _write_one(cache: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """new [1, Hkv, D] into `slot` of cache [Hkv, NB, B, D]; a negative slot rewrites the row
    at slot 0 with its own content (a no-op write keeps the update static)."""
    hkv, _, bs, d = cache.shape
    at = jnp.maximum(slot, 0)
    start = (0, at // bs, at % bs, 0)
    row = new.astype(cache.dtype).reshape(hkv, 1, 1, d)
    old = jax.lax.dynamic_slice(cache, start, row.shape)
    return jax.lax.dynamic_update_slice(cache, jnp.where(slot >= 0, row, old), start)


def gather_context(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[Hkv, NB, B, D] paged cache -> [S, M*B, Hkv, D] contiguous per-sequence context."""
    hkv, _, bs, d = cache.shape
    s, m = block_tables.shape
    ctx = cache[:, block_tables]  # [Hkv, S, M, B, D]
    return ctx.reshape(hkv, s, m * bs, d).transpose(1, 2, 0, 3)


def _softcap(scores: jax.Array, softcap: float | None) -> jax.Array:
    return scores if not softcap else softcap * jnp.tanh(scores / softcap)


def in_window(q_pos: jax.Array, k_pos: jax.Array, window: int | None,
              chunk: int | None = None) -> jax.Array:
    """Whether a query at q_pos sees the key at k_pos: causal, and with a sliding window only the
    last `window` positions (HF's convention: q_pos - k_pos < window; the key at q_pos included);
    with a chunk only the keys of its own chunk, q_pos - q_pos % chunk <= k_pos (Llama 4's
    chunked local attention)."""
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (q_pos - k_pos < window)
    if chunk is not None:
        visible = visible & (k_pos >= q_pos - q_pos % chunk)
    return visible


def check_window(window: int | None, chunk: int | None = None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r} must be a positive int (or None for full attention)")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk={chunk!r} must be a positive int (or None for no chunks)")


def masked_softmax_rows(scores: jax.Array, valid: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Probabilities over the last axis of float32 `scores` where `valid`; rows without a valid key
    give zeros. `sinks` (broadcastable to scores[..., 0]) are one extra logit per row whose
    probability is dropped: they only enlarge the denominator (gpt-oss)."""
    scores = jnp.where(valid, scores, NEG_INF)
    m = scores.max(-1)
    if sinks is not None:
        m = jnp.maximum(m, sinks)
    p = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
    denom = p.sum(-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks - m)
    return p / jnp.maximum(denom, 1e-30)[..., None]


# Queries are processed this many at a time, so the gathered context (chunk x L x Hkv x D) stays
# small even when a step holds thousands of tokens of hundreds of sequences.
QUERY_CHUNK = 32


def _attend_rows(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, tables: jax.Array,
                 last_pos: jax.Array, *, scale: float, softcap: float | None,
                 window: int | None, sinks: jax.Array | None,
                 chunk: int | None = None) -> jax.Array:
    """Each query row attends to its own sequence's context positions 0..last_pos (inclusive;
    last_pos < 0 = no keys, output 0), only the last `window` of them with a window. q: [N, Hq, D];
    tables: [N, M] block table of each row's sequence; last_pos: [N]; sinks: [Hq] or None. Rows
    are processed QUERY_CHUNK at a time."""
    n, hq, d = q.shape
    hkv = k_cache.shape[0]
    sink_g = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, hq // hkv)

    def one(row):
        qi, table, last = row
        k = gather_context(k_cache, table[None])[0].astype(jnp.float32)  # [L, Hkv, D]
        v = gather_context(v_cache, table[None])[0].astype(jnp.float32)
        qg = qi.astype(jnp.float32).reshape(hkv, hq // hkv, d)
        scores = _softcap(jnp.einsum("kgd,lkd->kgl", qg, k) * scale, softcap)
        valid = in_window(last, jnp.arange(k.shape[0]), window, chunk)
        p = masked_softmax_rows(scores, valid, sink_g)
        return jnp.einsum("kgl,lkd->kgd", p, v).reshape(hq, d)

    out = jax.lax.map(one, (q, tables, last_pos), batch_size=min(QUERY_CHUNK, max(n, 1)))
    return out.astype(q.dtype)


def paged_decode_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           block_tables: jax.Array, seq_lens: jax.Array, *, scale: float,
                           softcap: float | None = None, window: int | None = None,
                           sinks: jax.Array | None = None, chunk: int | None = None) -> jax.Array:
    """One query token per sequence (the last of its context). q: [S, Hq, D] -> [S, Hq, D];
    seq_lens == 0 gives zeros."""
    check_window(window, chunk)
    return _attend_rows(q, k_cache, v_cache, block_tables, seq_lens - 1, scale=scale,
                        softcap=softcap, window=window, sinks=sinks, chunk=chunk)


def token_positions(query_start_loc: jax.Array, seq_lens: jax.Array,
                    num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """For each token: its sequence index (S for padding tokens) and its position in the context."""
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right")  # first s with end > t
    s = seq_lens.shape[0]
    safe = jnp.minimum(seq, s - 1)
    q_len = query_start_loc[safe + 1] - query_start_loc[safe]
    pos = seq_lens[safe] - q_len + (t - query_start_loc[safe])
    return jnp.where(seq < s, seq, s), pos


def ragged_prefill_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                             query_start_loc: jax.Array, seq_lens: jax.Array,
                             block_tables: jax.Array, *, scale: float,
                             softcap: float | None = None, window: int | None = None,
                             sinks: jax.Array | None = None,
                             chunk: int | None = None) -> jax.Array:
    """Ragged causal attention: sequence s owns tokens query_start_loc[s]:query_start_loc[s+1]; they
    are the last tokens of its context of seq_lens[s] tokens (earlier ones are already cached).
    q: [T, Hq, D] -> [T, Hq, D]; tokens that belong to no sequence give zeros."""
    check_window(window, chunk)
    seq, pos = token_positions(query_start_loc, seq_lens, q.shape[0])
    owned = seq < seq_lens.shape[0]
    tables = block_tables[jnp.minimum(seq, seq_lens.shape[0] - 1)]
    return _attend_rows(q, k_cache, v_cache, tables, jnp.where(owned, pos, -1), scale=scale,
                        softcap=softcap, window=window, sinks=sinks, chunk=chunk)


def causal_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                               softcap: float | None = None, causal: bool = True,
                               window: int | None = None,
                               sinks: jax.Array | None = None,
                               chunk: int | None = None) -> jax.Array:
    """Dense batched attention without a cache (training and kernel tests).
    q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D]. A window or chunk implies causal."""
    check_window(window, chunk)
    b, l, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, l, hkv, hq // hkv, d)
    scores = _softcap(jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32)) * scale, softcap)
    pos = jnp.arange(l)
    if causal or window is not None or chunk is not None:
        valid = in_window(pos[:, None], pos[None, :], window, chunk)
    else:
        valid = jnp.ones((l, l), dtype=bool)
    sink_g = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, hq // hkv, 1)
    p = masked_softmax_rows(scores, valid, sink_g)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
    return out.reshape(b, l, hq, d).astype(q.dtype)
