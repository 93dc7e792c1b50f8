"""Paged decode attention as a Triton-lowered `pallas_call`: the portable path for CUDA GPUs that are
not Hopper, and the version that runs in interpret mode on CPU (`interpret=True`).

One program per (sequence, kv head, context split). All G query heads that share a kv head are one
[Gp, D] tile (Gp = G padded to 16, the smallest `tl.dot` M), so each K/V byte is read from HBM once.
The program walks its pages `pages_per_step` at a time through the block table (a gather of whole
[block_size, D] pages), keeps an online softmax in fp32, and writes unnormalised partial results
that `combine_splits` merges (flash-decoding).

Sliding window: the wrapper cuts each block table to the window (`window_view`), and the kernel
masks the keys before `length - window`, which lie in the first page; sinks join in the combine.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common.device_info import num_sms
from pallas_kernels.attention.paged_decode_common import (NEG_INF, check_decode_inputs,
                                                          check_variant, combine_splits,
                                                          pad_block_tables, plan_splits,
                                                          window_view)

_MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


def _decode_kernel(lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale: float,
                   softcap: float | None, window: int | None, block_size: int,
                   pages_per_step: int, pages_per_split: int):
    split = pl.program_id(2)
    length = lens_ref[0]
    first_page = split * pages_per_split
    last_page = jnp.minimum(pl.cdiv(length, block_size), first_page + pages_per_split)
    num_steps = pl.cdiv(jnp.maximum(last_page - first_page, 0), pages_per_step)
    tokens_per_step = pages_per_step * block_size
    gp, d = q_ref.shape
    q = q_ref[...]

    def step(i, carry):
        o, m, l = carry
        pages = bt_ref[pl.ds(i * pages_per_step, pages_per_step)]
        # An fp8 cache is widened to q's 16-bit type in registers (kv_quant.py: exact).
        k = k_ref[pages].reshape(tokens_per_step, d).astype(q.dtype)
        v = v_ref[pages].reshape(tokens_per_step, d).astype(q.dtype)
        s = plgpu_triton.dot(q, k, trans_b=True) * scale  # fp32 [Gp, tokens]
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        token = (first_page + i * pages_per_step) * block_size + lax.broadcasted_iota(
            jnp.int32, (gp, tokens_per_step), 1)
        visible = token < length
        if window is not None:
            visible = visible & (token >= length - window)
        s = jnp.where(visible, s, NEG_INF)
        # NEG_INF is finite: a step (or split) with no visible key keeps m = NEG_INF, and its terms
        # get weight exp(NEG_INF - m) = 0 once a visible key raises m (here or in the combine).
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        o = alpha[:, None] * o + plgpu_triton.dot(p.astype(v.dtype), v)
        return o, m_new, l

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), NEG_INF, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    o, m, l = lax.fori_loop(0, num_steps, step, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def paged_decode_triton_configured(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                                   softcap: float | None = None, window: int | None = None,
                                   sinks: jax.Array | None = None,
                                   pages_per_step: int | None = None,
                                   workers: int | None = None, num_warps: int = 4,
                                   num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """`paged_decode_triton` with its tuning knobs exposed (benchmarks, CPU tests in interpret mode).

    pages_per_step: pages per inner step (default: 128 tokens' worth); workers: programs the GPU
    runs at once, for the split plan (default: 4 per SM)."""
    shape = check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    check_variant(shape, window, sinks)
    block_tables, seq_lens = window_view(block_tables, seq_lens, window, shape.block_size)
    shape = dataclasses.replace(shape, max_blocks=block_tables.shape[1])
    bs, d, g = shape.block_size, shape.head_dim, shape.group
    if pages_per_step is None:
        pages_per_step = max(1, 128 // bs)
    if pages_per_step & (pages_per_step - 1) or (pages_per_step * bs) & (pages_per_step * bs - 1):
        raise ValueError(f"pages_per_step ({pages_per_step}) and pages_per_step * block_size "
                         f"({pages_per_step * bs}) must be powers of two (Triton block shapes)")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim ({d}) must be a power of two >= 16 for the Triton kernel")
    # This path combines even one split (combine_splits normalises), so splitting adds no op.
    plan = plan_splits(shape, pages_per_step=pages_per_step, workers=workers or 4 * num_sms(),
                       combine_cost_steps=0)
    bt = pad_block_tables(block_tables, plan).reshape(shape.num_seqs, plan.num_splits,
                                                      plan.pages_per_split)
    gp = max(_MIN_DOT_ROWS, 1 << math.ceil(math.log2(g)))
    qg = q.reshape(shape.num_seqs, shape.num_kv_heads, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    s, hkv, c, nb = shape.num_seqs, shape.num_kv_heads, plan.num_splits, k_cache.shape[1]

    kernel = functools.partial(_decode_kernel, scale=scale, softcap=softcap, window=window,
                               block_size=bs,
                               pages_per_step=pages_per_step, pages_per_split=plan.pages_per_split)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(s, hkv, c),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, j: (i,)),  # seq_lens
            pl.BlockSpec((None, None, plan.pages_per_split), lambda i, h, j: (i, j, 0)),
            pl.BlockSpec((None, None, gp, d), lambda i, h, j: (i, h, 0, 0)),  # q
            pl.BlockSpec((None, nb, bs, d), lambda i, h, j: (h, 0, 0, 0)),  # all pages of head h
            pl.BlockSpec((None, nb, bs, d), lambda i, h, j: (h, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((s, hkv, c, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((s, hkv, c, gp), jnp.float32),
            jax.ShapeDtypeStruct((s, hkv, c, gp), jnp.float32),
        ],
        compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_triton",
    )(seq_lens.astype(jnp.int32), bt, qg, k_cache, v_cache)
    return combine_splits(o, m, l, shape, q.dtype, sinks)


def paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                        softcap: float | None = None, window: int | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:
    """Paged decode attention (backend `decode` signature), Triton-lowered Pallas."""
    return paged_decode_triton_configured(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                          softcap=softcap, window=window, sinks=sinks)
