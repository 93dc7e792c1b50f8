"""What the two paged-decode kernels (Mosaic GPU and Triton-lowered Pallas) share: input checks,
the flash-decoding split plan, and the combine step that merges per-split partial results.

Both kernels work on "items": one (sequence, kv head, context split). An item streams the pages
[split * pages_per_split, (split + 1) * pages_per_split) of its sequence (clipped to the sequence
length). The Triton kernel emits, for each of the G query heads of its kv head, an unnormalised
fp32 output row `o`, the running max `m` (natural-log units) and the softmax denominator `l`, and
`combine_splits` merges the splits; an item with no tokens emits m = NEG_INF, l = 0, o = 0 and so
contributes nothing, which is also how `seq_lens == 0` rows come out as zeros. (The Mosaic kernel
emits normalised parts with their log-sum-exp; `split_combine_mosaic` merges those.)

Sliding window (`window_view`): a decode query at position len - 1 sees keys len - window .. len - 1,
at most `window_pages` pages. Before either kernel runs, each sequence's block table is cut to the
pages from the one holding its first visible key (`first`), and its length shifted by first * B,
so the kernels, the split plan and the producers see a short sequence whose keys before
`length - window` (inside its first page only) are masked: pages before the window are never
read, and the splits divide the windowed range only.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import NEG_INF, check_window


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int  # M: block-table width

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> DecodeShape:
    """Validate the decode signature's arrays; the error names the offending argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_kv_heads, num_blocks, block_size, "
                         f"head_dim]; got {k_cache.shape} and {v_cache.shape}")
    s, hq, d = q.shape
    hkv, _, bs, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) != head_dim of k_cache ({dk})")
    if hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    if block_tables.ndim != 2 or block_tables.shape[0] != s:
        raise ValueError(f"block_tables must be [num_seqs={s}, max_blocks], got {block_tables.shape}")
    if seq_lens.shape != (s,):
        raise ValueError(f"seq_lens must be [num_seqs={s}], got {seq_lens.shape}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer) or not jnp.issubdtype(seq_lens.dtype,
                                                                               jnp.integer):
        raise ValueError(f"block_tables ({block_tables.dtype}) and seq_lens ({seq_lens.dtype}) "
                         "must be integer arrays")
    return DecodeShape(s, hq, hkv, d, bs, block_tables.shape[1])


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    num_splits: int
    pages_per_split: int  # a multiple of pages_per_step

    @property
    def padded_blocks(self) -> int:
        return self.num_splits * self.pages_per_split


# What splitting costs beyond the split items themselves (the combine kernel, the parts' stores),
# in pipeline steps of one item at full load (~0.9 us on the H200). First measured with the XLA
# combine (an extra ~8 us per call at small contexts); with the one-kernel Mosaic combine (1.3-1.7
# us on the device) forcing splits at batch 1 x 512 still costs more than it saves (10.2 us per call
# unsplit, 11.3 with 2 splits, 10.5 with 4), so the charge stays (benchmarks/RESULTS.md, "Paged
# decode attention").
COMBINE_COST_STEPS = 8
# How much faster than its fair share of HBM bandwidth one worker streams when few are busy
# (H200: ~42 GB/s per SM against 4.55 TB/s / 132 SMs = 34.5).
WORKER_SPEEDUP = 1.2


