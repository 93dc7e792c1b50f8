"""KV groups (the hybrid allocator's bookkeeping, host side only): layers grouped by window, a
windowed group's blocks released as a sequence grows, prefix matches that resume only where every
group still has the blocks a query there sees, and no block leaked by aborts, forks or evictions.
The engine runs of the windowed families are in test_windowed_families.py."""

from __future__ import annotations

import pytest

from jaxinfer.core.kv_cache import KVCacheGroups, KVCacheManager
from jaxinfer.core.kv_cache.manager import SKIPPED_BLOCK

BS = 4


def gemma3_27b_windows() -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]


def test_groups_split_kinds_into_equal_slots():
    g = KVCacheGroups.from_layer_windows(gemma3_27b_windows())
    assert g.num_slots == 10 and g.windows == (None,) + (1024,) * 6
    # every (slot, group) pair is one layer's: layers of a slot never share a group
    assert len(set(zip(g.layer_slot, g.layer_group))) == 62
    assert all(g.layer_group[i] == 0 for i in range(5, 62, 6))
    assert KVCacheGroups.from_layer_windows([None] * 4) == KVCacheGroups.full_attention(4)
    mixed = KVCacheGroups.from_layer_windows([8, 16, None, 8])
    assert mixed.windows == (None, 8, 8, 16) and mixed.num_slots == 1
    with pytest.raises(ValueError, match="window 0"):
        KVCacheGroups.from_layer_windows([0, None])


def test_a_32k_sequence_holds_a_fifth_of_the_all_global_pages():
    g = KVCacheGroups.from_layer_windows(gemma3_27b_windows())
    hybrid = g.tokens_held(32768, 16) * g.num_slots
    assert hybrid / (32768 * 62) < 0.2


def manager(num_blocks: int, windows=(8, None, 8), **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=KVCacheGroups.from_layer_windows(windows), **kw)


def held_per_group(mgr, rid) -> list[int]:
    return [sum(b != SKIPPED_BLOCK or i >= k for i, b in enumerate(t))
            for t, k in zip(mgr.get_block_tables(rid), mgr._requests[rid].skipped)]


def test_windowed_blocks_are_released_as_the_sequence_grows():
    # groups: full, window 8, window 8 (one layer each). 40 tokens = 10 blocks per group: the
    # all-global layout would need 30 blocks; 16 fit because the windowed groups keep ~3 each.
    mgr = manager(16)
    assert mgr.allocate_slots("a", 8)
    for _ in range(32):
        assert mgr.allocate_slots("a", 1)
    assert mgr.num_tokens("a") == 40
    full, w1, w2 = mgr.get_block_tables("a")
    assert len(full) == len(w1) == 10 and SKIPPED_BLOCK not in full[1:]
    # the last query appended was at 39; the next starts at 39: sees keys 32..39 -> blocks 8, 9
    # (the skip runs before each new block, so block 7 is still held from the step at 36)
    assert mgr._requests["a"].skipped[1:] == [7, 7]
    assert mgr.num_held_blocks("a") == 10 + 3 + 3
    assert mgr.pool.num_free_blocks == 0
    mgr.free("a")
    assert mgr.pool.num_free_blocks == 16


def test_the_pool_refuses_without_changing_tables():
    mgr = manager(5)
    assert mgr.allocate_slots("a", 4)        # one block per group
    assert not mgr.allocate_slots("a", 4)    # 3 more needed, 2 free
    assert mgr.num_tokens("a") == 4 and mgr.num_held_blocks("a") == 3


def run_prompt(mgr, rid, tokens, chunk=4):
    """Prefill `tokens` in chunks, caching after each as the scheduler does."""
    n = mgr.get_computed_blocks(rid, tokens)
    while n < len(tokens):
        k = min(chunk, len(tokens) - n)
        assert mgr.allocate_slots(rid, k)
        n += k
        mgr.cache_blocks(rid, tokens, n)
    return n


def test_a_hit_past_the_window_resumes_where_the_window_blocks_are_cached():
    mgr = manager(64)
    prompt = list(range(100, 132))  # 8 blocks
    run_prompt(mgr, "a", prompt)
    mgr.free("a")
    # skipped-then-released blocks stayed cached (evictable): the whole prompt but its last
    # block (one token is always computed) is a hit, windowed groups only hold their window
    assert mgr.get_computed_blocks("b", prompt + [7]) == 32
    tables = mgr.get_block_tables("b")
    assert mgr._requests["b"].skipped == [0, 6, 6]  # a query at 32 sees keys 25.. -> block 6
    assert tables[1][:6] == [SKIPPED_BLOCK] * 6 and len(tables[1]) == 8
    mgr.free("b")

    # Evict window group 1's block 6: resuming at block 8 needs it, so the walk from the right
    # stops at 6 (a query at 24 sees keys 17.. -> blocks 4, 5, both cached).
    node = mgr.prefix_cache.match(prompt, 8)[1]
    victim = node.parent.block_ids[1]
    mgr.pool._evictable.move_to_end(victim, last=False)
    mgr.pool.allocate(len(mgr.pool.free_block_ids()) + 1)
    assert mgr.cache_node_of(victim) is None
    assert mgr.get_computed_blocks("c", prompt + [7]) == 24
    assert mgr.stats.hits == 32 + 24
    mgr.free("c")


