"""The KV cache manager's side of the host tier (host_tier.py): what to copy to the host and when,
and matching a prompt's prefix past the device cache into host blocks. Mixed into KVCacheManager.

*Write-through at release*, when the host holds at least twice the device pool's blocks: when a
request frees its blocks (finished, preempted, aborted), every block of its cached prefix the host
does not hold yet is queued for the host at once, as one *run* (SGLang HiCache's write-through
policy). A run is copied as a few large pieces (worker/kv/host_store.py), so a later load of that
prefix reads a few large host arrays instead of one small one per block; and the device's later
eviction of those blocks copies nothing. A smaller host would spend itself on copies of blocks the
device still holds, so it only gets blocks at eviction: the blocks the pool evicts between two
steps are one run. Either way the copy is dispatched before the step that could reuse the block.

*Host LRU order.* A run is stored, and a host match touches its blocks, last block first, so a
prefix's first blocks are the most recently used: the host evicts the tail of a prefix before its
head (an evicted head would leave its tail unreachable: a match walks from the head).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from jaxinfer.core.kv_cache.host_tier import piece_sizes


class HostOffloadMixin:
    def _init_host_offload(self) -> None:
        # Runs of (device block, host slot) to copy to the host before the blocks are reused, in
        # the order the host tier handed out the slots (a slot reused within a run: the later
        # entry is the slot's owner).
        self._pending_offloads: list[list[tuple[int, int]]] = []
        self._evict_run: list[tuple[int, int]] | None = None  # the run evictions append to
        self._writes_through = (self.host is not None
                                and self.host.num_slots >= 2 * self.pool.num_blocks)

    def match_host(self, request_id: Hashable, token_ids: Sequence[int],
                   chunk_tokens: int | None = None) -> list[tuple[int, int]]:
        """Continue a request's prefix match (get_computed_blocks, just called) into the host tier:
        the host blocks that follow its device-cached prefix get fresh device blocks, appended to
        its table, and their host slots are pinned until `loaded`. Returns the copies to make,
        (host slot, device block) in order; [] without a host tier or a host hit. The request's
        `num_tokens` grows by the blocks' tokens: the caller treats them as computed once copied.
        At most as many blocks as are free now less those of the request's next chunk (at most
        `chunk_tokens` of what is left to compute, plus one): a load never takes the room its
        own prefill needs."""
        host, req = self.host, self._requests[request_id]
        table = req.tables[0]  # the only group: a host tier needs one (__init__)
        if host is None or req.cache_node is None or len(table) != req.num_cached_blocks:
            return []
        bs = self.block_size
        max_blocks = max(len(token_ids) - 1, 0) // bs
        slots = host.match(req.cache_node.digest, token_ids, len(table), max_blocks, bs)
        if chunk_tokens is not None:
            left = len(token_ids) - (len(table) + len(slots)) * bs
            room = self.pool.num_free_blocks - 1
            slots = slots[:max(room - -(-min(chunk_tokens, left) // bs), 0)]
        if not slots:
            return []
        host.pin(slots)  # (first: the allocation below may offload, which must not take them)
        blocks = self.pool.allocate(len(slots))
        table.extend(blocks)
        req.num_tokens += len(blocks) * bs
        host.stats.hit_blocks += len(blocks)
        self.stats.host_hits += len(blocks) * bs
        req.counted = None  # a load is made: the lookup stays counted whatever comes next
        return list(zip(slots, blocks))

    def loaded(self, slots: Sequence[int], landed: bool = True) -> None:
        """A copy from these host slots (match_host's) landed, or was dropped (`landed` False: its
        request ended first): unpin them."""
        self.host.unpin(slots)
        if landed:
            self.host.stats.loaded_blocks += len(slots)

    def _write_through(self, node) -> None:
        """A request releasing its blocks: queue its cached prefix's blocks the host lacks (one
        run, last block first), ending at `node`, its last cached block's node."""
        if not self._writes_through:
            return
        run, store = [], self.host.store
        while node is not None and node.parent is not None:
            slot = store(node.digest)
            if slot is not None:
                run.append((node.block_id, slot))
            node = node.parent
        if run:
            self._pending_offloads.append(run)
            self._evict_run = None

    def _offload(self, node, block_id: int) -> None:
        """The pool evicts a cached block: copy it to the host unless the host has it."""
        slot = self.host.store(node.digest)
        if slot is None:
            return
        if self._evict_run is None:
            self._evict_run = []
            self._pending_offloads.append(self._evict_run)
        self._evict_run.append((block_id, slot))

    def take_pending_offloads(self) -> list[list[tuple[int, int]]]:
        """Runs of (device block, host slot) queued since the last call, and clear them. The
        worker must read every one before a step writes into those blocks again; it copies each
        run as `piece_sizes` pieces, which the host tier from now on evicts whole."""
        out, self._pending_offloads, self._evict_run = self._pending_offloads, [], None
        for run in out:
            i = 0
            for size in piece_sizes(len(run)):
                self.host.group([s for _, s in run[i:i + size]])
                i += size
        return out

    def offload_cached(self) -> int:
        """Queue every unreferenced cached device block for the host (before the device cache is
        released, e.g. LLMEngine.sleep), least recently used first; how many were queued."""
        if self.host is None:
            return 0
        before = sum(map(len, self._pending_offloads))
        for b in self.pool.evictable_block_ids():
            self._offload(self.prefix_cache.node_of(b), b)
        return sum(map(len, self._pending_offloads)) - before
