"""The host KV tier (--kv-offload) on state-space hybrids (Granite 4.0-H's Mamba-2, Qwen3-Next's
Gated DeltaNet), float32 on a device pool too small to keep a prefix: a prefix node's state
snapshots go to the host beside its attention block, as bundles kept whole or gone
(core/kv_cache/host_tier.py), and a prompt found there resumes from the host's snapshot, skipping
its prefill, with HF's token and logprob and those of the same engine without the host tier;
multi-turn chats and sleep / wake give the same tokens and logprobs with the tier as without, as
does a hybrid whose attention layers fill two groups; aborted hits leave no device block held and
no host slot pinned."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.core.kv_cache.host_tier import HostTier, state_keys
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.config import load_config
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from hybrid_support import GREEDY, hybrid_args
from test_engine_support import assert_all_free

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = {"granite": FIXTURES / "granitemoehybrid", "qwen3_next": FIXTURES / "qwen3_next"}
BLOCK = 4
# A pool of 24 (Granite) or 30 (Qwen3-Next) blocks holds one 29-token prompt's blocks, state
# pages and a snapshot or two: the next prompt evicts them.
POOL = {"granite": 24, "qwen3_next": 30}
# Host sizes (one block: 1 KiB for Granite, 2 KiB for Qwen3-Next): a large one gets a request's
# prefix written through at release, one under twice the pool only what the device evicts.
HOST_GIB = {"write_through": 1e-3, "at_eviction": 40 * 1024 / 2 ** 30}
_LOADED: dict = {}


def _model(name: str):
    if name not in _LOADED:
        cfg = load_config(FAMILIES[name])
        _LOADED[name] = cfg, load_params(FAMILIES[name], cfg, jnp.float32, progress=False)
    return _LOADED[name]


def _engine(name: str, host: str | None) -> LLMEngine:
    cfg, params = _model(name)
    args = hybrid_args(FAMILIES[name], POOL[name], block_size=BLOCK, max_model_len=40,
                       enable_prefix_caching=True, kv_offload=host is not None,
                       kv_host_gib=HOST_GIB.get(host, 1.0))
    return LLMEngine(cfg, params, None, args, num_blocks=POOL[name])


def _run(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int):
    """(token ids, their logprobs, prompt tokens not computed) of one request run alone."""
    engine.add_request(request_id, prompt,
                       SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY))
    final = None
    while engine.has_unfinished_requests():
        final = next((out for out in engine.step() if out.finished), final)
    choice = final.outputs[0]
    return list(choice.token_ids), [e.logprob for e in choice.logprobs], final.num_cached_tokens


def _assert_host_settled(engine: LLMEngine) -> None:
    """No host slot pinned, every held one evictable (in the LRU), no device block held."""
    host = engine.scheduler.kv.host
    assert not any(host._pins) and len(host.lru_slots()) == host.num_used_slots
    assert_all_free(engine)


@pytest.mark.parametrize("host", HOST_GIB)
@pytest.mark.parametrize("name", FAMILIES)
def test_an_evicted_prefix_resumes_from_the_host(name, host):
    golden = np.load(FAMILIES[name] / "golden.npz")
    prompt, other = golden["prompt_2"].tolist(), golden["greedy_prompt"].tolist()
    last = np.asarray(jax.nn.log_softmax(golden["logits_2"][-1]))
    outputs = {}
    for tier in (None, host):
        engine = _engine(name, tier)
        first = _run(engine, "first", prompt, 1)
        _run(engine, "other", other, 8)  # evicts the first prompt's blocks and snapshots
        outputs[tier] = first, _run(engine, "again", prompt, 1)
    (first, again), (_, plain) = outputs[host], outputs[None]
    kv = engine.scheduler.kv
    assert plain[2] == 0 and kv.stats.hits == 0  # nothing left on the device
    # Written through: from the prompt's last boundary (28); at eviction the device may keep the
    # head of its attention blocks (taken as they are) and the host a snapshot at 24 or 28.
    assert again[2] == kv.stats.host_hits >= 24
    assert host == "at_eviction" or again[2] == 28
    assert kv.host.stats.loaded_blocks == kv.host.stats.hit_blocks > 0
    for tokens, logprobs, _ in (first, again, plain):
        assert tokens == [int(np.argmax(last))]
        assert logprobs == [pytest.approx(float(last.max()), abs=1e-4)]
    assert again[1] == pytest.approx(plain[1], abs=1e-5)
    _assert_host_settled(engine)


def test_a_host_hit_without_its_snapshot_is_wrong(monkeypatch):
    """Sanity check that the parity above depends on the host snapshot: the same hit whose
    state pages are not loaded from it gives another logprob."""
    from jaxinfer.core import kv_loads
    golden = np.load(FAMILIES["granite"] / "golden.npz")
    prompt = golden["prompt_2"].tolist()
    engine = _engine("granite", "write_through")
    _run(engine, "first", prompt, 1)
    _run(engine, "other", golden["greedy_prompt"].tolist(), 8)
    start = kv_loads.KVLoads.start

    def without_states(self, seq, chunk_tokens):
        start(self, seq, chunk_tokens)
        for slots, blocks in self._next.loads:
            states = set(b for t in self.kv.get_block_tables(seq.seq_id)[1:] for b in t)
            blocks[:] = [-1 if b in states else b for b in blocks]

    monkeypatch.setattr(kv_loads.KVLoads, "start", without_states)
    _, logprobs, cached = _run(engine, "again", prompt, 1)
    assert cached == 28
    assert abs(logprobs[0] - float(jax.nn.log_softmax(golden["logits_2"][-1]).max())) > 1e-3


def _chats(engine: LLMEngine, turns: int = 3) -> dict:
    """Two chats over a shared 8-token system prompt, each turn appending the answer and a new
    question: greedy tokens and logprobs by (chat, turn)."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 380, 8).tolist()
    hist = {c: system + rng.integers(0, 380, 3).tolist() for c in range(2)}
    outs = {}
    for t in range(turns):
        for c in range(2):
            tokens, logprobs, _ = _run(engine, f"c{c}t{t}", hist[c], 4)
            outs[c, t] = tokens, logprobs
            hist[c] = hist[c] + tokens + rng.integers(0, 380, 5).tolist()
    return outs


