"""Speculative decoding end to end on CPU: greedy outputs identical with and without speculation
(n-gram and draft model, every family's fixture, chunked prefill, prefix-cache hits, n > 1, stop
strings, logprobs, preemption mid-speculation), no leaked KV block, the policy, the acceptance
gate and the opt-out, sampled outputs distributed as without speculation, the flags and their
refusals. The engines here keep the acceptance gate open (min acceptance 0) so that drafts of low
acceptance still speculate all the way; `test_acceptance_gate_*` test the gate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.model.transformer import init_params
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec_decode.config import speculative_config
from jaxinfer.spec_decode.draft import DraftModel, load_draft
from jaxinfer.spec_decode.ngram import propose_ngram
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, assert_all_free, prompt_ids,
                                 record_proposed, run_all, tiny_model, tiny_tokenizer)

pytestmark = [pytest.mark.filterwarnings("error:Some donated buffers were not usable"),
              pytest.mark.slow]  # minutes on the CI machine: xdist starts its group first

FIXTURES = Path(__file__).parent / "fixtures" / "models"
# The hub-layout fixtures: <family>_fused/ holds the same weights in transformers-5's fused-expert
# file layout, which loads to the same params (test_hf_parity.py checks both layouts).
# One family per kind of model the verification step and the KV manager treat differently (the
# others add nothing here: their forwards are test_hf_parity's): llama (full attention; also its
# own draft, every proposal accepted), mistral_window (one sliding window over every layer),
# gemma3 (sliding and full layers: two KV groups), gpt_oss (two groups, sinks, MoE), deepseek_v2
# (MLA's latent cache). gemma2's softcapped attention and qwen3's q/k norms speculate in
# test_eagle3.py (qwen3_moe adds experts, as gpt_oss's); every family's forward at TP > 1 is
# test_parallel's.
FAMILIES = ["deepseek_v2", "gemma3", "gpt_oss", "llama", "mistral_window"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine(draft=None, num_blocks=NUM_BLOCKS, **kwargs) -> LLMEngine:
    cfg, params = tiny_model()
    args = dict(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=num_blocks,
                max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                compilation_cache_dir=None, warmup=False, dtype="float32")
    args.update(kwargs)
    if "speculative_method" in kwargs or "speculative_model" in kwargs:
        args.setdefault("speculative_min_acceptance", 0.0)
    return LLMEngine(cfg, params, tiny_tokenizer(), EngineArgs(**args), num_blocks=num_blocks,
                     draft=draft)


def self_draft() -> DraftModel:
    """The target as its own draft: greedy proposals are all accepted (long verified runs)."""
    cfg, params = tiny_model()
    return DraftModel(cfg, params)


def other_draft() -> DraftModel:
    cfg, _ = tiny_model()
    cfg = dataclasses.replace(cfg, num_layers=1)
    return DraftModel(cfg, init_params(cfg, jax.random.key(3), jnp.float32, std=0.3))


# Repetitive prompts (n-gram hits), shared prefixes (prefix-cache hits), lengths past one chunk.
PROMPTS = [prompt_ids(i % 3, 5 + i) * 2 for i in range(7)]


class Logprob(float):
    """A logprob equal to another within 2e-4: verification scores a row's k + 1 positions in one
    ragged pass where the baseline decodes them one by one (float32 summation order differs)."""

    def __eq__(self, other):
        return abs(float(self) - float(other)) <= 2e-4

    __hash__ = float.__hash__


def run_workload(e: LLMEngine, params: dict | None = None, arrivals_per_step: int = 2) -> dict:
    pending = list(enumerate(PROMPTS))
    results: dict = {}
    while pending or e.has_unfinished_requests():
        for _ in range(min(arrivals_per_step, len(pending))):
            i, p = pending.pop(0)
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=12 + i, **(params or GREEDY)))
        for out in e.step():
            for c in out.outputs:
                results.setdefault(out.request_id, {})[c.index] = (
                    c.token_ids, c.text, c.finish_reason,
                    None if c.logprobs is None else [(lp.token_id, Logprob(lp.logprob))
                                                     for lp in c.logprobs])
    assert_all_free(e)
    return results


_BASELINES: dict = {}


def baseline(params: dict | None = None, **kwargs) -> dict:
    """The workload's outputs without speculation, run once per module for each engine and
    sampling setting (the tests compare to it, never change it)."""
    key = repr((params, sorted(kwargs.items())))
    if key not in _BASELINES:
        _BASELINES[key] = run_workload(engine(**kwargs), params)
    return _BASELINES[key]


@pytest.mark.parametrize("options", [
    dict(),
    dict(long_prefill_chunk=5),  # chunked prefill next to verification rows
    dict(enable_prefix_caching=False),
])
def test_ngram_greedy_identical(options):
    spec = engine(speculative_method="ngram", num_speculative_tokens=3, **options)
    assert run_workload(spec) == baseline(**options)
    m = spec.spec.metrics
    assert m.drafts > 0 and 0 < m.accepted <= m.draft_tokens


@pytest.mark.parametrize("draft", [self_draft, other_draft], ids=["self", "other"])
def test_draft_greedy_identical_with_n2_stop_strings_and_logprobs(draft):
    params = dict(GREEDY, n=2, logprobs=2, stop=["ab"])
    spec = engine(draft(), speculative_model="draft", num_speculative_tokens=3)
    assert run_workload(spec, params) == baseline(params)
    m = spec.spec.metrics
    assert m.drafts > 0
    if draft is self_draft:
        assert m.accepted == m.draft_tokens  # the target proposing for itself is always right


def test_preemption_mid_speculation_keeps_outputs_and_frees_everything():
    # 17 blocks of 4 tokens: one full-length sequence fits, the workload needs preemptions; the
    # outputs are those of the unpreempted engine without speculation.
    spec = engine(self_draft(), num_blocks=17, speculative_model="draft", num_speculative_tokens=3)
    assert run_workload(spec, arrivals_per_step=7) == baseline()
    assert spec.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_greedy_matches_transformers_with_a_draft(family):
    """The HF golden greedy continuation, generated with a draft (the llama fixture; for llama
    itself, so one family also runs with every proposal accepted)."""
    golden = np.load(FIXTURES / family / "golden.npz")
    for draft in ("llama",):
        args = EngineArgs(model=str(FIXTURES / family), speculative_model=str(FIXTURES / draft),
                          num_speculative_tokens=4, dtype="float32", max_model_len=64,
                          block_size=BLOCK, num_blocks=64, max_num_seqs=2,
                          max_num_batched_tokens=16, compilation_cache_dir=None, warmup=False,
                          speculative_min_acceptance=0.0)
        e = LLMEngine.from_engine_args(args)
        e.add_request("g", golden["greedy_prompt"].tolist(),
                      SamplingParams(max_tokens=len(golden["greedy_tokens"]), **GREEDY))
        out = run_all(e)["g"][0][0]
        assert out == golden["greedy_tokens"].tolist(), draft
        assert e.spec.metrics.drafts > 0
        assert_all_free(e)


def test_sampled_outputs_follow_the_same_distribution():
    """Temperature 1, top-p 0.9: the second generated token (the first a proposal can stand for)
    of 300 seeded requests, with the target proposing for itself and without speculation: a
    two-sample chi-square over token classes finds no difference; and p == q accepts all."""
    params = dict(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)
    prompt = prompt_ids(5, 6)

    def second_tokens(e):
        out = {}
        for batch in range(0, 300, 8):  # no request waits: every step may speculate
            for i in range(batch, batch + 8):
                e.add_request(f"s{i}", prompt, SamplingParams(seed=1000 + i, **params))
            out.update(run_all(e))
        return np.array([v[0][0][1] for v in out.values()])

    spec = engine(self_draft(), speculative_model="draft", num_speculative_tokens=2)
    a, b = second_tokens(spec), second_tokens(engine())
    m = spec.spec.metrics
    assert m.draft_tokens >= 200 and m.accepted >= 0.97 * m.draft_tokens  # p == q: all accepted
    classes = np.unique(np.concatenate([a, b]))
    counts = np.array([[np.sum(x == c) for c in classes] for x in (a, b)], float)
    keep = counts.sum(0) >= 10  # rare tokens pooled into one class
    counts = np.concatenate([counts[:, keep], counts[:, ~keep].sum(1, keepdims=True)], axis=1)
    expected = counts.sum(1, keepdims=True) * counts.sum(0, keepdims=True) / counts.sum()
    stat = ((counts - expected) ** 2 / np.maximum(expected, 1e-9)).sum()
    df = counts.shape[1] - 1
    assert stat < df + 4 * np.sqrt(2 * df) + 10, (stat, df)


def test_seeded_sampling_is_reproducible_with_speculation():
    params = dict(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, top_k=5)
    outs = []
    for _ in range(2):
        e = engine(other_draft(), speculative_model="draft", num_speculative_tokens=3)
        e.add_request("x", PROMPTS[2], SamplingParams(**params))
        outs.append(run_all(e))
    assert outs[0] == outs[1]


def test_policy_and_opt_out():
    """No step speculates while more sequences run than --speculative-disable-by-batch-size or a
    request waits, and a request that opts out never speculates."""
    e = engine(speculative_method="ngram", num_speculative_tokens=3,
               speculative_disable_by_batch_size=2)
    seen = []
    schedule = e.scheduler.schedule

    def spy():
        running, waiting = len(e.scheduler.running), e.scheduler.num_waiting
        out = schedule()
        seen.append((running, waiting, out.num_proposed))
        return out
    e.scheduler.schedule = spy
    for i, p in enumerate(PROMPTS[:4]):
        e.add_request(f"r{i}", p, SamplingParams(max_tokens=8 + 6 * i, **GREEDY))
    run_all(e)
    assert all(n == 0 for running, waiting, n in seen if running > 2 or waiting)
    assert any(n > 0 for _, _, n in seen)
    e = engine(speculative_method="ngram", num_speculative_tokens=3)
    e.add_request("o", PROMPTS[3], SamplingParams(max_tokens=20, speculative_decoding=False,
                                                  **GREEDY))
    run_all(e)
    assert e.spec.metrics.drafts == 0
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(speculative_decoding="no").validate(100)
    assert err.value.param == "speculative_decoding"


def test_acceptance_gate_window_threshold_and_probe():
    from jaxinfer.spec_decode.gate import PROBE_AFTER_STEPS, WINDOW_TOKENS, AcceptanceGate
    gate = AcceptanceGate(0.25)
    for _ in range(WINDOW_TOKENS // 4 - 1):
        gate.observe(4, 0)        # 60 of 64 proposals seen: too few to judge
        gate.observe(0, 0)        # steps without proposals change nothing
    assert gate.open
    gate.observe(4, 4)            # 4 / 64 accepted < 25%
    assert not gate.open and gate.closings == 1
    for _ in range(PROBE_AFTER_STEPS - 1):
        gate.observe(0, 0)
    assert not gate.open
    gate.observe(0, 0)
    assert gate.open              # probing again, with an empty window
    for _ in range(4 * WINDOW_TOKENS):
        gate.observe(4, 1)        # exactly 25%: stays open; the window slides
    assert gate.open and gate.closings == 1
    never = AcceptanceGate(0.0)
    for _ in range(4 * WINDOW_TOKENS):
        never.observe(4, 0)
    assert never.open


def test_acceptance_gate_waits_out_the_start_of_a_batch():
    """Rows admitted together propose their least predictable tokens together: a batch's first
    steps (at c16 one step holds more than the token window) must not close the gate; a low rate
    kept over the step window still does."""
    from jaxinfer.spec_decode import gate as g
    gate = g.AcceptanceGate(0.1)
    gate.observe(80, 7)           # the demo's EAGLE-3 head at c16, first step: 9% accepted
    assert gate.open
    for _ in range(g.WINDOW_STEPS - 2):
        gate.observe(80, 7)
    assert gate.open and gate.closings == 0
    gate.observe(80, 7)           # still 9% over the whole step window
    assert not gate.open and gate.closings == 1


def test_acceptance_gate_pauses_a_draft_that_is_rejected(monkeypatch):
    """A draft whose proposals fall under --speculative-min-acceptance stops being asked (outputs
    unchanged); its steps run unspeculated until the gate probes again."""
    monkeypatch.setattr("jaxinfer.spec_decode.gate.WINDOW_STEPS", 4)  # the workload is short
    e = engine(other_draft(), speculative_model="draft", num_speculative_tokens=3,
               speculative_min_acceptance=1.0)  # any rejection in a full window closes it
    proposed = record_proposed(e)
    assert run_workload(e) == baseline()
    gate = e.spec.speculator.gate
    assert gate.closings == 1 and not gate.open
    last_speculating = max(i for i, n in enumerate(proposed) if n)
    assert sum(proposed) >= 64 and last_speculating < len(proposed) - 3
    ungated = engine(other_draft(), speculative_model="draft", num_speculative_tokens=3)
    run_workload(ungated)
    assert ungated.spec.metrics.draft_tokens > e.spec.metrics.draft_tokens


def test_metrics_have_vllm_names():
    from prometheus_client import generate_latest
    e = engine(self_draft(), speculative_model="draft", num_speculative_tokens=3)
    e.add_request("m", PROMPTS[1], SamplingParams(max_tokens=10, **GREEDY))
    run_all(e)
    text = generate_latest(e.metrics.registry).decode()
    m = e.spec.metrics
    assert f'jaxinfer:spec_decode_num_drafts_total{{model_name="tiny"}} {float(m.drafts)}' in text
    assert f'jaxinfer:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(m.accepted)}' in text
    assert 'jaxinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}' in text
    assert "jaxinfer:spec_decode_num_draft_tokens_total" in text


def test_ngram_proposer():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 4) == [4, 5, 1, 2]  # latest
    assert propose_ngram([7, 8, 5, 8, 6, 7, 8], 1, 2, 2) == [5, 8]  # the 2-gram [7, 8] first
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2) == []                # no earlier occurrence
    assert propose_ngram([5, 5], 1, 3, 3) == [5]                     # what follows, up to the end
    assert propose_ngram([1, 2, 1], 2, 3, 3) == []                   # shorter than min_n


def test_flags_json_and_refusals():
    cfg = speculative_config(method=None, model=None, num_tokens=None, lookup_min=None,
                             lookup_max=None, disable_by_batch_size=None,
                             config_json='{"method": "ngram", "num_speculative_tokens": 5, '
                                         '"prompt_lookup_max": 3}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 5, 3)
    args = EngineArgs(speculative_model="some/dir", num_speculative_tokens=2)
    assert args.spec_config().method == "draft_model"
    assert EngineArgs().spec_config() is None
    for kwargs, flag in [(dict(speculative_method="ngram"), "--num-speculative-tokens"),
                         (dict(speculative_method="ngram", num_speculative_tokens=0),
                          "--num-speculative-tokens"),
                         (dict(speculative_method="draft_model", num_speculative_tokens=2),
                          "--speculative-model"),
                         (dict(num_speculative_tokens=2), "--speculative-method"),
                         (dict(speculative_method="ngram", num_speculative_tokens=2,
                               speculative_min_acceptance=1.5), "--speculative-min-acceptance"),
                         (dict(speculative_config='{"method": "medusa", "num_speculative_tokens": 2}'),
                          "--speculative-method"),
                         (dict(speculative_config='{"method": "eagle3", "num_speculative_tokens": 2}'),
                          "--speculative-model"),
                         (dict(speculative_config='{"draft_tensor_parallel_size": 2}'),
                          "--speculative-config"),
                         (dict(speculative_method="ngram", num_speculative_tokens=2,
                               speculative_config='{"num_speculative_tokens": 3}'),
                          "--speculative-config")]:
        with pytest.raises(ConfigError, match=flag):
            EngineArgs(**kwargs)


def test_draft_must_share_the_tokenizer():
    target_cfg, _ = tiny_model()
    demo_draft = Path(__file__).parents[1] / "checkpoints" / "demo-draft"
    with pytest.raises(ConfigError, match="--speculative-model"):
        load_draft(str(demo_draft), target_cfg, tiny_tokenizer(), jnp.float32, "auto", 0)
