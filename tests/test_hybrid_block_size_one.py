"""A state-space hybrid at --block-size 1, the one odd block size (block sizes are powers of two):
its states are packed into cache elements (model/state_pages.py), so a state whose pages do not
end on a 4-byte word (fp8, one KV head of odd width, an odd number of pages) reads back as
written, and the engine's greedy tokens and logprobs are those of block size 16, of the dense
forward (float32), and of HF's goldens (tests/fixtures/make_golden_hybrid.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.config import config_from_dict, load_config
from jaxinfer.model.transformer import init_params, train_forward
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from hybrid_support import GREEDY, assert_engine_matches_goldens, hybrid_args
from test_engine_support import assert_all_free

FIXTURES = Path(__file__).parent / "fixtures" / "models"

# One KV head 15 wide (NoPE): an fp8 page of one token is 30 bytes, and the 648-byte state (162
# words, 6 fp8 bytes each) spans 33 of them, 990 bytes: not a whole number of 4-byte words.
ODD = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64, "hidden_size": 30,
    "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
    "layer_types": ["mamba", "attention"], "mamba_n_heads": 2, "mamba_expand": 1,
    "mamba_n_groups": 1, "mamba_d_state": 2, "mamba_chunk_size": 8, "num_local_experts": 0,
    "shared_intermediate_size": 16, "position_embedding_type": "nope", "torch_dtype": "float32"}


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """Per prompt (run together, in 3-token chunks) its greedy tokens and their logprobs."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[int(o.request_id)] = (list(c.token_ids), [e.logprob for e in c.logprobs])
    assert_all_free(engine)
    return [out[i] for i in range(len(prompts))]


def _dense_greedy(params, cfg, prompt: list[int], max_tokens: int):
    """The dense forward's greedy tokens and logprobs (fresh states over the whole sequence)."""
    dense = jax.jit(train_forward, static_argnums=1)
    tokens, logprobs = list(prompt), []
    for _ in range(max_tokens):
        buf = np.zeros((1, len(prompt) + max_tokens), np.int32)
        buf[0, :len(tokens)] = tokens
        last = jax.nn.log_softmax(dense(params, cfg, jnp.asarray(buf))[0, len(tokens) - 1])
        tokens.append(int(jnp.argmax(last)))
        logprobs.append(float(last.max()))
    return tokens[len(prompt):], logprobs


def test_state_pages_not_ending_on_a_word():
    cfg = config_from_dict(ODD)
    state = cfg.layer_kv_specs()[0]
    fp8 = jnp.float8_e4m3fn
    assert state.page_bytes(1, fp8) == 30 and state.state_pages(1, fp8) == 33
    params = init_params(cfg, jax.random.key(1), jnp.float32, std=0.3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (20, 7, 1)]
    results = {}
    # (A bf16 page always ends on a word, 4 x block x heads x head_dim bytes: fp8 is the case.)
    for dtype in ("auto", "fp8"):
        for block in (1, 16):
            args = hybrid_args(Path("odd"), 300, block_size=block, kv_cache_dtype=dtype,
                               kv_cache_scales="1.0" if dtype == "fp8" else "auto")
            engine = LLMEngine(cfg, params, None, args, num_blocks=300)
            results[dtype, block] = _greedy(engine, prompts, 8)
    for dtype in ("auto", "fp8"):
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(results[dtype, 1],
                                                                    results[dtype, 16]):
            assert tokens == want_tokens, dtype
            np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)
    for prompt, (tokens, logprobs) in zip(prompts, results["auto", 1]):
        want_tokens, want_logprobs = _dense_greedy(params, cfg, prompt, 8)
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


def test_golden_walk_at_block_size_one():
    """Granite 4.0-H's fixture at block size 1 (its float32 state over 8 one-token pages) through
    the golden walk (preemption, a fork, prompt logprobs beside decodes, aborts) gives HF's tokens
    and logprobs. (An fp8 cache at block size 1: test_state_pages_not_ending_on_a_word.)"""
    model_dir = FIXTURES / "granitemoehybrid"
    cfg = load_config(model_dir)
    params = load_params(model_dir, cfg, jnp.float32, progress=False)
    args = hybrid_args(model_dir, 64, block_size=1)
    assert_engine_matches_goldens(LLMEngine(cfg, params, None, args, num_blocks=64),
                                  np.load(model_dir / "golden.npz"))
