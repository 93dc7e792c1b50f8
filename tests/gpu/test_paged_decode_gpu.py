"""The paged decode kernels on the GPU at real sizes: outputs against the float32 reference, the
cache write done in place, and greedy decoding of a small random model equal to the reference
backend's. Skipped without a CUDA GPU (`make test-gpu` on the H200)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import reference
from pallas_kernels.attention.backend import AttentionBackend, get_backend
from pallas_kernels.attention.kv_quant import quantize
from pallas_kernels.attention.paged_decode import paged_decode_mosaic, paged_decode_triton
from small_model import greedy_decode, small_llama

pytestmark = pytest.mark.gpu

KERNELS = {"mosaic": paged_decode_mosaic, "triton": paged_decode_triton}

# (batch, hq, hkv, d, page, max_blocks, softcap)
CASES = [
    (64, 32, 8, 128, 16, 256, None),  # the target shape, random lengths up to 4096
    (3, 32, 8, 128, 16, 2048, None),  # few sequences, long contexts: many splits
    (33, 8, 8, 64, 32, 40, None),     # GQA 1, d 64, page 32
    (17, 32, 4, 128, 32, 64, 50.0),   # GQA 8, soft-cap
    (5, 16, 4, 64, 16, 100, None),    # GQA 4, d 64
]


def random_case(seed, batch, hq, hkv, d, page, max_blocks):
    """Random lengths including 0, 1 and the full capacity, shuffled block tables."""
    rng = np.random.default_rng(seed)
    num_blocks = batch * max_blocks + 7
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (hkv, num_blocks, page, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (hkv, num_blocks, page, d), jnp.bfloat16)
    cap = max_blocks * page
    lens = rng.integers(1, cap + 1, batch)
    lens[: min(batch, 3)] = [0, 1, cap][: min(batch, 3)]
    rng.shuffle(lens)
    bt = rng.permutation(num_blocks)[: batch * max_blocks].reshape(batch, max_blocks)
    bt = np.where(np.arange(max_blocks)[None] < -(-lens[:, None] // page), bt, 0)
    return q, k, v, jnp.asarray(bt, jnp.int32), jnp.asarray(lens, jnp.int32)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_matches_the_reference_at_real_sizes(case, kernel):
    b, hq, hkv, d, page, mb, cap = CASES[case]
    q, k, v, bt, lens = random_case(case, b, hq, hkv, d, page, mb)
    scale = d ** -0.5
    ref = np.asarray(jax.jit(functools.partial(reference.paged_decode_reference, scale=scale,
                                               softcap=cap))(q.astype(jnp.float32), k, v, bt, lens))
    # A NaN-filled buffer of the output's size freed right before the run: a fresh output likely
    # lands on it, so rows the kernel fails to write show up as NaN.
    poison = jax.block_until_ready(jnp.full((b, hq, d), jnp.nan, jnp.bfloat16))
    del poison
    out = np.asarray(jax.jit(functools.partial(KERNELS[kernel], scale=scale, softcap=cap))(
        q, k, v, bt, lens).astype(jnp.float32))
    assert np.isfinite(out).all()
    assert (out[np.asarray(lens) == 0] == 0).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", [0, 2, 3])
def test_decode_over_an_fp8_cache_matches_the_reference(case, kernel):
    # The reference reads the same fp8 pages: what is compared is the kernels' fp8 reads.
    b, hq, hkv, d, page, mb, cap = CASES[case]
    q, k, v, bt, lens = random_case(case, b, hq, hkv, d, page, mb)
    k, v = quantize(k, 0.25), quantize(v, 0.25)
    scale = d ** -0.5
    ref = np.asarray(jax.jit(functools.partial(reference.paged_decode_reference, scale=scale,
                                               softcap=cap))(q.astype(jnp.float32), k, v, bt, lens))
    out = np.asarray(jax.jit(functools.partial(KERNELS[kernel], scale=scale, softcap=cap))(
        q, k, v, bt, lens).astype(jnp.float32))
    assert np.isfinite(out).all()
    assert (out[np.asarray(lens) == 0] == 0).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_cache_write_stays_in_place():
    """One decode step's cache write (an XLA scatter into the donated cache) at the target shape
    must not copy the whole cache."""
    hkv, d, page, nb, t = 8, 128, 16, 16384 * 8, 256
    k_cache = jax.ShapeDtypeStruct((hkv, nb, page, d), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((t, hkv, d), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((t,), jnp.int32)
    hlo = jax.jit(reference.write_kv, donate_argnums=(0, 1)).lower(
        k_cache, k_cache, new, new, slots).compile().as_text()
    assert not any(" copy(" in ln and f"bf16[{hkv},{nb},{page},{d}]" in ln
                   for ln in hlo.splitlines())


def test_greedy_decoding_with_the_kernel_equals_the_reference():
    """A small random model, prefill by the reference backend, then greedy decode with the kernel
    as the decode backend: the tokens equal the reference backend's, or, where a near-tie flips
    one, teacher-forced top-1 agreement stays near 1."""
    cfg, params = small_llama(jnp.float32)
    ref_backend = get_backend("reference")
    kernel = AttentionBackend("mosaic+reference-prefill", decode=paged_decode_mosaic,
                              prefill=reference.ragged_prefill_reference)
    ref_tokens, ref_logits = greedy_decode(cfg, params, ref_backend, ref_backend)
    tokens, _ = greedy_decode(cfg, params, ref_backend, kernel)
    if (tokens != ref_tokens).any():
        _, forced = greedy_decode(cfg, params, ref_backend, kernel, forced=ref_tokens)
        assert (forced.argmax(-1) == ref_logits.argmax(-1)).mean() > 0.97
