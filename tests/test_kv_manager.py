"""KVCacheManager scenarios: copy-on-write after fork, prefix cache hits and LRU leaf-first eviction,
out-of-blocks behaviour, deduplication, reset, and the disabled cache."""

import pytest

from jaxinfer.core.kv_cache import BlockPool, KVCacheManager, OutOfBlocksError

BS = 4


def admit(mgr, rid, tokens, cache=True):
    """Scheduler + runner for one prefill: match, allocate the rest, then cache what was computed."""
    hit = mgr.get_computed_blocks(rid, tokens)
    assert mgr.allocate_slots(rid, len(tokens) - hit)
    if cache:
        mgr.cache_blocks(rid, tokens, len(tokens))
    return hit


# ---- copy-on-write -------------------------------------------------------------------------
def test_fork_shares_blocks_and_child_append_copies_only_the_partial_last_block():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, "p", list(range(6)))  # blocks: one full, one with 2 of 4 tokens
    parent_blocks = list(mgr.get_block_ids("p"))
    free_before = mgr.num_free_blocks
    mgr.fork("p", "c")
    assert mgr.get_block_ids("c") == parent_blocks
    assert mgr.num_free_blocks == free_before  # sharing, not copying
    assert [mgr.pool.ref_counts[b] for b in parent_blocks] == [2, 2]

    assert mgr.allocate_slots("c", 1)
    child_blocks = mgr.get_block_ids("c")
    assert child_blocks[0] == parent_blocks[0]  # the full block stays shared
    assert child_blocks[1] not in parent_blocks  # the partial one was copied ...
    assert mgr.take_pending_copies() == [(parent_blocks[1], child_blocks[1])]  # ... on the device
    assert mgr.take_pending_copies() == []
    assert mgr.get_block_ids("p") == parent_blocks  # the parent's table is unchanged
    assert [mgr.pool.ref_counts[b] for b in parent_blocks] == [2, 1]

    # The parent now owns its last block alone: it appends in place, no copy.
    assert mgr.allocate_slots("p", 1)
    assert mgr.get_block_ids("p") == parent_blocks and mgr.take_pending_copies() == []


def test_fork_at_block_boundary_needs_no_copy():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, "p", list(range(8)))
    mgr.fork("p", "c")
    assert mgr.allocate_slots("c", 1)
    assert mgr.get_block_ids("c")[:2] == mgr.get_block_ids("p")
    assert len(mgr.get_block_ids("c")) == 3 and mgr.take_pending_copies() == []


def test_copy_of_a_copy_reads_the_original_source():
    """Copies run together, reading before writing, so a chained copy must name the first source."""
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, "p", [1, 2])
    (x,) = mgr.get_block_ids("p")
    mgr.fork("p", "c1")
    assert mgr.allocate_slots("c1", 1)
    (y,) = mgr.get_block_ids("c1")
    mgr.fork("c1", "c2")
    assert mgr.allocate_slots("c2", 1)
    (z,) = mgr.get_block_ids("c2")
    assert sorted(mgr.take_pending_copies()) == sorted([(x, y), (x, z)])


def test_copy_into_a_block_freed_before_the_step_is_dropped():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, "p", [1, 2])
    mgr.fork("p", "c")
    assert mgr.allocate_slots("c", 1)
    mgr.free("c")  # e.g. aborted before the runner ran: its block may be reused at once
    assert mgr.take_pending_copies() == []


# ---- out of blocks -------------------------------------------------------------------------
def test_out_of_blocks_returns_false_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    admit(mgr, "a", list(range(10)))  # 3 blocks
    state = (list(mgr.get_block_ids("a")), mgr.num_tokens("a"), mgr.num_free_blocks)
    assert not mgr.allocate_slots("a", 3)  # needs a 4th block
    assert (list(mgr.get_block_ids("a")), mgr.num_tokens("a"), mgr.num_free_blocks) == state
    assert mgr.allocate_slots("a", 2)  # still fits in the last block
    assert not mgr.allocate_slots("new", 1)
    assert not mgr.has_request("new")  # a failed first allocation leaves no registration


def test_copy_on_write_counts_toward_the_blocks_needed():
    mgr = KVCacheManager(num_blocks=1, block_size=BS)
    admit(mgr, "p", [1, 2])
    mgr.fork("p", "c")
    assert not mgr.allocate_slots("c", 1)  # the copy needs a block and there is none
    assert mgr.get_block_ids("c") == mgr.get_block_ids("p") and mgr.take_pending_copies() == []


