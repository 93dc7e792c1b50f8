"""DeepSeek MLA through the engine: greedy tokens of a tiny random DeepSeek-V3 model (q LoRA,
latent cache of one 20-wide entry per token, grouped sigmoid routing, shared expert, a dense
first layer) equal a cache-free dense oracle under batching, chunked prefill, preemption and a
prefix-cache hit; the cache's V arrays are empty and the planner counts only the latent. (HF
parity: test_hf_parity.py's deepseek_* fixtures; TP = 2: test_parallel.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import config_from_dict
from jaxinfer.model.transformer import param_shapes, train_forward
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.kv.planner import kv_bytes_per_block
from test_engine_support import (EOS, MAX_LEN, assert_all_free, make_engine, prompt_ids, run_all,
                                 tiny_tokenizer)

GREEDY = dict(temperature=0.0, ignore_eos=True)
CONFIG = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4,
              n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=8, n_group=2,
              topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
              max_position_embeddings=MAX_LEN, eos_token_id=EOS, bos_token_id=0,
              torch_dtype="float32",
              rope_scaling={"type": "yarn", "factor": 2.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 16})


# DeepSeek-V2-Lite's hub config.json (the fields that matter).
V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], hidden_size=2048, intermediate_size=10944,
               kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=1408,
               moe_layer_freq=1, n_group=1, n_routed_experts=64, n_shared_experts=2,
               norm_topk_prob=False, num_attention_heads=16, num_experts_per_tok=6,
               num_hidden_layers=27, num_key_value_heads=16, q_lora_rank=None,
               qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6,
               rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                             "type": "yarn"},
               rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax", topk_group=1,
               topk_method="greedy", v_head_dim=128, vocab_size=102400, first_k_dense_replace=1,
               torch_dtype="bfloat16", bos_token_id=100000, eos_token_id=100001)


def test_v2_lite_config_parses_to_its_shape():
    cfg = config_from_dict(V2_LITE)
    m = cfg.mla
    assert m.q_lora_rank is None and m.latent_width == 576 and m.qk_head_dim == 192
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_head_dim) == (1, 576, 64)
    assert cfg.moe_layers == (False,) + (True,) * 26 and cfg.n_shared_experts == 2
    assert (cfg.router_scoring, cfg.n_group, cfg.norm_topk_prob) == ("softmax", 1, False)
    # mscale == mscale_all_dim: no cos/sin factor; the scores scale by mscale(40, 0.707) ** 2
    assert cfg.rope.attention_factor == 1.0
    assert cfg.score_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * np.log(40) + 1) ** 2)
    assert cfg.num_params() == pytest.approx(15.7e9, rel=0.01)  # "15.7 B total"


@functools.lru_cache(maxsize=None)
def model():
    cfg = config_from_dict({**CONFIG, "vocab_size": tiny_tokenizer().vocab_size})
    rng = np.random.default_rng(5)  # numpy draws: one generator, not one compile per leaf shape
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), jnp.float32),
                          param_shapes(cfg, jnp.float32))
    return cfg, params


@functools.lru_cache(maxsize=None)
def _dense():
    cfg, params = model()
    return jax.jit(lambda toks: train_forward(params, cfg, toks))


def oracle(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        buf = np.zeros((1, MAX_LEN), np.int32)
        buf[0, :len(toks)] = toks
        toks.append(int(jnp.argmax(_dense()(jnp.asarray(buf))[0, len(toks) - 1])))
    return toks[len(prompt):]


def test_latent_cache_geometry():
    cfg, _ = model()
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_widths) == (1, 20, (20, 0))
    assert cfg.layer_is_moe(1) and not cfg.layer_is_moe(0)
    # 2 layers x 20 values x 4 bytes per token, 4-token blocks: no V, no per-head copies.
    assert kv_bytes_per_block(cfg, 4, jnp.float32) == 4 * 2 * 20 * 4


def test_v3_score_correction_bias_loads_in_float32_in_a_bf16_model():
    """HF keeps e_score_correction_bias in float32 (its differences between experts can be below
    bf16's resolution, and they choose the experts); a bf16 model keeps the file's values."""
    from pathlib import Path

    from safetensors.numpy import load_file

    from jaxinfer.model.config import load_config
    from jaxinfer.model.weights import load_safetensors
    fixture = Path(__file__).parent / "fixtures" / "models" / "deepseek_v3"
    cfg = load_config(fixture)
    params = load_safetensors(fixture, cfg, jnp.bfloat16, progress=False)
    stored = load_file(fixture / "model.safetensors")
    layer = next(i for i in range(cfg.num_layers) if cfg.layer_is_moe(i))
    bias = params[f"layers_{layer}"]["moe"]["score_bias"]
    want = stored[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == jnp.float32 and want.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(bias), want)
    assert not np.array_equal(want.astype(jnp.bfloat16).astype(np.float32), want)  # bf16 rounds
    assert params[f"layers_{layer}"]["moe"]["router"].dtype == jnp.bfloat16


def test_draft_sizing_counts_the_latent_once():
    """A draft model beside an MLA target: the target's block holds the latent alone (V is
    zero-wide), as the planner counts it, not K and V of head_dim each."""
    from jaxinfer.spec_decode.draft import kv_block_bytes
    cfg, _ = model()
    assert kv_block_bytes(cfg, 4, cfg.num_layers, 1, 4) == kv_bytes_per_block(cfg, 4, jnp.float32)
    llama = config_from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=32,
                                  intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    assert kv_block_bytes(llama, 4, 2, 2, 2) == kv_bytes_per_block(llama, 4, jnp.bfloat16)


def test_batched_chunked_preempted_and_prefix_cached_runs_match_the_oracle():
    # 16 blocks of 4 tokens for 5 requests of up to 27 tokens, 3-token prefill chunks: admission
    # and decode growth run out of blocks (preemption), prefills are split across steps.
    engine = make_engine(model=model(), num_blocks=16, max_num_batched_tokens=16,
                         long_prefill_chunk=3, max_num_seqs=4)
    k_cache, v_cache = engine.runner.kv_cache[0]
    assert v_cache.shape[-1] == 0 and k_cache.shape[0] == 1
    work = [(prompt_ids(500 + i, 9 + 3 * i), 6) for i in range(5)]
    for i, (p, m) in enumerate(work):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, **GREEDY))
    got = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    expected = [oracle(p, m) for p, m in work]
    assert len({tuple(e) for e in expected}) == len(expected)  # not a degenerate model
    for i in range(len(work)):
        assert got[f"r{i}"][0][0] == expected[i], i

    # A prompt sharing the longest one's first 20 tokens (5 blocks) hits the cache.
    hits = engine.scheduler.kv_cache_stats()[-1].hits
    prompt = work[-1][0][:20] + prompt_ids(600, 3)
    engine.add_request("hit", prompt, SamplingParams(max_tokens=6, **GREEDY))
    assert run_all(engine)["hit"][0][0] == oracle(prompt, 6)
    assert engine.scheduler.kv_cache_stats()[-1].hits - hits == 20
    assert_all_free(engine)


def test_an_mla_engine_takes_a_disaggregated_role():
    """The hand-over carries the latent pages like any other (test_disagg.py hands DeepSeek-V2
    over between two devices): a role's engine builds over an MLA model."""
    engine = make_engine(model=model(), role="prefill")
    assert engine.scheduler.kv.groups.page_spec.values_in_keys  # the latent: V read from K


