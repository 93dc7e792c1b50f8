"""FlashAttention-3-style forward kernel for Hopper in Mosaic GPU: TMA + wgmma + warp specialisation.

One kernel serves both the dense and the ragged/paged entry points of `flash_prefill.py`: it works on
*query tiles* described by a small int32 table (built on the device by `flash_prefill.tile_table`),
so a tile never crosses a sequence boundary and the grid is static whatever the batch looks like.

CTA layout (FA3): three warpgroups.
  - wg 0 and wg 1 ("consumers") each own BLOCK_Q = 64 query rows of the tile (128 rows per CTA) and
    run QK^T -> online softmax -> PV with wgmma, accumulating in registers (f32).
  - wg 2 ("producer") only issues TMA copies of K and V tiles into a ring of STAGES shared-memory
    slots, waiting on the consumers' "consumed" barriers before reusing a slot.
  A "schedule barrier" shared by the two consumers makes them take turns on the tensor cores, so one
  warpgroup's softmax overlaps the other's matmuls (FA3's ping-pong).
  (FA3's intra-warpgroup pipelining -- issue QK_n and PV_{n-1} together, softmax_n while PV_{n-1}
  runs -- was tried and measured 27% slower here; see docs/ARCHITECTURE.md.)

K/V sources (static `kv_mode`):
  - "contiguous": k, v are [N, Hkv, D] token-major (the dense entry point flattens [B, L, Hkv, D]);
    a K tile is one strided TMA copy of rows kv_base + j*BLOCK_KV ... (out-of-range rows read as 0).
  - "paged": k, v are the cache [Hkv, num_blocks, block_size, D]; a K tile of BLOCK_KV tokens is
    BLOCK_KV / block_size page copies, each into its row slice of the SMEM tile, all arriving on one
    barrier (its arrival count is the number of pages). Page ids come from block_tables in GMEM.

Tile table row (int32[6], built by `flash_prefill.tile_table`): row0 // 8 (first flat token of the
tile, 8-aligned), lead (rows before the sequence's first token), n_rows (the sequence's rows in the
tile; 0 = empty tile, skip), q_pos0 (context position of row 0), ctx_len (keys the tile may see),
kv_ref (contiguous: flat row of the sequence's first key // 8; paged: row of block_tables).

Outputs: full 64-row halves go out as one TMA store from the swizzled Q/O buffer; a partial half (the
ragged end of a sequence) goes out of an unswizzled buffer as predicated 8-row and 1-row TMA stores,
so no CTA ever writes a row of another sequence.

No CPU interpretation: jax 0.11.2's Mosaic GPU interpreter cannot run this kernel (see the tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

BLOCK_Q = 64          # query rows per consumer warpgroup (wgmma M = 64)
TILE_Q = 2 * BLOCK_Q  # query rows per CTA (two consumer warpgroups)
BLOCK_KV = 128        # keys per pipeline step
STAGES = 2            # K/V shared-memory ring depth
LOG2E = math.log2(math.e)


def mosaic_attention(q, k, v, tiles, block_tables, *, kv_mode: str, causal: bool, scale: float,
                     softcap: float | None):
    """q: [T, Hq, D] (T a multiple of 8); k, v: see module doc; tiles: int32[NT, 6]; block_tables:
    int32[S, M] (paged) or int32[1, 1] (contiguous, unused). Returns [T, Hq, D]; rows no tile covers
    are left unwritten (the caller's tile table covers every row it reads back)."""
    t, hq, d = q.shape
    dtype = q.dtype
    if kv_mode == "paged":
        hkv, _, page, _ = k.shape
        if BLOCK_KV % page:
            raise ValueError(f"block_size={page} must divide {BLOCK_KV}")
        pages_per_tile = BLOCK_KV // page
        max_pages = block_tables.shape[1]
    elif kv_mode == "contiguous":
        hkv = k.shape[1]
        pages_per_tile = 1
    else:
        raise ValueError(f"kv_mode={kv_mode!r}")
    group = hq // hkv
    num_tiles = tiles.shape[0]
    # Logits go to log2 units so exp2 replaces exp; the factor is folded into the exp2 argument as
    # one FMA (s * c - m) rather than a separate multiply of the whole score tile.
    if softcap:
        log2_factor = softcap * LOG2E
    else:
        log2_factor = scale * LOG2E

    def kernel(q_ref, k_ref, v_ref, tiles_ref, bt_ref, out_ref, scoped):
        (qo_smem2, o_smem2, k_smem, v_smem), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scoped
        head = lax.axis_index("heads")
        tile = lax.axis_index("tiles")
        wg = lax.axis_index("wg")
        row0 = tiles_ref[tile, 0] * 8  # written as a product so Mosaic sees 8-row alignment
        lead = tiles_ref[tile, 1]
        n_rows = tiles_ref[tile, 2]
        q_pos0 = tiles_ref[tile, 3]
        ctx_len = tiles_ref[tile, 4]
        kv_ref_idx = tiles_ref[tile, 5]

        def num_steps(last_row_pos):  # K/V steps needed by rows up to context position last_row_pos
            kv_end = jnp.minimum(ctx_len, last_row_pos + 1) if causal else ctx_len
            return lax.div(kv_end + (BLOCK_KV - 1), jnp.int32(BLOCK_KV))

        cta_steps = num_steps(q_pos0 + TILE_Q - 1)  # the producer feeds the later half's needs

        def schedule_barrier():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        def slot_of(j):
            return lax.rem(j, jnp.int32(STAGES))

        def store_output(out, qo_smem, lo, hi, out_row):
            @pl.when((lo == 0) & (hi == BLOCK_Q))
            def _full():
                qo_smem[...] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(out_row, BLOCK_Q), head])

            @pl.when((lo < hi) & ((lo > 0) | (hi < BLOCK_Q)))
            def _partial():
                # TMA boxes and SMEM offsets are static: 8-row groups that lie inside [lo, hi),
                # then the remaining single rows, each copy predicated.
                o_smem = o_smem2.at[wg]
                o_smem[...] = out
                plgpu.commit_smem()
                for r in range(0, BLOCK_Q, 8):
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(r, 8)],
                                            out_ref.at[pl.ds(out_row + r, 8), head],
                                            predicate=(lo <= r) & (r + 8 <= hi), commit_group=False)
                for r in range(BLOCK_Q):
                    g = r - r % 8
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(r, 1)],
                                            out_ref.at[pl.ds(out_row + r, 1), head],
                                            predicate=(lo <= r) & (r < hi) & ((g < lo) | (g + 8 > hi)),
                                            commit_group=r == BLOCK_Q - 1)
            plgpu.wait_smem_to_gmem(0)

        @pl.when((n_rows > 0) & (wg < 2))
        def _consumer():
            plgpu.set_max_registers(240, action="increase")
            qo_smem = qo_smem2.at[wg]
            q_pos_first = q_pos0 + wg * BLOCK_Q
            # Rows [lo, hi) of this warpgroup's 64 belong to the tile's sequence.
            lo = jnp.clip(lead - wg * BLOCK_Q, 0, BLOCK_Q)
            hi = jnp.clip(lead + n_rows - wg * BLOCK_Q, 0, BLOCK_Q)
            out_row = row0 + wg * BLOCK_Q
            # Both consumers have steps >= 1 unless the tile has no keys (padding pseudo-sequence).
            steps = num_steps(q_pos_first + BLOCK_Q - 1)
            # Steps whose every key is visible to every row of this warpgroup need no mask.
            full_steps = lax.div(ctx_len, jnp.int32(BLOCK_KV))
            if causal:
                full_steps = jnp.minimum(full_steps, lax.div(q_pos_first + 1, jnp.int32(BLOCK_KV)))
            full_steps = jnp.minimum(full_steps, steps)

            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(out_row, BLOCK_Q), head], qo_smem, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

            def online_softmax(s, m_i, j, masked):
                """Raw scores of step j -> (p, new row max, rescale factor for older terms)."""
                if softcap:
                    s = jnp.tanh(s * (scale / softcap))
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    kpos = cols + j * BLOCK_KV
                    visible = kpos < ctx_len
                    if causal:
                        visible = visible & (kpos <= rows + q_pos_first)
                    s = jnp.where(visible, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1) * log2_factor)
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
                # the slots and keep the ping-pong turns in step (two rendezvous per step).
                plgpu.barrier_arrive(k_free.at[slot_of(j)])
                plgpu.barrier_arrive(v_free.at[slot_of(j)])
                schedule_barrier()
                schedule_barrier()

            def finish(acc, l_i):
                lax.fori_loop(steps, cta_steps, drain_step, None)
                pl.when(wg == 0)(schedule_barrier)
                inv_l = 1.0 / jnp.maximum(l_i, 1e-30)
                store_output(rows_scale(acc, inv_l).astype(dtype), qo_smem, lo, hi, out_row)

            def kv_loop():
                """QK_j, softmax_j, PV_j in order within the warpgroup; the two consumers alternate."""
                plgpu.barrier_wait(k_bar.at[0])
                pl.when(wg == 1)(schedule_barrier)

                def kv_step(j, carry, masked: bool):
                    acc, m_i, l_i = carry
                    slot = slot_of(j)

                    def qk_scope(acc_ref):
                        plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                        schedule_barrier()
                        return acc_ref[...]
                    s = pl.run_scoped(qk_scope, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    p, m_new, alpha = online_softmax(s, m_i, j, masked)
                    acc = rows_scale(acc, alpha)
                    l_i = l_i * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    # Pin the softmax before the barrier so the compiler does not sink it into the
                    # other warpgroup's matmul turn (same ordering trick as jax's attention_mgpu).
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                    plgpu.barrier_arrive(sched)      # softmax done: the other wg may issue
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_wait(sched)        # our turn on the tensor cores again

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        nxt = j + 1

                        @pl.when(nxt < steps)  # wait for the next K while PV runs
                        def _():
                            plgpu.barrier_wait(k_bar.at[slot_of(nxt)])
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                carry = (acc_init, m_init, l_init)
                carry = lax.fori_loop(0, full_steps, functools.partial(kv_step, masked=False), carry)
                carry = lax.fori_loop(full_steps, steps, functools.partial(kv_step, masked=True), carry)
                acc, _, l_i = carry
                finish(acc, l_i)

            pl.when(steps > 0)(kv_loop)

            @pl.when(steps == 0)
            def _no_keys():  # padding rows: zeros
                store_output(acc_init.astype(dtype), qo_smem, lo, hi, out_row)

        @pl.when((n_rows > 0) & (wg == 2))
        def _producer():
            plgpu.set_max_registers(24, action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            def page_ids(step):
                if kv_mode == "contiguous":
                    return None
                # Pages past the end of the block table are clamped to its last entry (a valid
                # page; those keys lie past ctx_len and are masked).
                first = step * pages_per_tile
                return [bt_ref[kv_ref_idx, jnp.minimum(first + i, max_pages - 1)]
                        for i in range(pages_per_tile)]

            def load(src_ref, dst_smem, bar, step, slot, ids):
                if kv_mode == "contiguous":  # kv_ref holds the first key's flat row // 8
                    rows = (pl.ds(kv_ref_idx * 8 + step * BLOCK_KV, BLOCK_KV), kv_head)
                    plgpu.copy_gmem_to_smem(src_ref.at[rows], dst_smem.at[slot], bar.at[slot])
                    return
                for i, pid in enumerate(ids):  # one TMA copy per page, all on the slot's barrier
                    plgpu.copy_gmem_to_smem(src_ref.at[kv_head, pid],
                                            dst_smem.at[slot, pl.ds(i * page, page)], bar.at[slot])

            for s in range(STAGES):
                @pl.when(s < cta_steps)
                def _(s=s):
                    ids = page_ids(s)
                    load(k_ref, k_smem, k_bar, s, s, ids)
                    load(v_ref, v_smem, v_bar, s, s, ids)

            @pl.loop(STAGES, jnp.maximum(cta_steps, STAGES))
            def _(step):
                slot = slot_of(step)
                ids = page_ids(step)  # block-table reads overlap the wait for a free slot
                plgpu.barrier_wait(k_free.at[slot])
                load(k_ref, k_smem, k_bar, step, slot, ids)
                plgpu.barrier_wait(v_free.at[slot])
                load(v_ref, v_smem, v_bar, step, slot, ids)

    def entry(q_ref, k_ref, v_ref, tiles_ref, bt_ref, out_ref):
        tiling = plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize))
        swizzle = plgpu.SwizzleTransform(128)
        smem = (
            plgpu.SMEM((2, BLOCK_Q, d), dtype, transforms=(tiling, swizzle)),   # Q, then O
            plgpu.SMEM((2, BLOCK_Q, d), dtype),                                 # ragged O
            plgpu.SMEM((STAGES, BLOCK_KV, d), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((STAGES, BLOCK_KV, d), dtype, transforms=(tiling, swizzle)),
        )
        loaded = (plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=STAGES),
                  plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=STAGES),
                  plgpu.Barrier(num_barriers=2))
        freed = (plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),) * 2
        pl.run_scoped(lambda *s: kernel(q_ref, k_ref, v_ref, tiles_ref, bt_ref, out_ref, s),
                      smem, loaded, freed, plgpu.Barrier(num_arrivals=2), collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((t, hq, d), dtype),
        grid=(hq, num_tiles),
        grid_names=("heads", "tiles"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, tiles, block_tables)
