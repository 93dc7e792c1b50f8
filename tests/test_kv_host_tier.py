"""The host KV tier (--kv-offload): the host pool's LRU and pins, chained digests (a host block
is never served for another prefix), the store's copies (a block's offload reads it before a
donated overwrite; fp8 bytes round-trip), and the engine: greedy tokens with offload = without on
a pool so small that every turn's prefix goes through the host, sleep keeping host copies, and an
abort while a copy is in flight leaking nothing."""

from __future__ import annotations

import time
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.core.kv_cache import KVCacheManager
from jaxinfer.core.kv_cache.host_tier import HostTier, block_digest, root_digest
from jaxinfer.core.kv_cache.kv_groups import KVCacheGroups
from jaxinfer.model.kv_specs import MLAAttentionSpec
from jaxinfer.core.kv_loads import KVTransfers
from jaxinfer.engine.kv_tier import GIB, host_tier_for
from jaxinfer.errors import ConfigError
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.kv import copy_blocks
from jaxinfer.worker.kv.host_store import HostKVStore
from test_engine_support import assert_all_free, make_engine, prompt_ids, run_all

BS = 4


def _digests(tokens, n, namespace=None):
    d, out = root_digest(namespace), []
    for i in range(n):
        d = block_digest(d, tokens[i * BS:(i + 1) * BS])
        out.append(d)
    return out


# ---- bookkeeping ----------------------------------------------------------------------------
def test_host_lru_evicts_least_recently_used_and_never_a_pinned_slot():
    tier = HostTier(3)
    a, b, c, d, e = (bytes([i]) * 32 for i in range(5))
    sa, sb, sc = tier.store(a), tier.store(b), tier.store(c)
    assert tier.store(a) is None  # already held: no copy, now most recent
    assert tier.lru_slots() == [sb, sc, sa]
    tier.pin([sb])
    assert tier.store(d) == sc  # b is pinned: c is the least recently used unpinned
    assert tier.slot_of(c) is None and tier.slot_of(b) == sb
    tier.pin([sa])
    tier.pin([sc])  # (d's slot)
    assert tier.store(e) is None  # every slot pinned: dropped
    tier.unpin([sa, sb, sc])
    assert tier.stats.evicted_blocks == 1
    tier.clear()
    assert tier.num_used_slots == 0 and len(tier._free) == 3


def test_host_lru_evicts_a_slot_with_its_piece_but_not_a_pinned_sibling():
    tier = HostTier(4)
    a, b, c, d, e, f, g = (bytes([i]) * 32 for i in range(7))
    sa, sb, sc, sd = map(tier.store, (a, b, c, d))
    tier.group([sa, sb])  # one host array: evicted together
    assert tier.store(e) == sa  # a is the LRU victim; b goes with it (to the free list)
    assert tier.slot_of(b) is None and tier.store(f) == sb
    assert tier.stats.evicted_blocks == 2
    tier.group([sc, sd])
    tier.pin([sd])  # a load in flight from d: it stays
    assert tier.store(g) == sc and tier.slot_of(d) == sd
    tier.unpin([sd])
    assert tier.lru_slots()[-1] == sd and tier.num_used_slots == 4


