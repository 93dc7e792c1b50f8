"""Prefix caching of state-space layers' states (core/kv_cache/state_snapshots.py) through the
engine, for both hybrid families (Granite 4.0-H's Mamba-2, Qwen3-Next's Gated DeltaNet) in
float32: a request sharing a prefix with an earlier one resumes from the state snapshot at the
hit's last block and gives HF's greedy token and logprob (and the tokens and logprobs of the
same engine without prefix caching), whether the hit spans the earlier request's prefill chunks
or its decoded tokens; no block is held after aborts of requests that hit. (The golden walk
with prefix caching on, test_engine_matches_transformers[prefix_caching] in
test_granite_hybrid.py and test_qwen3_next.py, runs beside the walk without it: the same
compiled steps.)"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.core.kv_cache.state_snapshots import StateSnapshotMixin
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.config import load_config
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from hybrid_support import GREEDY, hybrid_args
from test_engine_support import assert_all_free

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = {"granite": FIXTURES / "granitemoehybrid", "qwen3_next": FIXTURES / "qwen3_next"}
BLOCK = 4  # a state spans two (Granite) or three (Qwen3-Next) pages of 4 float32 tokens
_LOADED: dict = {}


def _model(name: str):
    if name not in _LOADED:
        cfg = load_config(FAMILIES[name])
        _LOADED[name] = cfg, load_params(FAMILIES[name], cfg, jnp.float32, progress=False)
    return _LOADED[name]


def _engine(name: str, num_blocks: int, caching: bool = True) -> LLMEngine:
    cfg, params = _model(name)
    args = hybrid_args(FAMILIES[name], num_blocks, block_size=BLOCK,
                       enable_prefix_caching=caching)
    return LLMEngine(cfg, params, None, args, num_blocks=num_blocks)


def _run(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int):
    """(token ids, their logprobs, prompt tokens served from the prefix cache) of one request
    run alone to its end."""
    engine.add_request(request_id, prompt,
                       SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    choice = final.outputs[0]
    return list(choice.token_ids), [e.logprob for e in choice.logprobs], final.num_cached_tokens


def _golden_next(golden, i: int) -> tuple[int, float]:
    """HF's greedy token after prompt i and its logprob."""
    last = np.asarray(jax.nn.log_softmax(golden[f"logits_{i}"][-1]))
    return int(np.argmax(last)), float(last.max())


@pytest.mark.parametrize("name", FAMILIES)
def test_hits_resume_from_the_snapshot(name):
    golden = np.load(FAMILIES[name] / "golden.npz")
    engine, plain = _engine(name, 64), _engine(name, 64, caching=False)
    long_prompt = golden["prompt_2"].tolist()  # 29 tokens: ten 3-token chunks
    token, logprob = _golden_next(golden, 2)
    assert _run(engine, "first", long_prompt, 1)[:2] == ([token], [pytest.approx(logprob, abs=1e-4)])

    # The same prompt again: resumes at its last block boundary, past nine chunk boundaries of
    # the first run; HF's token and logprob.
    tokens, logprobs, cached = _run(engine, "again", long_prompt, 1)
    assert cached == 28
    assert tokens == [token] and logprobs == [pytest.approx(logprob, abs=1e-4)]

    # A prompt that leaves the first one mid-chunk (at 14: the chunks were cut at 12) and goes on
    # differently: the hit is the last boundary before the divergence, and every token and
    # logprob is the engine's without prefix caching.
    other = long_prompt[:14] + long_prompt[::-1][:9]
    tokens, logprobs, cached = _run(engine, "branch", other, 6)
    assert cached == 12
    want_tokens, want_logprobs, none = _run(plain, "branch", other, 6)
    assert none == 0 and tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)

    # A next turn: HF's greedy run, asked again from its 11th token on, resumes at its prompt's
    # last block boundary (decodes take no snapshots) and computes the decoded tokens again.
    prompt, expected = golden["greedy_prompt"].tolist(), golden["greedy_tokens"].tolist()
    assert _run(engine, "decode", prompt, len(expected))[0] == expected
    tokens, logprobs, cached = _run(engine, "turn", prompt + expected[:11], len(expected) - 11)
    assert cached == 4 and tokens == expected[11:]
    want_tokens, want_logprobs, _ = _run(plain, "turn", prompt + expected[:11],
                                         len(expected) - 11)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)
    assert_all_free(engine)


