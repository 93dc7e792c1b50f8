"""Ragged paged flash prefill as a Triton-lowered `pallas_call`: the portable path (any CUDA GPU) and
the one whose full arithmetic runs in the CPU interpreter (`interpret=True`) in tests.

Same work decomposition as the Mosaic GPU kernel (`flash_prefill.tile_table`): grid (NT, Hq), one
program per (query tile of TILE_Q rows, query head). A program walks its sequence's context in
blocks of BLOCK_K keys; each block is gathered from BLOCK_K / block_size cache pages named by the
block table (`k_ref[page_ids]`), so K/V are read in place, never copied into a contiguous buffer.
GQA: query head h reads KV head h // (Hq // Hkv) through the BlockSpec index map.
Sliding window: the loop starts at the first block holding a key the tile's first row sees
(earlier pages are never read); sinks (one per program: its query head) join the final 1 / l.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as pltriton
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention.flash_config import TILE_Q

BLOCK_K = 64
LOG2E = math.log2(math.e)


def _kernel(tiles_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale, softcap, window, block_k):
    sink_ref, o_ref = refs if len(refs) == 2 else (None, *refs)
    tile = pl.program_id(0)
    row0 = tiles_ref[tile, 0] * 8
    lead = tiles_ref[tile, 1]
    n_rows = tiles_ref[tile, 2]
    q_pos0 = tiles_ref[tile, 3]
    ctx_len = tiles_ref[tile, 4]
    seq = tiles_ref[tile, 5]
    page = k_ref.shape[1]
    d = k_ref.shape[2]
    pages_per_block = block_k // page
    max_pages = bt_ref.shape[1]

    r = jnp.arange(TILE_Q)
    row_ok = (r >= lead) & (r < lead + n_rows)
    q = pltriton.load(q_ref.at[pl.ds(row0, TILE_Q), :], mask=row_ok[:, None], other=0)
    q_pos = q_pos0 + r
    kv_end = jnp.minimum(ctx_len, q_pos0 + TILE_Q)  # causal: the tile's last row sees up to here
    steps = jnp.where(n_rows > 0, (kv_end + block_k - 1) // block_k, 0)
    # The block of the first key row 0 sees (rows before it see no more than it does).
    first = 0 if window is None else jnp.maximum(q_pos0 - window + 1, 0) // block_k

    def body(j, carry):
        acc, m_i, l_i = carry
        p_idx = j * pages_per_block + jnp.arange(pages_per_block)
        ids = pltriton.load(bt_ref.at[seq, pl.ds(j * pages_per_block, pages_per_block)],
                            mask=p_idx < max_pages, other=0)
        # An fp8 cache is widened to q's 16-bit type in registers (kv_quant.py: exact).
        k = k_ref[ids].reshape(block_k, d).astype(q.dtype)
        v = v_ref[ids].reshape(block_k, d).astype(q.dtype)
        s = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        kpos = j * block_k + jnp.arange(block_k)
        visible = (kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] < ctx_len)
        if window is not None:
            visible = visible & (q_pos[:, None] - kpos[None, :] < window)
        s = jnp.where(visible, s * LOG2E, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        # Rows with nothing visible yet keep m = -inf: shift by 0 there so exp2 gives 0, not NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, m_new, l_i * alpha + p.sum(axis=1)

    init = (jnp.zeros((TILE_Q, d), jnp.float32), jnp.full((TILE_Q,), -jnp.inf, jnp.float32),
            jnp.zeros((TILE_Q,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(first, steps, body, init)
    if sink_ref is not None:  # the head's sink (log2 units): one more denominator term
        sink = sink_ref[pl.program_id(1)]
        m_f = jnp.maximum(m_i, sink)
        alpha = jnp.exp2(m_i - m_f)
        acc, l_i = acc * alpha[:, None], l_i * alpha + jnp.exp2(sink - m_f)
    out = acc / jnp.maximum(l_i, 1e-30)[:, None]  # no visible key (padding rows) -> 0
    pltriton.store(o_ref.at[pl.ds(row0, TILE_Q), :], out.astype(o_ref.dtype), mask=row_ok[:, None])


def triton_paged_attention(q, k_cache, v_cache, tiles, block_tables, *, scale: float,
                           softcap: float | None, window: int | None = None,
                           sinks: jax.Array | None = None, interpret: bool = False):
    """q: [Tp, Hq, D] with Tp >= every tile's row0 + TILE_Q (the caller pads); tiles from
    `flash_prefill.tile_table` with kv_ref = block-table row; sinks: [Hq] (natural-log units) or
    None. Returns [Tp, Hq, D]."""
    tp, hq, d = q.shape
    hkv, nb, page, _ = k_cache.shape
    group = hq // hkv
    block_k = max(BLOCK_K, page)
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, window=window,
                               block_k=block_k)
    sink_inputs = () if sinks is None else (sinks.astype(jnp.float32) * LOG2E,)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))
    return pl.pallas_call(
        kernel,
        grid=(tiles.shape[0], hq),
        in_specs=[
            whole(tiles.shape),
            whole(block_tables.shape),
            pl.BlockSpec((tp, None, d), lambda t, h: (0, h, 0)),
            pl.BlockSpec((None, nb, page, d), lambda t, h: (h // group, 0, 0, 0)),
            pl.BlockSpec((None, nb, page, d), lambda t, h: (h // group, 0, 0, 0)),
            *[whole((hq,))] * len(sink_inputs),
        ],
        out_specs=pl.BlockSpec((tp, None, d), lambda t, h: (0, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=2),
        interpret=interpret,
        name="flash_prefill_triton",
    )(tiles, block_tables, q, k_cache, v_cache, *sink_inputs)
