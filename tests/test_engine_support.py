"""Shared pieces of the engine tests: a tiny tokenizer and random model made in-process, and an
engine factory whose engines share compiled steps (same model config -> same jit cache).

Also checks the helpers themselves (the tokenizer round-trips, the model is not degenerate)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from jaxinfer.model.config import config_from_dict
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.args import EngineArgs
from jaxinfer.model.transformer import init_params
from jaxinfer.model.tokenizer import Tokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz #.!"
MERGES = [("#", "#"), ("a", "b"), ("c", "d"), ("e", " "), ("s", "t"), ("o", "p")]
EOS = 1
BLOCK = 4
MAX_LEN = 64
NUM_BLOCKS = 128


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> Tokenizer:
    vocab = {"<s>": 0, "</s>": 1}
    for c in CHARS:
        vocab[c] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=MERGES))
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>", eos_token_ids=(EOS,))


@functools.lru_cache(maxsize=None)
def tiny_model():
    vocab = tiny_tokenizer().vocab_size
    cfg = config_from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-6, "eos_token_id": EOS, "bos_token_id": 0, "torch_dtype": "float32"})
    params = init_params(cfg, jax.random.key(7), jnp.float32, std=0.3)
    return cfg, params


def make_engine(*, num_blocks: int = NUM_BLOCKS, warmup: bool = False, role: str | None = None,
                model=None, **kwargs) -> LLMEngine:
    """An engine over the tiny model (or `model`, a (cfg, params) pair over the tiny tokenizer's
    vocabulary). Defaults: 8 seqs, 32-token steps, 4-token blocks. `role`: a disaggregated pair's
    side (LLMEngine's)."""
    cfg, params = model or tiny_model()
    defaults = dict(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=num_blocks,
                    max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                    compilation_cache_dir=None, warmup=False, dtype="float32",
                    background_compile=False)
    defaults.update(kwargs)
    args = EngineArgs(**defaults)
    engine = LLMEngine(cfg, params, tiny_tokenizer(), args, num_blocks=num_blocks, role=role)
    if warmup:
        engine.warmup(progress=False)
    return engine



def one_device_disaggregated(cfg, params, tokenizer, args: EngineArgs, num_blocks: int):
    """A DisaggregatedEngine whose prefill and decode engines share the one CPU device, each on a
    one-device mesh (the transfer's plans), built as from_engine_args builds the pair."""
    from jaxinfer.disagg.args import role_args
    from jaxinfer.frontends.disagg_handoff import HandoffOutputProcessor
    from jaxinfer.frontends.disaggregated import DisaggregatedEngine
    from jaxinfer.parallel.sharding import ShardingPlan, build_mesh

    def engine(role: str, **parts) -> LLMEngine:
        return LLMEngine(cfg, params, tokenizer, role_args(args, role), num_blocks=num_blocks,
                         role=role, plan=ShardingPlan(build_mesh(1), cfg), **parts)

    prefill = engine("prefill", outputs_cls=HandoffOutputProcessor)
    return DisaggregatedEngine(prefill, engine("decode", grammars=prefill.grammars))

PROMPT_DRAW = 4096  # tokens drawn per seed: one shape, so one compile (modules call this at import)


def prompt_ids(seed: int, length: int) -> list[int]:
    """A reproducible random prompt of token ids (no EOS): the first `length` of the seed's draw
    (threefry is partitionable, so a prefix of a longer draw equals the shorter draw)."""
    return _prompt_draw(seed, max(length, PROMPT_DRAW))[:length]


@functools.lru_cache(maxsize=None)
def _prompt_draw(seed: int, length: int) -> list[int]:
    vocab = tiny_tokenizer().vocab_size
    return jax.random.randint(jax.random.key(seed), (length,), 2, vocab).tolist()


def run_all(engine: LLMEngine) -> dict:
    """Step until idle; return {request_id: {index: (token_ids, text, finish_reason)}}."""
    results: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                results.setdefault(out.request_id, {})[c.index] = (c.token_ids, c.text, c.finish_reason)
    return results


def assert_all_free(engine: LLMEngine) -> None:
    """Nothing leaked: every KV block is free, nothing runs or waits."""
    assert engine.scheduler.kv.num_free_blocks == engine.num_total_blocks
    assert not engine.scheduler.running and engine.num_waiting == 0


def assert_speculative_greedy_matches_golden(model_dir, spec: dict, golden, block_size: int,
                                             **engine_args):
    """An engine speculating with `spec` (a --speculative-config dict) over `model_dir` gives the
    fixture's HF greedy tokens, proposed drafts, and leaks nothing; returns the engine."""
    import json

    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.spec_decode.eagle import EagleProposer
    args = EngineArgs(model=str(model_dir), speculative_config=json.dumps(spec), dtype="float32",
                      max_model_len=64, block_size=block_size, num_blocks=64, max_num_seqs=2,
                      max_num_batched_tokens=16, compilation_cache_dir=None, warmup=False,
                      speculative_min_acceptance=0.0, **engine_args)
    e = LLMEngine.from_engine_args(args)
    assert isinstance(e.spec.speculator.proposer, EagleProposer)
    e.add_request("g", golden["greedy_prompt"].tolist(),
                  SamplingParams(max_tokens=len(golden["greedy_tokens"]), temperature=0.0,
                                 ignore_eos=True))
    assert run_all(e)["g"][0][0] == golden["greedy_tokens"].tolist()
    assert e.spec.metrics.drafts > 0
    assert_all_free(e)
    return e


def record_proposed(engine) -> list[int]:
    """A list the engine's scheduler appends each step's proposed-token count to."""
    proposed, schedule = [], engine.scheduler.schedule

    def spy():
        out = schedule()
        proposed.append(out.num_proposed)
        return out
    engine.scheduler.schedule = spy
    return proposed


def test_tiny_tokenizer_round_trip():
    tok = tiny_tokenizer()
    text = "abcd ## stop e x"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tiny_model_is_not_degenerate():
    """Greedy continuations of different prompts differ (else equality tests prove little)."""
    from jaxinfer.sampling_params import SamplingParams
    engine = make_engine()
    for i in range(4):
        engine.add_request(f"r{i}", prompt_ids(i, 5), SamplingParams(temperature=0, max_tokens=8,
                                                                      ignore_eos=True))
    outs = run_all(engine)
    seqs = {tuple(outs[f"r{i}"][0][0]) for i in range(4)}
    assert len(seqs) == 4
    assert all(len(set(s)) > 2 for s in seqs)