def plan_splits(shape: DecodeShape, *, pages_per_step: int, workers: int,
                combine_cost_steps: float = COMBINE_COST_STEPS,
                num_splits: int | None = None) -> SplitPlan:
    """Split each sequence's context (flash-decoding) so that the (sequence, kv head, split) items
    keep `workers` concurrent workers (persistent CTAs, or resident programs) evenly busy.

    Cost model for full-length sequences, in steps at full load: the busiest worker runs
    ceil(items / workers) items of (steps per split) steps plus 1 (an item's fixed cost: q load,
    output store); a step takes busy / workers of a full-load step (HBM bandwidth is shared) but
    no less than 1 / WORKER_SPEEDUP; more than one split adds the combine, `combine_cost_steps`.
    The smallest-cost split count wins; ties go to fewer splits. Splits are whole steps of
    `pages_per_step` pages. `num_splits` forces a split count instead (benchmarks)."""
    base = shape.num_seqs * shape.num_kv_heads
    total_steps = max(1, math.ceil(shape.max_blocks / pages_per_step))

    def cost(splits):
        items = base * splits
        step = max(min(items, workers) / workers, 1 / WORKER_SPEEDUP)
        return (math.ceil(items / workers) * (math.ceil(total_steps / splits) * step + 1)
                + (combine_cost_steps if splits > 1 else 0))

    if num_splits is None:
        splits = min(range(1, total_steps + 1), key=lambda c: (cost(c), c))
    else:
        splits = max(1, min(num_splits, total_steps))
    pages_per_split = math.ceil(total_steps / splits) * pages_per_step
    return SplitPlan(math.ceil(shape.max_blocks / pages_per_split), pages_per_split)


def window_pages(window: int, block_size: int) -> int:
    """The most pages `window` consecutive positions can touch (starting at a page's last slot)."""
    return (window + block_size - 2) // block_size + 1


def window_view(block_tables: jax.Array, seq_lens: jax.Array, window: int | None,
                block_size: int) -> tuple[jax.Array, jax.Array]:
    """(block_tables, seq_lens) of each sequence's windowed tail: the table from the page holding
    its first visible key (len - window), width min(M, window_pages), and the length counted from
    that page. Keys at relative positions < length - window (the same rule as before the shift)
    still need masking in the first page. No window, or a window as wide as the table: unchanged."""
    m = block_tables.shape[1]
    if window is None or window_pages(window, block_size) >= m:
        return block_tables, seq_lens
    lens = seq_lens.astype(jnp.int32)
    first = jnp.maximum(lens - window, 0) // block_size
    cols = jnp.minimum(first[:, None] + jnp.arange(window_pages(window, block_size)), m - 1)
    return (jnp.take_along_axis(block_tables.astype(jnp.int32), cols, axis=1),
            lens - first * block_size)


def pad_block_tables(block_tables: jax.Array, plan: SplitPlan) -> jax.Array:
    """Pad the table's width to splits * pages_per_split with block 0 (a valid id; the tokens it
    would cover are past seq_lens and masked), so every split reads a full-width slice."""
    pad = plan.padded_blocks - block_tables.shape[1]
    bt = block_tables.astype(jnp.int32)
    return jnp.pad(bt, ((0, 0), (0, pad))) if pad else bt


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array, shape: DecodeShape,
                   dtype, sinks: jax.Array | None = None) -> jax.Array:
    """o: [S, Hkv, C, Gp, D] unnormalised fp32; m, l: [S, Hkv, C, Gp] (Gp >= G rows, extra rows
    are padding); sinks: [Hq] logits (natural-log units, as m) added to every row's denominator.
    Returns the attention output [S, Hq, D] in `dtype`."""
    g = shape.group
    o, m, l = o[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g]
    m_max = m.max(axis=2, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, shape.num_kv_heads, 1, g)
        m_max = jnp.maximum(m_max, sink)
    w = jnp.exp(m - m_max)  # empty splits have m = NEG_INF: weight 0 unless every split is empty
    num = (w[..., None] * o).sum(axis=2)
    den = (w * l).sum(axis=2)
    if sinks is not None:
        den = den + jnp.exp(sink - m_max)[:, :, 0]
    out = num / jnp.maximum(den, 1e-30)[..., None]  # den == 0 only for empty rows, where num == 0
    return out.reshape(shape.num_seqs, shape.num_q_heads, shape.head_dim).astype(dtype)


def check_variant(shape: DecodeShape, window: int | None, sinks: jax.Array | None) -> None:
    """The decode kernels' window and sinks arguments; errors name the field."""
    check_window(window)
    if sinks is not None and sinks.shape != (shape.num_q_heads,):
        raise ValueError(f"sinks must be [num_q_heads={shape.num_q_heads}], got {sinks.shape}")


__all__ = ["NEG_INF", "DecodeShape", "SplitPlan", "check_decode_inputs", "check_variant",
           "plan_splits", "pad_block_tables", "combine_splits", "window_pages", "window_view"]
