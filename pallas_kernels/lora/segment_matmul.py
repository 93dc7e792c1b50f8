"""LoRA's delta as Triton-lowered Pallas kernels over rows grouped by adapter slot (SGMV):
y[t] += (x[t] A[slot t]) B[slot t] for every token t whose slot is not 0 (0: no adapter).

`segment_plan(slot, num_slots, block_m)` groups the tokens once per step (every projection of
every layer shares it): the tokens of each slot > 0 are laid out one slot after another, each
slot's run padded to a multiple of `block_m`, so every `block_m`-row tile belongs to one slot
(the MoE grouped matmul's layout, pallas_kernels/moe). `rows` maps a padded row to its token
(-1: padding), `tile_slot` a tile to its slot (0: no rows). Tokens of slot 0 get no tile at all:
a step's cost is its adapter rows', and a slot no row uses is never read.

`lora_shrink_expand(x, a, b, y, plan)` runs two kernels:
- shrink: grid (tile, K split); each program gathers its tile's rows of x by `rows` (no sorted
  copy of x is made), multiplies them by its slot's A over its share of K and writes float32
  partial sums [split, padded row, W]. Splitting K gives a decode step with one adapter row
  enough programs to stream A at full bandwidth (one tile alone would read it on one SM);
- expand: grid (tile, N block); sums the tile's partials, rounds them to x's dtype (as the XLA
  path does), multiplies by the slot's B block and adds the result onto y's rows in place (y is
  aliased to the output; rows are gathered and scattered by `rows`, padding rows masked).
Tiles of slot 0 return at once in both. W (the stack's rank width, P * R for a fused projection)
must be a power of two >= 16 (Triton's dot): the stacks are laid out so (model/lora/stacks.py).

The reference is the XLA path, jaxinfer/model/lora/delta.py's `lora_delta`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.common.device_info import num_sms

MIN_DOT = 16  # Triton's smallest dot dimension
MAX_BLOCK = 256


class SegmentPlan(NamedTuple):
    """Tokens grouped by slot: `rows` i32[tiles * block_m] (token of each padded row, -1 padding),
    `tile_slot` i32[tiles] (slot of each tile, 0: empty). `block_m` is rows.size // tiles."""
    rows: jax.Array
    tile_slot: jax.Array

    @property
    def block_m(self) -> int:
        return self.rows.shape[0] // self.tile_slot.shape[0]


def block_m_for(num_tokens: int) -> int:
    """Rows per tile: 16 (the smallest dot) for decode-sized steps, 64 for prefill."""
    return MIN_DOT if num_tokens <= 128 else 64


