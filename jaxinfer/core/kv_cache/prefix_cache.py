"""Radix tree of token prefixes over full KV-cache blocks (SGLang's RadixAttention idea, at block
granularity).

Each node is one *full* block: its edge key is the tuple of that block's ``block_size`` token ids and
its parent is the block before it, so a node stands for its whole token prefix (the path from the
root) — the same content-chaining a vLLM block hash gets from folding in its parent's hash. Partly
filled blocks are never cached: their content still changes.

Eviction is leaf first, least recently released first. The order comes for free from two facts the
KV-cache manager guarantees:

1. every holder of a cached block also holds all its ancestors (a block table is a path from the
   root: prefix matches, forks and cache insertion all keep it so), hence an unreferenced node has
   only unreferenced descendants;
2. a request releases its blocks last-to-first, so a child enters the pool's evictable LRU before
   its parent, and a prefix hit takes the whole path out of the LRU at once.

So the LRU head is always a leaf; ``_on_evict`` checks it anyway and raises if the invariant breaks.

A *namespace* (a LoRA adapter and its weight version; None for the base model) has a root of its
own, so the same tokens under another namespace never match: their KV differs.
"""

from __future__ import annotations

import dataclasses

from typing import Callable, Hashable, Sequence

from jaxinfer.core.kv_cache.block_pool import BlockPool
from jaxinfer.core.kv_cache.host_tier import block_digest, root_digest
from jaxinfer.core.kv_cache.kv_groups import KVCacheGroups


_ABSENT = -1  # a group's entry in a node whose block was never cached or was evicted


def _entry_blocks(block_ids: list) -> list[int]:
    """The blocks a node's entries name (a snapshot's tuple spread out)."""
    out = []
    for entry in block_ids:
        if isinstance(entry, tuple):
            out.extend(entry)
        elif entry != _ABSENT:
            out.append(entry)
    return out


@dataclasses.dataclass
class PrefixCacheStats:
    """Monotonic counters for metrics, in tokens like vLLM's ``prefix_cache_queries/hits``."""
    requests: int = 0  # get_computed_blocks calls with caching on
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, tokens found cached
    host_hits: int = 0  # of those, tokens found in the host tier past the device match

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hits / self.queries if self.queries else 0.0


class _Node:
    __slots__ = ("key", "block_ids", "parent", "children", "digest")

    def __init__(self, key: tuple[int, ...] | None, block_ids: list[int], parent: _Node | None,
                 digest: bytes | None = None):
        self.key = key
        # Per KV group: the block holding this prefix's last block; for a fixed-state group the
        # tuple of blocks of the state snapshot after it (attach_snapshot).
        self.block_ids = block_ids
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.digest = digest  # the host tier's chained name of the prefix (None: no host tier)

    @property
    def block_id(self) -> int:
        """The first group's block (the only one for a one-group model)."""
        return self.block_ids[0]


