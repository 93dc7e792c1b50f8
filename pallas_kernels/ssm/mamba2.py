"""Mamba-2's SSM (the SSD scan) as Triton-lowered Pallas kernels: a chunked prefill over a ragged
batch and a one-token decode, both updating the state pool in place.

    ssd_prefill(x, dt, a, b, c, state_pool, cu_seqlens, slots, has_initial_state=None, *, d=None,
                src_slots=None, chunk_size=64, block_p=64)
        -> (y [T, H, P], state_pool)
    ssd_decode(x, dt, a, b, c, state_pool, slots, *, d=None, src_slots=None, block_p=64)
        -> (y [S, H, P], state_pool)

Inputs as HF's Mamba2Mixer / mamba_ssm's mamba_chunk_scan_combined take them after the conv and
the split of xBC: x [T, H, P], dt [T, H] the step size after softplus and clamping
(`reference.mamba2_dt`), a [H] = -exp(A_log), b and c [T, G, N] (head h reads group
h // (H // G)), d [H] or None (the skip y += D x), state_pool [num_slots, H, P, N] float32 (the
mamba_ssm layout); the ragged batch of `batch.py`. The gated RMSNorm with z is the caller's.
The references are `reference.ssd_chunked_reference` / `ssd_decode_reference`.

Prefill. Per chunk: cs = cumsum(dt a); L = exp(cs_i - cs_j) (i >= j);
y = ((C B^T) * L * dt_j) x + exp(cs) (C S^T) + D x;
S <- exp(cs_last) S + (x dt exp(cs_last - cs))^T B. Rows past a sequence's end load as dt = 0,
x = B = 0: the identity step. Matmul operands in x's dtype, float32 accumulation and state.
One kernel, grid (S, H, P / block_p), walks a sequence's chunks with its [block_p, N] slice of
the state in registers, computing y on the serial walk. This beat mamba_ssm's split of the work
(a state-update-only serial pass writing each chunk's incoming state to HBM, then every chunk's
y at once) on an H100: 91.1 vs 73.9 TF/s at 8 x 1024 tokens, 69.1 vs 67.7 at 1 x 8192, the
split at its best (block_p 64, num_stages 2; c3db3f4's record). So did one program per head
against programs walking 2 or 4 heads of a group that share C B^T (0.4-0.7x, H100, 1a18fab).
x, B and C go in as they are (no padded copy: `tiles.rows_past_end`), and padding rows are
zeroed by programs of their own, not by a select over y: that took the call from 657 to 426 us
at 8 x 1024 tokens, 385 with `default_stages` (benchmarks/results/ssm_kernels_h100.json).
Decode: grid (S, H, P / block_p): `reference.ssd_step` on the slot.

Mixed prefill/decode steps: decode rows are sequences of length 1 in the prefill's packed batch;
`ssd_decode` is the fast path of a step with only decode rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ssm.tiles import chunk_rows, dot, rows_past_end
from pallas_kernels.ssm.batch import check_ragged, check_sources, sequence_table, slot_table


def _chunk_cumsum(dt, a, chunk):
    """cs = the cumsum of dt a within the chunk (a masked reduction: Triton has no scan here)."""
    r = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return jnp.sum(jnp.where(r >= col, (dt * a)[None, :], 0.0), axis=1)


def _prefill_kernel(info_ref, a_ref, d_ref, x_ref, dt_ref, b_ref, c_ref, h_ref, y_ref, h_out_ref,
                    *, chunk: int):
    """One (sequence, head, P block): the chunks in order, the state in registers. Tiles stay in
    the input dtype (float32 copies of B and C held across the step's four matmuls would spill).
    A padding sequence's program (and the one for the padding tokens past the last sequence)
    writes zeros over its rows."""
    s, head = pl.program_id(0), pl.program_id(1)
    start, length, slot, init = info_ref[s, 0], info_ref[s, 1], info_ref[s, 2], info_ref[s, 3]
    src = info_ref[s, 4]
    a, skip = a_ref[head], d_ref[head]
    dtype = x_ref.dtype
    rows = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    @pl.when(slot >= 0)
    def _():
        def step(j, h):
            row0 = start + j * chunk
            ok = j * chunk + rows < length
            load2 = lambda ref: chunk_rows(ref, row0, ok)
            x, b, c = load2(x_ref), load2(b_ref), load2(c_ref)
            dt = chunk_rows(dt_ref, row0, ok)
            cs = _chunk_cumsum(dt, a, chunk)
            r = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
            col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
            decay = jnp.exp(jnp.where(r >= col, cs[:, None] - cs[None, :], -jnp.inf))
            scores = dot(c, b, dtype, trans_b=True) * decay * dt[None, :]
            y = (dot(scores, x, dtype) + jnp.exp(cs)[:, None] * dot(c, h, dtype, trans_b=True)
                 + skip * x.astype(jnp.float32))
            pltriton.store(y_ref.at[pl.ds(row0, chunk), :], y.astype(y_ref.dtype),
                           mask=ok[:, None])
            last = jnp.sum(jnp.where(rows == chunk - 1, cs, 0.0))
            xs = x.astype(jnp.float32) * (dt * jnp.exp(last - cs))[:, None]
            return h * jnp.exp(last) + dot(xs, b, dtype, trans_a=True)

        h0 = h_ref[src].astype(jnp.float32)
        h = lax.fori_loop(0, pl.cdiv(length, chunk), step, jnp.where(init > 0, h0, 0.0))
        h_out_ref[slot] = h.astype(h_out_ref.dtype)

    @pl.when(slot < 0)
    def _():
        def zero(j, carry):
            ok = j * chunk + rows < length
            pltriton.store(y_ref.at[pl.ds(start + j * chunk, chunk), :],
                           jnp.zeros((chunk, y_ref.shape[-1]), y_ref.dtype), mask=ok[:, None])
            return carry

        lax.fori_loop(0, pl.cdiv(length, chunk), zero, 0)


def _check_ssd(x, dt, a, b, c, d, state_pool, block_p):
    t, h, p = x.shape
    g, n = b.shape[1], b.shape[2]
    if dt.shape != (t, h) or a.shape != (h,) or (d is not None and d.shape != (h,)):
        raise ValueError(f"x {x.shape}, dt {dt.shape}, a {a.shape}, d "
                         f"{None if d is None else d.shape}: need [T, H, P], [T, H], [H], [H]")
    if b.shape != c.shape or b.shape[0] != t or h % g:
        raise ValueError(f"b {b.shape} and c {c.shape} must be [T, G, N] with G dividing H={h}")
    if state_pool.shape[1:] != (h, p, n) or state_pool.dtype != jnp.float32:
        raise ValueError(f"state_pool {state_pool.shape} {state_pool.dtype} must be float32 "
                         f"[num_slots, H={h}, P={p}, N={n}]")
    bp = min(block_p, p)
    for name, v in (("N", n), ("block_p", bp)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"{name}={v} must be a power of two >= 16 (Triton block shapes)")
    if p % bp:
        raise ValueError(f"P={p} must be a multiple of block_p={bp}")
    skip = jnp.zeros((h,), jnp.float32) if d is None else d.astype(jnp.float32)
    return h, p, g, n, bp, skip


def ssd_prefill(x, dt, a, b, c, state_pool, cu_seqlens, slots, has_initial_state=None, *, d=None,
                src_slots=None, chunk_size: int = 64, block_p: int = 64, num_warps: int = 4,
                num_stages: int | None = None, interpret: bool = False):
    """The chunked SSD scan over a ragged batch (module docstring). Returns (y [T, H, P] in x's
    dtype, zeros on padding/dead rows; state_pool with each live sequence's final state in its
    slot). chunk_size: a power of two >= 16; block_p: the P block; num_stages: Triton's software
    pipelining of the chunk walk's loads (None: `default_stages`)."""
    h, p, g, n, bp, skip = _check_ssd(x, dt, a, b, c, d, state_pool, block_p)
    t = x.shape[0]
    check_ragged(t, cu_seqlens, slots, has_initial_state, src_slots)
    if chunk_size & (chunk_size - 1) or chunk_size < 16:
        raise ValueError(f"chunk_size={chunk_size} must be a power of two >= 16")
    cu = cu_seqlens.astype(jnp.int32)
    # One more program row: the padding tokens past the last sequence, zeroed like a padding
    # sequence's, so every output row is written once by the kernel (no select after it).
    tail = jnp.stack([cu[-1], t - cu[-1], -1, 0, 0])[None].astype(jnp.int32)
    info = jnp.concatenate([sequence_table(cu, slots, has_initial_state, src_slots), tail])
    pad = lambda v: rows_past_end(v, chunk_size, interpret)
    params = pltriton.CompilerParams(num_warps=num_warps,
                                     num_stages=num_stages or default_stages(slots.shape[0]))
    y, pool = _prefill_call(info, a.astype(jnp.float32), skip, pad(x), pad(dt.astype(jnp.float32)),
                            pad(b), pad(c), state_pool, chunk=chunk_size, bp=bp, params=params,
                            interpret=interpret)
    return y[:t], pool


def default_stages(num_seqs: int) -> int:
    """The walk's pipelining depth, by the H100 sweep (ssm_kernels_h100.json): 2 stages for a
    batch of prompts (8 x 1024 tokens: 385 us against 426 with 1 and 503 with 3), 3 for a lone
    one, whose 128 programs each walk many chunks (1 x 8192: 466 us against 698 with 2)."""
    return 3 if num_seqs == 1 else 2


def _prefill_call(info, a, skip, x, dt, b, c, state_pool, *, chunk, bp, params, interpret):
    """Each sequence's chunks in order, the output computed on the serial path."""
    s, (tp, h, p), (g, n) = info.shape[0], x.shape, b.shape[1:]
    slots_n, rep = state_pool.shape[0], h // g
    x_spec = pl.BlockSpec((tp, None, bp), lambda i, hh, j: (0, hh, j))
    bc_spec = pl.BlockSpec((tp, None, n), lambda i, hh, j: (0, hh // rep, 0))
    state_spec = pl.BlockSpec((slots_n, None, bp, n), lambda i, hh, j: (0, hh, j, 0))
    whole = lambda shape: pl.BlockSpec(shape, lambda i, hh, j: (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_prefill_kernel, chunk=chunk),
        grid=(s, h, p // bp),
        in_specs=[whole((s, 5)), whole((h,)), whole((h,)), x_spec,
                  pl.BlockSpec((tp, None), lambda i, hh, j: (0, hh)), bc_spec, bc_spec,
                  state_spec],
        out_specs=[x_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct((tp, h, p), x.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={7: 1},
        compiler_params=params,
        interpret=interpret,
        name="ssd_prefill",
    )(info, a, skip, x, dt, b, c, state_pool)


def _decode_kernel(slot_ref, a_ref, d_ref, dt_ref, x_ref, b_ref, c_ref, h_ref, y_ref, h_out_ref):
    s, head = pl.program_id(0), pl.program_id(1)
    slot, init, src = slot_ref[s, 0], slot_ref[s, 1], slot_ref[s, 2]
    x = x_ref[...].astype(jnp.float32)
    dt = dt_ref[s, head]

    @pl.when(slot >= 0)
    def _():
        h = (jnp.where(init > 0, h_ref[src].astype(jnp.float32), 0.0) * jnp.exp(dt * a_ref[head])
             + (dt * x)[:, None] * b_ref[...].astype(jnp.float32)[None, :])
        y = jnp.sum(h * c_ref[...].astype(jnp.float32)[None, :], axis=1) + d_ref[head] * x
        y_ref[...] = y.astype(y_ref.dtype)
        h_out_ref[slot] = h.astype(h_out_ref.dtype)

    @pl.when(slot < 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


def ssd_decode(x, dt, a, b, c, state_pool, slots, *, d=None, src_slots=None, block_p: int = 64,
               num_warps: int = 4, interpret: bool = False):
    """One token per sequence: x [S, H, P], dt [S, H], b, c [S, G, N]; slots [S] (< 0: padding
    row, zeros out, nothing written), src_slots [S] where each reads its state (default: slots).
    Returns (y [S, H, P], state_pool updated in place)."""
    h, p, g, n, bp, skip = _check_ssd(x, dt, a, b, c, d, state_pool, block_p)
    s = x.shape[0]
    check_sources(slots, src_slots)
    if slots.shape != (s,):
        raise ValueError(f"slots {slots.shape} must be [num_seqs={s}]")
    slots_n, rep = state_pool.shape[0], h // g
    whole = lambda shape: pl.BlockSpec(shape, lambda i, hh, j: (0,) * len(shape))
    x_spec = pl.BlockSpec((None, None, bp), lambda i, hh, j: (i, hh, j))
    bc_spec = pl.BlockSpec((None, None, n), lambda i, hh, j: (i, hh // rep, 0))
    state_spec = pl.BlockSpec((slots_n, None, bp, n), lambda i, hh, j: (0, hh, j, 0))
    return pl.pallas_call(
        _decode_kernel,
        grid=(s, h, p // bp),
        in_specs=[whole((s, 3)), whole((h,)), whole((h,)), whole((s, h)), x_spec, bc_spec, bc_spec,
                  state_spec],
        out_specs=[x_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={7: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ssd_decode",
    )(slot_table(slots, None, src_slots), a.astype(jnp.float32), skip, dt.astype(jnp.float32), x,
      b, c,
      state_pool)


def ssd_prefill_flops(seq_lens, num_heads: int, head_dim: int, state_dim: int,
                      chunk_size: int = 64) -> float:
    """Useful FLOPs of a chunked prefill (for `ssd_prefill_frac_of_matmul`): per chunk of n rows
    and head, C B^T (2n^2 N), the scores times x (2n^2 P), C S^T and x^T B (2nPN each). Partial
    chunks count their real rows; B/C shared by a group are counted per head, as computed."""
    p, n_state = head_dim, state_dim
    total = 0.0
    for length in seq_lens:
        full, rest = divmod(int(length), chunk_size)
        for n, times in ((chunk_size, full), (rest, 1 if rest else 0)):
            total += times * (2 * n * n * (n_state + p) + 4 * n * p * n_state)
    return total * num_heads
