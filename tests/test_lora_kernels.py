"""The slot-grouped LoRA kernels (pallas_kernels/lora/segment_matmul.py): in the Pallas interpreter
inside the model against the XLA path on a ragged mixed batch; lowered for the H200 at real shapes;
the grouping on its own (pure jnp, no kernel)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import load_config
from jaxinfer.model.lora.delta import group_slots
from jaxinfer.model.lora.stacks import empty_stacks, slot_arrays
from jaxinfer.model.transformer import REFERENCE_KERNELS, Transformer
from jaxinfer.model.weights import load_params
from lora_support import random_adapter
from pallas_kernels.lora import segment_matmul
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


def test_kernels_in_the_model_equal_the_xla_path_and_read_only_used_slots(monkeypatch):
    """The llama fixture cut to one layer, adapters in slots 1 and 3 on its o_proj (one kernel
    pair), each token of a ragged mix of slots 0, 1, 3: the logits equal the XLA path's. Then
    slots 0 (no adapter) and 2 (unused) are filled with NaN: were either read into a row it would
    show. Blocks of 16 and a 2-SM device give K two splits of two blocks and N four blocks."""
    monkeypatch.setattr(segment_matmul, "MAX_BLOCK", 16)
    monkeypatch.setattr(segment_matmul, "num_sms", lambda: 2)
    cfg = load_config(FIXTURES / "llama")
    params = load_params(FIXTURES / "llama", cfg, jnp.float32, progress=False)
    cfg = dataclasses.replace(cfg, num_layers=1)
    params = {k: v for k, v in params.items() if k != "layers_1"}
    stacks = empty_stacks(cfg, params, 3, 4, jnp.float32, pow2=True)
    for slot, seed in ((1, 1), (3, 2)):
        arrays = slot_arrays(random_adapter(cfg, 4, seed), cfg, stacks)
        stacks = jax.tree.map(lambda s, v, i=slot: s.at[i].set(v), stacks, arrays)
    o_proj = stacks["layers_0"]["attn"]["o_proj"]
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 8)), jnp.int32)
    slots = jnp.asarray(rng.choice([0, 1, 3], (3, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), tokens.shape)
    model = Transformer(cfg, REFERENCE_KERNELS, jnp.float32)

    @jax.jit
    def logits(lora, lora_slot):
        stack = {"layers_0": {"attn": {"o_proj": lora}}}
        return model.apply({"params": params, "lora": stack}, tokens, positions,
                           lora_slot=lora_slot)[0]

    xla = np.asarray(logits(o_proj, slots))
    poisoned = jax.tree.map(lambda w: w.at[jnp.asarray([0, 2])].set(jnp.nan), o_proj)
    got = np.asarray(logits(poisoned, group_slots(slots.reshape(-1), 4)))
    np.testing.assert_allclose(got, xla, rtol=1e-4, atol=1e-4)
    base = np.asarray(logits(o_proj, jnp.zeros_like(slots)))
    assert not np.allclose(xla, base, atol=1e-3)  # the adapters do change the logits


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
