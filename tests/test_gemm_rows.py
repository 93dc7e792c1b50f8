"""gemm_rows: one token's small products run on two rows (as on a GPU) give the same outputs."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import gemm_rows
from jaxinfer.model.kernel_table import REFERENCE_KERNELS
from jaxinfer.model.transformer import train_forward
from test_mla_engine import model


def test_one_row_runs_twice_behind_a_barrier_and_keeps_its_value():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8, 16)), jnp.float32)

    def f(x):
        return jnp.einsum("thk,hkn->thn", x, w)
    got = jax.jit(lambda x: gemm_rows.gemm_rows(f, x, 1, 512))
    assert "optimization_barrier" in got.lower(x).as_text()
    assert "2x4x8" in got.lower(x).as_text()  # the product's operand: the token twice
    np.testing.assert_allclose(got(x), f(x), rtol=1e-5)
    # Past XLA's threshold, or with more than one row, the product is left as it is.
    for y, macs in ((x, gemm_rows.XLA_STRENGTH_REDUCE_BELOW), (jnp.concatenate([x, x]), 512)):
        text = jax.jit(lambda y: gemm_rows.gemm_rows(f, y, y.shape[0], macs)
                       ).lower(y).as_text()
        assert "optimization_barrier" not in text


def test_mla_model_outputs_are_unchanged_by_the_second_row():
    """DeepSeek's projections, router and absorbed per-head products at one token."""
    cfg, params = model()
    toks = jnp.asarray([[5]], jnp.int32)
    want = jax.jit(lambda t: train_forward(params, cfg, t))(toks)
    gpu_rows = dataclasses.replace(REFERENCE_KERNELS, gemm_rows=gemm_rows.gemm_rows)
    fn = jax.jit(lambda t: train_forward(params, cfg, t, gpu_rows))
    assert "optimization_barrier" in fn.lower(toks).as_text()
    np.testing.assert_allclose(fn(toks), want, rtol=1e-5, atol=1e-5)


def test_eagle_head_step_outputs_are_unchanged_by_the_second_row():
    """An EAGLE-3 head's chain steps after the first run one token a row: its fc, projections and
    draft lm head stay products on the GPU too; the serving layout (q/k/v and gate/up fused) runs
    six of them with the same outputs."""
    from jaxinfer.spec_decode import eagle_head as head
    from test_eagle3 import random_head
    from test_engine_support import tiny_model
    target_cfg, target_params = tiny_model()
    cfg, hp = random_head(target_cfg, std=0.2)
    embed = target_params["embed"]["embedding"]
    aux = jnp.asarray(np.random.default_rng(3).normal(size=(1, cfg.stream_width)), jnp.float32)

    def step(ids, aux, hp=hp, rows=gemm_rows.plain_rows):
        def attend(q, k, v):  # the token attends to itself alone
            g = q.shape[-2] // k.shape[-2]
            k, v = (jnp.repeat(a, g, axis=-2) for a in (k, v))
            w = jax.nn.softmax(jnp.einsum("thd,shd->hts", q, k), axis=-1)
            return jnp.einsum("hts,shd->thd", w, v)
        normed, stream = head.layer(hp, cfg, embed, ids, head.fuse(hp, aux, rows),
                                    jnp.zeros(1, int), attend, rows)
        return head.draft_logits(hp, normed, rows), stream
    ids = jnp.asarray([7], jnp.int32)
    want = jax.jit(step)(ids, aux)
    fn = jax.jit(lambda i, a: step(i, a, rows=gemm_rows.gemm_rows))
    assert fn.lower(ids, aux).as_text().count("optimization_barrier") == 9
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    jax.tree_util.tree_map(close, fn(ids, aux), want)
    fused = jax.jit(lambda i, a: step(i, a, head.fuse_projections(hp), gemm_rows.gemm_rows))
    assert fused.lower(ids, aux).as_text().count("optimization_barrier") == 6
    jax.tree_util.tree_map(close, fused(ids, aux), want)
