"""The fp8-cache decode consumer in the transposed ("swap-AB") formulation
(`MosaicDecodeConfig.fp8_swap`): the paged decode kernel's producer, ring and item walk
(`paged_decode_mosaic`) with a consumer warpgroup that puts the KV tokens on wgmma's M side.

With GQA only G query heads (4 at Hq 32 / Hkv 8) share a kv head, so the M = 64 query rows of the
plain kernel's wgmma tiles are mostly padding, and its softmax and accumulator rescale run over
all 64 rows. Transposed, per step of T tokens:

    S^T [T, N] = K [T, D] . (q_hi + q_lo)^T [D, N]   two e4m3 wgmmas, K straight from the ring
    P^T = exp2(S^T - m)                               softmax over the token axis (axis 0)
    O^T [D, N] += V^T [D, T] . P^T [T, N]             V^T: the float16 staging tile, transposed

with N = the G heads rounded up to 8 (`gp`), so the tensor-core work, the softmax and the
accumulator (D x N fp32: 8 registers a thread) shrink by 64 / N. K is K-major, so it is a valid
fp8 operand as it lies; V is read MN-major by the second product, so it is still widened to
float16 (by the consumer while its QK^T wgmmas run); P^T goes
through a small [N, T] shared-memory tile (wgmma's B operand lives in shared memory). The row sum
l is kept per token row and reduced once per item; the running max needs one cross-warp
reduction per step. One split per sequence, no window or sinks (the launcher uses the plain
consumer otherwise).

History (docs/kernels/paged_decode.md, "FP8 KV cache"): built in issue 26, timed at 75.6 % of the
read ceiling in a form whose consumers raced on their reduction scratch, fixed (each consumer's
own `reduce` scratch) and checked on the H200, deleted untimed in issue 39, restored beside the
plain consumer in issue 45 so `benchmarks/bench_quant_kv.py` times both in one run.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.mgpu_fp8 import tile_transforms, widen
from pallas_kernels.attention.paged_decode_common import NEG_INF

_LOG2E = math.log2(math.e)


def widen_slot(ring, ready, free, slot, wide, layout: str = "WGMMA_8BIT") -> None:
    """Wait for ring slot `slot` to land, then `mgpu_fp8.widen` it into `wide` (the whole step)."""
    plgpu.barrier_wait(ready.at[slot])
    widen(ring.at[slot], wide, free.at[slot], layout)


def _pv(acc, v_t, p_t, interpret: bool):
    """acc + V^T @ P^T (both operands in shared memory); the interpreter has no run_state."""
    if interpret:
        def scoped(acc_ref):
            plgpu.wgmma(acc_ref, v_t, p_t)
            return acc_ref[...]
        return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))

    def fn(acc_ref):
        plgpu.wgmma(acc_ref, v_t, p_t)
    return pl.run_state(fn)(plgpu.ACC.init(acc))


# The softmax's max and sum over the token axis span the warpgroup's 4 warps: a cross-warp
# reduction through shared memory. Pallas gives it a scratch right after the shared memory live at
# that point, the same for both consumers (which then race), and moving warpgroup 1's past it with
# a thread-collective `run_scoped` puts a CTA-wide barrier (bar.sync 0) in warpgroup 1's step that
# no other warpgroup reaches: the kernel hung on the H200. So each consumer reduces through
# Mosaic GPU's own `reduce` with a scratch of its own (`swap_scratch`'s "red"), which synchronises
# its warpgroup only (bar.sync 1 + wg).
_REDUCTION_SCRATCH = 512  # float32s per consumer; Mosaic needs 4 warps x 32 lanes x vector width


def _reduce(op: str, x, scratch, interpret: bool):
    """x [tokens, N] (WGMMA layout) reduced over the token axis with `op` ("max" or "add") in this
    warpgroup's `scratch`; the interpreter has no cross-warp scratch and takes the jnp form."""
    if interpret:
        return x.max(axis=0) if op == "max" else x.sum(axis=0)
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((x.shape[1],), x.dtype,
                                                          layout=layout.reduce(0)))
    def reduce(_, arr, scratch_ref):
        return arr.reduce(op, 0, scratch=scratch_ref)
    return reduce(x, scratch)