def test_fp8_latent_cache_stays_within_fp8_tolerance():
    """--kv-cache-dtype fp8 on an MLA model: one calibrated power-of-two scale per layer for the
    whole latent (K and V alike: the values are the latent's columns), the cache holds the
    latent to e4m3's 2^-4, and a prefill then a decode step over it give the dense oracle's
    logits within fp8's rounding (the argmax unchanged)."""
    from jaxinfer.model.transformer import forward
    from jaxinfer.worker.kv import allocate_kv_cache
    from jaxinfer.model.kernel_table import REFERENCE_KERNELS
    from jaxinfer.worker.kv.kv_scales import kv_cache_kernels
    from pallas_kernels.attention.kv_quant import fp8_max
    from pallas_kernels.attention.metadata import AttentionMetadata
    e4m3 = jnp.float8_e4m3fn
    cfg, params = model()
    fp8 = kv_cache_kernels(REFERENCE_KERNELS, e4m3, cfg, params, scales="calibrate")
    assert fp8.attention.k_scales == fp8.attention.v_scales
    assert all(s > 0 and np.log2(s) == round(np.log2(s)) for s in fp8.attention.k_scales)

    prompt = prompt_ids(7, 12)
    n, block, blocks = len(prompt), 4, 8
    tables = jnp.arange(blocks, dtype=jnp.int32)[None]
    step = jax.jit(lambda p, ids, pos, kv, md: forward(p, cfg, ids, pos, kv, md, fp8))
    kv = allocate_kv_cache(cfg, blocks, block, e4m3)
    md = AttentionMetadata(jnp.arange(n - 1, dtype=jnp.int32), jnp.asarray([0, n - 1], jnp.int32),
                           jnp.asarray([n - 1], jnp.int32), tables)
    _, kv = step(params, jnp.asarray(prompt[:-1]), jnp.arange(n - 1), kv, md)
    md = AttentionMetadata(jnp.asarray([n - 1], jnp.int32), jnp.asarray([0, 1], jnp.int32),
                           jnp.asarray([n], jnp.int32), tables, num_decodes=1)
    got, kv = step(params, jnp.asarray(prompt[-1:]), jnp.asarray([n - 1]), kv, md)
    assert kv[0][0].dtype == e4m3 and kv[0][1].shape[-1] == 0
    for latent, _ in kv:  # calibrated: nothing saturates
        assert np.abs(np.asarray(latent, np.float32)).max() < fp8_max(e4m3)

    buf = np.zeros((1, MAX_LEN), np.int32)
    buf[0, :n] = prompt
    want = np.asarray(_dense()(jnp.asarray(buf))[0, n - 1])
    got = np.asarray(got[0])
    err = np.abs(got - want).max()
    assert 0 < err <= 0.08 * np.abs(want).max()  # fp8 rounds (2^-4), averaged by attention
    assert got.argmax() == want.argmax()
