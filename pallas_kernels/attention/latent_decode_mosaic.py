"""Absorbed MLA decode over the paged latent cache, in Mosaic GPU (Hopper: TMA + wgmma).

The cache is one "KV head" [1, NB, B, W] (W = kv_lora_rank + rope = 512 + 64 for DeepSeek) that
is the keys and, in its first V = kv_lora_rank columns, the values (docs/MLA.md). For query
token s and head h:

    out[s, h] = softmax(scale * q[s, h] . latent[s, :]) . latent[s, :, :V]

Design (docs/MLA.md, "The latent decode kernel"):
- One CTA per item (sequence, head block, context split); an item's head block is all H query
  heads of the sequence when H <= 64 (else 64 of them; H a multiple of 64). Every latent page
  the CTA loads feeds all its heads.
- A producer warpgroup loads the item's q rows, then its pages into a ring of `stages` slots of
  `pages_per_step` pages ([T, W], T = pages_per_step * B tokens; one TMA copy per page, block ids
  read ahead of the slot waits).
- Two consumer warpgroups both take every slot: each computes all the scores (the same f32 online
  softmax in both) and P . V for its half of the value columns (a [64, V/2] or [V/2, heads] f32
  accumulator: one warpgroup cannot hold all 512 columns of 64 rows).
- Heads-major (H > 32, or few splits): S = Q . K^T ([64, W] x [W, T], the heads padded to
  wgmma's M = 64) and O_w += P . V_w ([64, T] x [T, V/2], P from registers). Heads-minor
  (H <= 32 and many splits, the default there): S^T = K . Q^T ([T, W] x [W, H]: the tokens on M,
  the heads on N, no padding) and O_w^T += V_w^T . P^T ([V/2, T] x [T, H], P^T through shared
  memory): at 16 heads a quarter of the tensor work and of the q reads, which keeps a short
  split bound by HBM, not the SM (`LatentDecodeConfig.heads_minor` has the measured rule).
- Splits (flash-decoding) come from `plan_splits`; several splits store normalised f32 parts and
  their log2-sum-exp, merged by `split_combine_mosaic.combine_split_parts` (the paged decode
  kernel's combine). One split stores the output directly.
- The output has W columns, as the backend's decode contract says (decode rows concatenate with
  prefill rows): the V value columns, then zeros where the rope columns would be (the model keeps
  the first kv_lora_rank; the reference computes P . rope there).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.latent_reference import paged_latent_decode
from pallas_kernels.attention.mgpu_common import accumulate_pv, observe_last_releases
from pallas_kernels.attention.paged_decode_common import (NEG_INF, DecodeShape, SplitPlan,
                                                          plan_splits)
from pallas_kernels.attention.paged_decode_smem import SMEM_BUDGET, WGMMA_ROWS
from pallas_kernels.attention.split_combine_mosaic import combine_split_parts
from pallas_kernels.common.device_info import num_sms

_LOG2E = math.log2(math.e)
_CONSUMERS = 2  # each owns half of the value columns
_HEADS_MINOR_MAX = 32


@dataclasses.dataclass(frozen=True)
class LatentDecodeConfig:
    """Static tuning knobs (each distinct value compiles its own kernel); the defaults are the
    production kernel.

    pages_per_step: pages per ring slot (tokens per step T = pages_per_step * block_size, a
      multiple of the swizzle's width in elements: T is wgmma's K for P . V).
    swizzle: the shared-memory swizzle of the q tile and the ring, in bytes (32, 64, 128): 128
      needs T a multiple of 64 (at most 2 slots of [64, 576] bf16 beside the q tile), 64 allows
      T = 32 (4 slots of half the size).
    stages: ring slots; None: as many as fit in shared memory beside the q tile.
    num_splits: force this many context splits (benchmarks, tests); None: planned.
    bt_lookahead: the producer reads block ids this many steps ahead.
    heads_minor: compute S^T = K Q^T [T, heads] and O^T = V^T P^T [V/2, heads] (tokens and value
      columns on wgmma's M, the heads on N, P^T through shared memory) instead of S = Q K^T with
      the heads padded to M = 64: at 16 heads a quarter of the tensor work and shared-memory
      reads of q; needs T a multiple of 64 and the heads a multiple of 8, at most 32 (the
      accumulator's registers). None: heads-minor where it can run, else heads-major.
      Measured on one H200 at 16 heads, inputs off L2 (benchmarks/results/mla_h200.json,
      fraction of a plain read of the same bytes), heads-minor vs heads-major: 64 x 4096 with
      2 splits 0.826 vs 0.776 (two earlier runs 0.847 / 0.779, 0.855 / 0.791; one older run
      0.765 / 0.807), with 4 splits 0.699 vs 0.725 and 0.715 vs 0.705; 1 x 32k with 128 splits
      0.442 vs 0.418, with 64 splits 0.376 vs 0.355. True / False: force it
      (benchmarks, tests)."""
    pages_per_step: int = 4
    stages: int | None = None
    num_splits: int | None = None
    bt_lookahead: int = 2
    swizzle: int = 128
    heads_minor: bool | None = None

    def __post_init__(self):
        if self.swizzle not in (32, 64, 128):
            raise ValueError(f"swizzle={self.swizzle} must be 32, 64 or 128 (bytes)")
        if self.pages_per_step < 1:
            raise ValueError(f"pages_per_step={self.pages_per_step} must be positive")
        if self.stages is not None and self.stages < 2:
            raise ValueError(f"stages={self.stages} must be >= 2 (None: as many as fit)")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be positive (or None)")
        if self.bt_lookahead < 0:
            raise ValueError(f"bt_lookahead={self.bt_lookahead} must be >= 0")


def _heads_minor_fits(heads: int, tokens: int) -> bool:
    return tokens % 64 == 0 and heads % 8 == 0 and heads <= _HEADS_MINOR_MAX


def heads_minor(heads: int, tokens: int, config: LatentDecodeConfig) -> bool:
    """Whether the kernel runs heads-minor (`LatentDecodeConfig.heads_minor`)."""
    if config.heads_minor is None:
        return _heads_minor_fits(heads, tokens)
    return config.heads_minor


def unsupported(q_shape, cache_shape, cache_dtype, value_width: int,
                config: LatentDecodeConfig = LatentDecodeConfig()) -> str | None:
    """Why the kernel cannot run these shapes (None: it can)."""
    _, h, w = q_shape
    bs = cache_shape[2]
    if jnp.dtype(cache_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cache dtype {jnp.dtype(cache_dtype)} (bf16 or f16 only)"
    if w % 64 or value_width % (64 * _CONSUMERS) or not 0 < value_width <= w:
        return (f"latent width {w} must be a multiple of 64 and the value width {value_width} "
                f"a multiple of {64 * _CONSUMERS} within it")  # wgmma N tiles of 64 per half
    if h > WGMMA_ROWS and h % WGMMA_ROWS:
        return f"{h} query heads: at most {WGMMA_ROWS} or a multiple of it"
    cols = config.swizzle // jnp.dtype(cache_dtype).itemsize
    if config.heads_minor and not _heads_minor_fits(h, config.pages_per_step * bs):
        return (f"heads_minor needs pages_per_step x block size a multiple of 64 and the heads "
                f"({h}) a multiple of 8, at most {_HEADS_MINOR_MAX}")
    if bs % 8 or (config.pages_per_step * bs) % cols:
        return (f"block size {bs} (a multiple of 8) x pages_per_step {config.pages_per_step} "
                f"must be a multiple of {cols} (the swizzle's width)")
    return None


def split_plan(num_seqs: int, heads: int, width: int, block_size: int, max_blocks: int,
               config: LatentDecodeConfig) -> SplitPlan:
    """The flash-decoding split of each sequence's pages: items (sequence, head block, split)
    spread over one CTA per SM (the ring and q tile fill an SM's shared memory)."""
    head_blocks = heads // min(heads, WGMMA_ROWS)
    shape = DecodeShape(num_seqs, heads, head_blocks, width, block_size, max_blocks)
    return plan_splits(shape, pages_per_step=config.pages_per_step, workers=num_sms(),
                       num_splits=config.num_splits)


def _stages(requested: int | None, *, tokens: int, width: int, value_width: int,
            elem_bytes: int, q_rows: int, p_tiles: bool) -> int:
    """Ring slots beside the q tile; the staging tiles of the output overlay the ring, so it must
    hold them (f32 [64, V] when split)."""
    slot = tokens * width * elem_bytes
    # q tile, P tiles, lse row, barriers
    fixed = (q_rows * width * elem_bytes + p_tiles * _CONSUMERS * q_rows * tokens * elem_bytes
             + 2048)
    stages = requested or (SMEM_BUDGET - fixed) // slot
    if stages < 2:
        raise ValueError(f"shared memory holds {stages} ring slots of {tokens} tokens x {width}; "
                         "use fewer pages_per_step")
    if stages * slot < WGMMA_ROWS * value_width * 4:
        raise ValueError(f"{stages} ring slots of {tokens} tokens cannot hold the output staging")
    return stages


def _kernel(lens_ref, bt_ref, q_ref, cache_ref, *refs, num_splits: int, head_blocks: int,
            heads: int, rows: int, pages_per_split: int, pages_per_step: int, stages: int,
            block_size: int, max_blocks: int, value_width: int, scale: float,
            bt_lookahead: int, heads_minor: bool, interpret: bool):
    o_ref, *refs = refs
    lse_ref, refs = (refs[0], refs[1:]) if num_splits > 1 else (None, refs)
    q_smem, (ring, staging), lse_smem, q_bar, ready, free, done, *p_tiles = refs
    bs, tokens, half = block_size, pages_per_step * block_size, value_width // _CONSUMERS
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
    seq = cta // (head_blocks * num_splits)
    head_block = (cta // num_splits) % head_blocks
    split = lax.rem(cta, num_splits)
    item = seq * head_blocks + head_block
    length = lens_ref[seq]
    first = split * pages_per_split
    last = jnp.minimum(pl.cdiv(length, bs), first + pages_per_split)
    steps = pl.cdiv(jnp.maximum(last - first, 0), pages_per_step)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(item * rows, rows)], q_smem.at[pl.ds(0, rows)],
                                q_bar.at[0])

        def block_ids(j):
            """Step j's block ids, each read at its column clamped to the table: columns past
            the sequence hold the table's padding (a valid id) and their tokens are masked."""
            page0 = first + j * pages_per_step
            return tuple(bt_ref[seq, jnp.minimum(page0 + i, max_blocks - 1)]
                         for i in range(pages_per_step))

        def step(j, ahead):
            slot = lax.rem(j, stages)
            # Read before the slot wait (and `bt_lookahead` steps early): the ids' load latency
            # overlaps the wait and earlier copies.
            if bt_lookahead:
                blocks, ahead = ahead[:pages_per_step], (
                    *ahead[pages_per_step:], *block_ids(j + bt_lookahead))
            else:
                blocks = block_ids(j)
            pl.when(j >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
            for i, block in enumerate(blocks):
                plgpu.copy_gmem_to_smem(cache_ref.at[0, block], ring.at[slot, pl.ds(i * bs, bs)],
                                        ready.at[slot])
            return ahead

        ahead = sum((block_ids(j) for j in range(bt_lookahead)), ())
        lax.fori_loop(0, steps, step, ahead)
        observe_last_releases(steps, stages, free)

    def consume(w: int):
        """Consumer warpgroup w: every step's scores and softmax, P . V for value columns
        [w * V/2, (w + 1) * V/2), then that half of the output. Heads-major: S [64, T] and
        O_w [64, V/2], heads on wgmma's M; heads-minor: S^T [T, rows] and O_w^T [V/2, rows],
        tokens and value columns on M, the heads on N (no rows padded to 64)."""
        plgpu.set_max_registers(232, action="increase")
        head_axis, tok_axis = (1, 0) if heads_minor else (0, 1)
        stat_layout = plgpu.Layout.WGMMA.reduce(tok_axis)  # per-head statistics
        s_shape = (tokens, rows) if heads_minor else (WGMMA_ROWS, tokens)
        acc_shape = (half, rows) if heads_minor else (WGMMA_ROWS, half)
        n_stats = rows if heads_minor else WGMMA_ROWS
        p_tile = p_tiles[0].at[w] if p_tiles else None
        plgpu.barrier_wait(q_bar.at[0])

        def heads_bcast(x, shape):
            return lax.broadcast_in_dim(x, shape, [head_axis])

        def step(j, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(ready.at[slot])
            tile = ring.at[slot]
            values = tile.at[:, pl.ds(w * half, half)]

            def qk(acc_ref):
                if heads_minor:  # S^T = K Q^T
                    plgpu.wgmma(acc_ref, tile, q_smem.transpose((1, 0)))
                else:  # S = Q K^T
                    plgpu.wgmma(acc_ref, q_smem, tile.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(s_shape, jnp.float32))
            s = s * (scale * _LOG2E)  # log2 domain: exp2 below
            token = plgpu.broadcasted_iota(jnp.int32, s_shape, tok_axis,
                                           layout=plgpu.Layout.WGMMA)
            valid = length - (first + j * pages_per_step) * bs
            # NEG_INF is finite: a step with no visible key keeps m = NEG_INF, and its terms get
            # weight 0 once a visible key raises m (here or in the combine).
            s = jnp.where(token < valid, s, NEG_INF)
            m_new = jnp.maximum(m_i, s.max(axis=tok_axis))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - heads_bcast(m_new, s_shape))
            l_i = l_i * alpha + p.sum(axis=tok_axis)
            acc = acc * heads_bcast(alpha, acc_shape)
            if heads_minor:  # O^T += V^T P^T: P^T through shared memory (wgmma's B)
                p_tile.transpose((1, 0))[...] = p.astype(ring.dtype)
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, values.transpose((1, 0)), p_tile.transpose((1, 0)))

                # A fresh accumulator added after (at most [V/2, 32] f32: 64 registers a
                # thread): run_state does not lower with the ring slot's refs closed over.
                acc = acc + pl.run_scoped(lambda r: (pv(r), r[...])[1],
                                          plgpu.ACC(acc_shape, jnp.float32))
            else:
                acc = accumulate_pv(acc, p.astype(ring.dtype), values, p_tile)
            plgpu.barrier_arrive(free.at[slot])  # both warpgroups' arrivals free the slot
            return acc, m_new, l_i

        init = (plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((n_stats,), NEG_INF, jnp.float32), stat_layout),
                plgpu.layout_cast(jnp.zeros((n_stats,), jnp.float32), stat_layout))
        acc, m_i, l_i = lax.fori_loop(0, steps, step, init)
        # The staging tiles overlay the ring: wait until the other warpgroup's last P . V has
        # read it too.
        plgpu.barrier_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])
        # Empty rows (l == 0) have acc == 0 and come out as 0.
        out = (acc * heads_bcast(1.0 / jnp.maximum(l_i, 1e-30), acc_shape)).astype(
            staging.dtype)
        tile = staging.at[w]
        # Heads-major and heads-minor with one split: [64 or rows, V/2], heads on rows as the
        # output (heads-minor transposes on the store: 16-bit only). Heads-minor f32 parts:
        # [V/2, rows] as computed, into [C, items, V, rows] parts.
        transposed_part = heads_minor and num_splits > 1
        if heads_minor and not transposed_part:
            tile.transpose((1, 0))[...] = out
        else:
            tile[...] = out
        dst = o_ref if num_splits == 1 else o_ref.at[split]
        heads_here = min(heads, WGMMA_ROWS)
        base = seq * heads + head_block * heads_here
        if w == 0 and num_splits > 1:  # the part's log2-sum-exp; empty parts NEG_INF: weight 0
            lse_smem[...] = jnp.where(l_i > 0, m_i + jnp.log2(jnp.maximum(l_i, 1e-30)), NEG_INF)
        plgpu.commit_smem()
        if transposed_part:
            plgpu.copy_smem_to_gmem(tile, dst.at[item, pl.ds(w * half, half)])
        else:
            plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, heads_here)],
                                    dst.at[pl.ds(base, heads_here), pl.ds(w * half, half)])
        if w == 0 and num_splits > 1:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, item, pl.ds(0, n_stats)])
        plgpu.wait_smem_to_gmem(0)

    for w in range(_CONSUMERS):
        pl.when(wg == w)(functools.partial(consume, w))