def swap_consumer(*, wg: int, my_items, item_info, q_rows, refs: dict, hkv: int, g: int, bs: int,
                  pages_per_step: int, stages: int, logit_scale: float, softcap: float | None,
                  interpret: bool, widen_layout: str, q_parts: int = 2) -> None:
    """Consumer warpgroup `wg` (0 or 1, static) of the transposed kernel: the steps of each item whose
    global slot parity is `wg`, then warpgroup 1 hands its state to warpgroup 0, which merges and
    stores the item's G output rows. `refs`: the kernel's refs by name."""
    r = refs
    q_smem, k_smem, v_smem = r["q_smem"], r["k_smem"], r["v_smem"]
    n, d = q_smem.shape[-2], q_smem.shape[-1]
    tokens = k_smem.shape[1]
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    wgd = lax.axis_index("wg")  # == wg, traced: refs indexed by a constant break run_state
    p_tile = r["p_smem"].at[wgd]
    red = r["red_smem"].at[wgd]
    cols = lambda v, shape: lax.broadcast_in_dim(v, shape, [1])

    def item_body(it, g0):
        seq, head, _, length, first, steps = item_info(it)
        qb = lax.rem(it, 2)
        with jax.named_scope("wait_q"):
            plgpu.barrier_wait(r["q_bar"].at[qb])
        j0 = lax.rem(wgd - lax.rem(g0, 2) + 2, 2)
        my_steps = pl.cdiv(jnp.maximum(steps - j0, 0), 2)
        item_scale = logit_scale * r["qinv_ref"][seq * hkv + head]

        def step(t, carry):
            acc, m_i, l_acc = carry
            j = j0 + 2 * t
            slot = lax.rem(g0 + j, stages)
            wide = r["wide"].at[wgd]  # this consumer's V staging tile
            with jax.named_scope("wait_k"):
                plgpu.barrier_wait(r["k_bar"].at[slot])
            k_tile = k_smem.at[slot]

            def widen_v():
                widen_slot(v_smem, r["v_bar"], r["v_free"], slot, wide, widen_layout)

            def qk_fn(acc_ref):
                for h in range(q_parts):  # q_hi, then q_lo (q_parts 1: q_hi alone)
                    plgpu.wgmma(acc_ref, k_tile, q_smem.at[qb, h].transpose((1, 0)))
                if not interpret:  # V widened while QK^T runs
                    widen_v()
                return acc_ref[...]

            with jax.named_scope("qk"):
                s = pl.run_scoped(qk_fn, plgpu.ACC((tokens, n), jnp.float32))
            if interpret:  # no barrier wait inside a wgmma scope there
                widen_v()
            plgpu.barrier_arrive(r["k_free"].at[slot])
            s = s * item_scale
            if softcap:
                s = (softcap * _LOG2E) * jnp.tanh(s * (1.0 / softcap))
            row = plgpu.broadcasted_iota(jnp.int32, (tokens, n), 0, layout=plgpu.Layout.WGMMA)
            valid = length - (first + j * pages_per_step) * bs
            s = jnp.where(row < valid, s, NEG_INF)
            m_new = jnp.maximum(m_i, _reduce("max", s, red, interpret))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - cols(m_new, s.shape))
            l_acc = l_acc * cols(alpha, s.shape) + p  # summed over tokens once per item
            acc = acc * cols(alpha, acc.shape)
            p_tile.transpose((1, 0))[...] = p.astype(p_tile.dtype)
            plgpu.commit_smem()
            with jax.named_scope("pv"):
                acc = _pv(acc, wide.transpose((1, 0)), p_tile.transpose((1, 0)), interpret)
            return acc, m_new, l_acc

        init = (
            plgpu.layout_cast(jnp.zeros((d, n), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((n,), NEG_INF, jnp.float32), col_layout),
            plgpu.layout_cast(jnp.zeros((tokens, n), jnp.float32), plgpu.Layout.WGMMA),
        )
        with jax.named_scope("kv_steps"):
            acc, m_i, l_acc = lax.fori_loop(0, my_steps, step, init)
        plgpu.barrier_arrive(r["q_free"].at[qb])
        l_i = _reduce("add", l_acc, red, interpret)
        _, base, r0 = q_rows(seq, head)
        x_smem, vec_smem, y_smem = r["x_smem"], r["vec_smem"], r["y_smem"]

        if wg == 1:  # warpgroup 1's softmax state -> warpgroup 0
            @pl.when(it > 0)
            def _():
                plgpu.barrier_wait(r["x_free"].at[0])
            x_smem[...] = acc
            vec_smem.at[0][...] = m_i
            vec_smem.at[1][...] = l_i
            plgpu.barrier_arrive(r["x_full"].at[0])

        else:
            plgpu.barrier_wait(r["x_full"].at[0])
            acc1 = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)
            m1 = plgpu.load(vec_smem.at[0], layout=col_layout, optimized=False)
            l1 = plgpu.load(vec_smem.at[1], layout=col_layout, optimized=False)
            plgpu.barrier_arrive(r["x_free"].at[0])  # acc1, m1, l1 are in registers
            m = jnp.maximum(m_i, m1)
            a0, a1 = jnp.exp2(m_i - m), jnp.exp2(m1 - m)
            l = l_i * a0 + l1 * a1
            out = ((acc * cols(a0, acc.shape) + acc1 * cols(a1, acc.shape))
                   * cols(1.0 / jnp.maximum(l, 1e-30), acc.shape))  # empty rows: acc == 0
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's output left
            y_smem.transpose((1, 0))[...] = out.astype(y_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_smem.at[pl.ds(r0, g)], r["o_ref"].at[pl.ds(base, g)])

        return g0 + steps

    lax.fori_loop(0, my_items, item_body, jnp.int32(0))


def swap_scratch(*, gp: int, d: int, tokens: int, dtype, num_consumers: int):
    """The transposed consumer's scratch shapes: hand-over tile, m/l rows, output tile, the P^T
    tiles and the reduction scratch; "bytes": the shared memory outside the ring (those, the q
    tile pair and the consumers' whole-step float16 V staging tiles)."""
    q_bytes = 2 * 2 * gp * d  # two items, q_hi and q_lo, fp8
    return dict(
        x=plgpu.RefUnion(plgpu.SMEM((d, gp), jnp.float32), plgpu.SMEM((d, gp), jnp.float32)),
        vec=plgpu.SMEM((2, gp), jnp.float32),
        out=plgpu.SMEM((gp, d), dtype),  # untiled: the output copy starts at any row
        p=plgpu.SMEM((num_consumers, gp, tokens), dtype, transforms=tile_transforms(dtype, tokens)),
        red=plgpu.SMEM((num_consumers, _REDUCTION_SCRATCH), jnp.float32),
        bytes=(q_bytes + 4 * d * gp + 8 * gp + 2 * gp * d + 2 * num_consumers * gp * tokens
               + 4 * num_consumers * _REDUCTION_SCRATCH
               + num_consumers * tokens * d * jnp.dtype(dtype).itemsize),
    )
