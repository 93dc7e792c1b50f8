"""Gated DeltaNet (Qwen3-Next's linear attention) as Triton-lowered Pallas kernels: a chunked prefill
over a ragged batch and a one-token decode, both updating the state pool in place.

    gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial_state=None, *,
                src_slots=None, use_qk_l2norm=True, chunk_size=64, block_v=64, num_stages=2)
        -> (o [T, Hv, V], state_pool)
    gdn_decode(q, k, v, g, beta, state_pool, slots, *, src_slots=None, use_qk_l2norm=True,
               block_v=64) -> (o [S, Hv, V], state_pool)

Inputs as HF's Qwen3NextGatedDeltaNet passes them to fla's chunk_gated_delta_rule (after the conv,
before the gated RMSNorm): q, k [T, Hk, K], v [T, Hv, V] (value head h reads key head
h // (Hv // Hk): no repeated copy of q/k is made), g [T, Hv] the log decay (<= 0) and beta [T, Hv]
(`reference.gdn_gating`), state_pool [num_slots, Hv, K, V] float32; the ragged batch of
`batch.py`. use_qk_l2norm: q and k L2-normalised in the kernel (HF passes True). q is scaled by
K^-1/2. The references are `reference.gdn_chunked_reference` / `gdn_decode_reference`.

Prefill (fla's split of chunk_gated_delta_rule). Per chunk of `chunk_size` tokens, the WY form:
gc = cumsum(g), D = exp(gc_i - gc_j) (i >= j), T = (I + strictly-lower(beta_i k_i.k_j D))^-1
(the UT transform), u = T (beta v), w = T (beta exp(gc) k); then v' = u - w S,
o = (q exp(gc)) S + (q k^T * D) v', S <- exp(gc_last) S + (k exp(gc_last - gc))^T v'.
  1. `_wy_kernel`, grid (chunk, Hv): w and u of every chunk of every sequence at once (chunks
     from `batch.chunk_table`; they never cross sequences), T by 16-row blocks (forward
     substitution on the diagonal blocks, or dots with `ut_solve="doubling"`; 16 x 16 float32
     dots for the rest: fla's solve_tril), written to HBM in k's / v's dtype;
  2. `_h_kernel`, grid (S, Hv, V / block_v), walks a sequence's chunks in order with its
     [K, block_v] slice of the state in registers, doing only v' and the state update (two
     matmuls a step) and writing each chunk's incoming state (in q's dtype) and v'; then
     `_o_kernel`, grid (chunk, Hv, V / 128), every chunk's output at once. This split beat
     computing the output on the serial walk (one kernel, five matmuls a step) on an H100:
     48.5 vs 46.0 TF/s at 8 x 1024 tokens, 38.9 vs 24.1 at 1 x 8192 (c3db3f4's record). The
     default tiling is the sweep's fastest (benchmarks/results/ssm_kernels_h100.json): chunks
     of 32 (a two-block UT transform, twice the walk's steps), block_v 64, num_stages 2: 762 us
     against 872 at chunk 64 for 8 x 1024 tokens.
Rows past a sequence's end load as k = v = beta = g = 0, which is the identity step, so a partial
last chunk needs no other masking. Matmul operands are cast to q's dtype (bf16 in serving, as fla
does), accumulating in float32; the state stays float32.
Decode: grid (S, Hv, V / block_v): the recurrence's one step (`reference.gdn_step`) on the slot.

Mixed prefill/decode steps: decode rows are sequences of length 1 in the prefill's packed batch
(one partial chunk each); `gdn_decode` is the fast path of a step with only decode rows.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ssm.tiles import chunk_rows, dot, rows_past_end
from pallas_kernels.ssm.batch import (check_ragged, check_sources, chunk_table, first_chunks,
                                      sequence_table, slot_table)
from pallas_kernels.ssm.reference import L2NORM_EPS

def _total(terms):
    return functools.reduce(operator.add, terms)


def unit_lower_inverse(*lowers: jax.Array) -> jax.Array | tuple:
    """(I + lower)^-1 for each strictly lower-triangular float32 [n, n], row by row (forward
    substitution: row i = e_i - lower[i] @ rows < i), with selects and reductions only (Triton
    cannot index a register tensor). HF's torch_chunk_gated_delta_rule row loop, exactly. Several
    matrices share one loop, so their independent steps overlap. One matrix in, one out."""
    n = lowers[0].shape[0]
    r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    cols = lax.broadcasted_iota(jnp.int32, (n,), 0)

    def row(i, ts):
        out = []
        for lower, t in zip(lowers, ts):
            li = jnp.sum(jnp.where(r == i, lower, 0.0), axis=0)   # lower[i, :] along the columns
            new = jnp.where(cols == i, 1.0, 0.0) - jnp.sum(li[:, None] * t, axis=0)
            out.append(jnp.where(r == i, new[None, :], t))
        return tuple(out)

    eye = (r == c).astype(jnp.float32)
    inv = lax.fori_loop(1, n, row, tuple(eye for _ in lowers))
    return inv[0] if len(lowers) == 1 else inv


def unit_lower_inverse_by_doubling(lower: jax.Array, precision=None) -> jax.Array:
    """(I + lower)^-1 for a strictly lower-triangular float32 [n, n], n a power of two, by dots:
    lower^n = 0, so sum_{p < n} (-lower)^p factors as (I - lower)(I + lower^2)(I + lower^4)...
    (I + lower^(n/2)), log2(n) - 1 squarings and as many products (6 dots at n = 16) where
    `unit_lower_inverse` takes n - 1 serial row steps. The powers cancel, so the dots need
    float32's precision: `precision` 3xTF32 on the GPU (docs/kernels/ssm.md gives the errors)."""
    n = lower.shape[0]
    eye = (lax.broadcasted_iota(jnp.int32, (n, n), 0)
           == lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(jnp.float32)
    inv, power = eye - lower, lower
    for _ in range(n.bit_length() - 2):
        power = pltriton.dot(power, power, precision=precision)
        inv = inv + pltriton.dot(inv, power, precision=precision)
    return inv


# How the WY pass inverts the UT transform's diagonal blocks: "rows" (`unit_lower_inverse`),
# "doubling" (`unit_lower_inverse_by_doubling`, 3xTF32 dots).
UT_SOLVES = ("rows", "doubling")


def _normed(x, l2: bool, scale: float = 1.0):
    x = x.astype(jnp.float32)
    if l2:
        x = x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
    return x * scale if scale != 1.0 else x


def _chunk_cumsum(g, chunk):
    """gc = the cumsum of g within the chunk (a masked reduction: Triton has no scan here)."""
    r = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    c = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return jnp.sum(jnp.where(r >= c, g[None, :], 0.0), axis=1)


def _chunk_decay(g, chunk):
    """gc = the cumsum of g within the chunk, and D_ij = exp(gc_i - gc_j) for i >= j, else 0."""
    r = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    c = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    gc = _chunk_cumsum(g, chunk)
    return gc, jnp.exp(jnp.where(r >= c, gc[:, None] - gc[None, :], -jnp.inf))


SUB = 16  # rows of the UT transform's diagonal blocks (Triton's smallest dot side)


def _block_lower_inverse(a: dict, nb: int, ut_solve: str, interpret: bool) -> dict:
    """(I + A)^-1 of a strictly lower-triangular matrix given as SUB x SUB blocks a[i, j] (i >= j):
    the diagonal blocks as `ut_solve` says (by forward substitution all in one loop, or by
    doubling: 3xTF32 dots, IEEE in the interpreter, which lacks 3xTF32), then block substitution
    T_ij = -T_ii sum_{j <= m < i} A_im T_mj (fla's solve_tril) as dots of float32 operands at
    Triton's default precision for them, TF32 (10-bit mantissas: errors of bf16's order, the
    dtype w and u are stored in when serving). Not so the diagonal blocks: as dots (the product
    form, docs/kernels/ssm.md) their powers of A cancel, which TF32 does not survive."""
    if ut_solve == "doubling":
        precision = (lax.DotAlgorithmPreset.F32_F32_F32 if interpret
                     else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
        diag = tuple(unit_lower_inverse_by_doubling(a[i, i], precision) for i in range(nb))
    else:
        diag = unit_lower_inverse(*(a[i, i] for i in range(nb)))
        diag = diag if nb > 1 else (diag,)
    inv = {(i, i): diag[i] for i in range(nb)}
    for i in range(nb):
        for j in range(i):
            acc = _total(pltriton.dot(a[i, m], inv[m, j]) for m in range(j, i))
            inv[i, j] = -pltriton.dot(inv[i, i], acc)
    return inv


def _wy_kernel(chunks_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, *, chunk: int, l2: bool,
               ut_solve: str, interpret: bool):
    """One (chunk, value head): the UT transform T in SUB-row blocks, then w = T (beta exp(gc) k),
    u = T (beta v), block row by block row. Blocks keep the triangular solve off 64 x 64 register
    tensors (a row loop over those costs more than all the matmuls)."""
    row0, n = chunks_ref[pl.program_id(0), 0], chunks_ref[pl.program_id(0), 1]
    dtype = k_ref.dtype
    nb, sub = chunk // SUB, lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    r = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    c = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

    @pl.when(n > 0)
    def _():
        # Per block: k, beta v and beta exp(gc) k kept in the matmul dtype (they only feed
        # matmuls; twelve float32 [16, K] tiles would spill).
        ks, bvs, bks, betas, gcs = [], [], [], [], []
        base = jnp.float32(0.0)
        for i in range(nb):
            ok = i * SUB + sub < n
            at = pl.ds(row0 + i * SUB, SUB)
            beta = pltriton.load(b_ref.at[at], mask=ok, other=0).astype(jnp.float32)
            g = pltriton.load(g_ref.at[at], mask=ok, other=0).astype(jnp.float32)
            gc = base + jnp.sum(jnp.where(r >= c, g[None, :], 0.0), axis=1)
            base = base + jnp.sum(g)
            k = _normed(pltriton.load(k_ref.at[at, :], mask=ok[:, None], other=0), l2)
            ks.append(k.astype(dtype))
            bks.append(((beta * jnp.exp(gc))[:, None] * k).astype(dtype))
            v = pltriton.load(v_ref.at[at, :], mask=ok[:, None], other=0).astype(jnp.float32)
            bvs.append((beta[:, None] * v).astype(dtype))
            betas.append(beta)
            gcs.append(gc)
        a = {}
        for i in range(nb):
            for j in range(i + 1):
                diff = gcs[i][:, None] - gcs[j][None, :]
                if i == j:
                    diff = jnp.where(r > c, diff, -jnp.inf)
                a[i, j] = (betas[i][:, None] * dot(ks[i], ks[j], dtype, trans_b=True)
                           * jnp.exp(diff))
        inv = _block_lower_inverse(a, nb, ut_solve, interpret)
        for i in range(nb):
            ok = (i * SUB + sub < n)[:, None]
            at = pl.ds(row0 + i * SUB, SUB)
            u = _total(dot(inv[i, j], bvs[j], dtype) for j in range(i + 1))
            w = _total(dot(inv[i, j], bks[j], dtype) for j in range(i + 1))
            pltriton.store(u_ref.at[at, :], u.astype(u_ref.dtype), mask=ok)
            pltriton.store(w_ref.at[at, :], w.astype(w_ref.dtype), mask=ok)


def _h_kernel(info_ref, k_ref, w_ref, u_ref, g_ref, h_ref, vn_ref, hc_ref, h_out_ref, *,
              chunk: int, l2: bool):
    """The serial pass, one (sequence, value head, V block): per chunk in order,
    the state before it to hc (row first_chunk + j, in the matmul dtype the output pass reads),
    v' = u - w S to vn, then the state update. Two matmuls per step on the serial path."""
    s = pl.program_id(0)
    start, length, slot, init = info_ref[s, 0], info_ref[s, 1], info_ref[s, 2], info_ref[s, 3]
    src, c0 = info_ref[s, 4], info_ref[s, 5]
    dtype = k_ref.dtype
    rows = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    @pl.when(slot >= 0)
    def _():
        def step(j, h):
            row0 = start + j * chunk
            ok = j * chunk + rows < length
            load2 = lambda ref: chunk_rows(ref, row0, ok)
            hc_ref[c0 + j] = h.astype(hc_ref.dtype)
            v_new = load2(u_ref).astype(jnp.float32) - dot(load2(w_ref), h, dtype)
            pltriton.store(vn_ref.at[pl.ds(row0, chunk), :], v_new.astype(vn_ref.dtype),
                           mask=ok[:, None])
            g = chunk_rows(g_ref, row0, ok)
            gc = _chunk_cumsum(g.astype(jnp.float32), chunk)
            last = jnp.sum(jnp.where(rows == chunk - 1, gc, 0.0))
            k = _normed(load2(k_ref), l2) * jnp.exp(last - gc)[:, None]
            return h * jnp.exp(last) + dot(k, v_new, dtype, trans_a=True)

        h0 = h_ref[src].astype(jnp.float32)
        h = lax.fori_loop(0, pl.cdiv(length, chunk), step, jnp.where(init > 0, h0, 0.0))
        h_out_ref[slot] = h.astype(h_out_ref.dtype)


def _o_kernel(chunks_ref, q_ref, k_ref, g_ref, vn_ref, hc_ref, _zeros_ref, o_ref, *, chunk: int,
              l2: bool):
    """The output, one (chunk, value head, V block), every chunk at once:
    o = (q exp(gc)) S_before + (q k^T * D) v'."""
    i = pl.program_id(0)
    row0, n = chunks_ref[i, 0], chunks_ref[i, 1]
    kd, dtype = q_ref.shape[-1], q_ref.dtype

    @pl.when(n > 0)
    def _():
        ok = lax.broadcasted_iota(jnp.int32, (chunk,), 0) < n
        load2 = lambda ref: chunk_rows(ref, row0, ok)
        g = chunk_rows(g_ref, row0, ok)
        gc, decay = _chunk_decay(g.astype(jnp.float32), chunk)
        # Operands go to the matmul dtype as soon as they are made: float32 [chunk, K] tiles
        # held across the dots would spill.
        q = _normed(load2(q_ref), l2, kd ** -0.5)
        qg, q = (q * jnp.exp(gc)[:, None]).astype(dtype), q.astype(dtype)
        scores = dot(q, _normed(load2(k_ref), l2).astype(dtype), dtype, trans_b=True) * decay
        o = dot(qg, hc_ref[i], dtype) + dot(scores, load2(vn_ref), dtype)
        pltriton.store(o_ref.at[pl.ds(row0, chunk), :], o.astype(o_ref.dtype), mask=ok[:, None])


def _check_gdn(q, k, v, g, beta, state_pool, block_v):
    t, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != t or hv % hk:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: q and k must be [T, Hk, K] and "
                         f"v [T, Hv, V] with Hk dividing Hv")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be [T, Hv] = [{t}, {hv}]")
    if state_pool.shape[1:] != (hv, kd, vd) or state_pool.dtype != jnp.float32:
        raise ValueError(f"state_pool {state_pool.shape} {state_pool.dtype} must be float32 "
                         f"[num_slots, Hv={hv}, K={kd}, V={vd}]")
    bv = min(block_v, vd)
    for name, n in (("K", kd), ("V", vd), ("block_v", bv)):
        if n & (n - 1) or n < 16:
            raise ValueError(f"{name}={n} must be a power of two >= 16 (Triton block shapes)")
    if vd % bv:
        raise ValueError(f"V={vd} must be a multiple of block_v={bv}")
    return hk, hv, kd, bv


def gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial_state=None, *,
                src_slots=None, use_qk_l2norm: bool = True, chunk_size: int = 32, block_v: int = 64,
                num_warps: int = 4, num_stages: int = 2, ut_solve: str = "rows",
                interpret: bool = False):
    """The chunked gated delta rule over a ragged batch (module docstring). Returns
    (o [T, Hv, V] in v's dtype, zeros on padding/dead rows; state_pool with each live sequence's
    final state in its slot). chunk_size: a power of two >= 16 (the result is the same at any
    chunk, to rounding); block_v: the V block of the serial pass; num_warps, num_stages:
    Triton's, for all three kernels (defaults: the H100 sweep's fastest); ut_solve: one of
    UT_SOLVES ("doubling" is not yet timed: `jaxinfer bench kernels --only ssm` sweeps it)."""
    hk, hv, kd, bv = _check_gdn(q, k, v, g, beta, state_pool, block_v)
    t, vd = q.shape[0], v.shape[2]
    check_ragged(t, cu_seqlens, slots, has_initial_state, src_slots)
    if chunk_size & (chunk_size - 1) or chunk_size < 16:
        raise ValueError(f"chunk_size={chunk_size} must be a power of two >= 16")
    if ut_solve not in UT_SOLVES:
        raise ValueError(f"ut_solve={ut_solve!r}: expected one of {', '.join(UT_SOLVES)}")
    cu = cu_seqlens.astype(jnp.int32)
    info = sequence_table(cu, slots, has_initial_state, src_slots)
    chunks = chunk_table(cu, slots, t, chunk_size)
    pad = lambda x: rows_past_end(x, chunk_size, interpret)
    q, k, v, g = pad(q), pad(k), pad(v), pad(g.astype(jnp.float32))
    rep, tp = hv // hk, q.shape[0]
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    # WY: every chunk of every head at once (the UT transform is off the serial path).
    key_spec = pl.BlockSpec((tp, None, kd), lambda i, h: (0, h // rep, 0))
    head_spec = lambda d: pl.BlockSpec((tp, None, d), lambda i, h: (0, h, 0))
    gate_spec = pl.BlockSpec((tp, None), lambda i, h: (0, h))
    w, u = pl.pallas_call(
        functools.partial(_wy_kernel, chunk=chunk_size, l2=use_qk_l2norm, ut_solve=ut_solve,
                          interpret=interpret),
        grid=(chunks.shape[0], hv),
        in_specs=[pl.BlockSpec(chunks.shape, lambda i, h: (0, 0)), key_spec, head_spec(vd),
                  gate_spec, gate_spec],
        out_specs=[head_spec(kd), head_spec(vd)],
        out_shape=[jax.ShapeDtypeStruct((tp, hv, kd), k.dtype),
                   jax.ShapeDtypeStruct((tp, hv, vd), v.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="gdn_prefill_wy",
    )(chunks, k, v, g, pad(beta.astype(jnp.float32)))
    common = dict(chunk=chunk_size, bv=bv, l2=use_qk_l2norm, params=params, interpret=interpret)
    info = jnp.concatenate([info, first_chunks(cu, slots, chunk_size)[:, None]], axis=1)
    o, pool = _state_pass(q, k, w, u, g, state_pool, info, chunks, **common)
    return o[:t], pool


def _state_pass(q, k, w, u, g, state_pool, info, chunks, *, chunk, bv, l2, params, interpret):
    """fla's split: the serial pass keeps only v' = u - w S and the state update (two matmuls a
    step), writing each chunk's incoming state and v'; then every chunk's output at once. info:
    `sequence_table` rows with each sequence's first chunk (`first_chunks`) appended."""
    tp, hk, kd = q.shape
    n, hv, _, vd = state_pool.shape
    rep, s, nc = hv // hk, info.shape[0], chunks.shape[0]
    key_spec = pl.BlockSpec((tp, None, kd), lambda i, h, j: (0, h // rep, 0))
    w_spec = pl.BlockSpec((tp, None, kd), lambda i, h, j: (0, h, 0))
    gate_spec = pl.BlockSpec((tp, None), lambda i, h, j: (0, h))
    v_spec = lambda b: pl.BlockSpec((tp, None, b), lambda i, h, j: (0, h, j))
    hc_spec = lambda b: pl.BlockSpec((nc, None, kd, b), lambda i, h, j: (0, h, 0, j))
    state_spec = pl.BlockSpec((n, None, kd, bv), lambda i, h, j: (0, h, 0, j))
    vn, hc, pool = pl.pallas_call(
        functools.partial(_h_kernel, chunk=chunk, l2=l2),
        grid=(s, hv, vd // bv),
        in_specs=[pl.BlockSpec((s, 6), lambda i, h, j: (0, 0)), key_spec, w_spec, v_spec(bv),
                  gate_spec, state_spec],
        out_specs=[v_spec(bv), hc_spec(bv), state_spec],
        out_shape=[jax.ShapeDtypeStruct((tp, hv, vd), u.dtype),
                   jax.ShapeDtypeStruct((nc, hv, kd, vd), q.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={5: 2},
        compiler_params=params,
        interpret=interpret,
        name="gdn_prefill_h",
    )(info, k, w, u, g, state_pool)
    bo = min(vd, 128)  # the output pass holds no state: whole rows of V where they fit
    # The output starts as zeros (a write-only fill) and the kernel writes the live chunks' rows:
    # padding tokens and padding sequences' rows stay zero without a select over all of it.
    o = pl.pallas_call(
        functools.partial(_o_kernel, chunk=chunk, l2=l2),
        grid=(nc, hv, vd // bo),
        in_specs=[pl.BlockSpec((nc, 2), lambda i, h, j: (0, 0)), key_spec, key_spec, gate_spec,
                  v_spec(bo), hc_spec(bo), v_spec(bo)],
        out_specs=v_spec(bo),
        out_shape=jax.ShapeDtypeStruct((tp, hv, vd), u.dtype),
        input_output_aliases={6: 0},
        compiler_params=params,
        interpret=interpret,
        name="gdn_prefill_o",
    )(chunks, q, k, g, vn, hc, jnp.zeros((tp, hv, vd), u.dtype))
    return o, pool


def _decode_kernel(slot_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h_ref, o_ref, h_out_ref, *,
                   l2: bool):
    s, head = pl.program_id(0), pl.program_id(1)
    slot, init, src = slot_ref[s, 0], slot_ref[s, 1], slot_ref[s, 2]
    q = _normed(q_ref[...], l2, q_ref.shape[-1] ** -0.5)
    k = _normed(k_ref[...], l2)

    @pl.when(slot >= 0)
    def _():
        h = jnp.where(init > 0, h_ref[src].astype(jnp.float32), 0.0) * jnp.exp(g_ref[s, head])
        delta = (v_ref[...].astype(jnp.float32) - jnp.sum(h * k[:, None], axis=0)) * b_ref[s, head]
        h = h + k[:, None] * delta[None, :]
        o_ref[...] = jnp.sum(h * q[:, None], axis=0).astype(o_ref.dtype)
        h_out_ref[slot] = h.astype(h_out_ref.dtype)

    @pl.when(slot < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def gdn_decode(q, k, v, g, beta, state_pool, slots, *, src_slots=None, use_qk_l2norm: bool = True,
               block_v: int = 64, num_warps: int = 4, interpret: bool = False):
    """One token per sequence: q, k [S, Hk, K], v [S, Hv, V], g, beta [S, Hv]; slots [S] (< 0:
    padding row, zeros out, nothing written), src_slots [S] where each reads its state (default:
    slots; < 0: from zeros). Returns (o [S, Hv, V], state_pool updated in place)."""
    hk, hv, kd, bv = _check_gdn(q, k, v, g, beta, state_pool, block_v)
    s, vd = q.shape[0], v.shape[2]
    check_sources(slots, src_slots)
    if slots.shape != (s,):
        raise ValueError(f"slots {slots.shape} must be [num_seqs={s}]")
    n, rep = state_pool.shape[0], hv // hk
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h, j: (0,) * len(shape))
    qk_spec = pl.BlockSpec((None, None, kd), lambda i, h, j: (i, h // rep, 0))
    v_spec = pl.BlockSpec((None, None, bv), lambda i, h, j: (i, h, j))
    state_spec = pl.BlockSpec((n, None, kd, bv), lambda i, h, j: (0, h, 0, j))
    return pl.pallas_call(
        functools.partial(_decode_kernel, l2=use_qk_l2norm),
        grid=(s, hv, vd // bv),
        in_specs=[whole((s, 3)), qk_spec, qk_spec, v_spec, whole((s, hv)), whole((s, hv)),
                  state_spec],
        out_specs=[v_spec, state_spec],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={6: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_decode",
    )(slot_table(slots, None, src_slots), q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
      state_pool)


def gdn_prefill_flops(seq_lens, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                      chunk_size: int = 64) -> float:
    """Useful FLOPs of a chunked prefill (for `gdn_prefill_frac_of_matmul`): per chunk of n rows
    and value head, the matmuls kk^T, w, qk^T (2n^2 K each), u, (qk^T D) v' (2n^2 V each),
    w S, q S, k^T v' (2nKV each) and the triangular solve (n^3 / 3). Partial chunks count their
    real rows."""
    kd, vd = head_k_dim, head_v_dim
    total = 0.0
    for length in seq_lens:
        full, rest = divmod(int(length), chunk_size)
        for n, times in ((chunk_size, full), (rest, 1 if rest else 0)):
            total += times * (6 * n * n * kd + 4 * n * n * vd + 6 * n * kd * vd + n ** 3 / 3)
    return total * num_v_heads