class PrefixCache:
    """The radix tree; shares the ``BlockPool`` whose evictable blocks it names.

    With several KV groups (kv_groups.py) a node holds one block per group. Groups whose spec
    keeps every block (full attention, MLA) keep the leaf-first order above. Another group's
    entry may be missing anywhere (its block left the window or chunk of the request that held
    it and was evicted, or was freed before it could be cached; a fixed state's snapshot is taken
    only at some blocks): a match only needs, per such group, the blocks a query at the resume
    point still reads (``match``)."""

    def __init__(self, pool: BlockPool, block_size: int,
                 groups: KVCacheGroups = KVCacheGroups.full_attention(1), digests: bool = False):
        """`digests`: name every node by its chained SHA-256 (host_tier.py), for a host tier."""
        self.pool = pool
        self.block_size = block_size
        self.specs = groups.specs
        self.digests = digests
        self._full = [g for g, spec in enumerate(self.specs) if spec.keeps_every_block]
        self._partial = [g for g, spec in enumerate(self.specs) if not spec.keeps_every_block]
        self.root = self._new_root(None)
        self._roots: dict[Hashable, _Node] = {None: self.root}
        self._node_of_block: dict[int, tuple[_Node, int]] = {}
        # Called with the node, group and entry (a block, or a snapshot's tuple) of every entry
        # the tree drops for an eviction (their KV still intact until the step that reuses the
        # blocks): the host tier copies them out. Set by KVCacheManager, which allows a host
        # tier only where no group frees blocks out of a window.
        self.on_drop: Callable[[_Node, int, int | tuple[int, ...]], None] | None = None
        pool.on_evict = self._on_evict

    def _new_root(self, namespace: Hashable) -> _Node:
        return _Node(None, [_ABSENT] * len(self.specs), None,
                     root_digest(namespace) if self.digests else None)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of_block)

    def node_of(self, block_id: int) -> _Node | None:
        entry = self._node_of_block.get(block_id)
        return None if entry is None else entry[0]

    def entry_of(self, block_id: int) -> tuple[_Node, int] | None:
        """The node and group whose entry holds the cached block (None: not cached)."""
        return self._node_of_block.get(block_id)

    def root_of(self, namespace: Hashable = None) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_root(namespace)
        return root

    def match(self, token_ids: Sequence[int], max_blocks: int,
              namespace: Hashable = None) -> tuple[list[list[int]], _Node, int]:
        """Longest cached prefix of whole blocks of ``token_ids`` under ``namespace`` that every
        group can resume from, at most ``max_blocks``.

        A group keeping every block needs all n blocks; another group needs the blocks from its
        spec's ``first_needed_block`` at token n * block_size on, walked from the right as vLLM's
        SlidingWindowManager does (the blocks before them stay placeholders). Returns per group
        the block ids (placeholders ``_ABSENT`` before that block; not yet referenced: the
        caller increfs the others), the node of block n (the namespace's root when n = 0) and
        n."""
        bs = self.block_size
        path = [self.root_of(namespace)]
        for i in range(max_blocks):
            child = path[-1].children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if child is None:
                break
            path.append(child)
        n = len(path) - 1
        for g in self._full:  # prefix-closed: the first missing block caps n
            n = next((i for i in range(n) if path[i + 1].block_ids[g] == _ABSENT), n)
        while True:  # each other group lowers n to where the blocks it needs are all there
            lowered = n
            for g in self._partial:
                lowered = self._resume(path, g, lowered)
            if lowered == n:
                break
            n = lowered
        blocks = []
        for g, spec in enumerate(self.specs):
            first = spec.first_needed_block(n * bs, bs)
            blocks.append([_ABSENT] * first + [path[i + 1].block_ids[g] for i in range(first, n)])
        return blocks, path[n], n

    def cached_run(self, node: _Node, token_ids: Sequence[int], first_block: int,
                   max_blocks: int) -> list[_Node]:
        """The nodes continuing ``token_ids`` below ``node`` (the node of its first
        ``first_block`` blocks), below ``max_blocks``, while the full groups' blocks are cached:
        what a match left for want of another group's entry."""
        bs, out = self.block_size, []
        for i in range(first_block, max_blocks):
            node = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if node is None or any(node.block_ids[g] == _ABSENT for g in self._full):
                break
            out.append(node)
        return out

    def _resume(self, path: list[_Node], g: int, n: int) -> int:
        """The largest m <= n whose blocks [first(m), m) of group g are all cached."""
        bs = self.block_size
        first_needed = self.specs[g].first_needed_block
        while n > 0:
            first = first_needed(n * bs, bs)
            gap = next((i for i in range(n - 1, first - 1, -1)
                        if path[i + 1].block_ids[g] == _ABSENT), None)
            if gap is None:
                return n
            n = gap  # resuming at the gap block's start needs no block from it onward
        return 0

    def insert(self, parent: _Node, key: tuple[int, ...], block_ids: Sequence[int]) -> _Node:
        """Register the held, full blocks ``block_ids`` (one per group, ``_ABSENT`` for a group
        whose block is gone) with content ``key`` under ``parent``.

        If ``parent`` already has a child with this content, its missing entries are filled from
        ``block_ids`` and its present ones stay; the caller compares them with its own blocks."""
        node = parent.children.get(key)
        if node is None:
            node = _Node(key, [_ABSENT] * len(self.specs), parent,
                         block_digest(parent.digest, key) if self.digests else None)
            parent.children[key] = node
        for g, b in enumerate(block_ids):
            if b != _ABSENT and node.block_ids[g] == _ABSENT:
                if b in self._node_of_block:
                    raise RuntimeError(f"prefix cache: block {b} is already cached under another "
                                       f"prefix")
                node.block_ids[g] = b
                self._node_of_block[b] = (node, g)
                self.pool.mark_cached(b)
        return node

    def attach_snapshot(self, node: _Node, g: int, blocks: Sequence[int]) -> bool:
        """Register the held blocks of a fixed-state group g's snapshot (the state after
        ``node``'s last token) at ``node``; False, changing nothing, when it has one already."""
        if node.block_ids[g] != _ABSENT:
            return False
        node.block_ids[g] = tuple(blocks)
        for b in blocks:
            self._node_of_block[b] = (node, g)
            self.pool.mark_cached(b)
        return True

    def _on_evict(self, block_id: int) -> None:
        node, g = self._node_of_block.pop(block_id)
        entry = node.block_ids[g]
        node.block_ids[g] = _ABSENT
        if self.on_drop is not None:
            self.on_drop(node, g, entry)
        if isinstance(entry, tuple):  # a snapshot is whole or gone: its other blocks go free
            for b in entry:
                if b != block_id:
                    del self._node_of_block[b]
                    self.pool.uncache(b)
        if self.specs[g].keeps_every_block:
            # A full group's block goes leaf first; without it nothing at or below the node can
            # be matched, so the other groups' blocks there are dropped too.
            for child in node.children.values():
                if any(child.block_ids[f] != _ABSENT for f in self._full):
                    raise RuntimeError(f"prefix cache: evicting block {block_id}, which still has "
                                       f"cached children (leaf-first invariant broken)")
            self._drop_subtree(node)
        self._prune(node)

    def _drop_subtree(self, node: _Node) -> None:
        """Uncache every block at or below ``node`` (none is held: a holder of a block also holds
        the full groups' blocks of its prefix, and those are gone) and cut its children off."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for g, entry in enumerate(n.block_ids):
                if entry != _ABSENT and self.on_drop is not None:
                    self.on_drop(n, g, entry)
            for b in _entry_blocks(n.block_ids):
                del self._node_of_block[b]
                self.pool.uncache(b)
        node.children.clear()
        node.block_ids[:] = [_ABSENT] * len(node.block_ids)

    def _prune(self, node: _Node) -> None:
        """Remove ``node`` and empty ancestors that hold no block and have no children."""
        while (node.parent is not None and not node.children
               and all(b == _ABSENT for b in node.block_ids)):
            del node.parent.children[node.key]
            node = node.parent

    def clear(self) -> int:
        """Forget every cached block. Unreferenced ones go to the free list (returned: how many);
        referenced ones stay with their holders as ordinary blocks."""
        freed = 0
        for block_id in self._node_of_block:
            freed += self.pool.ref_counts[block_id] == 0
            self.pool.uncache(block_id)
        self._node_of_block.clear()
        self.root = self._new_root(None)
        self._roots = {None: self.root}
        return freed
