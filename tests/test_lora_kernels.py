"""The slot-grouped LoRA kernels (pallas_kernels/lora/segment_matmul.py) in the Pallas interpreter
against the XLA path on a ragged mixed batch; the grouping on its own (pure jnp, no kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.lora.delta import lora_delta
from pallas_kernels.lora.segment_matmul import lora_shrink_expand, segment_plan


def test_plan_gives_each_adapter_row_one_place_in_a_tile_of_its_slot():
    rng = np.random.default_rng(3)
    plan_of = jax.jit(segment_plan, static_argnums=(1, 2))
    for t, g, bm in ((3, 9, 16), (300, 9, 64)):
        slot = rng.integers(0, g, t).astype(np.int32)
        plan = jax.tree.map(np.asarray, plan_of(jnp.asarray(slot), g, bm))
        rows = plan.rows.reshape(-1, bm)
        placed = rows[rows >= 0]
        np.testing.assert_array_equal(np.sort(placed), np.flatnonzero(slot > 0))  # once each
        for tile, s in zip(rows, plan.tile_slot):
            assert (slot[tile[tile >= 0]] == s).all() and (s > 0 or (tile < 0).all())


def test_kernels_equal_the_xla_path_and_never_read_unused_slots():
    """Slots 0 (no adapter) and 3 (unused) hold NaN: were either read into a row, it would show.
    K split two ways, two K blocks a split, three N blocks; rows of slot 0 keep y bit for bit."""
    rng = np.random.default_rng(0)
    t, k, w, n, g = 37, 128, 32, 96, 5
    slot = rng.choice([0, 1, 2, 4], t).astype(np.int32)
    a = rng.normal(size=(g, k, w)).astype(np.float32)
    b = rng.normal(size=(g, w, n)).astype(np.float32) * 0.1
    x = jnp.asarray(rng.normal(size=(t, k)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(t, n)), jnp.float32)
    want = y + lora_delta(x, jnp.asarray(a).at[0].set(0), jnp.asarray(b).at[0].set(0),
                          jnp.asarray(slot))
    a[[0, 3]], b[[0, 3]] = np.nan, np.nan
    plan = segment_plan(jnp.asarray(slot), g, 16)
    got = np.asarray(lora_shrink_expand(x, jnp.asarray(a), jnp.asarray(b), y, plan,
                                        interpret=True, block_k=32, splits=2))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[slot == 0], np.asarray(y)[slot == 0])
