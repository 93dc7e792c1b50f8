"""The residual add + RMSNorm kernel (pallas_kernels/norm/rms_norm.py, run in Pallas' interpreter here)
against its jnp reference on random shapes, the shapes it leaves to the reference, and a model
whose kernel table carries it against the reference table."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.transformer import Transformer, train_forward
from jaxinfer.model.kernel_table import REFERENCE_KERNELS
from pallas_kernels.norm.reference import add_rms_norm_reference
from pallas_kernels.norm.rms_norm import add_rms_norm_triton
from test_engine_support import tiny_model

KERNEL = functools.partial(add_rms_norm_triton, interpret=True, max_rows=8)


def inputs(seed, shape, dtype):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], shape, dtype) * 3, jax.random.normal(ks[1], shape, dtype),
            1 + 0.1 * jax.random.normal(ks[2], shape[-1:], dtype))


@pytest.mark.parametrize("shape, dtype", [((1, 4096), jnp.bfloat16), ((3, 256), jnp.float32),
                                          ((2, 1, 128), jnp.float32)])
def test_kernel_matches_the_reference(shape, dtype):
    x, r, w = inputs(sum(shape), shape, dtype)
    (h, y), (h_ref, y_ref) = KERNEL(x, r, w, eps=1e-5), add_rms_norm_reference(x, r, w, eps=1e-5)
    assert h.dtype == y.dtype == dtype and y.shape == shape
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))
    # The mean's summation order differs: at most one rounding step of the output dtype.
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(9, 64), (2, 96)])
def test_other_shapes_run_the_reference(shape):
    x, r, w = inputs(1, shape, jnp.float32)
    for got, want in zip(KERNEL(x, r, w, eps=1e-6), add_rms_norm_reference(x, r, w, eps=1e-6)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_model_on_the_kernel_matches_the_reference_backend():
    cfg, params = tiny_model()
    kernels = dataclasses.replace(REFERENCE_KERNELS, add_rms_norm=KERNEL)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 6)), jnp.int32)
    got = Transformer(cfg, kernels, jnp.float32).apply({"params": params}, tokens[:, :1],
                                                       jnp.zeros((1, 1), jnp.int32))[0]
    want = train_forward(params, cfg, tokens[:, :1])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
