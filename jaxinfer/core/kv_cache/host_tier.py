"""The host tier's bookkeeping: which prefix blocks the host pool holds, in which slot, in LRU order.

The host pool (`--kv-host-gib`) is a second level under the device prefix cache: a full cached
block the device pool evicts is copied to a host slot instead of being forgotten, and a later
prompt whose prefix continues past the device cache's match into host blocks gets them copied back
into fresh device blocks instead of recomputing them (docs/kv_cache.md, "Host tier").

A host block is named by its *digest*: SHA-256 chained over the block's token ids, its parent
block's digest and the namespace (LoRA adapter) at the root, so a digest stands for the whole
prefix up to and including the block, as a radix-tree node does on the device. A 256-bit chained
hash makes serving a block for another prefix as unlikely as a SHA-256 collision (vLLM's
`--prefix-caching-hash-algo sha256` makes the same trade); a plain Python hash would not do.

This module only counts slots: the bytes are the worker's (`jaxinfer/worker/kv/host_store.py`),
indexed by the slot numbers handed out here, as device block ids index the device cache.

A slot is *pinned* while a copy back to the device has been planned from it and has not landed,
so an offload in a later step cannot take the slot over meanwhile; pinned slots are never evicted.

A state-space layer's snapshot (core/kv_cache/state_snapshots.py) is several blocks, named by
`state_key`s under the digest of the prefix it follows, and kept as a *bundle*: whole or gone, as
on the device (evicting one of its slots evicts the others; it is pinned and loaded as a whole).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from typing import Hashable, Sequence

import numpy as np


# The largest host piece (blocks copied as one host array, worker/kv/host_store.py).
MAX_PIECE_BLOCKS = 256


def piece_sizes(n: int, cap: int = MAX_PIECE_BLOCKS) -> list[int]:
    """A run of `n` blocks as host pieces: powers of two, largest first, each at most `cap` (a
    power of two): 100 -> [64, 32, 4]. The worker copies each as one array (no padding); the
    tier evicts each as a whole (`group`)."""
    out = []
    while n:
        size = min(cap, 1 << (n.bit_length() - 1))
        out.append(size)
        n -= size
    return out


def root_digest(namespace: Hashable = None) -> bytes:
    """The digest a namespace's first block chains from (None: the base model)."""
    return hashlib.sha256(b"jaxinfer-kv-root:" + repr(namespace).encode()).digest()


def block_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The digest of a full block of `token_ids` whose prefix before it has digest `parent`."""
    return hashlib.sha256(parent + np.asarray(token_ids, np.int64).tobytes()).digest()


def block_key(digest: bytes, group: int) -> bytes:
    """The host name of KV group `group`'s block of the prefix of `digest` (the digest itself
    for the first group: the only one but beside fixed states' groups)."""
    return digest if group == 0 else hashlib.sha256(b"%s group %d" % (digest, group)).digest()


def state_keys(digest: bytes, group: int, num_blocks: int) -> list[bytes]:
    """The host names of the `num_blocks` blocks of KV group `group`'s state snapshot after the
    prefix of `digest` (the state after its last token)."""
    return [hashlib.sha256(b"%s state %d %d" % (digest, group, i)).digest()
            for i in range(num_blocks)]


@dataclasses.dataclass
class HostTierStats:
    """Monotonic counters (blocks), for metrics and benchmarks."""
    hit_blocks: int = 0        # blocks found on the host by prompt lookups (copied back)
    offloaded_blocks: int = 0  # device -> host copies planned
    loaded_blocks: int = 0     # host -> device copies that landed
    evicted_blocks: int = 0    # host blocks dropped for room (LRU)


