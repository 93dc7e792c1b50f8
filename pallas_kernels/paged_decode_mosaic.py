"""Paged decode attention for Hopper in Mosaic GPU (`plgpu.kernel`): TMA page loads driven by the
block table, a warp-specialised pipeline several stages deep, and wgmma for both matmuls.

Design (numbers for the target shape Hq 32 / Hkv 8 / D 128 / page 16, bf16):
- The kernel is persistent: one CTA per SM, each walking a static round-robin list of items
  (sequence, kv head, context split). A producer warpgroup streams K and V pages for item after
  item into a ring of `stages` shared-memory slots, so loads for the next item are in flight while
  the current one finishes: HBM never sees the per-item prologue/epilogue bubble.
- One slot holds `pages_per_step` whole pages (P * block_size = 64 or 128 tokens); each page is one
  TMA copy of a contiguous [block_size, D] tile (4 KiB at page 16), which is what the head-major
  cache layout buys. All P copies of a slot arrive on one barrier (num_arrivals = P).
- Two consumer warpgroups take alternating slots (even slots: warpgroup 0, odd: warpgroup 1; the
  number of stages is even so each warpgroup always owns the same barriers and their phases stay
  in step). Each keeps its own online softmax, so one item yields two partial results that the
  flash-decoding combine (`combine_splits`, XLA) merges together with any context splits.
- The G query heads of a kv head are the first rows of a 64-row wgmma tile (wgmma's M is 64), so
  S = Q K^T is [64, tokens] and O += P V is [64, D]; rows past G carry no query and are
  discarded. The tensor cores do 64/G times the useful work, which at these sizes still fits under
  the memory time of a step (see docs/ARCHITECTURE.md, "Kernels: paged decode").
- Softmax runs in the log2 domain (exp2 with the scale folded in), accumulation is fp32.
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

from pallas_kernels.paged_decode_common import (NEG_INF, DecodeShape, check_decode_inputs,
                                                combine_splits, plan_splits)

_WGMMA_ROWS = 64
_LOG2E = math.log2(math.e)
_NUM_CONSUMERS = 2
_SMEM_BUDGET = 227 * 1024 - 4096  # 227 KiB per block, less what Mosaic adds (barriers, alignment)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    tokens_per_step: int = 64  # K/V tokens per pipeline slot: a multiple of 64 (wgmma N tiling)
    stages: int | None = None  # slots in the ring; even (see module docstring); default: as
    # many as fit in shared memory
    num_ctas: int | None = None  # persistent CTAs; default: one per SM
    split_workers: int | None = None  # workers the split plan balances over; default: num_ctas


def _num_sms() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def _decode_kernel(lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, qo_smem,
                   m_smem, l_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free, p_smem,
                   *, shape: DecodeShape, gp: int, num_splits: int, pages_per_split: int,
                   pages_per_step: int, stages: int, num_ctas: int, scale: float,
                   softcap: float | None):
    bs, d = shape.block_size, shape.head_dim
    tokens = pages_per_step * bs
    hkv = shape.num_kv_heads
    num_items = shape.num_seqs * hkv * num_splits
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    my_items = pl.cdiv(num_items - cta, num_ctas)

    def item_info(it):
        """-> (seq, kv head, split, length, first page, pages in the sequence, steps) of this
        CTA's it-th item."""
        w = cta + it * num_ctas
        seq = w // (hkv * num_splits)
        head = (w // num_splits) % hkv
        split = w % num_splits
        length = lens_ref[seq]
        num_pages = pl.cdiv(length, bs)
        first = split * pages_per_split
        last = jnp.minimum(num_pages, first + pages_per_split)
        steps = pl.cdiv(jnp.maximum(last - first, 0), pages_per_step)
        return seq, head, split, length, first, num_pages, steps

    @pl.when(wg == _NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def item_body(it, g0):
            seq, head, _, _, first, num_pages, steps = item_info(it)

            @pl.loop(0, steps)
            def _step(j):
                g = g0 + j
                slot = lax.rem(g, stages)
                page0 = first + j * pages_per_step
                # Block ids are read before waiting for the slot, so their load latency overlaps
                # the wait. Pages past the sequence's last one re-read its last page (masked
                # later): every copy reads real, finite data and the barrier count stays fixed.
                blocks = [bt_ref[seq, jnp.minimum(page0 + i, num_pages - 1)]
                          for i in range(pages_per_step)]

                def load(cache_ref, smem, ready, free):
                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(free.at[slot])
                    for i, block in enumerate(blocks):
                        plgpu.copy_gmem_to_smem(cache_ref.at[head, block],
                                                smem.at[slot, pl.ds(i * bs, bs)], ready.at[slot])

                load(k_ref, k_smem, k_bar, k_free)
                load(v_ref, v_smem, v_bar, v_free)

            return g0 + steps

        total_steps = lax.fori_loop(0, my_items, item_body, jnp.int32(0))
        # Drain: wait for the consumers to free the last fill of every slot, so no barrier phase
        # is left unobserved when the kernel ends (GPU interpret mode checks this).
        for i in range(stages):
            @pl.when(total_steps > i)
            def _():
                plgpu.barrier_wait(k_free.at[i])
                plgpu.barrier_wait(v_free.at[i])

    @pl.when(wg < _NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        # One [64, D] buffer per warpgroup holds q during an item and its output after it. Rows
        # >= G start at zero and later hold finite leftovers of earlier outputs: wgmma rows are
        # independent, so they only produce rows that are never stored.
        my_qo = qo_smem.at[wg]
        my_m, my_l = m_smem.at[wg], l_smem.at[wg]
        my_qo[...] = jnp.zeros((_WGMMA_ROWS, d), qo_smem.dtype)
        plgpu.commit_smem()
        logit_scale = scale * (1.0 if softcap else _LOG2E)

        def item_body(it, g0):
            seq, head, split, length, first, _, steps = item_info(it)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last item's output left smem
            plgpu.copy_gmem_to_smem(q_ref.at[seq, head], my_qo.at[pl.ds(0, gp)], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            # This warpgroup owns the steps whose global slot parity equals its index.
            j0 = lax.rem(wg - lax.rem(g0, 2) + 2, 2)
            my_steps = pl.cdiv(jnp.maximum(steps - j0, 0), 2)

            def step(t, carry):
                acc, m_i, l_i = carry
                j = j0 + 2 * t
                slot = lax.rem(g0 + j, stages)
                plgpu.barrier_wait(k_bar.at[slot])

                def qk_fn(acc_ref):
                    plgpu.wgmma(acc_ref, my_qo, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(qk_fn, plgpu.ACC((_WGMMA_ROWS, tokens), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * logit_scale
                if softcap:
                    s = (softcap * _LOG2E) * jnp.tanh(s * (1.0 / softcap))
                col = plgpu.broadcasted_iota(jnp.int32, (_WGMMA_ROWS, tokens), 1,
                                             layout=plgpu.Layout.WGMMA)
                valid = length - (first + j * pages_per_step) * bs
                s = jnp.where(col < valid, s, NEG_INF)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(v_smem.dtype)
                plgpu.barrier_wait(v_bar.at[slot])

                acc = _accumulate_pv(acc, p16, v_smem.at[slot],
                                     None if p_smem is None else p_smem.at[wg])
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            init = (
                plgpu.layout_cast(jnp.zeros((_WGMMA_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((_WGMMA_ROWS,), NEG_INF, jnp.float32),
                                  plgpu.Layout.WGMMA.reduce(1)),
                plgpu.layout_cast(jnp.zeros((_WGMMA_ROWS,), jnp.float32),
                                  plgpu.Layout.WGMMA.reduce(1)),
            )
            acc, m_i, l_i = lax.fori_loop(0, my_steps, step, init)
            # Normalised output in the cache dtype (the final output's precision); empty rows
            # (l == 0) have acc == 0 and give 0.
            norm = 1.0 / jnp.maximum(l_i, 1e-30)
            my_qo[...] = (acc * lax.broadcast_in_dim(norm, acc.shape, [0])).astype(qo_smem.dtype)
            my_m[...] = m_i
            my_l[...] = l_i
            plgpu.commit_smem()
            part = split * _NUM_CONSUMERS + wg
            plgpu.copy_smem_to_gmem(my_qo.at[pl.ds(0, gp)], o_ref.at[seq, head, part])
            plgpu.copy_smem_to_gmem(my_m, m_ref.at[seq, head, part])
            plgpu.copy_smem_to_gmem(my_l, l_ref.at[seq, head, part])
            return g0 + steps

        lax.fori_loop(0, my_items, item_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)


def _accumulate_pv(acc, p16, v_tile, p_smem):
    """acc + P @ V. On the GPU P stays in registers (wgmma's A operand may live there). GPU
    interpret mode (CPU tests) supports neither register operands nor `run_state`, so there P goes
    through shared memory and the product is added to acc afterwards: same math, other plumbing."""
    if p_smem is None:
        def pv_fn(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_tile)

        return pl.run_state(pv_fn)(plgpu.ACC.init(acc))
    p_smem[...] = p16
    plgpu.commit_smem()

    def pv_fn(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    return acc + pl.run_scoped(pv_fn, plgpu.ACC(acc.shape, jnp.float32))


def mosaic_decode_partials(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                           softcap: float | None = None,
                           config: MosaicDecodeConfig = MosaicDecodeConfig(),
                           interpret: bool = False):
    """The kernel alone: per-part outputs (o [S, Hkv, parts, Gp, D] normalised within the part, in
    the cache dtype; m [S, Hkv, parts, 64] in log2 units; l likewise) before the combine."""
    shape = check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    bs, d, g = shape.block_size, shape.head_dim, shape.group
    dtype = k_cache.dtype
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"k_cache dtype {dtype} not supported: the Mosaic kernel needs bf16/f16")
    if d % 64:
        raise ValueError(f"head_dim ({d}) must be a multiple of 64 for the Mosaic kernel")
    if bs % 8 or config.tokens_per_step % bs or config.tokens_per_step % 64:
        raise ValueError(f"block_size ({bs}) must be a multiple of 8 dividing tokens_per_step "
                         f"({config.tokens_per_step}), itself a multiple of 64")
    elem_bytes = jnp.dtype(dtype).itemsize
    stage_bytes = 2 * config.tokens_per_step * d * elem_bytes  # K and V
    fixed_bytes = _NUM_CONSUMERS * _WGMMA_ROWS * (d * elem_bytes + 8)  # q/o tiles, m, l
    if interpret:
        fixed_bytes += _NUM_CONSUMERS * _WGMMA_ROWS * config.tokens_per_step * elem_bytes
    stages = config.stages or 2 * ((_SMEM_BUDGET - fixed_bytes) // stage_bytes // 2)
    if stages < 2 or stages % 2:
        raise ValueError(f"stages ({stages}) must be even and >= 2 (shared memory holds "
                         f"{(_SMEM_BUDGET - fixed_bytes) // stage_bytes} stages of "
                         f"{config.tokens_per_step} tokens at head_dim {d})")
    if g > _WGMMA_ROWS:
        raise ValueError(f"num_q_heads / num_kv_heads ({g}) must be <= {_WGMMA_ROWS}")
    pages_per_step = config.tokens_per_step // bs
    num_ctas = config.num_ctas or _num_sms()
    plan = plan_splits(shape, pages_per_step=pages_per_step,
                       workers=config.split_workers or num_ctas)
    # No padding of the block table: the producer never indexes past a sequence's last page.
    bt = block_tables.astype(jnp.int32)
    gp = max(8, -(-g // 8) * 8)  # TMA rows of q / o: a whole 8-row tile
    qg = q.astype(dtype).reshape(shape.num_seqs, shape.num_kv_heads, g, d)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    s, hkv = shape.num_seqs, shape.num_kv_heads
    parts = plan.num_splits * _NUM_CONSUMERS
    num_ctas = min(num_ctas, s * hkv * plan.num_splits)

    swizzle = 128
    kv_transforms = (plgpu.TilingTransform((8, swizzle // elem_bytes)),
                     plgpu.SwizzleTransform(swizzle))
    tokens = config.tokens_per_step
    kernel = functools.partial(
        _decode_kernel, shape=shape, gp=gp, num_splits=plan.num_splits,
        pages_per_split=plan.pages_per_split, pages_per_step=pages_per_step, stages=stages,
        num_ctas=num_ctas, scale=scale, softcap=softcap)
    o, m, l = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((s, hkv, parts, gp, d), dtype),
                  jax.ShapeDtypeStruct((s, hkv, parts, _WGMMA_ROWS), jnp.float32),
                  jax.ShapeDtypeStruct((s, hkv, parts, _WGMMA_ROWS), jnp.float32)),
        scratch_types=(
            plgpu.SMEM((_NUM_CONSUMERS, _WGMMA_ROWS, d), dtype, transforms=kv_transforms),
            plgpu.SMEM((_NUM_CONSUMERS, _WGMMA_ROWS), jnp.float32),
            plgpu.SMEM((_NUM_CONSUMERS, _WGMMA_ROWS), jnp.float32),
            plgpu.SMEM((stages, tokens, d), dtype, transforms=kv_transforms),
            plgpu.SMEM((stages, tokens, d), dtype, transforms=kv_transforms),
            plgpu.Barrier(num_barriers=_NUM_CONSUMERS),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=stages),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            (plgpu.SMEM((_NUM_CONSUMERS, _WGMMA_ROWS, tokens), dtype, transforms=kv_transforms)
             if interpret else None),
        ),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=_NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(seq_lens.astype(jnp.int32), bt, qg, k_cache, v_cache)
    return o, m, l


def paged_decode_mosaic_configured(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                                   softcap: float | None = None,
                                   config: MosaicDecodeConfig = MosaicDecodeConfig(),
                                   interpret: bool = False) -> jax.Array:
    """`paged_decode_mosaic` with its tuning knobs exposed (benchmarks, tests)."""
    shape = check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    o, m, l = mosaic_decode_partials(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                     softcap=softcap, config=config, interpret=interpret)
    # Each part's o is normalised and its m is in log2 units (exp2 softmax); the combine takes
    # unnormalised fp32 o and natural-log m.
    o = o.astype(jnp.float32) * l[..., : o.shape[3], None]
    return combine_splits(o, m * math.log(2.0), l, shape, q.dtype)


def paged_decode_mosaic(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                        softcap: float | None = None) -> jax.Array:
    """Paged decode attention (backend `decode` signature), Mosaic GPU (Hopper)."""
    return paged_decode_mosaic_configured(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                          softcap=softcap)
