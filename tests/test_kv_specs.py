"""KV-cache specs (jaxinfer/model/kv_specs.py): each kind's page size, the blocks it frees, the
blocks a prefix match needs, and how the model's layers turn into specs and groups."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxinfer.core.kv_cache import (ChunkedLocalAttentionSpec, FixedStateSpec, FullAttentionSpec,
                                    KVCacheGroups, KVCacheManager, MLAAttentionSpec,
                                    SlidingWindowSpec)
from jaxinfer.model.config import config_from_dict

BS = 4
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
         "vocab_size": 256, "max_position_embeddings": 512}
GEMMA2 = {**LLAMA, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4,
          "head_dim": 16, "sliding_window": 16}


def test_page_bytes_per_kind():
    assert FullAttentionSpec(8, 128).page_bytes(16, jnp.bfloat16) == 16 * 2 * 8 * 128 * 2
    # A window changes which blocks are kept, not a page.
    assert (SlidingWindowSpec(8, 128, sliding_window=4096).page_bytes(16, jnp.bfloat16)
            == FullAttentionSpec(8, 128).page_bytes(16, jnp.bfloat16))
    assert ChunkedLocalAttentionSpec(8, 128, attention_chunk=8192).page_bytes(16, "float8_e4m3fn") \
        == 16 * 2 * 8 * 128
    # DeepSeek: one 576-wide latent per token, no V (half of a K/V pair of that width).
    assert MLAAttentionSpec(576, 512).page_bytes(16, jnp.bfloat16) == 16 * 576 * 2
    # A fixed state is the same bytes whatever the block size; a float32 word takes 6 bytes of a
    # narrower cache (kv_specs.stored_state_bytes).
    assert FixedStateSpec(1 << 20).page_bytes(16, jnp.bfloat16) == 3 << 19
    assert FixedStateSpec(1 << 20).page_bytes(256, jnp.float32) == 1 << 20
    assert FixedStateSpec(1 << 20).state_pages(16, jnp.bfloat16) == 1


def test_what_each_kind_frees():
    full, mla = FullAttentionSpec(2, 8), MLAAttentionSpec(20, 16)
    window = SlidingWindowSpec(2, 8, sliding_window=8)
    chunked = ChunkedLocalAttentionSpec(2, 8, attention_chunk=8)
    state = FixedStateSpec(64)
    for pos in (0, 5, 100):
        assert full.first_needed_block(pos, BS) == mla.first_needed_block(pos, BS) == 0
    # A query at 13 sees keys 6..13: blocks 0 (0-3) is out, block 1 (4-7) still partly in.
    assert window.first_needed_block(13, BS) == 1
    assert window.first_needed_block(7, BS) == 0
    # A query at 13 sees its chunk, keys 8..13: blocks 0 and 1 (the finished chunk) are out.
    assert chunked.first_needed_block(13, BS) == 2
    assert chunked.first_needed_block(8, BS) == 2 and chunked.first_needed_block(7, BS) == 0
    # A state's prefix-cache entries are snapshots: resuming at token 12 (block 3) needs the
    # state after block 2 only.
    assert state.first_needed_block(12, BS) == 2 and state.first_needed_block(0, BS) == 0
    assert [s.keeps_every_block for s in (full, mla, window, chunked, state)] == \
        [True, True, False, False, False]


def test_blocks_for_sequence_per_kind():
    n, chunk = 1000, 64  # 250 blocks of 4 when every block is kept
    assert FullAttentionSpec(1, 1).blocks_for_sequence(n, chunk, BS) == 250
    assert MLAAttentionSpec(2, 1).blocks_for_sequence(n, chunk, BS) == 250
    assert SlidingWindowSpec(1, 1, sliding_window=32).blocks_for_sequence(n, chunk, BS) \
        == (64 + 32) // BS + 1
    assert ChunkedLocalAttentionSpec(1, 1, attention_chunk=32).blocks_for_sequence(n, chunk, BS) \
        == (64 + 32) // BS + 1
    # A fixed state: its pages, whatever the length (alone, its page is the state).
    assert FixedStateSpec(8).blocks_for_sequence(n, chunk, BS) == 1
    beside = FixedStateSpec(100, page_of=FullAttentionSpec(1, 1))  # 2 x 4 x 2 = 16 B a page
    # bfloat16: 25 words of 6 bytes each (kv_specs.stored_state_bytes) over 16-byte pages.
    assert beside.blocks_for_sequence(n, chunk, BS, jnp.bfloat16) == 10
    assert beside.blocks_for_sequence(3, chunk, BS, jnp.float32) == 4
    with pytest.raises(ValueError, match="dtype"):
        beside.blocks_for_sequence(n, chunk, BS)


def _cached_prompt(specs, num_blocks: int = 6):
    """A manager whose prefix cache holds a computed prompt of `num_blocks` full blocks (and one
    token more), released: every block cached and evictable."""
    mgr = KVCacheManager(64, BS, groups=KVCacheGroups.from_layer_specs(specs))
    prompt = list(range(num_blocks * BS)) + [99]
    mgr.get_computed_blocks("a", prompt)
    assert mgr.allocate_slots("a", len(prompt))
    mgr.cache_blocks("a", prompt, num_blocks * BS)
    mgr.free("a")
    return mgr, prompt


def _uncache(mgr, prompt, group: int, blocks) -> None:
    """Take group `group`'s blocks `blocks` of the prompt out of the prefix cache (as if evicted
    or freed before they were cached)."""
    cache, node = mgr.prefix_cache, mgr.prefix_cache.root
    for i in range(len(prompt) // BS):
        node = node.children[tuple(prompt[i * BS:(i + 1) * BS])]
        if i in blocks:
            b = node.block_ids[group]
            del cache._node_of_block[b]
            node.block_ids[group] = -1
            mgr.pool.uncache(b)


FULL = FullAttentionSpec(1, 1)


@pytest.mark.parametrize("specs, missing, resume", [
    # (the layers' specs, blocks of the last group not cached, the blocks a match resumes after)
    ([FULL], [3], 3),  # prefix-closed: the gap at 3 stops it
    # A window of 8 at a resume at block n reads blocks from (4n - 7) // 4 on.
    ([FULL, SlidingWindowSpec(1, 1, sliding_window=8)], [], 6),
    ([FULL, SlidingWindowSpec(1, 1, sliding_window=8)], [0, 1], 6),  # only 4 and 5 are read
    ([FULL, SlidingWindowSpec(1, 1, sliding_window=8)], [4], 4),  # resume before the gap
    ([FULL, SlidingWindowSpec(1, 1, sliding_window=8)], [2, 4, 5], 2),
    # A chunk of 16 tokens (4 blocks): a resume at 6 reads blocks 4-5 of its chunk, one at 4
    # nothing at all.
    ([FULL, ChunkedLocalAttentionSpec(1, 1, attention_chunk=16)], [0, 1, 2, 3], 6),
    ([FULL, ChunkedLocalAttentionSpec(1, 1, attention_chunk=16)], [5], 5),
    ([FULL, ChunkedLocalAttentionSpec(1, 1, attention_chunk=16)], [0, 1, 2, 3, 4, 5], 4),
])
def test_prefix_match_needs_the_blocks_the_spec_reads(specs, missing, resume):
    mgr, prompt = _cached_prompt(specs)
    last = mgr.groups.num_groups - 1
    _uncache(mgr, prompt, last, missing)
    assert mgr.get_computed_blocks("b", prompt) == resume * BS
    table = mgr.get_block_tables("b")[last]
    first = specs[-1].first_needed_block(resume * BS, BS)
    assert len(table) == resume and mgr._requests["b"].skipped[last] == first
    assert mgr.num_held_blocks("b") == sum(
        resume - s.first_needed_block(resume * BS, BS) for s in mgr.groups.specs)
    mgr.free("b")


def test_freeing_follows_the_spec_as_a_request_grows():
    """A chunked group gives back a finished chunk's blocks, a windowed one those before its
    window, a full group nothing; a fixed-state group all but the block of the latest state."""
    chunked = ChunkedLocalAttentionSpec(1, 1, attention_chunk=8)
    window = SlidingWindowSpec(1, 1, sliding_window=6)
    mgr = KVCacheManager(64, BS, groups=KVCacheGroups.from_layer_specs([FULL, window, chunked]))
    assert mgr.allocate_slots("r", 13)  # blocks 0..3 in each group
    assert mgr.num_held_blocks("r") == 3 * 4
    assert mgr.allocate_slots("r", 4)  # queries from 13 on: window 8.., chunk 8..
    assert mgr.groups.specs == (FULL, window, chunked)
    assert mgr._requests["r"].skipped == [0, 2, 2]
    assert mgr.num_held_blocks("r") == 5 + 3 + 3
    mgr.free("r")
    assert mgr.num_free_blocks == 64

    # A state of 3 pages beside full attention: its pages from the first token, then only
    # the attention blocks grow, past what the pool could give every token of both groups.
    # 8 words, 48 bf16 bytes (kv_specs.stored_state_bytes) over pages of 2 x 4 x 2 = 16 B.
    spec = FixedStateSpec(32, page_of=FullAttentionSpec(1, 1))
    groups = KVCacheGroups.from_layer_specs([FULL, spec])
    state = KVCacheManager(32, BS, enable_prefix_caching=False, groups=groups,
                           kv_dtype=jnp.bfloat16)
    assert state.allocate_slots("r", 1) and state.num_held_blocks("r") == 1 + 3
    pages = state.get_block_tables("r")[1]
    assert state.allocate_slots("r", 15) and state.num_held_blocks("r") == 4 + 3
    for _ in range(60):
        assert state.allocate_slots("r", 1)
    assert state.get_block_tables("r")[1] == pages and state.num_held_blocks("r") == 19 + 3
    # A fork shares the pages until either side writes: that side copies all three, the
    # other then writes its own in place.
    state.fork("r", "f")
    assert state.num_held_blocks("f") == 22 and state.num_free_blocks == 10
    assert state.allocate_slots("f", 1)
    copies = state.take_pending_copies()
    assert sorted(src for src, _ in copies) == sorted(pages)
    assert [dst for _, dst in copies] == state.get_block_tables("f")[1] != pages
    assert state.allocate_slots("r", 1) and not state.take_pending_copies()
    assert state.get_block_tables("r")[1] == pages
    state.free("r")
    state.free("f")
    assert state.num_free_blocks == 32


def test_layers_with_equal_specs_form_groups():
    gemma = config_from_dict(GEMMA2)
    specs = gemma.layer_kv_specs()
    assert specs == (SlidingWindowSpec(2, 16, sliding_window=16), FullAttentionSpec(2, 16)) * 2
    groups = KVCacheGroups.for_model(gemma)
    assert groups.specs == (FullAttentionSpec(2, 16), SlidingWindowSpec(2, 16, sliding_window=16))
    assert groups.layer_group == (1, 0, 1, 0) and groups.num_slots == 2
    assert groups.page_bytes(BS, jnp.bfloat16) == 2 * BS * 2 * 2 * 16 * 2
    # --no-hybrid-kv-cache: one group keeping every block, the same page.
    plain = KVCacheGroups.for_model(gemma, hybrid=False)
    assert plain.specs == (FullAttentionSpec(2, 16),) and plain.num_slots == 4
    llama = config_from_dict(LLAMA)
    assert KVCacheGroups.for_model(llama) == KVCacheGroups.full_attention(
        2, FullAttentionSpec(2, 16))


def test_pages_of_different_sizes_cannot_share_the_pool():
    with pytest.raises(ValueError, match="pages differ in size"):
        KVCacheGroups.from_layer_specs([FullAttentionSpec(2, 16), FixedStateSpec(3)])
    # Equal at one block size (16 x 2 x 4 bytes in float32) is not equal at every size.
    with pytest.raises(ValueError, match="pages differ in size"):
        KVCacheGroups.from_layer_specs([FullAttentionSpec(1, 1), FixedStateSpec(128)])
    with pytest.raises(ValueError, match="pages differ in size"):
        KVCacheGroups.from_layer_specs([MLAAttentionSpec(576, 512), FullAttentionSpec(1, 576)])


@pytest.mark.parametrize("make", [
    lambda: FullAttentionSpec(0, 8), lambda: SlidingWindowSpec(1, 8, sliding_window=0),
    lambda: ChunkedLocalAttentionSpec(1, 8, attention_chunk=-1),
    lambda: MLAAttentionSpec(16, 20), lambda: FixedStateSpec(0)])
def test_invalid_specs_are_refused(make):
    with pytest.raises(ValueError):
        make()
