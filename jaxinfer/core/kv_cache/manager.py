"""KVCacheManager: per-request block tables over the block pool, with prefix caching and forks.

This is the whole host-side KV API; the scheduler is its only caller (shaped like vLLM V1's
``KVCacheManager``). A request's life:

    n = mgr.get_computed_blocks(rid, prompt)    # cached whole-block prefix, now held by rid
    if not mgr.allocate_slots(rid, len(prompt) - n):
        mgr.free(rid)                           # not admitted this step: give the prefix back
    ...                                         # into the SchedulerOutput for the runner:
    ...                                         # mgr.get_block_ids(rid), mgr.take_pending_copies()
    mgr.cache_blocks(rid, tokens, num_computed) # after the step: newly full blocks -> cache
    mgr.allocate_slots(rid, 1)                  # each decode step; False -> preempt someone
    mgr.truncate(rid, num_computed)             # speculative step: rejected proposals' slots back
    mgr.fork(rid, child)                        # parallel sampling: share every block
    mgr.free(rid)                               # finished / aborted / preempted

Invariants (checked by tests/test_kv_manager_properties.py): a request holds exactly
``ceil(num_tokens / block_size)`` distinct blocks per full-attention group; a block's reference
count equals the number of request tables that hold it; free + used == num_blocks; every holder of
a cached block holds its whole cached prefix (so eviction can go leaf first, see prefix_cache.py).

KV groups (kv_groups.py): a model whose layers keep different blocks (sliding windows next to
full attention) has one table per group of layers with one KV-cache spec (kv_specs.py). All of
a request's tables have the same length (its logical blocks), but the leading entries of a
group no later query reads (its spec's ``first_needed_block``: before a window, a finished
chunk) are *skipped*: released to the pool as the request grows (``allocate_slots``) and left
in the table as block 0, which no kernel reads for them (the windowed kernels start at the
window; a page they touch for tile alignment is masked out).

Block 0 is not reserved: every block id in [0, num_blocks) can be handed out. Padding tokens use
slot -1 and padding block-table entries are never read (pallas_kernels/attention/metadata.py).
"""

from __future__ import annotations

import sys
from typing import Hashable, Sequence

from jaxinfer.core.kv_cache.block_pool import BlockPool
from jaxinfer.core.kv_cache.host_offload import HostOffloadMixin
from jaxinfer.core.kv_cache.host_tier import HostTier
from jaxinfer.core.kv_cache.kv_groups import KVCacheGroups
from jaxinfer.core.kv_cache.prefix_cache import _ABSENT, PrefixCache, PrefixCacheStats, _Node
from jaxinfer.core.kv_cache.request_blocks import RequestBlocks
from jaxinfer.core.kv_cache.state_rollback import StateRollbackMixin
from jaxinfer.core.kv_cache.state_snapshots import StateSnapshotMixin

