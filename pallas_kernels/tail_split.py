"""The flash kernel's last round split along K/V (`KernelConfig.tail_split`, non-causal only).

A persistent grid of C CTAs runs N equal non-causal items in ceil(N / C) rounds, and the last round
is partial: 2048 items on 132 SMs are 15.52 rounds of work, paid as 16. With the split, the items
of that round are cut into P parts along their K/V steps (part p of an n-step item takes steps
[p·n // P, (p+1)·n // P)), the parts are dealt to the CTAs, and each part leaves its normalised
output and log-sum-exp in a workspace instead of the output. `merge_tail` then combines each item's
parts (weights 2^(lse_p − max)) and scatters the rows into the output, in XLA. P is the smallest
that minimises the split rounds' length, ceil(tail·P / C) / P of an item: 3 for 68 items on 132
CTAs, which makes the last round 2/3 of an item long.

A part's output goes out as two tiles of the kernel's dtype, hi = o and lo = o − hi (about 16
mantissa bits together), through the same shared-memory buffer and TMA store as a finished
item's output; its log-sum-exp (log2 units) goes through a small fp32 buffer.

Why not inside one CTA: both consumer warpgroups on one 64-row half, each taking half the K/V and
merging in shared memory, cannot reach 15.5 rounds (it needs 4096 − 264R half-items ≤ 132(31 − 2R),
four half-items short at every R); parts of one item have to run on different CTAs."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

NEG_LSE = -1e30  # the log-sum-exp of a part with no keys: weight 0 (finite, so no inf - inf)


class TailPlan(NamedTuple):
    full_rounds: int   # rounds of whole items (every CTA busy)
    first_item: int    # the first split item (= full_rounds * C)
    items: int         # split items (the last round's)
    parts: int         # parts per split item (P)
    rounds: int        # rounds the parts take: ceil(items * P / C)

    @property
    def units(self) -> int:
        return self.items * self.parts


def plan_tail(num_items: int, num_ctas: int, max_parts: int) -> TailPlan | None:
    """The split of the last round, or None where it would not shorten it (no partial round, no
    full round before it, or no P <= max_parts that beats whole items)."""
    full, tail = divmod(num_items, num_ctas)
    if max_parts < 2 or full == 0 or tail == 0:
        return None
    length = lambda p: -(-tail * p // num_ctas) / p  # the split rounds' length, in items
    parts = min(range(1, max_parts + 1), key=lambda p: (length(p), p))
    if parts == 1:
        return None
    return TailPlan(full, full * num_ctas, tail, parts, -(-tail * parts // num_ctas))


def store_part(out, m_i, l_i, o_smem, lse_smem, parts_o_ref, parts_lse_ref, unit, rows) -> None:
    """In the kernel, one consumer warpgroup's rows of a part: its normalised output `out` [64, D]
    (fp32) as hi + lo tiles of o_smem's dtype through o_smem (its swizzled Q/O buffer: Q is dead),
    and its log-sum-exp (log2 units, from the running max m_i and sum l_i; NEG_LSE where it saw
    no keys) through lse_smem [64], into parts_o_ref[unit, 0 / 1, rows] and
    parts_lse_ref[unit, rows]."""
    hi = out.astype(o_smem.dtype)
    lo = (out - hi.astype(jnp.float32)).astype(o_smem.dtype)
    lse_smem[...] = jnp.where(l_i > 0, m_i + jnp.log2(jnp.maximum(l_i, 1e-30)), NEG_LSE)
    o_smem[...] = hi
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, parts_lse_ref.at[unit, rows])
    plgpu.copy_smem_to_gmem(o_smem, parts_o_ref.at[unit, 0, rows])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # hi has left o_smem
    o_smem[...] = lo
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, parts_o_ref.at[unit, 1, rows])


def merge_tail(out: jax.Array, parts_o: jax.Array, parts_lse: jax.Array, tiles: jax.Array,
               plan: TailPlan, num_heads: int) -> jax.Array:
    """out [T, Hq, D] with the split items' rows written: parts_o [U, 2, TILE_Q, D] (hi, lo),
    parts_lse [U, TILE_Q] fp32 (log2 units), unit u = item's index * P + part. The rows an item
    stores are those of its tile's sequence (lead <= r < lead + n_rows), as in the kernel."""
    _, _, rows, d = parts_o.shape
    o = parts_o[:, 0].astype(jnp.float32) + parts_o[:, 1].astype(jnp.float32)
    o = o.reshape(plan.items, plan.parts, rows, d)
    lse = parts_lse.reshape(plan.items, plan.parts, rows)
    w = jnp.exp2(lse - lse.max(axis=1, keepdims=True))
    merged = (w[..., None] * o).sum(axis=1) / w.sum(axis=1)[..., None]
    item = plan.first_item + jnp.arange(plan.items)
    tile = tiles[item // num_heads]
    r = jnp.arange(rows)
    row = tile[:, :1] * 8 + r
    mine = (r >= tile[:, 1:2]) & (r < tile[:, 1:2] + tile[:, 2:3])
    row = jnp.where(mine, row, out.shape[0])  # past the end: dropped
    return out.at[row, (item % num_heads)[:, None]].set(merged.astype(out.dtype), mode="drop")
