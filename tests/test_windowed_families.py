"""Windowed families through the engine: greedy tokens of a tiny random gpt-oss model (sliding
windows of 5 tokens over 4-token blocks, sinks, MoE) equal a cache-free dense oracle under chunked
prefill across the window edge, preemption under a tiny pool and a prefix-cache hit past the
window; the Gemma 3 config parses to its windows and ropes. (HF parity of the families:
test_hf_parity.py; config parsing, MXFP4 and multimodal loading: test_families_config.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import config_from_dict
from jaxinfer.model.transformer import param_shapes, train_forward
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import (EOS, MAX_LEN, assert_all_free, make_engine, prompt_ids, run_all,
                                 tiny_tokenizer)

GREEDY = dict(temperature=0.0, ignore_eos=True)
WINDOW = 5
COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=MAX_LEN, sliding_window=WINDOW, eos_token_id=EOS,
              bos_token_id=0, torch_dtype="float32")
CONFIGS = {
    "gpt_oss": dict(COMMON, architectures=["GptOssForCausalLM"], intermediate_size=16,
                    num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                  "original_max_position_embeddings": 16}),
    # The hub's spelling: sliding_window_pattern, rope_local_base_freq and rope_scaling.
    "gemma3": dict(COMMON, architectures=["Gemma3ForCausalLM"], intermediate_size=64,
                   num_hidden_layers=3, sliding_window_pattern=3, query_pre_attn_scalar=8,
                   attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                   rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear",
                                                               "factor": 2.0}),
}


@functools.lru_cache(maxsize=None)
def model(family: str):
    cfg = config_from_dict({**CONFIGS[family], "vocab_size": tiny_tokenizer().vocab_size})
    # numpy draws (init_params compiles one generator per leaf shape); norms, biases and sinks
    # random too
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), jnp.float32),
                          param_shapes(cfg, jnp.float32))
    return cfg, params


@functools.lru_cache(maxsize=None)
def _dense(family: str):
    cfg, params = model(family)
    return jax.jit(lambda toks: train_forward(params, cfg, toks))


def oracle(family: str, prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        buf = np.zeros((1, MAX_LEN), np.int32)
        buf[0, :len(toks)] = toks
        toks.append(int(jnp.argmax(_dense(family)(jnp.asarray(buf))[0, len(toks) - 1])))
    return toks[len(prompt):]


def test_configs_are_windowed():
    gpt, gemma = model("gpt_oss")[0], model("gemma3")[0]
    assert gpt.layer_windows == (WINDOW, None) and gpt.attn_sinks
    assert gemma.layer_windows == (WINDOW, WINDOW, None) and gemma.local_rope != gemma.rope


# gpt-oss: windows and sinks (Gemma 3's windows are the same code path; its soft-caps, sandwich
# norms and local rope are covered by test_hf_parity.py through the paged cache).
@pytest.mark.parametrize("family", ["gpt_oss"])
def test_chunked_preempted_and_prefix_cached_runs_match_the_oracle(family):
    # 16 blocks of 4 tokens for 5 requests of up to 27 tokens, 3-token prefill chunks: prefills
    # cross the window edge chunk by chunk, and admission and decode growth run out of blocks.
    # (4 sequences a step keep the engine's step buckets, and so its compiles, few.)
    engine = make_engine(model=model(family), num_blocks=24, max_num_batched_tokens=16,
                         long_prefill_chunk=3, max_num_seqs=4)
    work = [(prompt_ids(300 + i, 9 + 3 * i), 6) for i in range(5)]
    for i, (p, m) in enumerate(work):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, **GREEDY))
    got = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, (p, m) in enumerate(work):
        assert got[f"r{i}"][0][0] == oracle(family, p, m), i

    # A prompt sharing the longest one's first 20 tokens (5 blocks, 4 windows) hits the cache.
    hits = engine.scheduler.kv_cache_stats()[-1].hits
    prompt = work[-1][0][:20] + prompt_ids(400, 3)
    engine.add_request("hit", prompt, SamplingParams(max_tokens=6, **GREEDY))
    assert run_all(engine)["hit"][0][0] == oracle(family, prompt, 6)
    assert engine.scheduler.kv_cache_stats()[-1].hits - hits == 20
    assert_all_free(engine)


def test_gemma3_sequence_fits_only_because_window_blocks_are_freed():
    # Groups: full, window 5, window 5 (one layer each; a block is one layer's page). 48 tokens
    # take 12 blocks per group: 36 if every layer kept every block, but the pool has 26 (the
    # engine's floor for 64 tokens in 8-token chunks: 16 + 2 x 5).
    engine = make_engine(model=model("gemma3"), num_blocks=26, max_num_batched_tokens=8,
                         long_prefill_chunk=8, max_num_seqs=1, decode_steps_per_call=1)
    assert engine.scheduler.kv.groups.windows == (None, WINDOW, WINDOW)
    prompt = prompt_ids(500, 36)
    engine.add_request("long", prompt, SamplingParams(max_tokens=12, **GREEDY))
    out = run_all(engine)["long"][0][0]
    assert out == oracle("gemma3", prompt, 12)
    # A hit past the window: its 44 computed tokens (the windowed groups resume from block 9
    # and 10, the last ones the finished request held), then a request aborted mid-decode and one
    # while it waits.
    again = prompt + out + prompt_ids(501, 3)
    engine.add_request("hit", again, SamplingParams(max_tokens=4, **GREEDY))
    assert run_all(engine)["hit"][0][0] == oracle("gemma3", again, 4)
    assert engine.scheduler.kv_cache_stats()[-1].hits == 44
    for i in range(2):
        engine.add_request(f"x{i}", prompt_ids(510 + i, 19), SamplingParams(max_tokens=9, **GREEDY))
    for _ in range(4):
        engine.step()
    for i in range(2):
        engine.abort(f"x{i}")
    assert_all_free(engine)
