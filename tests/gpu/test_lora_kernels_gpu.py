"""The slot-grouped LoRA kernels (pallas_kernels/lora/segment_matmul.py) on the GPU at Llama-3-8B
shapes (bf16, rank 16, 8 adapters): bs 1, c = 64 decode with 8 adapters and base rows, and a
2048-token prefill mixing two adapters with the base, against the XLA path in float32. Unused
slots and slot 0 hold NaN (never read), rows of no adapter keep y bit for bit. Skipped without a
CUDA GPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.lora.delta import lora_delta_gather
from pallas_kernels.lora.segment_matmul import block_m_for, lora_shrink_expand, segment_plan

pytestmark = pytest.mark.gpu

# (tokens, K, W, N, slots used): qkv fused at bs 1, down at c = 64, gate_up fused at prefill
CASES = [(1, 4096, 64, 6144, (3,)), (64, 14336, 16, 4096, tuple(range(9))),
         (2048, 4096, 32, 28672, (0, 2, 5))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-N{c[3]}")
def test_kernels_match_the_reference(case):
    t, k, w, n, used = case
    rng = np.random.default_rng(t)
    slot = rng.choice(used, t).astype(np.int32)
    a = rng.standard_normal((9, k, w)).astype(np.float32) * k ** -0.5
    b = rng.standard_normal((9, w, n)).astype(np.float32) * 0.1
    unused = [s for s in range(9) if s == 0 or s not in used]
    a[unused], b[unused] = np.nan, np.nan
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16)
    plan = segment_plan(jnp.asarray(slot), 9, block_m_for(t))
    got = np.asarray(lora_shrink_expand(x, jnp.asarray(a, jnp.bfloat16),
                                        jnp.asarray(b, jnp.bfloat16), y, plan), np.float32)
    live = slot > 0
    clean = np.nan_to_num
    want = np.asarray(y, np.float32) + np.asarray(lora_delta_gather(
        x, jnp.asarray(clean(a), jnp.bfloat16), jnp.asarray(clean(b), jnp.bfloat16),
        jnp.asarray(slot)))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[~live], np.asarray(y, np.float32)[~live])
    if live.any():
        err = np.linalg.norm(got[live] - want[live]) / np.linalg.norm(want[live])
        assert err < 1e-2
