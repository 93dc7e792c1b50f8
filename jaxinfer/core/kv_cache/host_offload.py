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

*State snapshots* (state-space layers, state_snapshots.py) go with their prefix node: a node's
snapshot blocks are offloaded beside its attention block, at release or at eviction (whichever
of them the pool evicts first), as one host bundle per group, whole or gone (host_tier.py). A
host match of such a model resumes at the last block whose node has every group's snapshot on
the host, taking the blocks before it from the device where it still caches them; the snapshot
is loaded straight into the request's fresh state pages, as a device hit's is copied into them.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from jaxinfer.core.kv_cache.host_tier import block_key, piece_sizes, state_keys


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
        its table; their host slots are pinned until `loaded`. With fixed states the match ends
        at a block whose snapshot the host has, loaded into the request's state pages (the
        device match's snapshot let go), and may start with device blocks the device match
        left for want of a snapshot (taken as they are). Returns the copies to make, (host
        slot, device block): the blocks in order (each group's in turn, where attention layers
        outnumber the states' and fill several groups), then the state pages'; [] without a
        host tier or a host hit. The request's `num_tokens` grows by the tokens of the blocks
        appended: the caller treats them as computed once copied. At most as many blocks as are
        free now less those of the request's next chunk (at most `chunk_tokens` of what is left
        to compute, plus one) and its state pages: a load never takes the room its own prefill
        needs."""
        host, req = self.host, self._requests[request_id]
        table = req.tables[0]
        if host is None or req.cache_node is None or len(table) != req.num_cached_blocks:
            return []
        bs, states, groups = self.block_size, self._state_pages, self._growing
        max_blocks = max(len(token_ids) - 1, 0) // bs
        # (Without states the device match took every device block: `on_device` is empty.)
        on_device = self.prefix_cache.cached_run(req.cache_node, token_ids, len(table),
                                                 max_blocks) if states else []
        last = on_device[-1] if on_device else req.cache_node
        run = host.run(last.digest, token_ids, len(table) + len(on_device), max_blocks, bs,
                       len(groups))
        m, snapshot = self._host_resume(token_ids, len(table), on_device, run, chunk_tokens)
        if not m:
            return []
        slots = [s for _, per_group in run[:m - len(on_device)] for s in per_group]
        state_slots = [s for g in states for s in snapshot[g]]
        host.pin(slots + state_slots)  # (first: the allocations below may offload)
        for node in on_device[:m]:
            for g in groups:
                self.pool.incref(node.block_ids[g])
                req.tables[g].append(node.block_ids[g])
        blocks = self.pool.allocate(len(slots))
        for i, b in enumerate(blocks):  # (slots block by block, each group's in turn)
            req.tables[groups[i % len(groups)]].append(b)
        pages = []
        if states:
            self._drop_resume(req)  # resumes at block len(table) now, not at the device's
            for g, n in states.items():
                req.tables[g] = self.pool.allocate(n)
                pages += req.tables[g]
        req.num_tokens += m * bs
        host.stats.hit_blocks += len(slots) + len(state_slots)
        self.stats.host_hits += m * bs
        req.counted = None  # a load is made: the lookup stays counted whatever comes next
        return list(zip(slots + state_slots, blocks + pages))

    def _host_resume(self, token_ids: Sequence[int], first: int, on_device: list, run: list,
                     chunk_tokens: int | None) -> tuple[int, dict[int, list[int]]]:
        """match_host's resume point: the most blocks m past the device match's `first` (from
        the device's `on_device` nodes, then the host's `run`) that fit the room and, with fixed
        states, whose last node has each state group's snapshot on the host (returned: group ->
        its slots); 0 when none."""
        bs, states, groups = self.block_size, self._state_pages, self._growing
        digests = [node.digest for node in on_device] + [d for d, _ in run]
        room = self.pool.num_free_blocks - 1 - sum(states.values())
        # Blocks the first m take from the room: the host's, and device ones no one holds.
        taken = [0]
        for node in on_device:
            taken.append(taken[-1] + sum(self.pool.ref_counts[node.block_ids[g]] == 0
                                         for g in groups))
        taken += range(taken[-1] + len(groups), taken[-1] + len(groups) * (len(run) + 1),
                       len(groups))
        for m in range(len(digests), 0, -1):
            left = len(token_ids) - (first + m) * bs
            chunk = len(groups) * -(-min(chunk_tokens or 0, left) // bs)
            if chunk_tokens is not None and taken[m] > room - chunk:
                continue
            snapshot = {g: self.host.bundle(state_keys(digests[m - 1], g, n))
                        for g, n in states.items()}
            if None not in snapshot.values():
                return m, snapshot
        return 0, {}

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
        run = []
        while node is not None and node.parent is not None:
            for g, entry in enumerate(node.block_ids):
                run += self._host_copies(node, g, entry)
            node = node.parent
        if run:
            self._pending_offloads.append(run)
            self._evict_run = None

    def _offload(self, node, g: int, entry) -> None:
        """The prefix cache drops node's entry of group g for an eviction: copy it to the host
        unless the host has it."""
        copies = self._host_copies(node, g, entry)
        if not copies:
            return
        if self._evict_run is None:
            self._evict_run = []
            self._pending_offloads.append(self._evict_run)
        self._evict_run += copies

    def _host_copies(self, node, g: int, entry) -> list[tuple[int, int]]:
        """(device block, host slot) for node's entry of group g (a block, a snapshot's tuple
        or none) where the host lacks it."""
        if isinstance(entry, tuple):
            slots = self.host.store_bundle(state_keys(node.digest, g, len(entry)))
            return list(zip(entry, slots or ()))
        slot = None if entry < 0 else self.host.store(block_key(node.digest, g))
        return [] if slot is None else [(entry, slot)]

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
            node, g = self.prefix_cache.entry_of(b)
            self._offload(node, g, node.block_ids[g])
        return sum(map(len, self._pending_offloads)) - before