def test_a_hit_without_its_snapshot_is_wrong(monkeypatch):
    """Sanity check that the parity above depends on the snapshots: the same hit resuming
    from state pages that were not filled from the snapshot gives another logprob."""
    golden = np.load(FAMILIES["granite"] / "golden.npz")
    engine = _engine("granite", 64)
    long_prompt = golden["prompt_2"].tolist()
    _run(engine, "first", long_prompt, 1)
    monkeypatch.setattr(StateSnapshotMixin, "_copy_resumed_state", lambda self, req, g: None)
    _, logprobs, cached = _run(engine, "again", long_prompt, 1)
    assert cached == 28
    assert abs(logprobs[0] - _golden_next(golden, 2)[1]) > 1e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_preempted_request_resumes_from_its_snapshot(name, monkeypatch):
    """A request preempted by recompute mid-decode (the scheduler's own preemption, called
    between steps: one the pool forces comes only once every evictable block, snapshots
    included, is gone) resumes from the snapshot of its prompt, and its tokens and logprobs are
    the engine's without prefix caching."""
    golden = np.load(FAMILIES[name] / "golden.npz")
    prompt = golden["prompt_2"].tolist()
    engine = _engine(name, 64)
    scheduler, lookups = engine.scheduler, []
    match = scheduler.kv.get_computed_blocks

    def logged(request_id, token_ids, *args, **kwargs):
        lookups.append((len(token_ids), match(request_id, token_ids, *args, **kwargs)))
        return lookups[-1][1]

    monkeypatch.setattr(scheduler.kv, "get_computed_blocks", logged)
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, logprobs=0, **GREEDY))
    while not any(len(s.token_ids) > len(prompt) for s in scheduler.running):
        engine.step()
    scheduler._preempt(scheduler.running[0])
    final = None
    while engine.has_unfinished_requests():
        final = next((out for out in engine.step() if out.finished), final)
    assert scheduler.num_preemptions == 1
    length, cached = lookups[-1]  # the re-admission, with the tokens it had decoded
    assert len(lookups) == 2 and length > len(prompt) and cached == 28
    want_tokens, want_logprobs, _ = _run(_engine(name, 64, caching=False), "r", prompt, 3)
    assert list(final.outputs[0].token_ids) == want_tokens
    np.testing.assert_allclose([e.logprob for e in final.outputs[0].logprobs], want_logprobs,
                               atol=1e-4, rtol=0)
    assert_all_free(engine)


@pytest.mark.parametrize("name", FAMILIES)
def test_aborted_hits_leave_no_block_held(name):
    golden = np.load(FAMILIES[name] / "golden.npz")
    engine = _engine(name, 64)
    kv = engine.scheduler.kv
    long_prompt = golden["prompt_2"].tolist()
    _run(engine, "first", long_prompt, 1)
    free_before = kv.num_free_blocks
    # Two hits aborted mid-prefill and mid-decode, one aborted while it waits for admission.
    for i in range(2):
        engine.add_request(f"hit{i}", long_prompt[:22] + [i], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    engine.abort("hit0")
    for _ in range(3):
        engine.step()
    engine.add_request("waiting", long_prompt, SamplingParams(max_tokens=2, **GREEDY))
    engine.abort("hit1")
    engine.abort("waiting")
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.stats.hits == 2 * 12  # (the first run snapshotted its 12th and 24th tokens)
    assert kv.num_free_blocks == free_before == engine.num_total_blocks
    assert not kv.request_ids() and sum(kv.pool.ref_counts) == 0
    assert_all_free(engine)


def test_snapshot_bookkeeping():
    """The manager alone: chunks cut on boundaries; a snapshot is copied from the state pages of
    the step that starts on a boundary, registered once its node is cached, read by a hit's
    fresh state pages, whole or gone under eviction; nothing held after frees."""
    from jaxinfer.core.kv_cache import FixedStateSpec, FullAttentionSpec, KVCacheGroups
    from jaxinfer.core.kv_cache.manager import KVCacheManager
    page = FullAttentionSpec(1, 2)  # 4 float32 tokens x (K + V) x 2 = 64 bytes a page
    groups = KVCacheGroups.from_layer_specs([page, FixedStateSpec(100, page_of=page)])
    mgr = KVCacheManager(14, BLOCK, True, groups, kv_dtype=jnp.float32)
    assert mgr.snapshots_states and groups.state_pages(BLOCK, jnp.float32) == (None, 2)
    assert [mgr.aligned_chunk(*a, 13) for a in [(0, 6), (4, 3), (10, 3), (12, 1)]] == [4, 3, 2, 1]
    tokens = list(range(13))
    assert mgr.get_computed_blocks("a", tokens) == 0 and mgr.allocate_slots("a", 8)
    state = list(mgr.get_block_tables("a")[1])
    mgr.take_pending_copies()
    mgr.cache_blocks("a", tokens, 8)
    assert mgr.allocate_slots("a", 4)
    mgr.snapshot_state("a", 8)
    pages, copies = mgr.take_pending_copies_by_kind()  # state pages' copies apart (a head skips them)
    assert not pages and [src for src, _ in copies] == state
    snapshot = tuple(dst for _, dst in copies)
    mgr.cache_blocks("a", tokens, 12)  # node 2 (tokens 0..7) gets the snapshot
    mgr.snapshot_state("a", 8)  # node 2 has one: none taken
    assert not mgr.take_pending_copies() and mgr.num_cached_blocks == 3 + 2

    assert mgr.get_computed_blocks("b", tokens[:10] + [99]) == 8 and mgr.allocate_slots("b", 3)
    fresh = mgr.get_block_tables("b")[1]
    assert mgr.take_pending_copies() == list(zip(snapshot, fresh))
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 14 and sum(mgr.pool.ref_counts) == 0
    # 9 uncached blocks free, 5 evictable (3 of tokens, the snapshot's 2): taking 12 (10 of
    # tokens, 2 of state) evicts 3, and a snapshot losing one block loses both.
    assert mgr.allocate_slots("c", 40)
    assert all(mgr.cache_node_of(b) is None for b in snapshot)
    mgr.free("c")
    assert mgr.num_free_blocks == 14 and sum(mgr.pool.ref_counts) == 0
