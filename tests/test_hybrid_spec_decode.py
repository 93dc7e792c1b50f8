"""Speculative decoding over state-space layers (core/kv_cache/state_rollback.py), for both hybrid
families in float32: greedy tokens equal the same engine's without speculation, token for token
and logprobs within 1e-5, while proposals are both accepted and rejected (a rejection rolls the
state back to the verifying step's start and recomputes the accepted tokens), with the prefix
cache on, preemption by recompute and an abort, and no block held after."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.config import load_config
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from hybrid_support import GREEDY, assert_same_outputs, hybrid_args
from test_engine_support import assert_all_free

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = {"granite": FIXTURES / "granitemoehybrid", "qwen3_next": FIXTURES / "qwen3_next"}
BLOCK, MAX_TOKENS = 4, 20
LATE = 10  # a step that dispatches with a verifying step in flight
NUM_BLOCKS = 40  # small enough to preempt (the runs without speculation too)
ROOMY = 128  # no preemption: nothing waits, so every decode may speculate
SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_min_acceptance=0.0)
_LOADED: dict = {}
_PLAIN: dict = {}  # family -> (its engine without speculation, {prompts: its greedy runs})


def _engine(name: str, num_blocks: int, **spec) -> LLMEngine:
    if name not in _LOADED:
        cfg = load_config(FAMILIES[name])
        _LOADED[name] = cfg, load_params(FAMILIES[name], cfg, jnp.float32, progress=False)
    cfg, params = _LOADED[name]
    args = hybrid_args(FAMILIES[name], num_blocks, block_size=BLOCK, enable_prefix_caching=True,
                       max_model_len=64, **spec)
    return LLMEngine(cfg, params, None, args, num_blocks=num_blocks)


def _plain(name: str, prompts: list[list[int]]) -> dict:
    """_run of `prompts` on the family's engine without speculation (NUM_BLOCKS: it preempts),
    one engine per family and one run per prompt list: the tests compare against the same
    runs, and an engine's compiles cost more than its runs."""
    if name not in _PLAIN:
        _PLAIN[name] = _engine(name, NUM_BLOCKS), {}
    engine, runs = _PLAIN[name]
    key = tuple(map(tuple, prompts))
    if key not in runs:
        runs[key] = _run(engine, prompts)
    return runs[key]


def _run(engine: LLMEngine, prompts: list[list[int]], late: int | None = None) -> dict:
    """{request id: (tokens, logprobs)} of the greedy runs of `prompts`, all at once; with
    `late`, one more request arrives after that many steps (a verifying step in flight, as
    speculation turns off while it waits) and is aborted three steps later."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, logprobs=0, **GREEDY))
    out, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == late:
            engine.add_request("aborted", prompts[0][::-1], SamplingParams(max_tokens=30, **GREEDY))
        if late is not None and steps == late + 3:
            engine.abort("aborted")
        for o in engine.step():
            if o.finished and o.request_id != "aborted":
                c = o.outputs[0]
                out[o.request_id] = list(c.token_ids), np.array([e.logprob for e in c.logprobs])
    assert_all_free(engine)
    return out


class _Scripted:
    """A host proposer that knows each request's greedy continuation (the run without
    speculation) and proposes it, its second token wrong every other time: proposals are
    accepted in full and in part on any model."""
    on_device = False

    def __init__(self, prompts: list[list[int]], want: dict):
        self.full = {f"r{i}": p + want[f"r{i}"][0] for i, p in enumerate(prompts)}
        self.calls = 0

    def begin_step(self) -> None:
        pass

    def plan(self, seq, max_tokens: int) -> list[int]:
        full = self.full.get(seq.request.request_id)
        if full is None:
            return []
        n = len(seq.token_ids)
        proposal = list(full[n:n + max_tokens])
        self.calls += 1
        if self.calls % 2 and len(proposal) > 1:
            proposal[1] = (proposal[1] + 1) % 384
        return proposal


PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13] * 4 + [11], [20, 21, 22, 23] * 3]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rejected_proposals_roll_the_state_back(name):
    """Accepted and rejected proposals, a pool small enough to preempt, an abort mid-run."""
    want = _plain(name, PROMPTS)
    spec = _engine(name, NUM_BLOCKS, **SPEC)
    spec.spec.speculator.proposer = _Scripted(PROMPTS, want)
    assert_same_outputs(_run(spec, PROMPTS, late=LATE), want)
    m = spec.spec.metrics
    assert 0 < m.accepted < m.draft_tokens
    assert spec.scheduler.num_preemptions > 0


def test_ngram_on_granite_equals_no_speculation():
    """Real n-gram proposals: prompts that repeat the model's own continuation, so some are
    accepted and some rejected."""
    first = _plain("granite", PROMPTS)
    prompts = [p + first[f"r{i}"][0][:8] + p for i, p in enumerate(PROMPTS)]
    want = _plain("granite", prompts)
    spec = _engine("granite", ROOMY, **SPEC)
    assert_same_outputs(_run(spec, prompts), want)
    m = spec.spec.metrics
    assert 0 < m.accepted < m.draft_tokens


def test_draft_model_on_qwen3_next_equals_no_speculation():
    """A draft model (the tiny Llama, another model: its proposals rejected) over Gated
    DeltaNet, its KV caught up past the rolled-back tokens."""
    from jaxinfer.spec_decode.draft import DraftModel
    cfg = load_config(FIXTURES / "llama")
    draft = DraftModel(cfg, load_params(FIXTURES / "llama", cfg, jnp.float32, progress=False))
    want = {rid: run for rid, run in _plain("qwen3_next", PROMPTS).items() if rid != "r2"}
    cfg, params = _LOADED["qwen3_next"]
    args = hybrid_args(FAMILIES["qwen3_next"], ROOMY, block_size=BLOCK, enable_prefix_caching=True,
                       max_model_len=64, speculative_model="draft", num_speculative_tokens=3,
                       speculative_min_acceptance=0.0)
    spec = LLMEngine(cfg, params, None, args, num_blocks=ROOMY, draft=draft)
    assert_same_outputs(_run(spec, PROMPTS[:2]), want)
    m = spec.spec.metrics
    assert m.draft_tokens > m.accepted