@pytest.mark.parametrize("name", FAMILIES)
def test_chats_and_sleep_with_the_host_tier_equal_without(name):
    without = _chats(_engine(name, None))
    engine = _engine(name, "at_eviction")
    outs = _chats(engine)
    for key, (tokens, logprobs) in without.items():
        assert outs[key][0] == tokens, key
        np.testing.assert_allclose(outs[key][1], logprobs, atol=1e-5, rtol=0)
    kv = engine.scheduler.kv
    assert kv.stats.host_hits > 0 and kv.host.stats.loaded_blocks == kv.host.stats.hit_blocks
    _assert_host_settled(engine)
    # sleep copies every cached block and snapshot to the host: after wake a prompt resumes there.
    golden = np.load(FAMILIES[name] / "golden.npz")
    prompt = golden["prompt_2"].tolist()
    want = _run(engine, "before", prompt, 2)
    engine.sleep()
    engine.wake()
    before = kv.stats.host_hits
    tokens, logprobs, cached = _run(engine, "after", prompt, 2)
    assert cached == kv.stats.host_hits - before == 28
    assert tokens == want[0] and logprobs == pytest.approx(want[1], abs=1e-5)
    _assert_host_settled(engine)


@pytest.mark.parametrize("name", FAMILIES)
def test_aborted_host_hits_leak_nothing(name):
    golden = np.load(FAMILIES[name] / "golden.npz")
    prompt = golden["prompt_2"].tolist()
    engine = _engine(name, "write_through")
    _run(engine, "first", prompt, 1)
    _run(engine, "other", golden["greedy_prompt"].tolist(), 8)
    kv = engine.scheduler.kv
    # Hits aborted right after their load step, mid-decode and while waiting for admission.
    engine.add_request("hit0", prompt[:26] + [1], SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("hit1", prompt[:25] + [2], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    engine.abort("hit0")
    for _ in range(3):
        engine.step()
    engine.add_request("waiting", prompt, SamplingParams(max_tokens=2, **GREEDY))
    engine.abort("hit1")
    engine.abort("waiting")
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.stats.host_hits >= 2 * 24
    assert not kv.request_ids() and sum(kv.pool.ref_counts) == 0
    _assert_host_settled(engine)


def test_a_snapshot_bundle_is_whole_or_gone():
    tier = HostTier(5)
    a, b, c = (bytes([i]) * 32 for i in range(3))
    sa = tier.store(a)
    snap = tier.store_bundle(state_keys(a, 1, 3))
    assert len(snap) == 3 and tier.bundle(state_keys(a, 1, 3)) == snap
    assert tier.store_bundle(state_keys(a, 1, 3)) is None  # held: nothing to copy
    assert tier.bundle(state_keys(a, 2, 3)) is None  # another group's: not held
    assert tier.store_bundle(state_keys(b, 1, 7)) is None  # more than the host: dropped
    tier.store(b)
    tier.touch([sa])  # the bundle is now least recently used: one store evicts all of it
    assert tier.store(c) in snap
    assert tier.bundle(state_keys(a, 1, 3)) is None and tier.slot_of(a) == sa
    assert tier.stats.evicted_blocks == 3 and tier.num_used_slots == 3
    # A pinned bundle (a load in flight) stays whole.
    snap = tier.store_bundle(state_keys(b, 1, 3))
    tier.pin(snap)
    assert tier.store_bundle(state_keys(c, 1, 3)) is None  # room for 2 only
    tier.unpin(snap)
    assert tier.bundle(state_keys(b, 1, 3)) == snap


def test_attention_layers_outnumbering_the_states():
    """Two attention layers beside one Mamba-2 layer fill two attention groups (one layer a
    group): a host block of each group goes and comes back with its node, and a prefix evicted
    from the device gives the tokens and logprobs of the engine without the host tier."""
    from jaxinfer.model.config import config_from_dict
    from jaxinfer.model.transformer import init_params
    cfg = config_from_dict({
        "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 3,
        "layer_types": ["attention", "mamba", "attention"], "mamba_n_heads": 2,
        "mamba_expand": 1, "mamba_n_groups": 1, "mamba_d_state": 2, "mamba_chunk_size": 8,
        "num_local_experts": 0, "shared_intermediate_size": 16,
        "position_embedding_type": "nope", "torch_dtype": "float32"})
    params = init_params(cfg, jax.random.key(0), jnp.float32, std=0.3)
    rng = np.random.default_rng(2)
    prompt, other = rng.integers(0, 64, 29).tolist(), rng.integers(0, 64, 20).tolist()
    outputs = {}
    for offload in (False, True):
        args = hybrid_args(Path("tiny"), 24, block_size=BLOCK, max_model_len=40,
                           enable_prefix_caching=True, kv_offload=offload, kv_host_gib=1e-3)
        engine = LLMEngine(cfg, params, None, args, num_blocks=24)
        assert engine.scheduler.kv.groups.num_groups == 3
        outputs[offload] = [_run(engine, rid, p, 4) for rid, p in
                            (("first", prompt), ("other", other), ("again", prompt))]
    assert outputs[True][2][2] == 28 and outputs[False][2][2] == 0
    for (tokens, logprobs, _), (want_tokens, want_logprobs, _) in zip(*outputs.values()):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)
    _assert_host_settled(engine)
