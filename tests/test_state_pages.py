"""The state pages (jaxinfer/model/state_pages.py): a state-space layer's states laid over its
attention pages, element by element in 16-bit and fp8 caches, read back bit-exact, and laid out
alike at every tensor-parallel size. The shapes are a Mamba-2 layer's conv and SSM states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.state_pages import (StateShape, read_states, state_pages, state_shares,
                                         write_states)

BLOCK = 4
# A conv state of two channel parts and a two-head state: two shares over two KV heads.
SHARED_STATES = (StateShape((3, 6), 1, (2, 4)), StateShape((2, 4, 4)))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float16,
                                   jnp.float32])
def test_states_read_back_bit_exact_from_every_cache_dtype(dtype):
    """Any float32 bits (NaNs and infinities too) written over a sequence's state pages read back
    unchanged, in table order over shuffled blocks; in a narrower cache no stored element is a
    NaN or infinity (an attention kernel's masked read of a stale one would give 0 x NaN)."""
    kv = tuple(jnp.zeros((2, 8, BLOCK, 8), dtype) for _ in range(2))
    n = state_pages(kv, SHARED_STATES)
    narrow = jnp.dtype(dtype).itemsize < 4
    assert n == -(-50 * (6 if narrow else 4) // (2 * 2 * BLOCK * 8 * jnp.dtype(dtype).itemsize))
    states = _random_states(2, 0)
    blocks = jnp.asarray(np.random.default_rng(1).permutation(8)[:2 * n].reshape(2, n), jnp.int32)
    written = jax.jit(write_states, static_argnums=3)(kv, blocks, states, SHARED_STATES)
    back = jax.jit(read_states, static_argnums=2)(written, blocks, SHARED_STATES)
    for want, got in zip(states, back):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      np.asarray(want).view(np.uint32))
    if narrow:
        assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in written)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_state_pages_layout_is_the_same_at_every_tp_size(dtype):
    """The states laid over a two-head cache by one device are, head by head, the states each of
    two devices lays over its one-head shard (the first or second half of every part): a page's
    layout does not depend on the TP size, so the disaggregated hand-over copies pages between
    sizes as they are."""
    kv = tuple(jnp.zeros((2, 8, BLOCK, 8), dtype) for _ in range(2))
    assert state_shares(2, SHARED_STATES) == 2
    states = _random_states(2, 2)
    blocks = jnp.asarray([[5, 1, 6], [2, 7, 0]], jnp.int32)
    write = jax.jit(write_states, static_argnums=3)
    read = jax.jit(read_states, static_argnums=2)
    whole = write(kv, blocks, states, SHARED_STATES)
    halves = tuple(s.split(2) for s in SHARED_STATES)
    (conv, ssm), shards = states, []
    for i in range(2):
        own = (jnp.concatenate([conv[:, :, i:i + 1], conv[:, :, 2 + 2 * i:4 + 2 * i]], axis=2),
               ssm[:, i:i + 1])
        shard = tuple(a[i:i + 1] for a in whole)
        for want, got in zip(own, read(shard, blocks, halves)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        shards.append(write(tuple(a[i:i + 1] for a in kv), blocks, own, halves))
    for a, b0, b1 in zip(whole, *shards):
        np.testing.assert_array_equal(np.asarray(a, np.float32),
                                      np.concatenate([b0, b1]).astype(np.float32))


def _random_states(seqs: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """Random float32 bits (NaNs and infinities too) as states of SHARED_STATES."""
    bits = np.random.default_rng(seed).integers(0, 2 ** 32, (seqs, 50), dtype=np.uint64)
    words = bits.astype(np.uint32).view(np.float32)
    return (jnp.asarray(words[:, :18].reshape(seqs, 3, 6)),
            jnp.asarray(words[:, 18:].reshape(seqs, 2, 4, 4)))