def test_offload_takes_one_kv_group_and_any_page():
    cache = SimpleNamespace(kv_offload=True, kv_host_gib=1.0, block_size=BS)
    windowed = KVCacheGroups.from_layer_windows([None, 8])
    gemma = SimpleNamespace(architecture="Gemma3ForCausalLM", mla=None)
    # (from_engine_args turns --hybrid-kv-cache off first: tests/test_kv_copies.py)
    with pytest.raises(ConfigError, match="--kv-offload.*--no-hybrid-kv-cache"):
        host_tier_for(gemma, cache, jnp.bfloat16, windowed)
    with pytest.raises(ValueError, match="one KV group"):
        KVCacheManager(8, BS, groups=windowed, host_tier=HostTier(4))
    deepseek = SimpleNamespace(architecture="DeepseekV3ForCausalLM")
    latent = KVCacheGroups.full_attention(2, MLAAttentionSpec(576, 512))
    assert host_tier_for(deepseek, cache, jnp.bfloat16, latent).num_slots == (
        GIB // latent.page_bytes(BS, jnp.bfloat16))


def test_host_block_is_never_served_for_another_prefix():
    mgr = KVCacheManager(4, BS, host_tier=HostTier(8))
    x = [9, 9, 9, 9]
    p_a, p_b, p_c = [1, 2, 3, 4] + x + [7], [5, 6, 7, 8] + x + [7], [0, 0, 0, 0] + x + [7]
    for rid, p in (("a", p_a), ("b", p_b)):  # compute, cache, free: both prefixes evictable
        mgr.get_computed_blocks(rid, p)
        assert mgr.allocate_slots(rid, len(p))
        mgr.cache_blocks(rid, p, len(p))
        mgr.free(rid)
    # Written through to the host as each request released them (one run each).
    assert [len(run) for run in mgr.take_pending_offloads()] == [2, 2]
    assert mgr.allocate_slots("filler", 4 * BS)  # evicts all four cached blocks: no copy now
    assert mgr.take_pending_offloads() == []
    mgr.free("filler")
    # Same second block under another first block: no hit at all.
    assert mgr.get_computed_blocks("c", p_c) == 0 and mgr.match_host("c", p_c) == []
    assert mgr.get_computed_blocks("a2", p_a) == 0
    loads = mgr.match_host("a2", p_a)
    slots = [mgr.host.slot_of(d) for d in _digests(p_a, 2)]
    assert [s for s, _ in loads] == slots
    # Under another namespace (LoRA adapter) the same tokens do not match either.
    mgr.loaded([s for s, _ in loads])
    assert mgr.host.match(root_digest("adapter"), p_a, 0, 2, BS) == []


def test_release_writes_the_prefix_through_head_evicted_last_and_retries_count_once():
    # (the host holds twice the device pool: write-through; smaller, at eviction: below)
    mgr = KVCacheManager(8, BS, host_tier=HostTier(16))
    p = list(range(1, 3 * BS + 2))  # three full blocks and one token
    mgr.get_computed_blocks("a", p)
    assert mgr.allocate_slots("a", len(p))
    mgr.cache_blocks("a", p, len(p))
    table = list(mgr.get_block_ids("a"))
    mgr.free("a")
    # One run, last block first; the host's LRU then evicts the tail before the head.
    digests = _digests(p, 3)
    (run,) = mgr.take_pending_offloads()
    assert run == [(table[i], mgr.host.slot_of(digests[i])) for i in (2, 1, 0)]
    assert mgr.host.lru_slots() == [s for _, s in run]
    # A host match touches the blocks last first too (their order in the LRU stays head last).
    mgr.host.match(root_digest(), p, 0, 3, BS)
    assert mgr.host.lru_slots() == [s for _, s in run]
    # Freed again (a second request over the same prefix): nothing new to copy.
    mgr.get_computed_blocks("b", p)
    mgr.free("b")
    assert mgr.take_pending_offloads() == []
    # An admission that found no room and gave its prefix back counts no query.
    before = (mgr.stats.queries, mgr.stats.hits, mgr.stats.requests)
    assert mgr.get_computed_blocks("c", p) == 3 * BS
    mgr.free("c", admitted=False)
    assert (mgr.stats.queries, mgr.stats.hits, mgr.stats.requests) == before
    # A host smaller than twice the device pool gets blocks at eviction only, one run a step.
    small = KVCacheManager(4, BS, host_tier=HostTier(7))
    small.get_computed_blocks("a", p)
    assert small.allocate_slots("a", len(p))
    small.cache_blocks("a", p, len(p))
    small.free("a")
    assert small.take_pending_offloads() == []
    assert small.allocate_slots("filler", 4 * BS)
    assert [len(run) for run in small.take_pending_offloads()] == [3]


def test_a_run_goes_as_power_of_two_pieces_and_a_load_takes_only_its_rows():
    rng = np.random.default_rng(1)
    cache = tuple((jnp.asarray(rng.normal(size=(2, 12, BS, 8)), jnp.float32),
                   jnp.asarray(rng.normal(size=(2, 12, BS, 8)), jnp.float32)) for _ in range(2))
    want = [[np.asarray(k[:, b]) for k, _ in cache] for b in range(12)]
    store = HostKVStore(8, cache)
    # Blocks 1..5 into slots 0..4: pieces of 4 and 1 blocks, one device_put for both.
    cache = store.apply(cache, KVTransfers(offloads=[[(1 + i, i) for i in range(5)]]))
    store.flush()  # (the copier has put both pieces in host memory)
    assert store.host_copies == 2 and len(store.host_arrays()) == 2
    assert sorted(a.shape[0] for a in store.host_arrays()) == [1, 4]
    assert {a.sharding.memory_kind for a in store.host_arrays()} == {store.host_kind}
    # Load slots 3 (row 3 of the 4-piece), 4 (the 1-piece) and 1 into blocks 8, 9, 10.
    untouched = np.asarray(cache[0][0][:, 11])
    cache = store.apply(cache, KVTransfers(loads=[([3, 4, 1], [8, 9, 10])]))
    assert store.bytes_copied_to_device == 5 * store.block_bytes
    assert store.bytes_to_device == 3 * store.block_bytes
    for _ in range(200):  # the timer thread times the step's batched copy once
        if store.copy_seconds:
            break
        time.sleep(0.01)
    assert len(store.copy_seconds) == 1 and store.copy_seconds[0] > 0
    assert store.take_copy_seconds() == store.copy_seconds and store.take_copy_seconds() == []
    for block, src in ((8, 4), (9, 5), (10, 2)):
        for layer, (k, _) in enumerate(cache):
            np.testing.assert_array_equal(np.asarray(k[:, block]), want[src][layer])
    np.testing.assert_array_equal(np.asarray(cache[0][0][:, 11]), untouched)


def test_offload_reads_the_block_before_a_donated_overwrite_and_fp8_round_trips():
    for dtype in (jnp.float32, jnp.float8_e4m3fn):
        rng = np.random.default_rng(0)
        cache = tuple((jnp.asarray(rng.normal(size=(2, 6, BS, 8)), dtype),
                       jnp.asarray(rng.normal(size=(2, 6, BS, 8)), dtype)) for _ in range(2))
        before = [np.asarray(k[:, 1].astype(jnp.float32)) for k, _ in cache]
        store = HostKVStore(4, cache)
        cache = store.apply(cache, KVTransfers(offloads=[[(1, 2)]]))
        # Overwrite block 1 right away (dispatch order: after the gather), cache donated.
        cache = copy_blocks(cache, jnp.array([0], jnp.int32), jnp.array([1], jnp.int32))
        store.flush()
        host = store.slot_array(2)
        assert host.sharding.memory_kind == store.host_kind == "pinned_host"
        got = np.asarray(host.astype(jnp.float32))
        for layer in range(2):
            np.testing.assert_array_equal(got[0, layer, ..., :before[layer].shape[-1]], before[layer])
        cache = store.apply(cache, KVTransfers(loads=[([2], [5])]))
        for layer, (k, _) in enumerate(cache):
            np.testing.assert_array_equal(np.asarray(k[:, 5].astype(jnp.float32)), before[layer])
        assert store.bytes_to_host == store.bytes_to_device == store.block_bytes


# ---- the engine -------------------------------------------------------------------------------
GREEDY = dict(temperature=0.0)


def conversations(engine, nconv=3, turns=3) -> dict:
    """Multi-turn chats: per group (conversation parity) a shared 8-token system prompt; each turn
    appends the last answer and a new 5-token question. Greedy outputs by (chat, turn)."""
    hist = {c: prompt_ids(100 + c % 2, 8) + prompt_ids(200 + c, 3) for c in range(nconv)}
    outs = {}
    for t in range(turns):
        for c in range(nconv):
            engine.add_request(f"c{c}t{t}", hist[c], SamplingParams(max_tokens=4, **GREEDY))
        res = run_all(engine)
        for c in range(nconv):
            outs[(c, t)] = res[f"c{c}t{t}"][0][0]
            hist[c] = hist[c] + outs[(c, t)] + prompt_ids(300 + 10 * c + t, 5)
    return outs


def assert_host_unpinned(engine):
    host = engine.scheduler.kv.host
    assert not any(host._pins)


@pytest.fixture(scope="module")
def without_offload():
    return conversations(make_engine(num_blocks=16))


def test_greedy_tokens_with_offload_equal_without(without_offload):
    # 16 blocks of 4 tokens: one 64-token context. Four chats' prefixes cannot stay on the device.
    engine = make_engine(num_blocks=16, kv_offload=True, kv_host_gib=1e-3)
    assert conversations(engine) == without_offload
    stats, host = engine.scheduler.kv.stats, engine.scheduler.kv.host.stats
    assert stats.host_hits > 0 and host.loaded_blocks == host.hit_blocks > 0
    assert engine.host_kv.bytes_to_device == host.loaded_blocks * engine.host_kv.block_bytes
    assert_all_free(engine)
    assert_host_unpinned(engine)
    # sleep keeps the host copies: after wake, a prompt's prefix comes back from the host.
    engine.sleep()
    engine.wake()
    before = stats.host_hits
    p = prompt_ids(100, 8) + prompt_ids(200, 3)
    engine.add_request("again", p, SamplingParams(max_tokens=4, **GREEDY))
    assert run_all(engine)["again"][0][0] == without_offload[(0, 0)]
    assert stats.host_hits - before == 8
    assert_all_free(engine)


def test_greedy_tokens_exact_through_a_host_evicting_whole_pieces(without_offload):
    # Four host slots of the tiny model's 1 KiB blocks, under a 16-block pool: offloads at
    # eviction only, and the host's LRU evicts pieces while the chats still hit it.
    engine = make_engine(num_blocks=16, kv_offload=True, kv_host_gib=4 * 1024 / 2 ** 30)
    assert engine.scheduler.kv.host.num_slots == 4
    assert conversations(engine) == without_offload
    host = engine.scheduler.kv.host.stats
    assert host.evicted_blocks > 0 and host.loaded_blocks == host.hit_blocks > 0
    assert_all_free(engine)
    assert_host_unpinned(engine)


def test_a_host_hit_runs_in_its_load_step_and_an_abort_right_after_leaks_nothing():
    engine = make_engine(num_blocks=16, kv_offload=True, kv_host_gib=1e-3)
    shared = prompt_ids(100, 12)
    engine.add_request("a", shared + [5], SamplingParams(max_tokens=2, **GREEDY))
    run_all(engine)
    engine.add_request("fill", prompt_ids(7, 60), SamplingParams(max_tokens=1, **GREEDY))
    run_all(engine)  # evicts a's blocks to the host
    loaded = engine.scheduler.kv.host.stats.hit_blocks
    engine.add_request("b", shared + [6], SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("c", shared + [7], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()  # b loads its host blocks and computes its last token in the same step
    seq_b = engine.requests["b"].choices[0]
    assert engine.scheduler.kv.host.stats.hit_blocks > loaded
    assert seq_b.status.value == "running" and seq_b.num_computed == len(shared) + 1
    assert not any(engine.scheduler.kv.host._pins)  # unpinned once the step took its loads
    engine.abort("b")  # (its copy may still be on the device's queue)
    engine.abort("c")
    run_all(engine)
    assert_all_free(engine)
    assert_host_unpinned(engine)
