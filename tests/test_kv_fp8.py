"""FP8 KV cache (`--kv-cache-dtype fp8`): quantization, the scale folding around the kernels, where
the scales come from, the flag checks, the engine's cache paths (prefix caching, forks with
copy-on-write) over an fp8 cache, and the demo model's accuracy with one. The kernels' fp8 reads
are tested in test_paged_decode.py and test_flash_prefill.py."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from prometheus_client import generate_latest
from safetensors.numpy import save_file

from jaxinfer.core.kv_cache import CacheConfig
from jaxinfer.worker.kv import allocate_kv_cache, copy_blocks
from jaxinfer.worker.kv.kv_scales import (calibrate_kv_scales, calibration_tokens,
                                              checkpoint_kv_scales, resolve_kv_scales,
                                              rope_key_amax)
from jaxinfer.errors import ConfigError
from jaxinfer.model.transformer import forward
from jaxinfer.sampling_params import SamplingParams
from pallas_kernels.attention import reference
from pallas_kernels.attention.backend import REFERENCE
from pallas_kernels.attention.kv_quant import FP8KVAttention, dequantize, fp8_max, quantize
from pallas_kernels.attention.metadata import AttentionMetadata
from test_engine_support import make_engine, prompt_ids, run_all, tiny_model, tiny_tokenizer

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.mark.parametrize("dtype,mantissa_bits", [(E4M3, 3), (E5M2, 2)])
def test_quantize_round_trip_and_saturation(dtype, mantissa_bits):
    scale = 0.37
    top = fp8_max(dtype)
    rng = np.random.default_rng(0)
    # Magnitudes over the normal range of the type (after the scale), both signs, and zero.
    x = np.sign(rng.standard_normal(4096)) * np.exp(rng.uniform(np.log(1e-1), np.log(top), 4096))
    x = np.concatenate([x, [0.0, top, -top]]) * scale
    back = np.asarray(dequantize(quantize(jnp.asarray(x, jnp.float32), scale, dtype), scale))
    # Round to nearest: half a unit in the last place, 2^-(mantissa bits + 1) relative.
    np.testing.assert_array_less(np.abs(back - x), np.abs(x) * 2.0 ** -(mantissa_bits + 1) + 1e-30)
    assert back[-3] == 0 and back[-2] == pytest.approx(top * scale)
    # Past the range: saturated to the largest finite value, never NaN (e4m3fn has no infinity).
    big = np.asarray(dequantize(quantize(jnp.asarray([1e9, -1e9, top * scale * 1.6]), scale,
                                         dtype), scale))
    np.testing.assert_allclose(big, [top * scale, -top * scale, top * scale], rtol=1e-6)


def test_split_q_holds_q_to_bf16_precision_per_item():
    """The fp8 QK^T path's q: per item, q_hi + q_lo = q * c with c a power of two that keeps the
    item's largest |q| within e4m3's range, to ~2^-8 of that largest value (bf16 keeps 2^-9 of
    each value); q_hi alone is off by up to 2^-4 relative; an all-zero item stays zero."""
    from pallas_kernels.attention.mgpu_fp8 import split_q
    rng = np.random.default_rng(0)
    mags = np.array([1e-3, 0.05, 1.0, 30.0, 0.0])[:, None, None]  # items of very different range
    q = jnp.asarray(rng.standard_normal((5, 8, 128)) * mags, jnp.float32)
    q_hi, q_lo, inv = split_q(q)
    assert q_hi.dtype == q_lo.dtype == E4M3
    c = 1.0 / np.asarray(inv)
    assert (np.exp2(np.round(np.log2(c))) == c).all()
    amax = np.abs(np.asarray(q)).max(axis=(1, 2))
    assert (amax * c <= 448).all() and (amax[:4] * c[:4] > 224).all()
    hi, lo = (np.asarray(x.astype(jnp.float32)) for x in (q_hi, q_lo))
    back = (hi + lo) * np.asarray(inv)[:, None, None]
    err = np.abs(back - np.asarray(q)).max(axis=(1, 2))
    np.testing.assert_array_less(err[:4], amax[:4] * 2.0 ** -8)
    assert (back[4] == 0).all()
    hi_err = np.abs(hi * np.asarray(inv)[:, None, None] - np.asarray(q)).max(axis=(1, 2))
    assert (hi_err[:4] > amax[:4] * 2.0 ** -8).all()  # q_lo carries what q_hi drops


def _ragged_batch(seed=0, hq=4, hkv=2, d=16, bs=4):
    """Two sequences' new tokens (one decode-like, one chunk over a cached prefix) in a paged cache."""
    rng = np.random.default_rng(seed)
    q_lens, ctx = [1, 6], [9, 11]
    tables = jnp.asarray(rng.permutation(8).reshape(2, 4), jnp.int32)
    slots = [int(tables[s, p // bs]) * bs + p % bs for s in range(2) for p in range(ctx[s])]
    t = sum(ctx)
    k, v = (jnp.asarray(3 * rng.standard_normal((t, hkv, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((sum(q_lens), hq, d)), jnp.float32)
    md = AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray([0, 1, 7], jnp.int32),
                           jnp.asarray(ctx, jnp.int32), tables)
    return q, k, v, md, (hkv, 8, bs, d)


@pytest.mark.parametrize("k_scale,v_scale", [(0.25, 0.5), (0.037, 0.07)])
def test_scales_folded_around_attention_equal_attention_over_the_dequantized_cache(k_scale,
                                                                                   v_scale):
    q, k, v, md, shape = _ragged_batch()
    layer = FP8KVAttention(REFERENCE, (k_scale,), (v_scale,)).for_layer(0)
    k8, v8 = layer.write_kv(jnp.zeros(shape, E4M3), jnp.zeros(shape, E4M3), k, v, md.slot_mapping)
    assert k8.dtype == v8.dtype == E4M3
    out = layer(q[1:], k8, v8, AttentionMetadata(md.slot_mapping, md.query_start_loc[1:] - 1,
                                                 md.seq_lens[1:], md.block_tables[1:]), scale=0.25)
    ref = reference.ragged_prefill_reference(q[1:], dequantize(k8, k_scale), dequantize(v8, v_scale),
                                             md.query_start_loc[1:] - 1, md.seq_lens[1:],
                                             md.block_tables[1:], scale=0.25)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-6)
    # ... and close to attention over the unquantized K/V (fp8's 2^-4 rounding, averaged).
    exact = reference.ragged_prefill_reference(
        q[1:], *reference.write_kv(jnp.zeros(shape), jnp.zeros(shape), k, v, md.slot_mapping),
        md.query_start_loc[1:] - 1, md.seq_lens[1:], md.block_tables[1:], scale=0.25)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.05


def test_block_copies_keep_the_fp8_values():
    cfg, _ = tiny_model()
    cache = allocate_kv_cache(cfg, 6, 4, E4M3)
    filled = tuple((k.at[:, 2].set(1.5), v.at[:, 2].set(-448.0)) for k, v in cache)
    out = copy_blocks(filled, jnp.asarray([2, 0]), jnp.asarray([5, -1]))
    for k, v in out:
        assert k.dtype == v.dtype == E4M3
        assert (np.asarray(k[:, 5], np.float32) == 1.5).all()
        assert (np.asarray(v[:, 5], np.float32) == -448.0).all()


def test_checkpoint_scales_are_read_per_layer(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": np.array(0.5, np.float32),
               "model.layers.0.self_attn.v_scale": np.array([0.25], np.float32),
               "model.layers.1.self_attn.kv_scale": np.array(2.0, np.float32),
               "model.embed_tokens.weight": np.zeros((2, 2), np.float32)},
              str(tmp_path / "model.safetensors"))
    assert checkpoint_kv_scales(tmp_path, 2) == ((0.5, 2.0), (0.25, 2.0))
    with pytest.raises(ConfigError, match="--kv-cache-scales.*layer 2"):
        checkpoint_kv_scales(tmp_path, 3)
    cfg, params = tiny_model()
    assert resolve_kv_scales("auto", cfg, params, model_dir=str(tmp_path))[2] == "checkpoint"
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(ConfigError, match="--kv-cache-scales checkpoint"):
        resolve_kv_scales("checkpoint", cfg, params, model_dir=str(empty))
    assert resolve_kv_scales("auto", cfg, params, model_dir=str(empty))[2] == "calibrated"
    assert resolve_kv_scales("0.5", cfg, params, model_dir=None)[:2] == ((0.5, 0.5), (0.5, 0.5))


def test_calibrated_scales_are_the_smallest_powers_of_two_that_hold_the_cache():
    """Written through the calibration tokens with a float32 cache, every layer's largest |K| and
    |V| fit under 448 x scale, and |V| (read exactly by the calibration) reaches past half of it."""
    cfg, params = tiny_model()
    tokens = calibration_tokens(tiny_tokenizer(), cfg.vocab_size, 48)
    k_scales, v_scales = calibrate_kv_scales(cfg, params, tokens)
    t = len(tokens)
    cache = allocate_kv_cache(cfg, -(-t // 4), 4, jnp.float32)
    md = AttentionMetadata(jnp.arange(t, dtype=jnp.int32), jnp.asarray([0, t], jnp.int32),
                           jnp.asarray([t], jnp.int32), jnp.arange(-(-t // 4), dtype=jnp.int32)[None])
    _, cache = jax.jit(forward, static_argnums=1)(params, cfg, jnp.asarray(tokens),
                                                  jnp.arange(t), cache, md)
    for (k, v), ks, vs in zip(cache, k_scales, v_scales):
        assert ks == 2.0 ** round(np.log2(ks)) and vs == 2.0 ** round(np.log2(vs))
        assert float(jnp.abs(k).max()) <= 448 * ks
        assert 224 * vs < float(jnp.abs(v).max()) <= 448 * vs


def test_flag_values_and_combinations_are_refused_naming_the_flag():
    for bad in ("0", "-1", "inf", "sometimes"):
        with pytest.raises(ConfigError, match="--kv-cache-scales"):
            CacheConfig(kv_cache_scales=bad)
    with pytest.raises(ConfigError, match="--kv-cache-scales .*fp8 --kv-cache-dtype"):
        make_engine(kv_cache_scales="calibrate")


def test_engine_over_an_fp8_cache_prefix_caching_and_forks_change_nothing():
    """Greedy outputs over an fp8 cache are the same with prefix-cache hits and with forked
    choices (n = 2, the shared partly filled block copied on write) as without them: cached and
    copied blocks hold the same fp8 bytes a recompute writes."""
    shared = prompt_ids(1, 10)
    prompts = [shared + prompt_ids(2 + i, 3 + i) for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        engine = make_engine(kv_cache_dtype="fp8", enable_prefix_caching=caching)
        assert engine.runner.kv_cache[0][0].dtype == E4M3
        metrics = generate_latest(engine.metrics.registry).decode()
        cfg = engine.cfg  # /metrics: one byte per element (K and V, every layer and KV head)
        per_block = 4 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
        assert f'jaxinfer:kv_cache_bytes{{model_name="tiny"}} {float(128 * per_block)}' in metrics
        assert 'cache_dtype="float8_e4m3fn"' in metrics
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy)
            outs[caching, i] = run_all(engine)[f"r{i}"][0][0]  # one at a time: later ones hit
        engine.add_request("fork", prompts[0], SamplingParams(n=2, temperature=0, max_tokens=6,
                                                              ignore_eos=True))
        forks = run_all(engine)["fork"]
        assert forks[0][0] == forks[1][0] == outs[caching, 0]
        if caching:
            assert engine.scheduler.kv.stats.hits > 0
    assert all(outs[False, i] == outs[True, i] for i in range(3))


def test_demo_model_perplexity_and_top1_agreement_with_an_fp8_cache():
    """Held-out text through the paged cache: fp8 KV (calibrated scales) within +0.5 % of the bf16
    cache's perplexity, and the same argmax at >= 97 % of >= 1000 positions. The forwards are
    compiled with XLA CPU's default optimization, not the tests' level 0 (conftest.py): they are
    the rare test programs whose run costs more than their compile (25 s -> 5 s)."""
    from jaxinfer.bench.suites.quant_kv import demo_ppl
    m = demo_ppl(compiler_options={"xla_backend_optimization_level": 3})
    assert m["demo_positions"] >= 1000
    assert m["demo_ppl_bf16"] < 12.5  # the model as committed (test_demo_model.py)
    assert m["demo_ppl_fp8kv"] <= 1.005 * m["demo_ppl_bf16"]
    assert m["demo_top1_agreement_fp8kv"] >= 0.97


def test_demo_engine_over_an_fp8_cache_ranks_the_bf16_greedy_tokens_first():
    """The engine with --kv-cache-dtype fp8 scores the bf16 engine's greedy continuations (prompt
    logprobs, teacher-forced through its own fp8 cache): their tokens are its top-1 at >= 95 %
    of 8 x 24 positions. (Free-running greedy outputs are not compared token for token: one
    flipped near-tie changes everything after it.)"""
    from pathlib import Path
    from jaxinfer import LLM
    heldout = (Path(__file__).resolve().parent.parent / "checkpoints" / "heldout_sample.txt")
    lines = [ln for ln in heldout.read_text().splitlines() if ln.strip()]
    prompts = ["\n".join(lines[i:i + 3]) for i in range(0, 24, 3)]
    # (no decode loop: its compile would cost more than the 24 steps it runs; the tokens are a
    # single step's, tests/test_decode_loop.py)
    common = dict(max_num_seqs=8, max_model_len=128, warmup=False, compilation_cache_dir="",
                  decode_steps_per_call=1)
    bf16 = LLM(**common)
    outs = bf16.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)
    fp8 = LLM(kv_cache_dtype="fp8", **common)
    assert fp8.engine.runner.kv_cache[0][0].dtype == E4M3
    full = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    scored = fp8.generate(full,
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = [lp.rank for o, src in zip(scored, outs)
             for lp in o.prompt_logprobs[len(src.prompt_token_ids):]]
    assert len(ranks) == 8 * 24
    assert np.mean(np.asarray(ranks) == 1) >= 0.95


def test_calibration_reads_fused_and_split_projections_alike():
    """The serving layout stores q/k/v as one fused projection (fused_projections.py): the
    calibration must find K and V there too, with the same scales as the split checkpoint layout."""
    from jaxinfer.model.fused_projections import fuse_projections
    cfg, params = tiny_model()
    tokens = calibration_tokens(tiny_tokenizer(), cfg.vocab_size, 48)
    assert calibrate_kv_scales(cfg, fuse_projections(params), tokens) == \
        calibrate_kv_scales(cfg, params, tokens)


@pytest.mark.parametrize("head_dim,rotary_dim", [(8, 8), (8, 4), (7, 4), (6, 0)])
def test_rope_key_bound_covers_every_rotation_under_partial_rotary(head_dim, rotary_dim):
    """The calibrated K maximum bounds the key at every position: the rotated part's pairs are
    (j, j + rotary_dim / 2), not (j, j + head_dim / 2), and an odd or unrotated tail counts as is."""
    rng = np.random.default_rng(head_dim + rotary_dim)
    x = rng.standard_normal((5, 3, head_dim)).astype(np.float32)
    half = rotary_dim // 2
    angles = np.linspace(0.0, 2 * np.pi, 64)[:, None, None, None]
    rotated = np.concatenate([x[..., :half] * np.cos(angles) - x[..., half:2 * half] * np.sin(angles),
                              x[..., half:2 * half] * np.cos(angles) + x[..., :half] * np.sin(angles),
                              np.broadcast_to(x[..., 2 * half:], (64, *x.shape[:-1], head_dim - 2 * half))],
                             axis=-1)
    got = float(rope_key_amax(jnp.asarray(x), rotary_dim))
    assert np.abs(rotated).max() <= got * (1 + 1e-6)
    assert got <= np.abs(rotated).max() * (1 + 2e-3)  # tight: the bound is reached
