"""Prefix caching of fixed states (kv_specs.FixedStateSpec: state-space layers): the KV cache
manager's side. Mixed into KVCacheManager.

A sequence's state pages hold its state after its last computed token and are updated in place,
so a prefix hit needs a copy of the state as it was at the hit's last block boundary: a
*snapshot*. The scheduler asks for one for each row of known tokens it schedules (a prompt's
chunks, a recompute's; not decodes: a snapshot is the whole state, ~1 us of host bookkeeping per
block). If the row starts on a block boundary k * block_size (k > 0) and prefix-cache node k has
none yet, the manager allocates
``state_pages`` fresh blocks per fixed-state group and queues the device copies of the
sequence's state pages into them. The copies run at the start of that step, before it writes
any state (take_pending_copies' contract), so they read the state after token k * block_size
whatever the host has processed (asynchronous scheduling, decode loops). The sequence holds
the snapshot until node k is in the tree (its tokens came back: cache_blocks), or until it is
freed; then the snapshot is registered there (evictable like any cached block) or, where node
k has one already, released.

A hit at block n (PrefixCache.match: n is lowered until node n has every fixed-state group's
snapshot, the spec's ``first_needed_block``) holds node n's snapshots until the request gets
its state pages (allocate_slots), which start as copies of them.

Steps start on block boundaries because ``aligned_chunk`` cuts a prompt's chunks there: a chunk
of at least a block ends on a boundary, and the chunk that would pass the prompt's last boundary
before its final token ends on it (vLLM's mamba "align" mode), so an identical prompt resumes
there, and a conversation's next turn at its previous prompt's last boundary.
"""

from __future__ import annotations

from typing import Hashable

from jaxinfer.core.kv_cache.prefix_cache import _ABSENT


class StateSnapshotMixin:
    def _init_state_snapshots(self) -> None:
        # Snapshot blocks a hit's state copies read, held until those copies are taken.
        self._copy_sources: list[int] = []
        self.snapshots_states = bool(self._state_pages) and self.prefix_cache is not None

    def aligned_chunk(self, num_computed: int, num_new: int, num_tokens: int) -> int:
        """The tokens of a prefill chunk of `num_new` from `num_computed` of a sequence of
        `num_tokens`, cut so the step ends on a block boundary (its state can then be
        snapshotted by the next step): a chunk of a block or more to its last boundary, the one
        passing the last boundary before the final token to that boundary. `num_new` unchanged
        when the manager takes no snapshots."""
        if not self.snapshots_states:
            return num_new
        bs = self.block_size
        last = (num_tokens - 1) // bs * bs
        end = num_computed + num_new
        if num_computed < last < end:
            return last - num_computed
        if end < last and num_new >= bs and end // bs * bs > num_computed:
            return end // bs * bs - num_computed
        return num_new

    def snapshot_state(self, request_id: Hashable, start: int) -> None:
        """A step of the request's known tokens was scheduled from token `start` (a prompt
        chunk, not a decode): if that is a block boundary whose prefix-cache node lacks a
        snapshot, take one (module docstring). Nothing when the request holds one not yet
        registered, or the pool has no room for it (a snapshot is an optimization, never a
        reason to preempt)."""
        bs = self.block_size
        req = self._requests.get(request_id)
        if start == 0 or start % bs or req is None or req.snapshot is not None:
            return
        k = start // bs
        node = self._node_at(req, k)
        if node is not None and all(node.block_ids[g] != _ABSENT for g in self._state_pages):
            return
        if any(not req.tables[g] for g in self._state_pages):
            return
        taken = self._copy_state_pages(req)
        if taken is not None:
            req.snapshot = (k, taken)

    def _copy_state_pages(self, req) -> dict[int, list[int]] | None:
        """Fresh blocks per state group with the request's state pages queued to be copied into
        them at the start of the step, before it writes any state (take_pending_copies); None,
        nothing taken, when the pool lacks the room."""
        pool, copies = self.pool, self._pending_state_copies
        if pool.num_free_blocks < sum(self._state_pages.values()):
            return None
        taken = {}
        for g, n in self._state_pages.items():
            blocks = pool.allocate(n)
            for src, dst in zip(req.tables[g], blocks):
                copies[dst] = copies.get(src, src)  # (a copy into src this step: its source)
            taken[g] = blocks
        return taken

    def _node_at(self, req, k: int):
        """The request's prefix-cache node of its first k blocks, None while it has not cached
        them (or after reset_prefix_cache)."""
        node, depth = req.cache_node, req.num_cached_blocks
        if node is None or depth < k:
            return None
        for _ in range(depth - k):
            node = node.parent
        return node

    def _settle_snapshot(self, req) -> None:
        """Register the request's snapshot at its node once the node is cached (else keep it);
        the request's hold on its blocks ends either way once the node is there."""
        k, taken = req.snapshot
        node = self._node_at(req, k)
        if node is None:
            return
        req.snapshot = None
        for g, blocks in taken.items():
            self.prefix_cache.attach_snapshot(node, g, blocks)
            for b in blocks:
                self._release(b)  # cached: evictable; not registered (node had one): free

    def _drop_state_holds(self, req) -> None:
        """A freed request's snapshot (registered where its node is cached) and matched
        snapshots go back."""
        if req.snapshot is not None:
            self._settle_snapshot(req)
        for blocks in req.snapshot[1].values() if req.snapshot is not None else ():
            for b in blocks:
                self._release(b)
        req.snapshot = None
        self._drop_resume(req)

    def _drop_resume(self, req) -> None:
        """Let the matched snapshots go (the request ends, or resumes from a host hit's)."""
        for blocks in (req.resume or {}).values():
            for b in blocks:
                self._release(b)
        req.resume = None

    def _matched_states(self, tables: list, n: int) -> dict[int, tuple[int, ...]] | None:
        """A match of n blocks (PrefixCache.match's tables): each fixed-state group's entry, node
        n's snapshot, held and returned (None at n = 0); the group's table emptied, for
        allocate_slots to fill."""
        resume = {}
        for g in self._state_pages:
            if n:
                resume[g] = tables[g][-1]
                for b in resume[g]:
                    self.pool.incref(b)
            tables[g] = []
        return resume or None

    def _copy_resumed_state(self, req, g: int) -> None:
        """Group g's fresh state pages start as copies of the matched snapshot (if any)."""
        if not req.resume or g not in req.resume:
            return
        blocks = req.resume.pop(g)
        copies = self._pending_state_copies
        for src, dst in zip(blocks, req.tables[g]):
            copies[dst] = copies.get(src, src)
        self._copy_sources.extend(blocks)

    def _release_copy_sources(self) -> None:
        sources, self._copy_sources = self._copy_sources, []
        for b in sources:
            self._release(b)
