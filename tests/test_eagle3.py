"""EAGLE-3 speculative decoding on CPU: greedy output with a random head (HF format, a reduced
draft vocabulary mapped by d2t) identical to the HF golden continuation on several families'
fixtures; sampled outputs distributed as without speculation; the head's loading refusals."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import load_config
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec_decode import eagle_head as head
from jaxinfer.spec_decode.eagle import EagleProposer, load_eagle
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, assert_all_free,
                                 assert_speculative_greedy_matches_golden, prompt_ids, run_all,
                                 tiny_model, tiny_tokenizer)

pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def random_head(target_cfg, key=0, std=0.3) -> tuple[head.Eagle3Config, dict]:
    """A random head over a reduced draft vocabulary (every other token, offsets in d2t)."""
    vd = target_cfg.vocab_size // 2
    cfg = head.eagle3_config(
        {"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": target_cfg.vocab_size,
         "draft_vocab_size": vd, "hidden_size": target_cfg.hidden_size,
         "intermediate_size": 2 * target_cfg.hidden_size, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6,
         "max_position_embeddings": target_cfg.max_position_embeddings}, target_cfg)
    params = head.init_head(cfg, key, jnp.float32, std=std)
    params["d2t"] = jnp.arange(vd, dtype=jnp.int32)  # draft i -> target 2 i
    return cfg, params


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory):
    out = {}
    for family in ("llama", "qwen3", "gemma2"):
        target = load_config(FIXTURES / family)
        cfg, params = random_head(target)
        path = tmp_path_factory.mktemp(f"eagle_{family}")
        head.save_head(params, cfg, json.loads((FIXTURES / family / "config.json").read_text()),
                       path)
        out[family] = path
    return out


@pytest.mark.parametrize("family, loop_iterations", [("llama", None), ("qwen3", 1), ("gemma2", 1)])
def test_greedy_matches_transformers_with_an_eagle3_head(family, loop_iterations, head_dirs):
    """Through the default on-device loop (llama) and host-driven verifying steps (the loop runs
    the same forward for every family: test_spec_loop.py checks it against those steps)."""
    golden = np.load(FIXTURES / family / "golden.npz")
    spec = {"method": "eagle3", "model": str(head_dirs[family]), "num_speculative_tokens": 4}
    assert_speculative_greedy_matches_golden(FIXTURES / family, spec, golden, block_size=BLOCK,
                                             spec_loop_iterations=loop_iterations)


def tiny_engine(proposer=None, **kwargs) -> LLMEngine:
    cfg, params = tiny_model()
    args = dict(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                compilation_cache_dir=None, warmup=False, dtype="float32")
    if proposer is not None:
        args.update(speculative_config={"method": "eagle3", "model": "in-process",
                                        "num_speculative_tokens": 2},
                    speculative_min_acceptance=0.0)
    args.update(kwargs)
    return LLMEngine(cfg, params, tiny_tokenizer(), EngineArgs(**args), num_blocks=NUM_BLOCKS,
                     draft=proposer)


@pytest.mark.parametrize("loop_iterations", [1, 4])
def test_sampled_outputs_follow_the_same_distribution(loop_iterations):
    """Temperature 1: the second generated token (the first a proposal can stand for) of 160
    seeded requests, with a random head and without speculation: a two-sample chi-square over
    token classes finds no difference; some proposals are accepted, some rejected. With
    host-driven verifying steps and with the on-device loop (spec_decode/spec_loop.py)."""
    params = dict(temperature=1.0, max_tokens=3, ignore_eos=True)
    prompt = prompt_ids(5, 6)
    target_cfg, _ = tiny_model()
    cfg, hp = random_head(target_cfg, std=0.05)

    def second_tokens(e):
        out = {}
        for batch in range(0, 160, 8):  # no request waits: every step may speculate
            for i in range(batch, batch + 8):
                e.add_request(f"s{i}", prompt, SamplingParams(seed=1000 + i, **params))
            out.update(run_all(e))
        return np.array([v[0][0][1] for v in out.values()])

    spec = tiny_engine(EagleProposer(cfg, hp), spec_loop_iterations=loop_iterations)
    a, b = second_tokens(spec), second_tokens(tiny_engine())
    assert (spec.spec.step.loop is not None) == (loop_iterations > 1)
    assert spec.spec.step.loop is None or spec.spec.step.loop.dispatches >= 10
    m = spec.spec.metrics
    assert m.draft_tokens >= 150 and 0 < m.accepted < m.draft_tokens
    classes = np.unique(np.concatenate([a, b]))
    counts = np.array([[np.sum(x == c) for c in classes] for x in (a, b)], float)
    keep = counts.sum(0) >= 10  # rare tokens pooled into one class
    counts = np.concatenate([counts[:, keep], counts[:, ~keep].sum(1, keepdims=True)], axis=1)
    expected = counts.sum(1, keepdims=True) * counts.sum(0, keepdims=True) / counts.sum()
    stat = ((counts - expected) ** 2 / np.maximum(expected, 1e-9)).sum()
    df = counts.shape[1] - 1
    assert stat < df + 4 * np.sqrt(2 * df) + 10, (stat, df)


def test_head_loading_round_trip_and_refusals(tmp_path):
    target = load_config(FIXTURES / "llama")
    cfg, params = random_head(target)
    raw = json.loads((FIXTURES / "llama" / "config.json").read_text())
    head.save_head(params, cfg, raw, tmp_path / "ok")
    loaded = load_eagle(str(tmp_path / "ok"), target, jnp.float32)
    assert loaded.cfg == cfg
    np.testing.assert_array_equal(loaded.params["d2t"], params["d2t"])
    # Served in the fused layout (head.fuse_projections): q's columns come first.
    q = loaded.params["qkv_proj"][:, :params["q_proj"].shape[1]]
    np.testing.assert_allclose(q, params["q_proj"], atol=2e-2, rtol=2e-2)
    small = load_config(FIXTURES / "llama")
    with pytest.raises(ConfigError, match="vocab_size"):
        head.eagle3_config(dict(head.hf_config(cfg, raw), vocab_size=7), small)
    bad = dict(params, fc=params["fc"][:-1])
    head.save_head(bad, cfg, raw, tmp_path / "bad")
    with pytest.raises(ConfigError, match="fc"):
        load_eagle(str(tmp_path / "bad"), target, jnp.float32)
    with pytest.raises(ConfigError, match="model directory"):
        EngineArgs(model="x", speculative_config={"method": "eagle3",
                                                  "num_speculative_tokens": 2}).spec_config()


def test_warmup_compiles_the_stream_writing_forward_and_the_spec_loop():
    """With a head attached, warm-up compiles the head's stream-writing forward for every step
    bucket (the ordinary steps run it, not the runner's own forward) and the on-device
    speculative loop of each loop bucket (sampler variants x greedy-only or not), so serving
    compiles none of them."""
    target_cfg, _ = tiny_model()
    cfg, hp = random_head(target_cfg)
    proposer = EagleProposer(cfg, hp)
    e = tiny_engine(proposer, max_num_batched_tokens=16, background_compile=False)
    e.warmup(progress=False)
    buckets = e.runner.buckets
    programs = e.runner.programs
    assert len(programs.compiled[proposer.forward_program]) == (len(buckets.token_buckets)
                                                                + len(buckets.decode_buckets))
    assert not programs.compiled["forward"]  # the runner's own forward is not compiled
    loop = e.runner.speculation.loop
    assert e.runner.spec_loop_buckets == buckets.decode_buckets == (8,)  # 8 sequences at most
    assert sorted((s, v.advanced, g) for s, v, g in programs.compiled[loop.program]) == [
        (8, False, False), (8, False, True), (8, True, False), (8, True, True)]
    calls = []
    jitted, loop_fn = programs.jitted[proposer.forward_program], programs.jitted[loop.program]
    programs.jitted[proposer.forward_program] = lambda *a: calls.append(1) or jitted(*a)
    programs.jitted[loop.program] = lambda *a, **k: calls.append(2) or loop_fn(*a, **k)
    for temperature in (0.0, 0.8):
        e.add_request(f"t{temperature}", prompt_ids(3, 20),
                      SamplingParams(temperature=temperature, max_tokens=12, seed=1))
        run_all(e)
    # Prefill ran an executable, the decodes speculated in compiled loops, nothing through jit.
    assert not calls and e.spec.metrics.draft_tokens and loop.dispatches >= 2


@pytest.mark.parametrize("loop_iterations", [1, 4])
def test_greedy_over_an_fp8_cache_equals_the_target_alone(loop_iterations):
    """Over an fp8 KV cache the head keeps its own layer's cache in its weights' dtype (no fp8
    scales of its own): greedy tokens with speculation are the fp8 target's alone, through
    host-driven verifying steps and the on-device loop."""
    target_cfg, _ = tiny_model()
    cfg, hp = random_head(target_cfg, std=0.02)
    prompts = [prompt_ids(3 + i, 9 + 3 * i) for i in range(3)]

    def greedy(e):
        for i, p in enumerate(prompts):
            e.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=10,
                                                    ignore_eos=True))
        return run_all(e)

    proposer = EagleProposer(cfg, hp)
    spec = tiny_engine(proposer, kv_cache_dtype="fp8", spec_loop_iterations=loop_iterations)
    assert jnp.dtype(spec.runner.kv_cache[0][0].dtype).itemsize == 1
    assert proposer.kv_cache[0][0].dtype == jnp.float32
    assert greedy(spec) == greedy(tiny_engine(kv_cache_dtype="fp8"))
    assert spec.spec.metrics.draft_tokens > 0
    assert (spec.spec.step.loop is not None) == (loop_iterations > 1)
    assert_all_free(spec)
