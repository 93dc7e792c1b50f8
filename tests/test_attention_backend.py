"""The attention dispatch (`pallas_kernels/attention/backend.py`): mixed steps split on the device into the
decode part (leading one-token sequences) and the prefill part must give exactly what sending the
whole step through the prefill path gives. Checked with the jnp reference as both parts, so the
split logic is what is under test (the kernels are tested against the reference on their own)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.backend import REFERENCE
from pallas_kernels.attention.metadata import AttentionMetadata
from pallas_kernels.common.testing import random_paged_batch

SPLIT = dataclasses.replace(REFERENCE, name="reference-split", split_mixed_steps=True)


@pytest.mark.parametrize("q_lens,prefixes,extra", [
    ([1, 1, 1, 5, 1, 7, 0], [9, 30, 3, 4, 17, 0, 0], 3),  # decodes, prefills, a 1-token chunk later
    ([1, 1, 1, 0], [5, 40, 2, 0], 5),                      # only decodes, padding tokens after
    ([4, 1, 1], [0, 6, 20], 0),                            # no leading decode
])
def test_mixed_step_split_matches_unsplit(q_lens, prefixes, extra):
    rng = np.random.default_rng(len(q_lens))
    q, k, v, qsl, seq_lens, tables = random_paged_batch(
        rng, hq=8, hkv=2, d=32, block_size=8, q_lens=q_lens, prefixes=prefixes,
        dtype=jnp.float32, extra_tokens=extra)
    md = AttentionMetadata(jnp.full((q.shape[0],), -1, jnp.int32), qsl, seq_lens, tables)
    want = REFERENCE(q, k, v, md, scale=0.3)
    got = SPLIT(q, k, v, md, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
