"""The recurrent-layer kernels (pallas_kernels/ssm) compiled by Triton on the GPU at the models' head
shapes, against their jnp references: Gated DeltaNet (Qwen3-Next), Mamba-2 SSD (Nemotron-H) and the
causal conv1d, on a ragged batch with a padding row, one-token rows and a prompt of many chunks,
the state pool donated (in place: other slots keep their bits). Skipped without a CUDA GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.bench.kernel_ssm import CONV, GDN, SSD, gdn_args, rel_err, ssd_args
from pallas_kernels.ssm import conv1d, gated_deltanet, mamba2, reference

pytestmark = pytest.mark.gpu

LENS = [700, 1, 64, 0, 131]
SLOTS = [5, 2, 7, -1, 0]  # of 8; the padding row names none
INIT = [True, True, False, True, False]


def batch():
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENS)]), jnp.int32)
    return (int(cu[-1]) + 5, cu, jnp.asarray(SLOTS, jnp.int32), jnp.asarray(INIT))


def untouched(before, after):
    others = np.setdiff1d(np.arange(before.shape[0]), [s for s in SLOTS if s >= 0])
    np.testing.assert_array_equal(np.asarray(after)[others], np.asarray(before)[others])


@pytest.mark.parametrize("block_v, ut_solve, correlated", [
    (32, "rows", False), (64, "rows", False), (128, "rows", False), (64, "doubling", False),
    (64, "rows", True), (64, "doubling", True)])
def test_gdn_prefill(block_v, ut_solve, correlated):
    """`correlated`: every key near one vector and beta near 1, so the UT transform's blocks
    are near 1 below the diagonal, where the doubling's powers cancel most."""
    t, cu, slots, init = batch()
    ins, pool = gdn_args(t, 8, **GDN)
    if correlated:
        q, k, v, g, beta = ins
        k = (k[:1] + 0.01 * k).astype(k.dtype)
        ins = (q, k, v, g, jnp.full_like(beta, 0.99))
    want = reference.gdn_chunked_reference(*ins, pool, cu, slots, init)
    before = np.asarray(pool)
    run = jax.jit(lambda p: gated_deltanet.gdn_prefill(*ins, p, cu, slots, init, block_v=block_v,
                                                       ut_solve=ut_solve),
                  donate_argnums=0)
    o, new = run(pool)
    assert rel_err(o, want[0]) < 2e-2 and rel_err(new, want[1]) < 2e-2
    untouched(before, new)


def test_gdn_decode():
    slots = jnp.asarray(SLOTS, jnp.int32)
    ins, pool = gdn_args(len(SLOTS), 8, **GDN)
    want = reference.gdn_decode_reference(*ins, pool, slots)
    before = np.asarray(pool)
    o, new = jax.jit(lambda p: gated_deltanet.gdn_decode(*ins, p, slots), donate_argnums=0)(pool)
    assert rel_err(o, want[0]) < 1e-3 and rel_err(new, want[1]) < 1e-4
    untouched(before, new)


@pytest.mark.parametrize("block_p", [32, 64])
def test_ssd_prefill(block_p):
    t, cu, slots, init = batch()
    (x, dt, a, b, c), pool = ssd_args(t, 8, **SSD)
    d = jnp.linspace(0.0, 1.0, SSD["h"])
    want = reference.ssd_chunked_reference(x, dt, a, b, c, pool, cu, slots, init, d=d)
    before = np.asarray(pool)
    run = jax.jit(lambda p: mamba2.ssd_prefill(x, dt, a, b, c, p, cu, slots, init, d=d,
                                               block_p=block_p),
                  donate_argnums=0)
    y, new = run(pool)
    assert rel_err(y, want[0]) < 2e-2 and rel_err(new, want[1]) < 2e-2
    untouched(before, new)


def test_ssd_decode():
    slots = jnp.asarray(SLOTS, jnp.int32)
    (x, dt, a, b, c), pool = ssd_args(len(SLOTS), 8, **SSD)
    want = reference.ssd_decode_reference(x, dt, a, b, c, pool, slots)
    before = np.asarray(pool)
    y, new = jax.jit(lambda p: mamba2.ssd_decode(x, dt, a, b, c, p, slots),
                     donate_argnums=0)(pool)
    assert rel_err(y, want[0]) < 1e-3 and rel_err(new, want[1]) < 1e-4
    untouched(before, new)


def test_conv1d_prefill_and_update():
    t, cu, slots, init = batch()
    c, w = CONV["c"], CONV["w"]
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (t, c), jnp.bfloat16)
    weight = jax.random.normal(ks[1], (w, c), jnp.bfloat16)
    bias = jax.random.normal(ks[2], (c,), jnp.bfloat16)
    state = jax.random.normal(ks[3], (8, w - 1, c), jnp.bfloat16)
    want = reference.causal_conv1d_reference(x, weight, bias, state, cu, slots, init)
    before = np.asarray(state.astype(jnp.float32))
    y, new = jax.jit(lambda s: conv1d.causal_conv1d(x, weight, bias, s, cu, slots, init),
                     donate_argnums=0)(state)
    assert rel_err(y, want[0]) < 1e-2
    np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)),
                                  np.asarray(want[1].astype(jnp.float32)))
    untouched(before, new.astype(jnp.float32))
    want = reference.causal_conv1d_update_reference(x[:5], weight, bias, new, slots)
    y, new = jax.jit(lambda s: conv1d.causal_conv1d_update(x[:5], weight, bias, s, slots),
                     donate_argnums=0)(new)
    assert rel_err(y, want[0]) < 1e-2
    np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)),
                                  np.asarray(want[1].astype(jnp.float32)))
