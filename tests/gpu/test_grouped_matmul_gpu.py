"""The grouped-matmul kernels on the GPU: both Hopper kernels (one-warpgroup decode tiling,
warp-specialised prefill tiling split by M and by N, with and without one ring across units),
plain and with the fused SwiGLU, against float32 `ragged_dot` on ragged group sizes with empty
experts and one hot expert; and the expert MLP `moe_experts` at decode and prefill row counts.
Skipped without a CUDA GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import grouped_matmul as gm
from pallas_kernels.moe.grouped_matmul_mosaic import GmmConfig
from pallas_kernels.moe.grouped_matmul_ws import WsConfig
from pallas_kernels.common.testing import ragged_group_sizes

pytestmark = pytest.mark.gpu

CASES = [(GmmConfig(64, 128, 64, 4), True), (WsConfig(128, 128, 64, 3, "m"), True),
         (WsConfig(64, 256, 32, 3, "n"), True), (WsConfig(128, 256, 64, 2, "m"), False),
         (WsConfig(64, 256, 64, 4, "n"), False),
         (WsConfig(128, 192, 64, 4, "m"), False)]  # (config, fused SwiGLU)


def _rel(out, ref) -> float:
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize("kind", ["random", "hot"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{'-swiglu' if c[1] else ''}")
def test_kernels_match_ragged_dot(case, kind):
    config, fused = case
    rng = np.random.default_rng(len(str(config)) + fused)
    rows, k, n, groups = 3001, 512, 768, 24
    # 9 rows past the groups
    sizes = jnp.asarray(ragged_group_sizes(rng, groups, rows - 9, kind), jnp.int32)
    used = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal((groups, k, n)) * k ** -0.5, jnp.bfloat16)
               for _ in range(2 if fused else 1))
    out = gm.gmm(x, ws, sizes, config)
    ref = [jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes) for w in ws]
    ref = jax.nn.silu(ref[0]) * ref[1] if fused else ref[0]
    assert out.shape == (rows, n)
    assert _rel(out[:used], ref[:used]) < 1e-2


@pytest.mark.parametrize("tokens", [64, 1024])
def test_moe_experts_on_the_kernels(tokens):
    rng = np.random.default_rng(tokens)
    experts, top_k, h, f = 64, 8, 1024, 768
    rows = tokens * top_k
    sizes = jnp.asarray(ragged_group_sizes(rng, experts, rows, "random"), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal(s) * s[1] ** -0.5, jnp.bfloat16)
               for s in [(experts, h, f), (experts, h, f), (experts, f, h)])
    ref = gm.moe_experts(x.astype(jnp.float32), tuple(w.astype(jnp.float32) for w in ws), sizes,
                         impl="ragged")
    out = gm.moe_experts(x, ws, sizes, max_group_size=tokens, impl="mosaic")
    used = int(sizes.sum())
    assert _rel(out[:used], ref[:used]) < 1e-2
