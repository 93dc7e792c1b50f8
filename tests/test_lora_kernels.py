"""The slot-grouped LoRA kernels (pallas_kernels/lora/segment_matmul.py) in the Pallas interpreter
against the XLA path on a ragged mixed batch and inside the model (--lora-impl pallas); the
grouping on its own (pure jnp, no kernel)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import load_config
from jaxinfer.model.lora.delta import group_slots, lora_delta
from jaxinfer.model.lora.stacks import empty_stacks, slot_arrays
from jaxinfer.model.transformer import REFERENCE, Transformer
from jaxinfer.model.weights import load_params
from lora_support import random_adapter
from pallas_kernels.lora.segment_matmul import block_m_for, lora_shrink_expand, segment_plan

FIXTURES = Path(__file__).parent / "fixtures" / "models"


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


def test_model_with_the_kernels_equals_the_xla_path():
    """The llama fixture with an adapter on layer 0's o_proj only (one kernel pair): logits of a
    batch mixing two adapters and the base model equal the XLA path's on the same stacks."""
    cfg = load_config(FIXTURES / "llama")
    params = load_params(FIXTURES / "llama", cfg, jnp.float32, progress=False)
    stacks = empty_stacks(cfg, params, 3, 4, jnp.float32, pow2=True)
    for slot, seed in ((1, 1), (3, 2)):
        arrays = slot_arrays(random_adapter(cfg, 4, seed), cfg, stacks)
        stacks = jax.tree.map(lambda s, v, i=slot: s.at[i].set(v), stacks, arrays)
    stacks = {"layers_0": {"attn": {"o_proj": stacks["layers_0"]["attn"]["o_proj"]}}}
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 8)), jnp.int32)
    slots = jnp.asarray([[1] * 8, [0] * 8, [3] * 8], jnp.int32)
    model = Transformer(cfg, REFERENCE, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(8), tokens.shape)

    @jax.jit
    def logits(lora_slot):
        return model.apply({"params": params, "lora": stacks}, tokens, positions,
                           lora_slot=lora_slot)[0]

    xla = np.asarray(logits(slots))
    got = np.asarray(logits(group_slots(slots.reshape(-1), 4)))
    np.testing.assert_allclose(got, xla, rtol=1e-4, atol=1e-4)
    assert not np.allclose(xla[0], xla[1], atol=1e-3)  # the adapter does change the logits


def test_kernels_lower_to_triton_at_llama3_8b_shapes(monkeypatch):
    """Triton's rules the interpreter does not check (power-of-two blocks, dot sizes), lowered for
    an H200 on this CPU machine: down_proj at decode (K 14336 split) and gate_up at prefill."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))

    def delta(x, a, b, y, slot):
        return lora_shrink_expand(x, a, b, y, segment_plan(slot, a.shape[0],
                                                           block_m_for(x.shape[0])))

    for t, k, w, n in ((64, 14336, 16, 4096), (2048, 4096, 32, 28672)):
        bf16 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
        args = (bf16((t, k)), bf16((9, k, w)), bf16((9, w, n)), bf16((t, n)),
                jax.ShapeDtypeStruct((t,), jnp.int32))
        text = jax.jit(delta).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2  # shrink and expand
