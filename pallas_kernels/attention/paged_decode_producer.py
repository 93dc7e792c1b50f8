"""The paged decode kernel's producer warpgroup (`paged_decode_mosaic`): item after item, an item's
q tile and its K/V pages into the shared-memory ring, one TMA copy per page, block ids read ahead.

Profiler ranges (bench/profile/profile_decode.py): `producer_item` per item and, per step, `wait_free`
around each wait for a consumer to release the slot; the rest of a step is issuing copies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.mgpu_common import observe_last_releases, scoped


def produce(caches, *, q_load, my_items, item_info, q_rows, bt_ref, head_pages: int, bs: int,
            pages_per_step: int, stages: int, bt_lookahead: int, gp: int) -> None:
    """Producer warpgroup body. caches: (cache_ref [Hkv, blocks, bs, D], ring, ready, free) for K
    and V. q_load: (q_ref, q_smem, q_bar, q_free, q_tiles) to load each item's q (q_tiles 2: q_hi
    and q_lo of an fp8 cache, else 1). head_pages: the block table's width."""
    plgpu.set_max_registers(40, action="decrease")

    def item_body(it, g0):
        seq, head, _, _, first, steps = item_info(it)
        q_ref, q_smem, q_bar, q_free, q_tiles = q_load
        qb = lax.rem(it, 2)

        @pl.when(it >= 2)
        def _():
            plgpu.barrier_wait(q_free.at[qb])
        start, _, _ = q_rows(seq, head)
        for h in range(q_tiles):  # fp8: q_hi and q_lo, both on the tile's barrier
            src = q_ref.at[h] if q_tiles > 1 else q_ref
            dst = q_smem.at[qb, h] if q_tiles > 1 else q_smem.at[qb]
            plgpu.copy_gmem_to_smem(src.at[pl.ds(start, gp)], dst.at[pl.ds(0, gp)],
                                    q_bar.at[qb])

        def block_ids(j):
            """Block ids of step j's pages, each read at its column (clamped to the table).
            Columns past the sequence's last page hold the table's padding, a valid block id
            (metadata.py), and their tokens are masked: reading them keeps the barrier count
            fixed, and no read waits for the sequence length, so the first copy waits for one
            global round trip (the table), not two (the length, then the table)."""
            page0 = first + j * pages_per_step
            return tuple(bt_ref[seq, jnp.minimum(page0 + i, head_pages - 1)]
                         for i in range(pages_per_step))

        def step(j, ahead):
            gs = g0 + j
            slot = lax.rem(gs, stages)
            # Block ids are read before waiting for the slot (and, with a lookahead, that many
            # steps early), so their load latency overlaps the wait and earlier copies.
            if bt_lookahead:
                blocks, ahead = ahead[:pages_per_step], (
                    *ahead[pages_per_step:], *block_ids(j + bt_lookahead))
            else:
                blocks = block_ids(j)
            for cache_ref, smem, ready, free in caches:
                @pl.when(gs >= stages)
                def _():
                    with jax.named_scope("wait_free"):
                        plgpu.barrier_wait(free.at[slot])
                for i, block in enumerate(blocks):
                    plgpu.copy_gmem_to_smem(cache_ref.at[head, block],
                                            smem.at[slot, pl.ds(i * bs, bs)], ready.at[slot])
            return ahead

        ahead = sum((block_ids(j) for j in range(bt_lookahead)), ())
        lax.fori_loop(0, steps, step, ahead)
        return g0 + steps

    total_steps = lax.fori_loop(0, my_items, scoped("producer_item")(item_body), jnp.int32(0))
    # Drain: wait for the consumers to free the last fill of every slot and q tile, so no barrier
    # phase is left unobserved when the kernel ends (GPU interpret mode checks this).
    observe_last_releases(total_steps, stages, *(cache[3] for cache in caches))
    observe_last_releases(my_items, 2, q_load[3])  # the two q tiles, one per item in turn
