"""The latent decode (pallas_kernels/attention/latent_reference.py) equals the generic paged
reference run with the latent cache as both K and V, on ragged lengths (an empty sequence, one
token, a partial last page, a full table) over shuffled pages, 16 query heads sharing each page."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.latent_reference import paged_latent_decode
from pallas_kernels.attention.reference import paged_decode_reference


def test_latent_decode_equals_the_generic_reference():
    heads = 16
    rng = np.random.default_rng(heads)
    block, pages, width = 4, 5, 40
    lens = np.array([0, 1, 7, block * pages, 13])
    cache = jnp.asarray(rng.normal(size=(1, len(lens) * pages, block, width)), jnp.float32)
    tables = jnp.asarray(rng.permutation(len(lens) * pages).reshape(len(lens), pages), jnp.int32)
    q = jnp.asarray(rng.normal(size=(len(lens), heads, width)), jnp.float32)
    got = paged_latent_decode(q, cache, cache, tables, jnp.asarray(lens, jnp.int32), scale=0.3)
    want = paged_decode_reference(q, cache, cache, tables, jnp.asarray(lens, jnp.int32), scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert not np.asarray(got[0]).any()  # no context: zeros


def test_latent_decode_refuses_variants_it_does_not_have():
    cache = jnp.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="soft-cap, window or sinks"):
        paged_latent_decode(jnp.zeros((1, 2, 8)), cache, cache, jnp.zeros((1, 2), jnp.int32),
                            jnp.ones((1,), jnp.int32), scale=1.0, window=4)