def latent_decode_call(q, cache, block_tables, seq_lens, *, scale: float, value_width: int,
                       config: LatentDecodeConfig = LatentDecodeConfig(),
                       interpret: bool = False) -> tuple[jax.Array, ...]:
    """The kernel alone: (o [S * H, V] in the cache dtype,) with one split, else (o [C, S * H, V]
    f32 normalised parts (heads-minor: [C, items, V, rows]), lse [C, items, 64] f32 log2 units,
    entries 0..heads-1 of an item's 64 its heads; items = S * head blocks), plus the split
    count."""
    s, h, w = q.shape
    _, _, bs, _ = cache.shape
    why = unsupported(q.shape, cache.shape, cache.dtype, value_width, config)
    if why:
        raise ValueError(f"the Mosaic latent decode cannot run: {why}")
    dtype = cache.dtype
    heads_here = min(h, WGMMA_ROWS)
    head_blocks = h // heads_here
    rows = -(-heads_here // 8) * 8  # q rows per item: whole 8-row TMA tiles
    tokens = config.pages_per_step * bs
    plan = split_plan(s, h, w, bs, block_tables.shape[1], config)
    c = plan.num_splits
    hm = heads_minor(h, tokens, config)
    q_rows = rows if hm else WGMMA_ROWS  # the q tile: wgmma's N (heads-minor) or M
    stages = _stages(config.stages, tokens=tokens, width=w, value_width=value_width,
                     elem_bytes=jnp.dtype(dtype).itemsize, q_rows=q_rows,
                     p_tiles=hm or interpret)
    q2 = q.astype(dtype).reshape(s * head_blocks, heads_here, w)
    if rows != heads_here:
        q2 = jnp.pad(q2, ((0, 0), (0, rows - heads_here), (0, 0)))
    transforms = (plgpu.TilingTransform((8, config.swizzle // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(config.swizzle))
    half = value_width // _CONSUMERS
    part_dtype = dtype if c == 1 else jnp.float32
    # Heads-minor: the output tile is written transposed from the WGMMA layout, through a
    # swizzled tile (what Mosaic stores a transposed view into).
    if hm and c > 1:  # f32 parts as computed, [V/2, rows] (no transposed f32 store)
        staging = plgpu.SMEM((_CONSUMERS, half, q_rows), jnp.float32)
    else:
        staging = plgpu.SMEM((_CONSUMERS, q_rows, half), part_dtype, transforms=(
            plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if hm else ())
    if c == 1:
        out_type = (jax.ShapeDtypeStruct((s * h, value_width), dtype),)
    else:
        items = s * head_blocks
        out_type = (jax.ShapeDtypeStruct((c, items, value_width, q_rows) if hm else
                                         (c, s * h, value_width), jnp.float32),
                    jax.ShapeDtypeStruct((c, items, WGMMA_ROWS), jnp.float32))
    kernel = functools.partial(
        _kernel, num_splits=c, head_blocks=head_blocks, heads=h, rows=rows,
        pages_per_split=plan.pages_per_split, pages_per_step=config.pages_per_step,
        stages=stages, block_size=bs, max_blocks=block_tables.shape[1],
        value_width=value_width, scale=scale, bt_lookahead=config.bt_lookahead,
        heads_minor=hm, interpret=interpret)
    p_swizzle = min(128, tokens * jnp.dtype(dtype).itemsize)
    # P through shared memory: heads-minor always (P^T is wgmma's B there), else in interpret
    # mode only (mgpu_common.accumulate_pv).
    p_tiles = [plgpu.SMEM((_CONSUMERS, q_rows, tokens), dtype,
                          transforms=(plgpu.TilingTransform((8, p_swizzle // 2)),
                                      plgpu.SwizzleTransform(p_swizzle)))] * (hm or interpret)
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(
            plgpu.SMEM((q_rows, w), dtype, transforms=transforms),  # q tile
            # The ring, and the output staging tiles over it once every step is consumed.
            plgpu.RefUnion(plgpu.SMEM((stages, tokens, w), dtype, transforms=transforms),
                           staging),
            plgpu.SMEM((q_rows,), jnp.float32),  # lse row
            plgpu.Barrier(num_barriers=1),  # q tile loaded
            plgpu.Barrier(num_arrivals=config.pages_per_step, num_barriers=stages),  # slot full
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # slot free
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=1),  # both done with the ring
            *p_tiles,
        ),
        grid=(s * head_blocks * c,),
        grid_names=("cta",),
        kernel_name="latent_decode",
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32), q2.reshape(-1, w), cache)
    return (tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)), c


def _combine_heads_minor(o, lse, dtype) -> jax.Array:
    """Merge heads-minor parts o [C, items, V, rows] (normalised) by their log2-sum-exps
    lse [C, items, 64] (entries :rows) in XLA. -> [items * rows, V] (rows: the item's heads)."""
    c, items, v, rows = o.shape
    lse = lse[..., :rows]
    w = jnp.exp2(lse - lse.max(axis=0))  # an all-empty row: every weight 1, parts 0
    out = (w[:, :, None, :] * o).sum(axis=0) / w.sum(axis=0)[:, None, :]
    return out.transpose(0, 2, 1).reshape(items * rows, v).astype(dtype)


def latent_decode_mosaic(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                         value_width: int, softcap: float | None = None,
                         window: int | None = None, sinks: jax.Array | None = None,
                         config: LatentDecodeConfig = LatentDecodeConfig(),
                         interpret: bool = False) -> jax.Array:
    """The backend `decode` signature over a latent cache (k_cache = v_cache [1, NB, B, W]):
    [S, H, W] with the first `value_width` columns the attention output, the rest zeros."""
    if softcap or window is not None or sinks is not None:
        raise ValueError("the latent decode has no soft-cap, window or sinks")
    if k_cache.ndim != 4 or k_cache.shape[0] != 1 or (v_cache is not k_cache
                                                       and v_cache.shape != k_cache.shape):
        raise ValueError(f"expected one latent head as both K and V, got {k_cache.shape} and "
                         f"{v_cache.shape}")
    s, h, w = q.shape
    outs, c = latent_decode_call(q, k_cache, block_tables, seq_lens, scale=scale,
                                 value_width=value_width, config=config, interpret=interpret)
    if c == 1:
        out = outs[0]
    elif outs[0].ndim == 4:  # heads-minor parts [C, items, V, rows]
        out = _combine_heads_minor(*outs, k_cache.dtype)
    else:
        out = combine_split_parts(*outs, group=min(h, WGMMA_ROWS), q_padded=True,
                                  dtype=k_cache.dtype, pdl=False, interpret=interpret)
    out = out.reshape(s, h, value_width).astype(q.dtype)
    return jnp.pad(out, ((0, 0), (0, 0), (0, w - value_width))) if w > value_width else out


@dataclasses.dataclass(frozen=True)
class MosaicLatentDecode:
    """The Mosaic backend's decode over an MLA latent cache with its value width bound (hashable,
    so the attention jit's static backend stays one trace): the kernel where `unsupported` says
    it runs, else the jnp latent reference."""
    value_width: int
    config: LatentDecodeConfig = LatentDecodeConfig()

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                 softcap: float | None = None, window: int | None = None,
                 sinks: jax.Array | None = None) -> jax.Array:
        variant = dict(scale=scale, softcap=softcap, window=window, sinks=sinks)
        if unsupported(q.shape, k_cache.shape, k_cache.dtype, self.value_width, self.config):
            return paged_latent_decode(q, k_cache, v_cache, block_tables, seq_lens, **variant)
        return latent_decode_mosaic(q, k_cache, v_cache, block_tables, seq_lens,
                                    value_width=self.value_width, config=self.config, **variant)
