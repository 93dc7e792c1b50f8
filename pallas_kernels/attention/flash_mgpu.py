"""FlashAttention-3-style forward kernel for Hopper in Mosaic GPU: TMA + wgmma + warp specialisation.

One kernel serves both the dense and the ragged/paged entry points of `flash_prefill.py`: it works on
*query tiles* described by a small int32 table (built by `flash_prefill.tile_table`),
so a tile never crosses a sequence boundary and the grid is static whatever the batch looks like.
A *work item* is one (query tile, query head) pair; items are numbered tile-major (heads inner, so
the heads sharing a KV head run side by side and share its K/V in L2).

CTA layout (FA3): three warpgroups.
  - wg 0 and wg 1 ("consumers") each own BLOCK_Q = 64 query rows of the tile (128 rows per CTA) and
    run QK^T -> online softmax -> PV with wgmma, accumulating in registers (f32).
  - wg 2 ("producer") only issues TMA copies of K and V tiles into a ring of `stages` shared-memory
    slots, waiting on the consumers' "consumed" barriers before reusing a slot.
  The two consumers take turns on the tensor cores (FA3's ping-pong), handing a token over through
  two barriers: a warpgroup holds the turn while it issues PV_j and QK_{j+1}, passes it on, and
  starts softmax_{j+1} as soon as its own QK is done, so one warpgroup's softmax overlaps the other's
  matmuls. (FA3's intra-warpgroup pipelining -- issue QK_n and PV_{n-1} together, softmax_n while
  PV_{n-1} runs -- was tried twice and measured slower or no faster; see docs/kernels/flash_prefill.md.)

Grid: persistent, one CTA per SM (or `KernelConfig.num_ctas`) looping over items in a snake order
(round r takes items r*G .. r*G+G-1, alternately forwards and backwards, so with the table sorted
longest-first every CTA gets about the same causal work). The K/V ring runs on across items -- the
producer fills the next item's K/V while the consumers finish the current one -- and each consumer
prefetches its next item's Q into its second Q/O buffer before writing out the current output.
  The K/V step counter is global across a CTA's items, so ring slots and barrier phases simply
  continue from one item to the next.

K/V sources (static `kv_mode`):
  - "contiguous": k, v are [N, Hkv, D] token-major (the dense entry point flattens [B, L, Hkv, D]);
    a K tile is one strided TMA copy of rows kv_base + j*block_kv ... (out-of-range rows read as 0).
  - "paged": k, v are the cache [Hkv, num_blocks, block_size, D]; a K tile of block_kv tokens is
    block_kv / block_size page copies, each into its row slice of the SMEM tile, all arriving on one
    barrier (its arrival count is the number of pages). Page ids come from block_tables in GMEM.

Tile table row (int32[6], built by `flash_prefill.tile_table`): row0 // 8 (first flat token of the
tile, 8-aligned), lead (rows before the sequence's first token), n_rows (the sequence's rows in the
tile; 0 = empty tile, skip), q_pos0 (context position of row 0), ctx_len (keys the tile may see),
kv_ref (contiguous: flat row of the sequence's first key // 8; paged: row of block_tables).

Sliding window: a tile's K/V steps start at the block of its first row's first key (`first_step`,
for producer and consumers), so blocks wholly before the window are never loaded. Keys a row sees
causally but outside its window get a finite logit (-2^20, log2 units): a row whose first steps
hold none of its keys keeps a finite max, not exp2(-inf + inf) = NaN. Sinks join the final 1 / l.

Outputs: full 64-row halves go out as one TMA store from the swizzled Q/O buffer; a partial half
(a sequence's ragged end) as predicated 8- and 1-row TMA stores from an unswizzled view of the same
SMEM (a RefUnion: Q is dead by then): no CTA writes another sequence's row, at no K/V-stage SMEM.

CPU tests run it in Mosaic GPU's interpreter (`interpret=True`), which also checks that every
thread observes every phase of each barrier it waits on; three parts change there (no register A
operand of wgmma, no barrier wait inside a wgmma scope, no `inline_mgpu`), see `mosaic_attention`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common.device_info import SMEM_LIMIT, num_sms
from pallas_kernels.attention.flash_config import (BLOCK_Q, PROFILE_EVENTS, Q_BUFFERS, TILE_Q,
                                                   KernelConfig)
from pallas_kernels.attention.mgpu_common import accumulate_pv, observe_last_releases
from pallas_kernels.attention.mgpu_fp8 import tile_transforms, wgmma_tile
from pallas_kernels.attention.softmax_mgpu import redo_where_sums_overflow

LOG2E = math.log2(math.e)
# Logit of keys outside a row's window (module docstring): small enough that exp2(s * f - m), one
# FMA against a rounded m, stays within 2^+-0.125 of 1 (at -1e30 it came out inf).
_WINDOW_MASKED_LOG2 = -(2.0 ** 20)


class WorkItem(NamedTuple):
    head: jax.Array
    row0: jax.Array
    lead: jax.Array
    n_rows: jax.Array   # 0: nothing to do (empty table row, or past the last item)
    q_pos0: jax.Array
    ctx_len: jax.Array
    kv_ref: jax.Array


def mosaic_attention(q, k, v, tiles, block_tables, *, kv_mode: str, causal: bool, scale: float,
                     softcap: float | None, window: int | None = None,
                     sinks: jax.Array | None = None, config: KernelConfig = KernelConfig(),
                     interpret: bool = False):
    """q: [T, Hq, D] (T a multiple of 8); k, v: see module doc; tiles: int32[NT, 6]; block_tables:
    int32[S, M] (paged) or int32[1, 1] (contiguous, unused). Returns [T, Hq, D]; rows no tile covers
    are left unwritten (the caller's tile table covers every row it reads back).

    interpret: run in Mosaic GPU's interpreter (CPU tests). It checks every barrier's phase
    accounting, but supports no register A operand of wgmma, no barrier wait inside a wgmma scope and
    no `inline_mgpu`; there P goes through shared memory, the next-K wait follows PV instead of
    overlapping it, and every step takes the plain online softmax (row max, lazy threshold, a
    rescale of every row: the same math as the stale-max step)."""
    t, hq, d = q.shape
    dtype = q.dtype
    cfg = config
    bkv, stages = cfg.block_kv, cfg.stages
    if kv_mode == "paged":
        hkv, _, page, _ = k.shape
        if bkv % page:
            raise ValueError(f"block_size={page} must divide block_kv={bkv}")
        pages_per_tile = bkv // page
        max_pages = block_tables.shape[1]
    elif kv_mode == "contiguous":
        hkv = k.shape[1]
        pages_per_tile = 1
    else:
        raise ValueError(f"kv_mode={kv_mode!r}")
    smem_bytes = cfg.smem_bytes(d, jnp.dtype(dtype).itemsize, jnp.dtype(k.dtype).itemsize)
    if smem_bytes > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {smem_bytes} bytes of shared memory at head_dim={d}; the "
                         f"limit is {SMEM_LIMIT}")
    widen = k.dtype != dtype  # an fp8 cache: consumers widen each K/V tile (mgpu_fp8.py)
    group = hq // hkv
    num_items = hq * tiles.shape[0]
    num_ctas = min(num_items, cfg.num_ctas or num_sms())
    rounds = -(-num_items // num_ctas)
    # Logits go to log2 units so exp2 replaces exp; the factor is folded into the exp2 argument as
    # one FMA (s * c - m) rather than a separate multiply of the whole score tile.
    log2_factor = (softcap if softcap else scale) * LOG2E
    if window is not None and not causal:
        raise ValueError("a sliding window needs causal=True")
    window_masked = _WINDOW_MASKED_LOG2 / log2_factor  # as a raw score (before the factor)

    def kernel(q_ref, k_ref, v_ref, tiles_ref, bt_ref, sink_ref, out_ref, scoped):
        (qo_union, k_smem, v_smem, *p_smem), (k_bar, v_bar, q_bar), (k_free, v_free), turn = scoped
        wide = p_smem[-1].at[lax.axis_index("wg")] if widen else None
        qo_all, o_all = qo_union  # swizzled Q/O view, unswizzled ragged-output view: same bytes
        cta = lax.axis_index("ctas")
        wg = lax.axis_index("wg")

        def item(r) -> WorkItem:
            """This CTA's r-th work item (n_rows = 0 past the last one)."""
            pos = jnp.where(lax.rem(r, 2) == 0, cta, num_ctas - 1 - cta)
            idx = r * num_ctas + pos
            valid = idx < num_items
            idx = jnp.minimum(idx, num_items - 1)
            tile, head = lax.div(idx, jnp.int32(hq)), lax.rem(idx, jnp.int32(hq))
            return WorkItem(head=head,
                            row0=tiles_ref[tile, 0] * 8,  # a product: Mosaic sees 8-row alignment
                            lead=tiles_ref[tile, 1],
                            n_rows=jnp.where(valid, tiles_ref[tile, 2], 0),
                            q_pos0=tiles_ref[tile, 3], ctx_len=tiles_ref[tile, 4],
                            kv_ref=tiles_ref[tile, 5])

        def num_steps(it, last_row_pos):  # K/V steps needed by rows up to context position
            kv_end = jnp.minimum(it.ctx_len, last_row_pos + 1) if causal else it.ctx_len
            return lax.div(kv_end + (bkv - 1), jnp.int32(bkv))

        def first_step(it):  # the step holding the first key of the tile's first row's window
            if window is None:
                return jnp.int32(0)
            return lax.div(jnp.maximum(it.q_pos0 - (window - 1), 0), jnp.int32(bkv))

        def item_steps(it):  # steps the producer streams for the item (the later half's needs)
            n = num_steps(it, it.q_pos0 + TILE_Q - 1) - first_step(it)
            return jnp.where(it.n_rows > 0, n, 0)

        def over_items(body):
            """Runs body(r, step_base) for this CTA's items, carrying the global K/V step count;
            returns the CTA's total."""
            if rounds == 1:
                return body(jnp.int32(0), jnp.int32(0))
            return lax.fori_loop(0, rounds, lambda r, g: g + body(r, g), jnp.int32(0))

        # The consumers' turns on the tensor cores: turn[w] completes a phase when the other
        # consumer hands the turn to warpgroup w (FA3's scheduler barriers).
        def take_turn():
            plgpu.barrier_wait(turn.at[wg])

        def pass_turn():
            plgpu.barrier_arrive(turn.at[1 - wg])

        def slot_of(g):
            return lax.rem(g, jnp.int32(stages))

        def store_output(it, out, qo_smem, o_smem, lo, hi, out_row):
            @pl.when((lo == 0) & (hi == BLOCK_Q))
            def _full():
                qo_smem[...] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(out_row, BLOCK_Q), it.head])

            @pl.when((lo < hi) & ((lo > 0) | (hi < BLOCK_Q)))
            def _partial():
                # TMA boxes and SMEM offsets are static: 8-row groups that lie inside [lo, hi),
                # then the remaining single rows, each copy predicated.
                o_smem[...] = out
                plgpu.commit_smem()

                def copy_rows(r, n, predicate, commit_group):
                    src, dst = o_smem.at[pl.ds(r, n)], out_ref.at[pl.ds(out_row + r, n), it.head]
                    if interpret:  # the interpreter has no predicated copies
                        pl.when(predicate)(lambda: plgpu.copy_smem_to_gmem(src, dst))
                    else:
                        plgpu.copy_smem_to_gmem(src, dst, predicate=predicate,
                                                commit_group=commit_group)
                for r in range(0, BLOCK_Q, 8):
                    copy_rows(r, 8, (lo <= r) & (r + 8 <= hi), False)
                for r in range(BLOCK_Q):
                    g = r - r % 8
                    copy_rows(r, 1, (lo <= r) & (r < hi) & ((g < lo) | (g + 8 > hi)),
                              r == BLOCK_Q - 1)

        def load_q(it, b):
            # The buffer's previous output must have left SMEM before Q overwrites it.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(it.row0 + wg * BLOCK_Q, BLOCK_Q), it.head],
                                    qo_all.at[b, wg], q_bar.at[b * 2 + wg])

        def consume_item(it, g0, b, prefetch_next):
            qo_smem, o_smem = qo_all.at[b, wg], o_all.at[b, wg]
            q_pos_first = it.q_pos0 + wg * BLOCK_Q
            # Rows [lo, hi) of this warpgroup's 64 belong to the tile's sequence.
            lo = jnp.clip(it.lead - wg * BLOCK_Q, 0, BLOCK_Q)
            hi = jnp.clip(it.lead + it.n_rows - wg * BLOCK_Q, 0, BLOCK_Q)
            out_row = it.row0 + wg * BLOCK_Q
            cta_steps = item_steps(it)
            # Step j holds keys from (first + j) * bkv. Both consumers have steps >= 1 unless the
            # tile has no keys (padding pseudo-sequence); causal rows of warpgroup 0 may stop
            # earlier than the tile's (it then drains the rest).
            first = first_step(it)
            steps = num_steps(it, q_pos_first + BLOCK_Q - 1) - first
            # Steps whose every key is visible to every row of this warpgroup need no mask: from
            # the first whose keys are all inside the last row's window, to the causal limit.
            full_steps = lax.div(it.ctx_len, jnp.int32(bkv))
            if causal:
                full_steps = jnp.minimum(full_steps, lax.div(q_pos_first + 1, jnp.int32(bkv)))
            full_steps = (jnp.minimum(full_steps, steps) if window is None  # first == 0
                          else jnp.clip(full_steps - first, 0, steps))
            window_start = jnp.int32(0)  # the first step inside the last row's window
            if window is not None:
                last_first_key = jnp.maximum(q_pos_first + BLOCK_Q - window, 0)
                window_start = jnp.clip(lax.div(last_first_key + bkv - 1, jnp.int32(bkv)) - first,
                                        0, steps)
            plgpu.barrier_wait(q_bar.at[b * 2 + wg])

            def visible_scores(s, j, masked):
                """Raw scores of step j -> soft-capped, -inf where the key is not visible."""
                if softcap:
                    s = jnp.tanh(s * (scale / softcap))
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    kpos = cols + (first + j) * bkv
                    visible = kpos < it.ctx_len
                    if causal:
                        visible = visible & (kpos <= rows + q_pos_first)
                    s = jnp.where(visible, s, -jnp.inf)
                    if window is not None:  # finite: see the module docstring
                        s = jnp.where(kpos <= rows + q_pos_first - window, window_masked, s)
                return s

            def online_softmax(s, m_i, j, masked):
                """Raw scores of step j -> (p, new row max, rescale factor for older terms)."""
                s = visible_scores(s, j, masked)
                m_new = jnp.maximum(m_i, s.max(axis=1) * log2_factor)
                # Keep the stale max unless it grew a lot (NaN: keep).
                m_new = jnp.where(m_new - m_i > cfg.rescale_threshold, m_new, m_i)
                p = jnp.exp2(s * log2_factor - lax.broadcast_in_dim(m_new, s.shape, [0]))
                return p, m_new, jnp.exp2(m_i - m_new)

            def rows_scale(x, r):
                return x * lax.broadcast_in_dim(r, x.shape, [0])

            m_init = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                                       plgpu.Layout.WGMMA.reduce(1))
            l_init = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32),
                                       plgpu.Layout.WGMMA.reduce(1))
            acc_init = plgpu.layout_cast(jnp.full((BLOCK_Q, d), 0.0, jnp.float32),
                                         plgpu.Layout.WGMMA)

            def drain_step(j, _):
                # This warpgroup is done but the producer still streams the other one's K/V: free
                # the slots and keep the turns in step (one turn per step, passed straight on). The
                # waits on the slot's loads are needed although the data is not: every thread
                # tracks each barrier's phase parity itself, one flip per wait, so a skipped phase
                # would leave this warpgroup's parity one behind for the rest of the CTA's items
                # (a later wait then passes before its data lands, or waits on a phase that never
                # comes: an engine hang).
                slot = slot_of(g0 + j)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                pass_turn()

            def finish(acc, m_i, l_i):
                pass_turn()  # after the last PV
                lax.fori_loop(steps, cta_steps, drain_step, None)
                prefetch_next()
                if sink_ref is not None:  # the head's sink: one more denominator term
                    sink = sink_ref[it.head]
                    m_f = jnp.maximum(m_i, sink)  # acc, l re-based to m_f: no exp2 overflow
                    alpha = jnp.exp2(m_i - m_f)
                    acc, l_i = rows_scale(acc, alpha), l_i * alpha + jnp.exp2(sink - m_f)
                inv_l = 1.0 / jnp.maximum(l_i, 1e-30)
                store_output(it, rows_scale(acc, inv_l).astype(dtype), qo_smem, o_smem, lo, hi,
                             out_row)

            def kv_loop():
                """QK_j, softmax_j, PV_j in order within the warpgroup; the two consumers alternate."""
                plgpu.barrier_wait(k_bar.at[slot_of(g0)])
                take_turn()

                def kv_step(j, carry, masked, peeled: bool = False):
                    """masked: a Python bool, or for the first step a traced one (a lax.cond
                    picks the masked or unmasked softmax)."""
                    acc, m_i, l_i = carry
                    slot = slot_of(g0 + j)
                    k_tile = wgmma_tile(k_smem.at[slot], wide, k_free.at[slot])

                    def qk_scope(acc_ref):
                        plgpu.wgmma(acc_ref, qo_smem, k_tile.transpose((1, 0)))
                        if not interpret:
                            pass_turn()  # QK_j is issued: the other consumer's turn
                        return acc_ref[...]
                    with jax.named_scope("qk"):
                        s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_Q, bkv), jnp.float32))
                    if interpret:
                        pass_turn()
                    if wide is None:
                        plgpu.barrier_arrive(k_free.at[slot])
                    with jax.named_scope("softmax"):
                        if peeled:  # the plain path, from m = -inf: acc is still zero
                            def first_softmax(masked):
                                def softmax(s):
                                    p, m_new, _ = online_softmax(s, m_i, j, masked)
                                    return p, m_new, p.sum(axis=1)
                                return softmax
                            p, m_new, l_i = lax.cond(masked, first_softmax(True),
                                                     first_softmax(False), s)
                        elif not interpret:  # the stale-max step
                            s = visible_scores(s, j, masked)
                            p = jnp.exp2(s * log2_factor - lax.broadcast_in_dim(m_i, s.shape, [0]))
                            p, acc, m_new, l_i = redo_where_sums_overflow(
                                s, p, acc, m_i, l_i, p.sum(axis=1), log2_factor,
                                cfg.rescale_threshold)
                        else:
                            p, m_new, alpha = online_softmax(s, m_i, j, masked)
                            acc = rows_scale(acc, alpha)
                            l_i = l_i * alpha + p.sum(axis=1)
                        p16 = p.astype(dtype)
                        # Pin the softmax before the barrier so the compiler does not sink it into
                        # the other warpgroup's matmul turn (as jax's attention_mgpu does).
                        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                    with jax.named_scope("wait_v_turn"):
                        plgpu.barrier_wait(v_bar.at[slot])
                        v_tile = wgmma_tile(v_smem.at[slot], wide, v_free.at[slot])
                        take_turn()  # PV_j and QK_{j+1} are issued in one turn

                    has_next, next_slot = j + 1 < steps, slot_of(g0 + j + 1)

                    def wait_next_k():  # while PV runs (interpret mode: after it)
                        pl.when(has_next)(lambda: plgpu.barrier_wait(k_bar.at[next_slot]))

                    with jax.named_scope("pv"):
                        acc = accumulate_pv(acc, p16, v_tile,
                                            p_smem[0].at[wg] if interpret else None, wait_next_k)
                    if wide is None:
                        plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                # The first step (steps >= 1 here) runs on its own: on the plain path from
                # m = -inf with no rescale of the zero accumulator, since the stale-max step
                # would take its exps against -inf only to redo them.
                carry = kv_step(0, (acc_init, m_init, l_init),
                                (full_steps <= 0) | (window_start > 0), peeled=True)
                unmasked_start = jnp.maximum(window_start, 1)
                unmasked_end = jnp.maximum(full_steps, unmasked_start)
                if window is not None:  # steps with keys before the last row's window
                    carry = lax.fori_loop(1, unmasked_start,
                                          functools.partial(kv_step, masked=True), carry)
                carry = lax.fori_loop(unmasked_start, unmasked_end,
                                      functools.partial(kv_step, masked=False), carry)
                carry = lax.fori_loop(unmasked_end, steps, functools.partial(kv_step, masked=True),
                                      carry)
                finish(*carry)

            pl.when(steps > 0)(kv_loop)

            @pl.when(steps <= 0)
            def _no_keys():  # padding rows: zeros
                prefetch_next()
                store_output(it, acc_init.astype(dtype), qo_smem, o_smem, lo, hi, out_row)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(cfg.consumer_registers, action="increase")
            pl.when(wg == 1)(pass_turn)  # warpgroup 0 takes the first turn

            def prefetch(r):  # issue the Q load of this CTA's item r into buffer r % 2
                nxt = item(r)
                pl.when(nxt.n_rows > 0)(lambda: load_q(nxt, lax.rem(r, 2)))

            prefetch(jnp.int32(0))

            def consumer_round(r, g0):
                it = item(r)
                b = lax.rem(r, 2)
                pl.when(it.n_rows > 0)(lambda: consume_item(it, g0, b, lambda: prefetch(r + 1)))
                pl.when(it.n_rows == 0)(lambda: prefetch(r + 1))
                return item_steps(it)

            over_items(consumer_round)
            # Observe warpgroup 1's last hand-over (interpret mode checks every phase).
            pl.when(wg == 0)(take_turn)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(cfg.producer_registers, action="decrease")

            def producer_round(r, g0):
                it = item(r)
                kv_head = lax.div(it.head, jnp.int32(group))

                first_kv = first_step(it)

                def page_ids(step):
                    if kv_mode == "contiguous":
                        return None
                    # Pages past the end of the block table are clamped to its last entry (a valid
                    # page; those keys lie past ctx_len and are masked).
                    first = (first_kv + step) * pages_per_tile
                    return [bt_ref[it.kv_ref, jnp.minimum(first + i, max_pages - 1)]
                            for i in range(pages_per_tile)]

                def load(src_ref, dst_smem, bar, step, slot, ids):
                    if kv_mode == "contiguous":  # kv_ref holds the first key's flat row // 8
                        rows = (pl.ds(it.kv_ref * 8 + (first_kv + step) * bkv, bkv), kv_head)
                        plgpu.copy_gmem_to_smem(src_ref.at[rows], dst_smem.at[slot], bar.at[slot])
                        return
                    for i, pid in enumerate(ids):  # one TMA copy per page, all on the slot's barrier
                        plgpu.copy_gmem_to_smem(src_ref.at[kv_head, pid],
                                                dst_smem.at[slot, pl.ds(i * page, page)],
                                                bar.at[slot])

                @pl.loop(0, item_steps(it))
                def _(step):
                    g = g0 + step
                    slot = slot_of(g)
                    ids = page_ids(step)  # block-table reads overlap the wait for a free slot
                    with jax.named_scope("wait_free"):
                        pl.when(g >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                    load(k_ref, k_smem, k_bar, step, slot, ids)
                    with jax.named_scope("wait_free"):
                        pl.when(g >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                    load(v_ref, v_smem, v_bar, step, slot, ids)
                return item_steps(it)

            observe_last_releases(over_items(producer_round), stages, k_free, v_free)

    def entry(q_ref, k_ref, v_ref, tiles_ref, bt_ref, *refs):
        sink_ref, out_ref = refs if sinks is not None else (None, *refs)
        tiling = plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize))
        swizzle = plgpu.SwizzleTransform(128)
        qo = plgpu.SMEM((Q_BUFFERS, 2, BLOCK_Q, d), dtype, transforms=(tiling, swizzle))
        smem = (
            plgpu.RefUnion(qo, plgpu.SMEM((Q_BUFFERS, 2, BLOCK_Q, d), dtype)),  # Q/O | ragged O
            plgpu.SMEM((stages, bkv, d), k.dtype, transforms=tile_transforms(k.dtype, d)),
            plgpu.SMEM((stages, bkv, d), k.dtype, transforms=tile_transforms(k.dtype, d)),
            # interpret mode: each consumer's P tile (on the GPU P stays in registers)
            *([plgpu.SMEM((2, BLOCK_Q, bkv), dtype, transforms=(tiling, swizzle))]
              if interpret else []),
            *([plgpu.SMEM((2, bkv, d), dtype, transforms=(tiling, swizzle))] if widen else []),
        )
        loaded = (plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
                  plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
                  plgpu.Barrier(num_barriers=2 * Q_BUFFERS))
        freed = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2
        turn = plgpu.Barrier(num_barriers=2)
        pl.run_scoped(lambda *s: kernel(q_ref, k_ref, v_ref, tiles_ref, bt_ref, sink_ref, out_ref,
                                        s),
                      smem, loaded, freed, turn, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((t, hq, d), dtype),
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=3,
        thread_name="wg",
        kernel_name="flash_attention",  # what profiles show
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **(dict(profile_space=PROFILE_EVENTS, profile_dir=cfg.profile_dir,
                                      profile_bounds_check=True)
                                 if cfg.profile_dir and not interpret else {})),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(q, k, v, tiles, block_tables,
      *(() if sinks is None else (sinks.astype(jnp.float32) * LOG2E,)))
