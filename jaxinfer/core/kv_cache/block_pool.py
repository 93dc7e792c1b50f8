"""The pool of physical KV-cache blocks: reference counts, the free list and the evictable set.

Every physical block is in exactly one of three states:

- *referenced*: ``ref_counts[b] > 0``; held by that many request block tables;
- *free*: unreferenced and holding no reusable content; waits in the FIFO free list;
- *evictable*: unreferenced but registered in the prefix cache, so a later request may still reuse
  its KV. Kept in least-recently-released order; it is reclaimed (evicted) only when the free list
  is empty and a block is needed.

``num_free_blocks`` counts free + evictable blocks: both can be handed out. Allocation is
all-or-nothing: ``allocate(n)`` either returns n blocks or raises ``OutOfBlocksError`` having
changed nothing.

Block 0 is an ordinary block: no block id is reserved. Padding tokens in a step use slot -1
(see ``pallas_kernels/attention/metadata.py``), never a reserved block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

from jaxinfer.errors import JaxinferError


class OutOfBlocksError(JaxinferError):
    """Fewer free (or evictable) KV-cache blocks than an allocation needs; nothing was allocated.

    Raised by ``BlockPool.allocate``. ``KVCacheManager.allocate_slots`` checks first and returns
    False instead, so the scheduler sees a plain False and preempts."""

    def __init__(self, requested: int, available: int):
        super().__init__(f"KV cache out of blocks: {requested} needed, {available} free")
        self.requested = requested
        self.available = available


class BlockPool:
    """Reference-counted pool of ``num_blocks`` KV-cache blocks (host-side bookkeeping only)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        # Plain lists indexed by block id: the hot path (one decode token per request per step)
        # touches these, and list indexing is the cheapest lookup Python has.
        self.ref_counts = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Cached, unreferenced blocks; first = least recently released, the next eviction victim.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Called with a block id just before an evictable block is reused, so the prefix cache
        # can drop the node that points at it. Set by PrefixCache.
        self.on_evict: Callable[[int], None] | None = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: the free list plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); evictable cached blocks count as free."""
        return self.num_used_blocks / self.num_blocks

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list (uncached), in allocation order; for tests and debugging."""
        return list(self._free)

    def evictable_block_ids(self) -> list[int]:
        """Evictable cached blocks, next victim first; for tests and debugging."""
        return list(self._evictable)

    # ---- allocation and reference counting -----------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n blocks with reference count 1: free-list blocks first, then evict LRU cached ones.

        Raises OutOfBlocksError (changing nothing) when fewer than n blocks are free."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks)
        out = []
        free, refs = self._free, self.ref_counts
        for _ in range(n):
            if free:
                b = free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._cached[b] = False
                if self.on_evict is not None:
                    self.on_evict(b)
            refs[b] = 1
            out.append(b)
        return out

    def incref(self, block_id: int) -> None:
        """One more holder. An evictable block becomes referenced again (a prefix-cache hit)."""
        if self.ref_counts[block_id] == 0:
            if not self._cached[block_id]:
                raise RuntimeError(f"block {block_id} is free: only held or cached blocks can be shared")
            del self._evictable[block_id]
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        """One holder fewer. At zero the block goes to the evictable set if cached, else to the
        free list. A block released more often than it was taken is a bug: raise, never corrupt."""
        count = self.ref_counts[block_id] - 1
        if count < 0:
            raise RuntimeError(f"block {block_id} released twice (reference count already 0)")
        self.ref_counts[block_id] = count
        if count == 0:
            if self._cached[block_id]:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    # ---- prefix-cache membership ---------------------------------------------------------
    def mark_cached(self, block_id: int) -> None:
        """The block's content is now registered in the prefix cache (it must be referenced)."""
        if self.ref_counts[block_id] == 0:
            raise RuntimeError(f"block {block_id} is not referenced; only held blocks can be cached")
        self._cached[block_id] = True

    def uncache(self, block_id: int) -> None:
        """Forget that the (cached) block is cached; if unreferenced it moves to the free list."""
        self._cached[block_id] = False
        if self.ref_counts[block_id] == 0:
            del self._evictable[block_id]
            self._free.append(block_id)
