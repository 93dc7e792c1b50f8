"""Sliding window, sinks and softcap in the attention kernels (Mosaic GPU in its CPU interpreter,
Triton in interpret mode) against the jnp reference, on random ragged shapes: a window smaller than
a page, windows spanning pages, contexts much longer than the window, the split-combine paths.

The K/V pages a kernel must skip (decode: every page wholly before the row's window; prefill: the
pages before the K/V step holding the first key of a tile's first row) are filled with NaN, so a
kernel that loaded them would return NaN (0 * NaN in P @ V): the tests check that a window makes
the kernels read less, not only mask more. The reference reads the clean cache."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import flash_prefill as fp
from pallas_kernels.attention import reference
from pallas_kernels.attention.flash_config import KernelConfig
from pallas_kernels.attention.kv_quant import quantize
from pallas_kernels.attention.paged_decode import (MosaicDecodeConfig, paged_decode_mosaic,
                                                   paged_decode_triton_configured)
from pallas_kernels.common.testing import random_paged_batch

import kernel_references

KV_STEP = 64  # the prefill kernels' K/V step in these tests (Mosaic block_kv, Triton BLOCK_K)


def poisoned(cache, tables, skip_tokens):
    """cache with NaN in the pages of sequence s that lie wholly before skip_tokens[s]."""
    bs = cache.shape[2]
    tables = np.asarray(tables)
    blocks = [tables[s, p] for s, skip in enumerate(skip_tokens) for p in range(skip // bs)]
    assert blocks, "the case must have pages before some window"
    return cache.at[:, np.asarray(blocks)].set(jnp.nan)


def assert_close(out, ref, atol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "NaN: a page before the window was read"
    np.testing.assert_allclose(out, ref, atol=atol, rtol=atol)
    # bf16 output: ~2^-9 relative; a wrong window or a lost sink is far off in norm.
    assert np.linalg.norm(out - ref) < 1e-2 * np.linalg.norm(ref)


def decode_case(seed, *, prefixes, window, hq=4, hkv=1, d=64, block_size=16, cache_dtype=None):
    """Decode inputs (one token per sequence, contexts prefixes[s] + 1), clean and poisoned caches,
    and sinks."""
    rng = np.random.default_rng(seed)
    q, k, v, _, lens, tables = random_paged_batch(rng, hq=hq, hkv=hkv, d=d, block_size=block_size,
                                                  q_lens=[1] * len(prefixes), prefixes=prefixes)
    if cache_dtype is not None:
        k, v = quantize(k, 0.5, cache_dtype), quantize(v, 0.5, cache_dtype)
    skip = [max(n - window, 0) // block_size * block_size for n in np.asarray(lens)]
    sinks = jnp.asarray(rng.normal(size=hq) * 2, jnp.float32)
    return q, (k, v), (poisoned(k, tables, skip), poisoned(v, tables, skip)), tables, lens, sinks


def decode_reference(q, clean, tables, lens, **variant):
    k, v = (c.astype(jnp.float32) for c in clean)
    return kernel_references.paged_decode_reference(q.astype(jnp.float32), k, v, tables, lens, **variant)


# Lengths: empty, shorter than the window, and several pages past it.
MOSAIC_DECODE = {
    # bf16, one split: the sinks in the kernel's merge; a window smaller than a page.
    "bf16_one_split_window_lt_page": (dict(prefixes=[-1, 3, 100, 140], window=9),
                                      dict(num_splits=1), dict(softcap=5.0), None),
    # fp8 cache, two splits merged by the combine kernel (the sinks there); up to 8 pages in a window.
    "fp8_split_combine_window_spans_pages": (dict(prefixes=[230, 20], window=100),
                                             dict(num_splits=2, fp8_tokens_per_step=64),
                                             dict(softcap=None), jnp.float8_e4m3fn),
}


@pytest.mark.parametrize("name", MOSAIC_DECODE)
def test_mosaic_decode_window_sinks_softcap(name):
    case, config, variant, cache_dtype = MOSAIC_DECODE[name]
    prefixes = [max(p, 0) for p in case["prefixes"]]
    q, clean, dirty, tables, lens, sinks = decode_case(1, prefixes=prefixes,
                                                       window=case["window"],
                                                       cache_dtype=cache_dtype)
    if -1 in case["prefixes"]:  # an empty (padding) sequence
        lens = lens.at[case["prefixes"].index(-1)].set(0)
    variant = dict(variant, scale=0.125, window=case["window"], sinks=sinks)
    cfg = MosaicDecodeConfig(tokens_per_step=64, stages=2, num_ctas=2, **config)
    out = paged_decode_mosaic(q, *dirty, tables, lens, config=cfg, interpret=True, **variant)
    assert_close(out, decode_reference(q, clean, tables, lens, **variant), atol=2e-2)


def test_triton_decode_window_sinks_softcap_over_splits():
    # One page per step and few programs: several splits per sequence, merged with the sinks.
    q, clean, dirty, tables, lens, sinks = decode_case(2, prefixes=[90, 61], window=20)
    variant = dict(scale=0.125, softcap=4.0, window=20, sinks=sinks)
    out = paged_decode_triton_configured(q, *dirty, tables, lens, pages_per_step=1, workers=8,
                                         interpret=True, **variant)
    assert_close(out, decode_reference(q, clean, tables, lens, **variant), atol=2e-2)


def prefill_case(seed, *, q_lens, prefixes, window, hq, hkv, extra=3):
    rng = np.random.default_rng(seed)
    q, k, v, *rest = random_paged_batch(rng, hq=hq, hkv=hkv, d=64, block_size=16, q_lens=q_lens,
                                        prefixes=prefixes, extra_tokens=extra)
    # A tile's first row sits at most 7 alignment rows before its sequence's first new token.
    skip = [max(p - 7 - window + 1, 0) // KV_STEP * KV_STEP for p in prefixes]
    tables = rest[2]
    sinks = jnp.asarray(rng.normal(size=hq) * 2, jnp.float32)
    return q, (k, v), (poisoned(k, tables, skip), poisoned(v, tables, skip)), rest, sinks


@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_prefill_window_sinks_softcap(kernel):
    # Mosaic: a window smaller than a page, so the first K/V steps of most rows hold no key of
    # their window (the finite mask); Triton: a window spanning pages, a one-token chunk and an
    # empty sequence too. Both: a chunk whose prefix runs K/V steps past the window, padding.
    if kernel == "mosaic":
        window, cap, q_lens, prefixes, hq, hkv = 10, 3.0, [70, 9], [150, 0], 2, 1
    else:
        window, cap, q_lens, prefixes, hq, hkv = 100, None, [70, 1, 0, 9], [150, 200, 0, 0], 4, 2
    q, clean, dirty, rest, sinks = prefill_case(3, q_lens=q_lens, prefixes=prefixes,
                                                window=window, hq=hq, hkv=hkv)
    variant = dict(scale=0.125, softcap=cap, window=window, sinks=sinks)
    if kernel == "mosaic":
        out = fp.flash_prefill_mosaic(q, *dirty, *rest, interpret=True, **variant,
                                      config=KernelConfig(block_kv=KV_STEP, num_ctas=2))
    else:
        out = fp.flash_prefill_triton(q, *dirty, *rest, interpret=True, **variant)
    assert_close(out, kernel_references.ragged_prefill_reference(q, *clean, *rest, **variant), atol=2e-2)


def test_prefill_kernels_have_the_backend_signature():
    # `chunk` only the reference takes: a backend whose kernels lack it (chunked_local false)
    # runs chunked layers on the reference (backend.py)
    backend = list(name for name in inspect.signature(reference.ragged_prefill_reference).parameters
                   if name != "chunk")
    for fn in (fp.flash_prefill_mosaic, fp.flash_prefill_triton):
        params = inspect.signature(fn).parameters
        assert list(params)[:len(backend)] == backend
        extra = [params[name] for name in list(params)[len(backend):]]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), extra


def test_bad_window_and_sinks_name_the_field():
    q = jnp.zeros((1, 4, 64), jnp.bfloat16)
    cache = jnp.zeros((2, 3, 16, 64), jnp.bfloat16)
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="window"):
        paged_decode_mosaic(q, cache, cache, tables, lens, scale=1.0, window=0)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_triton_configured(q, cache, cache, tables, lens, scale=1.0,
                                       sinks=jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="window"):
        fp.flash_prefill_triton(q, cache, cache, jnp.asarray([0, 1], jnp.int32), lens, tables,
                                scale=1.0, window=-2)
