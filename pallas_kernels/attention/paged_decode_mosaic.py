"""Paged decode attention for Hopper in Mosaic GPU (`plgpu.kernel`): TMA page loads driven by the
block table, a warp-specialised pipeline several stages deep, and wgmma for both matmuls.

Design (numbers for the target shape Hq 32 / Hkv 8 / D 128 / page 16, bf16):
- The kernel is persistent: one CTA per SM, each walking a static round-robin list of items
  (sequence, kv head, context split). A producer warpgroup streams, item after item, the item's q
  rows into one of two q tiles and its K and V pages into a ring of `stages` shared-memory slots,
  so the next item's q and pages are in flight while the current one finishes: HBM never sees a
  per-item prologue/epilogue bubble, and no consumer waits for a q load of its own.
- One slot holds `pages_per_step` whole pages (P * block_size = 64 or 128 tokens); each page is one
  TMA copy of a contiguous [block_size, D] tile (4 KiB at page 16), which is what the head-major
  cache layout buys. All P copies of a slot arrive on one barrier (num_arrivals = P).
- Two consumer warpgroups take alternating slots (even slots: warpgroup 0, odd: warpgroup 1; the
  number of stages is even so each warpgroup always owns the same barriers and their phases stay
  in step). Each keeps its own online softmax; at the end of an item warpgroup 1 hands its state
  to warpgroup 0 through shared memory, and warpgroup 0 merges the two and stores one normalised
  result. With one split per sequence (batch x kv heads fills the GPU) that is the final output,
  written straight into [S * Hq, D] with no XLA op before or after the kernel; with several splits
  the kernel stores normalised fp32 parts and their log-sum-exp, and one small combine kernel
  (`split_combine_mosaic`, which PDL may launch early) merges them; `combine_parts_xla` is the same
  merge in XLA (`MosaicDecodeConfig.combine_kernel=False`).
- q is read unpadded where it can be: the G query heads of a kv head are rows [base, base + G)
  of q viewed as [S * Hq, D], and the producer copies the aligned 8-row TMA tile holding them
  (rows of other heads only produce rows never stored; the item's rows start at r0 = base % 8).
  That needs G | 8 or 8 | G, and 8 | S * Hq; other shapes get q padded to [S, Hkv, Gp, D].
- The G query heads are rows of a 64-row wgmma tile (wgmma's M is 64): S = Q K^T is [64, tokens],
  O += P V is [64, D]; the tensor cores do 64/G times the useful work. Softmax runs in the log2
  domain (exp2 with the scale folded in), accumulation is fp32.
- fp8 cache: `mgpu_fp8.py`; what bounds it and the shared-memory plan: `paged_decode_smem.py`.
- Window, sinks, softcap (cut tables, masks, sinks in the merge or combine): attention_variants.md.
- The kernel waits on `griddepcontrol.wait` before reading anything (programmatic dependent
  launch: its launch and set-up overlap the previous kernel's tail), and the producer reads block
  ids `bt_lookahead` steps ahead without waiting for the sequence length.
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

from pallas_kernels.common.device_info import num_sms
from pallas_kernels.attention.mgpu_common import accumulate_pv, scoped
from pallas_kernels.attention import mgpu_fp8
from pallas_kernels.attention.mgpu_fp8 import compute_dtype, tile_transforms
from pallas_kernels.attention.paged_decode_config import MosaicDecodeConfig
from pallas_kernels.attention.paged_decode_common import (
    NEG_INF,
    DecodeShape,
    check_decode_inputs,
    check_variant,
    plan_splits,
    window_view,
)
from pallas_kernels.attention.paged_decode_producer import produce
from pallas_kernels.attention.paged_decode_smem import fixed_bytes, profile_space, ring_stages
from pallas_kernels.attention.paged_decode_smem import WGMMA_ROWS as _WGMMA_ROWS
from pallas_kernels.attention.split_combine_mosaic import (DecodeLaunch, combine_parts_xla,
                                                           combine_split_parts, sink_rows)

_LOG2E = math.log2(math.e)
_NUM_CONSUMERS = 2
_PROFILE_EVENTS = 128  # the fewest profiler events per warpgroup (16 bytes of shared memory each)


def _decode_kernel(lens_ref, bt_ref, q_ref, k_ref, v_ref, *refs, shape: DecodeShape, gp: int,
                   q_padded: bool, num_splits: int, pages_per_split: int, pages_per_step: int,
                   stages: int, num_ctas: int, scale: float, softcap: float | None,
                   window: int | None, has_sinks: bool, bt_lookahead: int, pdl: bool,
                   interpret: bool, widen: bool, widen_layout: str,
                   shared: bool, pv_tokens: int, q_parts: int):
    # fp8 (widen): q_ref holds [2 (q_hi, q_lo), rows, D] in e4m3, and the first ref after it the
    # per-item 1 / c of `mgpu_fp8.split_q`.
    qinv_ref, refs = (refs[0], refs[1:]) if widen else (None, refs)
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    o_ref, *refs = refs
    lse_ref, refs = (refs[0], refs[1:]) if num_splits > 1 else (None, refs)
    (q_smem, k_smem, v_smem, tiles, vec_smem, out_tile, q_bar, q_free, k_bar, v_bar, k_free,
     v_free, x_full, x_free, *refs) = refs
    # shared (fp8_shared_scratch): the staging tiles, the hand-over tile and its unswizzled view
    # share one allocation (`mosaic_decode_call`), and `wide_free` says warpgroup 0 is done with
    # its staging tile for the item.
    wide_free, refs = (refs[0], refs[1:]) if shared else (None, refs)
    if shared:
        wide_all, x_smem, x_plain = tiles
    else:
        (x_smem, x_plain), wide_all = tiles, (refs[-1] if widen else None)
    y_smem, lse_smem = (out_tile, None) if num_splits == 1 else (None, out_tile)
    # Trailing scratch: the P tiles (interpret mode's stand-in), the fp8 V staging tiles.
    p_smem = refs[0] if interpret else None
    bs, d, g = shape.block_size, shape.head_dim, shape.group
    tokens = pages_per_step * bs
    hkv = shape.num_kv_heads
    num_items = shape.num_seqs * hkv * num_splits
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    my_items = pl.cdiv(num_items - cta, num_ctas)
    if pdl:
        plgpu.griddepcontrol_wait()  # q and the cache may come from the kernel just before
        if num_splits > 1:
            # Let the combine kernel launch now: its CTAs take the SMs this grid leaves idle or
            # frees, and wait (griddepcontrol.wait) until every part here is written.
            plgpu.griddepcontrol_launch_dependents()

    def q_rows(seq, head):
        """-> (first row of the item's q tile in q_ref, first output row, the item's first row
        in the tile)."""
        item = seq * hkv + head
        base = item * g
        if q_padded:
            return item * gp, base, 0
        return pl.multiple_of(base - lax.rem(base, 8), 8), base, lax.rem(base, 8)

    def item_info(it):
        """-> (seq, kv head, split, length, first page, steps) of this CTA's it-th item."""
        w = cta + it * num_ctas
        seq = w // (hkv * num_splits)
        head = (w // num_splits) % hkv
        split = w % num_splits
        length = lens_ref[seq]
        num_pages = pl.cdiv(length, bs)
        first = split * pages_per_split
        last = jnp.minimum(num_pages, first + pages_per_split)
        steps = pl.cdiv(jnp.maximum(last - first, 0), pages_per_step)
        return seq, head, split, length, first, steps

    k_load, v_load = (k_ref, k_smem, k_bar, k_free), (v_ref, v_smem, v_bar, v_free)
    producer = functools.partial(
        produce, my_items=my_items, item_info=item_info, q_rows=q_rows, bt_ref=bt_ref,
        head_pages=shape.max_blocks, bs=bs, pages_per_step=pages_per_step, stages=stages,
        bt_lookahead=bt_lookahead, gp=gp)
    q_load = (q_ref, q_smem, q_bar, q_free, 2 if widen else 1)  # fp8: q_hi, q_lo
    pl.when(wg == _NUM_CONSUMERS)(lambda: producer((k_load, v_load), q_load=q_load))

    @pl.when(wg < _NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        logit_scale = scale * (1.0 if softcap else _LOG2E)
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def item_body(it, g0):
            seq, head, split, length, first, steps = item_info(it)
            qb = lax.rem(it, 2)
            q_tile = q_smem.at[qb]
            with jax.named_scope("wait_q"):
                plgpu.barrier_wait(q_bar.at[qb])
            # This warpgroup owns the steps whose global slot parity equals its index.
            j0 = lax.rem(wg - lax.rem(g0, 2) + 2, 2)
            my_steps = pl.cdiv(jnp.maximum(steps - j0, 0), 2)

            # fp8: the item's logit scale carries 1 / c, q's scale in its fp8 tiles, and this
            # warpgroup's staging tile takes each step's V, widened while QK^T runs.
            item_scale = logit_scale * qinv_ref[seq * hkv + head] if widen else logit_scale
            wide = wide_all.at[wg] if widen else None
            chunks = tokens // pv_tokens  # fp8: V widened and P @ V run chunk by chunk

            @scoped("softmax")
            def softmax(s, valid, m_i, l_i, acc):
                """One step's online softmax: -> (P in the matmul dtype, m, l, acc rescaled)."""
                s = s * item_scale
                if softcap:
                    s = (softcap * _LOG2E) * jnp.tanh(s * (1.0 / softcap))
                col = plgpu.broadcasted_iota(jnp.int32, (_WGMMA_ROWS, tokens), 1,
                                             layout=plgpu.Layout.WGMMA)
                visible = col < valid
                if window is not None:  # keys before length - window: in the first page only
                    visible = visible & (col >= valid - window)
                # NEG_INF is finite: a step with no visible key keeps m = NEG_INF and its terms
                # get weight 0 once a visible key raises m (or in the merge).
                s = jnp.where(visible, s, NEG_INF)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                return p.astype(wide.dtype if widen else q_smem.dtype), m_new, l_i, acc

            def step(t, carry):
                acc, m_i, l_i = carry
                j = j0 + 2 * t
                slot = lax.rem(g0 + j, stages)
                with jax.named_scope("wait_k"):
                    plgpu.barrier_wait(k_bar.at[slot])
                k_tile = k_smem.at[slot]

                def widen_chunk(c):  # the last chunk's widening frees the fp8 slot
                    mgpu_fp8.widen(v_smem.at[slot, pl.ds(c * pv_tokens, pv_tokens)], wide,
                                   v_free.at[slot] if c == chunks - 1 else None, widen_layout)

                def widen_v():
                    plgpu.barrier_wait(v_bar.at[slot])
                    widen_chunk(0)
                widen_v = widen and widen_v

                def qk_fn(acc_ref):
                    if widen:  # (q_hi + q_lo) K^T (q_parts 1: q_hi K^T), K from the ring
                        for h in range(q_parts):
                            plgpu.wgmma(acc_ref, q_tile.at[h], k_tile.transpose((1, 0)))
                    else:
                        plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
                    if widen_v and not interpret:  # V widened while QK^T runs
                        widen_v()
                    return acc_ref[...]

                with jax.named_scope("qk"):
                    s = pl.run_scoped(qk_fn, plgpu.ACC((_WGMMA_ROWS, tokens), jnp.float32))
                if widen_v and interpret:  # no barrier wait inside a wgmma scope there
                    widen_v()
                plgpu.barrier_arrive(k_free.at[slot])
                valid = length - (first + j * pages_per_step) * bs
                p16, m_new, l_i, acc = softmax(s, valid, m_i, l_i, acc)
                p_tile = None if p_smem is None else p_smem.at[wg]
                if not widen:
                    with jax.named_scope("wait_v"):
                        plgpu.barrier_wait(v_bar.at[slot])
                    with jax.named_scope("pv"):
                        acc = accumulate_pv(acc, p16, v_smem.at[slot], p_tile)
                    plgpu.barrier_arrive(v_free.at[slot])
                for c in range(chunks if widen else 0):  # chunk c > 0: after chunk c - 1's P @ V
                    if c:
                        widen_chunk(c)
                    p_c = p16[:, c * pv_tokens:(c + 1) * pv_tokens] if chunks > 1 else p16
                    with jax.named_scope("pv"):
                        acc = accumulate_pv(acc, p_c, wide, p_tile)
                return acc, m_new, l_i

            init = (
                plgpu.layout_cast(jnp.zeros((_WGMMA_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((_WGMMA_ROWS,), NEG_INF, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((_WGMMA_ROWS,), jnp.float32), row_layout),
            )
            with jax.named_scope("kv_steps"):
                acc, m_i, l_i = lax.fori_loop(0, my_steps, step, init)
            plgpu.barrier_arrive(q_free.at[qb])
            if shared:  # warpgroup 0's last P @ V is done: its staging tile may take the hand-over
                pl.when(wg == 0)(lambda: plgpu.barrier_arrive(wide_free.at[0]))
            _, base, r0 = q_rows(seq, head)

            @pl.when(wg == 1)
            @scoped("hand_over")
            def _hand_over():  # warpgroup 1's softmax state -> warpgroup 0, via x_smem
                if shared:  # x_smem overlays both staging tiles
                    plgpu.barrier_wait(wide_free.at[0])
                else:
                    pl.when(it > 0)(lambda: plgpu.barrier_wait(x_free.at[0]))
                x_smem[...] = acc
                vec_smem.at[0][...] = m_i
                vec_smem.at[1][...] = l_i
                plgpu.barrier_arrive(x_full.at[0])
                if shared:  # the merge's reads are done before this warpgroup widens again
                    plgpu.barrier_wait(x_free.at[0])

            @pl.when(wg == 0)
            @scoped("merge_store")
            def _merge_and_store():
                with jax.named_scope("wait_x"):  # for warpgroup 1's hand-over
                    plgpu.barrier_wait(x_full.at[0])
                acc1 = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)
                m1 = plgpu.load(vec_smem.at[0], layout=row_layout, optimized=False)
                l1 = plgpu.load(vec_smem.at[1], layout=row_layout, optimized=False)
                # NEG_INF is finite, so two empty states give weights 1 and 0 / 0 never happens.
                m = jnp.maximum(m_i, m1)
                if sink_ref is not None:  # one split: the sinks (split_combine_mosaic.sink_rows)
                    sink = plgpu.load(sink_ref.at[seq * hkv + head], layout=row_layout,
                                      optimized=False)
                    m = jnp.maximum(m, sink)
                a0, a1 = jnp.exp2(m_i - m), jnp.exp2(m1 - m)
                col = lambda v: lax.broadcast_in_dim(v, acc.shape, [0])
                l = l_i * a0 + l1 * a1
                if sink_ref is not None:
                    l = l + jnp.exp2(sink - m)
                # Empty rows (l == 0) have acc == 0 and come out as 0.
                out = (acc * col(a0) + acc1 * col(a1)) * col(1.0 / jnp.maximum(l, 1e-30))
                if num_splits == 1:
                    plgpu.barrier_arrive(x_free.at[0])  # acc1 is in registers: x_smem is free
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last item's output left
                    y_smem[...] = out.astype(y_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(y_smem.at[pl.ds(r0, g)], o_ref.at[pl.ds(base, g)])
                else:
                    # Log-sum-exp of the part (log2 units); empty parts get NEG_INF: weight 0.
                    lse = jnp.where(l > 0, m + jnp.log2(jnp.maximum(l, 1e-30)), NEG_INF)
                    # The unswizzled view of the hand-over tile (acc1 is in registers; the store
                    # waits for the warpgroup's reads): a TMA source may start at any row r0.
                    x_plain[...] = out
                    lse_smem[...] = lse
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(x_plain.at[pl.ds(r0, g)],
                                            o_ref.at[split, pl.ds(base, g)])
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, seq * hkv + head])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(x_free.at[0])

            return g0 + steps

        lax.fori_loop(0, my_items, item_body, jnp.int32(0))

        if not shared:  # (shared: warpgroup 1 waited on every release already)
            @pl.when(wg == 1)
            def _():  # observe warpgroup 0's last release of x_smem (interpret mode checks phases)
                plgpu.barrier_wait(x_free.at[0])
        plgpu.wait_smem_to_gmem(0)


def mosaic_decode_call(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                       softcap: float | None = None, window: int | None = None,
                       sinks: jax.Array | None = None,
                       config: MosaicDecodeConfig = MosaicDecodeConfig(),
                       interpret: bool = False):
    """The kernel alone. Returns (outputs, launch): with one split per sequence outputs is
    (o [S * Hq, D] in the cache dtype, final); with several, (o [splits, S * Hq, D] fp32, each part
    normalised, lse [splits, S * Hkv, 64] fp32 in log2 units, row r0 + i of an item's 64 being its
    query head i) for `split_combine_mosaic.combine_split_parts` (or `combine_parts_xla`)."""
    shape = check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    check_variant(shape, window, sinks)
    block_tables, seq_lens = window_view(block_tables, seq_lens, window, shape.block_size)
    shape = dataclasses.replace(shape, max_blocks=block_tables.shape[1])
    bs, d, g = shape.block_size, shape.head_dim, shape.group
    cache_dtype, dtype = k_cache.dtype, compute_dtype(k_cache.dtype)  # fp8: computes in f16
    if cache_dtype != dtype and config.fp8_tokens_per_step:
        config = dataclasses.replace(config, tokens_per_step=config.fp8_tokens_per_step)
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"k_cache dtype {dtype} not supported: the Mosaic kernel needs bf16, "
                         f"f16 or fp8")
    if d % 64:
        raise ValueError(f"head_dim ({d}) must be a multiple of 64 for the Mosaic kernel")
    if bs % 8 or config.tokens_per_step % bs:
        raise ValueError(f"block_size ({bs}) must be a multiple of 8 dividing tokens_per_step "
                         f"({config.tokens_per_step})")
    if g > _WGMMA_ROWS:
        raise ValueError(f"num_q_heads / num_kv_heads ({g}) must be <= {_WGMMA_ROWS}")
    pages_per_step = config.tokens_per_step // bs
    num_ctas = config.num_ctas or num_sms()
    plan = plan_splits(shape, pages_per_step=pages_per_step,
                       workers=config.split_workers or num_ctas, num_splits=config.num_splits)
    elem_bytes = jnp.dtype(dtype).itemsize
    widen = cache_dtype != dtype  # fp8: q split in two e4m3 tiles, V widened to float16
    num_threads = _NUM_CONSUMERS + 1
    # fp8: the hand-over and output tiles may overlay the V staging tiles, which may hold a chunk
    # of a step's tokens (paged_decode_smem.py).
    shared = widen and config.fp8_shared_scratch
    pv_tokens = (config.fp8_pv_tokens if widen else None) or config.tokens_per_step
    profiling = bool(config.profile_dir) and not interpret
    gp = max(8, -(-g // 8) * 8)  # rows per q tile copy: G rounded up to whole 8-row TMA tiles
    fixed = fixed_bytes(
        d=d, elem_bytes=elem_bytes, one_split=plan.num_splits == 1,
        staging_tokens=pv_tokens * widen, shared=shared,
        p_tokens=pv_tokens * interpret, num_consumers=_NUM_CONSUMERS)
    stages = ring_stages(config.stages, fixed, tokens=config.tokens_per_step, d=d,
                         cache_bytes=jnp.dtype(cache_dtype).itemsize)
    # The profiler's event buffers take the shared memory the ring leaves, so a profiled kernel
    # keeps the ring of the timed one; with too little left, one slot pair less.
    profile_events = profiling and profile_space(
        fixed, stages, tokens=config.tokens_per_step, d=d,
        cache_bytes=jnp.dtype(cache_dtype).itemsize, num_threads=num_threads)
    if profiling and profile_events < _PROFILE_EVENTS:
        stages, profile_events = max(2, stages - 2), _PROFILE_EVENTS
    s, hkv, hq = shape.num_seqs, shape.num_kv_heads, shape.num_q_heads
    q_padded = not ((8 % g == 0 or g % 8 == 0) and (s * hq) % 8 == 0)
    q2 = q.reshape(s * hkv, g, d)
    if widen:  # q -> (q_hi, q_lo) in the cache's fp8 type, and the per-item 1 / c
        q_hi, q_lo, qinv = mgpu_fp8.split_q(q2, cache_dtype)
        q2, extra_inputs = jnp.stack([q_hi, q_lo]), (qinv,)
    else:
        q2, extra_inputs = q2.astype(dtype)[None], ()
    if q_padded:
        q2 = jnp.pad(q2, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    q2 = q2.reshape(2, -1, d) if widen else q2.reshape(-1, d)
    has_sinks = sinks is not None and plan.num_splits == 1  # else the combine takes them
    if has_sinks:
        extra_inputs += (sink_rows(sinks, shape, q_padded),)
    num_ctas = min(num_ctas, s * hkv * plan.num_splits)
    swizzle = 128
    transforms = (plgpu.TilingTransform((8, swizzle // elem_bytes)),
                  plgpu.SwizzleTransform(swizzle))
    f32_transforms = (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))
    q_tiles = (plgpu.SMEM((2, 2, _WGMMA_ROWS, d), cache_dtype,
                          transforms=tile_transforms(cache_dtype, d)) if widen else
               plgpu.SMEM((2, _WGMMA_ROWS, d), dtype, transforms=transforms))
    tokens = config.tokens_per_step
    if plan.num_splits == 1:
        out_type = (jax.ShapeDtypeStruct((s * hq, d), dtype),)
        out_scratch = (plgpu.SMEM((_WGMMA_ROWS, d), dtype),)  # final output tile
    else:
        out_type = (jax.ShapeDtypeStruct((plan.num_splits, s * hq, d), jnp.float32),
                    jax.ShapeDtypeStruct((plan.num_splits, s * hkv, _WGMMA_ROWS), jnp.float32))
        out_scratch = (plgpu.SMEM((_WGMMA_ROWS,), jnp.float32),)  # lse row
    kernel = functools.partial(
        _decode_kernel, shape=shape, gp=gp, q_padded=q_padded, num_splits=plan.num_splits,
        pages_per_split=plan.pages_per_split, pages_per_step=pages_per_step, stages=stages,
        num_ctas=num_ctas, scale=scale, softcap=softcap, window=window, has_sinks=has_sinks,
        bt_lookahead=config.bt_lookahead,
        pdl=config.pdl and not interpret, interpret=interpret, widen=widen,
        widen_layout=config.fp8_widen_layout, shared=shared, pv_tokens=pv_tokens,
        q_parts=1 + config.fp8_q_split)
    x_tiles = (plgpu.SMEM((_WGMMA_ROWS, d), jnp.float32, transforms=f32_transforms),
               plgpu.SMEM((_WGMMA_ROWS, d), jnp.float32))
    wide_tiles = plgpu.SMEM((_NUM_CONSUMERS, pv_tokens, d), dtype, transforms=transforms)
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(
            q_tiles,  # two items' q (fp8: each as q_hi, q_lo)
            plgpu.SMEM((stages, tokens, d), cache_dtype, transforms=tile_transforms(cache_dtype, d)),
            plgpu.SMEM((stages, tokens, d), cache_dtype, transforms=tile_transforms(cache_dtype, d)),
            # The hand-over tile, swizzled so the WGMMA-layout store and load are free of bank
            # conflicts; its unswizzled view stages the fp32 part when split; shared: both over
            # the V staging tiles.
            plgpu.RefUnion(wide_tiles, *x_tiles) if shared else plgpu.RefUnion(*x_tiles),
            plgpu.SMEM((2, _WGMMA_ROWS), jnp.float32),  # warpgroup 1's m and l
            *out_scratch,
            plgpu.Barrier(num_arrivals=1 + widen, num_barriers=2),  # q tile filled
            plgpu.Barrier(num_arrivals=_NUM_CONSUMERS, num_barriers=2),  # q tile free
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=stages),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=1),  # hand-over tile filled (warpgroup 1 -> 0)
            plgpu.Barrier(num_barriers=1),  # hand-over tile free (warpgroup 0 -> 1)
            *[plgpu.Barrier(num_barriers=1)] * shared,  # warpgroup 0's staging tile idle
            *[plgpu.SMEM((_NUM_CONSUMERS, _WGMMA_ROWS, pv_tokens), dtype, transforms=transforms)]
            * interpret,
            *[wide_tiles] * (widen and not shared),
        ),
        grid=(num_ctas,),
        grid_names=("cta",),
        kernel_name="paged_decode",  # what profiles show
        num_threads=num_threads,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **(dict(profile_space=profile_events, profile_dir=config.profile_dir,
                                      profile_bounds_check=True)
                                 if profiling else {})),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32), q2, k_cache, v_cache,
      *extra_inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return tuple(outs), DecodeLaunch(shape, plan.num_splits, q_padded)


def paged_decode_mosaic(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                        softcap: float | None = None, window: int | None = None,
                        sinks: jax.Array | None = None,
                        config: MosaicDecodeConfig = MosaicDecodeConfig(),
                        interpret: bool = False) -> jax.Array:
    """Paged decode attention (backend `decode` signature), Mosaic GPU (Hopper). `config`: the
    kernel's tuning (the default is the production kernel). `interpret`: Mosaic GPU's interpreter
    (CPU tests)."""
    outs, launch = mosaic_decode_call(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      softcap=softcap, window=window, sinks=sinks, config=config,
                                      interpret=interpret)
    sinks2 = None if sinks is None else sinks.astype(jnp.float32) * _LOG2E
    if launch.num_splits == 1:
        out = outs[0]
    elif config.combine_kernel:
        out = combine_split_parts(*outs, group=launch.shape.group, q_padded=launch.q_padded,
                                  dtype=compute_dtype(k_cache.dtype), pdl=config.pdl,
                                  sinks=sinks2, interpret=interpret)
    else:
        out = combine_parts_xla(*outs, launch, sinks2)
    return out.reshape(q.shape).astype(q.dtype)