def test_evicting_a_full_block_drops_the_windowed_blocks_under_it():
    mgr = manager(64)
    prompt = list(range(200, 216))
    run_prompt(mgr, "a", prompt)
    last = [t[3] for t in mgr.get_block_tables("a")]
    mgr.free("a")
    assert mgr.num_cached_blocks == 4 * 3
    # the windowed groups' first block left their window first (the LRU head); then the last
    # block, full group first. Evicting the full group's makes its node unmatchable: the windowed
    # blocks there go uncached to the free list with it.
    order = mgr.pool.evictable_block_ids()
    assert order.index(last[0]) == 2
    mgr.pool.allocate(len(mgr.pool.free_block_ids()) + 3)
    assert mgr.num_cached_blocks == 12 - 3 - 2
    assert all(mgr.cache_node_of(b) is None for b in last)
    assert set(last[1:]) <= set(mgr.pool.free_block_ids())
    assert mgr.get_computed_blocks("b", prompt) == 12


def test_forks_truncates_and_aborts_leak_nothing():
    mgr = manager(40)
    prompt = list(range(300, 318))
    run_prompt(mgr, "p", prompt, chunk=5)
    mgr.fork("p", "c1")
    mgr.fork("p", "c2")
    for rid in ("p", "c1", "c2"):  # copy-on-write of each group's shared partial last block
        assert mgr.allocate_slots(rid, 3)
    copies = mgr.take_pending_copies()
    assert len(copies) == 2 * 3  # two of the three sharers copy, in every group
    mgr.truncate("c1", 19)
    for rid in ("p", "c1", "c2"):
        for _ in range(9):
            assert mgr.allocate_slots(rid, 1)
    assert all(held <= 4 for held in held_per_group(mgr, "c2")[1:])
    for rid in ("p", "c1", "c2"):
        mgr.free(rid)
    assert mgr.pool.num_used_blocks == 0
    assert mgr.pool.num_free_blocks == 40
    mgr.reset_prefix_cache()
    assert len(mgr.pool.free_block_ids()) == 40


def test_every_layer_windowed_mistral_style():
    mgr = manager(12, windows=(8, 8))  # one group, two cache arrays
    assert mgr.groups.windows == (8,) and mgr.groups.num_slots == 2
    prompt = list(range(400, 440))  # 10 blocks through a 12-block pool
    run_prompt(mgr, "a", prompt)
    assert mgr.num_held_blocks("a") <= 4
    mgr.free("a")
    assert mgr.get_computed_blocks("b", prompt + [1]) == 40  # the window's blocks are cached
    assert mgr.num_held_blocks("b") == 2  # a query at 40 sees keys 33.. -> blocks 8, 9
    mgr.free("b")
    mgr.pool.allocate(12)  # evicts everything: nodes without blocks or children are pruned
    assert mgr.num_cached_blocks == 0 and not mgr.prefix_cache.root.children


def test_slots_reserved_ahead_keep_the_blocks_of_the_first_querys_chunk():
    """A decode loop reserves slots for its later steps before its first step runs: the blocks
    that step's query reads (its attention chunk) stay held, and go once a later reservation's
    first query is past them."""
    from jaxinfer.model.kv_specs import ChunkedLocalAttentionSpec, FullAttentionSpec
    groups = KVCacheGroups.from_layer_specs([FullAttentionSpec(1, 8),
                                             ChunkedLocalAttentionSpec(1, 8, attention_chunk=8)])
    mgr = KVCacheManager(16, BS, groups=groups)
    assert mgr.allocate_slots("a", 8)  # tokens 0..7: the first chunk, blocks 0 and 1
    # the loop's first query is at 7 (still chunk 0); slots for 8..11 are reserved with it
    assert mgr.allocate_slots("a", 4, first_query_pos=7)
    assert SKIPPED_BLOCK not in mgr.get_block_tables("a")[1]
    assert mgr.allocate_slots("a", 4, first_query_pos=12)  # the next loop starts in chunk 1
    assert mgr.get_block_tables("a")[1][:2] == [SKIPPED_BLOCK] * 2
    mgr.free("a")
    assert mgr.pool.num_free_blocks == 16