# num_cached_blocks of a request that must insert nothing more (see reset_prefix_cache).
_NEVER_CACHE = sys.maxsize
# The table entry of a skipped block (out of its group's window, no longer held).
SKIPPED_BLOCK = 0
class KVCacheManager(HostOffloadMixin, StateSnapshotMixin, StateRollbackMixin):
    """Block tables for every live request over one pool of ``num_blocks`` blocks.

    Request ids are any hashable values. All methods are host-side and O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 groups: KVCacheGroups | None = None, host_tier: HostTier | None = None,
                 kv_dtype=None):
        """`host_tier`: the host pool's bookkeeping (host_tier.py), or None: an evicted block's
        KV is gone. Needs prefix caching and no group that frees blocks (a window).
        `kv_dtype`: the cache's element type, which sets how many blocks a fixed state spans
        (kv_specs.FixedStateSpec)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError("a host KV tier needs prefix caching")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Which layers share a table (one full-attention group unless the model has windows).
        self.groups = groups or KVCacheGroups.full_attention(1)
        self._num_groups = self.groups.num_groups
        # Groups of a fixed state: a sequence holds its state's pages there from its first
        # token to its end (group -> pages); the others grow with the tokens.
        self._state_pages = {g: n for g, n in enumerate(self.groups.state_pages(block_size,
                                                                              kv_dtype))
                             if n is not None}
        self._growing = [g for g in range(self.groups.num_groups) if g not in self._state_pages]
        self._partial = [g for g in self._growing  # groups that free blocks
                         if not self.groups.specs[g].keeps_every_block]
        self._one_table = self._growing == [0] and not self._partial  # one full-attention group
        if host_tier is not None and self._partial:
            raise ValueError("a host KV tier needs whole prefix blocks: one KV group (no sliding "
                             "windows), or groups keeping every block beside fixed states'")
        self.pool = BlockPool(num_blocks)
        self.host = host_tier
        self.prefix_cache = (PrefixCache(self.pool, block_size, self.groups,
                                         digests=host_tier is not None)
                             if enable_prefix_caching else None)
        if host_tier is not None:
            self.prefix_cache.on_drop = self._offload
        self.stats = PrefixCacheStats()
        self._requests: dict[Hashable, RequestBlocks] = {}
        # Pending device copies, dst block -> src block (take_pending_copies): of attention
        # pages (copy-on-write) and of state pages (snapshots, prefix hits, rollbacks), apart
        # because a speculative head or draft model holds pages of the first group only.
        self._pending_copies: dict[int, int] = {}
        self._pending_state_copies: dict[int, int] = {}
        self._init_host_offload()
        self._init_state_snapshots()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can still get (free list + evictable cached blocks)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction (0..1) of blocks held by live requests; evictable cached blocks count as free."""
        return self.pool.usage

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or evictable)."""
        return self.prefix_cache.num_cached_blocks if self.prefix_cache else 0

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def num_tokens(self, request_id: Hashable) -> int:
        """Tokens of the request that have a KV slot (cached prefix + everything allocated)."""
        return self._requests[request_id].num_tokens

    def get_block_ids(self, request_id: Hashable) -> list[int]:
        """The request's physical block ids in logical order (its row of the step's block table),
        of the first group: the only one unless the model has sliding windows.

        Returns the manager's own list: read it, do not mutate or keep it. Re-read it every step
        after allocate_slots / cache_blocks: allocation appends, copy-on-write replaces the last
        id, and cache_blocks may swap a full block for an identical cached one (deduplication)."""
        return self._requests[request_id].tables[0]

    def get_block_tables(self, request_id: Hashable) -> list[list[int]]:
        """Every group's table (same length; a windowed group's skipped entries read
        SKIPPED_BLOCK). The manager's own lists, as get_block_ids."""
        return self._requests[request_id].tables

    def table_version(self, request_id: Hashable) -> int:
        """Its tables' version: unchanged while they only grow by appends to the growing groups
        (a copy then takes just the new tail: worker/block_table.py); new after any other change,
        and for every registration (a preempted request back, a fork)."""
        return self._requests[request_id].version

    def num_held_blocks(self, request_id: Hashable) -> int:
        """Blocks the request holds over all groups (skipped entries excluded)."""
        req = self._requests[request_id]
        return sum(len(t) - k for t, k in zip(req.tables, req.skipped))

    def _new_request(self, node) -> RequestBlocks:
        g = self._num_groups
        return RequestBlocks([[] for _ in range(g)], [0] * g, 0, 0, node)

    # ---- admission -----------------------------------------------------------------------
    def get_computed_blocks(self, request_id: Hashable, token_ids: Sequence[int],
                            match: bool = True, count: bool = True,
                            namespace: Hashable = None) -> int:
        """Register a new request and give it the longest cached whole-block prefix of its tokens.

        The matched blocks are referenced by the request right away (they cannot be evicted under
        it); call allocate_slots for the remaining tokens next, and free(request_id) if the request
        is not admitted after all. At least one token is always left to compute, so the step that
        follows yields logits (a fully cached prompt recomputes its last block's tokens from the
        last block boundary before its final token).

        Returns the number of tokens whose KV is already cached: a multiple of block_size, always
        < len(token_ids); 0 when prefix caching is off or `match` is False (the request computes
        every token, e.g. for prompt logprobs; its blocks still enter the cache). A match counts
        one query of len(token_ids) tokens and the hits in ``stats`` (unless `count` is False: a
        lookup made for a request whose own lookup counted elsewhere). `namespace` keys the
        prefix (a LoRA adapter's blocks are matched only by requests of that adapter: None is
        the base model's). Raises ValueError if the request already holds blocks."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already registered with the KV cache "
                             f"manager; free() it before matching its prefix again")
        cache = self.prefix_cache
        if cache is None:
            self._requests[request_id] = self._new_request(None)
            return 0
        if not match:
            self._requests[request_id] = self._new_request(cache.root_of(namespace))
            return 0
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        tables, node, n = cache.match(token_ids, max_blocks, namespace)
        resume = self._matched_states(tables, n)
        incref = self.pool.incref
        skipped = []
        for table in tables:
            k = 0
            while k < len(table) and table[k] == _ABSENT:  # before a window: placeholders
                table[k] = SKIPPED_BLOCK
                k += 1
            skipped.append(k)
            for b in table[k:]:
                incref(b)
        num_computed = n * self.block_size
        self._requests[request_id] = RequestBlocks(tables, skipped, num_computed, n, node)
        self._requests[request_id].resume = resume
        if not count:
            return num_computed
        self.stats.requests += 1
        self.stats.queries += len(token_ids)
        self.stats.hits += num_computed
        self._requests[request_id].counted = [len(token_ids), num_computed]
        return num_computed

    # ---- growth --------------------------------------------------------------------------
    def allocate_slots(self, request_id: Hashable, num_new_tokens: int,
                       first_query_pos: int | None = None) -> bool:
        """Give the request slots for ``num_new_tokens`` more tokens (a prefill chunk or a decode).

        Allocates blocks on demand as tokens cross block boundaries, and a fixed state's pages
        with the request's first tokens (kv_specs.FixedStateSpec.state_pages). If the request's
        last block is partly filled and shared with a fork, it is first copied into a fresh
        block (copy-on-write), as are a state's pages shared with a fork (every step writes
        them); the (src, dst) device copies are queued for take_pending_copies.

        Returns True on success. Returns False, having changed nothing (but for skipping blocks
        no query can see any more, below), when the pool has too few free + evictable blocks:
        the scheduler then preempts (free()s) a request and retries. An unknown request id is
        registered with an empty table (no prefix match).

        Groups that free blocks (windowed, chunked) first release those no query from the
        request's current length on reads (the new tokens start there; no earlier query is
        scheduled again), so the new blocks can reuse them; `first_query_pos` instead when slots
        are reserved ahead for a device loop whose first query comes earlier (a decode loop's
        first step: the blocks it reads must not be handed to another sequence of the loop)."""
        req = self._requests.get(request_id)
        if (req is not None and self._one_table  # a decode with room in its own last block, first
                and 0 < num_new_tokens <= -req.num_tokens % self.block_size
                and self.pool.ref_counts[req.tables[0][-1]] == 1):
            req.num_tokens += num_new_tokens
            return True
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0 (got {num_new_tokens})")
        registered_here = req is None
        if registered_here:
            req = self._new_request(self.prefix_cache.root if self.prefix_cache else None)
            self._requests[request_id] = req
        if num_new_tokens == 0:
            return True
        bs = self.block_size
        tables = req.tables
        old_tokens = req.num_tokens
        new_tokens = old_tokens + num_new_tokens
        num_new_blocks = (new_tokens + bs - 1) // bs - (old_tokens + bs - 1) // bs
        pool = self.pool
        # Copy-on-write: a growing group's partly filled last block, or a state's pages, shared
        # with a fork (a state is updated in place by every step, so a shared one always is).
        cow = ([(g, len(t) - 1) for g in self._growing
                if pool.ref_counts[(t := tables[g])[-1]] > 1] if old_tokens % bs else [])
        state_new = 0  # the pages of states the request takes now (its first tokens)
        for g, n in self._state_pages.items():
            t = tables[g]
            if not t:
                state_new += n
            elif pool.ref_counts[t[0]] > 1:
                cow.extend((g, i) for i in range(n))
        if num_new_blocks == 0 and not cow and not state_new:  # a decode step: room in place
            req.num_tokens = new_tokens
            return True
        if self._partial:
            self._skip_unneeded(req, old_tokens if first_query_pos is None
                                else min(first_query_pos, old_tokens))
        if num_new_blocks * len(self._growing) + state_new + len(cow) > pool.num_free_blocks:
            if registered_here:
                del self._requests[request_id]  # leave no trace of a request we registered
            return False
        for g, i in cow:
            blocks = tables[g]
            src = blocks[i]
            (dst,) = pool.allocate(1)
            pool.decref(src)  # still held by the fork that shares it (count was > 1)
            blocks[i] = dst
            # If src is itself waiting to be filled by a copy, copy from that copy's source: all
            # copies of a step read the cache before any writes (see device_cache.copy_blocks).
            self._pending_copies[dst] = self._pending_copies.get(src, src)
        if num_new_blocks > 0:
            for g in self._growing:
                tables[g].extend(pool.allocate(num_new_blocks))
        for g, n in self._state_pages.items():
            if not tables[g]:
                tables[g].extend(pool.allocate(n))
                self._copy_resumed_state(req, g)
        if cow or state_new:
            req.edited()
        req.num_tokens = new_tokens
        return True

    def _skip_unneeded(self, req: RequestBlocks, first_query_pos: int) -> None:
        """Release each freeing group's blocks that no query at `first_query_pos` or later reads."""
        first_needed = self.groups.first_needed_block
        for g in self._partial:
            table = req.tables[g]
            end = min(first_needed(g, first_query_pos, self.block_size), len(table))
            if end > req.skipped[g]:
                req.edited()
            for i in range(req.skipped[g], end):
                self._release(table[i])
                table[i] = SKIPPED_BLOCK
            req.skipped[g] = max(req.skipped[g], end)

    def truncate(self, request_id: Hashable, num_tokens: int) -> None:
        """Give back the slots past the first ``num_tokens`` (speculative decoding: the proposals
        that were rejected); blocks left empty are released. The request keeps every cached
        block: ``num_tokens`` may not reach into them (cached blocks hold computed tokens only)."""
        req = self._requests[request_id]
        if num_tokens >= req.num_tokens:
            return
        keep = -(-num_tokens // self.block_size)
        cached = 0 if req.num_cached_blocks == _NEVER_CACHE else req.num_cached_blocks
        if num_tokens < 0 or keep < cached:
            raise ValueError(f"truncate({request_id!r}, {num_tokens}): below the request's "
                             f"{req.num_cached_blocks} cached blocks")
        for g in self._growing:  # (a state's pages hold no tokens)
            blocks = req.tables[g]
            if len(blocks) > keep:  # (appends may bring the length back: not a shorter copy)
                req.edited()
            while len(blocks) > keep:
                b = blocks.pop()
                if len(blocks) >= req.skipped[g]:
                    self._release(b)
            req.skipped[g] = min(req.skipped[g], keep)
        req.num_tokens = num_tokens

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int],
                     num_computed_tokens: int) -> int:
        """Insert the request's newly *computed* full blocks into the prefix cache.

        Call after each step with the request's token ids (prompt + output) and how many of them
        now have their KV written. Only full blocks among the first ``num_computed_tokens`` are
        inserted, each keyed by its tokens under its predecessor (so the key covers the whole
        prefix). If an identical block is already cached (two requests computed the same prefix
        concurrently), the request -- and every fork sharing its copy -- switches to the cached
        block and the copy is released, so the duplicate does not stay resident.

        Returns the number of blocks newly registered or deduplicated; 0 (a no-op) when caching
        is off, after reset_prefix_cache, or when no block filled up since the last call."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        req = self._requests[request_id]
        if req.snapshot is not None:  # a state snapshot whose node an earlier call inserted
            self._settle_snapshot(req)
        bs, states = self.block_size, self._state_pages
        num_full = num_computed_tokens // bs
        first = req.num_cached_blocks
        if num_full <= first:
            return 0
        if num_computed_tokens > req.num_tokens or num_computed_tokens > len(token_ids):
            raise ValueError(
                f"cache_blocks({request_id!r}): num_computed_tokens={num_computed_tokens} exceeds "
                f"the request's {req.num_tokens} allocated tokens or its {len(token_ids)} token ids")
        tables, skipped, pool, node = req.tables, req.skipped, self.pool, req.cache_node
        for i in range(first, num_full):
            # (A state's table holds its pages, no token's block.)
            own = [t[i] if i >= k and g not in states else _ABSENT
                   for g, (t, k) in enumerate(zip(tables, skipped))]
            node = cache.insert(node, tuple(token_ids[i * bs:(i + 1) * bs]), own)
            for g, b in enumerate(own):
                cached = node.block_ids[g]
                if b == _ABSENT or cached == b:
                    continue
                # Identical block already cached: share it, drop ours. Every holder of `b` (an
                # uncached block, so shared only by forks) switches, which keeps "a holder of a
                # cached block holds its whole cached prefix" true for the blocks inserted next.
                for holder in req.family or (req,):
                    table = holder.tables[g]
                    if len(table) > i >= holder.skipped[g] and table[i] == b:
                        pool.incref(cached)
                        table[i] = cached
                        holder.edited()
                        self._release(b)
        req.num_cached_blocks = num_full
        req.cache_node = node
        return num_full - first

    # ---- sharing and release -------------------------------------------------------------
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (reference counts +1, no copy).

        Needs no free block, so it always succeeds. The first append by either side into the
        shared partly-filled last block copies that one block, and the first by either side
        copies a fixed state's pages (see allocate_slots)."""
        if child_id in self._requests:
            raise ValueError(f"fork: child request {child_id!r} already exists")
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"fork: unknown parent request {parent_id!r}")
        incref = self.pool.incref
        for table, k in zip(parent.tables, parent.skipped):
            for b in table[k:]:
                incref(b)
        if parent.family is None:
            parent.family = {parent}
        child = RequestBlocks([list(t) for t in parent.tables], list(parent.skipped),
                               parent.num_tokens, parent.num_cached_blocks, parent.cache_node,
                               parent.family)
        parent.family.add(child)
        self._requests[child_id] = child

    def free(self, request_id: Hashable, admitted: bool = True) -> bool:
        """Release all the request's blocks (finished, aborted or preempted).

        Blocks whose count reaches 0 return to the free list, or to the evictable set if cached;
        they are released last block first so cached leaves become evictable before their
        parents. `admitted` False: the admission its prefix lookup was for did not happen (no
        room; the scheduler looks again next step), so the lookup leaves `stats`: a request
        waiting for room counts one query, not one a step. Idempotent: returns False for an
        unknown (or already freed) request."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if not admitted and req.counted is not None:
            st = self.stats
            st.requests -= 1
            st.queries -= req.counted[0]
            st.hits -= req.counted[1]
        if self.host is not None:
            self._write_through(req.cache_node)
        if req.family is not None:
            req.family.discard(req)
        if req.snapshot is not None or req.resume is not None:
            self._drop_state_holds(req)
        self._drop_verify_hold(req)
        release = self._release
        tables, skipped = req.tables, req.skipped
        if len(tables) == 1:
            for b in reversed(tables[0][skipped[0]:]):
                release(b)
            return True
        for g in self._state_pages:
            for b in tables[g]:
                release(b)
        growing = [(tables[g], skipped[g]) for g in self._growing]
        for i in range((len(growing[0][0]) if growing else 0) - 1, -1, -1):
            for table, k in growing:  # last block first, every group at once
                if i >= k:
                    release(table[i])
        return True

    def _release(self, block_id: int) -> None:
        self.pool.decref(block_id)
        # A block freed before its pending copy ran will be reallocated: the copy must not land.
        if self.pool.ref_counts[block_id] == 0:
            if self._pending_copies:
                self._pending_copies.pop(block_id, None)
            if self._pending_state_copies:
                self._pending_state_copies.pop(block_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Every (src, dst) block copy queued since the last call, pages' then states', and clear
        them (take_pending_copies_by_kind)."""
        pages, states = self.take_pending_copies_by_kind()
        return pages + states

    def take_pending_copies_by_kind(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(attention pages' copy-on-write copies, state pages' copies) queued since the last
        call, as (src, dst) pairs, and clear them.

        The runner performs them (device_cache.copy_blocks) at the start of the next step,
        before that step writes any KV. Destinations are distinct; a source may repeat."""
        pages = [(src, dst) for dst, src in self._pending_copies.items()]
        states = [(src, dst) for dst, src in self._pending_state_copies.items()]
        self._pending_copies.clear()
        self._pending_state_copies.clear()
        if self._copy_sources:  # (read by these copies: free to go once they are taken)
            self._release_copy_sources()
        return pages, states

    def reset_prefix_cache(self, keep_host: bool = False) -> int:
        """Forget every cached prefix (e.g. after loading new weights). Unreferenced cached blocks
        go back to the free list (returned: how many). Blocks held by live requests stay theirs,
        uncached; those requests insert nothing more (unrelated requests may now share uncached
        blocks, which the new tree could not keep consistent), requests admitted later do.
        The host tier is emptied too unless `keep_host` (the device cache released, the weights
        unchanged: LLMEngine.sleep)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        if self.host is not None and not keep_host:
            self.host.clear()
            self._pending_offloads.clear()
            self._evict_run = None
        freed = cache.clear()
        for req in self._requests.values():
            req.num_cached_blocks = _NEVER_CACHE
            req.cache_node = None
        return freed

    # ---- introspection for tests ---------------------------------------------------------
    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def cache_node_of(self, block_id: int) -> _Node | None:
        return self.prefix_cache.node_of(block_id) if self.prefix_cache else None
