"""The one-token K/V cache write (dynamic-update-slices) against the general scatter: the same
cache for any slot, padding (a negative slot) writing nothing, and in place under donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import scatter_kv, write_kv


@pytest.mark.parametrize("slot", [0, 5, 17, 63, -1])
def test_one_token_write_equals_the_scatter(slot):
    ks = jax.random.split(jax.random.key(slot + 1), 4)
    k_cache = jax.random.normal(ks[0], (2, 4, 16, 8), jnp.bfloat16)
    v_cache = jax.random.normal(ks[1], (2, 4, 16, 8), jnp.bfloat16)
    k = jax.random.normal(ks[2], (1, 2, 8), jnp.float32)  # cast to the cache's dtype on the way
    v = jax.random.normal(ks[3], (1, 2, 8), jnp.float32)
    slots = jnp.asarray([slot], jnp.int32)
    got = write_kv(k_cache, v_cache, k, v, slots)
    want = scatter_kv(k_cache, v_cache, k, v, slots)
    for g, w, old in zip(got, want, (k_cache, v_cache)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        assert (np.asarray(g != old).any()) == (slot >= 0)


def test_one_token_write_updates_the_donated_cache_in_place():
    cache = jax.ShapeDtypeStruct((8, 4096, 16, 128), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((1, 8, 128), jnp.bfloat16)
    hlo = jax.jit(write_kv, donate_argnums=(0, 1)).lower(
        cache, cache, new, new, jax.ShapeDtypeStruct((1,), jnp.int32)).compile().as_text()
    assert not any(" copy(" in ln and "bf16[8,4096,16,128]" in ln for ln in hlo.splitlines())
