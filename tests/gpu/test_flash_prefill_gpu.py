"""The flash prefill kernels on the GPU at real sizes: dense and ragged paged outputs against the
float32 references, and greedy decoding of a small random model whose prompts were prefilled by
the Mosaic kernel (in two chunks, the second over the cached first half) equal to the reference
backend's. Skipped without a CUDA GPU (`make test-gpu` on the H200)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import flash_prefill as fp
from pallas_kernels.attention import reference
from pallas_kernels.attention.backend import AttentionBackend, get_backend
from pallas_kernels.attention.kv_quant import quantize
from pallas_kernels.common.testing import random_paged_batch
from small_model import greedy_decode, small_llama

pytestmark = pytest.mark.gpu

DENSE_CASES = [  # (B, L, Hq, Hkv, D, causal, dtype, softcap, q gain)
    (2, 1024, 8, 2, 128, True, jnp.bfloat16, None, 1.0),
    (2, 1000, 8, 8, 64, True, jnp.float16, None, 1.0),
    (1, 777, 4, 1, 128, False, jnp.bfloat16, None, 1.0),
    (1, 513, 8, 1, 64, True, jnp.bfloat16, 30.0, 1.0),
    # Wide logits (std ~12): row maxima jump by more than the lazy-rescale threshold mid-item, so
    # the rescale runs on steps other than an item's first.
    (1, 900, 4, 1, 128, True, jnp.bfloat16, None, 12.0),
    (2, 700, 8, 2, 64, False, jnp.float16, None, 12.0),
    (1, 8192, 32, 8, 128, True, jnp.bfloat16, None, 1.0),
    (2, 4096, 32, 8, 128, False, jnp.bfloat16, None, 1.0),
]

PAGED_CASES = [  # (Hq, Hkv, D, block, q_lens, prefixes, extra padding tokens, softcap, dtype)
    (4, 1, 64, 16, [37, 1, 130, 300], [0, 20, 45, 1000], 5, None, jnp.bfloat16),
    (8, 8, 128, 32, [5, 200, 129], [300, 0, 17], 0, None, jnp.bfloat16),
    (8, 8, 128, 32, [5, 200, 129], [300, 0, 17], 0, None, jnp.float16),
    (32, 4, 128, 16, [1, 64, 65, 128, 257], [0, 127, 3, 500, 2048], 11, None, jnp.bfloat16),
    (16, 2, 64, 32, [700, 3], [33, 4000], 3, 50.0, jnp.bfloat16),
    (32, 8, 128, 16, [512] * 2, [8192] * 2, 0, None, jnp.bfloat16),  # a real-size chunk
]


def rel_err(out, ref) -> float:
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize("case", range(len(DENSE_CASES)))
def test_dense_matches_the_reference(case):
    b, l, hq, hkv, d, causal, dt, cap, gain = DENSE_CASES[case]
    ks = jax.random.split(jax.random.key(100 + case), 3)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
    q = (gain * normal(ks[0], (b, l, hq, d))).astype(dt)
    k, v = normal(ks[1], (b, l, hkv, d)).astype(dt), normal(ks[2], (b, l, hkv, d)).astype(dt)
    ref = jax.jit(functools.partial(reference.causal_attention_reference, scale=d ** -0.5,
                                    softcap=cap, causal=causal))(q, k, v)
    out = jax.jit(functools.partial(fp.flash_attention, causal=causal, scale=d ** -0.5,
                                    softcap=cap))(q, k, v)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_ragged_paged_matches_the_reference(case, kernel):
    hq, hkv, d, bs, ql, pre, extra, cap, dt = PAGED_CASES[case]
    args = random_paged_batch(np.random.default_rng(7 + case), hq=hq, hkv=hkv, d=d, block_size=bs,
                              q_lens=ql, prefixes=pre, dtype=dt, extra_tokens=extra)
    ref = jax.jit(functools.partial(reference.ragged_prefill_reference, scale=d ** -0.5,
                                    softcap=cap))(*args)
    fn = fp.flash_prefill_mosaic if kernel == "mosaic" else fp.flash_prefill_triton
    out = jax.jit(functools.partial(fn, scale=d ** -0.5, softcap=cap))(*args)
    used = int(args[3][-1])
    assert rel_err(out[:used], ref[:used]) < 1e-2
    assert not jnp.abs(out[used:].astype(jnp.float32)).any()  # padding tokens come out zero


@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
@pytest.mark.parametrize("case", [0, 3, 4])
def test_ragged_paged_over_an_fp8_cache_matches_the_reference(case, kernel):
    # The reference reads the same fp8 pages: what is compared is the kernels' fp8 reads.
    hq, hkv, d, bs, ql, pre, extra, cap, _ = PAGED_CASES[case]
    q, k, v, *rest = random_paged_batch(np.random.default_rng(7 + case), hq=hq, hkv=hkv, d=d,
                                        block_size=bs, q_lens=ql, prefixes=pre, extra_tokens=extra)
    k, v = quantize(k, 0.25), quantize(v, 0.25)
    ref = jax.jit(functools.partial(reference.ragged_prefill_reference, scale=d ** -0.5,
                                    softcap=cap))(q, k, v, *rest)
    fn = fp.flash_prefill_mosaic if kernel == "mosaic" else fp.flash_prefill_triton
    out = jax.jit(functools.partial(fn, scale=d ** -0.5, softcap=cap))(q, k, v, *rest)
    used = int(rest[0][-1])
    assert rel_err(out[:used], ref[:used]) < 1e-2
    assert not jnp.abs(out[used:].astype(jnp.float32)).any()


def test_greedy_decoding_after_a_kernel_prefill_equals_the_reference():
    cfg, params = small_llama(jnp.bfloat16)
    ref_backend = get_backend("reference")
    flash = AttentionBackend("flash-prefill+reference-decode",
                             decode=reference.paged_decode_reference,
                             prefill=fp.flash_prefill_mosaic)
    ref_tokens, ref_logits = greedy_decode(cfg, params, ref_backend, ref_backend, steps=12)
    tokens, logits = greedy_decode(cfg, params, flash, ref_backend, steps=12)
    assert (tokens == ref_tokens).all() or rel_err(logits, ref_logits) < 2e-2
