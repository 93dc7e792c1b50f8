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

from typing import Callable, Hashable, Sequence

from jaxinfer.core.kv_cache.block_pool import BlockPool
from jaxinfer.core.kv_cache.host_tier import block_digest, root_digest


class _Node:
    __slots__ = ("key", "block_id", "parent", "children", "digest")

    def __init__(self, key: tuple[int, ...] | None, block_id: int, parent: _Node | None,
                 digest: bytes | None = None):
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.digest = digest  # the host tier's chained name of the prefix (None: no host tier)


class PrefixCache:
    """The radix tree; shares the ``BlockPool`` whose evictable blocks it names."""

    def __init__(self, pool: BlockPool, block_size: int, digests: bool = False):
        """`digests`: name every node by its chained SHA-256 (host_tier.py), for a host tier."""
        self.pool = pool
        self.block_size = block_size
        self.digests = digests
        self._roots: dict[Hashable, _Node] = {}
        self.root = self.root_of(None)
        self._node_of_block: dict[int, _Node] = {}
        # Called with each node the pool evicts (its block's KV still intact until the step that
        # reuses the block): the host tier copies it out. Set by KVCacheManager.
        self.on_drop: Callable[[_Node], None] | None = None
        pool.on_evict = self._on_evict

    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of_block)

    def node_of(self, block_id: int) -> _Node | None:
        return self._node_of_block.get(block_id)

    def root_of(self, namespace: Hashable = None) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(
                None, -1, None, root_digest(namespace) if self.digests else None)
        return root

    def match(self, token_ids: Sequence[int], max_blocks: int,
              namespace: Hashable = None) -> tuple[list[int], _Node]:
        """Longest cached run of whole blocks that prefixes ``token_ids`` under ``namespace``, at
        most ``max_blocks``.

        Returns the block ids (not yet referenced: the caller increfs them) and the deepest node
        matched (the namespace's root when nothing matched)."""
        bs = self.block_size
        node, blocks = self.root_of(namespace), []
        for i in range(max_blocks):
            child = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if child is None:
                break
            blocks.append(child.block_id)
            node = child
        return blocks, node

    def insert(self, parent: _Node, key: tuple[int, ...], block_id: int) -> _Node:
        """Register the held, full ``block_id`` with content ``key`` under ``parent``.

        If ``parent`` already has a child with this content (another request computed the same
        block), that node is returned unchanged; the caller decides what to do with its copy."""
        existing = parent.children.get(key)
        if existing is not None:
            return existing
        if block_id in self._node_of_block:
            raise RuntimeError(f"prefix cache: block {block_id} is already cached under another prefix")
        node = _Node(key, block_id, parent,
                     block_digest(parent.digest, key) if self.digests else None)
        parent.children[key] = node
        self._node_of_block[block_id] = node
        self.pool.mark_cached(block_id)
        return node

    def _on_evict(self, block_id: int) -> None:
        node = self._node_of_block.pop(block_id)
        if node.children:
            raise RuntimeError(f"prefix cache: evicting block {block_id}, which still has cached "
                               f"children (leaf-first invariant broken)")
        del node.parent.children[node.key]
        if self.on_drop is not None:
            self.on_drop(node)

    def clear(self) -> int:
        """Forget every cached block. Unreferenced ones go to the free list (returned: how many);
        referenced ones stay with their holders as ordinary blocks."""
        freed = 0
        for block_id in self._node_of_block:
            freed += self.pool.ref_counts[block_id] == 0
            self.pool.uncache(block_id)
        self._node_of_block.clear()
        self._roots = {}
        self.root = self.root_of(None)
        return freed
