"""FP8 weight-only GEMV for decode steps: a Triton-lowered `pallas_call`

    fp8_gemv(x[M, K], w[N, K] float8_e4m3fn, scale[N] float32) -> x @ (w * scale[:, None]).T

for M <= MAX_ROWS (16) rows, the weight in the layout the checkpoint stores ([out, in], contracted
over its last dim like x's). At decode a projection is a weight stream: the kernel reads each e4m3
byte once, widens it in registers and accumulates in float32; the channel scale multiplies the
output once. Why a kernel: XLA's weight-only dot (`quantized_matmul` impl "dequant") ran the FP8
batch-1 step of the Llama-3-8B shape at 52 % of the H200's HBM read ceiling, against 78 % for the
bf16 step (benchmarks/bench_bs1_step.py).

Two inner products, chosen per call by `GemvConfig.dot`:
- FMA (`dot=False`, meant for one row): the [block_n, block_k] weight tile is widened to float32
  (e4m3 -> f16 is one hardware conversion per pair on sm_89+, exact, then f16 -> f32) and multiplied
  by each x row broadcast over block_n, then summed over K. No tensor core, no shared memory, no
  layout conversion; but M FMAs per weight byte, so it turns compute bound at a few rows.
- tensor cores (`dot=True`, for 2-16 rows): the weight tile widened to bf16 is the *left* operand
  of `tl.dot` (acc[block_n, 16] += w_tile @ x_tile.T), so the 8-bit tile is never transposed and
  x's rows are padded to the 16 an MMA needs by masked loads (no copy). The previous weight-only
  kernel (removed in 4c2389e) put the weight on the right, transposed, and read 33-45 % of the
  ceiling.

Grid: (N / block_n, split_k). When N / block_n alone cannot keep the GPU's memory system busy
(o and down at Llama-3-8B's shapes), `split_k` programs share one tile's K range and write float32
partial sums that one small XLA reduction adds (deterministic, unlike atomics). Ragged N and K are
masked, so no weight is ever padded or copied; shapes that tile exactly compile without masks.

The tiling per (rows, N, K) comes from `TUNED` (benchmarks/bench_fp8_gemv.py's sweep prints the
winners in its format), else from `heuristic_config`. `fp8_gemv_reference` is the jnp oracle
(dequantize, then a float32 dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.device_info import num_sms

MAX_ROWS = 16
_DOT_ROWS = 16  # rows of the tensor-core path's x tile: the smallest MMA operand


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    dot: bool = False  # tensor cores (x rows padded to 16) instead of float32 FMAs

    def __str__(self) -> str:
        return (f"{'dot' if self.dot else 'fma'}_n{self.block_n}_k{self.block_k}_w{self.num_warps}"
                f"_s{self.num_stages}_sk{self.split_k}")


# (rows bucket, N, K) -> tiling; rows bucket 1 for one-row steps, 8 for 2..16 rows (`rows_bucket`).
# Llama-3-8B's projections as the engine fuses them (q/k/v, gate/up). First guesses, not yet
# measured: replace them with bench_fp8_gemv.py's `suggested_tuned` lines from the H200.
TUNED: dict[tuple[int, int, int], GemvConfig] = {
    (1, 28672, 4096): GemvConfig(32, 512, 4, 1),       # gate_up: 896 programs
    (1, 4096, 14336): GemvConfig(16, 512, 4, 1, 2),    # down: 256 tiles x 2 splits
    (1, 6144, 4096): GemvConfig(16, 512, 4, 1),        # qkv: 384 programs
    (1, 4096, 4096): GemvConfig(16, 512, 4, 1),        # o: 256 programs
    (8, 28672, 4096): GemvConfig(64, 256, 4, 3, 1, True),
    (8, 4096, 14336): GemvConfig(64, 256, 4, 3, 4, True),
    (8, 6144, 4096): GemvConfig(64, 256, 4, 3, 2, True),
    (8, 4096, 4096): GemvConfig(64, 256, 4, 3, 4, True),
}


def rows_bucket(m: int) -> int:
    return 1 if m <= 1 else 8


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << max(0, (v - 1).bit_length()))


def heuristic_config(m: int, n: int, k: int, programs: int | None = None) -> GemvConfig:
    """A tiling for shapes `TUNED` lacks: FMAs at one row, tensor cores above; K split until the
    grid has `programs` (default 2 per SM) programs; blocks no larger than the (padded) shape."""
    dot = m > 1
    block_n = min(64 if dot else 16, _pow2_at_least(n, 16))
    block_k = min(256 if dot else 512, _pow2_at_least(k, 16 if dot else 32))
    tiles = pl.cdiv(n, block_n)
    split = max(1, min(pl.cdiv(programs or 2 * num_sms(), tiles), pl.cdiv(k, block_k)))
    return GemvConfig(block_n, block_k, 4, 3 if dot else 1, split, dot)


def config_for(m: int, n: int, k: int) -> GemvConfig:
    return TUNED.get((rows_bucket(m), n, k)) or heuristic_config(m, n, k)


def fp8_gemv_reference(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """The oracle: w dequantized to float32, then x @ w.T in float32."""
    wf = w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    y = jnp.dot(x.astype(jnp.float32), wf.T, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


def _iota(size: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (size,), 0)


def _load_w(w_ref, n0, kk, n_ok, k_ok, bn: int, bk: int) -> jax.Array:
    """One [bn, bk] e4m3 weight tile; read once, so it is evicted first (x stays in cache)."""
    mask = None
    if n_ok is not None or k_ok is not None:
        mask = ((n_ok[:, None] if n_ok is not None else True)
                & (k_ok[None, :] if k_ok is not None else True))
        mask = jnp.broadcast_to(mask, (bn, bk))
    return plgpu_triton.load(w_ref.at[pl.ds(n0, bn), pl.ds(kk, bk)], mask=mask,
                             other=None if mask is None else 0.0, eviction_policy="evict_first")


def _kernel(x_ref, w_ref, s_ref, o_ref, *, m: int, n: int, k: int, cfg: GemvConfig,
            k_per_split: int):
    bn, bk = cfg.block_n, cfg.block_k
    n0 = pl.program_id(0) * bn
    k0 = pl.program_id(1) * k_per_split
    n_ok = None if n % bn == 0 else n0 + _iota(bn) < n
    ragged_k = k % k_per_split != 0  # the last split (or the only one) runs past K

    def k_mask(kk):
        return kk + _iota(bk) < k if ragged_k else None

    if cfg.dot:
        rows_ok = _iota(_DOT_ROWS) < m

        def step(i, acc):
            kk = k0 + i * bk
            k_ok = k_mask(kk)
            w = _load_w(w_ref, n0, kk, n_ok, k_ok, bn, bk).astype(jnp.bfloat16)
            xmask = rows_ok[:, None] if k_ok is None else rows_ok[:, None] & k_ok[None, :]
            x = plgpu_triton.load(x_ref.at[pl.ds(0, _DOT_ROWS), pl.ds(kk, bk)],
                                  mask=jnp.broadcast_to(xmask, (_DOT_ROWS, bk)), other=0.0)
            return acc + plgpu_triton.dot(w, x.astype(jnp.bfloat16), trans_b=True)

        acc = lax.fori_loop(0, k_per_split // bk, step, jnp.zeros((bn, _DOT_ROWS), jnp.float32))
        scale = plgpu_triton.load(s_ref.at[pl.ds(n0, bn)], mask=n_ok,
                                  other=None if n_ok is None else 0.0)
        y = (acc * scale[:, None]).T
        omask = rows_ok[:, None] if n_ok is None else rows_ok[:, None] & n_ok[None, :]
        plgpu_triton.store(o_ref.at[pl.program_id(1), pl.ds(0, _DOT_ROWS), pl.ds(n0, bn)],
                           y.astype(o_ref.dtype), mask=jnp.broadcast_to(omask, y.shape))
        return

    def step(i, accs):
        kk = k0 + i * bk
        k_ok = k_mask(kk)
        # e4m3 -> f16 is exact and one conversion per pair on sm_89+; f16 -> f32 then is exact.
        w = _load_w(w_ref, n0, kk, n_ok, k_ok, bn, bk).astype(jnp.float16).astype(jnp.float32)
        out = []
        for r in range(m):
            x = plgpu_triton.load(x_ref.at[pl.ds(r, 1), pl.ds(kk, bk)],
                                  mask=None if k_ok is None else k_ok[None, :],
                                  other=None if k_ok is None else 0.0).astype(jnp.float32)
            out.append(accs[r] + jnp.sum(w * x, axis=1))
        return tuple(out)

    accs = lax.fori_loop(0, k_per_split // bk, step,
                         tuple(jnp.zeros((bn,), jnp.float32) for _ in range(m)))
    scale = plgpu_triton.load(s_ref.at[pl.ds(n0, bn)], mask=n_ok,
                              other=None if n_ok is None else 0.0)
    for r in range(m):
        plgpu_triton.store(o_ref.at[pl.program_id(1), pl.ds(r, 1), pl.ds(n0, bn)],
                           (accs[r] * scale).astype(o_ref.dtype)[None, :],
                           mask=None if n_ok is None else n_ok[None, :])


def _check(x, w, scale, cfg: GemvConfig) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or scale.shape != w.shape[:1]:
        raise ValueError(f"x [M, K], w [N, K], scale [N]: got {x.shape}, {w.shape}, {scale.shape}")
    if jnp.dtype(w.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"w must be float8_e4m3fn, got {w.dtype}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; the GEMV takes 1 to {MAX_ROWS}")
    for name, v in (("block_n", cfg.block_n), ("block_k", cfg.block_k)):
        if v & (v - 1) or v < (16 if cfg.dot else 1):
            raise ValueError(f"{name} ({v}) must be a power of two (>= 16 with dot)")
    if cfg.split_k < 1:
        raise ValueError(f"split_k ({cfg.split_k}) must be >= 1")


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret"))
def fp8_gemv_configured(x: jax.Array, w: jax.Array, scale: jax.Array, *, cfg: GemvConfig,
                        out_dtype=None, interpret: bool = False) -> jax.Array:
    """x [M, K] @ (w [N, K] * scale[:, None]).T -> [M, N] with the tiling `cfg` (benchmarks, CPU
    tests with `interpret`). A jit of its own: every layer calls it with the same few shapes, so
    it is traced and lowered once per shape (XLA inlines the call)."""
    _check(x, w, scale, cfg)
    (m, k), n = x.shape, w.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    # Whole blocks per split, and no split without work.
    k_per_split = pl.cdiv(pl.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = pl.cdiv(k, k_per_split)
    y = pl.pallas_call(
        functools.partial(_kernel, m=m, n=n, k=k, cfg=cfg, k_per_split=k_per_split),
        grid=(pl.cdiv(n, cfg.block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype if splits == 1 else jnp.float32),
        compiler_params=plgpu_triton.CompilerParams(num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages),
        interpret=interpret,
        name="fp8_gemv",
    )(x, w, scale.astype(jnp.float32))
    return y[0] if splits == 1 else y.sum(axis=0).astype(out_dtype)


def fp8_gemv(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None,
             cfg: GemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """x [..., K] (at most MAX_ROWS rows in all) @ (w [N, K] * scale[:, None]).T -> [..., N] in
    x's dtype (or `out_dtype`), tiled by `config_for` unless `cfg` is given."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    cfg = cfg or config_for(x2.shape[0], w.shape[0], k)
    y = fp8_gemv_configured(x2, w, scale, cfg=cfg, out_dtype=out_dtype, interpret=interpret)
    return y.reshape(*lead, w.shape[0])
