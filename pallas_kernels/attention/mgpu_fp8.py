"""Mosaic GPU pieces for reading an fp8 KV cache (`pallas_kernels/attention/kv_quant.py` has the scheme).

Hopper's wgmma takes fp8 operands only as e4m3/e5m2 on both sides and only K-major. K is K-major
for Q K^T (its rows run along the reduced head dimension), so an fp8 ring tile of K is a valid
wgmma operand as it lies, provided q is fp8 too: q goes in as two e4m3 tiles whose sum is q scaled
by a power of two (`split_q`), and two fp8 wgmmas, each at twice the f16 rate, carry q to about 8
mantissa bits (bf16's). P @ V reads V MN-major, which fp8 wgmma cannot, so V is widened: a
consumer waits for a ring slot's fp8 V tile, loads it into registers (the WGMMA_8BIT layout: four
bytes per 32-bit shared-memory load), widens it with the hardware's paired `cvt.rn.f16x2.e4m3x2`
(exact: every e4m3 value is a float16 value; bfloat16 would need PTX ISA 9.2), stores it into its
own float16 staging tile and releases the fp8 slot at once, so the producer refills it while the
wgmma runs (the prefill kernel widens K that way too: `wgmma_tile`). HBM streams half the bytes;
the widening costs shared-memory bandwidth, not HBM time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.kv_quant import is_fp8


def compute_dtype(cache_dtype) -> jnp.dtype:
    """The dtype the kernel's matmuls take for this cache: float16 for fp8, else the cache's."""
    return jnp.dtype(jnp.float16) if is_fp8(cache_dtype) else jnp.dtype(cache_dtype)


def split_q(q, dtype=jnp.float8_e4m3fn):
    """q [items, rows, D] -> (q_hi, q_lo [items, rows, D] in `dtype`, inv [items] float32) with
    q_hi + q_lo ~= q / inv: per item, c = 1 / inv is the largest power of two that keeps max |q| * c
    within dtype's range, q_hi = round(q * c) and q_lo = round(q * c - q_hi), so the pair holds q to
    about twice fp8's mantissa (the residual is at most half an ulp of q_hi: no overflow)."""
    q = q.astype(jnp.float32)
    amax = jnp.max(jnp.abs(q), axis=(1, 2))
    top = float(jnp.finfo(dtype).max)
    c = jnp.exp2(jnp.floor(jnp.log2(top / jnp.where(amax > 0, amax, 1.0))))
    scaled = q * c[:, None, None]
    q_hi = scaled.astype(dtype)
    q_lo = (scaled - q_hi.astype(jnp.float32)).astype(dtype)
    return q_hi, q_lo, 1.0 / c


def tile_transforms(dtype, head_dim: int):
    """Tiling + swizzle of a [rows, head_dim] shared-memory tile: the widest swizzle (<= 128 B)
    that one row fills, which is what TMA and wgmma both accept."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, head_dim * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def widen(tile, wide, free, layout: str = "WGMMA_8BIT") -> None:
    """fp8 ring tile -> its float16 copy in the warpgroup's staging tile `wide`, then arrive on
    the slot's `free` barrier (the fp8 bytes are no longer needed; None: the caller will, after
    widening the slot's other chunks). `layout`: the register layout
    of the copy (a `plgpu.Layout` name): WGMMA_8BIT moves 4 fp8 bytes per thread and load,
    WGMMA_UPCAST_2X / _4X 8 / 16."""
    with jax.named_scope("widen"):  # a range of the in-kernel profile (bench/profile/profile_decode.py)
        wide[...] = plgpu.load(tile, layout=getattr(plgpu.Layout, layout)).astype(wide.dtype)
        plgpu.commit_smem()  # the stores -> visible to wgmma (async proxy), every thread's done
    if free is not None:
        plgpu.barrier_arrive(free)


def wgmma_tile(tile, wide, free, layout: str = "WGMMA_8BIT"):
    """The 16-bit tile a wgmma reads for ring slot `tile`: the tile itself (`wide` None; the caller
    arrives on `free` after its wgmma), or its float16 copy made now (`widen`)."""
    if wide is None:
        return tile
    widen(tile, wide, free, layout)
    return wide