def test_pool_raises_out_of_blocks_error_atomically():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(OutOfBlocksError, match="2 needed, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    with pytest.raises(RuntimeError, match="released twice"):
        pool.decref(1)


def test_free_is_idempotent_and_returns_every_block():
    mgr = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    admit(mgr, "a", list(range(9)))
    mgr.fork("a", "b")
    assert mgr.usage == 0.5
    assert mgr.free("a") and mgr.free("b") and not mgr.free("b")
    assert mgr.num_free_blocks == 6 and mgr.usage == 0.0


# ---- prefix cache --------------------------------------------------------------------------
SYSTEM = list(range(100, 110))  # 10 tokens: two whole blocks and two tokens of a third


def test_shared_system_prompt_hits_whole_blocks_only():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    assert admit(mgr, "a", SYSTEM + [1, 2, 3]) == 0
    assert admit(mgr, "b", SYSTEM + [7, 8]) == 8  # 10 shared tokens, 2 whole blocks
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert mgr.get_block_ids("b")[2] != mgr.get_block_ids("a")[2]
    assert (mgr.stats.queries, mgr.stats.hits, mgr.stats.requests) == (25, 8, 2)
    assert mgr.stats.hit_rate == 8 / 25


def test_fully_cached_prompt_still_leaves_a_token_to_compute():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    admit(mgr, "a", list(range(8)))
    assert admit(mgr, "b", list(range(8))) == 4  # not 8: the last token must be computed
    assert admit(mgr, "c", list(range(9))) == 8


def test_blocks_are_cached_only_once_computed():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(12))
    assert mgr.get_computed_blocks("a", tokens) == 0
    assert mgr.allocate_slots("a", 12)
    assert mgr.get_computed_blocks("b", tokens) == 0  # scheduled, not yet computed: no hit
    assert mgr.cache_blocks("a", tokens, 6) == 1  # one full block computed so far
    assert mgr.get_computed_blocks("c", tokens) == 4
    assert mgr.cache_blocks("a", tokens, 12) == 2
    assert mgr.cache_blocks("a", tokens, 12) == 0


def test_concurrent_duplicates_are_deduplicated():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(9))
    for rid in ("a", "b"):  # both admitted before either was computed
        assert mgr.get_computed_blocks(rid, tokens) == 0 and mgr.allocate_slots(rid, 9)
    a_blocks, b_blocks = list(mgr.get_block_ids("a")), list(mgr.get_block_ids("b"))
    free_before = mgr.num_free_blocks
    mgr.cache_blocks("a", tokens, 9)
    assert mgr.cache_blocks("b", tokens, 9) == 2
    assert mgr.get_block_ids("b") == a_blocks[:2] + b_blocks[2:]  # b now reads a's full blocks
    assert mgr.num_free_blocks == free_before + 2  # and its two copies are free again


def test_eviction_is_lru_leaf_first_and_spares_referenced_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, "old", [1] * 12)  # chain o0 -> o1 -> o2
    admit(mgr, "new", [2] * 12)  # chain n0 -> n1 -> n2
    admit(mgr, "held", [3] * 8)  # stays referenced
    old, new, held = (list(mgr.get_block_ids(r)) for r in ("old", "new", "held"))
    mgr.free("old")
    mgr.free("new")
    assert mgr.num_free_blocks == 6 and mgr.num_cached_blocks == 8  # freed but still cached
    assert mgr.pool.evictable_block_ids() == old[::-1] + new[::-1]  # leaves first, LRU chain first

    assert mgr.allocate_slots("x", 4 * 4)  # 4 blocks: the whole old chain (leaf first), then n2
    assert mgr.get_block_ids("x") == [old[2], old[1], old[0], new[2]]
    assert not set(mgr.get_block_ids("x")) & set(held)
    mgr.free("x")
    assert admit(mgr, "again", [2] * 12) == 8  # the newer chain's surviving prefix still hits
    assert admit(mgr, "held2", [3] * 8) == 4


def test_prefix_hit_on_an_evictable_block_protects_it_from_eviction():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, "a", [5] * 8)
    mgr.free("a")
    assert mgr.num_free_blocks == 4
    assert mgr.get_computed_blocks("b", [5] * 8) == 4  # takes the first block back
    assert mgr.num_free_blocks == 3
    assert mgr.allocate_slots("c", 12)  # evicts everything else ...
    assert not mgr.allocate_slots("d", 1)  # ... but never b's block
    assert mgr.get_block_ids("b")[0] not in mgr.get_block_ids("c")


def test_disabled_prefix_cache_never_hits_and_frees_to_the_free_list():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    assert admit(mgr, "a", SYSTEM) == 0
    assert mgr.cache_blocks("a", SYSTEM, len(SYSTEM)) == 0
    assert admit(mgr, "b", SYSTEM) == 0
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_cached_blocks == 0 and mgr.pool.evictable_block_ids() == []
    assert (mgr.stats.queries, mgr.stats.hits) == (0, 0)
    assert mgr.reset_prefix_cache() == 0


def test_reset_prefix_cache_frees_unreferenced_and_keeps_held_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, "a", [1] * 8)
    admit(mgr, "b", [2] * 8)
    held = list(mgr.get_block_ids("b"))
    mgr.free("a")
    assert mgr.reset_prefix_cache() == 2
    assert mgr.num_cached_blocks == 0 and mgr.get_block_ids("b") == held
    assert admit(mgr, "c", [2] * 8) == 0  # nothing cached any more
    assert mgr.cache_blocks("b", [2] * 9, 8) == 0  # live requests insert nothing after a reset
    mgr.free("b")
    mgr.free("c")
    mgr.reset_prefix_cache()
    assert sorted(mgr.pool.free_block_ids()) == list(range(8))


def test_block_zero_is_an_ordinary_block():
    mgr = KVCacheManager(num_blocks=2, block_size=BS)
    assert mgr.allocate_slots("a", 8)
    assert sorted(mgr.get_block_ids("a")) == [0, 1]


def test_bad_calls_name_the_problem():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="already registered"):
        mgr.get_computed_blocks("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots("a", -1)
    with pytest.raises(KeyError, match="unknown parent"):
        mgr.fork("nope", "b")
    with pytest.raises(ValueError, match="already exists"):
        mgr.fork("a", "a")
    with pytest.raises(ValueError, match="num_computed_tokens=8 exceeds"):
        mgr.cache_blocks("a", list(range(8)), 8)
