"""Sliding window, attention chunks, sinks and softcap in the jnp references (the kernels'
oracle), checked against a float64 numpy loop written from the definitions, and through the
backend dispatch (mixed steps, the fp8-KV wrapper, backends without chunks). Kernel tests
against the reference are in test_attention_variant_kernels.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import reference
from pallas_kernels.attention.backend import REFERENCE
from pallas_kernels.attention.kv_quant import FP8KVAttention
from pallas_kernels.attention.metadata import AttentionMetadata
from pallas_kernels.common.testing import random_paged_batch


def naive_ragged(q, k_cache, v_cache, qsl, seq_lens, tables, *, scale, softcap, window, sinks,
                 chunk=None):
    """Token by token, from the definitions: scores -> softcap -> causal/window mask -> softmax
    with one extra dropped logit per head."""
    q, kc, vc = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    qsl, seq_lens, tables = np.asarray(qsl), np.asarray(seq_lens), np.asarray(tables)
    hkv, _, bs, d = kc.shape
    hq = q.shape[1]
    out = np.zeros_like(q)
    for s in range(len(seq_lens)):
        ctx = seq_lens[s]
        blocks = tables[s, np.arange(ctx) // bs]
        k, v = kc[:, blocks, np.arange(ctx) % bs], vc[:, blocks, np.arange(ctx) % bs]  # [Hkv, L, D]
        for t in range(qsl[s], qsl[s + 1]):
            p = ctx - (qsl[s + 1] - t)
            for h in range(hq):
                kv = h // (hq // hkv)
                sc = k[kv] @ q[t, h] * scale
                if softcap:
                    sc = softcap * np.tanh(sc / softcap)
                j = np.arange(ctx)
                ok = (j <= p) & ((p - j < window) if window else True)
                if chunk:  # Llama 4's chunked local attention: the keys of the query's chunk
                    ok &= j // chunk == p // chunk
                logits = np.concatenate([sc[ok], [sinks[h]] if sinks is not None else []])
                if len(logits) == 0:
                    continue
                e = np.exp(logits - logits.max())
                out[t, h] = e[: ok.sum()] @ v[kv][ok] / e.sum()
    return out


RAGGED = dict(q_lens=[1, 1, 6, 13, 0, 2], prefixes=[30, 3, 11, 0, 0, 21])


@pytest.mark.parametrize("window,sinks,softcap,chunk", [
    (5, False, 3.0, None),      # smaller than a page (8), softcap
    (12, True, None, None),     # spans pages, sinks
    (None, True, 2.0, None),    # full causal, sinks and softcap
    (None, False, None, 8),     # chunks of a page
    (None, True, 3.0, 5),       # chunks across page edges, sinks and softcap
])
def test_ragged_reference_matches_the_definition(window, sinks, softcap, chunk):
    rng = np.random.default_rng(7)
    hq, hkv = 4, 2
    args = random_paged_batch(rng, hq=hq, hkv=hkv, d=16, block_size=8, dtype=jnp.float32,
                              extra_tokens=2, **RAGGED)
    sk = jnp.asarray(rng.normal(size=hq) * 2, jnp.float32) if sinks else None
    got = reference.ragged_prefill_reference(*args, scale=0.4, softcap=softcap, window=window,
                                             sinks=sk, chunk=chunk)
    want = naive_ragged(*args, scale=0.4, softcap=softcap, window=window,
                        sinks=None if sk is None else np.asarray(sk), chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masks", [dict(window=6), dict(chunk=7)])
def test_dense_reference_agrees_with_the_ragged_one(masks):
    rng = np.random.default_rng(3)
    hq, hkv, d, bs, length = 4, 1, 16, 4, 19
    q, kc, vc, qsl, lens, bt = random_paged_batch(rng, hq=hq, hkv=hkv, d=d, block_size=bs,
                                                  q_lens=[length], prefixes=[0], dtype=jnp.float32)
    sk = jnp.asarray(rng.normal(size=hq), jnp.float32)
    variant = dict(scale=0.5, softcap=4.0, sinks=sk, **masks)
    ragged = reference.ragged_prefill_reference(q, kc, vc, qsl, lens, bt, **variant)
    # The whole sequence as dense causal attention over the gathered context.
    k = reference.gather_context(kc, bt)[:, :length]
    v = reference.gather_context(vc, bt)[:, :length]
    dense = reference.causal_attention_reference(q[None], k, v, **variant)
    np.testing.assert_allclose(np.asarray(dense[0]), np.asarray(ragged), rtol=1e-5, atol=1e-6)


def test_bad_window_names_the_field():
    cache = jnp.zeros((1, 2, 4, 8))
    args = (jnp.zeros((2, 2, 8)), cache, cache, jnp.asarray([0, 2]), jnp.asarray([3]),
            jnp.zeros((1, 2), jnp.int32))
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="window"):
            reference.ragged_prefill_reference(*args, scale=1.0, window=bad)
        with pytest.raises(ValueError, match="chunk"):
            reference.ragged_prefill_reference(*args, scale=1.0, chunk=bad)


SPLIT = dataclasses.replace(REFERENCE, name="reference-split", split_mixed_steps=True)


def test_dispatch_and_fp8_wrapper_pass_window_and_sinks():
    """The fp8-KV wrapper and the mixed-step split under it (decode reference for the leading
    one-token sequences, ragged reference for the rest) forward every keyword: a windowed step
    with sinks and softcap gives the ragged reference's answer."""
    rng = np.random.default_rng(11)
    q_lens, prefixes = [1, 1, 5, 1, 7], [20, 3, 9, 17, 0]
    q, k, v, qsl, seq_lens, tables = random_paged_batch(
        rng, hq=4, hkv=2, d=16, block_size=4, q_lens=q_lens, prefixes=prefixes,
        dtype=jnp.float32, extra_tokens=3)
    k8, v8 = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
    md = AttentionMetadata(jnp.full((q.shape[0],), -1, jnp.int32), qsl, seq_lens, tables)
    variant = dict(scale=0.3, softcap=5.0, window=6,
                   sinks=jnp.asarray(rng.normal(size=4), jnp.float32))
    want = reference.ragged_prefill_reference(q, k8, v8, qsl, seq_lens, tables, **variant)
    got = FP8KVAttention(SPLIT, (1.0,), (1.0,)).for_layer(0)(q, k8, v8, md, **variant)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _no_kernel(*args, **kwargs):
    raise AssertionError("a backend without chunked_local ran a chunked layer on its kernels")


def test_chunked_layers_of_a_backend_without_chunks_run_on_the_reference():
    """A backend whose kernels take no `chunk` (the GPU ones) runs chunked local layers on the
    reference's decode and prefill, under the fp8-KV wrapper too; decode rows see their chunk."""
    rng = np.random.default_rng(5)
    q, k, v, qsl, seq_lens, tables = random_paged_batch(
        rng, hq=4, hkv=2, d=16, block_size=4, q_lens=[1, 1, 6], prefixes=[13, 4, 9],
        dtype=jnp.float32, extra_tokens=2)
    md = AttentionMetadata(jnp.full((q.shape[0],), -1, jnp.int32), qsl, seq_lens, tables,
                           num_decodes=2)
    kernels_only = dataclasses.replace(REFERENCE, name="no-chunks", decode=_no_kernel,
                                       prefill=_no_kernel, chunked_local=False)
    variant = dict(scale=0.3, softcap=None, window=None, sinks=None)
    want = naive_ragged(q, k, v, qsl, seq_lens, tables, chunk=4, **variant)
    for backend in (kernels_only, FP8KVAttention(kernels_only, (1.0,), (1.0,)).for_layer(0)):
        got = backend(q, k, v, md, chunk=4, **variant)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