def segment_plan(slot: jax.Array, num_slots: int, block_m: int) -> SegmentPlan:
    """Group the tokens of `slot` i32[T] (values in [0, num_slots), 0: none) by slot."""
    t = slot.shape[0]
    tiles = -(-t // block_m) + num_slots - 1  # each slot > 0 adds at most one part-filled tile
    active = slot > 0
    key = jnp.where(active, slot, num_slots)  # rows of no adapter sort last and get no tile
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros(num_slots, jnp.int32).at[slot].add(active.astype(jnp.int32))
    padded = -(-counts // block_m) * block_m
    pstart = jnp.cumsum(padded) - padded
    cstart = jnp.cumsum(counts) - counts
    skey = key[order]
    group = jnp.minimum(skey, num_slots - 1)
    dest = jnp.where(skey < num_slots, pstart[group] + jnp.arange(t) - cstart[group],
                     tiles * block_m)
    rows = jnp.full(tiles * block_m, -1, jnp.int32).at[dest].set(order, mode="drop")
    starts = jnp.arange(tiles, dtype=jnp.int32) * block_m
    passed = jnp.sum(starts[:, None] >= (pstart + padded)[None, :], axis=1).astype(jnp.int32)
    return SegmentPlan(rows, jnp.where(passed < num_slots, passed, 0))


def _pow2_block(n: int) -> int:
    """The largest power of two <= MAX_BLOCK dividing n."""
    return math.gcd(n, MAX_BLOCK)


def supported(fan_in: int, width: int, fan_out: int) -> bool:
    """The kernels' shape limits: K and N multiples of 16, W a power of two in [16, 256]."""
    return (fan_in % MIN_DOT == 0 and fan_out % MIN_DOT == 0 and MIN_DOT <= width <= MAX_BLOCK
            and width & (width - 1) == 0)


def _splits(chunks: int, tiles: int) -> int:
    """K splits: enough programs to fill the GPU twice over with the tiles a step fills; a power
    of two (the expand loads all splits' partials as one block) dividing the K chunks."""
    want = max(1, 2 * num_sms() // max(tiles, 1))
    splits = 1
    while chunks % (2 * splits) == 0 and 2 * splits <= want:
        splits *= 2
    return splits


def _shrink_kernel(tile_slot_ref, rows_ref, x_ref, a_ref, out_ref, *, block_m, block_k,
                   chunks_per_split):
    i, s = pl.program_id(0), pl.program_id(1)
    g = tile_slot_ref[i]

    @pl.when(g != 0)
    def _():
        rows = rows_ref[pl.ds(i * block_m, block_m)]
        rows = jnp.where(rows >= 0, rows, 0)  # padding rows read token 0; expand drops them

        def body(c, acc):
            k0 = (s * chunks_per_split + c) * block_k
            xk = x_ref[rows, pl.ds(k0, block_k)]
            ak = a_ref[g, pl.ds(k0, block_k), :]
            return acc + jnp.dot(xk, ak.astype(xk.dtype), preferred_element_type=jnp.float32)

        acc = jnp.zeros(out_ref.shape[1:], jnp.float32)
        out_ref[0] = lax.fori_loop(0, chunks_per_split, body, acc)


def _expand_kernel(tile_slot_ref, rows_ref, part_ref, b_ref, _y_in, y_ref, *, block_m, block_n):
    i, j = pl.program_id(0), pl.program_id(1)
    g = tile_slot_ref[i]

    @pl.when(g != 0)
    def _():
        rows = rows_ref[pl.ds(i * block_m, block_m)]
        valid = rows >= 0
        # Padding rows point past y (masked: never touched); as arrays on both axes, the gather
        # and the scatter take the same path in Triton and in the interpreter.
        rows = jnp.where(valid, rows, y_ref.shape[0])[:, None]
        cols = j * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
        mask = jnp.broadcast_to(valid[:, None], (block_m, block_n))
        xa = jnp.sum(part_ref[...], axis=0).astype(y_ref.dtype)
        b = b_ref[g, :, pl.ds(j * block_n, block_n)]
        d = jnp.dot(xa, b.astype(xa.dtype), preferred_element_type=jnp.float32)
        y = plgpu_triton.load(y_ref.at[rows, cols], mask=mask, other=0)
        plgpu_triton.store(y_ref.at[rows, cols], y + d.astype(y.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "block_k", "splits"))
def lora_shrink_expand(x: jax.Array, a: jax.Array, b: jax.Array, y: jax.Array, plan: SegmentPlan,
                       *, interpret: bool = False, num_warps: int = 4, block_k: int | None = None,
                       splits: int | None = None) -> jax.Array:
    """y + (x A[slot]) B[slot] per token of `plan` (x [T, K], a [G, K, W], b [G, W, N] with the
    scale folded in, y [T, N]); tokens of slot 0 keep y exactly. `block_k` and `splits` override
    the chosen K tiling (tests)."""
    k, w = a.shape[1:]
    n = b.shape[2]
    if not supported(k, w, n):
        raise ValueError(f"LoRA kernel shapes: K={k}, W={w}, N={n} (K, N multiples of 16, "
                         "W a power of two in [16, 256])")
    bm = plan.block_m
    tiles = plan.tile_slot.shape[0]
    bk, bn = block_k or _pow2_block(k), _pow2_block(n)
    splits = splits or _splits(k // bk, -(-x.shape[0] // bm))
    params = plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=2)
    full = pl.BlockSpec()
    part = pl.pallas_call(
        functools.partial(_shrink_kernel, block_m=bm, block_k=bk,
                          chunks_per_split=k // bk // splits),
        grid=(tiles, splits),
        in_specs=[full, full, full, full],
        out_specs=pl.BlockSpec((1, bm, w), lambda i, s: (s, i, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, tiles * bm, w), jnp.float32),
        compiler_params=params, interpret=interpret, name="lora_shrink",
    )(plan.tile_slot, plan.rows, x, a)
    return pl.pallas_call(
        functools.partial(_expand_kernel, block_m=bm, block_n=bn),
        grid=(tiles, n // bn),
        in_specs=[full, full, pl.BlockSpec((splits, bm, w), lambda i, j: (0, i, 0)), full, full],
        out_specs=full,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        input_output_aliases={4: 0},
        compiler_params=params, interpret=interpret, name="lora_expand",
    )(plan.tile_slot, plan.rows, part, b, y)
