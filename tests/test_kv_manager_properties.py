"""Property test of KVCacheManager: random interleavings of admission with prefix match, append,
speculative append with rollback, fork, append-after-fork (copy-on-write), free, prefix-cache
reset and eviction under pressure.

A simulated device (one row of token ids per block) plays the runner: it performs the pending
copy-on-write copies, then writes each new token at its slot. So besides the bookkeeping invariants
(no leak, no double free, free + used == total, ref counts == holders) every request must read back
exactly its own tokens through its block table, and every cached block must hold its key: a wrong
prefix hit, a missed copy or an evicted-while-referenced block shows up as wrong content.
"""

import math
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from jaxinfer.core.kv_cache import KVCacheManager

# Two token values make shared prefixes (and so cache hits, duplicates and evictions) common.
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=14)


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 20), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.num_blocks, self.bs, self.caching = num_blocks, block_size, caching
        self.device = np.full((num_blocks, block_size), -1)
        self.tokens: dict[int, list[int]] = {}  # live request -> tokens whose KV is written
        self.next_id = 0
        self.evicted_referenced = []
        pool = self.mgr.pool
        if pool.on_evict is not None:  # record that no referenced block is ever evicted
            inner = pool.on_evict

            def on_evict(b):
                if pool.ref_counts[b] != 0:
                    self.evicted_referenced.append(b)
                inner(b)
            pool.on_evict = on_evict

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _run_step(self, rid, start, new_tokens):
        """The runner: pending copies first (all reads before writes), then the KV writes."""
        copies = self.mgr.take_pending_copies()
        if copies:
            src, dst = (list(x) for x in zip(*copies))
            assert len(set(dst)) == len(dst)
            self.device[dst] = self.device[src]
        blocks = self.mgr.get_block_ids(rid)
        for i, t in enumerate(new_tokens):
            p = start + i
            self.device[blocks[p // self.bs], p % self.bs] = t

    def _read(self, rid, n):
        blocks = self.mgr.get_block_ids(rid)
        return [int(self.device[blocks[p // self.bs], p % self.bs]) for p in range(n)]

    @rule(prompt=TOKENS)
    def add_request(self, prompt):
        rid = self._new_id()
        free_before = self.mgr.num_free_blocks
        n = self.mgr.get_computed_blocks(rid, prompt)
        assert n % self.bs == 0 and 0 <= n < len(prompt)
        if not self.caching:
            assert n == 0
        assert self._read(rid, n) == prompt[:n]  # a hit is whole blocks of exactly these tokens
        if self.mgr.allocate_slots(rid, len(prompt) - n):
            self._run_step(rid, n, prompt[n:])
            self.tokens[rid] = list(prompt)
            self.mgr.cache_blocks(rid, prompt, len(prompt))
        else:
            assert self.mgr.free(rid)
            assert self.mgr.num_free_blocks == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=TOKENS)
    def append(self, data, new):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = (list(self.mgr.get_block_ids(rid)), self.mgr.num_free_blocks, self.mgr.num_tokens(rid))
        if self.mgr.allocate_slots(rid, len(new)):
            self._run_step(rid, len(self.tokens[rid]), new)
            self.tokens[rid] += new
            self.mgr.cache_blocks(rid, self.tokens[rid], len(self.tokens[rid]))
        else:  # out of blocks: nothing may have changed
            after = (list(self.mgr.get_block_ids(rid)), self.mgr.num_free_blocks,
                     self.mgr.num_tokens(rid))
            assert after == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), accepted=TOKENS, rejected=st.integers(1, 6))
    def speculative_append(self, data, accepted, rejected):
        """A verification step writes KV for the accepted tokens and for `rejected` proposals
        (token 7, never a real token) past them; the rejected slots are then given back. A cached
        block holding a 7 would fail the cached-content invariant."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        known = len(self.tokens[rid])
        free_before = self.mgr.num_free_blocks
        if not self.mgr.allocate_slots(rid, len(accepted) + rejected):
            return
        self._run_step(rid, known, accepted + [7] * rejected)
        self.mgr.truncate(rid, known + len(accepted))
        self.tokens[rid] += accepted
        assert self.mgr.num_free_blocks >= free_before - math.ceil(
            (len(accepted) + self.bs) / self.bs)  # the rejected slots' surplus blocks came back
        self.mgr.cache_blocks(rid, self.tokens[rid], len(self.tokens[rid]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        free_before = self.mgr.num_free_blocks
        self.mgr.fork(parent, child)
        assert self.mgr.num_free_blocks == free_before  # sharing costs no block
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        assert self.mgr.free(rid)
        assert not self.mgr.free(rid)  # a second free of the same request is a no-op
        del self.tokens[rid]

    @rule()
    def reset_prefix_cache(self):
        self.mgr.reset_prefix_cache()
        assert self.mgr.num_cached_blocks == 0

    @invariant()
    def consistent(self):
        mgr, pool = self.mgr, self.mgr.pool
        assert not self.evicted_referenced
        assert set(mgr.request_ids()) == set(self.tokens)
        holders = Counter()
        for rid, toks in self.tokens.items():
            blocks = mgr.get_block_ids(rid)
            assert len(blocks) == math.ceil(len(toks) / self.bs)
            assert len(set(blocks)) == len(blocks)
            assert mgr.num_tokens(rid) == len(toks)
            assert self._read(rid, len(toks)) == toks
            holders.update(blocks)
        free, evictable = pool.free_block_ids(), pool.evictable_block_ids()
        assert len(set(free)) == len(free) and len(set(evictable)) == len(evictable)  # no double free
        assert not (set(free) & set(evictable)) and not (set(free) | set(evictable)) & set(holders)
        assert len(free) + len(evictable) + len(holders) == self.num_blocks  # no leak
        assert mgr.num_free_blocks + pool.num_used_blocks == self.num_blocks
        assert mgr.usage == len(holders) / self.num_blocks
        assert [pool.ref_counts[b] for b in range(self.num_blocks)] == [
            holders[b] for b in range(self.num_blocks)]
        cached = {b for b in range(self.num_blocks) if pool.is_cached(b)}
        if not self.caching:
            assert not cached and not evictable
            return
        assert set(evictable) == {b for b in cached if holders[b] == 0}
        order = {b: i for i, b in enumerate(evictable)}
        for b in cached:
            node = mgr.cache_node_of(b)
            assert node is not None and node.block_id == b
            assert [int(t) for t in self.device[b]] == list(node.key)  # cached KV is the key's
            parent = node.parent
            if parent.block_id >= 0:
                assert parent.children[node.key] is node
                if holders[b]:  # every holder of a cached block holds its cached parent
                    assert holders[parent.block_id] >= holders[b]
                if b in order and parent.block_id in order:  # leaves leave the LRU first
                    assert order[b] < order[parent.block_id]
        assert mgr.num_cached_blocks == len(cached)

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.tokens):
            self.mgr.free(rid)
        assert self.mgr.num_free_blocks == self.num_blocks  # a released tree frees the whole pool
        assert self.mgr.usage == 0.0
        assert not any(self.mgr.pool.ref_counts)
        self.mgr.reset_prefix_cache()
        assert sorted(self.mgr.pool.free_block_ids()) == list(range(self.num_blocks))


def test_manager_random_interleavings():
    run_state_machine_as_test(
        ManagerMachine,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]))
