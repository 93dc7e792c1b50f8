"""Weight-only matmul for few rows (decode): y = x @ (w * scale[:, None]).T as a Triton-lowered
`pallas_call`, for 8-bit weights with per-channel scales and for 16-bit weights (the LM head).

At decode a linear layer reads every weight byte once for a handful of rows, so its time is the
weight stream. XLA's dot over a converted 8-bit weight does not stream the 8-bit bytes at the HBM
rate (the conversion is not fused into the gemm's operand load), and cuBLASLt's FP8 gemm is tuned
for large M. Here each program owns `block_n` output channels (and one K range under split-K): it
streams its [block_n, block_k] weight tiles from HBM (e4m3 or int8, 1 byte each), widens them to
x's 16-bit type in registers, multiplies with tensor cores into a float32 accumulator, and applies
the per-channel scale once at the end.

x's rows are padded to 16 (the smallest `tl.dot` M) by masked loads, not a copy; ragged N and K are
masked the same way, so no weight is ever padded or copied. When N / block_n programs cannot fill
the GPU (the k and v projections, o, down), K is split: each split writes float32 partial sums that
one small XLA reduction adds (deterministic, unlike atomics).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.device_info import num_sms

_MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
MAX_ROWS = 64  # beyond this the weight tile is re-read per 64 rows: the gemm path is better


def weight_only_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array | None,
                                 out_dtype=None, w_kn: bool = False) -> jax.Array:
    """x [M, K] @ (w [N, K] * scale [N, None]).T -> [M, N] (w [K, N] with `w_kn`; no scale with
    None), float32 accumulation."""
    wf = w.astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wf if w_kn else wf.T, precision=lax.Precision.HIGHEST)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


def _kernel(x_ref, w_ref, *refs, rows: int, n: int, k: int, block_n: int, block_k: int,
            steps: int, k_per_split: int, w_kn: bool):
    *s_ref, o_ref = refs
    j, split = pl.program_id(0), pl.program_id(1)
    mp = o_ref.shape[-2]
    n0 = j * block_n
    k0 = split * k_per_split
    n_ok = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0) < n
    row_ok = lax.broadcasted_iota(jnp.int32, (mp,), 0) < rows
    # The fill must have the weight's kind: Triton casts a float constant to e4m3, not an int one.
    w_zero = 0 if jnp.issubdtype(w_ref.dtype, jnp.integer) else 0.0

    def step(i, acc):
        kk = k0 + i * block_k
        k_ok = (kk + lax.broadcasted_iota(jnp.int32, (block_k,), 0)) < k
        x = plgpu_triton.load(x_ref.at[pl.ds(0, mp), pl.ds(kk, block_k)],
                              mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if w_kn:
            w = plgpu_triton.load(w_ref.at[pl.ds(kk, block_k), pl.ds(n0, block_n)],
                                  mask=k_ok[:, None] & n_ok[None, :], other=w_zero)
            return acc + plgpu_triton.dot(x, w.astype(x.dtype))
        w = plgpu_triton.load(w_ref.at[pl.ds(n0, block_n), pl.ds(kk, block_k)],
                              mask=n_ok[:, None] & k_ok[None, :], other=w_zero)
        return acc + plgpu_triton.dot(x, w.astype(x.dtype), trans_b=True)

    y = lax.fori_loop(0, steps, step, jnp.zeros((mp, block_n), jnp.float32))
    if s_ref:
        y = y * plgpu_triton.load(s_ref[0].at[pl.ds(n0, block_n)], mask=n_ok, other=0.0)[None, :]
    plgpu_triton.store(o_ref.at[split, pl.ds(0, mp), pl.ds(n0, block_n)], y.astype(o_ref.dtype),
                       mask=row_ok[:, None] & n_ok[None, :])


def plan_split_k(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """K splits so that (N tiles) x splits reaches `programs`, each split >= one K block."""
    tiles = pl.cdiv(n, block_n)
    return max(1, min(pl.cdiv(programs, tiles), pl.cdiv(k, block_k)))


def weight_only_matmul_configured(x: jax.Array, w: jax.Array, scale: jax.Array | None, *,
                                  w_kn: bool = False, block_n: int = 64, block_k: int = 256,
                                  split_k: int | None = None, num_warps: int = 4,
                                  num_stages: int = 4, out_dtype=None,
                                  interpret: bool = False) -> jax.Array:
    """`weight_only_matmul` with its tuning knobs exposed (benchmarks, CPU tests in interpret mode).

    w_kn: w is [K, N] (a Flax Dense kernel) instead of [N, K]; scale None: unscaled weights.
    split_k: K ranges per output tile (default: enough programs for 2 per SM)."""
    n, wk = (w.shape[1], w.shape[0]) if w_kn and w.ndim == 2 else (w.shape[0], w.shape[-1])
    if (x.ndim != 2 or w.ndim != 2 or x.shape[1] != wk
            or (scale is not None and scale.shape != (n,))):
        raise ValueError(f"x [M, K], w [N, K] (or [K, N]), scale [N]: got {x.shape}, {w.shape}, "
                         f"{None if scale is None else scale.shape}")
    if jnp.dtype(w.dtype).itemsize > 2:
        raise ValueError(f"w must be an 8- or 16-bit type, got {w.dtype}")
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"{name} ({v}) must be a power of two >= 16 (Triton block shapes)")
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows; the weight-only kernel takes at most {MAX_ROWS}")
    out_dtype = out_dtype or x.dtype
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.bfloat16)
    mp = max(_MIN_DOT_ROWS, 1 << math.ceil(math.log2(max(m, 1))))
    splits = split_k or plan_split_k(n, k, block_n, block_k, 2 * num_sms())
    k_per_split = pl.cdiv(pl.cdiv(k, splits), block_k) * block_k
    splits = pl.cdiv(k, k_per_split)  # no empty split
    steps = k_per_split // block_k
    part_dtype = jnp.float32 if splits > 1 else out_dtype
    kernel = functools.partial(_kernel, rows=m, n=n, k=k, block_n=block_n, block_k=block_k,
                               steps=steps, k_per_split=k_per_split, w_kn=w_kn)
    scales = () if scale is None else (scale.astype(jnp.float32),)
    # Padded rows of the output are never stored; the [.., mp, ..] buffer keeps the store's block
    # a power of two without a masked-out-of-range pointer past the array.
    y = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, mp, n), part_dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="weight_only_matmul",
    )(x, w, *scales)
    y = y[0] if splits == 1 else y.sum(axis=0)
    return y[:m].astype(out_dtype)


def weight_only_matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None, out_dtype=None,
                       w_kn: bool = False, interpret: bool = False) -> jax.Array:
    """x [..., K] (at most MAX_ROWS rows) @ (w [N, K] * scale[:, None]).T -> [..., N] (w [K, N]
    with `w_kn`; no scale with None); x is multiplied in bfloat16 (float16 stays float16)."""
    lead = x.shape[:-1]
    y = weight_only_matmul_configured(x.reshape(-1, x.shape[-1]), w, scale, w_kn=w_kn,
                                      out_dtype=out_dtype, interpret=interpret)
    return y.reshape(*lead, y.shape[-1])
