"""GLM-4.5 and Llama 4, the families declared in a module of their own (glm4_moe.py, llama4.py),
through the engine against HF transformers' goldens (tests/fixtures/make_golden_families.py):
greedy tokens and prompt logprobs under 3-token prefill chunks (Llama 4's 8-token attention
chunks end mid-step), preemption under a tiny pool and a prefix-cache hit; and what their
config.json parses to. (Single-step logits parity: test_hf_parity.py.)"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import config_from_dict, load_config
from jaxinfer.model.kv_specs import ChunkedLocalAttentionSpec, FullAttentionSpec
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import assert_all_free, run_all

FIXTURES = Path(__file__).parent / "fixtures" / "models"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine_for(family: str, num_blocks: int, max_num_seqs: int) -> LLMEngine:
    cfg = load_config(FIXTURES / family)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    args = EngineArgs(model=str(FIXTURES / family), max_model_len=32, block_size=4,
                      num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
                      long_prefill_chunk=3, compilation_cache_dir=None, warmup=False,
                      dtype="float32", background_compile=False, attention_backend="reference")
    return LLMEngine(cfg, params, None, args, num_blocks=num_blocks)


@pytest.mark.parametrize("family", ["glm4_moe", "llama4"])
def test_engine_matches_transformers(family):
    golden = np.load(FIXTURES / family / "golden.npz")
    prompt, expected = golden["greedy_prompt"].tolist(), golden["greedy_tokens"].tolist()
    long_prompt = golden["prompt_2"].tolist()
    # Greedy runs of 21 tokens at once: 6 blocks each in GLM's one KV group (4 runs, a pool of
    # 12); Llama 4's four one-layer groups (three chunked: their finished chunks' blocks are
    # freed) hold 6 + 3 x (at most 4) each (8 runs, a pool of 30; a 32-token sequence's floor is
    # 29). Decode growth preempts; decode loops of several steps reserve slots ahead (a chunk's
    # blocks stay until its last query has run: KVCacheManager.allocate_slots' first_query_pos).
    num_blocks, runs = {"glm4_moe": (12, 4), "llama4": (30, 8)}[family]
    engine = engine_for(family, num_blocks, max_num_seqs=runs)
    for i in range(runs):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=len(expected), **GREEDY))
    results = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for i in range(runs):
        assert results[f"g{i}"][0][0] == expected, i

    # A prompt continuing the finished runs' 20 tokens hits their cached blocks (Llama 4: past
    # two attention chunks, whose chunked groups' blocks are gone).
    hits = engine.scheduler.kv_cache_stats()[-1].hits
    again = prompt + expected[:15]
    engine.add_request("hit", again, SamplingParams(max_tokens=1, **GREEDY))
    assert run_all(engine)["hit"][0][0] == expected[15:]
    assert engine.scheduler.kv_cache_stats()[-1].hits > hits

    # A 29-token prompt (Llama 4: three attention chunks) scored in 3-token prefill chunks.
    engine.add_request("lp", long_prompt, SamplingParams(max_tokens=1, prompt_logprobs=1,
                                                         **GREEDY))
    prompt_logprobs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            prompt_logprobs = prompt_logprobs or out.prompt_logprobs
    want = np.asarray(jax.nn.log_softmax(golden["logits_2"], axis=-1))
    assert prompt_logprobs[0] is None
    got = [e.logprob for e in prompt_logprobs[1:]]
    np.testing.assert_allclose(got, want[np.arange(len(long_prompt) - 1), long_prompt[1:]],
                               atol=1e-4, rtol=0)
    assert_all_free(engine)


def test_glm4_moe_config():
    cfg = load_config(FIXTURES / "glm4_moe")
    assert cfg.rotary_dim == 8 and cfg.rope_head_dim == 8 and cfg.head_dim == 16
    assert cfg.qk_norm and cfg.qkv_bias and not cfg.o_bias
    assert cfg.moe_layers == (False, True) and cfg.score_correction_bias
    assert (cfg.n_group, cfg.topk_group, cfg.router_scoring) == (4, 2, "sigmoid")
    raw = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 32, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "n_routed_experts": 8}
    # HF's defaults: partial_rotary_factor 0.5 at the top level when rope_parameters lacks it
    assert config_from_dict(raw).rotary_dim == 8
    with pytest.raises(ConfigError, match="n_group"):
        config_from_dict({**raw, "n_group": 3})
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        config_from_dict({**raw, "partial_rotary_factor": 0.1})


def test_llama4_config():
    cfg = load_config(FIXTURES / "llama4")
    specs = cfg.layer_kv_specs()
    assert [type(s) for s in specs] == [ChunkedLocalAttentionSpec] * 3 + [FullAttentionSpec]
    assert specs[0].attention_chunk == 8
    assert cfg.family_options.rope_layers == (True, True, True, False)
    assert cfg.moe_layers == (False, True, False, True)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size) == (96, 24)
    raw = {"architectures": ["Llama4ForCausalLM"], "vocab_size": 32, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_hidden_layers": 4}
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        config_from_dict({**raw, "num_experts_per_tok": 2})
    with pytest.raises(ConfigError, match="attention_chunk_size"):
        config_from_dict({**raw, "attention_chunk_size": 0})
    # Without attention_chunk_size every layer attends globally (the RoPE layers too).
    assert config_from_dict({**raw, "attention_chunk_size": None}).layer_chunks == ()