class HostTier:
    """`num_slots` host blocks: digest -> slot, LRU of unpinned slots, pin counts."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot (got {num_slots})")
        self.num_slots = num_slots
        self._slot_of: dict[bytes, int] = {}
        self._digest_of: list[bytes | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        # Unpinned occupied slots, least recently used first: the next eviction victim.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins = [0] * num_slots
        # The host piece (one host array) each slot's bytes live in, and each piece's slots: a
        # piece stays in host memory while any of its slots is held, so the LRU evicts a slot's
        # whole piece at once (its unpinned slots) instead of leaving the array mostly dead.
        self._piece_of = [-1] * num_slots
        self._pieces: dict[int, list[int]] = {}
        self._next_piece = 0
        # Each slot's bundle (a state snapshot's slots, evicted together), None for a lone block.
        self._bundle_of: list[tuple[int, ...] | None] = [None] * num_slots
        self.stats = HostTierStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_used_slots(self) -> int:
        return len(self._slot_of)

    def slot_of(self, digest: bytes) -> int | None:
        return self._slot_of.get(digest)

    def lru_slots(self) -> list[int]:
        """Unpinned occupied slots, next victim first (tests)."""
        return list(self._lru)

    def match(self, parent: bytes, token_ids: Sequence[int], first_block: int, max_blocks: int,
              block_size: int) -> list[int]:
        """Slots of the longest run of host blocks continuing a prefix (`run`), touched as most
        recently used, last block first (`touch`)."""
        slots = [slot for _, (slot,) in self.run(parent, token_ids, first_block, max_blocks,
                                                  block_size)]
        self.touch(slots[::-1])
        return slots

    def run(self, parent: bytes, token_ids: Sequence[int], first_block: int, max_blocks: int,
            block_size: int, num_groups: int = 1) -> list[tuple[bytes, tuple[int, ...]]]:
        """(digest, slot of each of the first `num_groups` groups' blocks: `block_key`) of the
        longest run of host blocks continuing a prefix: block i (from `first_block`, below
        `max_blocks`) of `token_ids` under the chain starting at `parent` (the digest of the
        blocks before `first_block`)."""
        out = []
        for i in range(first_block, max_blocks):
            parent = block_digest(parent, token_ids[i * block_size:(i + 1) * block_size])
            slots = tuple(self._slot_of.get(block_key(parent, g)) for g in range(num_groups))
            if None in slots:
                break
            out.append((parent, slots))
        return out

    def touch(self, slots: Sequence[int]) -> None:
        """These slots become the most recently used, the last one most (a match touches a
        prefix's blocks last first: its head is evicted last, without it the rest is
        unreachable)."""
        for slot in slots:
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def bundle(self, keys: Sequence[bytes]) -> list[int] | None:
        """The slots of the bundle named `keys` (`state_keys`), None unless the host has it."""
        slots = [self._slot_of.get(k) for k in keys]
        return None if None in slots else slots

    # ---- pins (a planned copy back to the device) ----------------------------------------
    def pin(self, slots: Sequence[int]) -> None:
        for s in slots:
            if self._digest_of[s] is None:
                raise RuntimeError(f"host tier: slot {s} is empty; only held slots can be pinned")
            self._pins[s] += 1
            self._lru.pop(s, None)

    def unpin(self, slots: Sequence[int]) -> None:
        for s in slots:
            if self._pins[s] <= 0:
                raise RuntimeError(f"host tier: slot {s} unpinned more often than pinned")
            self._pins[s] -= 1
            if self._pins[s] == 0:
                if self._digest_of[s] is not None:
                    self._lru[s] = None
                else:  # cleared while pinned (clear()): free only now
                    self._free.append(s)

    # ---- offload (a device block evicted) -------------------------------------------------
    def store(self, digest: bytes) -> int | None:
        """A slot to copy the block of `digest` into, evicting the least recently used unpinned
        block when full; None when the host already has it (nothing to copy: it becomes most
        recently used) or every slot is pinned (the block is dropped, as without a host tier)."""
        slot = self._slot_of.get(digest)
        if slot is not None:
            if slot in self._lru:
                self._lru.move_to_end(slot)
            return None
        if self._free:
            slot = self._free.pop()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            self._evict_piece(slot)
        else:
            return None
        self._slot_of[digest] = slot
        self._digest_of[slot] = digest
        self._piece_of[slot] = -1  # (until its run is grouped)
        self._lru[slot] = None
        self.stats.offloaded_blocks += 1
        return slot

    def store_bundle(self, keys: Sequence[bytes]) -> list[int] | None:
        """Slots to copy the blocks named `keys` into, kept whole or not at all (`store` each);
        None when the host has them already (touched) or cannot make room for all of them (the
        bundle is dropped, as without a host tier)."""
        held = [k in self._slot_of for k in keys]
        if all(held):
            self.touch(self.bundle(keys))
            return None
        # (The LRU's head is older than any slot stored here, so room for all is found first.)
        if any(held) or len(keys) > len(self._free) + len(self._lru):
            return None
        slots = [self.store(k) for k in keys]
        for s in slots:
            self._bundle_of[s] = tuple(slots)
        return slots

    def group(self, slots: Sequence[int]) -> None:
        """These slots' blocks are copied as one host piece: evicted together from now on."""
        pid, self._next_piece = self._next_piece, self._next_piece + 1
        self._pieces[pid] = list(slots)
        for s in slots:  # (a slot named twice in a run: the later piece owns it)
            self._piece_of[s] = pid

    def _evict_piece(self, victim: int) -> None:
        """Drop `victim` (taken off the LRU; its slot is reused by the caller) and the other
        unpinned slots of its piece and of its bundle, and of theirs in turn (to the free
        list). A pinned slot (a load in flight) stays; a bundle is pinned whole."""
        doomed, todo = {victim}, [victim]
        while todo:
            s = todo.pop()
            pid = self._piece_of[s]
            kin = [t for t in self._pieces.pop(pid, []) if self._piece_of[t] == pid]
            for t in kin + list(self._bundle_of[s] or ()):
                if t not in doomed and t in self._lru:
                    doomed.add(t)
                    todo.append(t)
        for s in doomed:
            self._piece_of[s] = -1
            self._bundle_of[s] = None
            if s != victim:
                del self._lru[s]
                self._free.append(s)
            del self._slot_of[self._digest_of[s]]
            self._digest_of[s] = None
            self.stats.evicted_blocks += 1

    def clear(self) -> None:
        """Forget every host block (new weights: their KV is stale). Pins stay counted, so the
        loads in flight still unpin; a pinned slot is not handed out again until then."""
        for slot in list(self._slot_of.values()):
            self._digest_of[slot] = None
            if self._pins[slot] == 0:
                self._free.append(slot)
        self._slot_of.clear()
        self._lru.clear()
        self._piece_of = [-1] * self.num_slots
        self._bundle_of = [None] * self.num_slots
        self._pieces.clear()
